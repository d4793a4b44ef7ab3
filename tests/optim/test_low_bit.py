"""Tests for 8-bit moments: ``mpx.with_state_dtype(inner, state_dtype="int8" | "float8_e4m3fn")``.

The reference is adam in float64 NumPy with the same block quantiser, written
here from the docstring's formulas: each step starts from the state mpx
stored, and must give the codes, scales and dequantised moments mpx stores
next (codes bit for bit, except where float32 and float64 round a value that
lies on a rounding boundary differently).
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from checkpoints import round_trip
from marks import all_but
from optax_compat import standard_promotion

import mpx
from mpx._src.optim import low_bit

FORMATS = ("int8", "float8_e4m3fn")
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8

# name -> (storage, signed, power, top): the codes the docstring describes.
REFERENCE_CODES = {
  "int8": ((np.int8, True, 2, 127.0), (np.uint8, False, 4, 255.0)),
  "float8_e4m3fn": (
    (ml_dtypes.float8_e4m3fn, True, 1, 448.0),
    (ml_dtypes.float8_e4m3fn, False, 1, 448.0),
  ),
}


def _blocks64(x, block):
  """Row-major blocks of ``block`` (the tests' shapes have whole blocks in their last axes)."""
  return np.asarray(x, np.float64).reshape(-1, block)


def _encode64(y, code):
  """Codes of ``y`` in float64, and each value's distance to a rounding boundary (in codes)."""
  storage, signed, power, top = code
  a = np.abs(y) if signed else np.maximum(y, 0.0)
  t = np.minimum(a ** (1.0 / power) * top, top)
  if np.issubdtype(storage, np.integer):
    q = np.round(t)
    boundary = np.abs(np.abs(t - np.floor(t)) - 0.5)
  else:
    q = t.astype(storage).astype(np.float64)
    lo = np.nextafter(q.astype(storage), np.array(-1, storage)).astype(np.float64)
    hi = np.nextafter(q.astype(storage), np.array(500, storage)).astype(np.float64)
    boundary = np.minimum(np.abs(t - (q + lo) / 2), np.abs(t - (q + hi) / 2)) / (hi - lo)
  if not signed:
    smallest = 1.0 if np.issubdtype(storage, np.integer) else 2.0**-9
    q = np.where((y > 0) & (q == 0), smallest, q)
  return np.where(y < 0, -q, q), boundary


def _decode64(q, code):
  _, _, power, top = code
  t = np.asarray(q, np.float64) / top
  return np.sign(t) * np.abs(t) ** power


def _quantize64(x, code, block):
  blocks = _blocks64(x, block)
  scales = np.abs(blocks).max(axis=-1)
  y = blocks / np.where(scales > 0, scales, 1.0)[:, None]
  q, boundary = _encode64(y, code)
  return q, scales, boundary


def _dequantize(qm, code, block):
  """A stored QuantizedMoment read back in float64 by the reference's own decoder."""
  q = np.asarray(jnp.asarray(qm.codes).astype(jnp.float32), np.float64).reshape(-1, block)
  return _decode64(q, code) * np.asarray(qm.scales, np.float64).reshape(-1)[:, None]


@pytest.mark.parametrize("fmt", FORMATS)
def test_adam_steps_match_a_float64_numpy_adam_with_the_same_quantiser(fmt):
  shape, block = (32, 512), 256
  tx = mpx.with_state_dtype(
    standard_promotion(optax.adam(LR, b1=B1, b2=B2, eps=EPS)), state_dtype=fmt
  )
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  code_mu, code_nu = REFERENCE_CODES[fmt]
  rng = np.random.default_rng(0)
  mismatches = total = 0
  for t in range(1, 11):
    # Gradients spanning five orders of magnitude within each block.
    g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-5, 0, shape)).astype(np.float32)
    mu = _dequantize(state[0].mu["w"], code_mu, block).reshape(shape)
    nu = _dequantize(state[0].nu["w"], code_nu, block).reshape(shape)
    g64 = g.astype(np.float64)
    mu, nu = B1 * mu + (1 - B1) * g64, B2 * nu + (1 - B2) * g64**2
    want_update = -LR * (mu / (1 - B1**t)) / (np.sqrt(nu / (1 - B2**t)) + EPS)

    updates, state = update({"w": jnp.asarray(g)}, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), want_update, rtol=2e-5, atol=1e-9)
    assert int(state[0].count) == t
    for moment, got, code in ((mu, state[0].mu["w"], code_mu), (nu, state[0].nu["w"], code_nu)):
      want_q, want_scales, boundary = _quantize64(moment, code, block)
      np.testing.assert_allclose(np.asarray(got.scales).reshape(-1), want_scales, rtol=1e-6)
      got_q = np.asarray(jnp.asarray(got.codes).astype(jnp.float32), np.float64).reshape(-1, block)
      differ = got_q != want_q
      # Only values within a hair of a rounding boundary may round the other way in float32.
      assert (boundary[differ] < 1e-3).all(), boundary[differ]
      mismatches, total = mismatches + int(differ.sum()), total + differ.size
      # The dequantised moments are exactly what the codes and scales stand for.
      same = ~differ
      want = _decode64(want_q, code) * want_scales[:, None]
      np.testing.assert_allclose(_dequantize(got, code, block)[same], want[same], rtol=1e-6)
  assert mismatches <= total * 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_state_layout_codes_keep_the_params_shape_tiny_leaves_stay_float32(fmt):
  params = {
    "kernel": jnp.zeros((64, 512)),  # trailing axis of whole blocks: scales (64, 2)
    "square": jnp.zeros((64, 64)),  # 4096 elements in blocks across rows: scales (16,)
    "odd": jnp.zeros((4099,)),  # padded last block: scales (17,)
    "bias": jnp.zeros((512,)),  # below min_size: float32
    "scalar": jnp.zeros(()),
  }
  tx = mpx.with_state_dtype(standard_promotion(optax.adamw(1e-3)), state_dtype=fmt)
  state = tx.init(params)
  mu, nu = state[0].mu, state[0].nu
  storage = {"int8": (jnp.int8, jnp.uint8), "float8_e4m3fn": (jnp.float8_e4m3fn,) * 2}[fmt]
  for name, scales in (("kernel", (64, 2)), ("square", (16,)), ("odd", (17,))):
    for moment, dtype in zip((mu, nu), storage, strict=True):
      assert isinstance(moment[name], mpx.QuantizedMoment)
      assert moment[name].codes.shape == params[name].shape
      assert moment[name].codes.dtype == dtype
      assert moment[name].scales.shape == scales and moment[name].scales.dtype == jnp.float32
  for name in ("bias", "scalar"):
    assert mu[name].dtype == nu[name].dtype == jnp.float32
  assert optax.tree_utils.tree_get(state, "nu") is nu
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, state), state)  # every field survives
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)

  @jax.jit
  def step(state):
    return tx.update(grads, state, params)[1]

  new = step(step(state))
  chex.assert_trees_all_equal_shapes_and_dtypes(new, state)  # no retrace, no dtype drift
  # The odd leaf's padding never leaks into its values.
  mu_odd = low_bit.dequantize(new[0].mu["odd"], low_bit.CODES[fmt][0], 256)
  np.testing.assert_allclose(mu_odd, np.full(4099, 0.01 * (1 - 0.81)), rtol=0.07)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_positive_second_moment_never_reads_back_as_zero(fmt):
  code = low_bit.CODES[fmt][1]
  nu = jnp.array([1.0] + [1e-30, 1e-20, 1e-12, 0.0] + [0.5] * 251, jnp.float32)
  back = low_bit.dequantize(low_bit.quantize(nu, code, 256), code, 256)
  assert (back[:4] > 0).all() and back[4] == 0
  # Second moments within the code's range keep a few percent of relative precision.
  np.testing.assert_allclose(back[5:], 0.5, rtol=0.03)


def test_int8_first_moment_resolves_small_values_a_linear_code_would_zero():
  code = low_bit.CODES["int8"][0]
  mu = jnp.array([1.0, -1e-3, 2e-3, -5e-4] + [0.0] * 252, jnp.float32)
  back = low_bit.dequantize(low_bit.quantize(mu, code, 256), code, 256)
  # A linear int8 code stops at 1/254 of the block's largest value; this one keeps sign and
  # size of values four hundred times smaller, within the square-root code's step.
  np.testing.assert_allclose(back[:4], mu[:4], rtol=0.35)
  assert (np.sign(back[:4]) == np.sign(mu[:4])).all()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_training_tracks_float32_moments(fmt):
  x = jax.random.normal(jax.random.key(0), (256, 64))
  w_true = jax.random.normal(jax.random.key(1), (64, 128))
  y = jnp.tanh(x @ w_true)

  def loss(p):
    return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)

  def run(tx):
    p = {"w": jnp.zeros((64, 128))}

    def step(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), loss(p)

    return jax.lax.scan(step, (p, tx.init(p)), None, length=300)[1]

  ref = jax.jit(lambda: run(standard_promotion(optax.adam(3e-2))))()
  got = jax.jit(
    lambda: run(mpx.with_state_dtype(standard_promotion(optax.adam(3e-2)), state_dtype=fmt))
  )()
  assert float(ref[-1]) < 0.02 * float(ref[0])
  # Measured: the last-20 mean losses differ by 0.0001 (int8) and 0.0003 (float8) from
  # float32 moments' 0.0025, after starting at about 0.4.
  gap = abs(float(got[-20:].mean()) - float(ref[-20:].mean()))
  assert gap < 0.005 * float(ref[0]), (gap, float(ref[0]))


def test_errors_name_the_accepted_formats_and_the_leaf():
  with pytest.raises(mpx.PolicyError, match=r"'int4'.*also accepts 'int8', 'float8_e4m3fn'"):
    mpx.with_state_dtype(optax.adam(1e-3), state_dtype="int4")
  with pytest.raises(mpx.ConfigError, match="block_size must be a positive int"):
    mpx.with_state_dtype(optax.adam(1e-3), state_dtype="int8", block_size=0)
  params = {"w": jnp.zeros((64, 64))}
  wide = standard_promotion(optax.adam(1e-3)).init(params)
  tx = mpx.with_state_dtype(standard_promotion(optax.adam(1e-3)), state_dtype="int8")
  with pytest.raises(mpx.StateError, match=r"'0/mu/w' is float32\[64, 64\], but .* int8"):
    tx.update(params, wide, params)
  fp8 = mpx.with_state_dtype(standard_promotion(optax.adam(1e-3)), state_dtype=jnp.float8_e4m3fn)
  with pytest.raises(mpx.StateError, match=r"'0/mu/w' is float8_e4m3fn codes"):
    tx.update(params, fp8.init(params), params)
  with pytest.raises(mpx.StateError, match=r"'0/mu/w' is block-quantised\[64, 64\]"):
    mpx.check_state(tx.init(params), params, "float32", state_dtype=jnp.float32)
  mpx.check_state(tx.init(params), params, "float32", state_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_orbax_round_trip_resumes_bitwise(fmt, tmp_path):
  params = {"w": jnp.linspace(-1, 1, 8192).reshape(16, 512), "b": jnp.zeros(512)}
  tx = mpx.with_state_dtype(standard_promotion(optax.adamw(1e-2)), state_dtype=fmt)

  @jax.jit
  def step(params, state, seed):
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for seed in range(3):
    params, state = step(params, state, seed)
  target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  restored = round_trip(tmp_path, {"params": params, "opt_state": state}, target)
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  chex.assert_trees_all_equal_dtypes(restored, {"params": params, "opt_state": state})
  assert isinstance(restored["opt_state"][0].mu["w"], mpx.QuantizedMoment)
  chex.assert_trees_all_equal(
    step(restored["params"], restored["opt_state"], 7), step(params, state, 7)
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  ("fmt", "dtype"),
  all_but(
    [(fmt, dtype) for dtype in (jnp.bfloat16, jnp.float16, jnp.float32) for fmt in FORMATS],
    ("int8", jnp.bfloat16),
  ),
)
def test_half_params_train_resume_and_keep_small_moments_in_float32(fmt, dtype, tmp_path):
  # torchao's test_optim_smoke and test_optim_default_dtype_bf16 (test/test_low_bit_optim.py)
  # in JAX: a 32 -> 256 -> 32 MLP in the param dtype, whose biases are under min_size. Issue
  # 34: their moments stayed in the param dtype at init, and the first update raised.
  keys = jax.random.split(jax.random.key(0), 5)
  params = {
    "w1": jax.random.normal(keys[0], (32, 256)).astype(dtype) / 8,
    "b1": jnp.zeros(256, dtype),
    "w2": jax.random.normal(keys[1], (256, 32)).astype(dtype) / 16,
    "b2": jnp.zeros(32, dtype),
  }
  tx = mpx.with_state_dtype(standard_promotion(optax.adam(1e-3)), state_dtype=fmt)

  @jax.jit
  def step(params, state, x):
    def loss(p):
      h = jax.nn.relu(x @ p["w1"] + p["b1"])
      return jnp.sum((h @ p["w2"] + p["b2"]).astype(jnp.float32))

    updates, state = tx.update(jax.grad(loss)(params), state, params)
    with jax.numpy_dtype_promotion("standard"):  # float32 updates of half params
      return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for moment in (state[0].mu, state[0].nu):
    assert isinstance(moment["w1"], mpx.QuantizedMoment)
    assert moment["b1"].dtype == moment["b2"].dtype == jnp.float32
  params, state = step(params, state, jax.random.normal(keys[2], (4, 32), dtype))
  name = np.dtype(dtype).name
  mpx.check_state(state, params, name, master_dtype=None, state_dtype=fmt)
  target = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  restored = round_trip(tmp_path, {"params": params, "opt_state": state}, target)
  resumed = (restored["params"], restored["opt_state"])
  for key in keys[3:]:
    x = jax.random.normal(key, (4, 32), dtype)
    params, state = step(params, state, x)
    resumed = step(*resumed, x)
  chex.assert_trees_all_equal(resumed, (params, state))
  chex.assert_trees_all_equal_dtypes(resumed, (params, state))
  # Adam ran in float32: float16 gradients squared in float16 made NaN updates.
  assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))
