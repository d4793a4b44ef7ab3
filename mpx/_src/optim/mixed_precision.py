"""One optimizer for mixed-precision training: loss scaling around master weights."""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import policy as policy_lib
from mpx._src import tree as tree_lib
from mpx._src.optim import base, masters
from mpx._src.optim import state_dtype as state_dtype_lib
from mpx._src.scaling import rules as scale_rules
from mpx._src.scaling import transform
from mpx._src.scaling.state import LossScaleState

LossScaleSpec = str | float | Callable[[optax.GradientTransformation], Any] | None

_F16 = np.dtype(jnp.float16)


def _loss_scaling(
  spec: LossScaleSpec, policy: policy_lib.Policy
) -> Callable[[optax.GradientTransformation], optax.GradientTransformationExtraArgs]:
  if isinstance(spec, numbers.Real | np.ndarray | np.generic | jax.Array) and not isinstance(
    spec, bool
  ):  # a static scale; first, because `array == "dynamic"` is not a bool
    return functools.partial(
      transform.static_loss_scale, scale=scale_rules.check_scale("loss_scale", spec)
    )
  if spec is None:
    return transform.no_loss_scale
  if spec == "dynamic":
    if _F16 in (policy.compute_dtype, policy.param_dtype):
      return transform.dynamic_loss_scale
    return transform.no_loss_scale  # bfloat16 and float32 gradients do not underflow
  if isinstance(spec, str):
    if spec not in scale_rules.PRESETS:
      raise errors.ConfigError(
        f"Unknown loss_scale {spec!r}. Pass 'dynamic', a preset name "
        f"({', '.join(scale_rules.PRESETS)}), a positive float for a static scale, "
        "None for no scaling, or a function such as "
        "functools.partial(mpx.dynamic_loss_scale, growth_interval=500)."
      )
    return functools.partial(transform.dynamic_loss_scale, preset=spec)
  if callable(spec):
    return spec
  raise errors.ConfigError(
    f"loss_scale={spec!r} of type {type(spec).__name__} is not understood. Pass 'dynamic', a "
    "preset name, a positive float (static), None, or a function wrapping a transformation."
  )


def _warn_on_narrow_params(params: optax.Params, policy: policy_lib.Policy) -> None:
  """Warns when params are narrower than the policy stores them (wider is fine: keep rules)."""
  want = policy.param_dtype
  narrow = [
    (path, leaf.dtype)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if tree_lib.is_floating_array(leaf) and not dtypes_lib.can_hold(leaf.dtype, want)
  ]
  if not narrow:
    return
  path, dtype = narrow[0]
  warnings.warn(
    f"{len(narrow)} params (e.g. {tree_lib.path_str(path)!r}, {dtype}) are narrower than the "
    f"policy's param dtype {want} (policy {policy}): the model was initialised outside the "
    "policy. Float32 masters are kept for them, so training is correct, but the forward pass "
    f"reads {dtype} weights the policy did not ask for. Initialise the model under the policy "
    "(mpx.linen.apply_policy(model, policy).init(...) or mpx.nnx.apply_policy(model, policy)), "
    f"cast the params with policy.cast_to_param(params), or train with a policy whose params "
    f"are {dtype} (e.g. 'params={dtype},compute={dtype},output=float32').",
    errors.PrecisionWarning,
    stacklevel=3,
  )


def mixed_precision(
  inner: optax.GradientTransformation,
  policy: policy_lib.Policy | str,
  *,
  loss_scale: LossScaleSpec = "dynamic",
  master_dtype: dtypes_lib.DTypeLike | None = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer for training under a precision policy.

  Builds ``loss_scale(with_master_params(inner))``, in the order of the
  paper's figure 1 (sections 3.1 and 3.2): gradients of the scaled loss are
  unscaled to float32 and checked; a non-finite step is skipped with the
  masters and moments untouched; otherwise ``inner`` runs on float32
  gradients against float32 masters and the new masters are cast back to the
  params' dtype. Use it with ``mpx.value_and_grad(loss_fn, opt_state)`` and
  :func:`mpx.apply_updates`.

  Two layouts (bytes per parameter with adamw: 12 and 14):

  * (a) ``param_dtype=float32`` (``"mixed_float16"``, ``"mixed_bfloat16"``):
    params are cast to the compute dtype in the forward pass; the masters
    wrapper holds no copy, since the params already are float32.
  * (b) half ``param_dtype`` (``"params=float16,compute=float16,..."``):
    float32 masters live in the optimizer state; the forward and backward
    read half the bytes. The updates of half params are float32, and each
    param becomes the rounding of its new master (but in one corner
    :func:`mpx.with_master_params` describes) under :func:`mpx.apply_updates`
    and, bit for bit the same, under ``optax.apply_updates`` with JAX's
    default dtype promotion (which Flax's ``nnx.Optimizer`` and
    ``TrainState`` call).

  Layout (c), half params without masters, keeps their small updates by
  compensating them inside ``inner``: wrap it in
  :func:`mpx.with_kahan_summation` or :func:`mpx.with_stochastic_rounding`
  and pass ``master_dtype=None``, e.g. ``mixed_precision(
  mpx.with_kahan_summation(mpx.with_state_dtype(optax.adamw(3e-4),
  state_dtype="bfloat16")), "bfloat16", master_dtype=None)`` (8 bytes per
  parameter; 6 with stochastic rounding). Masters around a compensated
  ``inner`` are an error at ``init``.

  Masters follow the params, not the policy: any floating param narrower than
  ``master_dtype`` gets one. ``init`` warns when a param is narrower than the
  policy's param dtype (a model initialised outside the policy).

  ``loss_scale="dynamic"`` picks dynamic scaling when the compute or param
  dtype is float16, and ``mpx.no_loss_scale`` (a no-op with the same state)
  for bfloat16 and float32, so one train step serves every policy.

  Args:
    inner: the optimizer, e.g. ``optax.adamw(3e-4)``.
    policy: an :class:`mpx.Policy` or a spec for :func:`mpx.get_policy`.
    loss_scale: ``"dynamic"``; a preset name such as ``"torch"`` or
      ``"flax"`` (dynamic scaling with that framework's rule, whatever the
      policy); a positive float (a static scale); ``None`` (no scaling); or
      a function ``inner -> transformation`` such as
      ``functools.partial(mpx.dynamic_loss_scale, growth_interval=500)``.
    master_dtype: the dtype of masters and moments for half params; ``None``
      disables masters, which loses small updates (a ``PrecisionWarning``)
      unless ``inner`` compensates them (layout (c) above).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    ``mpx.LossScaleState`` holding an :class:`mpx.MasterParamsState`
    (unless ``master_dtype=None``). ``update`` requires ``params``.

  Raises:
    PolicyError: ``policy`` or ``master_dtype`` cannot be parsed.
    ConfigError: ``loss_scale`` is not understood or out of range.
    StateError: at ``init``, masters around a compensated ``inner``.

  Warns:
    PrecisionWarning: at ``init``, when a param is narrower than the policy's
      param dtype, when half-precision params meet ``master_dtype=None``, or
      when a float16 policy meets ``loss_scale=None``; at the first traced
      ``update`` whose gradients were not differentiated with the loss scale
      (``jax.value_and_grad`` instead of :func:`mpx.value_and_grad`; see
      :func:`mpx.dynamic_loss_scale`).

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.mixed_precision(optax.sgd(1.0), "params=float16,compute=float16")
    >>> params = {"w": jnp.ones(2, jnp.float16)}
    >>> state = tx.init(params)
    >>> scale = mpx.get_loss_scale(state)
    >>> grads = {"w": jnp.full(2, -1e-4 * scale, jnp.float16)}  # scaled gradients
    >>> updates, state = tx.update(grads, state, params)
    >>> mpx.apply_updates(params, updates)["w"].dtype, state.inner_state.master_params["w"]
    (dtype('float16'), Array([1.0001, 1.0001], dtype=float32))
  """
  policy = policy_lib.get_policy(policy)
  tx = inner
  if master_dtype is not None:
    tx = masters.with_master_params(tx, master_dtype=master_dtype)
  tx = _loss_scaling(loss_scale, policy)(tx)

  def init_fn(params: optax.Params) -> optax.OptState:
    _warn_on_narrow_params(params, policy)
    if loss_scale is None and _F16 in (policy.compute_dtype, policy.param_dtype):
      warnings.warn(
        f"mpx.mixed_precision(..., loss_scale=None) with the float16 policy {policy}: float16 "
        "gradients below 2**-24 flush to zero and small activation gradients are lost, so "
        "training degrades without a word (paper section 3.2). Keep the default "
        "loss_scale='dynamic' (with mpx.value_and_grad in the train step), or train in "
        "bfloat16, whose range needs no loss scaling.",
        errors.PrecisionWarning,
        stacklevel=2,
      )
    state = tx.init(params)
    base.find_half_params_state(state)  # masters around a compensated inner: raise
    return state

  return optax.GradientTransformationExtraArgs(init_fn, tx.update)


def _check_typed(opt_state: optax.OptState) -> None:
  """Raises if ``opt_state`` lost its state types (an orbax restore without a target)."""
  if tree_lib.find_nodes(opt_state, LossScaleState):
    return
  for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if "loss_scale" in names:
      raise errors.StateError(
        f"The optimizer state holds a plain {tree_lib.path_str(path)!r} entry instead of an "
        "mpx.LossScaleState: it was restored without a target, and neither mpx nor optax can "
        f"use it. {tree_lib.RESTORE_ADVICE}"
      )


def _check_params(params: optax.Params, policy: policy_lib.Policy) -> list[tuple[Any, Any]]:
  """Raises if restored params do not fit ``policy``; returns their floating leaves with paths."""
  want = policy.param_dtype
  floating = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if tree_lib.is_floating_array(leaf)
  ]
  for path, leaf in floating:
    if not dtypes_lib.can_hold(leaf.dtype, want):
      raise errors.StateError(
        f"params leaf {tree_lib.path_str(path)!r} has dtype {leaf.dtype}, but the policy "
        f"({policy}) stores params in {want}. Restore with a target built under this policy "
        "(jax.eval_shape of the model init and tx.init), or train with the policy the "
        "checkpoint was saved under."
      )
  if dtypes_lib.is_half(want) and floating and all(leaf.dtype != want for _, leaf in floating):
    raise errors.StateError(
      f"The policy ({policy}) stores params in {want}, but every floating param is wider "
      "(this checkpoint was saved by a run with float32 params). Cast them with "
      "policy.cast_to_param(params) and rebuild the optimizer state with tx.init, or use the "
      "checkpoint's policy."
    )
  return floating


def check_state(
  opt_state: optax.OptState,
  params: optax.Params,
  policy: policy_lib.Policy | str,
  *,
  master_dtype: dtypes_lib.DTypeLike | None = jnp.float32,
  state_dtype: dtypes_lib.DTypeLike | None = None,
) -> None:
  """Raises if restored params and optimizer state do not fit ``policy``.

  Call it once after restoring a checkpoint (it reads shapes and dtypes only).
  ``tx.update`` checks the masters against the params too, at trace time; this
  also checks the params against the policy, and catches a state restored
  without its masters before any step runs.

  Args:
    opt_state: the restored optimizer state.
    params: the restored params.
    policy: the policy the run trains with.
    master_dtype: as passed to :func:`mixed_precision`; ``None`` if masters
      are disabled, as they are around :func:`mpx.with_kahan_summation` and
      :func:`mpx.with_stochastic_rounding`, whose buffers or keys are then
      checked instead.
    state_dtype: the dtype the run keeps its optimizer moments in (the one
      passed to :func:`mpx.with_state_dtype`; ``jnp.float32`` for optax's
      own moments under masters or compensation), or ``None`` to leave the
      moments unchecked.

  Returns:
    ``None`` when the state fits the policy.

  Raises:
    StateError: the state was restored without a target (dicts and lists
      instead of the state types); a floating param narrower than the policy's
      param dtype;
      half-precision params in the policy but none in ``params``; masters
      missing, superfluous or of the wrong shape or dtype; compensation
      buffers or rounding keys missing or not fitting the params, or present
      where masters are expected; a moment not of ``state_dtype``.
  """
  policy = policy_lib.get_policy(policy)
  floating = _check_params(params, policy)
  _check_typed(opt_state)
  keeper = base.find_half_params_state(opt_state)
  if keeper is not None:
    keeper.check(params, None if master_dtype is None else dtypes_lib.parse_dtype(master_dtype))
  elif master_dtype is not None and any(dtypes_lib.is_half(leaf.dtype) for _, leaf in floating):
    raise errors.StateError(
      f"The params have {policy.param_dtype} leaves but the optimizer state holds no master "
      "params, so the float32 masters were lost (paper section 3.1). Restore the optimizer "
      "state with jax.eval_shape(tx.init, params) as the target, where tx = mpx.mixed_precision(...)."
    )
  if state_dtype is not None:
    state_dtype_lib.check_state_dtype(opt_state, state_dtype)


def get_master_params(opt_state: optax.OptState, params: optax.Params) -> optax.Params:
  """Returns the weights the optimizer trains, at least float32: the masters where there are any.

  The one call that reads the high-precision weights in every layout (for
  evaluation, export, or an EMA of the weights), leaf by leaf:

  * a param with a float32 master (layout (b), :func:`mpx.with_master_params`
    anywhere in ``opt_state``, also under ``optax.masked`` or
    ``optax.multi_transform``): the master itself;
  * a param compensated by :func:`mpx.with_kahan_summation`: the compensated
    weight ``float32(p) + float32(c)``, which the param dtype alone rounds;
  * every other floating param (float32 params of layout (a), params without
    masters, under :func:`mpx.with_stochastic_rounding` whose params are the
    weights): the param converted to float32 (float64 stays float64);
  * non-floating leaves: returned as they are.

  Args:
    opt_state: the optimizer state, e.g. that of :func:`mpx.mixed_precision`
      (the one ``update`` returned with the updates ``params`` received).
    params: the params that state belongs to.

  Returns:
    A tree with the structure of ``params``.

  Raises:
    StateError: ``opt_state`` holds more than one masters or compensation
      state, or its masters do not have the structure of ``params``.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.mixed_precision(optax.sgd(1.0), "float16", loss_scale=1.0)
    >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(2, jnp.float32)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.full(2, 1e-4, jnp.float16), "b": jnp.ones(2, jnp.float32)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = mpx.apply_updates(params, updates)
    >>> params["w"], mpx.get_master_params(state, params)["w"]  # the master keeps the step
    (Array([1., 1.], dtype=float16), Array([0.9999, 0.9999], dtype=float32))
  """
  keeper = base.find_half_params_state(opt_state)
  if keeper is None:
    return jax.tree.map(base.widened, params)
  return keeper.weights(params)
