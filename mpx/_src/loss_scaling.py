"""Loss scaling as optax gradient transformations (paper section 3.2).

``dynamic_loss_scale``, ``static_loss_scale`` and ``no_loss_scale`` wrap an
inner optax transformation. Their ``update`` takes the gradients of the
*scaled* loss and

1. unscales them: each leaf is converted to float32 (float64 stays float64) and
   multiplied by ``1 / scale``. For the power-of-two scales of every preset this
   is exact (whenever the product is a normal float32), because scales are kept
   in ``[2**-126, 2**126]``, where the reciprocal is a normal float32 too (at
   jmp's 2**127 it is subnormal and flushes to zero). A multiplication rather
   than a division: XLA fuses it into every consumer, where a division is
   materialised (2 more reads of the gradients and one more kernel per leaf
   on XLA:CPU, docs/benchmarks.md). A scale that is not a power of two
   unscales within one float32 rounding of the exact quotient;
2. checks that every unscaled element is finite (one fused reduction over
   buckets of the scaled gradients, see ``_finite_after_unscale``);
3. if so, runs the inner update on the unscaled float32 gradients, so clipping,
   weight decay and every other inner transform see the true gradients;
   otherwise returns zero updates and leaves the inner state bitwise untouched
   (moments, ``count``: a learning-rate schedule does not advance);
4. adjusts the scale (``mpx._src.loss_scale``) and records skipped steps.

The inner transformation therefore receives float32 gradients, as the paper
recommends: with float16 parameters it should keep float32 state (float32
master weights, ``mu_dtype``...). Updates are returned in each parameter's
dtype when ``params`` is passed, so ``optax.apply_updates`` works under strict
dtype promotion. A skipped step returns updates of ``-0.0``, because
``p + (-0.0)`` is ``p`` bitwise for every ``p``, including ``-0.0``.

Order with ``optax.MultiSteps``: put loss scaling *outside*,
``dynamic_loss_scale(optax.MultiSteps(inner, k))``. Each mini-batch is then
unscaled and checked before it enters the float32 accumulator, so a
non-finite mini-batch costs one mini-step (the accumulator and mini-step
counter stay untouched) and what is eventually applied is a sum of checked,
true gradients; the scale may change inside a window, which is harmless
because every mini-batch is divided by the scale it was computed with. The
other order, ``MultiSteps(dynamic_loss_scale(inner), k)``, also works: the
scale is constant within a window and the check covers the accumulated sum,
but the *scaled* gradients are accumulated in their own dtype (float16 sums can
overflow), one bad mini-batch discards the whole window, and the scale adapts
``k`` times more slowly.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import loss_scale as rules
from mpx._src import master_params as master_params_lib
from mpx._src import tree as tree_lib

_INT32_MAX = np.iinfo(np.int32).max


class LossScaleState(NamedTuple):
  """State of every loss-scaling transformation.

  Attributes:
    loss_scale: float32 scalar, the scale of the next step's loss.
    growth_tracker: int32 scalar, finite steps counted toward the next growth.
    hysteresis_tracker: int32 scalar, overflows left before the scale backs off.
    skipped_steps: int32 scalar, total non-finite steps (saturating).
    consecutive_skips: int32 scalar, non-finite steps since the last finite one
      (saturating).
    diverged: bool scalar, set (and kept) once gradients overflowed while the
      scale was already at its floor; see :func:`check_loss_scale`.
    inner_state: the state of the wrapped transformation.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_tracker: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  diverged: jax.Array
  inner_state: optax.OptState


def all_finite(tree: Any) -> jax.Array:
  """Returns whether every element of every array leaf of ``tree`` is finite.

  Args:
    tree: any pytree of arrays.

  Returns:
    A bool scalar; ``True`` for a tree without leaves.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> bool(mpx.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


# Leaves up to this size are checked together in one concatenated reduction;
# larger ones get one reduction each. Tuned on the GPT of
# benchmarks/loss_scale_overhead.py (docs/benchmarks.md).
_CONCAT_LIMIT = 2**16


def _finite_after_unscale(grads: Any, scale: jax.Array) -> jax.Array:
  """Whether every element of ``grads / scale`` is finite, in few kernels.

  ``sum(|g|) * (1 / scale)`` is finite exactly when no element is inf or NaN
  and no unscaled ``|g_i| * (1 / scale)`` overflows (``|g_i| <= sum(|g|)``),
  so one scalar decides.
  It is conservative only when the L1 norm of a bucket of scaled gradients
  exceeds float32's max (3.4e38): that step is skipped and the scale backs off,
  the right response to gradients that large. Reading the *scaled* gradients
  lets XLA fuse the check without materialising the unscaled tree, and the
  buckets cut the kernels per leaf from about three (a per-leaf ``isfinite``
  reduction) to about one (docs/benchmarks.md).
  """
  small, totals = [], []
  for g in jax.tree.leaves(grads):
    g = g.astype(_unscaled_dtype(g))
    if g.size <= _CONCAT_LIMIT and g.dtype == np.dtype(np.float32):
      small.append(g.ravel())
    else:
      totals.append(jnp.sum(jnp.abs(g)).astype(jnp.float32))
  if small:
    totals.append(jnp.sum(jnp.abs(jnp.concatenate(small))))
  if not totals:
    return jnp.asarray(True)
  return jnp.isfinite(jnp.sum(jnp.stack(totals)) * (1 / scale))


def _saturating_increment(x: jax.Array) -> jax.Array:
  return x + (x < _INT32_MAX).astype(x.dtype)


def _unscaled_dtype(g: jax.Array) -> np.dtype:
  return g.dtype if g.dtype.itemsize > 4 else np.dtype(np.float32)  # float64 stays


def _unscale(grads: Any, scale: jax.Array) -> Any:
  inverse = 1 / scale  # normal, and exact for a power of two: scales stay in [2**-126, 2**126]

  def one(g: jax.Array) -> jax.Array:
    dtype = _unscaled_dtype(g)
    return g.astype(dtype) * inverse.astype(dtype)

  return jax.tree.map(one, grads)


def _in_param_dtypes(updates: Any, params: Any) -> Any:
  if params is None:
    return updates

  def one(u: Any, p: Any) -> Any:
    if tree_lib.is_floating_array(u) and tree_lib.is_floating_array(p) and u.dtype != p.dtype:
      return u.astype(p.dtype)
    return u

  return jax.tree.map(one, updates, params, is_leaf=lambda x: x is None)


def _update_if_finite(
  ok: jax.Array,
  run_inner: Callable[[], tuple[optax.Updates, optax.OptState]],
  inner_state: optax.OptState,
) -> tuple[optax.Updates, optax.OptState]:
  """The atomic skip: the inner step's result if ``ok``, else a no-op step.

  Both branches are computed and selected leaf by leaf with ``jnp.where``
  (as flax's ``DynamicScale`` does); this is the one place to change to try
  another formulation (``lax.cond``, a select fused into the update).
  """
  updates, new_state = run_inner()
  updates = jax.tree.map(lambda u: jnp.where(ok, u, -0.0), updates)
  new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, inner_state)
  return updates, new_state


def _check_grads(grads: Any, params: Any) -> None:
  tree_lib.check_floating_leaves(grads, what="gradients")
  if params is not None:
    tree_lib.check_same_structure(grads, params, names=("gradients", "params"))


def _warn_without_masters(params: Any, inner_state: Any) -> None:
  """Warns about half-precision params trained without float32 masters (paper section 3.1)."""
  half = [
    (path, leaf.dtype)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if tree_lib.is_floating_array(leaf) and dtypes_lib.is_half(leaf.dtype)
  ]
  if not half or master_params_lib.find_master_params(inner_state) is not None:
    return
  path, dtype = half[0]
  warnings.warn(
    f"{len(half)} params (e.g. {tree_lib.path_str(path)!r}, {dtype}) are stored in half "
    "precision and the optimizer keeps no float32 master copy, so every update smaller than "
    "half an ulp of its weight is rounded away and training stalls (paper section 3.1). "
    "Keep float32 masters: use mpx.mixed_precision(inner, policy) with its default "
    "master_dtype=jnp.float32, or wrap the optimizer as loss_scale(mpx.with_master_params(inner)).",
    errors.PrecisionWarning,
    stacklevel=3,
  )


def _initial_state(
  scale: float, trackers: tuple[int, int], inner: optax.GradientTransformation, params: Any
) -> LossScaleState:
  inner_state = inner.init(params)
  _warn_without_masters(params, inner_state)
  # One array per field: a buffer shared by two leaves cannot be donated.
  return LossScaleState(
    loss_scale=jnp.asarray(scale, jnp.float32),
    growth_tracker=jnp.asarray(trackers[0], jnp.int32),
    hysteresis_tracker=jnp.asarray(trackers[1], jnp.int32),
    skipped_steps=jnp.zeros((), jnp.int32),
    consecutive_skips=jnp.zeros((), jnp.int32),
    diverged=jnp.zeros((), jnp.bool_),
    inner_state=inner_state,
  )


def _scaled_transform(
  inner: optax.GradientTransformation,
  *,
  initial_scale: float,
  trackers: tuple[int, int],
  min_scale: float,
  adjust: Callable[[jax.Array, LossScaleState], tuple[jax.Array, jax.Array, jax.Array]],
  axis_name: Any,
) -> optax.GradientTransformationExtraArgs:
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> LossScaleState:
    return _initial_state(initial_scale, trackers, inner, params)

  def update_fn(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleState]:
    state = cast(LossScaleState, state)
    _check_grads(updates, params)
    ok = _finite_after_unscale(updates, state.loss_scale)
    grads = _unscale(updates, state.loss_scale)
    if axis_name is not None:
      ok = jax.lax.pmin(ok.astype(jnp.int32), axis_name) > 0

    def run_inner() -> tuple[optax.Updates, optax.OptState]:
      new_updates, new_state = inner.update(grads, state.inner_state, params, **extra_args)
      return _in_param_dtypes(new_updates, params), new_state

    new_updates, inner_state = _update_if_finite(ok, run_inner, state.inner_state)
    scale, growth, hysteresis = adjust(ok, state)
    at_floor = state.loss_scale <= jnp.float32(min_scale)
    skipped = jnp.logical_not(ok)
    return new_updates, LossScaleState(
      loss_scale=scale,
      growth_tracker=growth,
      hysteresis_tracker=hysteresis,
      skipped_steps=jnp.where(ok, state.skipped_steps, _saturating_increment(state.skipped_steps)),
      consecutive_skips=jnp.where(
        ok, jnp.zeros_like(state.consecutive_skips), _saturating_increment(state.consecutive_skips)
      ),
      diverged=state.diverged | (skipped & at_floor),
      inner_state=inner_state,
    )

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

  See the module docstring for what ``update`` does and for the recommended
  order with ``optax.MultiSteps``. The rule, as pseudo-code::

    ok = all gradients finite after unscaling
    if ok:
      growth_tracker += 1
      if growth_tracker == growth_interval:   # grows on the N-th finite step
        scale *= growth_factor                # only if finite and <= max_scale
        growth_tracker = 0
      hysteresis_tracker = hysteresis
    else:                                     # step skipped atomically
      growth_tracker = 0
      hysteresis_tracker -= 1
      if hysteresis_tracker == 0:
        scale = max(scale * backoff_factor, min_scale)
        hysteresis_tracker = hysteresis

  Presets fix a framework's semantics and defaults, step for step:

  ========== ======= ======== ===== ========== ==============================
  preset     initial interval floor hysteresis differences from the rule above
  ========== ======= ======== ===== ========== ==============================
  default    2**15   2000     1     1
  torch      2**16   2000     tiny  1          (torch has no floor)
  keras      2**15   2000     tiny  1          (Keras has no floor, no ceiling)
  jmp        2**15   2000     1     1
  flax       65536   2000     tiny  1          grows on the (N+1)-th finite step;
                                               clamps to max_scale
  megatron   2**32   1000     1     2          hysteresis refills only on growth
  deepspeed  2**16   1000     1     2          refills only on growth; first growth
                                               after N+1 clean steps, then every N
  paddle     2**16   2000     1     1          hysteresis = decr_every_n_nan_or_inf
  ========== ======= ======== ===== ========== ==============================

  ``tiny`` is float32's smallest normal number, 2**-126; every preset's
  ceiling is 2**126 (the largest scale whose reciprocal is a normal float32;
  flax's is float32's max, torch's and Keras' is none), so the scale always
  stays a finite, normal float32 with which unscaling is exact. Explicit arguments override the preset's values,
  so ``preset="flax", growth_interval=4`` behaves like flax's
  ``DynamicScale(growth_interval=4)``.

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
    A transformation whose state is a :class:`LossScaleState`.

  Raises:
    ConfigError: an unknown preset or an out-of-range hyperparameter.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([8.0, jnp.inf])}, state, params)
    >>> updates["w"], state.loss_scale, state.skipped_steps
    (Array([-0., -0.], dtype=float32), Array(4., dtype=float32), Array(1, dtype=int32))
  """
  rule = rules.resolve_rule(
    preset,
    initial_scale=initial_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    hysteresis=hysteresis,
    min_scale=min_scale,
    max_scale=max_scale,
  )
  growth0, hysteresis0 = rules.initial_trackers(rule)

  def adjust(ok: jax.Array, state: LossScaleState) -> tuple[jax.Array, jax.Array, jax.Array]:
    return rules.adjust(rule, ok, state.loss_scale, state.growth_tracker, state.hysteresis_tracker)

  return _scaled_transform(
    inner,
    initial_scale=rule.initial_scale,
    trackers=(int(growth0), int(hysteresis0)),
    min_scale=rule.min_scale,
    adjust=adjust,
    axis_name=axis_name,
  )


def static_loss_scale(
  inner: optax.GradientTransformation, scale: float, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
  """A constant loss scale around ``inner`` (paper section 3.2).

  Unscales in float32, checks finiteness and skips non-finite steps atomically
  exactly like :func:`dynamic_loss_scale`, but never changes the scale. Since
  the scale cannot back off, every skipped step sets ``diverged``.

  Args:
    inner: the transformation that receives the unscaled float32 gradients.
    scale: the constant scale, a positive normal float32 (a power of two keeps
      unscaling exact).
    axis_name: see :func:`dynamic_loss_scale`.

  Returns:
    A transformation whose state is a :class:`LossScaleState`.

  Raises:
    ConfigError: if ``scale`` is not a positive, finite, normal float32.
  """
  value = rules.check_scale("scale", scale)

  def adjust(ok: jax.Array, state: LossScaleState) -> tuple[jax.Array, jax.Array, jax.Array]:
    del ok
    return state.loss_scale, state.growth_tracker, state.hysteresis_tracker

  return _scaled_transform(
    inner,
    initial_scale=value,
    trackers=(0, 0),
    min_scale=value,
    adjust=adjust,
    axis_name=axis_name,
  )


def no_loss_scale(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """A loss scale of 1 with no check and no skip, for bfloat16 and float32.

  Gradients go to ``inner`` unchanged; the state is a :class:`LossScaleState`
  whose counters never move, so :func:`value_and_grad` and
  :func:`loss_scale_metrics` work on one code path for every precision.

  Args:
    inner: the wrapped transformation.

  Returns:
    A transformation whose state is a :class:`LossScaleState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> LossScaleState:
    return _initial_state(1.0, (0, 0), inner, params)

  def update_fn(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleState]:
    state = cast(LossScaleState, state)
    _check_grads(updates, params)
    new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    return _in_param_dtypes(new_updates, params), state._replace(inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
