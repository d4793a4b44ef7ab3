"""Stochastically rounded updates of half-precision params, without float32 masters (layout (c))."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.dtypes import F32
from mpx._src.optim import base


class StochasticRoundingState(NamedTuple):
  """State of :func:`with_stochastic_rounding`.

  Attributes:
    keys: a tree shaped like the params holding, for every half-precision
      param, the raw data (``jax.random.key_data``) of its own PRNG key,
      ``fold_in(key, leaf_index)``; ``None`` for every other leaf.
    count: int32 scalar, the steps taken (saturating at ``2**31 - 1``), folded
      into each leaf's key so that every step draws new random numbers.
    inner_state: the state of the inner transformation, built on float32
      weights.
  """

  keys: optax.Params
  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride] (optax's name)
  inner_state: optax.OptState

  @property
  def master_params(self) -> optax.Params:
    """``None`` at every leaf: no masters, each param is exactly ``params + updates``."""
    return base.no_masters(self.keys)

  def check(self, params: optax.Params, master_dtype: np.dtype | None) -> None:
    """Raises if a run expects masters, or the keys do not fit ``params``."""
    base.refuse_masters(self, master_dtype)
    check_keys(self, params)

  def weights(self, params: optax.Params) -> optax.Params:
    """The params converted to at least float32: each is exactly its weight."""
    return base.weights_of(self.master_params, params, compensation=False)


base.HalfParamsState.register(StochasticRoundingState)


def check_keys(state: StochasticRoundingState, params: optax.Params) -> None:
  """Raises if ``state`` does not hold a key for exactly the half params.

  Args:
    state: the state of :func:`with_stochastic_rounding`.
    params: the params the state is used with.

  Raises:
    StateError: naming the first leaf whose key is missing, superfluous or not
      raw uint32 key data.
  """
  base.check_buffers(
    state.keys,
    params,
    what="rounding key",
    fits=lambda k, p: k.dtype == np.uint32 and k.ndim == 1,
    want=lambda p: "raw uint32 key data, as jax.random.key_data returns",
  )


def round_stochastically(x: jax.Array, dtype: np.dtype, uniform: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to ``dtype``, up or down with probability by distance.

  ``x`` lies between two neighbours ``lo <= x <= hi`` of ``dtype``; the
  result is ``hi`` with probability ``(x - lo) / (hi - lo)`` (``uniform`` below
  that fraction) and ``lo`` otherwise, so its mean is ``x``. Values of
  ``dtype``, infinities and NaN are returned as by ``x.astype(dtype)``.
  """
  nearest = x.astype(dtype)
  near32 = nearest.astype(F32)
  toward = jnp.where(near32 < x, jnp.asarray(jnp.inf, dtype), jnp.asarray(-jnp.inf, dtype))
  other = jnp.nextafter(nearest, toward)
  # In [0, 1/2]; 0/0 (x a value of dtype, zero) and inf/inf (x beyond the
  # range) give NaN, which no uniform number is below.
  frac = (x - near32) / (other.astype(F32) - near32)
  return jnp.where(uniform < frac, other, nearest)


def with_stochastic_rounding(
  inner: optax.GradientTransformation,
  *,
  key: jax.Array,
) -> optax.GradientTransformationExtraArgs:
  """Stochastically rounded updates of half-precision params, without float32 masters.

  Each step, per bfloat16 or float16 param ``p``, adds the inner update in
  float32 and rounds the sum to the param dtype at random, up or down with
  probability proportional to the distance:

  .. math::

     u = \\mathrm{inner}(g, p), \\qquad x = p + u, \\qquad
     p' = \\begin{cases} \\mathrm{hi}(x) & \\text{with probability }
       \\frac{x - \\mathrm{lo}(x)}{\\mathrm{hi}(x) - \\mathrm{lo}(x)} \\\\
       \\mathrm{lo}(x) & \\text{otherwise,} \\end{cases}

  where ``lo(x) <= x <= hi(x)`` are the neighbouring values of the param
  dtype. Then ``E[p'] = x``: an update far below half an ulp still moves the
  weight in expectation, and the rounding errors of successive steps are
  uncorrelated, so they add up like a random walk instead of a bias. The inner
  optimizer sees float32 gradients and params (so its moments are float32
  unless :func:`mpx.with_state_dtype` stores them narrower); params of other
  dtypes get the inner updates unchanged. No buffer is kept: 2 bytes per
  parameter less than :func:`with_kahan_summation`, at the price of noise.

  The random numbers come from ``key``: each half param gets
  ``fold_in(key, leaf_index)`` (its index among the params' leaves) at
  ``init``, and each step folds in the step count. The stream is therefore
  reproducible, different for every leaf and step, and, with JAX's default
  partitionable threefry, independent of how the params are sharded.

  The returned update is ``p' - p`` in the param dtype, on which
  ``optax.apply_updates`` (and ``mpx.apply_updates``) lands exactly whenever it
  is representable: always when ``p'`` is within a factor of two of ``p``
  (Sterbenz), so in every ordinary step. A weight crossing zero or halving in
  one step can miss ``p'`` by one ulp of the move (0.04% to 0.07% of
  element-steps of adam runs on digits, ``benchmarks/compensated_training.py``),
  and the next step starts from where it landed.

  A skipped step of an outer loss-scaling wrapper leaves ``count`` untouched,
  so the retried step draws the same numbers; in :func:`mpx.mixed_precision`
  pass ``master_dtype=None``.

  Args:
    inner: the optimizer, e.g. ``optax.adamw(3e-4)``.
    key: a JAX PRNG key, typed (``jax.random.key(0)``) or raw
      (``jax.random.PRNGKey(0)``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`StochasticRoundingState` and whose ``update`` requires ``params``
    and forwards extra arguments to ``inner``.

  Raises:
    ConfigError: ``key`` is not a PRNG key; at ``update``, ``params`` is
      missing.
    StateError: at ``update``, the keys do not fit the params.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
    >>> tx = mpx.with_stochastic_rounding(optax.sgd(1e-3), key=jax.random.key(0))
    >>> state = tx.init(params)
    >>> for _ in range(100):  # plain bfloat16 stays at 1.0: 1e-3 < half an ulp
    ...   updates, state = tx.update({"w": -jnp.ones(10_000, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(params["w"].astype(jnp.float32).mean()), 2)
    1.1

  References:
    Gupta, Agrawal, Gopalakrishnan, Narayanan, *Deep Learning with Limited
    Numerical Precision*, ICML 2015.
    Zamirai, Zhang, Aberger, De Sa, *Revisiting BFloat16 Training*, 2020.
    Ozkara, Yu, Park, *Stochastic Rounding for LLM Training: Theory and
    Practice*, AISTATS 2025 (bfloat16 AdamW with stochastic rounding against
    mixed precision, up to 6.7B parameters).
  """
  root = _as_typed_key(key)
  impl = jax.random.key_impl(root)
  key_shape = jax.random.key_data(root).shape
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> StochasticRoundingState:
    leaves, treedef = jax.tree.flatten(params)
    keys = treedef.unflatten(
      [
        jax.random.key_data(jax.random.fold_in(root, i)) if base.is_compensated(p) else None
        for i, p in enumerate(leaves)
      ]
    )
    weights = base.float32_weights(params, keys)
    inner_state = tree_lib.place_state(inner.init(weights), weights)
    return StochasticRoundingState(keys, jnp.zeros((), jnp.int32), inner_state)

  def update_fn(
    updates: optax.Updates,
    state: StochasticRoundingState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, StochasticRoundingState]:
    params = base.require_params(params, "with_stochastic_rounding")
    tree_lib.check_same_structure(updates, params, names=("gradients", "params"))
    check_keys(state, params)
    for path, k in jax.tree_util.tree_flatten_with_path(state.keys)[0]:
      if k.shape != key_shape:
        raise errors.StateError(
          f"The rounding key of params leaf {tree_lib.path_str(path)!r} has shape "
          f"{list(k.shape)}, but keys of this transformation's PRNG implementation ({impl}) "
          f"have shape {list(key_shape)}. {base.FIX}"
        )
    weights = base.float32_weights(params, state.keys)
    inner_updates, inner_state = base.inner_step(
      inner, updates, state.inner_state, weights, extra_args
    )

    def one(k: Any, p: Any, u: Any) -> Any:
      if k is None:
        return u
      step_key = jax.random.fold_in(jax.random.wrap_key_data(k, impl=impl), state.count)
      uniform = jax.random.uniform(step_key, p.shape, F32)
      target = round_stochastically(p.astype(F32) + u.astype(F32), p.dtype, uniform)
      return base.update_toward(target, p, F32)

    param_updates = jax.tree.map(one, state.keys, params, inner_updates, is_leaf=base.is_none)
    count = jnp.asarray(optax.safe_increment(state.count))
    return param_updates, StochasticRoundingState(state.keys, count, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _as_typed_key(key: Any) -> jax.Array:
  if isinstance(key, jax.Array | np.ndarray):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      if key.shape == ():
        return jnp.asarray(key)
    elif key.dtype == np.uint32 and key.shape == (2,):
      return jax.random.wrap_key_data(jnp.asarray(key))
  got = f"{key.dtype}{list(key.shape)}" if tree_lib.is_array(key) else type(key).__name__
  raise errors.ConfigError(
    f"key must be one PRNG key, but got {got}. Pass key=jax.random.key(seed) (or the raw "
    "jax.random.PRNGKey(seed))."
  )
