"""Loss-scaling transformations: unscaling, the atomic skip, composition, state, errors."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optax_compat import standard_promotion

import mpx

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
NAN = float("nan")


def _bits_equal(a, b):
  """Asserts two trees are bitwise identical (NaN payloads and -0.0 included)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), (x, y)


def _params(dtype=F32):
  return {
    "dense": {"kernel": jnp.array([[0.5, -1.0], [2.0, -0.0]], dtype), "bias": jnp.zeros(2, dtype)},
    "scale": jnp.array([1.5, -0.0, 3.0], dtype),
  }


def _grads(scale, dtype=F32, bad=None):
  g = {
    "dense": {"kernel": jnp.array([[0.25, -0.5], [0.125, 1.0]]), "bias": jnp.array([0.5, -0.25])},
    "scale": jnp.array([0.75, 0.0, -2.0]),
  }
  g = jax.tree.map(lambda x: (x * scale).astype(dtype), g)
  if bad is not None:
    g["scale"] = g["scale"].at[1].set(bad)
  return g


def _maybe_jit(fn, use_jit):
  return jax.jit(fn) if use_jit else fn


# Half params without masters on purpose: only the dtypes of the hand-off are under test.
@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_unscales_in_float32_and_returns_param_dtype(dtype, use_jit):
  seen = []

  def record(updates, params):
    del params
    seen.extend(u.dtype for u in jax.tree.leaves(updates))
    return jax.tree.map(lambda u: -u, updates)

  tx = mpx.dynamic_loss_scale(optax.stateless(record), initial_scale=2.0**10)
  params = _params(dtype)
  updates, state = _maybe_jit(tx.update, use_jit)(_grads(2.0**10, dtype), tx.init(params), params)
  assert set(seen) == {np.dtype(F32)}
  want = jax.tree.map(lambda g: -np.asarray(g, np.float32), _grads(1.0, dtype))
  for u, w, p in zip(
    jax.tree.leaves(updates), jax.tree.leaves(want), jax.tree.leaves(params), strict=True
  ):
    assert u.dtype == p.dtype
    np.testing.assert_array_equal(np.asarray(u, np.float32), w)  # exact: power-of-two scale
  new = optax.apply_updates(params, updates)  # strict promotion: dtypes must already match
  assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, params)
  assert int(state.skipped_steps) == 0 and int(state.growth_tracker) == 1


@pytest.mark.parametrize(
  ("scale", "true"),
  [
    (2.0**-126, [1.5, 2.0**100, -3.0e30]),
    (2.0**-3, [1.5, 2.0**-20, -3.0e-30]),
    (2.0**15, [1.5, 2.0**-20, -3.0e-30]),
    (2.0**126, [1.5, 2.0**-20, -3.0e-30]),
  ],
)
def test_unscaling_is_exact_at_every_power_of_two_up_to_the_bounds(scale, true):
  # jmp's scale reaches 2**127, whose reciprocal is subnormal and flushes to zero;
  # mpx's bounds keep 1 / scale normal, so multiplying by it is exact.
  tx = mpx.static_loss_scale(optax.sgd(1.0), scale)
  params = {"w": jnp.zeros(3)}
  true = np.array(true, np.float32)
  grads = {"w": jnp.asarray(true * np.float32(scale))}
  scaled = np.abs(np.asarray(grads["w"]))
  assert np.all(np.isfinite(scaled)) and np.all(scaled >= np.finfo(np.float32).tiny)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], -true)


def test_a_scale_whose_reciprocal_would_be_subnormal_is_rejected():
  with pytest.raises(mpx.ConfigError, match=r"in \[2\*\*-126, 2\*\*126\]"):
    mpx.static_loss_scale(optax.sgd(1.0), 2.0**127)


def _adamw_chain():
  schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
  return optax.chain(
    optax.clip_by_global_norm(1.0), standard_promotion(optax.adamw(schedule, weight_decay=0.1))
  )


def _run(tx, params, state, grads_seq, use_jit=True):
  step = _maybe_jit(tx.update, use_jit)
  for g in grads_seq:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
@pytest.mark.parametrize(
  "make_inner",
  [_adamw_chain, lambda: optax.chain(_adamw_chain(), standard_promotion(optax.ema(0.9)))],
  ids=["adamw-schedule", "adamw-ema"],
)
def test_skip_is_bitwise_identity(make_inner, bad, use_jit):
  tx = mpx.dynamic_loss_scale(make_inner(), initial_scale=2.0**8)
  params = _params()
  params, state = _run(tx, params, tx.init(params), [_grads(2.0**8)] * 3, use_jit)
  updates, new_state = _maybe_jit(tx.update, use_jit)(_grads(2.0**8, bad=bad), state, params)
  _bits_equal(optax.apply_updates(params, updates), params)  # -0.0 params stay -0.0
  _bits_equal(new_state.inner_state, state.inner_state)  # moments, count, EMA
  counts = optax.tree_utils.tree_get_all_with_path(new_state, "count")
  assert len(counts) >= 2 and all(int(c) == 3 for _, c in counts)  # schedule did not advance
  assert float(new_state.loss_scale) == 2.0**7
  assert (int(new_state.skipped_steps), int(new_state.consecutive_skips)) == (1, 1)


def test_clipping_sees_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  scale = 2.0**12
  grads = {"w": jnp.array([0.3, -0.4])}  # true norm 0.5: not clipped
  params = {"w": jnp.zeros(2)}
  tx = mpx.dynamic_loss_scale(inner, initial_scale=scale)
  updates, _ = tx.update(jax.tree.map(lambda g: g * scale, grads), tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], -grads["w"])
  # Clipping the scaled gradients, then unscaling, would shrink them to norm 1 / scale.
  naive, _ = inner.update(jax.tree.map(lambda g: g * scale, grads), inner.init(params), params)
  assert not np.allclose(naive["w"] / scale, updates["w"])


def test_multisteps_inside_skips_one_mini_step_and_allows_scale_changes():
  k, inner = 3, standard_promotion(optax.MultiSteps(optax.adam(0.1), every_k_schedule=3))
  tx = mpx.dynamic_loss_scale(inner, initial_scale=4.0, growth_interval=1)
  params = {"w": jnp.array([1.0, -2.0])}
  true = [jnp.array([0.5, 1.0]), jnp.array([-0.25, 0.5]), jnp.array([1.0, 2.0])]
  state, step = tx.init(params), jax.jit(tx.update)
  updates = None
  for i, g in enumerate(true):
    scale = mpx.get_loss_scale(state)
    assert float(scale) == 4.0 * 2**i  # grows every finite step, mid-window
    before = state
    updates, state = step({"w": jnp.array([NAN, 1.0])}, state, params)  # a bad mini-batch
    _bits_equal(state.inner_state, before.inner_state)  # mini_step, acc_grads, adam state
    _bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})
    state = state._replace(loss_scale=before.loss_scale, growth_tracker=before.growth_tracker)
    updates, state = step({"w": g * scale}, state, params)
  ref = standard_promotion(optax.MultiSteps(optax.adam(0.1), every_k_schedule=k))
  ref_state = ref.init(params)
  for g in true:
    ref_updates, ref_state = ref.update({"w": g}, ref_state, params)
  np.testing.assert_array_equal(updates["w"], ref_updates["w"])
  assert int(state.skipped_steps) == 3


def test_multisteps_outside_skips_the_window_with_a_constant_scale():
  tx = standard_promotion(
    optax.MultiSteps(mpx.dynamic_loss_scale(optax.adam(0.1), initial_scale=8.0), 2)
  )
  params = {"w": jnp.array([1.0, -2.0])}
  state = tx.init(params)
  adam_before = mpx.loss_scale_metrics(state)
  _, state = tx.update({"w": jnp.array([8.0, NAN])}, state, params)
  assert float(mpx.get_loss_scale(state)) == 8.0  # constant within the window
  updates, state = tx.update({"w": jnp.array([8.0, 8.0])}, state, params)
  _bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})  # the whole window is lost
  assert float(mpx.get_loss_scale(state)) == 4.0
  assert int(mpx.loss_scale_metrics(state)["skipped_steps"]) == 1
  assert adam_before.keys() == mpx.loss_scale_metrics(state).keys()
  assert int(optax.tree_utils.tree_get(state.inner_opt_state.inner_state, "count")) == 0


def test_inject_hyperparams_inside():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  tx = mpx.dynamic_loss_scale(inner, initial_scale=2.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.25)
  updates, state = jax.jit(tx.update)({"w": jnp.array([2.0, 4.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-0.25, -0.5])
  assert float(mpx.get_loss_scale(state)) == 2.0


@pytest.mark.parametrize(
  "wrap",
  [
    lambda ls: optax.chain(optax.scale(1.0), ls),
    lambda ls: optax.named_chain(("decay", optax.add_decayed_weights(0.0)), ("ls", ls)),
    lambda ls: optax.MultiSteps(ls, 2),
    lambda ls: optax.masked(ls, {"w": True}),
    lambda ls: optax.inject_hyperparams(lambda lr: optax.chain(optax.scale(lr), ls))(lr=1.0),
  ],
  ids=["chain", "named_chain", "multisteps", "masked", "inject_hyperparams"],
)
def test_get_loss_scale_finds_nested_state(wrap):
  tx = wrap(mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=64.0))
  state = tx.init({"w": jnp.ones(2)})
  assert float(mpx.get_loss_scale(state)) == 64.0
  assert float(jax.jit(mpx.get_loss_scale)(state)) == 64.0


def test_get_loss_scale_errors():
  with pytest.raises(mpx.StateError, match="contains none"):
    mpx.get_loss_scale(optax.adam(1.0).init({"w": jnp.ones(2)}))
  nested = mpx.dynamic_loss_scale(mpx.static_loss_scale(optax.sgd(1.0), 2.0))
  with pytest.raises(mpx.StateError, match=r"contains 2, at '<root>', 'inner_state'"):
    mpx.get_loss_scale(nested.init({"w": jnp.ones(2)}))


def test_donated_buffers_and_no_retrace():
  tx = mpx.dynamic_loss_scale(_adamw_chain(), initial_scale=2.0**8)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  donating = jax.jit(step, donate_argnums=(0, 1))
  params = _params()
  state = tx.init(params)
  for bad in [None, NAN, None, float("inf"), None]:
    params, state = donating(params, state, _grads(mpx.get_loss_scale(state), bad=bad))
  assert len(traces) == 1
  assert int(state.skipped_steps) == 2


@pytest.mark.parametrize(
  "tx",
  [
    mpx.dynamic_loss_scale(standard_promotion(optax.adamw(1e-3))),
    mpx.static_loss_scale(standard_promotion(optax.adamw(1e-3)), 2.0**4),
    mpx.no_loss_scale(standard_promotion(optax.adamw(1e-3))),
  ],
  ids=["dynamic", "static", "none"],
)
def test_state_is_stable_under_cond(tx):
  params = _params()
  state = tx.init(params)
  grads = _grads(1.0, bad=NAN)
  new = jax.lax.cond(True, lambda: tx.update(grads, state, params)[1], lambda: state)
  assert jax.tree.map(lambda x: (x.dtype, x.shape), new) == jax.tree.map(
    lambda x: (x.dtype, x.shape), state
  )
  assert state.loss_scale.dtype == F32 and state.diverged.dtype == jnp.bool_
  assert state.skipped_steps.dtype == jnp.int32 and state.growth_tracker.dtype == jnp.int32
  assert state.skip_history.dtype == jnp.uint32 and state.nonfinite_leaf.dtype == jnp.int32


def _stepped_state():
  tx = mpx.dynamic_loss_scale(
    standard_promotion(optax.adam(0.1)), preset="deepspeed", min_scale=2.0**14
  )
  params = _params()
  state = tx.init(params)
  for bad in [None, NAN, NAN, NAN, NAN, None]:
    _, state = tx.update(_grads(2.0**10, bad=bad), state, params)
  assert bool(state.diverged) and int(state.consecutive_skips) == 0
  # The attribution fields differ from their initial values, so a round trip that
  # dropped them would be seen.
  assert int(state.skip_history) == 0b11110 and int(state.nonfinite_leaf) == 2  # "scale"
  return state


def test_tree_round_trips_keep_every_field():
  state = _stepped_state()
  _bits_equal(jax.tree.map(lambda x: x, state), state)
  leaves, treedef = jax.tree.flatten(state)
  again = jax.tree.unflatten(treedef, leaves)
  assert type(again) is mpx.LossScaleState
  _bits_equal(again, state)


def test_orbax_round_trip(tmp_path):
  import orbax.checkpoint as ocp  # a test dependency: never skipped

  state = _stepped_state()
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = ckpt.restore(tmp_path / "state", abstract)
  assert type(restored) is mpx.LossScaleState
  _bits_equal(restored, state)


def test_mismatched_grads_name_the_path():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0))
  params = _params()
  grads = {"dense": {"kernel": jnp.ones((2, 2)), "b": jnp.ones(2)}, "scale": jnp.ones(3)}
  with pytest.raises(
    mpx.TreeStructureError, match="'dense/b' is in the gradients but not in the params"
  ):
    tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("make", [mpx.dynamic_loss_scale, mpx.no_loss_scale])
def test_integer_gradient_leaf(make):
  tx = make(optax.sgd(1.0))
  params = {"w": jnp.ones(2), "step": jnp.ones(2)}
  grads = {"w": jnp.ones(2), "step": jnp.ones(2, jnp.int32)}
  with pytest.raises(mpx.LeafTypeError, match="gradients leaf 'step' has dtype int32"):
    tx.update(grads, tx.init(params), params)


def test_axis_name_makes_the_decision_global():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0, axis_name="devices")
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.array([[2.0, 2.0], [2.0, jnp.inf], [4.0, 4.0]])}
  update = jax.vmap(tx.update, in_axes=(0, None, None), axis_name="devices")
  updates, new = update(grads, state, params)
  _bits_equal(updates, {"w": jnp.full((3, 2), -0.0)})
  np.testing.assert_array_equal(new.skipped_steps, [1, 1, 1])
  alone, _ = jax.vmap(
    mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0).update, (0, None, None)
  )(grads, state, params)
  np.testing.assert_array_equal(alone["w"][0], [-1.0, -1.0])  # without axis_name: per member


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
def test_no_loss_scale_passes_gradients_through():
  tx = mpx.no_loss_scale(optax.sgd(1.0))
  params = _params(BF16)
  grads = _grads(1.0, BF16, bad=NAN)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(jnp.isnan(updates["scale"][1]))  # no check, no skip
  assert updates["scale"].dtype == BF16
  assert mpx.loss_scale_metrics(state) == mpx.loss_scale_metrics(tx.init(params))
  assert float(mpx.get_loss_scale(state)) == 1.0


def test_static_scale_skips_and_flags_divergence():
  tx = mpx.static_loss_scale(optax.sgd(1.0), 2.0**4)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  mpx.check_loss_scale(state)
  _, state = tx.update({"w": jnp.array([1.0, NAN])}, state, params)
  assert float(state.loss_scale) == 16.0 and int(state.skipped_steps) == 1
  with pytest.raises(mpx.LossScaleDivergedError, match=r"current scale 16.0, 1 skipped steps"):
    mpx.check_loss_scale((optax.EmptyState(), state))
  mpx.check_loss_scale(state._replace(diverged=jnp.asarray(False)))


def test_dynamic_divergence_only_at_the_floor():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0, min_scale=2.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  metrics = jax.jit(mpx.loss_scale_metrics)(state)
  assert set(metrics) == {
    "loss_scale",
    "skipped_steps",
    "consecutive_skips",
    "last_step_skipped",
    "growth_tracker",
    "diverged",
    "overflow_rate",
    "nonfinite_leaf",
  }
  bad = {"w": jnp.array([jnp.inf, 1.0])}
  _, state = tx.update(bad, state, params)  # 4 -> 2, not diverged
  mpx.check_loss_scale(state)
  _, state = tx.update(bad, state, params)  # at the floor
  with pytest.raises(mpx.LossScaleDivergedError, match="already at its floor"):
    mpx.check_loss_scale(state)


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_value_and_grad_with_aux_and_argnums(dtype):
  def loss_fn(w, b, x):
    loss = ((x @ w + b) ** 2).mean()
    return loss, {"w_sum": w.sum()}

  w, b = jnp.array([0.5, -0.25], dtype), jnp.array(0.125, dtype)
  x = jnp.array([[1.0, 2.0], [3.0, -1.0]], dtype)
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**8)
  state = (optax.EmptyState(), tx.init((w, b)))
  (loss, aux), grads = mpx.value_and_grad(loss_fn, state, argnums=(0, 1), has_aux=True)(w, b, x)
  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
    w.astype(F32), b.astype(F32), x.astype(F32)
  )
  assert loss.dtype == dtype
  np.testing.assert_array_equal(loss, ref_loss.astype(dtype))
  np.testing.assert_array_equal(aux["w_sum"], ref_aux["w_sum"].astype(dtype))
  for g, r in zip(grads, ref_grads, strict=True):
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), 2.0**8 * np.asarray(r), rtol=1e-2)
  # The transformation unscales what value_and_grad scaled.
  updates, _ = tx.update(grads, state[1], (w, b))
  np.testing.assert_allclose(
    np.asarray(updates[0], np.float32), -np.asarray(ref_grads[0]), rtol=1e-2
  )


def test_value_and_grad_accepts_a_scale_array():
  loss, grads = mpx.value_and_grad(lambda w: w @ w, jnp.float32(4.0))(jnp.array([1.0, 2.0]))
  np.testing.assert_array_equal(loss, 5.0)
  np.testing.assert_array_equal(grads, [8.0, 16.0])
  with pytest.raises(mpx.StateError, match="floating scalar, got shape"):
    mpx.value_and_grad(lambda w: w @ w, jnp.ones(2))


def test_all_finite():
  assert bool(mpx.all_finite({}))
  assert bool(mpx.all_finite({"a": jnp.ones(2, F16), "n": jnp.arange(3)}))
  assert not bool(mpx.all_finite([jnp.ones(2), jnp.array([NAN], BF16)]))


_SHARD_MAP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax, mpx
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((4,), ("data",))
tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0, axis_name="data")
params = {"w": jnp.ones(2)}
state = tx.init(params)

def step(grads, state, params):
  return tx.update({"w": grads["w"][0]}, state, params)

grads = {"w": jnp.array([[2.0, 2.0], [2.0, 2.0], [jnp.inf, 2.0], [2.0, 2.0]])}
grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))
f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P()),
                          check_vma=False))
updates, new = f(grads, state, params)
assert np.asarray(updates["w"]).tobytes() == np.full(2, -0.0, np.float32).tobytes(), updates
assert int(new.skipped_steps) == 1 and float(new.loss_scale) == 1.0, new
print("ok")
"""


def test_axis_name_under_shard_map_on_several_devices():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize(
  "make", [mpx.dynamic_loss_scale, mpx.no_loss_scale], ids=["dynamic", "none"]
)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_half_params_without_masters_warn_and_name_the_fix(make, dtype):
  params = {
    "params": {"Dense_0": {"kernel": jnp.ones((2, 2), dtype)}},
    "step": jnp.zeros((), jnp.int32),
  }
  with pytest.warns(mpx.PrecisionWarning, match=r"'params/Dense_0/kernel'.*with_master_params"):
    make(optax.sgd(1.0)).init(params)


def test_half_params_with_masters_or_float32_params_do_not_warn():
  mpx.dynamic_loss_scale(mpx.with_master_params(optax.sgd(1.0))).init({"w": jnp.ones(2, F16)})
  mpx.dynamic_loss_scale(optax.sgd(1.0)).init({"w": jnp.ones(2, F32)})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["small", "large"])
def test_check_finds_a_single_bad_element_in_small_and_large_leaves(bad, where):
  # Small leaves are checked in one concatenated bucket, leaves above 2**16 elements alone.
  params = {"small": jnp.zeros((3, 5), F16), "large": jnp.zeros((300, 300), F32)}
  grads = {"small": jnp.ones((3, 5), F16), "large": jnp.ones((300, 300), F32)}
  grads[where] = grads[where].at[1, 2].set(bad)
  tx = mpx.dynamic_loss_scale(mpx.with_master_params(optax.sgd(1.0)), initial_scale=4.0)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 1
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))


def test_a_finite_gradient_that_overflows_when_unscaled_is_skipped():
  # With a scale below 1 (the flax preset's floor is float32 tiny) g / scale can overflow.
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset="flax", initial_scale=2.0**-10)
  params = {"w": jnp.zeros(4, F32)}
  grads = {"w": jnp.array([1.0, 2.0, 3.0, 1.0e36], F32)}  # 1e36 * 2**10 > float32 max
  _, state = tx.update(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 1
  fine = {"w": jnp.array([1.0, 2.0, 3.0, 3.0e30], F32)}
  _, state = tx.update(fine, tx.init(params), params)
  assert int(state.skipped_steps) == 0


# ---------------------------------------------------------------- building under a trace

_FACTORIES = {
  "dynamic": lambda: mpx.dynamic_loss_scale(optax.sgd(0.1)),
  "dynamic_flax": lambda: mpx.dynamic_loss_scale(
    optax.sgd(0.1), preset="flax", growth_interval=4, hysteresis=2
  ),
  "static": lambda: mpx.static_loss_scale(optax.sgd(0.1), 2.0**4),
  "none": lambda: mpx.no_loss_scale(optax.sgd(0.1)),
  "mixed_float16": lambda: mpx.mixed_precision(optax.sgd(0.1), "mixed_float16"),
  "float16_masters": lambda: mpx.mixed_precision(optax.sgd(0.1), "float16"),
  "mixed_float16_torch": lambda: mpx.mixed_precision(
    optax.sgd(0.1), "mixed_float16", loss_scale="torch"
  ),
}


@pytest.mark.parametrize("make", list(_FACTORIES.values()), ids=list(_FACTORIES))
def test_factories_build_and_init_under_jit_and_eval_shape(make):
  params = {"w": jnp.ones(2)}
  eager = make().init(params)
  shapes = jax.eval_shape(lambda p: make().init(p), params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
    lambda x: (x.shape, x.dtype), eager
  )
  _bits_equal(jax.jit(lambda p: make().init(p))(params), eager)


def test_mixed_precision_inside_inject_hyperparams_under_jit():
  tx = optax.inject_hyperparams(
    lambda learning_rate: mpx.mixed_precision(
      standard_promotion(optax.adam(learning_rate)), "mixed_float16"
    )
  )(learning_rate=1e-3)
  params = {"w": jnp.ones(2)}
  state = jax.jit(tx.init)(params)
  scale = mpx.get_loss_scale(state)
  grads = {"w": jnp.array([1.0, -1.0]) * scale}
  updates, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_allclose(updates["w"], [-1e-3, 1e-3], rtol=1e-4)
  assert int(mpx.loss_scale_metrics(state)["growth_tracker"]) == 1
  updates, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 1.0])}, state, params)
  _bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})
  assert float(mpx.get_loss_scale(state)) == float(scale) / 2


def test_dynamic_loss_scale_inside_inject_hyperparams_reads_the_injected_value():
  tx = optax.inject_hyperparams(
    lambda learning_rate: mpx.dynamic_loss_scale(optax.sgd(learning_rate), initial_scale=4.0)
  )(learning_rate=0.5)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.25)
  updates, state = jax.jit(tx.update)({"w": jnp.array([4.0, 8.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-0.25, -0.5])
  assert float(mpx.get_loss_scale(state)) == 4.0


# ---------------------------------------------------------------- hyperparameters as arrays


@pytest.mark.parametrize(
  "to_array",
  [jnp.float32, np.float32, np.asarray, jnp.asarray],
  ids=["jnp.float32", "np.float32", "np.asarray", "jnp.asarray"],
)
def test_concrete_0d_arrays_are_accepted_as_scales(to_array):
  params = {"w": jnp.ones(2)}
  tx = mpx.dynamic_loss_scale(
    optax.sgd(1.0),
    initial_scale=to_array(2.0**15),
    min_scale=to_array(2.0),
    max_scale=to_array(2.0**20),
    growth_factor=to_array(4.0),
    backoff_factor=to_array(0.25),
    growth_interval=jnp.int32(3),
    hysteresis=np.int64(2),
  )
  ref = mpx.dynamic_loss_scale(
    optax.sgd(1.0),
    initial_scale=2.0**15,
    min_scale=2.0,
    max_scale=2.0**20,
    growth_factor=4.0,
    backoff_factor=0.25,
    growth_interval=3,
    hysteresis=2,
  )
  state, ref_state = tx.init(params), ref.init(params)
  for g in [1.0, jnp.inf, jnp.inf, 1.0, 1.0, 1.0]:
    grads = {"w": jnp.full(2, g, jnp.float32)}
    _, state = tx.update(grads, state, params)
    _, ref_state = ref.update(grads, ref_state, params)
    _bits_equal(state, ref_state)
  static = mpx.static_loss_scale(optax.sgd(1.0), to_array(8.0))
  assert float(mpx.get_loss_scale(static.init(params))) == 8.0
  mixed = mpx.mixed_precision(optax.sgd(1.0), "float16", loss_scale=to_array(1024.0))
  assert float(mpx.get_loss_scale(mixed.init({"w": jnp.ones(2, F16)}))) == 1024.0


@pytest.mark.parametrize(
  ("build", "name"),
  [
    (lambda x: mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=x), "initial_scale"),
    (lambda x: mpx.dynamic_loss_scale(optax.sgd(1.0), max_scale=x * 2**20), "max_scale"),
    (lambda x: mpx.dynamic_loss_scale(optax.sgd(1.0), growth_factor=x), "growth_factor"),
    (
      lambda x: mpx.dynamic_loss_scale(optax.sgd(1.0), growth_interval=x.astype(jnp.int32)),
      "growth_interval",
    ),
    (lambda x: mpx.static_loss_scale(optax.sgd(1.0), x), "scale"),
    (lambda x: mpx.mixed_precision(optax.sgd(1.0), "float16", loss_scale=x), "loss_scale"),
  ],
  ids=["initial_scale", "max_scale", "growth_factor", "growth_interval", "static", "mixed"],
)
def test_traced_scales_are_rejected_with_the_fix(build, name):
  with pytest.raises(mpx.ConfigError) as info:
    jax.jit(lambda x: build(x).init({"w": jnp.ones(2)}))(jnp.float32(4.0))
  message = str(info.value)
  assert message.startswith(f"{name} must be known when the optimizer is built, but it is a traced")
  assert f"Pass a Python number such as {name}=" in message
  assert f"under optax.inject_hyperparams, list {name!r} in static_args" in message


@pytest.mark.parametrize(
  ("value", "fragment"),
  [
    (jnp.float32(0.0), "initial_scale must be a float32 number in [2**-126, 2**126]"),
    (np.float32(np.inf), "initial_scale must be a float32 number in [2**-126, 2**126]"),
    (jnp.ones(2), "initial_scale must be a positive real number, got Array([1., 1.]"),
    (np.array(True), "initial_scale must be a positive real number, got True of type bool"),
  ],
  ids=["zero", "inf", "vector", "bool"],
)
def test_bad_array_scales_keep_their_messages(value, fragment):
  with pytest.raises(mpx.ConfigError) as info:
    mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=value)
  assert fragment in str(info.value)


# ---------------------------------------------------------------- shapes


def test_mismatched_gradient_shapes_name_the_path_and_both_shapes():
  tx = mpx.dynamic_loss_scale(standard_promotion(optax.adam(0.1)))
  params = _params()
  grads = _grads(1.0)
  grads["dense"]["bias"] = jnp.ones(5)
  message = (
    "gradients leaf 'dense/bias' has shape (5,), but the params leaf 'dense/bias' has shape (2,)"
  )
  with pytest.raises(mpx.TreeStructureError) as info:
    jax.jit(tx.update)(grads, tx.init(params), params)
  assert message in str(info.value)
  assert "Pass the params the gradients were computed from" in str(info.value)
  with pytest.raises(mpx.TreeStructureError, match="has shape"):
    mpx.no_loss_scale(optax.sgd(1.0)).update(grads, tx.init(params), params)


# ---------------------------------------------------------------- scale / unscale


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
def test_unscale_is_what_the_optimizer_feeds_its_inner_transformation():
  seen = []

  def record(updates, params):
    del params
    seen.append(updates)
    return updates

  tx = mpx.static_loss_scale(optax.stateless(record), 2.0**-3)
  params = {"a": jnp.zeros(3, F16), "b": jnp.zeros(2, BF16), "c": jnp.zeros(2, F32)}
  state = tx.init(params)
  grads = {
    "a": jnp.array([1.0, 3.0e-5, -7.0], F16),
    "b": jnp.array([2.0**-120, 5.0], BF16),
    "c": jnp.array([3.0e30, -1.0], F32),
  }
  tx.update(grads, state, params)
  for got in (mpx.unscale(grads, state), mpx.unscale(grads, jnp.float32(2.0**-3))):
    _bits_equal(got, seen[0])
  assert jax.tree.map(lambda x: x.dtype, seen[0]) == {"a": F32, "b": F32, "c": F32}


def test_scale_and_unscale_dtypes_and_non_floating_leaves():
  tree = {
    "f16": jnp.array([3.0], F16),
    "bf16": jnp.array([3.0], BF16),
    "i": jnp.arange(2),
    "key": jax.random.key(0),
    "none": None,
  }
  scaled = mpx.scale(tree, jnp.float32(2.0**16))  # 2**16 is inf in float16
  assert scaled["f16"].dtype == F32 and float(scaled["f16"][0]) == 3.0 * 2**16
  assert scaled["bf16"].dtype == F32
  assert scaled["i"] is tree["i"] and scaled["key"] is tree["key"] and scaled["none"] is None
  back = mpx.unscale(scaled, jnp.float32(2.0**16))
  assert float(back["f16"][0]) == 3.0 and back["f16"].dtype == F32
  with pytest.raises(mpx.StateError, match="floating scalar"):
    mpx.unscale(tree, jnp.ones(2))


def test_float64_stays_float64():
  with jax.enable_x64(True):
    tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**3)
    params = {"w": jnp.zeros(2, jnp.float64)}
    state = tx.init(params)
    grads = {"w": jnp.array([8.0, 1e-300], jnp.float64)}
    assert mpx.scale(grads, state)["w"].dtype == jnp.float64
    unscaled = mpx.unscale(grads, state)["w"]
    assert unscaled.dtype == jnp.float64 and float(unscaled[1]) == 1e-300 / 8
    updates, _ = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["w"], -unscaled)


def test_two_losses_and_a_gradient_penalty_compose_with_value_and_grad():
  # torch's recipes (`scaler.scale(loss)` per loss, unscaled inner gradients for a
  # penalty), written with mpx.scale / mpx.unscale beside mpx.value_and_grad.
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**12)
  w = {"w": jnp.array([0.5, -2.0])}
  x = jnp.array([1.0, 3.0])
  state = tx.init(w)

  def task(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  def penalised(p, x):
    grad_x = mpx.unscale(jax.grad(lambda x: mpx.scale(task(p, x), state))(x), state)
    return task(p, x) + jnp.sum(grad_x**2)

  def second(p):
    return jnp.sum(p["w"] ** 2)

  loss, g1 = mpx.value_and_grad(penalised, state)(w, x)
  g2 = jax.grad(lambda p: mpx.scale(second(p), state))(w)
  updates, _ = tx.update(jax.tree.map(jnp.add, g1, g2), state, w)
  want_loss, want = jax.value_and_grad(
    lambda p: task(p, x) + jnp.sum(jax.grad(task, argnums=1)(p, x) ** 2) + second(p)
  )(w)
  np.testing.assert_allclose(loss + second(w), want_loss, rtol=1e-6)
  np.testing.assert_allclose(updates["w"], -want["w"], rtol=1e-6)


def test_scale_keeps_a_float16_inner_gradient_from_underflowing():
  w, x = jnp.array(1e-4, F16), jnp.ones(2, F16)

  def inner(x, loss_scale):
    return mpx.scale(jnp.sum(w * x) * jnp.float16(1e-4), loss_scale)

  scaled = mpx.unscale(jax.grad(inner)(x, jnp.float32(2.0**15)), jnp.float32(2.0**15))
  plain = jax.grad(inner)(x, jnp.float32(1.0))
  assert bool(jnp.all(plain == 0))  # 1e-8 flushes to zero in float16
  np.testing.assert_allclose(scaled, [1e-8, 1e-8], rtol=2e-3)


# ---------------------------------------------------------------- last step skipped


def test_last_step_skipped_is_read_from_the_state_and_the_metrics():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  assert not bool(state.last_step_skipped)
  step = jax.jit(tx.update)
  seen = []
  for g in [1.0, jnp.inf, jnp.nan, 1.0]:
    _, state = step({"w": jnp.full(2, g)}, state, params)
    metrics = jax.jit(mpx.loss_scale_metrics)((optax.EmptyState(), state))
    assert metrics["last_step_skipped"].dtype == jnp.bool_
    assert bool(metrics["last_step_skipped"]) == bool(state.last_step_skipped)
    seen.append(bool(state.last_step_skipped))
  assert seen == [False, True, True, False]
  assert "last_step_skipped" not in mpx.LossScaleState._fields  # derived, not stored


# ---------------------------------------------------------------- overflow attribution


def _attribution_params():
  # One leaf for each way the check cuts a leaf into rows of 32 (see finite_check.row_flags).
  return {
    "a_big": jnp.zeros(70_000),  # no row length fits: reduced whole
    "b_small": jnp.zeros(3),  # last axis <= 32: one row
    "c_big": jnp.zeros((300, 300), F16),  # reduced whole
    "d_small": jnp.zeros((2, 2), BF16),  # rows along the last axis
    "e_small": jnp.zeros(5),
    "f_rows": jnp.zeros((4, 64)),  # last axis cut into rows of 32
    "g_flat": jnp.zeros((96, 33)),  # raveled, then cut into rows of 32
    "h_scalar": jnp.zeros(()),
  }


def _attribution_grads(*bad):
  grads = jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), _attribution_params())
  for name in bad:  # the last element: the end of the leaf's last row
    grads[name] = grads[name].reshape(-1).at[-1].set(jnp.inf).reshape(grads[name].shape)
  return grads


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_the_first_non_finite_leaf_is_recorded_and_named(use_jit):
  params = _attribution_params()
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0)
  step = _maybe_jit(tx.update, use_jit)
  state = tx.init(params)
  assert int(state.nonfinite_leaf) == -1
  assert mpx.diagnostics.nonfinite_gradient_paths(state, params) == []
  cases = [
    (("c_big",), 2),
    (("e_small",), 4),
    (("c_big", "a_big"), 0),  # the first leaf in tree order
    (("h_scalar", "d_small"), 3),
    (("f_rows",), 5),
    (("g_flat",), 6),
    (("h_scalar",), 7),
  ]
  names = list(params)
  for bad, leaf in cases:
    _, state = step(_attribution_grads(*bad), state, params)
    assert int(state.nonfinite_leaf) == leaf, bad
    assert int(mpx.loss_scale_metrics(state)["nonfinite_leaf"]) == leaf
    assert mpx.diagnostics.nonfinite_gradient_paths(state, params) == [names[leaf]]
    _, state = step(_attribution_grads(), state, params)  # a finite step keeps the record
    assert int(state.nonfinite_leaf) == leaf
  assert int(state.skipped_steps) == len(cases)


_LEAF_SHAPES = [(), (1,), (31,), (32,), (33,), (3, 64), (2, 33, 32), (96, 33), (7, 45), (65,)]
_CHECK_TX = mpx.dynamic_loss_scale(optax.sgd(1.0), min_scale=2.0**-30)
_CHECK_UPDATE = jax.jit(_CHECK_TX.update)


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
@settings(max_examples=40, deadline=None)
@given(
  shapes=st.lists(st.sampled_from(_LEAF_SHAPES), min_size=1, max_size=4),
  dtype=st.sampled_from([F32, F16, BF16]),
  log2_scale=st.integers(-20, 24),
  bad=st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.sampled_from(["inf", "nan", "big"])),
    max_size=2,
  ),
)
def test_the_check_and_the_attribution_match_numpy(shapes, dtype, log2_scale, bad):
  # Reference: the unscaled gradients in float64, element by element.
  rng = np.random.default_rng(len(shapes))
  grads = [rng.uniform(-2.0, 2.0, s).astype(dtype) for s in shapes]
  # Finite, but in float32 and bfloat16 it overflows once unscaled by a scale below 1.
  big = float(jnp.finfo(dtype).max)
  for leaf, position, kind in bad:
    leaf %= len(grads)
    if grads[leaf].size:
      flat = grads[leaf].reshape(-1)
      flat[position % flat.size] = {"inf": np.inf, "nan": np.nan, "big": big}[kind]
      grads[leaf] = flat.reshape(grads[leaf].shape)
  scale = 2.0**log2_scale
  # Finite once unscaled in float32: no inf or NaN (NaN fails the comparison), no overflow.
  f32_max = float(np.finfo(np.float32).max)
  finite = [bool(np.all(np.abs(g.astype(np.float64) / scale) <= f32_max)) for g in grads]
  tree = {f"leaf{i}": jnp.asarray(g) for i, g in enumerate(grads)}
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, F32), tree)
  # The scale as state, through one jitted update: examples of equal shapes share a compile.
  state = _CHECK_TX.init(params)._replace(loss_scale=jnp.float32(scale))
  _, state = _CHECK_UPDATE(tree, state, params)
  expected_leaf = finite.index(False) if False in finite else -1
  assert bool(state.last_step_skipped) == (expected_leaf >= 0)
  assert int(state.nonfinite_leaf) == expected_leaf


@pytest.mark.filterwarnings("ignore:.*no float32 master copy:mpx.PrecisionWarning")
def test_a_finite_gradient_that_overflows_only_when_unscaled_is_attributed():
  params = {"a": jnp.zeros(70_000), "b": jnp.zeros(3)}
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset="flax", initial_scale=2.0**-10)
  grads = {"a": jnp.ones(70_000), "b": jnp.array([1.0, 1.0e36, 1.0])}
  _, state = tx.update(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 1
  assert mpx.diagnostics.nonfinite_gradient_paths(state, params) == ["b"]


def test_nonfinite_gradient_paths_rejects_params_of_another_model():
  params = _attribution_params()
  tx = mpx.dynamic_loss_scale(mpx.with_master_params(optax.sgd(1.0)))
  _, state = tx.update(_attribution_grads("e_small"), tx.init(params), params)
  with pytest.raises(mpx.StateError, match="gradient leaf 4, but these params have 1 leaf "):
    mpx.diagnostics.nonfinite_gradient_paths(state, {"w": jnp.ones(3)})


def test_skip_history_and_overflow_rate_cover_the_last_32_steps():
  params = {"w": jnp.ones(2)}
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**20, min_scale=1.0)
  step = jax.jit(tx.update)
  state = tx.init(params)
  pattern = [True, False, False, True, True] + [False] * 31 + [True]  # True: a skipped step
  history = 0
  for i, skip in enumerate(pattern):
    grads = {"w": jnp.array([jnp.nan if skip else 1.0, 1.0])}
    _, state = step(grads, state, params)
    history = ((history << 1) | int(skip)) & 0xFFFFFFFF
    assert int(state.skip_history) == history, i
    window = pattern[max(0, i - 31) : i + 1]
    rate = mpx.loss_scale_metrics(state)["overflow_rate"]
    assert rate.dtype == F32 and float(rate) == sum(window) / 32, i
  # The first three skips have left the window; only the last one is still in it.
  assert (
    int(state.skip_history) == 1 and float(mpx.loss_scale_metrics(state)["overflow_rate"]) == 1 / 32
  )


def test_no_loss_scale_records_no_history():
  tx = mpx.no_loss_scale(optax.sgd(1.0))
  params = {"w": jnp.ones(2)}
  _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
  assert int(state.skip_history) == 0 and int(state.nonfinite_leaf) == -1


def test_axis_name_makes_the_attribution_global():
  params = {"a": jnp.zeros(70_000), "b": jnp.zeros(3)}
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0, axis_name="devices")
  state = tx.init(params)
  grads = {"a": jnp.ones((3, 70_000)), "b": jnp.ones((3, 3))}
  grads["b"] = grads["b"].at[0, 1].set(jnp.nan)  # member 0: leaf 1
  grads["a"] = grads["a"].at[2, 5].set(jnp.inf)  # member 2: leaf 0
  update = jax.vmap(tx.update, in_axes=(0, None, None), axis_name="devices")
  _, new = update(grads, state, params)
  np.testing.assert_array_equal(new.nonfinite_leaf, [0, 0, 0])
  np.testing.assert_array_equal(new.skip_history, [1, 1, 1])


def _sgd_step(tx, grad_fn):
  @jax.jit
  def step(params, state):
    grads = grad_fn(lambda p: jnp.sum(p["w"].astype(F32) ** 2) / 4, state)(params)
    updates, state = tx.update(grads, state, params)
    return mpx.apply_updates(params, updates), state

  return step


def test_forgotten_value_and_grad_warns_once_per_step_function_and_names_the_fix():
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16")
  params = {"w": jnp.ones(3)}
  step = _sgd_step(tx, lambda f, state: jax.grad(f))
  with pytest.warns(mpx.PrecisionWarning, match=r"mpx\.value_and_grad.*mpx\.scale.*step at "):
    new_params, _ = step(params, tx.init(params))
  # What the warning is about: the true gradient 0.5 moved w by 0.1 * 0.5 / 2**15, not 0.05.
  np.testing.assert_allclose(new_params["w"], 1 - 0.05 / 2**15, rtol=1e-7)
  step(new_params, tx.init(params))  # the same trace: silent (warnings are errors)


def test_forgotten_value_and_grad_warns_for_every_step_function():
  # Issue 34: the warning came once per process, so a second step function trained as badly
  # without a word. Under Python's default filter (once per message and line) too, each step
  # function warns, though both call update from one line (this helper's).
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16")
  params = {"w": jnp.ones(3)}
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("default")
    for _ in range(2):
      step = _sgd_step(tx, lambda f, state: jax.grad(f))
      step(params, tx.init(params))
      step(params, tx.init(params))  # the same trace
  assert [w.category for w in record] == [mpx.PrecisionWarning] * 2
  assert "once per traced step function" in str(record[1].message)


@pytest.mark.parametrize(
  "grad_fn",
  [
    lambda f, state: lambda p: mpx.value_and_grad(f, state)(p)[1],
    lambda f, state: jax.grad(lambda p: mpx.scale(f(p), state)),
    lambda f, state: jax.grad(lambda p: f(p) * mpx.get_loss_scale(state)),
    lambda f, state: jax.grad(lambda p: f(p) * state.loss_scale),
  ],
  ids=["value_and_grad", "scale", "get_loss_scale", "by_hand"],
)
@pytest.mark.parametrize("policy", ["mixed_float16", "params=float16,compute=float16"])
def test_scaled_gradients_do_not_warn(grad_fn, policy):
  tx = mpx.mixed_precision(optax.sgd(0.1), policy)
  params = mpx.get_policy(policy).cast_to_param({"w": jnp.ones(3)})
  new_params, _ = _sgd_step(tx, grad_fn)(params, tx.init(params))  # warnings are errors
  np.testing.assert_allclose(new_params["w"].astype(F32), 0.95, rtol=1e-3)


def test_unscaled_gradients_under_no_loss_scale_and_inner_multisteps_do_not_warn():
  params = {"w": jnp.ones(3)}
  for tx in (
    mpx.mixed_precision(optax.sgd(0.1), "mixed_bfloat16"),  # no_loss_scale: nothing to forget
    standard_promotion(optax.MultiSteps(mpx.dynamic_loss_scale(optax.sgd(0.1)), 2)),
  ):
    state = tx.init(params)
    step = _sgd_step(tx, lambda f, state: lambda p: mpx.value_and_grad(f, state)(p)[1])
    step(params, state)


def test_forgotten_value_and_grad_warns_under_nnx():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, mpx.mixed_precision(optax.sgd(0.1), "mixed_float16"), wrt=nnx.Param
  )

  def loss_fn(m):
    return jnp.mean(m(jnp.ones((4, 3))) ** 2)

  @nnx.jit
  def good(model, optimizer):
    optimizer.update(model, mpx.value_and_grad(loss_fn, optimizer.opt_state)(model)[1])

  @nnx.jit
  def forgotten(model, optimizer):
    optimizer.update(model, nnx.grad(loss_fn)(model))

  good(model, optimizer)
  with pytest.warns(mpx.PrecisionWarning, match=r"mpx\.value_and_grad"):
    forgotten(model, optimizer)


@pytest.mark.parametrize("policy", ["mixed_float16", "params=float16,compute=float16"])
def test_no_loss_scale_with_float16_warns(policy):
  tx = mpx.mixed_precision(optax.sgd(0.1), policy, loss_scale=None)
  with pytest.warns(mpx.PrecisionWarning, match="loss_scale=None"):
    tx.init(mpx.get_policy(policy).cast_to_param({"w": jnp.ones(3)}))


def test_no_loss_scale_with_bfloat16_does_not_warn():
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_bfloat16", loss_scale=None)
  tx.init({"w": jnp.ones(3)})


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_empty_gradient_leaves(shape):
  tx = mpx.mixed_precision(optax.sgd(0.1), "float16")
  empty = {"e": jnp.zeros(shape, F16)}
  state = tx.init(empty)
  updates, state = jax.jit(tx.update)(empty, state, empty)  # only empty leaves: a finite step
  assert updates["e"].shape == shape and not bool(state.last_step_skipped)
  params = {"e": jnp.zeros(shape, F16), "w": jnp.ones(2, F16)}
  state = tx.init(params)
  grads = {"e": jnp.zeros(shape, F16), "w": jnp.array([1.0, jnp.inf], F16)}
  _, state = jax.jit(tx.update)(grads, state, params)
  assert int(state.skipped_steps) == 1
  assert mpx.diagnostics.nonfinite_gradient_paths(state, params) == ["w"]


def test_advice_for_integer_gradient_leaves_works():
  tx = mpx.mixed_precision(optax.sgd(0.5), "mixed_float16")
  params = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}

  def loss_fn(p, step):
    return jnp.sum(p["w"] ** 2) * (1 + step).astype(F32)

  grads = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(mpx.LeafTypeError, match="out of the tree you differentiate") as info:
    tx.update(grads, tx.init(params), params)
  assert "None" not in str(info.value)  # None leaves break the structure check downstream
  # Following it: the counter is a separate argument, the optimizer sees floats only.
  params, step = {"w": params["w"]}, params["step"]
  state = tx.init(params)
  _, grads = mpx.value_and_grad(loss_fn, state)(params, step)
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(mpx.apply_updates(params, updates)["w"], 0.0)


def test_divergence_advice_works_on_a_nested_state():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), mpx.static_loss_scale(optax.sgd(1.0), 2.0**4)
  )  # the loss-scale state sits inside a chain's tuple
  params = {"w": jnp.ones(2)}
  step = jax.jit(tx.update)
  _, state = step({"w": jnp.array([1.0, NAN])}, tx.init(params), params)
  with pytest.raises(mpx.LossScaleDivergedError, match="tree_set") as info:
    mpx.check_loss_scale(state)
  advice = str(info.value).rsplit("reset the flag with ", 1)[1].rstrip(".")
  state = eval(advice, {"optax": optax, "jnp": jnp, "opt_state": state})  # follow it verbatim
  mpx.check_loss_scale(state)
  step({"w": jnp.ones(2)}, state, params)
  assert step._cache_size() == 1  # the reset flag keeps the state's dtypes
