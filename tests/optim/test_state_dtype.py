"""Tests for mpx.with_state_dtype (bfloat16 optimizer moments), its check, and bytes per param."""

import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from optax_compat import standard_promotion

import mpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import compensated_training
import memory_table

BF16 = "params=bfloat16,compute=bfloat16,output=float32"


def _bf16(inner):
  return mpx.with_state_dtype(inner, state_dtype=jnp.bfloat16)


def _params():
  return {"dense": {"kernel": jnp.full((3, 2), 0.5), "bias": jnp.zeros(2)}, "scale": jnp.ones(())}


INNERS = {
  "adam": lambda: standard_promotion(optax.adam(1e-2)),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "inject_adamw": lambda: standard_promotion(optax.inject_hyperparams(optax.adamw)(1e-2)),
  "adafactor": lambda: standard_promotion(optax.adafactor(1e-2, min_dim_size_to_factor=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", INNERS)
@pytest.mark.parametrize("use_jit", [False, True])
def test_moments_are_stored_narrow_and_nothing_else(name, use_jit):
  params = _params()
  plain, tx = INNERS[name](), _bf16(INNERS[name]())
  want = jax.eval_shape(plain.init, params)
  state = tx.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(want)

  def expected(w):
    floating = jnp.issubdtype(w.dtype, jnp.floating)
    return jnp.dtype(jnp.bfloat16) if floating and w.ndim > 0 else w.dtype

  chex.assert_trees_all_equal(jax.tree.map(lambda s: s.dtype, state), jax.tree.map(expected, want))
  if name == "inject_adamw":  # a scalar hyperparameter keeps its dtype
    assert state.hyperparams["learning_rate"].dtype == jnp.float32
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  update = jax.jit(tx.update) if use_jit else tx.update
  updates, new_state = update(grads, state, params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, new_state), new_state)
  step = jax.jit(
    lambda flag, s: jax.lax.cond(flag, lambda s: tx.update(grads, s, params)[1], lambda s: s, s)
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(step(True, state), state)


def test_each_step_is_float32_adam_rounded_once():
  """The update is float32 adam's from the stored moments; the moments are its rounding."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64,)), jnp.float32)}
  adam = standard_promotion(optax.adam(1e-2))
  tx = _bf16(adam)
  state = tx.init(params)
  for step in range(20):
    grads = {"w": jnp.asarray(rng.normal(size=(64,)) * 10.0 ** rng.uniform(-3, 1), jnp.float32)}
    state32 = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, state)
    want_updates, want_state = adam.update(grads, state32, params)
    updates, state = tx.update(grads, state, params)
    chex.assert_trees_all_equal(updates, want_updates)  # bitwise
    chex.assert_trees_all_equal(
      state, jax.tree.map(lambda x, s: x.astype(s.dtype), want_state, state)
    )
    if step == 0:  # from zero moments, the first step is float32 adam's exactly
      first, _ = adam.update(grads, adam.init(params), params)
      chex.assert_trees_all_equal(updates, first)


def test_adam_second_moment_does_not_decay_in_bfloat16():
  """The documented limit: with b2 = 0.999, nu * 0.999 rounds back to nu in bfloat16."""
  params = {"w": jnp.ones(4)}
  adam = standard_promotion(optax.adam(1e-3))
  tx, state32 = _bf16(adam), adam.init(params)
  state = tx.init(params)
  grads = {"w": jnp.asarray([1.0, 0.1, 1e-3, 3.0])}
  _, state = tx.update(grads, state, params)
  _, state32 = adam.update(grads, state32, params)
  nu0 = np.asarray(state[0].nu["w"], np.float32)
  zero = jax.tree.map(jnp.zeros_like, grads)
  for _ in range(100):
    _, state = tx.update(zero, state, params)
    _, state32 = adam.update(zero, state32, params)
  np.testing.assert_array_equal(np.asarray(state[0].nu["w"], np.float32), nu0)
  np.testing.assert_allclose(np.asarray(state32[0].nu["w"]), nu0 * 0.999**100, rtol=1e-2)
  assert np.asarray(state[0].mu["w"], np.float32).max() < 1e-4  # mu (b1 = 0.9) does decay


@pytest.mark.slow
def test_training_tracks_float32_moments():
  """Digits MLP, 150 adam steps (lr 1e-3), bfloat16 params with float32 masters.

  Measured (2-core x86-64 CPU, jax 0.10.2): final loss 0.5149 with float32 moments and 0.5150
  with bfloat16 moments at 150 steps (0.1728 and 0.1733 at 400,
  benchmarks/compensated_training.py); tolerance 0.005.
  """
  rows = compensated_training._rows(0)
  with jax.numpy_dtype_promotion("standard"):  # the benchmark runs optax's adam as users do
    f32 = compensated_training.train(*rows["bf16 params + f32 masters (b)"], lr=1e-3, steps=150)
    narrow = compensated_training.train(*rows["f32 masters (b), bf16 moments"], lr=1e-3, steps=150)
  assert narrow["final_loss"] < 0.5 * f32["losses"][0]  # it learns
  assert abs(narrow["final_loss"] - f32["final_loss"]) < 0.005


def test_bytes_per_param():
  rows = {name: memory_table.measure(*spec) for name, spec in memory_table.LAYOUTS.items()}
  total = {name: round(r["total_bytes_per_param"], 2) for name, r in rows.items()}
  assert total["fp32 training"] == 12
  assert total["layout (b): bf16 params + f32 masters"] == 14
  assert total["layout (a): f32 params, bf16 moments"] == 8
  assert total["layout (c): bf16 params + Kahan"] == 12
  assert total["layout (c): bf16 params + stochastic rounding"] == 10
  assert total["layout (c): bf16 params + Kahan, bf16 moments"] == 8
  assert total["layout (c): bf16 params + stoch. rounding, bf16 moments"] == 6


# ------------------------------------------------------------------ wrong state dtypes


def _kahan_run(inner):
  return mpx.mixed_precision(mpx.with_kahan_summation(inner), BF16, master_dtype=None)


def test_update_rejects_moments_of_another_dtype():
  params = {"w": jnp.ones(3)}
  wide = standard_promotion(optax.adam(1e-3)).init(params)
  with pytest.raises(mpx.StateError, match=r"'0/mu/w' is float32\[3\], but this run keeps"):
    _bf16(standard_promotion(optax.adam(1e-3))).update(params, wide, params)


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "run"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_check_state_catches_moments_restored_with_another_optimizers_dtypes(saved, run, tmp_path):
  params = mpx.get_policy(BF16).cast_to_param({"layer": {"w": jnp.linspace(-1, 1, 6)}})

  def tx_for(dtype):
    inner = standard_promotion(optax.adamw(1e-3))
    return _kahan_run(mpx.with_state_dtype(inner, state_dtype=dtype))

  tx_saved, tx_run = tx_for(saved), tx_for(run)
  state = tx_saved.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
  updates, state = tx_saved.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    ckpt.wait_until_finished()

  def restore(tx):
    target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
    with ocp.StandardCheckpointer() as ckpt:
      return ckpt.restore(tmp_path / "ckpt", target)

  # A target built by the saving run's optimizer keeps the saved dtypes: wrong for this run.
  wrong = restore(tx_saved)
  mpx.check_state(wrong["opt_state"], wrong["params"], BF16, master_dtype=None, state_dtype=saved)
  with pytest.raises(
    mpx.StateError,
    match=rf"'inner_state/inner_state/0/mu/layer/w' is {saved}\[6\], but this run keeps its "
    rf"optimizer moments in {run}",
  ):
    mpx.check_state(wrong["opt_state"], wrong["params"], BF16, master_dtype=None, state_dtype=run)
  # This run's own target: orbax casts the moments, and training goes on.
  right = restore(tx_run)
  mpx.check_state(right["opt_state"], right["params"], BF16, master_dtype=None, state_dtype=run)
  updates, new_state = tx_run.update(grads, right["opt_state"], right["params"])
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, right["opt_state"])


def test_masters_are_not_moments():
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = mpx.mixed_precision(_bf16(standard_promotion(optax.adam(1e-3))), BF16)
  state = tx.init(params)
  assert state.inner_state.master_params["w"].dtype == jnp.float32
  mpx.check_state(state, params, BF16, state_dtype=jnp.bfloat16)
  with pytest.raises(mpx.StateError, match=r"'inner_state/inner_state/0/mu/w' is bfloat16"):
    mpx.check_state(state, params, BF16, state_dtype=jnp.float32)


def test_bad_state_dtype():
  with pytest.raises(mpx.PolicyError, match="Unknown dtype name"):
    mpx.with_state_dtype(optax.adam(1e-3), state_dtype="bfloat17")
  with pytest.raises(mpx.PolicyError, match=r"not a dtype a precision policy can use.*'int8'"):
    mpx.with_state_dtype(optax.adam(1e-3), state_dtype=jnp.int16)
  # jnp.int8 names the block-quantised 8-bit moments (tests/optim/test_low_bit.py).
  state = mpx.with_state_dtype(optax.adam(1e-3), state_dtype=jnp.int8).init({"w": jnp.ones(4096)})
  assert isinstance(state[0].mu["w"], mpx.QuantizedMoment)


def test_multisteps_accumulator_stays_float32():
  k = 8
  tx = mpx.with_state_dtype(
    standard_promotion(optax.MultiSteps(optax.sgd(1.0, momentum=0.9), k)), state_dtype=jnp.bfloat16
  )
  params = {"w": jnp.zeros(256)}
  state = tx.init(params)
  assert state.acc_grads["w"].dtype == jnp.float32  # an accumulator, not a moment
  assert state.inner_opt_state[0].trace["w"].dtype == jnp.bfloat16  # a moment
  grads = jax.random.normal(jax.random.key(0), (k, 256)) * (1 + jnp.arange(256) / 7)
  update = jax.jit(tx.update)
  for i in range(k):
    updates, state = update({"w": grads[i]}, state, params)
  assert state.acc_grads["w"].dtype == jnp.float32
  want = -np.mean(np.asarray(grads, np.float64), axis=0)  # sgd(1.0): minus the mean
  np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-5, atol=1e-6)
