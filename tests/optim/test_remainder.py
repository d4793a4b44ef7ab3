"""Tests for remainder masters: ``mpx.with_master_params(inner, remainder=True)``.

The float32 master of a bfloat16 param is ``(param_bits << 16) + remainder``:
the split is checked over arbitrary float32 bit patterns, and the optimizer
against layout (b) (bfloat16 params with float32 masters), bit for bit.
"""

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoints import round_trip
from hypothesis import strategies as st
from optax_compat import standard_promotion

import mpx
from mpx._src.optim import remainder

BF16 = "params=bfloat16,compute=bfloat16,output=float32"

SPECIAL_BITS = [
  0x00000000,  # +0
  0x80000000,  # -0
  0x00000001,  # smallest subnormal
  0x80008000,  # a negative subnormal halfway between two bfloat16 subnormals
  0x007F8000,  # halfway below the smallest normal: rounds up into the next binade
  0x3F808000,  # 1.0039...: halfway, even lower neighbour (astype rounds down)
  0x3F818000,  # halfway, odd lower neighbour (astype rounds up too)
  0x3F7FFFFF,  # just below 1.0: rounds up to the next binade
  0x7F7F7FFF,  # largest float32 that rounds to a finite bfloat16
  0x7F7F8000,  # rounds to inf
  0x7F7FFFFF,  # float32 max
  0x7F800000,  # inf
  0xFF800000,  # -inf
  0x7FC00000,  # NaN
  0xFFC00001,  # negative NaN with a payload
  0x7F800001,  # signalling NaN whose payload lies in the low half only
  0x7FFF8000,  # NaN whose rounding would carry into the sign bit
]


def _floats(bits):
  return np.asarray(bits, np.uint32).view(np.float32)


def _check_split(bits):
  master = _floats(bits)
  param, rem = jax.device_get(remainder.split(jnp.asarray(master)))
  back = np.asarray(remainder.join(jnp.asarray(param), jnp.asarray(rem)))
  nan = np.isnan(master)
  # Exact for every float32 number, subnormals, zeros and infinities included.
  np.testing.assert_array_equal(back[~nan].view(np.uint32), np.asarray(bits, np.uint32)[~nan])
  assert np.isnan(back[nan]).all() and np.isnan(param.astype(np.float32)[nan]).all()
  # The param is the nearest bfloat16 number; only exact halfway cases with an even lower
  # neighbour round away from zero where astype rounds to even.
  cast = np.asarray(jnp.asarray(master).astype(jnp.bfloat16))
  differ = (param.view(np.uint16) != cast.view(np.uint16)) & ~nan
  b = np.asarray(bits, np.uint32)
  halfway_even = ((b & 0xFFFF) == 0x8000) & ((b >> 16) % 2 == 0)
  np.testing.assert_array_equal(differ, halfway_even & ~nan)
  np.testing.assert_array_equal(param.view(np.uint16)[differ], cast.view(np.uint16)[differ] + 1)


def test_split_is_exact_on_special_values():
  _check_split(SPECIAL_BITS)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64))  # one shape
def test_split_is_exact_on_arbitrary_float32_bits(bits):
  _check_split(bits + SPECIAL_BITS)


def test_split_is_exact_on_a_million_random_values():
  bits = np.random.default_rng(0).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
  _check_split(bits)


def test_remainder_toward_an_unreachable_master_stays_finite_and_nearest():
  params = jnp.array([0.0, -0.0, jnp.inf, 1.0], jnp.bfloat16)
  masters = jnp.array([-1e-3, 1e-3, 1.0, 3.0], jnp.float32)
  got = remainder.join(params, remainder.remainder_toward(masters, params))
  assert not jnp.isnan(got).any()
  # +0 cannot reach a negative master, -0 a positive one, 1.0 not 3.0: the nearest they can.
  np.testing.assert_array_equal(got[:2], [0.0, -0.0])
  assert float(got[3]) == float(remainder.join(params[3:], jnp.array([32767], jnp.int16))[0])
  assert float(got[2]) > 3e38


# ------------------------------------------------------------------ the optimizer


SEED = 10


def _tx(remainder_masters, lr=1e-2, moments=None):
  inner = standard_promotion(optax.adamw(lr, weight_decay=1e-2))
  if moments:
    inner = mpx.with_state_dtype(inner, state_dtype=moments)
  if remainder_masters:
    return mpx.mixed_precision(
      mpx.with_master_params(inner, remainder=True), BF16, master_dtype=None
    )
  return mpx.mixed_precision(inner, BF16)


def _masters(state, params):
  return mpx.get_master_params(state, params)


@pytest.mark.slow
def test_same_gradients_give_bitwise_the_masters_of_layout_b_for_200_steps():
  """Fed the same gradients, remainder masters and layout (b)'s float32 masters never differ.

  The params differ only where a master lies exactly halfway between two bfloat16 numbers
  with an even lower neighbour (about 1 in 2**17 element-steps): layout (b) rounds it to
  even, the remainder layout away from zero.
  """
  n = 16384
  key = jax.random.key(0)
  p0 = {"w": (jax.random.normal(key, (n,)) * 0.02).astype(jnp.bfloat16)}
  grads = jax.random.normal(jax.random.key(1), (200, n)) * 0.1

  def run(tx):
    def step(carry, g):
      params, state = carry
      updates, state = tx.update({"w": g.astype(jnp.bfloat16)}, state, params)
      params = mpx.apply_updates(params, updates)
      return (params, state), (params["w"], _masters(state, params)["w"])

    return jax.lax.scan(step, (p0, tx.init(p0)), grads)[1]

  params_b, masters_b = jax.jit(lambda: run(_tx(False)))()
  params_r, masters_r = jax.jit(lambda: run(_tx(True)))()
  np.testing.assert_array_equal(
    np.asarray(masters_r).view(np.uint32), np.asarray(masters_b).view(np.uint32)
  )
  bits = np.asarray(masters_b).view(np.uint32)
  halfway_even = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0)
  differ = np.asarray(params_r).view(np.uint16) != np.asarray(params_b).view(np.uint16)
  np.testing.assert_array_equal(differ, halfway_even)
  assert 0 < halfway_even.sum() < 200  # about n * 200 / 2**17 = 25 such element-steps
  # Weights crossed zero: a bfloat16 update could not have landed them exactly.
  crossed = np.signbit(np.asarray(params_b)[1:]) != np.signbit(np.asarray(params_b)[:-1])
  assert crossed.sum() > 100


def test_training_is_bitwise_layout_b_for_200_steps(seed=SEED):
  """A bfloat16 MLP trained on its own gradients: params and masters bitwise layout (b)'s."""
  x = jax.random.normal(jax.random.key(seed), (64, 16))
  y = jnp.sin(x @ jax.random.normal(jax.random.key(3), (16, 1)))
  p0 = {
    "w1": jax.random.normal(jax.random.key(4), (16, 16)) * 0.3,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(jax.random.key(5), (16, 1)) * 0.3,
  }
  p0 = mpx.get_policy(BF16).cast_to_param(p0)

  def loss(p):
    h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)

  def run(tx):
    def step(carry, _):
      params, state = carry
      grads = jax.grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      params = mpx.apply_updates(params, updates)
      return (params, state), (params, _masters(state, params), loss(params))

    return jax.lax.scan(step, (p0, tx.init(p0)), None, length=200)[1]

  params_b, masters_b, _ = jax.jit(lambda: run(_tx(False, lr=3e-3)))()
  params_r, masters_r, losses_r = jax.jit(lambda: run(_tx(True, lr=3e-3)))()
  # The precondition of bitwise equality: no master of layout (b) ever lay on a halfway
  # point with an even lower neighbour (checked, not assumed; about 0.4 such element-steps
  # are expected in this run, and these seeds have none).
  for m in jax.tree.leaves(masters_b):
    bits = np.asarray(m).view(np.uint32)
    assert not (((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0)).any(), "pick other seeds"
  chex.assert_trees_all_equal(params_r, params_b)
  chex.assert_trees_all_equal(masters_r, masters_b)
  assert float(losses_r[-1]) < 0.5 * float(losses_r[0])
  crossed = sum(
    int((np.signbit(np.asarray(p)[1:]) != np.signbit(np.asarray(p)[:-1])).sum())
    for p in jax.tree.leaves(params_b)
  )
  assert crossed > 0  # the float32 updates landed weights that crossed zero


@pytest.mark.slow
def test_state_holds_an_int16_remainder_per_bfloat16_param_only():
  params = {"w": jnp.ones((4, 3), jnp.bfloat16), "scale": jnp.ones(3)}
  tx = mpx.with_master_params(standard_promotion(optax.adam(1e-3)), remainder=True)
  state = tx.init(params)
  assert isinstance(state, mpx.RemainderMastersState)
  assert state.remainders["w"].dtype == jnp.int16 and state.remainders["w"].shape == (4, 3)
  assert state.remainders["scale"] is None
  assert state.inner_state[0].mu["w"].dtype == jnp.float32
  # Every field survives a pytree round trip.
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
  updates, new_state = tx.update(grads, state, params)
  assert updates["w"].dtype == jnp.float32  # lands crossing weights exactly, see the docstring
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  # optax.apply_updates (standard promotion, as in nnx.Optimizer) and mpx.apply_updates agree.
  with jax.numpy_dtype_promotion("standard"):
    via_optax = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(via_optax, mpx.apply_updates(params, updates))


@pytest.mark.slow
def test_remainder_and_int8_moments_cost_at_most_6_1_bytes_per_param():
  params = {"w": jnp.zeros((256, 256), jnp.bfloat16), "v": jnp.zeros((4096 * 3,), jnp.bfloat16)}
  tx = _tx(True, moments="int8")
  state = tx.init(params)
  count = sum(p.size for p in jax.tree.leaves(params))
  nbytes = sum(x.nbytes for x in jax.tree.leaves((params, state)))
  assert nbytes / count <= 6.1, nbytes / count
  assert nbytes / count >= 6.0


def test_errors():
  with pytest.raises(mpx.ConfigError, match=r"'w' has dtype float16.*bfloat16 params only"):
    mpx.with_master_params(optax.sgd(1.0), remainder=True).init({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(mpx.ConfigError, match=r"remainder=True, master_dtype=float64"):
    mpx.with_master_params(optax.sgd(1.0), remainder=True, master_dtype=jnp.float64)
  tx = mpx.with_master_params(optax.sgd(1.0), remainder=True)
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  state = tx.init(params)
  with pytest.raises(mpx.ConfigError, match="called without them"):
    tx.update(params, state)
  bad = state._replace(remainders={"w": jnp.zeros(2, jnp.int32)})
  with pytest.raises(mpx.StateError, match=r"'w' is bfloat16\[2\] but its remainder is int32"):
    tx.update(params, bad, params)
  with pytest.raises(mpx.StateError, match=r"'w' has dtype bfloat16 but .* holds no remainder"):
    tx.update(params, state._replace(remainders={"w": None}), params)
  # Beside layout (b)'s masters: two states keep the half params, which one is ambiguous.
  with pytest.raises(mpx.StateError, match="ambiguous"):
    mpx.mixed_precision(mpx.with_master_params(optax.sgd(1.0), remainder=True), BF16).init(params)


@pytest.mark.slow
def test_check_state_and_orbax_round_trip_resume_bitwise(tmp_path):
  params = mpx.get_policy(BF16).cast_to_param(
    {"w": jnp.linspace(-1, 1, 8192).reshape(64, 128), "b": jnp.zeros(128)}
  )
  tx = _tx(True, moments="int8")

  @jax.jit
  def step(params, state, seed):
    grads = jax.tree.map(
      lambda p: (jax.random.normal(jax.random.key(seed), p.shape) * 1e-2).astype(p.dtype), params
    )
    updates, state = tx.update(grads, state, params)
    return mpx.apply_updates(params, updates), state

  state = tx.init(params)
  for seed in range(3):
    params, state = step(params, state, seed)
  mpx.check_state(state, params, BF16, master_dtype=None, state_dtype="int8")
  target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  restored = round_trip(tmp_path, {"params": params, "opt_state": state}, target)
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  assert type(restored["opt_state"].inner_state) is mpx.RemainderMastersState
  mpx.check_state(
    restored["opt_state"], restored["params"], BF16, master_dtype=None, state_dtype="int8"
  )
  chex.assert_trees_all_equal(
    step(restored["params"], restored["opt_state"], 7), step(params, state, 7)
  )
