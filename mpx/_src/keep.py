"""Keep-in-float32 rules shared by the linen and NNX integrations.

Paper section 3 keeps three things out of half precision: the master weights,
the reductions (normalization statistics, softmax) and the accumulation of
products. A :class:`KeepRules` says which layers run under which policy:

* by **class**: the defaults pin every normalization layer of linen and NNX
  (``BatchNorm``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm``) to float32 params,
  statistics and compute (seed 002's "black list", Apex O1);
* by **path**: a regular expression searched in the module path
  (``"Decoder_0/head"``), like Keras' ``DTypePolicyMap``;
* by **instance** (NNX only: a linen module is cloned on every ``init`` /
  ``apply``, so its identity does not survive; pin it by path instead).

A rule applies to the matched layer and to everything below it, so one rule
gives a whole subtree its own policy (e.g. an embedding in float32). Among
rules of one kind the last matching one wins; an instance rule beats a path
rule, which beats a class rule. When a layer's policy differs from its
parent's, its floating inputs are cast to its compute dtype and its floating
outputs back to the parent's compute dtype, so a float32 norm does not make
the next matmul run in float32.

The float32 kernels that a rule cannot reach by setting a layer's ``dtype``
(softmax inside attention, float32 accumulation) live in
``mpx._src.kernels``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors, kernels
from mpx._src import policy as policy_lib

PolicyLike = Any

FLOAT32 = policy_lib.get_policy("float32")

DEFAULT_KEEP_CLASSES: tuple[type, ...] = (
  nn.BatchNorm,
  nn.LayerNorm,
  nn.RMSNorm,
  nn.GroupNorm,
  nnx.BatchNorm,
  nnx.LayerNorm,
  nnx.RMSNorm,
  nnx.GroupNorm,
)


def _pairs(rules: Mapping[Any, PolicyLike] | Iterable[tuple[Any, PolicyLike]]) -> tuple:
  items = rules.items() if isinstance(rules, Mapping) else rules
  return tuple((key, policy_lib.get_policy(value)) for key, value in items)


@dataclasses.dataclass(frozen=True)
class KeepRules:
  """Which layers keep their own policy instead of the model's.

  Attributes:
    classes: ``(layer class, policy)`` pairs; a layer matches by
      ``isinstance``. Defaults to every class in ``DEFAULT_KEEP_CLASSES``
      pinned to float32.
    paths: ``(regular expression, policy)`` pairs; a layer matches when
      ``re.search`` finds the pattern in its ``/``-joined module path (anchor
      with ``^...$`` for an exact path).
    instances: ``(module object, policy)`` pairs, matched by identity (NNX).
    softmax_in_float32: give Flax attention layers left at the default
      attention function :func:`dot_product_attention` instead, whose softmax
      runs in float32.

  Mappings are accepted for the three rule fields and stored as tuples.

  Example:
    >>> import flax.linen as nn, mpx
    >>> rules = mpx.KeepRules().with_class(nn.Embed, "float32").with_path("head$", "float32")
    >>> [p for p, _ in rules.paths]
    ['head$']
  """

  classes: Any = dataclasses.field(
    default_factory=lambda: tuple((cls, FLOAT32) for cls in DEFAULT_KEEP_CLASSES)
  )
  paths: Any = ()
  instances: Any = ()
  softmax_in_float32: bool = True

  def __post_init__(self) -> None:
    object.__setattr__(self, "classes", _pairs(self.classes))
    object.__setattr__(self, "paths", _pairs(self.paths))
    object.__setattr__(self, "instances", _pairs(self.instances))
    for cls, _ in self.classes:
      if not isinstance(cls, type):
        raise errors.PolicyError(
          f"A class rule needs a layer class, got {cls!r}; write e.g. "
          "KeepRules().with_class(nn.Embed, 'float32')."
        )
    for pattern, _ in self.paths:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise errors.PolicyError(
          f"The path rule {pattern!r} is not a valid regular expression ({e}). Write a "
          r"pattern over '/'-joined module paths such as r'^Decoder_0/head$'."
        ) from None

  def with_class(self, cls: type, policy: PolicyLike) -> KeepRules:
    """Returns these rules plus (overriding) a class rule."""
    kept = tuple((c, p) for c, p in self.classes if c is not cls)
    return dataclasses.replace(self, classes=(*kept, (cls, policy)))

  def without_class(self, cls: type) -> KeepRules:
    """Returns these rules with the class rule for ``cls`` removed."""
    return dataclasses.replace(self, classes=tuple((c, p) for c, p in self.classes if c is not cls))

  def with_path(self, pattern: str, policy: PolicyLike) -> KeepRules:
    """Returns these rules plus a path rule (later rules win)."""
    return dataclasses.replace(self, paths=(*self.paths, (pattern, policy)))

  def with_instance(self, module: Any, policy: PolicyLike) -> KeepRules:
    """Returns these rules plus a rule for one module object (NNX)."""
    return dataclasses.replace(self, instances=(*self.instances, (module, policy)))

  def own_policy(self, module: Any, path: str, matched: set[str] | None = None) -> Any:
    """Returns the policy a rule gives ``module`` itself, or ``None``.

    Args:
      module: the layer.
      path: its ``/``-joined module path.
      matched: if given, the path patterns that match are added to it (for the
        warning about rules that match nothing).

    Returns:
      The :class:`~mpx.Policy` of the winning rule, or ``None`` when no rule
      names this layer (it then inherits its parent's policy).
    """
    for obj, policy in reversed(self.instances):
      if obj is module:
        return policy
    found = None
    for pattern, policy in self.paths:
      if re.search(pattern, path):
        found = policy
        if matched is not None:
          matched.add(pattern)
    if found is not None:
      return found
    for cls, policy in reversed(self.classes):
      if isinstance(module, cls):
        return policy
    return None


def check_paths_matched(rules: KeepRules, matched: set[str], seen: Iterable[str]) -> None:
  """Warns about path rules that matched no layer, listing the paths there are.

  Args:
    rules: the rules that were applied.
    matched: the patterns that matched at least one layer.
    seen: every module path of the model.

  Raises:
    PrecisionWarning: (as a warning) one per pattern that matched nothing.
  """
  paths = sorted({p for p in seen if p})
  for pattern, policy in rules.paths:
    if pattern not in matched:
      warnings.warn(
        f"The path rule {pattern!r} -> {policy} matched no layer, so no layer was pinned by "
        f"it. The model's module paths are: {', '.join(paths) or '(none)'}.",
        errors.PrecisionWarning,
        stacklevel=3,
      )


def _floating_or_none(value: Any) -> bool:
  return value is None or dtypes_lib.is_floating(value)


def _set_field(module: nn.Module, name: str, value: Any) -> None:
  # Linen modules are frozen dataclasses; this copy is private to one call.
  object.__setattr__(module, name, value)


def configure_layer(
  module: Any,
  policy: policy_lib.Policy,
  rules: KeepRules,
  *,
  accumulate_in_float32: bool,
  fields: Any,
  default_attention: Any,
) -> None:
  """Writes ``policy`` into the dtype knobs a Flax layer has (linen or NNX).

  Args:
    module: the layer (a private linen copy, or an NNX module).
    policy: the layer's resolved policy.
    rules: the keep rules (for the softmax switch).
    accumulate_in_float32: install float32-accumulating matmuls.
    fields: the names of the layer's attributes.
    default_attention: Flax's default attention function for this API.
  """
  setter = _set_field if isinstance(module, nn.Module) else setattr
  for name, value in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
    if name in fields and _floating_or_none(getattr(module, name)):
      setter(module, name, value)
  if (
    rules.softmax_in_float32
    and "attention_fn" in fields
    and module.attention_fn is default_attention
  ):
    setter(module, "attention_fn", kernels.dot_product_attention)
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
        setter(module, name, wrapped)
