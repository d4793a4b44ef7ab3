"""Tests for mpx.mixed_precision and mpx.check_state: layouts (a) and (b) on real data."""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax_compat import standard_promotion
from sklearn.datasets import load_digits

import mpx


class MLP(nn.Module):
  """Plain Flax: the policy reaches the layers through mpx.linen.apply_policy."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


@functools.cache
def _digits():
  x, y = load_digits(return_X_y=True)
  return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y, jnp.int32)


def _train(policy, *, loss_scale="dynamic", steps=150, batch=128):
  policy = mpx.get_policy(policy)
  x, y = _digits()
  model = mpx.linen.apply_policy(MLP(), policy)
  params = model.init(jax.random.key(0), x[:1])["params"]
  tx = mpx.mixed_precision(standard_promotion(optax.adam(3e-3)), policy, loss_scale=loss_scale)
  order = jax.random.permutation(jax.random.key(1), steps * batch) % x.shape[0]

  def step(carry, idx):
    params, opt_state = carry

    def loss_fn(p):
      logits = model.apply({"params": p}, x[idx])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean()

    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (mpx.apply_updates(params, updates), opt_state), loss

  (params, opt_state), losses = jax.jit(
    lambda c: jax.lax.scan(step, c, order.reshape(steps, batch))
  )((params, tx.init(params)))
  return params, opt_state, np.asarray(losses)


@functools.cache
def _float32_losses():
  return _train("float32")[2]


@pytest.mark.slow
@pytest.mark.parametrize(
  ("policy", "tolerance"),
  [
    # Measured (benchmarks/precision_tracking.py): last-20 mean within 1e-4 (f16) and
    # 3e-4 (bf16), every step from 30 on within 5e-4 and 2.7e-3; tolerances ~10x that.
    ("mixed_float16", 0.002),  # layout (a)
    ("mixed_bfloat16", 0.005),  # layout (a)
    ("params=float16,compute=float16,output=float32", 0.002),  # layout (b)
    ("params=bfloat16,compute=bfloat16,output=float32", 0.005),  # layout (b)
  ],
)
def test_loss_curve_matches_float32(policy, tolerance):
  params, opt_state, losses = _train(policy)
  reference = _float32_losses()
  assert reference[-10:].mean() < 0.35 * reference[:10].mean()  # it does learn
  # Per-step losses track the float32 run (same data order; half params start
  # at the rounding of the float32 init) once float16's dynamic scale has
  # settled: its first steps may overflow and be skipped.
  np.testing.assert_allclose(losses[30:], reference[30:], atol=tolerance * 5, rtol=0)
  assert abs(losses[-20:].mean() - reference[-20:].mean()) < tolerance
  want = mpx.get_policy(policy).param_dtype
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {want}
  mpx.check_state(opt_state, params, policy)
  if want == jnp.float32:
    # layout (a): the masters wrapper holds no copy of a float32 param
    assert jax.tree.leaves(opt_state.inner_state.master_params) == []
  else:
    masters = opt_state.inner_state.master_params
    chex.assert_trees_all_equal(params, jax.tree.map(lambda m: m.astype(want), masters))


def test_without_masters_float16_training_stalls():
  tx = mpx.mixed_precision(optax.sgd(1.0), "float16", master_dtype=None)
  params = {"w": jnp.ones((), jnp.float16)}
  with pytest.warns(mpx.PrecisionWarning, match=r"'w'.*master_dtype=jnp.float32"):
    state = tx.init(params)
  scale = mpx.get_loss_scale(state)
  for _ in range(5):
    grads = {"w": (jnp.float32(-1e-4) * scale).astype(jnp.float16)}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert params["w"] == 1.0


@pytest.mark.parametrize(
  ("policy", "loss_scale", "scaled", "masters"),
  [
    ("float32", "dynamic", False, False),
    ("mixed_bfloat16", "dynamic", False, False),
    ("bfloat16", "dynamic", False, True),
    ("mixed_float16", "dynamic", True, False),
    ("float16", "dynamic", True, True),
    ("mixed_bfloat16", "torch", True, False),
    ("float16", 1024.0, True, True),
    ("float16", None, False, True),
    ("float16", functools.partial(mpx.dynamic_loss_scale, initial_scale=8.0), True, True),
  ],
)
def test_composition(policy, loss_scale, scaled, masters):
  tx = mpx.mixed_precision(optax.sgd(0.1), policy, loss_scale=loss_scale)
  dtype = mpx.get_policy(policy).param_dtype
  params = {"w": jnp.ones(3, dtype), "b": jnp.zeros(2, jnp.float32)}
  if loss_scale is None:  # float16 without loss scaling warns
    with pytest.warns(mpx.PrecisionWarning, match="loss_scale=None"):
      state = tx.init(params)
  else:
    state = tx.init(params)
  assert isinstance(state, mpx.LossScaleState)
  assert (float(state.loss_scale) != 1.0) == scaled
  assert isinstance(state.inner_state, mpx.MasterParamsState)
  # Copies exist exactly for the half-precision params.
  assert bool(jax.tree.leaves(state.inner_state.master_params)) == masters
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * state.loss_scale.astype(p.dtype), params)
  updates, _new_state = jax.jit(tx.update)(grads, state, params)
  new_params = mpx.apply_updates(params, updates)
  chex.assert_trees_all_equal_dtypes(new_params, params)
  chex.assert_trees_all_close(new_params["w"], jnp.full(3, 0.9, dtype), rtol=1e-2)


def test_skipped_step_leaves_masters_untouched():
  tx = mpx.mixed_precision(optax.sgd(0.1), "float16")
  params = {"w": jnp.ones(2, jnp.float16)}
  state = tx.init(params)
  updates, new_state = tx.update({"w": jnp.array([1.0, jnp.inf], jnp.float16)}, state, params)
  assert int(new_state.skipped_steps) == 1
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(mpx.apply_updates(params, updates), params)
  with jax.numpy_dtype_promotion("standard"):  # float32 updates of float16 params
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)


@pytest.mark.parametrize("loss_scale", ["dynamo", -1.0, 0.0, True, object()])
def test_bad_loss_scale(loss_scale):
  with pytest.raises(mpx.ConfigError):
    mpx.mixed_precision(optax.sgd(0.1), "mixed_float16", loss_scale=loss_scale)


def test_check_state_catches_policy_mismatches():
  params16 = {"w": jnp.ones(2, jnp.float16)}
  tx = mpx.mixed_precision(optax.sgd(0.1), "float16")
  state = tx.init(params16)
  mpx.check_state(state, params16, "float16")
  with pytest.raises(mpx.StateError, match=r"'w' has dtype float16, but the policy"):
    mpx.check_state(state, params16, "mixed_float16")
  params32 = {"w": jnp.ones(2, jnp.float32)}
  with pytest.raises(mpx.StateError, match="every floating param is wider"):
    mpx.check_state(state, params32, "float16")
  with pytest.warns(mpx.PrecisionWarning, match="no float32 master copy"):
    no_masters = mpx.mixed_precision(optax.sgd(0.1), "float16", master_dtype=None).init(params16)
  with pytest.raises(mpx.StateError, match="masters were lost"):
    mpx.check_state(no_masters, params16, "float16")
  half_masters = mpx.mixed_precision(optax.sgd(0.1), "float16", master_dtype=jnp.bfloat16)
  with pytest.raises(mpx.ConfigError, match="cannot hold exactly"):
    half_masters.init(params16)


def test_params_narrower_than_the_policy_warn_once_and_keep_masters():
  # float16 params under "mixed_float16" (params float32): the user did call
  # mixed_precision with its defaults; what is wrong is the params' dtype.
  params = {"Dense_0": {"kernel": jnp.ones((2, 2), jnp.float16)}, "b": jnp.zeros(2)}
  tx = mpx.mixed_precision(optax.sgd(1.0), "mixed_float16")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
  assert [str(w.message) for w in caught] == [
    "1 params (e.g. 'Dense_0/kernel', float16) are narrower than the policy's param dtype "
    "float32 (policy params=float32,compute=float16,output=float32): the model was initialised "
    "outside the policy. Float32 masters are kept for them, so training is correct, but the "
    "forward pass reads float16 weights the policy did not ask for. Initialise the model under "
    "the policy (mpx.linen.apply_policy(model, policy).init(...) or "
    "mpx.nnx.apply_policy(model, policy)), cast the params with policy.cast_to_param(params), "
    "or train with a policy whose params are float16 (e.g. "
    "'params=float16,compute=float16,output=float32')."
  ]
  assert caught[0].category is mpx.PrecisionWarning
  # The float16 leaf has a float32 master, so a small update is not rounded away.
  masters = state.inner_state.master_params
  assert masters["Dense_0"]["kernel"].dtype == jnp.float32 and masters["b"] is None
  scale = state.loss_scale
  grads = {
    "Dense_0": {"kernel": jnp.full((2, 2), -1e-4 * scale, jnp.float16)},
    "b": jnp.zeros(2),
  }
  _, state = tx.update(grads, state, params)
  assert float(state.inner_state.master_params["Dense_0"]["kernel"][0, 0]) == np.float32(1.0001)


def test_params_wider_than_the_policy_do_not_warn():
  # Keep rules leave norms in float32 under a float16-params policy: that is fine.
  params = {"kernel": jnp.ones((2, 2), jnp.float16), "norm": {"scale": jnp.ones(2)}}
  tx = mpx.mixed_precision(optax.sgd(1.0), "params=float16,compute=float16,output=float32")
  tx.init(params)  # filterwarnings=error: any warning fails the test


@pytest.mark.parametrize("layout", ["float32", "masters", "kahan", "stochastic", "masked"])
def test_get_master_params(layout):
  half = "params=bfloat16,compute=bfloat16,output=float32"
  sgd = optax.sgd(1.0)
  tx = {
    "float32": lambda: mpx.mixed_precision(sgd, "mixed_bfloat16"),
    "masters": lambda: mpx.mixed_precision(sgd, half),
    "kahan": lambda: mpx.mixed_precision(mpx.with_kahan_summation(sgd), half, master_dtype=None),
    "stochastic": lambda: mpx.mixed_precision(
      mpx.with_stochastic_rounding(sgd, key=jax.random.key(0)), half, master_dtype=None
    ),
    "masked": lambda: optax.masked(mpx.mixed_precision(sgd, half), {"w": True, "b": False}),
  }[layout]()
  dtype = jnp.float32 if layout == "float32" else jnp.bfloat16
  params = {"w": jnp.ones(3, dtype), "b": jnp.full(2, 0.5, jnp.float32)}
  state = tx.init(params)
  grads = {"w": jnp.full(3, 2.0**-12, dtype), "b": jnp.full(2, 0.25, jnp.float32)}
  for _ in range(3):  # each step is below half a bfloat16 ulp of 1
    updates, state = tx.update(grads, state, params)
    params = mpx.apply_updates(params, updates)
  got = mpx.get_master_params(state, params)
  chex.assert_trees_all_equal_dtypes(got, {"w": jnp.ones(3), "b": jnp.ones(2)})
  np.testing.assert_array_equal(got["b"], params["b"])
  if layout == "stochastic":  # its params are the weights
    np.testing.assert_array_equal(got["w"], params["w"].astype(jnp.float32))
  else:  # the float32 weight: 1 - 3 * 2**-12, which bfloat16 params alone cannot hold
    np.testing.assert_array_equal(got["w"], np.full(3, 1 - 3 * 2.0**-12, np.float32))
