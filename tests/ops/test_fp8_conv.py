"""Float8 convolutions on the CPU: the rounding against ml_dtypes, SQNR, the Flax adapters, delayed state.

What the compiled H100 program runs is pinned in ``tests/ops/test_fp8_target.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.ops import fp8_scaling
from mpx._src.ops import quantize as quantize_lib

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
NHWC = ("NHWC", "HWIO", "NHWC")


def _qdq(x, ml_dtype) -> np.ndarray:
  """``x`` rounded by ml_dtypes to the format with mpx's per-tensor power-of-two scale, saturating."""
  x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  scale = float(quantize_lib.scale_for(jnp.float32(np.abs(x).max()), ml_dtype))
  top = float(ml_dtypes.finfo(ml_dtype).max)
  return np.clip(x / scale, -top, top).astype(ml_dtype).astype(np.float64) * scale


def _conv_and_gradients(conv, x, w, g):
  """``(conv(x, w), *its vjp at g)``, compiled once."""

  @jax.jit
  def run(x, w, g):
    out, pullback = jax.vjp(conv, x, w)
    return (out, *pullback(g))

  return [np.asarray(t.astype(jnp.float32), np.float64) for t in run(x, w, g)]


def _float64_conv_and_gradients(x, w, g, **kwargs):
  with jax.enable_x64(True):
    out, pullback = jax.vjp(
      lambda a, b: jax.lax.conv_general_dilated(a, b, **kwargs), jnp.asarray(x), jnp.asarray(w)
    )
    return [np.asarray(t) for t in (out, *pullback(jnp.asarray(g)))]


# (input shape, kernel shape, strides, padding, kernel dilation, dimension numbers)
CASES = {
  "3x3": ((2, 9, 11, 16), (3, 3, 16, 32), (1, 1), "SAME", (1, 1), NHWC),
  "3x3-stride2": ((2, 9, 11, 16), (3, 3, 16, 32), (2, 2), "SAME", (1, 1), NHWC),
  "1x1-stride2": ((2, 9, 11, 16), (1, 1, 16, 32), (2, 2), "VALID", (1, 1), NHWC),
  "7x7-stride3": ((2, 16, 16, 16), (7, 7, 16, 16), (3, 3), ((3, 3), (3, 3)), (1, 1), NHWC),
  "uneven-pads-dilated": ((2, 10, 9, 16), (3, 2, 16, 16), (2, 1), ((2, 0), (1, 3)), (2, 1), NHWC),
  "1d": ((3, 17, 16), (5, 16, 32), (3,), "SAME", (1,), ("NWC", "WIO", "NWC")),
  "nchw": ((2, 16, 9, 11), (32, 16, 3, 3), (1, 2), "SAME", (1, 1), ("NCHW", "OIHW", "NCHW")),
}


_FAST_CASES = ("3x3-stride2", "uneven-pads-dilated")  # the phases; the dilated form


@pytest.mark.parametrize(
  "case",
  [
    pytest.param(case, id=name, marks=() if name in _FAST_CASES else (pytest.mark.slow,))
    for name, case in CASES.items()
  ],
)
def test_forward_and_both_gradients_are_float64_convolutions_of_the_float8_roundings(case):
  x_shape, w_shape, strides, padding, dilation, dims = case
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(x_shape) * 3).astype(np.float32)
  w = (rng.standard_normal(w_shape) * 0.1).astype(np.float32)
  kwargs = dict(
    window_strides=strides, padding=padding, rhs_dilation=dilation, dimension_numbers=dims
  )
  out_shape = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(a, b, **kwargs), x, w).shape
  g = (rng.standard_normal(out_shape) * 1e-4).astype(np.float32)

  got = _conv_and_gradients(lambda a, b: mpx.fp8.fp8_conv_general_dilated(a, b, **kwargs), x, w, g)
  # Forward E4M3 x E4M3; input gradient E5M2 gradient x E5M2 kernel; weight gradient
  # E4M3 input x E5M2 gradient: float64 convolutions of ml_dtypes' roundings.
  xq, wq, w5, gq = _qdq(x, E4M3), _qdq(w, E4M3), _qdq(w, E5M2), _qdq(g, E5M2)
  out = _float64_conv_and_gradients(xq, wq, gq, **kwargs)[0]
  dx = _float64_conv_and_gradients(xq, w5, gq, **kwargs)[1]
  dw = _float64_conv_and_gradients(xq, wq, gq, **kwargs)[2]
  for name, a, b in [("out", got[0], out), ("dx", got[1], dx), ("dw", got[2], dw)]:
    # float32 sums of exact products: only the summation order differs.
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * np.abs(b).max(), err_msg=name)
  # The float8 rounding is visible: a float32 convolution would not match.
  plain = _float64_conv_and_gradients(x, w, g, **kwargs)
  assert not np.allclose(got[0], plain[0], rtol=1e-3, atol=0)


def test_bfloat16_operands_give_a_bfloat16_output_and_gradients():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((3, 3, 16, 16)) * 0.1, jnp.bfloat16)
  g = jnp.ones((2, 8, 8, 16), jnp.bfloat16)

  def conv(a, b):
    return mpx.fp8.fp8_conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=NHWC)

  @jax.jit
  def run(x, w, g):
    out, pullback = jax.vjp(conv, x, w)
    return (out, *pullback(g))

  assert {t.dtype for t in run(x, w, g)} == {jnp.dtype(jnp.bfloat16)}


def test_saturation_and_nan_follow_the_float8_dot():
  x = np.ones((1, 4, 4, 16), np.float32)
  x[0, 0, 0, 0] = np.nan
  w = np.ones((1, 1, 16, 16), np.float32)
  conv = jax.jit(mpx.fp8.fp8_conv_general_dilated, static_argnums=(2, 3, 4, 5, 6))
  out = conv(x, w, (1, 1), "VALID", None, None, NHWC)
  # A NaN input makes its amax NaN: the scale falls back to 1, the NaN stays where it was.
  assert np.isnan(np.asarray(out)[0, 0, 0]).all() and np.isfinite(np.asarray(out)[0, 1:]).all()
  x = np.zeros((1, 2, 2, 16), np.float32)
  x[..., 0] = 1e4
  w = np.eye(16, dtype=np.float32).reshape(1, 1, 16, 16)
  # A fixed delayed scale of 1 (history amax 448): 1e4 saturates at E4M3's max.
  recipe = mpx.Fp8Recipe("delayed", history_length=1)
  state = tuple(jnp.array([0.0, 448.0]) for _ in range(3))
  out = jax.jit(
    lambda x, w, state: mpx.fp8.fp8_conv_general_dilated(
      x, w, (1, 1), "VALID", dimension_numbers=NHWC, recipe=recipe, state=state
    )
  )(x, w, state)
  np.testing.assert_array_equal(np.asarray(out)[..., 0], 448.0)


def test_groups_input_dilation_and_unaligned_features_run_the_plain_convolution():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 6, 6, 32)).astype(np.float32)
  w = rng.standard_normal((3, 3, 16, 32)).astype(np.float32)
  kwargs = dict(dimension_numbers=NHWC, feature_group_count=2)
  got = mpx.fp8.fp8_conv_general_dilated(x, w, (1, 1), "SAME", **kwargs)
  want = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", **kwargs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  w = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
  kwargs = dict(dimension_numbers=NHWC, lhs_dilation=(2, 2))
  got = mpx.fp8.fp8_conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), **kwargs)
  want = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), **kwargs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # A 3-channel stem: cuDNN's float8 kernels read 16 channels at a time.
  x, w = x[..., :3], rng.standard_normal((7, 7, 3, 32)).astype(np.float32)
  got = mpx.fp8.fp8_conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=NHWC)
  want = jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=NHWC)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _sqnr(x, reference) -> float:
  return float(10 * np.log10(np.sum(reference**2) / np.sum((x - reference) ** 2)))


@pytest.mark.parametrize("scaling", ["current", pytest.param("delayed", marks=pytest.mark.slow)])
def test_outputs_and_gradients_reach_20_db_on_tensors_with_outliers(scaling):
  # torchao's criterion, on a CNN's tensors: a few images and a few channels far larger
  # than the rest in the activations, a few images in the gradient.
  rng = np.random.default_rng(11)
  x = rng.standard_normal((8, 16, 16, 32))
  x[rng.choice(8, 2, replace=False)] *= 30.0
  x[..., rng.choice(32, 3, replace=False)] *= 20.0
  w = rng.standard_normal((3, 3, 32, 32)) * 0.05
  g = rng.standard_normal((8, 8, 8, 32)) * 1e-3
  g[rng.choice(8, 2, replace=False)] *= 30.0
  x, w, g = (t.astype(np.float32) for t in (x, w, g))
  recipe = mpx.Fp8Recipe(scaling)
  state = None
  if recipe.delayed:  # the steady state: histories that recorded these tensors' amaxes
    state = tuple(fp8_scaling.init_history(recipe).at[1].set(np.abs(t).max()) for t in (x, w, g))
  kwargs = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)

  def fp8(a, b):
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    out = mpx.fp8.fp8_conv_general_dilated(a, b, recipe=recipe, state=state, **kwargs)
    return out.astype(jnp.float32)

  got = _conv_and_gradients(fp8, x, w, g)
  want = _float64_conv_and_gradients(x, w, g, **kwargs)
  sqnrs = [_sqnr(a, b) for a, b in zip(got, want, strict=True)]
  assert min(sqnrs) >= 20, sqnrs


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_an_empty_batch_gives_empty_convolutions_and_zero_weight_gradients(scaling):
  recipe = mpx.Fp8Recipe(scaling)
  state = tuple(fp8_scaling.init_history(recipe) for _ in range(3)) if recipe.delayed else None
  x = jnp.zeros((0, 8, 8, 16), jnp.bfloat16)
  w = jnp.ones((3, 3, 16, 16), jnp.bfloat16)

  def conv(x, w):
    return mpx.fp8.fp8_conv_general_dilated(
      x, w, (2, 2), "SAME", dimension_numbers=NHWC, recipe=recipe, state=state
    )

  out, gx, gw = _conv_and_gradients(conv, x, w, jnp.zeros((0, 4, 4, 16), jnp.bfloat16))
  assert out.shape == (0, 4, 4, 16) and gx.shape == x.shape and gw.shape == w.shape
  assert not gw.any()


def test_delayed_state_gradient_is_the_observed_amax():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 6, 6, 16)) * 4, jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 16, 16)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 6, 6, 16)), jnp.float32)
  recipe = mpx.Fp8Recipe("delayed", history_length=4)
  state = tuple(fp8_scaling.init_history(recipe) for _ in range(3))

  def loss(state):
    out = mpx.fp8.fp8_conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=NHWC, recipe=recipe, state=state
    )
    return jnp.sum(out * g)

  observed = jax.jit(jax.grad(loss))(state)
  for history, tensor in zip(observed, (x, w, g), strict=True):
    assert history.shape == (5,) and history.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(history), [float(jnp.abs(tensor).max()), 0, 0, 0, 0])


class _LinenCnn(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(32, (3, 3), name="conv")(x))
    return nn.Conv(16, (1, 1), strides=(2, 2), name="proj")(x)


class _NnxCnn(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(16, 32, (3, 3), rngs=rngs)
    self.proj = nnx.Conv(32, 16, (1, 1), strides=(2, 2), rngs=rngs)

  def __call__(self, x):
    return self.proj(nnx.relu(self.conv(x)))


def _fp8_cnn_reference(params, x, recipe=None, state=None):
  """The two convolutions of the CNNs above by hand: bfloat16 operands into the float8 convolution."""
  bf16 = lambda t: jnp.asarray(t).astype(jnp.bfloat16)  # noqa: E731
  out = jnp.asarray(x).astype(jnp.bfloat16)
  for name, strides in (("conv", (1, 1)), ("proj", (2, 2))):
    out = mpx.fp8.fp8_conv_general_dilated(
      out, bf16(params[name]["kernel"]), strides, "SAME", dimension_numbers=NHWC, recipe=recipe
    )
    out = out + bf16(params[name]["bias"])
    out = nn.relu(out) if name == "conv" else out
  return out


def _x():
  return jnp.asarray(np.random.default_rng(4).standard_normal((2, 8, 8, 16)), jnp.float32)


def test_linen_conv_under_mixed_float8_is_the_float8_convolution():
  model = mpx.linen.apply_policy(_LinenCnn(), "mixed_float8")
  x = _x()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  out = jax.jit(model.apply)(variables, x)
  want = jax.jit(_fp8_cnn_reference)(variables["params"], x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  # A keep rule still takes a convolution out of float8.
  kept = mpx.linen.apply_policy(
    _LinenCnn(), "mixed_float8", rules=mpx.KeepRules().with_path("conv|proj", "mixed_bfloat16")
  )
  bf16 = jax.jit(mpx.linen.apply_policy(_LinenCnn(), "mixed_bfloat16").apply)(variables, x)
  np.testing.assert_array_equal(np.asarray(jax.jit(kept.apply)(variables, x)), np.asarray(bf16))
  assert not np.array_equal(np.asarray(out), np.asarray(bf16))


def test_nnx_conv_under_mixed_float8_is_the_float8_convolution():
  x = _x()
  model = mpx.nnx.apply_policy(_NnxCnn(nnx.Rngs(0)), "mixed_float8")
  params = {
    name: {"kernel": layer.kernel[...], "bias": layer.bias[...]}
    for name, layer in (("conv", model.conv), ("proj", model.proj))
  }
  run = nnx.jit(lambda model, x: model(x))
  np.testing.assert_array_equal(
    np.asarray(run(model, x)), np.asarray(jax.jit(_fp8_cnn_reference)(params, x))
  )
  kept = mpx.nnx.apply_policy(
    _NnxCnn(nnx.Rngs(0)),
    "mixed_float8",
    rules=mpx.KeepRules().with_path("conv|proj", "mixed_bfloat16"),
  )
  bf16 = mpx.nnx.apply_policy(_NnxCnn(nnx.Rngs(0)), "mixed_bfloat16")
  np.testing.assert_array_equal(np.asarray(run(kept, x)), np.asarray(run(bf16, x)))


def test_linen_delayed_histories_record_the_amaxes_and_commit():
  model = mpx.linen.apply_policy(_LinenCnn(), "mixed_float8_delayed")
  x = _x()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  histories = variables[mpx.linen.FP8_COLLECTION]
  assert set(histories) == {"conv", "proj"}
  assert set(histories["conv"]["Fp8ConvGeneralDilated_0"]) == {"lhs", "rhs", "grad"}

  def loss(params, histories):
    out = model.apply({"params": params, mpx.linen.FP8_COLLECTION: histories}, x)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  seen = jax.jit(jax.grad(loss, argnums=1))(variables["params"], histories)
  conv = seen["conv"]["Fp8ConvGeneralDilated_0"]
  np.testing.assert_allclose(float(conv["lhs"][0]), float(jnp.abs(x.astype(jnp.bfloat16)).max()))
  kernel = variables["params"]["conv"]["kernel"].astype(jnp.bfloat16)
  np.testing.assert_allclose(float(conv["rhs"][0]), float(jnp.abs(kernel).max()))
  assert float(conv["grad"][0]) > 0
  updated = jax.jit(mpx.fp8.update_fp8_state)(histories, seen)
  np.testing.assert_allclose(
    np.asarray(updated["conv"]["Fp8ConvGeneralDilated_0"]["lhs"])[:2], [0.0, conv["lhs"][0]]
  )


def test_nnx_delayed_histories_record_the_amaxes():
  x = _x()
  model = mpx.nnx.apply_policy(_NnxCnn(nnx.Rngs(0)), "mixed_float8_delayed")
  assert isinstance(model.conv.conv_general_dilated, mpx.nnx.Fp8ConvGeneralDilated)
  graphdef, params, histories = nnx.split(model, nnx.Param, mpx.nnx.Fp8History)

  def loss(histories):
    out = nnx.merge(graphdef, params, histories)(x)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  seen = jax.jit(jax.grad(loss))(histories)
  lhs = seen["conv"]["conv_general_dilated"]["lhs"][...]
  np.testing.assert_allclose(float(lhs[0]), float(jnp.abs(x.astype(jnp.bfloat16)).max()))
  assert float(seen["proj"]["conv_general_dilated"]["grad"][...][0]) > 0


@pytest.mark.parametrize("keep", ["all", pytest.param("weight_grad", marks=pytest.mark.slow)])
def test_kept_backward_products_multiply_the_dequantised_operands(keep):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((3, 3, 16, 16)) * 0.1, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((2, 4, 4, 16)) * 1e-3, jnp.bfloat16)
  kwargs = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)
  recipe = mpx.Fp8Recipe(keep_backward=keep)
  got = _conv_and_gradients(
    lambda a, b: mpx.fp8.fp8_conv_general_dilated(a, b, recipe=recipe, **kwargs), x, w, g
  )
  float8 = _conv_and_gradients(
    lambda a, b: mpx.fp8.fp8_conv_general_dilated(a, b, **kwargs), x, w, g
  )
  xq, wq = (jnp.asarray(_qdq(t, E4M3), jnp.bfloat16) for t in (x, w))
  kept = _conv_and_gradients(lambda a, b: jax.lax.conv_general_dilated(a, b, **kwargs), xq, wq, g)
  np.testing.assert_array_equal(got[0], float8[0])  # the forward stays float8
  np.testing.assert_array_equal(got[2], kept[2])  # the weight gradient is kept either way
  np.testing.assert_array_equal(got[1], kept[1] if keep == "all" else float8[1])
  assert not np.array_equal(kept[2], float8[2])
