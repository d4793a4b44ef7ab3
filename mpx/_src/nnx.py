"""Applying a precision policy to a Flax NNX graph, in place.

NNX layers are ordinary Python objects whose dtype knobs (``dtype``,
``param_dtype``, ``attention_fn``, ``dot_general``, ``conv_general_dilated``)
are read at call time, so :func:`apply_policy` walks the graph once
(``nnx.iter_graph``) and writes each layer's resolved policy into them, exactly
as the linen integration does on linen's per-call copies. Params (``nnx.Param``)
are cast to their layer's param dtype; other variables (e.g. ``BatchStat``)
are left alone, so norm statistics stay float32.

Policy boundaries (the root, and every layer whose policy differs from its
parent's) need their inputs and outputs cast. NNX has no method interceptor,
so such a layer's class is swapped for a cached subclass of the same name
whose ``__call__`` casts floating inputs to the layer's compute dtype and
floating outputs to the parent's compute dtype (the root's: the output dtype).
The subclass is part of the graph definition, so ``nnx.split`` / ``nnx.merge``,
``nnx.jit`` and ``nnx.Optimizer`` carry it along; the casting dtypes are
static strings on the layer. The model's other methods (e.g. ``generate``)
are not wrapped: cast their outputs with ``policy.cast_to_output``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from mpx._src import casting, errors
from mpx._src import keep as keep_lib
from mpx._src import policy as policy_lib
from mpx._src import tree as tree_lib

_BOUNDARY_CLASSES: dict[type, type] = {}


def _boundary_class(cls: type) -> type:
  """Returns the cached same-named subclass of ``cls`` that casts at its boundary."""
  if getattr(cls, "_mpx_casts_at_boundary", False):
    return cls
  if cls not in _BOUNDARY_CLASSES:

    def call_casting(self: Any, *args: Any, **kwargs: Any) -> Any:
      call: Any = super(subclass, self).__call__  # type: ignore[misc]
      if self.mpx_boundary is None:
        return call(*args, **kwargs)
      inner, outer = self.mpx_boundary
      args, kwargs = casting.cast_tree((args, kwargs), inner)
      return casting.cast_tree(call(*args, **kwargs), outer)

    # A mixin base would change the instance layout and forbid the swap.
    subclass = type(
      cls.__name__,
      (cls,),
      {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__call__": call_casting,
        "_mpx_casts_at_boundary": True,
      },
    )
    _BOUNDARY_CLASSES[cls] = subclass
  return _BOUNDARY_CLASSES[cls]


def _key(path: tuple[Any, ...]) -> str:
  return "/".join(str(p) for p in path)


def apply_policy(
  model: nnx.Module,
  policy: Any,
  *,
  rules: keep_lib.KeepRules | None = None,
  accumulate_in_float32: bool = False,
) -> nnx.Module:
  """Sets every layer of an NNX model to a precision policy, in place.

  Every layer computes in ``policy.compute_dtype`` and keeps its params in
  ``policy.param_dtype`` (existing ``nnx.Param`` values are cast), except
  where ``rules`` say otherwise (by default normalization layers stay float32
  and attention softmax runs in float32); calling the model returns floating
  outputs in ``policy.output_dtype``. Integer inputs stay integer.

  Args:
    model: the NNX model (as written, with or without dtype arguments).
    policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.
    rules: keep rules; ``None`` means ``mpx.KeepRules()``. Class, path
      (``/``-joined attribute path, e.g. ``blocks/0/mlp``) and instance rules
      all apply; a rule covers the matched layer's subtree.
    accumulate_in_float32: make ``Linear``, ``LinearGeneral`` and ``Conv``
      layers request float32 accumulation (see :func:`mpx.accumulate_in_float32`).

  Returns:
    ``model`` itself, for chaining.

  Raises:
    PolicyError: the model already runs under a different policy.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> from flax import nnx
    >>> model = mpx.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    >>> model.kernel.dtype, model(jnp.ones((2, 4))).dtype
    (dtype('float32'), dtype('float32'))
  """
  policy = policy_lib.get_policy(policy)
  rules = keep_lib.KeepRules() if rules is None else rules
  settings = f"{policy};accumulate_in_float32={accumulate_in_float32}"
  previous = getattr(model, "mpx_policy", None)
  if previous is not None and previous != settings:
    raise errors.PolicyError(
      f"This model already runs under {previous}; applying {settings} on top would "
      "conflict (half params cannot be restored to float32 exactly). Build the model again "
      "(or nnx.merge a float32 copy) and apply the policy once."
    )

  nodes = list(nnx.iter_graph(model))
  modules = {_key(p): m for p, m in nodes if isinstance(m, nnx.Module)}
  matched: set[str] = set()
  resolved: dict[str, policy_lib.Policy] = {}

  def policy_at(path: str) -> policy_lib.Policy:
    if path not in resolved:
      own = rules.own_policy(modules[path], path, matched)
      if own is None and path:
        own = policy_at(_parent(path, modules))
      resolved[path] = own or policy
    return resolved[path]

  for path, module in modules.items():
    own = policy_at(path)
    keep_lib.configure_layer(
      module,
      own,
      rules,
      accumulate_in_float32=accumulate_in_float32,
      fields=set(vars(module)),
      default_attention=nnx.dot_product_attention,
    )
    outer = policy_at(_parent(path, modules)).compute_dtype if path else policy.output_dtype
    if not path or outer != own.compute_dtype:
      object.__setattr__(module, "__class__", _boundary_class(type(module)))
      module.mpx_boundary = np.dtype(own.compute_dtype).name, np.dtype(outer).name  # pyright: ignore[reportAttributeAccessIssue]
    elif getattr(module, "_mpx_casts_at_boundary", False):
      module.mpx_boundary = None  # pyright: ignore[reportAttributeAccessIssue]

  for path, node in nodes:
    if isinstance(node, nnx.Param) and tree_lib.is_floating_array(node.get_value()):
      owner = _parent(_key(path), modules)
      node.set_value(casting.cast_tree(node.get_value(), policy_at(owner).param_dtype))

  model.mpx_policy = settings  # pyright: ignore[reportAttributeAccessIssue]
  keep_lib.check_paths_matched(rules, matched, modules)
  return model


def _parent(path: str, modules: dict[str, Any]) -> str:
  """Returns the path of the closest enclosing module of ``path``."""
  parts = path.split("/")
  for n in range(len(parts) - 1, 0, -1):
    candidate = "/".join(parts[:n])
    if candidate in modules:
      return candidate
  return ""
