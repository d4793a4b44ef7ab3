"""Tests for mpx.with_kahan_summation and mpx.with_stochastic_rounding (layout (c))."""

import math
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from checkpoints import round_trip
from optax_compat import standard_promotion

import mpx
from mpx._src.optim import base as half_params
from mpx._src.optim import stochastic_rounding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import compensated_training

HALF = [jnp.bfloat16, jnp.float16]
ALL = [jnp.float32, jnp.bfloat16, jnp.float16]
F32 = np.float32
BF16 = "params=bfloat16,compute=bfloat16,output=float32"


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _params(dtype):
  return {
    "dense": {"kernel": jnp.full((3, 2), 0.5, dtype), "bias": jnp.zeros(2, dtype)},
    "norm_scale": jnp.ones(2, jnp.float32),
    "step": jnp.array(7, jnp.int32),
  }


def _float_mask(params):
  return jax.tree.map(lambda p: jnp.issubdtype(p.dtype, jnp.floating), params)


def _kahan(inner):
  return mpx.with_kahan_summation(inner)


def _rounding(inner):
  return mpx.with_stochastic_rounding(inner, key=jax.random.key(0))


WRAPPERS = [pytest.param(_kahan, id="kahan"), pytest.param(_rounding, id="rounding")]


def _scan(tx, params, grads, apply=optax.apply_updates):
  """Runs ``tx`` over a stack of gradients; returns the final params and state."""

  def body(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    return (apply(params, updates), state), None

  run = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), grads)[0])
  return run(params)


# ------------------------------------------------------------------ the paper's rounding case


def test_paper_rounding_case_in_bfloat16():
  """A weight of 1.0, an update of 1e-3 per step, 100 steps (Zamirai et al. 2020).

  bfloat16 has 8 significant bits: near 1.0 its values are ``D = 2**-7``
  apart, so ``1 + 1e-3`` rounds back to 1.0 and plain training never moves.

  Stochastic rounding: the weight always sits on the grid ``1 + k D`` (it
  starts there and every step rounds to it), so each step adds ``d = 1e-3 <
  D`` to a grid point and rounds up with probability ``q = d / D`` (not
  depending on the weight). The 100 steps are independent Bernoulli(q) trials
  and ``w_100 = 1 + D * Binomial(100, q)``: mean ``1 + 100 d = 1.1``, variance
  ``100 * D**2 * q (1 - q) = 100 d (D - d)``, i.e. the variance of a sum of
  independent roundings is the sum of their variances ``(x - lo)(hi - x)``.
  Over N = 10,000 weights the mean has standard error ``sqrt(var / N)`` and the
  sample variance ``var * sqrt(2 / (N - 1) + kurt / N)`` (binomial excess
  kurtosis ``(1 - 6 q (1 - q)) / (100 q (1 - q))``). Both are asserted within
  5 standard errors, and the weights' values to be exactly the grid points.
  """
  n, steps = 10_000, 100
  grads = {"w": jnp.full((steps, n), -1e-3, jnp.float32)}  # sgd(1.0): an update of +1e-3
  params = {"w": jnp.ones(n, jnp.bfloat16)}

  plain, _ = _scan(optax.sgd(1.0), params, jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads))
  assert (np.asarray(plain["w"]) == 1.0).all()

  kahan, state = _scan(mpx.with_kahan_summation(optax.sgd(1.0)), params, grads)
  assert (np.asarray(kahan["w"]) == np.asarray(jnp.bfloat16(1.1))).all()  # 1.1015625
  weight = np.asarray(kahan["w"], F32) + np.asarray(state.compensation["w"], F32)
  exact = math.fsum([float(F32(1e-3))] * steps) + 1.0
  # Each step adds at most half an ulp of c <= 2**-16 |w| to the error of w = p + c.
  assert np.abs(weight - exact).max() <= steps * 2.0**-16 * 1.1

  rounded, _ = _scan(_rounding(optax.sgd(1.0)), params, grads)
  w = np.asarray(rounded["w"], np.float64)
  D, d = 2.0**-7, float(F32(1e-3))
  k = (w - 1) / D
  np.testing.assert_array_equal(k, np.round(k))  # on the grid
  q = d / D
  var = steps * d * (D - d)
  kurt = (1 - 6 * q * (1 - q)) / (steps * q * (1 - q))
  assert abs(w.mean() - (1 + steps * d)) < 5 * math.sqrt(var / n)
  assert abs(w.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (n - 1) + kurt / n)
  assert abs(w.mean() - 1.1) < 0.002  # the paper's 1.1, within 5 standard errors + 1e-3's rounding


# ------------------------------------------------------------------ Kahan: bitwise restatement


def _kahan_numpy(p, c, u, dtype):
  """The algorithm of with_kahan_summation in NumPy float32 (ml_dtypes for the half dtypes)."""
  x = (p.astype(F32) + c.astype(F32)) + u
  t = x.astype(dtype)
  diff = t.astype(F32) - p.astype(F32)
  big = F32(ml_dtypes.finfo(dtype).max)
  diff = np.where(np.isfinite(t.astype(F32)), np.clip(diff, -big, big), diff)
  d = diff.astype(dtype)
  new_p = (p.astype(F32) + d.astype(F32)).astype(dtype)  # one rounding: p + d in the param dtype
  return d, new_p, (x - new_p.astype(F32)).astype(dtype), x


def _walk(dtype, seed, num_steps=200, size=512):
  """Float32 updates over many magnitudes relative to the weight, with jumps across zero."""
  rng = np.random.default_rng(seed)
  lo, hi = (-12, 12) if dtype == jnp.float16 else (-30, 30)
  start = rng.choice([-1, 1], size) * 2.0 ** rng.uniform(lo, hi, size)
  # Ordinary steps move a weight by at most a quarter; jumps go anywhere, across zero.
  rel = rng.choice([-1, 1], (num_steps, size)) * 2.0 ** rng.uniform(-30, -2, (num_steps, size))
  jump = rng.uniform(size=(num_steps, size)) < 0.05
  to = rng.choice([-1, 1], (num_steps, size)) * 2.0 ** rng.uniform(lo, hi, (num_steps, size))
  return start, rel, jump, to


def _exact_by_sterbenz(old, new):
  """Where ``new - old`` is representable by Sterbenz's lemma: within a factor of two, or a zero."""
  old, new = old.astype(np.float64), new.astype(np.float64)
  ratio = new / np.where(old == 0, 1, old)
  return (old == 0) | (new == 0) | ((ratio >= 0.5) & (ratio <= 2))


@pytest.mark.parametrize("dtype", HALF)
def test_kahan_is_bitwise_the_numpy_restatement(dtype):
  start, rel, jump, to = _walk(dtype, seed=0)
  tx = mpx.with_kahan_summation(optax.sgd(1.0))
  params = jnp.asarray(start, F32).astype(dtype)

  def body(carry, xs):
    params, state = carry
    rel, jump, to = xs
    w = params.astype(F32) + state.compensation["w"].astype(F32)
    u = jnp.where(jump, to - w, w * rel)  # the float32 update sgd(1.0) returns for grads -u
    u = jax.lax.optimization_barrier(u)  # or XLA may fuse w * rel + w into one FMA
    updates, new_state = tx.update({"w": -u}, state, {"w": params})
    new_params = optax.apply_updates({"w": params}, updates)["w"]
    out = (
      params,
      state.compensation["w"],
      u,
      updates["w"],
      new_params,
      new_state.compensation["w"],
    )
    return (new_params, new_state), out

  xs = (jnp.asarray(rel, F32), jnp.asarray(jump), jnp.asarray(to, F32))
  run = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init({"w": p})), xs)[1])
  p, c, u, d, new_p, new_c = (np.asarray(a) for a in run(params))
  want_d, want_p, want_c, x = _kahan_numpy(p, c, u, dtype)
  np.testing.assert_array_equal(_bits(d), _bits(want_d))
  np.testing.assert_array_equal(_bits(new_p), _bits(want_p))
  np.testing.assert_array_equal(_bits(new_c), _bits(want_c))
  # The buffer accounts for the param optax.apply_updates returned, also where
  # that param is not the rounding of x (d not representable: a weight
  # crossing zero or shrinking more than twofold in one step).
  missed = new_p != x.astype(dtype)
  assert missed.sum() > 10
  assert (np.abs(new_c.astype(F32)) > np.abs(new_p.astype(F32)) * 2.0**-7)[missed].any()
  # Where old and new param are within a factor of two (Sterbenz), new_p is
  # exactly the rounding of x: every ordinary step (those not right after a
  # miss, when the buffer holds a large part of the weight).
  sterbenz = _exact_by_sterbenz(p, x.astype(dtype))
  assert not missed[sterbenz].any() and sterbenz[~jump].mean() > 0.99


@pytest.mark.parametrize(("dtype", "unit"), [(jnp.bfloat16, 2.0**-8), (jnp.float16, 2.0**-11)])
def test_kahan_tracks_the_float64_sum(dtype, unit):
  rng = np.random.default_rng(3)
  steps, size = 1000, 256
  start = rng.uniform(0.5, 2, size)
  u = (rng.normal(size=(steps, size)) * 1e-4).astype(F32)
  params, state = _scan(
    mpx.with_kahan_summation(optax.sgd(1.0)),
    {"w": jnp.asarray(start, F32).astype(dtype)},
    {"w": -u},
  )
  w = np.asarray(params["w"], np.float64) + np.asarray(state.compensation["w"], np.float64)
  exact = np.asarray(jnp.asarray(start, F32).astype(dtype), np.float64) + u.astype(np.float64).sum(
    0
  )
  # Per step: x rounds once in float32 and c once in the param dtype (<= unit**2 |w|).
  bound = steps * (unit**2 + 2.0**-24) * np.abs(exact).max()
  assert np.abs(w - exact).max() <= bound
  plain = np.asarray(jnp.asarray(start, F32).astype(dtype), np.float64)
  assert np.abs(w - exact).max() < np.abs(plain - exact).max() / 20  # far better than none


def test_kahan_inner_sees_compensated_float32_weights():
  def init_fn(params):
    return params

  def update_fn(updates, state, params=None):
    del state
    return updates, params  # records the weights it was given

  tx = mpx.with_kahan_summation(optax.GradientTransformation(init_fn, update_fn))
  params = {"w": jnp.ones(3, jnp.bfloat16), "s": jnp.ones(2, jnp.float32)}
  state = tx.init(params)
  assert state.inner_state["w"].dtype == jnp.float32
  grads = {"w": jnp.full(3, 1e-3, jnp.float32), "s": jnp.zeros(2, jnp.float32)}
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  _, state2 = tx.update(grads, state, params)
  weight = params["w"].astype(F32) + state.compensation["w"].astype(F32)
  np.testing.assert_array_equal(state2.inner_state["w"], weight)
  assert float(weight[0]) != 1.0 and params["w"][0] == 1.0


# ------------------------------------------------------------------ stochastic rounding


def _round_numpy(x, dtype, uniform):
  near = x.astype(dtype)
  near32 = near.astype(F32)
  toward = np.where(near32 < x, np.inf, -np.inf).astype(dtype)
  other = np.nextafter(near, toward)
  with np.errstate(invalid="ignore", divide="ignore"):
    frac = (x - near32) / (other.astype(F32) - near32)
  return np.where(uniform < frac, other, near)


def test_round_stochastically_edge_cases():
  x = jnp.asarray(
    [1.0, 0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan, 3.3e38, 1 + 2**-9, -(1 + 2**-9)], F32
  )
  for u in (0.0, 0.999):
    r = np.asarray(
      stochastic_rounding.round_stochastically(x, np.dtype(jnp.bfloat16), jnp.full_like(x, u))
    )
    np.testing.assert_array_equal(r[:5], np.asarray(x[:5]).astype(jnp.bfloat16))
    assert np.isnan(r[5]) and np.isfinite(r[6].astype(F32))
    assert _bits(r[2]) == _bits(np.asarray(-0.0, jnp.bfloat16))
  up = stochastic_rounding.round_stochastically(x[7:], np.dtype(jnp.bfloat16), jnp.zeros(2, F32))
  down = stochastic_rounding.round_stochastically(
    x[7:], np.dtype(jnp.bfloat16), jnp.full(2, 0.999, F32)
  )
  np.testing.assert_array_equal(np.asarray(up, F32), [1 + 2**-7, -(1 + 2**-7)])
  np.testing.assert_array_equal(np.asarray(down, F32), [1, -1])


@pytest.mark.parametrize("dtype", HALF)
def test_round_stochastically_is_unbiased(dtype):
  rng = np.random.default_rng(0)
  base = np.asarray(rng.uniform(-4, 4, 64), F32)
  x = jnp.asarray(np.repeat(base[:, None], 20_000, 1))
  r = stochastic_rounding.round_stochastically(
    x, np.dtype(dtype), jax.random.uniform(jax.random.key(1), x.shape)
  )
  r = np.asarray(r, np.float64)
  near = base.astype(dtype).astype(np.float64)
  other = np.nextafter(base.astype(dtype), np.where(near < base, np.inf, -np.inf).astype(dtype))
  gap = np.abs(other.astype(np.float64) - near)
  p = np.abs(base - near) / gap
  assert set(np.unique(r)) <= set(near) | set(other.astype(np.float64))  # the two neighbours
  sd = gap * np.sqrt(p * (1 - p) / x.shape[1])
  assert (np.abs(r.mean(1) - base) <= 5 * sd + 1e-12).all()


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_bitwise_the_numpy_restatement(dtype):
  start, rel, jump, to = _walk(dtype, seed=1)
  key = jax.random.key(42)
  tx = mpx.with_stochastic_rounding(optax.sgd(1.0), key=key)
  params = jnp.asarray(start, F32).astype(dtype)

  def body(carry, xs):
    params, state = carry
    rel, jump, to = xs
    p32 = params.astype(F32)
    u = jax.lax.optimization_barrier(jnp.where(jump, to - p32, p32 * rel))
    updates, new_state = tx.update({"w": -u}, state, {"w": params})
    new_params = optax.apply_updates({"w": params}, updates)["w"]
    return (new_params, new_state), (params, u, new_params, state.count)

  xs = (jnp.asarray(rel, F32), jnp.asarray(jump), jnp.asarray(to, F32))
  run = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init({"w": p})), xs)[1])
  p, u, new_p, counts = (np.asarray(a) for a in run(params))
  np.testing.assert_array_equal(counts, np.arange(len(counts)))
  # The documented stream: fold_in(key, leaf index), then the step count.
  leaf_key = jax.random.fold_in(key, 0)
  uniform = np.stack(
    [jax.random.uniform(jax.random.fold_in(leaf_key, k), (p.shape[1],)) for k in counts]
  )
  target = _round_numpy(p.astype(F32) + u, dtype, uniform)
  diff = target.astype(np.float64) - p.astype(np.float64)
  with np.errstate(over="ignore"):
    representable = diff.astype(dtype).astype(np.float64) == diff
  # optax.apply_updates lands on the stochastically rounded value wherever the
  # move is representable, which includes every ordinary step (Sterbenz).
  np.testing.assert_array_equal(_bits(new_p[representable]), _bits(target[representable]))
  sterbenz = _exact_by_sterbenz(p, target)
  assert representable[sterbenz].all() and sterbenz[~jump].all()
  assert (~representable).sum() > 10  # jumps across zero exist, and there it may miss
  missed = new_p != target
  assert missed.any() and not missed[sterbenz].any()


def test_stochastic_rounding_streams_differ_by_leaf_and_step_and_repeat_by_key():
  params = {"a": jnp.ones(4096, jnp.bfloat16), "b": jnp.ones(4096, jnp.bfloat16)}
  grads = {"a": jnp.full((2, 4096), -1e-3), "b": jnp.full((2, 4096), -1e-3)}

  def first_two(key):
    tx = mpx.with_stochastic_rounding(optax.sgd(1.0), key=key)
    state = tx.init(params)
    out = []
    for k in range(2):
      updates, state = tx.update({n: g[k] for n, g in grads.items()}, state, params)
      out.append(updates)
    return out

  one, again = first_two(jax.random.key(5)), first_two(jax.random.key(5))
  raw = first_two(jax.random.PRNGKey(5))
  other = first_two(jax.random.key(6))
  chex.assert_trees_all_equal(one, again)
  chex.assert_trees_all_equal(one, raw)
  moved = [{n: np.asarray(u[n]) != 0 for n in u} for u in one]
  assert 0.05 < moved[0]["a"].mean() < 0.2  # about 1e-3 / 2**-7 = 12.8%
  assert (moved[0]["a"] != moved[0]["b"]).any()  # per leaf
  assert (moved[0]["a"] != moved[1]["a"]).any()  # per step
  assert (moved[0]["a"] != (np.asarray(other[0]["a"]) != 0)).any()  # per key


@pytest.mark.parametrize("key", [jax.random.split(jax.random.key(0)), jnp.zeros(3, jnp.uint32), 0])
def test_stochastic_rounding_bad_key(key):
  with pytest.raises(mpx.ConfigError, match=r"jax.random.key\(seed\)"):
    mpx.with_stochastic_rounding(optax.sgd(1.0), key=key)


# ------------------------------------------------------------------ state, jit, cond


@pytest.mark.parametrize("wrap", WRAPPERS)
@pytest.mark.parametrize("dtype", ALL)
def test_state_layout_and_round_trip(wrap, dtype):
  params = _params(dtype)
  tx = wrap(standard_promotion(optax.masked(optax.adam(1e-3), _float_mask(params))))
  state = tx.init(params)
  buffers = state.compensation if wrap is _kahan else state.keys
  half = dtype != jnp.float32
  assert (buffers["dense"]["kernel"] is not None) == half
  assert buffers["norm_scale"] is None and buffers["step"] is None
  if half and wrap is _kahan:
    chex.assert_trees_all_equal(buffers["dense"], jax.tree.map(jnp.zeros_like, params["dense"]))
  if half and wrap is _rounding:
    assert buffers["dense"]["kernel"].dtype == jnp.uint32
    assert state.count.dtype == jnp.int32
  adam = state.inner_state.inner_state[0]
  for moment in (adam.mu, adam.nu):
    assert {leaf.dtype for leaf in jax.tree.leaves(moment)} == {np.dtype(F32)}
  # No masters: mpx.apply_updates is optax.apply_updates.
  masters = half_params.find_master_params(state)
  assert masters is not None and jax.tree.leaves(masters) == []
  again = jax.tree.map(lambda x: x, state)
  assert type(again) is type(state)
  chex.assert_trees_all_equal(again, state)


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPPERS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("use_jit", [False, True])
def test_update_keeps_dtypes(wrap, dtype, use_jit):
  params = _params(dtype)
  tx = wrap(standard_promotion(optax.masked(optax.adamw(1e-2), _float_mask(params))))
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  grads["step"] = jnp.zeros((), jnp.int32)
  update = jax.jit(tx.update) if use_jit else tx.update
  updates, new_state = update(grads, state, params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  new_params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(mpx.apply_updates(params, updates), new_params)
  assert new_params["step"] == 7
  # Float32 leaves see plain adamw.
  plain = standard_promotion(optax.adamw(1e-2))
  plain_updates, _ = plain.update(
    grads["norm_scale"], plain.init(params["norm_scale"]), params["norm_scale"]
  )
  chex.assert_trees_all_close(updates["norm_scale"], plain_updates, rtol=1e-6)
  # Dtypes are stable under cond (no retrace, no crash in scan).
  step = jax.jit(
    lambda flag, s: jax.lax.cond(flag, lambda s: tx.update(grads, s, params)[1], lambda s: s, s)
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(step(True, state), state)


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_skipped_step_leaves_buffers_and_keys_untouched(wrap):
  params = {"w": jnp.full(4, 0.5, jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
  tx = mpx.dynamic_loss_scale(wrap(standard_promotion(optax.adam(1e-3))))
  state = tx.init(params)  # filterwarnings=error: no "no float32 masters" warning
  scale = state.loss_scale
  grads = {"w": jnp.full(4, 1e-3, jnp.bfloat16) * scale.astype(jnp.bfloat16), "b": jnp.ones(2)}
  for _ in range(3):  # non-zero buffers, moments and count
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  bad = dict(grads, w=grads["w"].at[1].set(jnp.inf))
  updates, new_state = tx.update(bad, state, params)
  assert int(new_state.skipped_steps) == 1
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
  chex.assert_trees_all_equal(mpx.apply_updates(params, updates), params)
  if wrap is _kahan:
    assert (np.asarray(state.inner_state.compensation["w"]) != 0).any()
  else:
    assert int(new_state.inner_state.count) == 3


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_extra_args_and_missing_params(wrap):
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, factor):
    del params
    return jax.tree.map(lambda g: g * factor, updates), state

  tx = wrap(optax.GradientTransformationExtraArgs(init_fn, update_fn))
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  state = tx.init(params)
  updates, _ = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params, factor=jnp.float32(0.5))
  np.testing.assert_array_equal(np.asarray(updates["w"], F32), [0.5, 0.5])
  with pytest.raises(mpx.ConfigError, match=r"tx.update\(grads, opt_state, params\)"):
    tx.update(params, state)
  with pytest.raises(mpx.TreeStructureError, match="'v'"):
    tx.update({"v": jnp.ones(2, jnp.bfloat16)}, state, params)


# ------------------------------------------------------------------ with mpx.mixed_precision


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_mixed_precision_composition(wrap):
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
  tx = mpx.mixed_precision(wrap(optax.sgd(0.1)), "bfloat16", master_dtype=None)
  state = tx.init(params)  # no PrecisionWarning: the small updates are kept
  mpx.check_state(state, params, "bfloat16", master_dtype=None)
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  chex.assert_trees_all_equal(
    mpx.apply_updates(params, updates), optax.apply_updates(params, updates)
  )
  with_masters = mpx.mixed_precision(wrap(optax.sgd(0.1)), "bfloat16")
  with pytest.raises(mpx.StateError, match=r"master_dtype=None"):
    with_masters.init(params)
  with pytest.raises(mpx.StateError, match=r"instead of float32 masters.*master_dtype=None"):
    mpx.check_state(state, params, "bfloat16")


def test_check_state_catches_compensation_that_does_not_fit():
  params = {"layer": {"w": jnp.ones(3, jnp.bfloat16)}, "b": jnp.zeros(2, jnp.float32)}
  tx = mpx.mixed_precision(_kahan(optax.sgd(0.1)), "bfloat16", master_dtype=None)
  state = tx.init(params)
  comp = state.inner_state.compensation
  wide = state._replace(
    inner_state=state.inner_state._replace(compensation=dict(comp, layer={"w": jnp.zeros(3)}))
  )
  with pytest.raises(
    mpx.StateError, match=r"'layer/w' is bfloat16\[3\] but its compensation is float32\[3\]"
  ):
    mpx.check_state(wide, params, "bfloat16", master_dtype=None)
  with pytest.raises(mpx.StateError, match=r"'layer/w' is bfloat16\[3\] but its compensation"):
    tx.update(params, wide, params)  # update checks at trace time too
  lost = tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))  # built for f32 params
  with pytest.raises(mpx.StateError, match=r"'layer/w' has dtype bfloat16 but .* no compensation"):
    mpx.check_state(lost, params, "bfloat16", master_dtype=None)
  rounding = mpx.with_stochastic_rounding(optax.sgd(0.1), key=jax.random.key(0))
  other = rounding.init({"v": jnp.ones(3, jnp.bfloat16)})
  with pytest.raises(mpx.StateError, match=r"rounding key tree .* tree structure"):
    mpx.check_state(other, {"w": jnp.ones(3, jnp.bfloat16)}, "bfloat16", master_dtype=None)
  rbg = mpx.with_stochastic_rounding(optax.sgd(0.1), key=jax.random.key(0, impl="rbg"))
  with pytest.raises(mpx.StateError, match=r"shape \[2\].*\(rbg\) have shape \[4\]"):
    rbg.update(params, rounding.init(params), params)


@pytest.mark.slow
def test_training_keeps_what_nearest_rounding_loses():
  """Digits MLP, 150 adam steps at lr 1e-3, bfloat16 params (benchmarks/compensated_training.py).

  Measured (2-core x86-64 CPU, jax 0.10.2), final loss on all images: float32 masters 0.5149,
  Kahan 0.5149, stochastic rounding 0.5137, nearest rounding 0.5690 (at 400 steps 0.1728,
  0.1728, 0.1732 and 0.2883, docs/memory.md).
  """
  rows = compensated_training._rows(0)
  with jax.numpy_dtype_promotion("standard"):  # the benchmark runs optax's adam as users do
    loss = {
      name: compensated_training.train(*rows[name], lr=1e-3, steps=150)["final_loss"]
      for name in (
        "bf16 params + f32 masters (b)",
        "bf16, nearest",
        "bf16, Kahan",
        "bf16, stochastic rounding",
      )
    }
  masters = loss.pop("bf16 params + f32 masters (b)")
  assert abs(loss["bf16, Kahan"] - masters) < 0.002
  assert abs(loss["bf16, stochastic rounding"] - masters) < 0.01
  assert loss["bf16, nearest"] > masters + 0.03


# ------------------------------------------------------------------ checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPPERS)
def test_orbax_round_trip_resumes_bitwise(wrap, tmp_path):
  params = {
    "dense": {"kernel": jnp.linspace(-1, 1, 12).reshape(3, 4), "bias": jnp.zeros(4)},
    "scale": jnp.ones(4),
  }
  params = mpx.get_policy(BF16).cast_to_param(params)
  params["scale"] = params["scale"].astype(jnp.float32)
  tx = mpx.mixed_precision(wrap(standard_promotion(optax.adamw(1e-2))), BF16, master_dtype=None)

  @jax.jit
  def step(params, state, seed):
    grads = jax.tree.map(
      lambda p: (jax.random.normal(jax.random.key(seed), p.shape) * 1e-3).astype(p.dtype), params
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for seed in range(3):
    params, state = step(params, state, seed)
  target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  restored = round_trip(tmp_path, {"params": params, "opt_state": state}, target)
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  assert type(restored["opt_state"].inner_state) is type(state.inner_state)
  mpx.check_state(
    restored["opt_state"], restored["params"], BF16, master_dtype=None, state_dtype=jnp.float32
  )
  chex.assert_trees_all_equal(
    step(restored["params"], restored["opt_state"], 7), step(params, state, 7)
  )
