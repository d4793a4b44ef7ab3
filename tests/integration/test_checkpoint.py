"""Orbax round trips of half params with float32 masters (layout (b))."""

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import mpx

POLICY = "params=float16,compute=float16,output=float32"


def _setup():
  params = {
    "dense": {"kernel": jnp.linspace(-1, 1, 12).reshape(3, 4), "bias": jnp.zeros(4)},
    "scale": jnp.ones(4),
  }
  params = mpx.get_policy(POLICY).cast_to_param(params)
  params["scale"] = params["scale"].astype(jnp.float32)  # a leaf kept in float32
  tx = mpx.mixed_precision(optax.sgd(0.1, momentum=0.9), POLICY)
  return params, tx


def _step(tx, params, state, seed):
  grads = jax.tree.map(
    lambda p: (jax.random.normal(jax.random.key(seed), p.shape) * 1e-3).astype(p.dtype), params
  )
  grads = jax.tree.map(lambda g: g * mpx.get_loss_scale(state).astype(g.dtype), grads)
  updates, state = tx.update(grads, state, params)
  return mpx.apply_updates(params, updates), state


def _trained():
  params, tx = _setup()
  state = tx.init(params)
  step = jax.jit(lambda p, s, seed: _step(tx, p, s, seed))
  for seed in range(3):
    params, state = step(params, state, seed)
  return params, state, tx


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  params, state, tx = _trained()
  path = tmp_path_factory.mktemp("orbax") / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": params, "opt_state": state})
    ckpt.wait_until_finished()
  return path, params, state, tx


def _restore(path, target=None):
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(path, target)


@pytest.mark.slow
def test_restore_keeps_masters_and_half_params(saved):
  path, params, state, tx = saved
  restored = _restore(
    path, jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  )
  chex.assert_trees_all_equal(restored["params"], params)
  chex.assert_trees_all_equal(restored["opt_state"], state)
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  masters = restored["opt_state"].inner_state.master_params
  assert masters["scale"] is None and masters["dense"]["kernel"].dtype == jnp.float32
  mpx.check_state(restored["opt_state"], restored["params"], POLICY)
  # Training resumes bitwise where it stopped.
  chex.assert_trees_all_equal(
    _step(tx, restored["params"], restored["opt_state"], 7), _step(tx, params, state, 7)
  )


def test_restore_without_target_lost_masters(saved):
  restored = _restore(saved[0])  # plain dicts and lists: the state types are gone
  with pytest.raises(mpx.StateError, match=r"restored without a target.*target=jax\.eval_shape"):
    mpx.check_state(restored["opt_state"], restored["params"], POLICY)


def test_restore_without_target_of_float32_params_is_caught(tmp_path):
  params = {"w": jnp.ones(3)}
  tx = mpx.mixed_precision(optax.sgd(0.1, momentum=0.9), "mixed_float16")
  state = tx.init(params)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()
  untyped = _restore(tmp_path / "ckpt")
  with pytest.raises(mpx.StateError, match="restored without a target"):
    mpx.check_state(untyped, params, "mixed_float16")
  with pytest.raises(mpx.StateError, match="restored without a target"):
    tx.update(params, untyped, params)
  # The advice works: a target built by tx.init restores the state types.
  restored = _restore(tmp_path / "ckpt", jax.eval_shape(tx.init, params))
  mpx.check_state(restored, params, "mixed_float16")
  chex.assert_trees_all_equal(restored, state)


def test_restore_under_another_policy(saved):
  path, params, state, _ = saved
  restored = _restore(path, jax.eval_shape(lambda: {"params": params, "opt_state": state}))
  with pytest.raises(mpx.StateError, match="stores params in float32"):
    mpx.check_state(restored["opt_state"], restored["params"], "mixed_float16")
  with pytest.raises(mpx.StateError, match="bfloat16"):
    mpx.check_state(restored["opt_state"], restored["params"], "bfloat16")
