"""The policy of each layer of a Flax model: one resolver for the linen and NNX adapters.

Both adapters see a model as a tree of layers and ask it the same three
questions, answered here once:

* which policy a layer runs under (:meth:`LayerPolicies.policy_at`): its own
  keep rule, else its parent's policy, else the model's;
* whether its calls cast (:meth:`LayerPolicies.boundary`): the root always
  does (inputs to its compute dtype, outputs to the model's output dtype), and
  so does a layer whose compute dtype differs from its parent's (outputs back
  to the parent's compute dtype);
* which of its dtype knobs receive that policy (:func:`configure_layer`);
* whether a float32 normalisation layer in a half-precision parent runs the
  lean kernels instead of Flax's code (:meth:`LayerPolicies.lean_norm`).

The adapters differ only in how a layer's parent and path are found (a linen
module knows both; NNX modules are found by walking the graph) and in how a
field is written (a linen module is a frozen dataclass), which they pass in.
Flax is not imported here.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import policy as policy_lib
from mpx._src.adapters import keep as keep_lib
from mpx._src.ops import attention, kernels

FLOAT32 = policy_lib.get_policy("float32")


def join_path(parts: Iterable[Any]) -> str:
  """Joins module path parts into the string that path rules and messages use.

  Args:
    parts: linen's ``module.path`` or an NNX graph path, e.g.
      ``("blocks", 0, "mlp")``.

  Returns:
    The parts joined with ``/``, e.g. ``"blocks/0/mlp"``; ``""`` for the root.
  """
  return "/".join(str(p) for p in parts)


class LayerPolicies:
  """Resolves and caches the policy of every layer of one model.

  Args:
    policy: the model's policy.
    rules: the keep rules.
    norm_classes: the normalisation layer classes of the Flax API in use, kept
      in float32 when ``rules.norms_in_float32`` is set.
    parent_of: returns a layer's enclosing layer, ``None`` for the root.
    path_of: returns a layer's ``/``-joined module path.
    lean_norm_kinds: the Flax API's normalisation classes the lean kernels
      compute, each with its kind (``mpx._src.adapters.lean_norms.KINDS``).
  """

  def __init__(
    self,
    policy: policy_lib.Policy,
    rules: keep_lib.KeepRules,
    *,
    norm_classes: tuple[type, ...],
    parent_of: Callable[[Any], Any],
    path_of: Callable[[Any], str],
    lean_norm_kinds: Mapping[type, str] | None = None,
  ) -> None:
    self.policy = policy
    self.rules = rules
    self._norm_classes = norm_classes if rules.norms_in_float32 else ()
    self._lean_norm_kinds = dict(lean_norm_kinds or {}) if rules.lean_norms else {}
    self._parent_of = parent_of
    self._path_of = path_of
    # Keyed by path: linen builds several short-lived copies of a layer per call.
    self._resolved: dict[str, policy_lib.Policy] = {}
    self._matched: set[str] = set()
    self._seen: set[str] = set()

  def _own_policy(self, module: Any, path: str) -> policy_lib.Policy | None:
    """The policy a rule gives ``module`` itself, or ``None`` when no rule names it."""
    by_path = None
    for pattern, policy in self.rules.paths:
      if re.search(pattern, path):
        by_path = policy
        self._matched.add(pattern)
    for obj, policy in reversed(self.rules.instances):
      if obj is module:
        return policy
    if by_path is not None:
      return by_path
    for cls, policy in reversed(self.rules.classes):
      if isinstance(module, cls):
        return policy
    return FLOAT32 if isinstance(module, self._norm_classes) else None

  def policy_at(self, module: Any) -> policy_lib.Policy:
    """Returns the policy ``module`` runs under.

    Args:
      module: a layer of the model.

    Returns:
      Its keep rule's policy, else its parent's policy, else the model's.
    """
    path = self._path_of(module)
    if path not in self._resolved:
      self._seen.add(path)
      own = self._own_policy(module, path)
      if own is None:
        parent = self._parent_of(module)
        own = self.policy if parent is None else self.policy_at(parent)
      self._resolved[path] = own
    return self._resolved[path]

  def boundary(self, module: Any) -> tuple[np.dtype, np.dtype] | None:
    """Returns the dtypes a call of ``module`` casts to, or ``None`` when it does not cast.

    Args:
      module: a layer of the model.

    Returns:
      ``(inner, outer)``: floating inputs are cast to ``inner`` (the layer's
      compute dtype) and floating outputs to ``outer`` (the parent's compute
      dtype, or the model's output dtype at the root). ``None`` for a layer
      that computes in its parent's compute dtype.
    """
    inner = np.dtype(self.policy_at(module).compute_dtype)
    parent = self._parent_of(module)
    if parent is None:
      return inner, np.dtype(self.policy.output_dtype)
    outer = np.dtype(self.policy_at(parent).compute_dtype)
    return None if outer == inner else (inner, outer)

  def lean_norm(self, module: Any, cls: type | None = None) -> str | None:
    """Returns the lean kernel kind that computes ``module``'s calls, or ``None`` for Flax's code.

    Args:
      module: a layer of the model.
      cls: the layer's Flax class, when ``type(module)`` is an adapter's
        subclass of it; ``None`` means ``type(module)``.

    Returns:
      ``"layer"``, ``"rms"`` or ``"batch"`` for a layer of exactly one of the
      ``lean_norm_kinds`` classes that computes in float32 inside a parent
      with a half-precision compute dtype, when ``rules.lean_norms`` is set;
      else ``None``.
    """
    kind = self._lean_norm_kinds.get(type(module) if cls is None else cls)
    boundary = self.boundary(module) if kind is not None else None
    if boundary is None:
      return None
    inner, outer = boundary
    return kind if inner == np.dtype(np.float32) and dtypes_lib.is_half(outer) else None

  def warn_unmatched_paths(self, *, stacklevel: int) -> None:
    """Warns about path rules that matched none of the layers resolved so far.

    Args:
      stacklevel: as for ``warnings.warn``, counted from the caller.

    Raises:
      PrecisionWarning: (as a warning) one per pattern that matched nothing,
        listing the model's module paths.
    """
    paths = ", ".join(sorted(p for p in self._seen if p)) or "(none)"
    for pattern, policy in self.rules.paths:
      if pattern not in self._matched:
        warnings.warn(
          f"The path rule {pattern!r} -> {policy} matched no layer, so no layer was pinned "
          f"by it. The model's module paths are: {paths}.",
          errors.PrecisionWarning,
          stacklevel=stacklevel + 1,
        )


def _floating_or_none(value: Any) -> bool:
  return value is None or dtypes_lib.is_floating(value)


def configure_layer(
  module: Any,
  policy: policy_lib.Policy,
  rules: keep_lib.KeepRules,
  *,
  accumulate_in_float32: bool,
  fields: set[str],
  default_attention: Any,
  set_field: Callable[[Any, str, Any], None],
) -> None:
  """Writes ``policy`` into the dtype knobs a Flax layer has.

  ``dtype`` and ``param_dtype`` are set when they are ``None`` or a floating
  dtype (an integer "dtype" field means something else); ``attention_fn`` when
  it is Flax's default and the rules ask for a float32 softmax; ``dot_general``
  and ``conv_general_dilated`` when they are unset or JAX's own and
  ``accumulate_in_float32`` is asked for.

  Args:
    module: the layer (a private linen copy, or an NNX module).
    policy: the policy the layer runs under.
    rules: the keep rules (for the softmax switch).
    accumulate_in_float32: install float32-accumulating matmuls.
    fields: the names of the layer's attributes.
    default_attention: Flax's default attention function for this API.
    set_field: writes one attribute of the layer.
  """
  for name, value in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
    if name in fields and _floating_or_none(getattr(module, name)):
      set_field(module, name, value)
  if (
    rules.softmax_in_float32
    and "attention_fn" in fields
    and module.attention_fn is default_attention
  ):
    set_field(module, "attention_fn", attention.dot_product_attention)
  if accumulate_in_float32:
    for name, wrapped in (
      ("dot_general", kernels.dot_general_f32_accumulation),
      ("conv_general_dilated", kernels.conv_general_dilated_f32_accumulation),
    ):
      if name in fields and getattr(module, name) in (
        None,
        jax.lax.dot_general,
        jax.lax.conv_general_dilated,
      ):
        set_field(module, name, wrapped)
