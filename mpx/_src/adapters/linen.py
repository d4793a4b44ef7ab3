"""The linen adapter: one method interceptor writes each layer's policy into linen's per-call copies.

Linen builds a fresh bound copy of every module on each ``init`` / ``apply`` /
``tabulate`` (the root is cloned, modules passed as attributes are cloned on
adoption, ``@nn.compact`` and ``setup`` children are constructed anew), and
every method of such a copy, ``setup`` included, passes through
``nn.intercept_methods`` before its body runs. On a copy's first call the
interceptor resolves its policy (``mpx._src.adapters.layer_policy``, by module path)
and writes it into the copy's fields, which the body then reads; the user's
module objects are never touched. The copies Flax's lifted transforms build
have a ``Scope`` for parent: their enclosing layer is the one seen at the
longest shorter path, so only the model itself is the root. A float32
``LayerNorm``, ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` in a half-precision parent is
computed by ``mpx._src.adapters.lean_norms`` on the copy's own params and
statistics instead of its body (after ``init``, which runs Flax's code to
create them); float8 contractions come from ``mpx._src.adapters.linen_fp8``.
The user-facing account is :func:`apply_policy`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import casting, errors
from mpx._src import dtypes as dtypes_lib
from mpx._src import policy as policy_lib
from mpx._src.adapters import keep as keep_lib
from mpx._src.adapters import layer_policy, lean_norms, linen_fp8
from mpx._src.ops import amax_grad

DEFAULT_KEEP_CLASSES: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
_LEAN_NORM_KINDS: dict[type, str] = {
  nn.LayerNorm: "layer",
  nn.RMSNorm: "rms",
  nn.BatchNorm: "batch",
  nn.GroupNorm: "group",
}


def _sampling_policy(policy: policy_lib.Policy) -> policy_lib.Policy:
  # Flax's initializers sample in the param dtype: float16 samples are a different
  # random stream from float32 ones, not their rounding.
  return (
    dataclasses.replace(policy, param_dtype="float32")
    if dtypes_lib.is_half(policy.param_dtype)
    else policy
  )


def _round_params(result: Any, param_dtypes: dict[tuple[str, ...], np.dtype]) -> Any:
  """Casts each sampled param to its layer's param dtype (the deepest recorded module)."""

  def round_leaf(path: jax.tree_util.KeyPath, leaf: Any) -> Any:
    keys = [str(getattr(k, "key", k)) for k in path]
    if "params" not in keys:
      return leaf
    module_path = tuple(keys[keys.index("params") + 1 : -1])
    while module_path not in param_dtypes and module_path:
      module_path = module_path[:-1]
    dtype = param_dtypes.get(module_path)
    return leaf if dtype is None else casting.cast_tree(leaf, dtype)

  return jax.tree_util.tree_map_with_path(round_leaf, result)


def _path(module: nn.Module) -> str:
  return layer_policy.join_path(module.path)


def _set_field(module: nn.Module, name: str, value: Any) -> None:
  # Linen modules are frozen dataclasses; this copy is private to one call.
  object.__setattr__(module, name, value)


def _lean_norm_call(module: nn.Module, kind: str, args: Any, kwargs: Any, dtype: Any) -> Any:
  """One call of a linen norm through the lean kernels (``None``: run Flax's code)."""
  running: list[Any] = []

  def param(name: str, shape: tuple[int, ...]) -> jax.Array:
    return module.param(name, getattr(module, f"{name}_init"), shape, module.param_dtype)

  def stats(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    if not running:  # The variables as Flax's BatchNorm declares them.
      f32 = getattr(module, "force_float32_reductions", True)
      stat_dtype = jnp.float32 if f32 else module.param_dtype
      for name, fill in (("mean", 0.0), ("var", 1.0)):
        init = functools.partial(jnp.full, fill_value=fill, dtype=stat_dtype)
        running.append(module.variable("batch_stats", name, init, shape))
    return running[0].value, running[1].value

  def set_stats(mean: jax.Array, var: jax.Array) -> None:
    running[0].value, running[1].value = mean, var

  return lean_norms.call(
    module,
    kind,
    args,
    kwargs,
    dtype=dtype,
    param=param,
    stats=stats,
    set_stats=set_stats,
    call_overrides_attribute=False,
  )


@dataclasses.dataclass(eq=False)
class PolicyModel:
  """A linen model that runs under a precision policy; made by :func:`apply_policy`.

  It has the model's ``init``, ``init_with_output``, ``apply`` and
  ``tabulate``, each running under the policy, and forwards every other
  attribute to the original model (so ``model.dtype`` reads the user's field,
  which the policy does not change). It is a plain object, not a
  ``flax.linen.Module``: use it as the outermost model, not as a submodule.

  Attributes:
    module: the original, unmodified model.
    policy: the model's policy.
    rules: the keep rules.
    accumulate_in_float32: whether matmuls request float32 accumulation.
  """

  module: nn.Module
  policy: policy_lib.Policy
  rules: keep_lib.KeepRules
  accumulate_in_float32: bool = False

  def __post_init__(self) -> None:
    self._checked_paths = False

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name == "module":
      raise AttributeError(name)
    return getattr(self.module, name)

  def _run(self, fn: Any, args: Any, kwargs: Any, *, initializing: bool = False) -> Any:
    call = _PolicyCall(self, initializing=initializing)
    with nn.intercept_methods(call.intercept):
      result = fn(*args, **kwargs)
    if initializing:
      result = _round_params(result, call.param_dtypes)
    if not self._checked_paths:
      self._checked_paths = True
      call.layers.warn_unmatched_paths(stacklevel=3)
    return result

  def init(self, *args: Any, **kwargs: Any) -> Any:
    """``module.init`` under the policy; params come out in their layers' param dtypes.

    Half-precision params are sampled in float32 and then rounded, so every
    policy starts from the float32 run's initial weights (to the param
    dtype's rounding): Flax's initializers would otherwise sample in the
    param dtype, a different random stream.

    Args:
      *args: as for ``module.init``.
      **kwargs: as for ``module.init``.

    Returns:
      The variables, as ``module.init`` returns them.
    """
    return self._run(self.module.init, args, kwargs, initializing=True)

  def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
    """``module.init_with_output`` under the policy (params as in :meth:`init`).

    Args:
      *args: as for ``module.init_with_output``.
      **kwargs: as for ``module.init_with_output``.

    Returns:
      ``(output, variables)``; floating outputs in the policy's output dtype.
    """
    return self._run(self.module.init_with_output, args, kwargs, initializing=True)

  def apply(self, *args: Any, **kwargs: Any) -> Any:
    """``module.apply`` under the policy.

    Delayed fp8 histories (the ``"fp8_history"`` collection) enter typed by
    :func:`mpx.fp8.fp8_max_grad`, so a history read by several calls (a shared
    layer, ``nn.scan`` with the collection in ``variable_broadcast``) gets
    the max of their amaxes as its gradient, not their sum.

    Args:
      *args: as for ``module.apply``.
      **kwargs: as for ``module.apply``.

    Returns:
      What ``module.apply`` returns, floating outputs in the policy's output
      dtype.
    """
    variables = args[0] if args else None
    collection = linen_fp8.FP8_COLLECTION
    if hasattr(variables, "keys") and collection in variables:  # pyright: ignore[reportOperatorIssue]
      # Typed where they enter, before any layer reads them: autodiff combines the
      # reads of a shared history at that point (see fp8_max_grad).
      histories = amax_grad.fp8_max_grad(variables[collection])  # pyright: ignore[reportOptionalSubscript]
      args = ({**variables, collection: histories}, *args[1:])  # pyright: ignore[reportGeneralTypeIssues]
    return self._run(self.module.apply, args, kwargs)

  def tabulate(self, *args: Any, **kwargs: Any) -> str:
    """``module.tabulate`` under the policy (the table shows the policy's dtypes).

    Args:
      *args: as for ``module.tabulate``.
      **kwargs: as for ``module.tabulate``.

    Returns:
      The table.
    """
    return self._run(self.module.tabulate, args, kwargs)


class _PolicyCall:
  """One ``init`` / ``apply`` / ``tabulate`` of a :class:`PolicyModel`: its method interceptor.

  Args:
    model: the policy model being run.
    initializing: whether the call creates the variables (``init``).
  """

  def __init__(self, model: PolicyModel, *, initializing: bool) -> None:
    self._model = model
    self._initializing = initializing
    # The first layer seen at each path in this call (see `_parent_of`).
    self._at_path: dict[tuple[str, ...], nn.Module] = {}
    # The copies configured in this call, by id: holding them until the call ends
    # keeps a later copy from reusing the id of one Flax has freed (nn.jit, nn.remat).
    self._configured: dict[int, nn.Module] = {}
    self._in_cast: set[int] = set()  # the copies whose casting call is in progress
    self.param_dtypes: dict[tuple[str, ...], np.dtype] = {}
    self.layers = layer_policy.LayerPolicies(
      model.policy,
      model.rules,
      norm_classes=DEFAULT_KEEP_CLASSES,
      parent_of=self._parent_of,
      path_of=_path,
      lean_norm_kinds=_LEAN_NORM_KINDS,
    )

  def _parent_of(self, module: nn.Module) -> nn.Module | None:
    # The layers Flax builds inside a lifted transform (nn.scan, nn.remat, nn.jit, nn.vmap)
    # have a Scope for parent; the layer that encloses them is the one at the longest
    # shorter path, which is running the transform and so was seen first.
    if isinstance(module.parent, nn.Module):
      return module.parent
    path = tuple(module.path)
    prefixes = (path[:n] for n in range(len(path) - 1, -1, -1))
    return next((self._at_path[p] for p in prefixes if p in self._at_path), None)

  def _configure(self, module: nn.Module) -> None:
    """Writes the policy into a copy's fields, on its first method call."""
    self._at_path.setdefault(tuple(module.path), module)
    policy = self.layers.policy_at(module)
    self.param_dtypes[tuple(module.path)] = policy.param_dtype
    fields = {f.name for f in dataclasses.fields(module)}
    layer_policy.configure_layer(
      module,
      _sampling_policy(policy) if self._initializing else policy,
      self._model.rules,
      accumulate_in_float32=self._model.accumulate_in_float32,
      fields=fields,
      default_attention=nn.dot_product_attention,
      set_field=_set_field,
    )
    if policy.fp8 is not None:
      linen_fp8.configure(module, policy.fp8, fields, set_field=_set_field)
    self._configured[id(module)] = module

  def intercept(self, next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
    """Runs one method call of a layer under its policy (a ``nn.intercept_methods`` interceptor)."""
    module = context.module
    key = id(module)
    if key not in self._configured:
      self._configure(module)
    recipe = self.layers.policy_at(module).fp8
    if recipe is not None and type(module) is nn.Einsum and context.method_name == "__call__":
      # Linen's Einsum has no dot_general knob: its body runs here, contracting in float8.
      next_fun = functools.partial(linen_fp8.einsum_call, module, recipe)
    # Only the outermost method call of a layer casts (a method calling
    # another of the same layer stays inside it), and setup never does.
    boundary = self.layers.boundary(module)
    if boundary is None or context.method_name == "setup" or key in self._in_cast:
      return next_fun(*args, **kwargs)
    inner, outer = boundary
    kind = self.layers.lean_norm(module)
    if kind is not None and not self._initializing and context.method_name == "__call__":
      out = _lean_norm_call(module, kind, args, kwargs, outer)
      if out is not None:
        return out
    args, kwargs = casting.cast_tree((args, kwargs), inner)
    self._in_cast.add(key)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      self._in_cast.discard(key)
    return casting.cast_tree(out, outer)


def apply_policy(
  model: nn.Module | PolicyModel,
  policy: Any,
  *,
  rules: keep_lib.KeepRules | None = None,
  accumulate_in_float32: bool = False,
) -> PolicyModel:
  """Runs an unmodified linen model under a precision policy.

  Every layer computes in ``policy.compute_dtype`` and creates its params in
  ``policy.param_dtype``, except where ``rules`` give it a policy of its own
  (by default normalisation layers stay in float32; see
  :class:`mpx.KeepRules`); the model's floating outputs come back in
  ``policy.output_dtype``.

  How: while the returned model's ``init``, ``init_with_output``, ``apply`` or
  ``tabulate`` runs, a method interceptor (``flax.linen.intercept_methods``)
  sees every layer before its body runs. Linen builds a fresh copy of every
  module on each of these calls; the layer's policy is written into that
  copy's Flax fields, which the body then reads. Your module objects are never
  changed. What each layer receives:

  * ``dtype`` <- the compute dtype and ``param_dtype`` <- the param dtype,
    wherever the field is ``None`` or a floating dtype. This overrides a
    ``dtype=jnp.float32`` (or bfloat16, or float16) written in a layer or as
    a config default, as Flax's ImageNet and LM1B examples do; pin a layer
    deliberately with a keep rule. Integer ``dtype`` fields are left alone.
  * ``attention_fn`` <- :func:`mpx.dot_product_attention` (a float32 softmax
    between half-precision matmuls), for attention layers left at Flax's
    default, when ``rules.softmax_in_float32`` is set.
  * ``dot_general`` / ``conv_general_dilated`` <- float32-accumulating
    versions (see :func:`mpx.accumulate_in_float32`), with
    ``accumulate_in_float32=True``, for the layers that have these fields
    (``Dense``, ``DenseGeneral``, ``Conv``...) and leave them at JAX's own.
  * With a float8 policy (``policy.fp8``, e.g. ``"mixed_float8"``): ``Dense``,
    ``DenseGeneral`` and ``Einsum`` layers left at Flax's default contraction
    compute it with float8 operands (:func:`mpx.fp8.fp8_dot_general`, see
    ``docs/guide/fp8.md``); with delayed scaling, ``dot_general_cls`` <-
    :class:`mpx.linen.Fp8DotGeneral`, whose amax histories live in the
    ``"fp8_history"`` collection. ``Einsum``, which has no such knob, runs its
    body in mpx with the same params. Layers a keep rule gives a policy
    without ``fp8`` keep their dtype.

  Boundaries: the model's floating inputs are cast to its compute dtype and
  its floating outputs to the output dtype. A layer whose compute dtype
  differs from its parent's (a float32 norm in a half-precision model) casts
  its floating inputs to its own compute dtype and its floating outputs back
  to the parent's, so the next matmul still runs in half precision. Integer
  inputs (token ids), PRNG keys and other non-floating values are never cast
  (see :func:`mpx.cast_tree`).

  Lean norms (``rules.lean_norms``, the default): a ``LayerNorm``,
  ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` that computes in float32 inside a
  half-precision parent is computed by mpx's kernels from its own params and
  ``batch_stats`` (updated as Flax updates them): the same float32
  arithmetic, an output in the parent's compute dtype, and a backward pass
  that keeps the half-precision input and float32 per-row statistics instead
  of float32 copies of the activations. ``init`` runs Flax's own code.

  Initialisation: half-precision params are sampled in float32 and rounded to
  the param dtype, so every policy starts from the float32 run's initial
  weights. Other collections (``batch_stats``) are created by the layers
  themselves, so a norm kept in float32 keeps float32 statistics.

  Lifted transforms: the layers inside ``nn.scan``, ``nn.remat`` /
  ``nn.checkpoint``, ``nn.jit`` and ``nn.vmap`` (Flax builds them with a
  ``Scope``, not the enclosing module, for parent) are placed by their path:
  their parent is the layer at the longest shorter path, so keep rules on an
  enclosing layer reach them and only the model itself casts to the output
  dtype. With delayed fp8, give the ``"fp8_history"`` collection to
  ``nn.scan`` / ``nn.vmap`` as ``variable_axes`` (a history per layer) or
  ``variable_broadcast`` (one shared history).

  Limits: the returned :class:`PolicyModel` is not a ``flax.linen.Module``;
  wrap the outermost model. A layer that ignores ``dtype`` (a hand-written
  ``x @ w``) computes in whatever dtype its operands have; :func:`mpx.audit`
  shows such products. Linen clones every module on every call, so a layer is
  pinned by class or path, never by instance.

  Args:
    model: the linen model (as written, with or without ``dtype`` fields).
    policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.
    rules: keep rules; ``None`` means ``mpx.KeepRules()`` (the defaults).
      Class and path rules apply; pin a single layer by its path.
    accumulate_in_float32: make ``Dense``, ``DenseGeneral`` and ``Conv``
      layers request float32 accumulation, forward and backward.

  Returns:
    A :class:`PolicyModel` with ``init``, ``init_with_output``, ``apply`` and
    ``tabulate``.

  Raises:
    PolicyError: ``model`` already has a different policy or rules, or the
      rules hold instance rules (linen clones modules on every call).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, mpx
    >>> model = mpx.linen.apply_policy(nn.Dense(3), "mixed_float16")
    >>> x = jnp.ones((2, 4))
    >>> params = model.init(jax.random.key(0), x)
    >>> model.apply(params, x).dtype, params["params"]["kernel"].dtype
    (dtype('float32'), dtype('float32'))
  """
  policy = policy_lib.get_policy(policy)
  rules = keep_lib.KeepRules() if rules is None else rules
  if rules.instances:
    raise errors.PolicyError(
      f"Linen modules are cloned on every init/apply, so the instance rules "
      f"{[type(m).__name__ for m, _ in rules.instances]} cannot be matched. Pin those "
      r"layers with a path rule instead, e.g. KeepRules().with_path(r'^Decoder_0/head$', 'float32')."
    )
  if isinstance(model, PolicyModel):
    settings = (model.policy, model.rules, model.accumulate_in_float32)
    if settings == (policy, rules, accumulate_in_float32):
      return model
    raise errors.PolicyError(
      f"This model already runs under the policy {model.policy} (accumulate_in_float32="
      f"{model.accumulate_in_float32}) with its own keep rules; applying {policy} "
      f"(accumulate_in_float32={accumulate_in_float32}) on top would conflict. Apply the "
      "new policy to the original model instead: mpx.linen.apply_policy(model.module, ...)."
    )
  if not isinstance(model, nn.Module):
    raise errors.PolicyError(
      f"mpx.linen.apply_policy needs a flax.linen.Module, got {type(model).__name__}. "
      "For an NNX model use mpx.nnx.apply_policy."
    )
  return PolicyModel(model, policy, rules, accumulate_in_float32)
