"""The NNX adapter: one walk over the graph writes each layer's policy into the layer itself.

NNX layers are ordinary Python objects whose dtype knobs are read at call
time, so :func:`apply_policy` resolves every module's policy once
(``mpx._src.adapters.layer_policy``) and writes it in place. NNX has no method
interceptor, so a layer that casts at its boundary gets its class swapped for a
cached same-named subclass whose ``__call__`` casts
(``mpx._src.adapters.class_swap``); the subclass is part of
the graph definition and survives ``nnx.split`` / ``nnx.merge``. The same
``__call__`` hands a float32 ``LayerNorm``, ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` in a
half-precision parent to ``mpx._src.adapters.lean_norms``, which computes it
from the layer's own params and statistics. Float8 contractions come from
``mpx._src.adapters.nnx_fp8``. The user-facing account is
:func:`apply_policy`'s docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import linen, nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from mpx._src import casting, errors
from mpx._src import policy as policy_lib
from mpx._src import tree as tree_lib
from mpx._src.adapters import class_swap, layer_policy, lean_norms, nnx_fp8
from mpx._src.adapters import keep as keep_lib

DEFAULT_KEEP_CLASSES: tuple[type, ...] = (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm)
_LEAN_NORM_KINDS: dict[type, str] = {
  nnx.LayerNorm: "layer",
  nnx.RMSNorm: "rms",
  nnx.BatchNorm: "batch",
  nnx.GroupNorm: "group",
}


def _lean_norm_call(module: Any, args: Any, kwargs: Any, dtype: Any) -> Any:
  """One call of an NNX norm through the lean kernels (``None``: run Flax's code)."""

  def set_stats(mean: jax.Array, var: jax.Array) -> None:
    module.mean[...], module.var[...] = mean, var

  return lean_norms.call(
    module,
    module.mpx_lean_norm,
    args,
    kwargs,
    dtype=dtype,
    param=lambda name, shape: getattr(module, name)[...],
    stats=lambda shape: (module.mean[...], module.var[...]),
    set_stats=set_stats,
    call_overrides_attribute=True,
  )


def _call_casting(module: Any, call: Any, args: tuple, kwargs: dict) -> Any:
  """A call of a layer that casts at its boundary (``mpx_boundary``), or is a lean norm."""
  if module.mpx_boundary is None:
    return call(*args, **kwargs)
  inner, outer = module.mpx_boundary
  if getattr(module, "mpx_lean_norm", None) is not None:
    out = _lean_norm_call(module, args, kwargs, outer)
    if out is not None:
      return out
  args, kwargs = casting.cast_tree((args, kwargs), inner)
  return casting.cast_tree(call(*args, **kwargs), outer)


def _new_casting(cls: type, *args: Any) -> Any:
  """Unpickles an instance of ``cls``'s casting subclass."""
  return _CASTING.new(cls, *args)


_CASTING = class_swap.CallSwap("casts_at_boundary", _call_casting, rebuild=_new_casting)


def _check_model(model: Any) -> None:
  """Raises a ``PolicyError`` unless ``model`` is an NNX module."""
  if isinstance(model, nnx.Module):
    return
  if isinstance(model, linen.Module) or isinstance(getattr(model, "module", None), linen.Module):
    raise errors.PolicyError(
      f"mpx.nnx.apply_policy got the linen module {type(model).__name__}; NNX's adapter cannot "
      "reach its layers, so it would train without the policy. Use "
      "mpx.linen.apply_policy(model, policy) and its init/apply for linen models."
    )
  raise errors.PolicyError(
    f"mpx.nnx.apply_policy needs a flax.nnx.Module (the model object), got "
    f"{type(model).__name__}. Build the model first (model = MyModel(rngs=nnx.Rngs(0))) and pass "
    "it; to cast a pytree of arrays, use policy.cast_to_param or mpx.cast_tree."
  )


class _Graph:
  """An NNX model's graph nodes, its modules by path and the path of each module."""

  def __init__(self, model: nnx.Module) -> None:
    self.nodes = list(nnx.iter_graph(model))
    self.modules = {tuple(path): node for path, node in self.nodes if isinstance(node, nnx.Module)}
    self.paths = {id(module): path for path, module in self.modules.items()}

  def owner(self, path: tuple[Any, ...]) -> nnx.Module:
    """The closest module strictly enclosing ``path`` (the root encloses everything)."""
    return next(
      self.modules[path[:n]] for n in range(len(path) - 1, -1, -1) if path[:n] in self.modules
    )

  def parent_of(self, module: nnx.Module) -> nnx.Module | None:
    path = self.paths[id(module)]
    return self.owner(path) if path else None

  def path_of(self, module: nnx.Module) -> str:
    return layer_policy.join_path(self.paths[id(module)])


def _settings(
  policy: policy_lib.Policy,
  rules: keep_lib.KeepRules,
  accumulate_in_float32: bool,
  paths: dict[int, tuple[Any, ...]],
) -> tuple[str, str]:
  """What :func:`apply_policy` writes into a model: ``(policy and accumulation, keep rules)``.

  Strings, so the record is static (part of the graph definition) and survives
  ``nnx.split``/``nnx.merge`` and pickling; instance rules are recorded by the
  layer's path, which is what they mean for this model.
  """
  instances = [
    (layer_policy.join_path(paths[id(m)]) if id(m) in paths else type(m).__name__, str(p))
    for m, p in rules.instances
  ]
  rules_text = f"{dataclasses.replace(rules, instances=())!r} with instance rules {instances}"
  return f"{policy}, accumulate_in_float32={accumulate_in_float32}", rules_text


def _already_applied(model: nnx.Module, settings: tuple[str, str]) -> bool:
  """Whether ``model`` already runs under ``settings``; raises if it runs under others."""
  previous = getattr(model, "mpx_policy", None)
  if previous is None or previous == settings:
    return previous is not None
  change = "it with other keep rules" if previous[0] == settings[0] else settings[0]
  raise errors.PolicyError(
    f"This model already runs under {previous[0]}; applying {change} on top would re-cast "
    "params that the first policy already rounded (half-precision "
    "params cannot be restored to float32 exactly). Build the model again (or nnx.merge a "
    "float32 copy of its state) and apply the policy once, with all its keep rules."
  )


def _configure_module(
  module: nnx.Module,
  layers: layer_policy.LayerPolicies,
  rules: keep_lib.KeepRules,
  accumulate_in_float32: bool,
) -> None:
  """Writes one module's policy into its attributes; swaps its class if it casts at its boundary."""
  policy = layers.policy_at(module)
  layer_policy.configure_layer(
    module,
    policy,
    rules,
    accumulate_in_float32=accumulate_in_float32,
    fields=set(vars(module)),
    default_attention=nnx.dot_product_attention,
    set_field=setattr,
  )
  if policy.fp8 is not None:
    nnx_fp8.configure(module, policy.fp8)
  boundary = layers.boundary(module)
  lean = layers.lean_norm(module, _CASTING.original(type(module)))
  if getattr(module, "promote_dtype", nnx_dtypes.promote_dtype) is not nnx_dtypes.promote_dtype:
    lean = None  # A custom promotion is part of the layer's computation.
  if boundary is not None:
    _CASTING.swap(module)
    # Static strings: the boundary is part of the graph definition.
    module.mpx_boundary = tuple(dtype.name for dtype in boundary)  # pyright: ignore[reportAttributeAccessIssue]
    module.mpx_lean_norm = lean  # pyright: ignore[reportAttributeAccessIssue]
  elif _CASTING.is_swapped(type(module)):
    module.mpx_boundary = module.mpx_lean_norm = None  # pyright: ignore[reportAttributeAccessIssue]


def apply_policy(
  model: nnx.Module,
  policy: Any,
  *,
  rules: keep_lib.KeepRules | None = None,
  accumulate_in_float32: bool = False,
) -> nnx.Module:
  """Sets every layer of an NNX model to a precision policy, in place.

  Every layer computes in ``policy.compute_dtype`` and keeps its params in
  ``policy.param_dtype``, except where ``rules`` give it a policy of its own
  (by default normalisation layers stay in float32; see
  :class:`mpx.KeepRules`); calling the model returns floating outputs in
  ``policy.output_dtype``.

  How: NNX layers read their dtype knobs at call time, so the graph is walked
  once (``nnx.iter_graph``) and each module's policy is written into its own
  attributes:

  * ``dtype`` <- the compute dtype and ``param_dtype`` <- the param dtype,
    wherever the attribute is ``None`` or a floating dtype. This overrides a
    ``dtype=jnp.float32`` (or bfloat16, or float16) given to a layer; pin a
    layer deliberately with a keep rule. Integer ``dtype`` attributes are left
    alone.
  * ``attention_fn`` <- :func:`mpx.dot_product_attention` (a float32 softmax
    between half-precision matmuls), for attention layers left at Flax's
    default, when ``rules.softmax_in_float32`` is set.
  * ``dot_general`` / ``conv_general_dilated`` <- float32-accumulating
    versions (see :func:`mpx.accumulate_in_float32`), with
    ``accumulate_in_float32=True``, for the layers that have these attributes
    (``Linear``, ``LinearGeneral``, ``Conv``...) and leave them at JAX's own.
  * Floating ``nnx.Param`` values are cast to their layer's param dtype. Other
    variables (``BatchStat``, caches, RNG state) are left alone, so the
    statistics of a norm kept in float32 stay float32.
  * With a float8 policy (``policy.fp8``, e.g. ``"mixed_float8"``):
    ``Linear``, ``LinearGeneral`` and ``Einsum`` layers left at Flax's default
    contraction compute it with float8 operands (:func:`mpx.fp8.fp8_dot_general`,
    see ``docs/guide/fp8.md``); with delayed scaling, ``dot_general`` /
    ``einsum_op`` <- an :class:`mpx.nnx.Fp8DotGeneral` /
    :class:`mpx.nnx.Fp8Einsum` holding :class:`mpx.nnx.Fp8History`
    variables, with the leading axes of the layer's kernel when the layer
    was built under ``nnx.vmap`` (so ``nnx.scan`` over the stack gives each
    layer its own). Layers a keep rule gives a policy without ``fp8`` keep
    their dtype.

  Boundaries: the model's floating inputs are cast to its compute dtype and
  its floating outputs to the output dtype. A layer whose compute dtype
  differs from its parent's (a float32 norm in a half-precision model) casts
  its floating inputs to its own compute dtype and its floating outputs back
  to the parent's, so the next matmul still runs in half precision. NNX has no
  method interceptor, so such a layer's class is swapped for a same-named
  subclass whose ``__call__`` casts; it is part of the graph definition, so
  ``nnx.split`` / ``nnx.merge``, ``nnx.jit``, ``nnx.Optimizer`` and the
  lifted transforms (``nnx.vmap``, ``nnx.scan``, ``nnx.remat``) carry it
  along, and ``pickle`` / ``copy.deepcopy`` restore it.

  Lean norms (``rules.lean_norms``, the default): that ``__call__`` computes
  a float32 ``LayerNorm``, ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` in a
  half-precision parent with mpx's kernels, from the layer's own params and statistics
  (updated as Flax updates them): the same float32 arithmetic, an output in
  the parent's compute dtype, and a backward pass that keeps the
  half-precision input and float32 per-row statistics instead of float32
  copies of the activations. Integer inputs (token ids), PRNG keys and NNX objects passed to a call
  (``nnx.Rngs``, modules, variables) are never cast or copied (see
  :func:`mpx.cast_tree`), so RNG counts advance as without a policy.

  Limits: only ``__call__`` casts. The model's other methods (``generate``,
  say) return whatever their layers compute; cast their results with
  ``policy.cast_to_output``. A layer that ignores ``dtype`` (a hand-written
  ``x @ w``) computes in whatever dtype its operands have; :func:`mpx.audit`
  shows such products. A policy is applied once: half-precision params cannot
  be restored to float32 exactly.

  Args:
    model: the NNX model (as written, with or without dtype arguments).
    policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.
    rules: keep rules; ``None`` means ``mpx.KeepRules()``. Class, path
      (``/``-joined attribute path, e.g. ``blocks/0/mlp``) and instance rules
      all apply; a rule covers the matched layer's subtree.
    accumulate_in_float32: make ``Linear``, ``LinearGeneral`` and ``Conv``
      layers request float32 accumulation, forward and backward.

  Returns:
    ``model`` itself, for chaining.

  Raises:
    PolicyError: ``model`` is not an NNX module (a linen module, a dict of
      params, ``None``), or it already runs under a different policy, keep
      rules or ``accumulate_in_float32``. Applying the same settings again
      returns ``model`` unchanged.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> from flax import linen, nnx
    >>> model = mpx.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    >>> model.kernel.dtype, model(jnp.ones((2, 4))).dtype
    (dtype('float32'), dtype('float32'))
  """
  _check_model(model)
  policy = policy_lib.get_policy(policy)
  rules = keep_lib.KeepRules() if rules is None else rules
  graph = _Graph(model)
  settings = _settings(policy, rules, accumulate_in_float32, graph.paths)
  if _already_applied(model, settings):
    return model
  layers = layer_policy.LayerPolicies(
    policy,
    rules,
    norm_classes=DEFAULT_KEEP_CLASSES,
    parent_of=graph.parent_of,
    path_of=graph.path_of,
    lean_norm_kinds=_LEAN_NORM_KINDS,
  )
  for module in graph.modules.values():
    _configure_module(module, layers, rules, accumulate_in_float32)
  for path, node in graph.nodes:
    if isinstance(node, nnx.Param) and tree_lib.is_floating_array(node.get_value()):
      param_dtype = layers.policy_at(graph.owner(tuple(path))).param_dtype
      node.set_value(casting.cast_tree(node.get_value(), param_dtype))
  model.mpx_policy = settings  # pyright: ignore[reportAttributeAccessIssue]
  layers.warn_unmatched_paths(stacklevel=2)
  return model
