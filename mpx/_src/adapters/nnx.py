"""The NNX adapter: one walk over the graph writes each layer's policy into the layer itself.

NNX layers are ordinary Python objects whose dtype knobs are read at call
time, so :func:`apply_policy` resolves every module's policy once
(``mpx._src.adapters.layer_policy``) and writes it in place. NNX has no method
interceptor, so a layer that casts at its boundary gets its class swapped for a
cached same-named subclass whose ``__call__`` casts; the subclass is part of
the graph definition and survives ``nnx.split`` / ``nnx.merge``. The same
``__call__`` hands a float32 ``LayerNorm``, ``RMSNorm`` or ``BatchNorm`` in a
half-precision parent to ``mpx._src.adapters.lean_norms``, which computes it from the
layer's own params and statistics. The user-facing account is
:func:`apply_policy`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from mpx._src import casting, errors
from mpx._src import policy as policy_lib
from mpx._src import recipe as recipe_lib
from mpx._src import tree as tree_lib
from mpx._src.adapters import keep as keep_lib
from mpx._src.adapters import layer_policy
from mpx._src.adapters import lean_norms as norm_layers
from mpx._src.ops import fp8 as fp8_lib
from mpx._src.ops import kernels

DEFAULT_KEEP_CLASSES: tuple[type, ...] = (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm)
_LEAN_NORM_KINDS: dict[type, str] = {
  nnx.LayerNorm: "layer",
  nnx.RMSNorm: "rms",
  nnx.BatchNorm: "batch",
}

_BOUNDARY_CLASSES: dict[type, type] = {}


class Fp8History(nnx.Variable):
  """One tensor's amax history for delayed fp8 scaling: ``float32[history_length + 1]``.

  A layer of an ``nnx.vmap`` stack has one per layer: ``float32[layers, history_length + 1]``.

  ``[pending, most recent, ..., oldest]``; see :func:`mpx.update_fp8_state`.
  Select them with ``nnx.split(model, nnx.Param, mpx.nnx.Fp8History, ...)``.
  """


def _delayed_dot(module: Fp8DotGeneral, *args: Any, **kwargs: Any) -> jax.Array:
  state = (module.lhs[...], module.rhs[...], module.grad[...])
  return fp8_lib.fp8_dot_general(*args, **kwargs, recipe=module.recipe, state=state)


class Fp8DotGeneral(nnx.Module):
  """A ``dot_general`` with float8 operands whose delayed-scaling state is NNX variables.

  :func:`apply_policy` installs one as the ``dot_general`` of each ``Linear``
  and ``LinearGeneral`` under a policy with a delayed :class:`mpx.Fp8Recipe`,
  with three :class:`Fp8History` variables: ``lhs``, ``rhs`` and ``grad``.

  Args:
    recipe: the delayed-scaling recipe.
    batch_shape: the leading axes of the layer's stack (``(layers,)`` for a
      layer built under ``nnx.vmap``), so that ``nnx.scan`` over the stack
      hands each layer its own histories.
  """

  def __init__(self, recipe: recipe_lib.Fp8Recipe, *, batch_shape: tuple[int, ...] = ()) -> None:
    self.recipe = recipe
    self.lhs = Fp8History(fp8_lib.init_history(recipe, batch_shape=batch_shape))
    self.rhs = Fp8History(fp8_lib.init_history(recipe, batch_shape=batch_shape))
    self.grad = Fp8History(fp8_lib.init_history(recipe, batch_shape=batch_shape))

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """Computes :func:`mpx.fp8_dot_general` with this layer's histories.

    Args:
      *args: as for ``jax.lax.dot_general``.
      **kwargs: as for ``jax.lax.dot_general``.

    Returns:
      The product.
    """
    return _delayed_dot(self, *args, **kwargs)


class Fp8Einsum(Fp8DotGeneral):
  """An ``einsum_op`` for ``nnx.Einsum`` whose contraction is :class:`Fp8DotGeneral`'s."""

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """``jnp.einsum`` with this layer's float8 ``dot_general``.

    Args:
      *args: as for ``jnp.einsum``.
      **kwargs: as for ``jnp.einsum``.

    Returns:
      The contraction.
    """
    return jnp.einsum(*args, **kwargs, _dot_general=functools.partial(_delayed_dot, self))


_REPLACEABLE_DOTS = (None, jax.lax.dot_general, kernels.dot_general_f32_accumulation)


def _stack_shape(module: nnx.Module) -> tuple[int, ...]:
  """The leading axes of a ``Linear``, ``LinearGeneral`` or ``Einsum`` built under ``nnx.vmap``.

  ``nnx.vmap`` stacks the kernel but leaves the layer's static fields as one
  layer's, so the axes the kernel has beyond what those fields give are the
  stack's. ``()`` for a layer built alone, or inside the vmapped constructor.
  """
  if "kernel_shape" in vars(module):  # Einsum
    ndim = len(module.kernel_shape)  # pyright: ignore[reportAttributeAccessIssue]
  elif "batch_axis" in vars(module):  # LinearGeneral
    fields: Any = module
    ndim = len(fields.batch_axis) + len(fields.in_features) + len(fields.out_features)
  else:  # Linear
    ndim = 2
  shape = module.kernel.shape  # pyright: ignore[reportAttributeAccessIssue]
  return tuple(shape[: len(shape) - ndim])


def _configure_fp8(module: nnx.Module, recipe: recipe_lib.Fp8Recipe) -> None:
  """Gives a ``Linear``, ``LinearGeneral`` or ``Einsum`` a float8 contraction (not if customised)."""
  fields = vars(module)
  if recipe.attention and fields.get("attention_fn") is kernels.dot_product_attention:
    dot = functools.partial(fp8_lib.fp8_dot_general, recipe=recipe.for_attention())
    fn = functools.partial(kernels.dot_product_attention, dot_general=dot)
    module.attention_fn = fn  # pyright: ignore[reportAttributeAccessIssue]
  if "dot_general" in fields and fields["dot_general"] in _REPLACEABLE_DOTS:
    if fields.get("dot_general_cls") is not None:
      return
    if recipe.delayed:
      dot = Fp8DotGeneral(recipe, batch_shape=_stack_shape(module))
      module.dot_general = nnx.data(dot)  # pyright: ignore[reportAttributeAccessIssue]
    else:
      module.dot_general = functools.partial(fp8_lib.fp8_dot_general, recipe=recipe)  # pyright: ignore[reportAttributeAccessIssue]
  elif fields.get("einsum_op") is jnp.einsum:
    if recipe.delayed:
      einsum = Fp8Einsum(recipe, batch_shape=_stack_shape(module))
      module.einsum_op = nnx.data(einsum)  # pyright: ignore[reportAttributeAccessIssue]
    else:
      dot = functools.partial(fp8_lib.fp8_dot_general, recipe=recipe)
      module.einsum_op = functools.partial(jnp.einsum, _dot_general=dot)  # pyright: ignore[reportAttributeAccessIssue]


def _flax_class(module: nnx.Module) -> type:
  """The class of ``module`` before :func:`apply_policy` swapped in its casting subclass."""
  cls = type(module)
  return cls.__mro__[1] if getattr(cls, "_mpx_casts_at_boundary", False) else cls


def _lean_norm_call(module: Any, args: Any, kwargs: Any, dtype: Any) -> Any:
  """One call of an NNX norm through the lean kernels (``None``: run Flax's code)."""

  def set_stats(mean: jax.Array, var: jax.Array) -> None:
    module.mean[...], module.var[...] = mean, var

  return norm_layers.call(
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
      if getattr(self, "mpx_lean_norm", None) is not None:
        out = _lean_norm_call(self, args, kwargs, outer)
        if out is not None:
          return out
      args, kwargs = casting.cast_tree((args, kwargs), inner)
      return casting.cast_tree(call(*args, **kwargs), outer)

    def reduce_ex(self: Any, protocol: Any) -> Any:
      # Pickle finds a class by its name, which leads to `cls`, not to this subclass: store
      # `cls` and rebuild the subclass from it on loading (`_new_casting`).
      _, (_, *new_args), *rest = super(subclass, self).__reduce_ex__(protocol)
      return (_new_casting, (cls, *new_args), *rest)

    # A mixin base would change the instance layout and forbid the swap.
    subclass = type(
      cls.__name__,
      (cls,),
      {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__call__": call_casting,
        "__reduce_ex__": reduce_ex,
        "_mpx_casts_at_boundary": True,
      },
    )
    _BOUNDARY_CLASSES[cls] = subclass
  return _BOUNDARY_CLASSES[cls]


def _new_casting(cls: type, *args: Any) -> Any:
  """Unpickles an instance of ``cls``'s casting subclass (see ``_boundary_class``)."""
  subclass = _boundary_class(cls)
  return subclass.__new__(subclass, *args)


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
    contraction compute it with float8 operands (:func:`mpx.fp8_dot_general`,
    see ``docs/fp8.md``); with delayed scaling, ``dot_general`` /
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
  a float32 ``LayerNorm``, ``RMSNorm`` or ``BatchNorm`` in a half-precision
  parent with mpx's kernels, from the layer's own params and statistics
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
  nodes = list(nnx.iter_graph(model))
  modules = {tuple(path): node for path, node in nodes if isinstance(node, nnx.Module)}
  paths = {id(module): path for path, module in modules.items()}
  settings = _settings(policy, rules, accumulate_in_float32, paths)
  previous = getattr(model, "mpx_policy", None)
  if previous == settings:
    return model
  if previous is not None:
    change = "it with other keep rules" if previous[0] == settings[0] else settings[0]
    raise errors.PolicyError(
      f"This model already runs under {previous[0]}; applying {change} on top would re-cast "
      "params that the first policy already rounded (half-precision "
      "params cannot be restored to float32 exactly). Build the model again (or nnx.merge a "
      "float32 copy of its state) and apply the policy once, with all its keep rules."
    )

  def owner(path: tuple[Any, ...]) -> nnx.Module:
    """The closest module strictly enclosing ``path`` (the root encloses everything)."""
    return next(modules[path[:n]] for n in range(len(path) - 1, -1, -1) if path[:n] in modules)

  def parent_of(module: nnx.Module) -> nnx.Module | None:
    path = paths[id(module)]
    return owner(path) if path else None

  layers = layer_policy.LayerPolicies(
    policy,
    rules,
    norm_classes=DEFAULT_KEEP_CLASSES,
    parent_of=parent_of,
    path_of=lambda module: layer_policy.join_path(paths[id(module)]),
    lean_norm_kinds=_LEAN_NORM_KINDS,
  )
  for module in modules.values():
    policy_here = layers.policy_at(module)
    layer_policy.configure_layer(
      module,
      policy_here,
      rules,
      accumulate_in_float32=accumulate_in_float32,
      fields=set(vars(module)),
      default_attention=nnx.dot_product_attention,
      set_field=setattr,
    )
    if policy_here.fp8 is not None:
      _configure_fp8(module, policy_here.fp8)
    boundary = layers.boundary(module)
    lean = layers.lean_norm(module, _flax_class(module))
    if getattr(module, "promote_dtype", nnx_dtypes.promote_dtype) is not nnx_dtypes.promote_dtype:
      lean = None  # A custom promotion is part of the layer's computation.
    if boundary is not None:
      object.__setattr__(module, "__class__", _boundary_class(type(module)))
      # Static strings: the boundary is part of the graph definition.
      module.mpx_boundary = tuple(dtype.name for dtype in boundary)  # pyright: ignore[reportAttributeAccessIssue]
      module.mpx_lean_norm = lean  # pyright: ignore[reportAttributeAccessIssue]
    elif getattr(module, "_mpx_casts_at_boundary", False):
      module.mpx_boundary = module.mpx_lean_norm = None  # pyright: ignore[reportAttributeAccessIssue]

  for path, node in nodes:
    if isinstance(node, nnx.Param) and tree_lib.is_floating_array(node.get_value()):
      param_dtype = layers.policy_at(owner(tuple(path))).param_dtype
      node.set_value(casting.cast_tree(node.get_value(), param_dtype))

  model.mpx_policy = settings  # pyright: ignore[reportAttributeAccessIssue]
  layers.warn_unmatched_paths(stacklevel=2)
  return model
