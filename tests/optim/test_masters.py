"""Tests for mpx.with_master_params and mpx.apply_updates (paper section 3.1)."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from marks import all_but
from optax_compat import standard_promotion

import mpx
from mpx._src.optim import base as half_params

HALF = [jnp.float16, jnp.bfloat16]
ALL = [jnp.float32, jnp.bfloat16, jnp.float16]


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


# ------------------------------------------------------------------ the paper's rounding case


@pytest.mark.parametrize(
  ("dtype", "step", "num_steps", "target"),
  [(jnp.float16, 1e-4, 1000, 1.1), (jnp.bfloat16, 1e-3, 100, 1.1), (jnp.bfloat16, 1e-3, 1000, 2.0)],
)
def test_small_updates_are_not_rounded_away(dtype, step, num_steps, target):
  grad = jnp.asarray(-step, dtype)

  def run(tx, apply):
    params = {"w": jnp.ones((), dtype)}

    def body(carry, _):
      params, state = carry
      updates, state = tx.update({"w": grad}, state, params)
      return (apply(params, updates), state), None

    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), length=num_steps)
    return params, state

  plain, _ = jax.jit(lambda: run(optax.sgd(1.0), optax.apply_updates))()
  assert plain["w"] == 1.0  # every update is below half an ulp of 1.0

  tx = mpx.with_master_params(optax.sgd(1.0))
  params, state = jax.jit(lambda: run(tx, mpx.apply_updates))()
  reference = np.float32(1.0)
  for _ in range(num_steps):
    reference = np.float32(reference - np.float32(1.0) * np.float32(grad))
  assert _bits(state.master_params["w"]) == _bits(reference)
  assert abs(float(reference) - target) < num_steps * 1e-6  # grad's own rounding
  assert _bits(params["w"]) == _bits(jnp.asarray(reference).astype(dtype))
  # optax.apply_updates lands on the same weights (under JAX's default promotion: the updates
  # of half params with masters are float32).
  with jax.numpy_dtype_promotion("standard"):
    params_optax, _ = jax.jit(lambda: run(tx, optax.apply_updates))()
  assert _bits(params_optax["w"]) == _bits(params["w"])


# ------------------------------------------------------------------ exactness


def _random_walk(dtype, seed, num_steps=200, size=512):
  """Masters jumping over random magnitudes, subnormals and the format's max."""
  rng = np.random.default_rng(seed)
  info = ml_dtypes.finfo(dtype)
  # bfloat16 shares float32's exponent range, whose subnormals XLA:CPU flushes
  # and whose max would overflow the float32 gradient m - wanted.
  top = float(info.max) if dtype == jnp.float16 else 2.0**125
  lo, hi = (-24, np.log2(top)) if dtype == jnp.float16 else (-120, 125)
  start = rng.choice([-1, 1], size) * 2.0 ** rng.uniform(lo, hi, size)
  rel = rng.choice([-1, 1], (num_steps, size)) * 2.0 ** rng.uniform(-30, 0, (num_steps, size))
  jump = rng.uniform(size=(num_steps, size)) < 0.05
  value = rng.choice([-1, 1], (num_steps, size)) * 2.0 ** rng.uniform(lo, hi, (num_steps, size))
  value[:, :8] = top * rng.choice([-1, 1], (num_steps, 8))
  value[:, 8:16] = float(info.smallest_subnormal) * rng.integers(-4, 5, (num_steps, 8))
  jump[:, :16] = rng.uniform(size=(num_steps, 16)) < 0.5
  params = jnp.asarray(start, jnp.float32).astype(dtype)
  tx = mpx.with_master_params(optax.sgd(1.0))
  maxval = jnp.float32(top)

  def body(carry, xs):
    params, state = carry
    rel, jump, value = xs
    m = state.master_params["w"]
    wanted = jnp.clip(jnp.where(jump, value, m * (1 + rel)), -maxval, maxval)
    updates, state = tx.update({"w": m - wanted}, state, {"w": params})
    exact = mpx.apply_updates({"w": params}, updates)["w"]
    with jax.numpy_dtype_promotion("standard"):  # as users call it; strict rejects f16 + f32
      via_optax = optax.apply_updates({"w": params}, updates)["w"]
    out = (params, exact, via_optax, state.master_params["w"].astype(dtype))
    return (exact, state), out

  xs = tuple(jnp.asarray(a, jnp.float32) for a in (rel, jump, value))
  xs = (xs[0], xs[1] > 0, xs[2])
  _, out = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init({"w": p})), xs))(params)
  return tuple(np.asarray(o) for o in out)


@pytest.mark.parametrize("dtype", HALF)
def test_apply_updates_is_bitwise_the_cast_master(dtype):
  _, exact, via_optax, cast_master = _random_walk(dtype, seed=0)
  # Bit for bit but for the sign of a zero: a master below the smallest subnormal rounds to
  # -0.0, and no sum p + u with p != -0 gives -0.0.
  nonzero = cast_master != 0
  np.testing.assert_array_equal(_bits(exact)[nonzero], _bits(cast_master)[nonzero])
  np.testing.assert_array_equal(exact, cast_master)
  # optax.apply_updates computes the same sum from the float32 updates, bit for bit.
  np.testing.assert_array_equal(_bits(via_optax), _bits(exact))
  assert np.isfinite(cast_master.astype(np.float32)).all()
  if dtype == jnp.float16:
    assert (np.abs(cast_master.astype(np.float32)) == 65504).any()
    tiny = np.abs(cast_master.astype(np.float32)) < float(ml_dtypes.finfo(dtype).smallest_normal)
    assert (tiny & (cast_master != 0)).any()  # subnormals were exercised


@pytest.mark.parametrize("dtype", HALF)
def test_optax_apply_updates_is_exact_whenever_possible(dtype):
  old, _, via_optax, cast_master = _random_walk(dtype, seed=1)
  diff = cast_master.astype(np.float64) - old.astype(np.float64)
  with np.errstate(over="ignore"):  # an overflowing difference is not representable
    representable = diff.astype(dtype).astype(np.float64) == diff
  # Where the difference is representable, p + u is exactly the cast master
  # (up to the sign of zero, which no sum p + u with p != -0 can produce).
  np.testing.assert_array_equal(via_optax[representable], cast_master[representable])
  old64 = old.astype(np.float64)
  ratio = cast_master.astype(np.float64) / np.where(old64 == 0, 1, old64)
  sterbenz = (old64 != 0) & (ratio >= 0.5) & (ratio <= 2)  # Sterbenz's lemma
  assert representable[sterbenz].all()
  # The moves a half-precision update cannot make occur (zero crossings, big shrinks,
  # +-65504), and the float32 update makes them all.
  assert (~representable).sum() > 100
  np.testing.assert_array_equal(via_optax, cast_master)


# The corner no float32 update reaches: a param that rounded up to 1.0 from a master just below
# (float32's grid at the param is twice as coarse as at the master), whose master then crosses
# zero to -(2**-20 + 2**-24), odd in the master's last bit and over 2**13 (float16) or 2**16
# (bfloat16) times smaller.
CORNER = {jnp.float16: 1 - 2.0**-12, jnp.bfloat16: 1 - 2.0**-9}
FAR = -(2.0**-20 + 2.0**-24)


def _one_step(old, new, dtype=jnp.float16, master=None):
  params = {"w": jnp.asarray(old, dtype)}
  tx = mpx.with_master_params(optax.sgd(1.0))
  state = tx.init(params)
  if master is not None:
    state = state._replace(master_params={"w": jnp.float32(master)})
  grad = jnp.float32(state.master_params["w"]) - jnp.float32(new)  # exact in these cases
  updates, state = tx.update({"w": grad}, state, params)
  assert float(state.master_params["w"]) == new
  return tx, params, updates, state


def test_optax_apply_updates_counterexamples():
  # Moves a float16 update cannot make land with the float32 update, in both apply calls.
  for old, new in [(65504.0, -65504.0), (1.0, 2.0**-24), (1000.0, 2.0**-14), (4.0, 1.0009765625)]:
    _, params, updates, _ = _one_step(old, new)
    assert mpx.apply_updates(params, updates)["w"] == jnp.float16(new)
    with jax.numpy_dtype_promotion("standard"):
      assert optax.apply_updates(params, updates)["w"] == jnp.float16(new)
  for dtype, below_one in CORNER.items():
    _, params, updates, _state = _one_step(1.0, FAR, dtype, master=below_one)
    exact = mpx.apply_updates(params, updates)["w"]
    with jax.numpy_dtype_promotion("standard"):
      via_optax = optax.apply_updates(params, updates)["w"]
    assert exact == via_optax == -(2.0**-20) and exact != jnp.asarray(FAR, dtype)


def test_optax_apply_updates_corrects_a_counterexample_on_the_next_step():
  # Each update targets the cast master from the params it is given, so the
  # one-step deviation of optax.apply_updates never accumulates, and it stays
  # finite (65504 -> -65504 would otherwise need an update of -inf).
  cases = [(65504.0, -65504.0, jnp.float16, None), (1.0, 2.0**-24, jnp.float16, None)]
  cases += [(1000.0, 2.0**-14, jnp.float16, None), (1.0, -0.0, jnp.float16, None)]
  cases += [(1.0, FAR, dtype, below_one) for dtype, below_one in CORNER.items()]
  for old, new, dtype, master in cases:
    tx, params, updates, state = _one_step(old, new, dtype, master)
    with jax.numpy_dtype_promotion("standard"):
      params = optax.apply_updates(params, updates)
    assert bool(jnp.isfinite(params["w"]))
    updates, state = tx.update({"w": jnp.zeros((), jnp.float32)}, state, params)
    with jax.numpy_dtype_promotion("standard"):
      params = optax.apply_updates(params, updates)
    assert float(state.master_params["w"]) == new
    # Equal as values: no sum p + u with p != -0 can give -0.0 itself.
    assert params["w"] == jnp.asarray(new, dtype)


# ------------------------------------------------------------------ state


@pytest.mark.parametrize("dtype", ALL)
def test_state_layout(dtype):
  params = _params(dtype)
  tx = mpx.with_master_params(
    standard_promotion(optax.masked(optax.adam(1e-3), _float_mask(params)))
  )
  state = tx.init(params)
  masters = state.master_params
  if dtype == jnp.float32:
    assert jax.tree.leaves(masters) == []
  else:
    chex.assert_trees_all_equal(
      masters["dense"], jax.tree.map(lambda p: p.astype(jnp.float32), params["dense"])
    )
  assert masters["norm_scale"] is None and masters["step"] is None
  adam = state.inner_state.inner_state[0]
  for moment in (adam.mu, adam.nu):
    for leaf in jax.tree.leaves(moment):
      assert leaf.dtype == jnp.float32
  # Every field survives a pytree round trip (jmp's DynamicLossScale bug).
  again = jax.tree.map(lambda x: x, state)
  assert type(again) is mpx.MasterParamsState
  chex.assert_trees_all_equal(again, state)
  assert again.master_params["step"] is None


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("use_jit", [False, True])
def test_update_keeps_dtypes_and_matches_jit(dtype, use_jit):
  params = _params(dtype)
  tx = mpx.with_master_params(
    standard_promotion(optax.masked(optax.adamw(1e-2), _float_mask(params)))
  )
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 3 if p.dtype == jnp.int32 else 0.25), params)
  grads["step"] = jnp.zeros((), jnp.int32)
  update = jax.jit(tx.update) if use_jit else tx.update
  updates, new_state = update(grads, state, params)
  # Params with a master get float32 updates, the others updates of their own dtype.
  chex.assert_trees_all_equal_dtypes(
    updates, jax.tree.map(lambda p: p.astype(jnp.float32) if p.dtype in HALF else p, params)
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  new_params = mpx.apply_updates(params, updates)
  chex.assert_trees_all_equal_dtypes(new_params, params)
  assert new_params["step"] == 7  # integer leaves are left alone
  reference_updates, _ = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_close(updates, reference_updates, rtol=1e-6)  # fusion may differ by an ulp
  # Float32 leaves see plain adamw; half leaves follow their masters.
  plain = standard_promotion(optax.adamw(1e-2))
  plain_updates, _ = plain.update(
    grads["norm_scale"], plain.init(params["norm_scale"]), params["norm_scale"]
  )
  chex.assert_trees_all_close(updates["norm_scale"], plain_updates, rtol=1e-6)
  if dtype != jnp.float32:
    chex.assert_trees_all_equal(
      new_params["dense"], jax.tree.map(lambda m: m.astype(dtype), new_state.master_params["dense"])
    )


def test_update_is_stable_under_cond():
  params = _params(jnp.float16)
  tx = mpx.with_master_params(
    standard_promotion(optax.masked(optax.adam(1e-3), _float_mask(params)))
  )
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)

  def step(flag, state):
    return jax.lax.cond(flag, lambda s: tx.update(grads, s, params)[1], lambda s: s, state)

  chex.assert_trees_all_equal_shapes_and_dtypes(jax.jit(step)(True, state), state)


def test_extra_args_reach_the_inner_transformation():
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, factor):
    del params
    return jax.tree.map(lambda g: g * factor, updates), state

  tx = mpx.with_master_params(optax.GradientTransformationExtraArgs(init_fn, update_fn))
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params, factor=jnp.float32(0.5))
  np.testing.assert_array_equal(np.asarray(state.master_params["w"]), [1.5, 1.5])


def test_apply_updates_without_masters_is_optax():
  params = {"w": jnp.ones(2)}
  tx = optax.sgd(0.5)
  updates, _state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  chex.assert_trees_all_equal(
    mpx.apply_updates(params, updates), optax.apply_updates(params, updates)
  )


# ------------------------------------------------------------------ bad input


def test_params_missing_from_update():
  tx = mpx.with_master_params(optax.sgd(1.0))
  params = {"w": jnp.ones(2, jnp.float16)}
  with pytest.raises(mpx.ConfigError, match=r"tx.update\(grads, opt_state, params\)"):
    tx.update(params, tx.init(params))


@pytest.mark.parametrize(
  ("param_dtype", "master_dtype"),
  [(jnp.float32, jnp.float16), (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float16)],
)
def test_master_dtype_narrower_than_params(param_dtype, master_dtype):
  tx = mpx.with_master_params(optax.sgd(1.0), master_dtype=master_dtype)
  with pytest.raises(mpx.ConfigError, match=r"'layer/w'.*master_dtype=jnp.float32"):
    tx.init({"layer": {"w": jnp.ones(2, param_dtype)}})


def test_bad_master_dtype_name():
  with pytest.raises(mpx.PolicyError, match="Unknown dtype name"):
    mpx.with_master_params(optax.sgd(1.0), master_dtype="float17")


def test_state_that_lost_its_masters():
  tx = mpx.with_master_params(optax.adam(1e-3))
  state = tx.init({"w": jnp.ones(2, jnp.float32)})  # built for float32 params
  params = {"w": jnp.ones(2, jnp.float16)}
  with pytest.raises(mpx.StateError, match=r"'w' has dtype float16 but .* no float32 master"):
    tx.update(params, state, params)


def test_state_for_other_params():
  tx = mpx.with_master_params(optax.sgd(1.0))
  state = tx.init({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(mpx.StateError, match="tree structure"):
    tx.update({"v": jnp.ones(2, jnp.float16)}, state, {"v": jnp.ones(2, jnp.float16)})
  params = {"w": jnp.ones(3, jnp.float16)}
  with pytest.raises(mpx.StateError, match=r"float16\[3\] but its master is float32\[2\]"):
    tx.update(params, state, params)


def test_grads_with_other_structure():
  tx = mpx.with_master_params(optax.sgd(1.0))
  params = {"w": jnp.ones(2, jnp.float16)}
  with pytest.raises(mpx.TreeStructureError, match="'v'"):
    tx.update({"v": jnp.ones(2, jnp.float16)}, tx.init(params), params)


def test_two_master_states_are_ambiguous():
  tx = optax.chain(mpx.with_master_params(optax.sgd(1.0)), mpx.with_master_params(optax.sgd(1.0)))
  params = {"w": jnp.ones(2, jnp.float16)}
  with pytest.raises(mpx.StateError, match="2 MasterParamsState"):
    half_params.find_master_params(tx.init(params))


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
def test_apply_updates_finds_masters_under_masked_and_multi_transform(wrapper):
  params = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(2, jnp.float16)}
  mixed = mpx.mixed_precision(optax.sgd(1.0), "float16", loss_scale=1.0)
  if wrapper == "masked":
    tx = optax.masked(mixed, {"a": True, "b": False})  # "b" passes its gradient through
  else:
    tx = optax.multi_transform({"mp": mixed, "sgd": optax.sgd(1.0)}, {"a": "mp", "b": "sgd"})
  state = tx.init(params)
  grads = {"a": jnp.full(3, 1e-4, jnp.float16), "b": jnp.full(2, 0.25, jnp.float16)}
  updates, state = tx.update(grads, state, params)
  new = mpx.apply_updates(params, updates)
  masters = half_params.find_master_params(state)
  # "a" is the cast of its float32 master, 1 - 1e-4 (1 in float16: the master keeps it).
  np.testing.assert_array_equal(masters["a"], np.float32(1) - np.float32(np.float16(1e-4)))
  np.testing.assert_array_equal(new["a"], masters["a"].astype(jnp.float16))
  want_b = 1.25 if wrapper == "masked" else 0.75
  np.testing.assert_array_equal(new["b"], np.full(2, want_b, np.float16))
  chex.assert_trees_all_equal_dtypes(new, params)


def test_update_with_another_optimizers_state():
  params = {"w": jnp.ones(2, jnp.float16)}
  grads = jax.tree.map(jnp.ones_like, params)
  tx = mpx.mixed_precision(optax.sgd(0.1), "float16")
  with pytest.raises(mpx.StateError, match=r"LossScaleState, but got a tuple.*init did not make"):
    tx.update(grads, optax.sgd(0.1).init(params), params)
  with pytest.raises(mpx.StateError, match="MasterParamsState, but got a tuple"):
    mpx.with_master_params(optax.sgd(0.1)).update(grads, optax.sgd(0.1).init(params), params)


# ------------------------------------------------------------------ the README's train step


@pytest.mark.slow
@pytest.mark.parametrize("dtype", all_but(HALF, jnp.bfloat16))
def test_the_readme_step_with_optax_apply_updates_is_bitwise_mpx_apply_updates(dtype):
  # Issue 34: with bfloat16 params and float32 masters, the README's step (optax.apply_updates)
  # drifted from the mpx.apply_updates run, and params left their masters' rounding.
  import models

  policy = f"params={np.dtype(dtype).name},compute={np.dtype(dtype).name},output=float32"
  model = mpx.linen.apply_policy(
    models.Decoder(features=32, num_heads=2, num_layers=1, mlp_hidden=64, flax_attention=False),
    policy,
  )
  tokens = models.text_tokens()
  batches = [models.lm_batch(tokens, i, batch_size=4, seq_len=16) for i in range(50)]
  xs, ys = (jnp.asarray(np.stack(b)) for b in zip(*batches, strict=True))
  params = model.init(jax.random.key(0), xs[0])["params"]
  tx = mpx.mixed_precision(standard_promotion(optax.adamw(1e-2)), policy)

  def body(carry, batch):  # the README's step, with both apply calls on the same updates
    params, opt_state = carry

    def loss_fn(p):
      logits = model.apply({"params": p}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    with jax.numpy_dtype_promotion("standard"):  # the README's call, as users run it
      via_optax = optax.apply_updates(params, updates)
    via_mpx = mpx.apply_updates(params, updates)  # strict promotion
    differ = sum(jax.tree.leaves(jax.tree.map(lambda a, b: jnp.sum(a != b), via_optax, via_mpx)))
    return (via_optax, opt_state), (loss, differ)

  # One trajectory: two separately compiled runs of a float16 model can differ in the last bit
  # of the model's own arithmetic (XLA:CPU fuses them differently), which says nothing of the
  # apply call. Each step compares both calls on the same params and updates.
  (params, state), (losses, differ) = jax.jit(
    lambda: jax.lax.scan(body, (params, tx.init(params)), {"x": xs, "y": ys})
  )()
  assert int(differ.sum()) == 0, differ
  masters = mpx.get_master_params(state, params)
  chex.assert_trees_all_equal(params, jax.tree.map(lambda m, p: m.astype(p.dtype), masters, params))
  assert float(losses[-1]) < 0.8 * float(losses[0])


def test_apply_updates_warns_that_the_optimizer_state_is_not_read():
  """The third argument is deprecated: passing it warns and changes nothing."""
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  tx = mpx.mixed_precision(optax.sgd(0.5), "params=bfloat16,compute=bfloat16")
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.ones((3,), jnp.bfloat16)}, state, params)
  with pytest.warns(DeprecationWarning, match=r"mpx.apply_updates\(params, updates\)"):
    old = mpx.apply_updates(params, updates, state)
  chex.assert_trees_all_equal(old, mpx.apply_updates(params, updates))
