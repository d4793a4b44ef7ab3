"""Loss scaling as optax gradient transformations (paper section 3.2).

One transformation, driven by a static rule (``mpx._src.scaling.rules``), serves
``dynamic_loss_scale``, ``static_loss_scale`` and ``no_loss_scale``; what its
``update`` does is documented on :func:`dynamic_loss_scale`.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import tree as tree_lib
from mpx._src.optim import base as half_params
from mpx._src.scaling import finite_check, misuse
from mpx._src.scaling import rules as scale_rules
from mpx._src.scaling.state import LossScaleState


def multiply(tree: Any, factor: jax.Array) -> Any:
  """Multiplies every floating leaf by the float32 scalar ``factor``, in float32.

  Half-precision leaves are converted to float32 first; float64 leaves stay
  float64; other leaves are returned as they are.
  """

  def one(x: Any) -> Any:
    if not tree_lib.is_floating_array(x):
      return x
    dtype = dtypes_lib.at_least_float32(x.dtype)
    return x.astype(dtype) * factor.astype(dtype)

  return jax.tree.map(one, tree)


def _in_param_dtypes(updates: Any, params: Any, inner_state: Any) -> Any:
  # Remainder masters return float32 updates of bfloat16 params on purpose: only a float32
  # update lands a weight that crosses zero exactly on the param its remainder is kept for.
  if params is None or half_params.keeps_wide_updates(inner_state):
    return updates

  def one(u: Any, p: Any) -> Any:
    if tree_lib.is_floating_array(u) and tree_lib.is_floating_array(p) and u.dtype != p.dtype:
      return u.astype(p.dtype)
    return u

  return jax.tree.map(one, updates, params, is_leaf=lambda x: x is None)


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
  """The atomic skip: ``new`` where ``ok``, else ``old``, leaf by leaf with ``jnp.where``.

  Both branches are computed and selected, as flax's ``DynamicScale`` does; it
  beats ``lax.cond`` in bytes and kernels (docs/benchmarks.md).
  """
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _check_grads(grads: Any, params: Any) -> None:
  tree_lib.check_floating_leaves(grads, what="gradients")
  if params is not None:
    tree_lib.check_same_shapes(grads, params, names=("gradients", "params"))


def _initial_state(rule: scale_rules.Rule, inner_state: optax.OptState) -> LossScaleState:
  growth, hysteresis = rule.initial_trackers
  # One array per field: a buffer shared by two leaves cannot be donated.
  return LossScaleState(
    loss_scale=jnp.asarray(rule.initial_scale, jnp.float32),
    growth_tracker=jnp.asarray(growth, jnp.int32),
    hysteresis_tracker=jnp.asarray(hysteresis, jnp.int32),
    skipped_steps=jnp.zeros((), jnp.int32),
    consecutive_skips=jnp.zeros((), jnp.int32),
    diverged=jnp.zeros((), jnp.bool_),
    skip_history=jnp.zeros((), jnp.uint32),
    nonfinite_leaf=jnp.full((), -1, jnp.int32),
    inner_state=inner_state,
  )


def _next_state(
  rule: scale_rules.Rule,
  state: LossScaleState,
  ok: jax.Array,
  leaf: jax.Array,
  inner_state: optax.OptState,
) -> LossScaleState:
  """The state after a step that was finite (``ok``) or not, ``leaf`` the first bad leaf."""
  scale, growth, hysteresis = rule.adjust(
    ok, state.loss_scale, state.growth_tracker, state.hysteresis_tracker
  )
  skipped = jnp.logical_not(ok)
  at_floor = state.loss_scale <= jnp.float32(rule.min_scale)
  return LossScaleState(
    loss_scale=scale,
    growth_tracker=growth,
    hysteresis_tracker=hysteresis,
    skipped_steps=jnp.where(ok, state.skipped_steps, optax.safe_increment(state.skipped_steps)),
    consecutive_skips=jnp.where(
      ok, jnp.zeros_like(state.consecutive_skips), optax.safe_increment(state.consecutive_skips)
    ),
    diverged=state.diverged | (skipped & at_floor),
    skip_history=(state.skip_history << jnp.uint32(1)) | skipped.astype(jnp.uint32),
    nonfinite_leaf=jnp.where(ok, state.nonfinite_leaf, leaf),
    inner_state=inner_state,
  )


def _loss_scaling(
  inner: optax.GradientTransformation, rule: scale_rules.Rule, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
  """The one loss-scaling transformation; ``rule`` decides what the scale does."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> LossScaleState:
    inner_state = inner.init(params)
    misuse.warn_without_masters(params, inner_state)
    return tree_lib.place_state(_initial_state(rule, inner_state), params)

  def update_fn(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleState]:
    tree_lib.check_state_type(state, LossScaleState, "the loss-scaling transformation")
    state = cast(LossScaleState, state)
    _check_grads(updates, params)
    if rule.kind == "none":  # a scale of 1: nothing to unscale, check or skip
      new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return _in_param_dtypes(new_updates, params, inner_state), state._replace(
        inner_state=inner_state
      )

    misuse.warn_if_unscaled(updates, params, state.loss_scale)
    ok, leaf = finite_check.finite_after_unscale(updates, state.loss_scale, axis_name=axis_name)
    grads = multiply(updates, 1 / state.loss_scale)
    new_updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    # p + (-0.0) is p bitwise for every p, -0.0 included; p + 0.0 is not.
    new_updates = jax.tree.map(
      lambda u: jnp.where(ok, u, -0.0), _in_param_dtypes(new_updates, params, inner_state)
    )
    inner_state = _select(ok, inner_state, state.inner_state)
    return new_updates, _next_state(rule, state, ok, leaf, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  preset: str = "default",
  initial_scale: float | None = None,
  growth_factor: float | None = None,
  backoff_factor: float | None = None,
  growth_interval: int | None = None,
  hysteresis: int | None = None,
  min_scale: float | None = None,
  max_scale: float | None = None,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around ``inner`` (paper section 3.2).

  Gradients of a float16 network are computed for ``loss * scale`` (see
  :func:`mpx.value_and_grad`), so that small values do not flush to zero. The
  transformation's ``update`` takes those *scaled* gradients and

  1. unscales them: each leaf is converted to float32 (float64 stays float64)
     and multiplied by ``1 / scale``, as :func:`mpx.unscale` does;
  2. checks that every unscaled element is finite (one fused kernel per leaf,
     then one reduction over all leaves; the unscaled tree is not
     materialised for it);
  3. if so, runs ``inner`` on the unscaled float32 gradients, so clipping,
     weight decay and every other inner transform see the true gradients;
     otherwise returns updates of ``-0.0`` (``p + (-0.0)`` is ``p`` bitwise,
     ``-0.0`` included) and leaves the inner state bitwise untouched (moments,
     ``count``: a learning-rate schedule does not advance);
  4. adjusts the scale by the rule below, counts skipped steps, and records
     which gradient leaf broke a skipped step
     (``nonfinite_leaf``, for :func:`mpx.diagnostics.nonfinite_gradient_paths`) and
     the last 32 steps' skips (``skip_history``, for the overflow rate of
     :func:`mpx.loss_scale_metrics`).

  ``inner`` therefore receives float32 gradients, as the paper recommends: with
  float16 params it should keep float32 state (float32 master weights, see
  :func:`mpx.with_master_params`). Updates are returned in each param's dtype
  when ``params`` is passed, so ``optax.apply_updates`` works under strict dtype
  promotion, except the float32 updates of params with masters (see
  :func:`mpx.apply_updates`). ``update`` checks, at trace time, that the gradients match the
  params' tree structure and shapes, naming the first leaf that does not.

  The rule, as pseudo-code (``ok`` = every unscaled gradient is finite)::

    if ok:
      growth_tracker += 1
      if growth_tracker == growth_interval:
        scale = grow(scale)
        growth_tracker = -extra_steps_after_growth
        if refill == "growth": hysteresis_tracker = hysteresis
      if refill == "finite": hysteresis_tracker = hysteresis
    else:                                   # the step is skipped
      growth_tracker = -extra_steps_after_overflow
      hysteresis_tracker -= 1
      if hysteresis_tracker <= 0:
        scale = max(scale * backoff_factor, min_scale)
        hysteresis_tracker = hysteresis if refill == "finite" else 0

  The first step starts from ``growth_tracker = -extra_steps_after_overflow``
  and ``hysteresis_tracker = hysteresis``. ``grow(scale)`` is
  ``scale * growth_factor`` when that is at most ``max_scale``, else ``scale``
  unchanged ("hold"); the flax preset clamps to ``max_scale`` instead, as
  ``flax.training.dynamic_scale`` does ("clamp"). ``diverged`` is set when a
  step overflows while the scale is already at ``min_scale``. Presets fix a
  framework's semantics and defaults, step for step:

  ========= ======= ======== ===== ========== ====== =============== ======
  preset    initial interval floor hysteresis refill extra steps     at max
                                                     overflow/growth
  ========= ======= ======== ===== ========== ====== =============== ======
  default   2**15   2000     1     1          finite 0 / 0           hold
  torch     2**16   2000     tiny  1          finite 0 / 0           hold
  keras     2**15   2000     tiny  1          finite 0 / 0           hold
  jmp       2**15   2000     1     1          finite 0 / 0           hold
  flax      65536   2000     tiny  1          finite 1 / 1           clamp
  megatron  2**32   1000     1     2          growth 0 / 0           hold
  deepspeed 2**16   1000     1     2          growth 1 / 0           hold
  paddle    2**16   2000     1     1          finite 0 / 0           hold
  ========= ======= ======== ===== ========== ====== =============== ======

  Every preset grows by 2 and backs off by 0.5. flax grows on the
  (N+1)-th finite step; DeepSpeed first grows after N+1 clean steps, then
  every N; Paddle's ``decr_every_n_nan_or_inf`` is the hysteresis. Explicit
  arguments override the preset's values, so ``preset="flax",
  growth_interval=4`` behaves like flax's ``DynamicScale(growth_interval=4)``.

  Bounds and exactness: every scale lies in ``[2**-126, 2**126]``, where the
  scale and its reciprocal are normal float32 numbers. ``tiny`` is 2**-126
  (torch and Keras have no floor; their scale can reach 0) and every preset's
  ceiling is 2**126 (flax's is float32's max, torch's and Keras' none; they
  agree below 2**126). Multiplying by ``1 / scale`` is then exact for the
  power-of-two scales of every preset whenever the product is a normal float32
  (jmp's scale can reach 2**127, whose reciprocal is subnormal and flushes to
  zero); a scale that is not a power of two unscales within one float32
  rounding of the exact quotient. A multiplication rather than a division:
  XLA fuses it into every consumer, where a division is materialised.

  Order with ``optax.MultiSteps``: put loss scaling *outside*,
  ``dynamic_loss_scale(optax.MultiSteps(inner, k))``. Each mini-batch is then
  unscaled and checked before it enters the accumulator, so a non-finite
  mini-batch costs one mini-step (the accumulator and mini-step counter stay
  untouched). ``MultiSteps`` does not sum its mini-batches: with its default
  ``use_grad_mean=True`` it keeps the running mean ``acc + (g - acc) / (n +
  1)`` of the ``n + 1`` mini-batches so far and hands ``inner`` that mean of
  checked, true gradients (``use_grad_mean=False`` sums instead). Its
  accumulator has the dtype of the params it was initialised with (the
  float32 masters under :func:`mpx.mixed_precision`) unless its
  ``accumulator_dtype`` says otherwise. The scale may change inside a window,
  which is harmless because every mini-batch is divided by the scale it was
  computed with. The other order, ``MultiSteps(dynamic_loss_scale(inner),
  k)``, also works: the scale is constant within a window and the check
  covers the accumulated mean, but the *scaled* gradients are accumulated
  (in float16 for float16 params, where a running mean of values near the
  scale can overflow), one bad mini-batch discards the whole window, and the
  scale adapts ``k`` times more slowly.

  A forgotten :func:`mpx.value_and_grad` (gradients of the unscaled loss)
  trains SGD not at all, as the true gradients get divided by the scale. When
  ``update`` is traced in one ``jit`` with the gradient computation, it checks
  that the gradients depend on the state's ``loss_scale`` whenever they depend
  on ``params``, and warns once (a ``PrecisionWarning``) if not. The check is
  on the traced computation, not on magnitudes, so it cannot mistake small
  true gradients for unscaled ones; it is silent where it cannot see the
  gradient computation (gradients passed into the ``jit``, eager calls).

  Every hyperparameter must be known when the transformation is built: a
  Python number or a concrete 0-d array such as ``jnp.float32(2**15)``, not a
  value traced under ``jit``. Building and ``init`` work under ``jax.jit``,
  ``jax.eval_shape`` and ``optax.inject_hyperparams``.

  Args:
    inner: the transformation that receives the unscaled float32 gradients.
    preset: which framework's rule to follow (table above).
    initial_scale: the first step's scale.
    growth_factor: multiplier on growth, > 1.
    backoff_factor: multiplier on overflow, in (0, 1).
    growth_interval: finite steps before the scale grows, >= 1.
    hysteresis: overflows tolerated before the scale backs off, >= 1.
    min_scale: the floor, in [2**-126, 2**126].
    max_scale: the ceiling, in [2**-126, 2**126].
    axis_name: under ``shard_map``/``pmap``/``vmap``, the mapped axis over
      which the finite decision is made global (every device skips together).

  Returns:
    A transformation whose state is a :class:`mpx.LossScaleState`.

  Raises:
    ConfigError: an unknown preset, or a traced or out-of-range hyperparameter.

  Warns:
    PrecisionWarning: once, when ``update`` is traced with gradients that
      were not differentiated through the loss scale (see above).

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([8.0, jnp.inf])}, state, params)
    >>> updates["w"], state.loss_scale, state.skipped_steps
    (Array([-0., -0.], dtype=float32), Array(4., dtype=float32), Array(1, dtype=int32))
  """
  rule = scale_rules.resolve_rule(
    preset,
    initial_scale=initial_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    hysteresis=hysteresis,
    min_scale=min_scale,
    max_scale=max_scale,
  )
  return _loss_scaling(inner, rule, axis_name=axis_name)


def static_loss_scale(
  inner: optax.GradientTransformation, scale: float, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
  """A constant loss scale around ``inner`` (paper section 3.2).

  ``update`` unscales, checks and skips non-finite steps atomically exactly
  like :func:`mpx.dynamic_loss_scale` (whose docstring describes the steps),
  but never changes the scale. Since the scale cannot back off, every skipped
  step sets ``diverged``.

  Args:
    inner: the transformation that receives the unscaled float32 gradients.
    scale: the constant scale, a positive normal float32 (a power of two keeps
      unscaling exact): a Python number or a concrete 0-d array.
    axis_name: see :func:`mpx.dynamic_loss_scale`.

  Returns:
    A transformation whose state is a :class:`mpx.LossScaleState`.

  Raises:
    ConfigError: if ``scale`` is traced, or not a positive, finite, normal
      float32.
  """
  return _loss_scaling(inner, scale_rules.static_rule(scale), axis_name=axis_name)


def no_loss_scale(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """A loss scale of 1 with no check and no skip, for bfloat16 and float32.

  Gradients go to ``inner`` unchanged; the state is a :class:`mpx.LossScaleState`
  whose counters never move, so :func:`mpx.value_and_grad` and
  :func:`mpx.loss_scale_metrics` work on one code path for every precision.

  Args:
    inner: the wrapped transformation.

  Returns:
    A transformation whose state is a :class:`mpx.LossScaleState`.
  """
  return _loss_scaling(inner, scale_rules.NO_SCALING)
