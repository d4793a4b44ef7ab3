"""Float8 matmuls: quantisation against ml_dtypes, the scaling recipes, their state, the adapters."""

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from marks import all_but

import mpx
from mpx._src.ops import fp8_scaling
from mpx._src.ops import quantize as quantize_lib
from tests.optax_compat import standard_promotion

FORMATS = [(jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn), (jnp.float8_e5m2, ml_dtypes.float8_e5m2)]
DIMS = (((1,), (0,)), ((), ()))
HEAD = mpx.KeepRules().with_path("head$", "mixed_bfloat16")


def _reference(x: np.ndarray, ml_dtype) -> np.ndarray:
  """ml_dtypes' rounding, saturating finite values (ml_dtypes' own cast gives NaN or inf)."""
  top = float(ml_dtypes.finfo(ml_dtype).max)
  x = np.asarray(x, np.float32)
  clipped = np.where(np.isfinite(x), np.clip(x, -top, top), x)
  return clipped.astype(ml_dtype).astype(np.float32)


def _grid(ml_dtype) -> np.ndarray:
  info = ml_dtypes.finfo(ml_dtype)
  tiny = float(info.smallest_subnormal)
  rng = np.random.default_rng(0)
  normal = rng.standard_normal(2000) * np.exp2(rng.integers(-20, 20, 2000))
  specials = [0.0, -0.0, tiny, -tiny, tiny / 2, tiny * 0.75, tiny * 1.5, tiny * 3.5]
  specials += [float(info.max), float(info.max) * 1.01, 1e30, -1e30, np.nan, np.inf, -np.inf]
  return np.concatenate([normal, specials]).astype(np.float32)


@pytest.mark.parametrize(("dtype", "ml_dtype"), FORMATS)
@pytest.mark.parametrize("source", [jnp.float32, jnp.bfloat16])
def test_quantize_matches_ml_dtypes_with_saturation_subnormals_and_nan(dtype, ml_dtype, source):
  x = jnp.asarray(_grid(ml_dtype), source)
  q = np.asarray(quantize_lib.quantize(x, dtype, jnp.float32(1.0)).astype(jnp.float32))
  expected = _reference(np.asarray(x.astype(jnp.float32)), ml_dtype)
  np.testing.assert_array_equal(q, expected)  # NaN == NaN here; +-0 compare equal
  top = float(ml_dtypes.finfo(ml_dtype).max)
  assert top == {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[np.dtype(dtype).name]
  x32 = np.asarray(x.astype(jnp.float32))
  huge = np.isfinite(x32) & (np.abs(x32) > 2 * top)
  assert huge.sum() >= 2 and (np.abs(q[huge]) == top).all()  # saturates
  assert np.isnan(q[np.isnan(x32)]).all()
  tiny = float(ml_dtypes.finfo(ml_dtype).smallest_subnormal)
  assert ((q != 0) & (np.abs(q) < float(ml_dtypes.finfo(ml_dtype).smallest_normal))).any()
  assert q[x32 == np.float32(tiny * 1.5)].tolist() == [2 * tiny]  # a subnormal tie, to even


@pytest.mark.parametrize(("dtype", "ml_dtype"), FORMATS)
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_keeps_the_sign_of_zeros_bitwise(dtype, ml_dtype, jit):
  # E4M3FN saturates with no mask (clip minus (x - x)): -0 and values that round to -0
  # must keep their sign bit, as ml_dtypes' rounding does.
  x = np.array([-0.0, 0.0, -1e-30, 1e-30, -3.0, 1e6, -1e6, np.nan], np.float32)
  quantize = functools.partial(quantize_lib.quantize, dtype=dtype, scale=jnp.float32(1.0))
  q = (jax.jit(quantize) if jit else quantize)(jnp.asarray(x))
  np.testing.assert_array_equal(
    np.asarray(q).view(np.uint8)[:-1], _reference(x, ml_dtype).astype(ml_dtype).view(np.uint8)[:-1]
  )
  assert np.isnan(np.asarray(q.astype(jnp.float32))[-1])


def test_infinities_follow_the_format():
  x = jnp.array([np.inf, -np.inf], jnp.float32)
  e4m3 = quantize_lib.quantize(x, jnp.float8_e4m3fn, jnp.float32(1.0)).astype(jnp.float32)
  e5m2 = quantize_lib.quantize(x, jnp.float8_e5m2, jnp.float32(1.0)).astype(jnp.float32)
  assert np.isnan(np.asarray(e4m3)).all()  # E4M3FN has no infinity
  np.testing.assert_array_equal(np.asarray(e5m2), [np.inf, -np.inf])


@pytest.mark.parametrize(("dtype", "ml_dtype"), FORMATS)
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_is_the_power_of_two_that_fits_the_amax(dtype, ml_dtype, margin):
  top = float(ml_dtypes.finfo(ml_dtype).max)
  amaxes = np.array([1e-30, 3e-7, 0.5, 1.0, top, top * 2, top * 3, 7e4, 1e30], np.float32)
  scales = np.asarray(jax.vmap(lambda a: quantize_lib.scale_for(a, dtype, margin=margin))(amaxes))
  mantissa, _ = np.frexp(scales)
  assert (mantissa == 0.5).all()  # powers of two
  limit = top / 2**margin
  assert (amaxes / scales <= limit).all()
  assert (amaxes / scales > limit / 2).all()  # the largest such scale: no bit wasted
  for bad in (0.0, np.inf, np.nan):
    assert float(quantize_lib.scale_for(jnp.float32(bad), dtype)) == 1.0


# Rows longer than XLA's one-kernel reduction, trailing axes that make a row, an axis split
# to bring the row count down (4096 rows), a prime one that cannot be (4099), a tensor of one
# row, a prime size, a scalar, an empty tensor.
AMAX_SHAPES = [(3, 40_000), (7, 5, 3000), (4096, 16, 64), (4099, 8), (2, 3, 4), (13,), (), (0, 4)]


@pytest.mark.parametrize("margin", [0, 1])
def test_per_tensor_scale_of_any_shape_is_the_scale_of_its_amax(margin):
  rng = np.random.default_rng(5)
  xs = []
  for i, shape in enumerate(AMAX_SHAPES):
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size:  # the largest magnitude anywhere, so that a missed row would show
      x.flat[rng.integers(x.size)] = -(10.0 ** (i - 3)) * 3e3
    xs.append(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)))

  @jax.jit
  def scales(*xs):
    return [
      quantize_lib.tensor_scale(x.astype(jnp.bfloat16), jnp.float8_e4m3fn, margin=margin)
      for x in xs
    ]

  for x, scale in zip(xs, scales(*xs), strict=True):
    # An empty tensor gets the smallest scale, 2**-126, which represents its zeros.
    want = 2.0**-126
    if x.size:
      amax = jnp.float32(np.abs(x).max())
      want = float(quantize_lib.scale_for(amax, jnp.float8_e4m3fn, margin=margin))
    assert scale.shape == () and float(scale) == want, (x.shape, float(scale), want)
    if x.size:
      partials = np.asarray(jax.jit(quantize_lib.partial_amaxes)(jnp.asarray(x)))
      assert partials.max() == np.abs(x).max(), x.shape


@pytest.mark.parametrize(("dtype", "ml_dtype"), FORMATS)
def test_quantize_dequantize_with_current_scaling_is_exact_rounding(dtype, ml_dtype):
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64,)) * 3e3, jnp.bfloat16)
  out = mpx.fp8.quantize_dequantize(x, dtype)
  assert out.dtype == jnp.bfloat16
  x32 = np.asarray(x.astype(jnp.float32))
  scale = float(quantize_lib.scale_for(jnp.float32(np.abs(x32).max()), dtype))
  np.testing.assert_array_equal(
    np.asarray(out.astype(jnp.float32)), _reference(x32 / scale, ml_dtype) * scale
  )
  # The amax itself lands within the format's top binade, unsaturated.
  assert np.abs(np.asarray(out.astype(jnp.float32))).max() == pytest.approx(
    np.abs(x32).max(), rel=2**-3
  )


@pytest.mark.parametrize(("dtype", "ml_dtype"), FORMATS)
@pytest.mark.parametrize("top", [1e-3, 1e-5, 3e-7])
def test_current_scaling_of_small_float16_tensors_keeps_the_scale_in_float32(dtype, ml_dtype, top):
  # float16's exponent range is narrower than float32's: a scale cast to float16
  # underflows to zero for these amaxes, and x / 0 is not finite.
  x32 = np.random.default_rng(7).uniform(-1, 1, 64).astype(np.float32) * top
  x = jnp.asarray(x32, jnp.float16)
  out = mpx.fp8.quantize_dequantize(x, dtype)
  assert out.dtype == jnp.float16 and np.isfinite(np.asarray(out, np.float32)).all()
  x16 = np.asarray(x, np.float32)
  scale = float(quantize_lib.scale_for(jnp.float32(np.abs(x16).max()), dtype))
  expected = (_reference(x16 / scale, ml_dtype).astype(np.float64) * scale).astype(np.float16)
  np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("source", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale", [None, 1.0], ids=["current", "fixed"])
def test_straight_through_gradient_is_the_identity_within_range(source, scale):
  x = jnp.asarray([1.0, 0.3, -5.0, 2.7, 700.0], source)  # 700 saturates E4M3 at scale 1
  ct = jnp.asarray([1000.0, 0.3, 1e-9, 0.123456, 5.0], source)
  scale = None if scale is None else jnp.float32(scale)

  def loss(x, straight_through):
    out = mpx.fp8.quantize_dequantize(
      x, jnp.float8_e4m3fn, scale=scale, straight_through=straight_through
    )
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss), static_argnums=1)(x, True)
  assert grad.dtype == source
  expected = np.array(ct.astype(jnp.float32))
  if scale is not None:
    expected[-1] = 0.0  # saturated: the output does not move with x there
  np.testing.assert_array_equal(np.asarray(grad.astype(jnp.float32)), expected)
  # Same forward; the default differentiates through the rounding, cotangent included.
  np.testing.assert_array_equal(
    np.asarray(
      mpx.fp8.quantize_dequantize(x, jnp.float8_e4m3fn, scale=scale, straight_through=True)
    ),
    np.asarray(mpx.fp8.quantize_dequantize(x, jnp.float8_e4m3fn, scale=scale)),
  )
  rounded = np.asarray(jax.grad(loss)(x, False).astype(jnp.float32))
  assert not np.array_equal(rounded[:4], expected[:4])


def _operands():
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.standard_normal((8, 32)) * 5, jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((32, 16)) * 0.05, jnp.bfloat16)
  return lhs, rhs


def _qdq_np(x, ml_dtype) -> np.ndarray:
  x = np.asarray(jnp.asarray(x).astype(jnp.float32))
  scale = float(quantize_lib.scale_for(jnp.float32(np.abs(x).max()), ml_dtype))
  return _reference(x / scale, ml_dtype) * scale


def _product_and_gradients(f, lhs, rhs, g):
  """``(f(lhs, rhs), *its vjp at g)``, compiled once (op by op, the float8 casts compile slowly)."""

  @jax.jit
  def run(lhs, rhs, g):
    out, pullback = jax.vjp(f, lhs, rhs)
    return (out, *pullback(g))

  return run(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(g))


def test_fp8_dot_general_forward_and_backward_use_float8_operands():
  lhs, rhs = _operands()
  g = jnp.asarray(np.random.default_rng(3).standard_normal((8, 16)) * 1e-6, jnp.bfloat16)

  @jax.jit
  def forward_and_backward(lhs, rhs, g):
    out, pullback = jax.vjp(lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS), lhs, rhs)
    return out, pullback(g)

  out, (ga, gb) = forward_and_backward(lhs, rhs, g)
  a, b = _qdq_np(lhs, ml_dtypes.float8_e4m3fn), _qdq_np(rhs, ml_dtypes.float8_e4m3fn)
  gq = _qdq_np(g, ml_dtypes.float8_e5m2)
  assert out.dtype == jnp.bfloat16
  # float32 sums of exact float8 products, rounded once to bfloat16.
  np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), a @ b, rtol=2**-8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ga.astype(jnp.float32)), gq @ b.T, rtol=2**-8, atol=1e-12)
  np.testing.assert_allclose(np.asarray(gb.astype(jnp.float32)), a.T @ gq, rtol=2**-8, atol=1e-12)
  # Without float8 the tiny gradient would differ: E5M2 rounding is visible.
  assert not np.allclose(gq, np.asarray(g.astype(jnp.float32)), rtol=1e-3)


# (lhs shape, rhs shape, dimension numbers, einsum of the same product): batch axes,
# several contracting axes in an order of their own, free axes on both sides.
_GENERAL_DOTS = [
  ((4, 6, 8), (8, 5), (((2,), (0,)), ((), ())), "abk,kn->abn"),
  ((3, 4, 8), (3, 8, 5), (((2,), (1,)), ((0,), (0,))), "bmk,bkn->bmn"),
  ((6, 4, 2, 3), (3, 5, 2, 6), (((3, 2), (0, 2)), ((0,), (3,))), "bmij,jniB->bmn"),
  ((8, 3), (5, 8), (((0,), (1,)), ((), ())), "km,nk->mn"),
]


@pytest.mark.parametrize(
  "lhs_shape,rhs_shape,dims,_", _GENERAL_DOTS, ids=[d[3] for d in _GENERAL_DOTS]
)
def test_fp8_dot_general_handles_batch_and_several_contracting_axes(lhs_shape, rhs_shape, dims, _):
  rng = np.random.default_rng(7)
  lhs = jnp.asarray(rng.standard_normal(lhs_shape) * 3, jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(rhs_shape) * 0.1, jnp.float32)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs).shape
  g = jnp.asarray(rng.standard_normal(out_shape) * 1e-3, jnp.float32)
  out, ga, gb = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, dims), lhs, rhs, g
  )
  # The reference: float64 products of the float8-rounded operands and gradient, with
  # the plain dot_general's own transposes.
  a, b = _qdq_np(lhs, ml_dtypes.float8_e4m3fn), _qdq_np(rhs, ml_dtypes.float8_e4m3fn)
  gq = _qdq_np(g, ml_dtypes.float8_e5m2)
  f64 = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  ref_out, ref_pullback = jax.vjp(
    lambda x, y: jax.lax.dot_general(x, y, dims, precision="highest"),
    jnp.asarray(a, f64),
    jnp.asarray(b, f64),
  )
  ref_ga, ref_gb = ref_pullback(jnp.asarray(gq, f64))
  assert ga.shape == lhs.shape and gb.shape == rhs.shape
  for got, want in ((out, ref_out), (ga, ref_ga), (gb, ref_gb)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
  "lhs_shape,rhs_shape,dims,_",
  all_but(_GENERAL_DOTS, _GENERAL_DOTS[2]),
  ids=[d[3] for d in _GENERAL_DOTS],
)
def test_mxfp8_handles_batch_and_several_contracting_axes(lhs_shape, rhs_shape, dims, _):
  # Blocks along flattened contractions, padded to 32: close to float32 for every layout.
  rng = np.random.default_rng(8)
  lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs).shape
  g = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
  recipe = mpx.Fp8Recipe("mxfp8")
  got = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, dims, recipe=recipe), lhs, rhs, g
  )
  want = _product_and_gradients(
    lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), lhs, rhs, g
  )
  for x, y in zip(got, want, strict=True):
    assert x.shape == y.shape and _sqnr(x, y) > 25


def _rows_qdq(x, axis):
  """x rounded to E4M3 with a power-of-two scale per index of the axes other than ``axis``."""
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=axis, keepdims=True)
  scale = np.asarray(quantize_lib.scale_for(jnp.asarray(amax), jnp.float8_e4m3fn))
  return _reference(x / scale, ml_dtypes.float8_e4m3fn) * scale, scale


def test_rowwise_forward_and_backward_match_a_numpy_reference():
  rng = np.random.default_rng(5)
  lhs = rng.standard_normal((16, 64)).astype(np.float32) * np.exp2(rng.integers(-12, 12, (16, 1)))
  rhs = rng.standard_normal((64, 8)).astype(np.float32) * np.exp2(rng.integers(-12, 12, (1, 8)))
  g = rng.standard_normal((16, 8)).astype(np.float32) * 1e-4
  recipe = mpx.Fp8Recipe("rowwise")
  out, ga, gb = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=recipe), lhs, rhs, g
  )
  # Forward: a scale per row of lhs (over its contracted columns), per column of rhs.
  a, a_scale = _rows_qdq(lhs, 1)
  b, b_scale = _rows_qdq(rhs, 0)
  # Backward: the saved float8 operands as they are; the other side's scales folded
  # into the gradient, which is rounded to E4M3 per row of the product it feeds.
  ga_ref = _rows_qdq(g * b_scale, 1)[0] @ (b / b_scale).T
  gb_ref = (a / a_scale).T @ _rows_qdq(g * a_scale, 0)[0]
  for got, want in ((out, a @ b), (ga, ga_ref), (gb, gb_ref)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=0)
  # Per tensor, the rows 2**24 times smaller than the largest would be flushed to zero.
  assert np.all(np.abs(np.asarray(out)).max(axis=1) > 0)


def _blocks_qdq(x, axis, size=32):
  """x rounded to E4M3 with a power-of-two scale per block of ``size`` along ``axis`` (zero-padded).

  Blocks of 32 have E8M0 scales (MXFP8, at least 2**-127), blocks of 128 float32 ones (blockwise).
  """
  x = np.asarray(x, np.float32)
  pad = -x.shape[axis] % size
  widths = [(0, pad if d == axis else 0) for d in range(x.ndim)]
  padded = np.pad(x, widths)
  shape = padded.shape
  blocks = np.moveaxis(padded, axis, -1).reshape(*np.delete(shape, axis), -1, size)
  amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
  scale = np.asarray(quantize_lib.scale_for(jnp.asarray(amax), jnp.float8_e4m3fn))
  scale = np.maximum(scale, 2.0**-127) if size == 32 else scale
  rounded = _reference(blocks / scale, ml_dtypes.float8_e4m3fn) * scale
  rounded = np.moveaxis(rounded.reshape(*np.delete(shape, axis), shape[axis]), -1, axis)
  return rounded[tuple(slice(0, n) for n in x.shape)]


@pytest.mark.parametrize(
  "m,k,n", all_but([(64, 96, 32), (20, 50, 10)], (20, 50, 10)), ids=["aligned", "padded"]
)
def test_mxfp8_forward_and_backward_match_a_numpy_reference(m, k, n):
  rng = np.random.default_rng(6)
  # Magnitudes that change every few elements: each block of 32 gets its own scale.
  lhs = rng.standard_normal((m, k)) * np.exp2(rng.integers(-20, 20, (m, k)) // 8 * 4)
  rhs = rng.standard_normal((k, n)) * np.exp2(rng.integers(-20, 20, (k, n)) // 8 * 4)
  lhs, rhs = lhs.astype(np.float32), rhs.astype(np.float32)
  g = (rng.standard_normal((m, n)) * 1e-4).astype(np.float32)
  recipe = mpx.Fp8Recipe("mxfp8")
  out, ga, gb = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=recipe), lhs, rhs, g
  )
  # Each product's operands in blocks of 32 along the axis it contracts.
  products = (
    (out, _blocks_qdq(lhs, 1), _blocks_qdq(rhs, 0)),
    (ga, _blocks_qdq(g, 1), _blocks_qdq(rhs, 1).T),
    (gb, _blocks_qdq(lhs, 0).T, _blocks_qdq(g, 0)),
  )
  for got, a, b in products:
    # float32 sums in another order than float64's: within a few ulps of sum(|a||b|).
    error = np.abs(np.asarray(got, np.float64) - a.astype(np.float64) @ b)
    assert np.all(error <= 2**-20 * (np.abs(a).astype(np.float64) @ np.abs(b)))
  # One scale per tensor or per row would flush the smallest blocks to zero.
  assert np.count_nonzero(np.asarray(out)) == out.size


def _tiles_qdq(w, size=128):
  """w (2-D) rounded to E4M3 with a float32 power-of-two scale per size x size tile (zero-padded)."""
  w = np.asarray(w, np.float32)
  rows, cols = w.shape
  padded = np.pad(w, [(0, -rows % size), (0, -cols % size)])
  tiles = padded.reshape(padded.shape[0] // size, size, padded.shape[1] // size, size)
  amax = np.max(np.abs(tiles), axis=(1, 3), keepdims=True)
  scale = np.asarray(quantize_lib.scale_for(jnp.asarray(amax), jnp.float8_e4m3fn))
  rounded = (_reference(tiles / scale, ml_dtypes.float8_e4m3fn) * scale).reshape(padded.shape)
  return rounded[:rows, :cols]


@pytest.mark.parametrize(
  "m,k,n", all_but([(128, 256, 128), (100, 200, 130)], (100, 200, 130)), ids=["aligned", "padded"]
)
def test_blockwise_forward_and_backward_match_a_numpy_reference(m, k, n):
  rng = np.random.default_rng(7)
  # lhs: magnitudes that change every 64 columns, so that 1 x 128 blocks differ from rows;
  # rhs: columns 2**-12 apart inside a tile, so that a tile's scale (set by its largest
  # column) rounds the small columns coarser than a scale per 1 x 128 block would.
  magnitudes = np.repeat(np.exp2(rng.integers(-16, 16, (m, -(-k // 64)))), 64, axis=1)[:, :k]
  lhs = np.asarray(rng.standard_normal((m, k)) * magnitudes, np.float32)
  rhs = np.asarray(rng.standard_normal((k, n)) * np.exp2(-12.0 * (np.arange(n) % 2)), np.float32)
  g = (rng.standard_normal((m, n)) * 1e-4).astype(np.float32)
  recipe = mpx.Fp8Recipe("blockwise")
  out, ga, gb = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=recipe), lhs, rhs, g
  )
  w = _tiles_qdq(rhs)  # quantised once, for the forward and the input gradient
  products = (
    (out, _blocks_qdq(lhs, 1, 128), w),
    (ga, _blocks_qdq(g, 1, 128), w.T),
    (gb, _blocks_qdq(lhs, 0, 128).T, _blocks_qdq(g, 0, 128)),
  )
  for got, a, b in products:
    error = np.abs(np.asarray(got, np.float64) - a.astype(np.float64) @ b)
    assert np.all(error <= 2**-20 * (np.abs(a).astype(np.float64) @ np.abs(b)))
  # The tiles are tiles: per 1 x 128 block along k, the small columns would round finer.
  per_block = _blocks_qdq(lhs, 1, 128).astype(np.float64) @ _blocks_qdq(rhs, 0, 128)
  assert not np.allclose(np.asarray(out, np.float64), per_block, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
  ("keep", "scaling"),
  all_but(
    [
      ("all", "current"),
      ("weight_grad", "current"),
      ("all", "rowwise"),
      ("weight_grad", "rowwise"),
    ],
    ("all", "current"),
  ),
)
def test_kept_backward_products_multiply_the_dequantised_operands_in_bfloat16(keep, scaling):
  lhs, rhs = _operands()
  g = jnp.asarray(np.random.default_rng(3).standard_normal((8, 16)) * 1e-6, jnp.bfloat16)
  kept = mpx.Fp8Recipe(scaling, keep_backward=keep)
  out, ga, gb = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=kept), lhs, rhs, g
  )
  full_out, fp8_ga, _ = _product_and_gradients(
    lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=mpx.Fp8Recipe(scaling)), lhs, rhs, g
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(full_out))  # the forward is float8
  # The reference: the saved float8 operands, dequantised, times the bfloat16 gradient.
  a = jnp.asarray(
    _qdq_np(lhs, ml_dtypes.float8_e4m3fn) if scaling == "current" else _rows_qdq(lhs, 1)[0],
    jnp.bfloat16,
  )
  b = jnp.asarray(
    _qdq_np(rhs, ml_dtypes.float8_e4m3fn) if scaling == "current" else _rows_qdq(rhs, 0)[0],
    jnp.bfloat16,
  )
  _, reference = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, DIMS), a, b)
  want_ga, want_gb = reference(g)
  np.testing.assert_array_equal(np.asarray(gb), np.asarray(want_gb))
  if keep == "all":
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(want_ga))
  else:  # the input gradient stays a float8 product: the tiny gradient rounds in E5M2 / E4M3
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(fp8_ga))
    assert not np.array_equal(np.asarray(ga), np.asarray(want_ga))


def test_keep_backward_round_trips_and_rejects_mxfp8():
  policy = mpx.get_policy("p=f32,c=bf16,o=f32,fp8=rowwise:keep_backward=weight_grad")
  assert policy.fp8 == mpx.Fp8Recipe("rowwise", keep_backward="weight_grad")
  assert mpx.get_policy(str(policy)) == policy
  with pytest.raises(mpx.PolicyError, match="Unknown keep_backward 'wgrad'"):
    mpx.Fp8Recipe("current", keep_backward="wgrad")
  with pytest.raises(mpx.PolicyError, match="not to 'mxfp8'"):
    mpx.get_policy("p=f32,c=bf16,fp8=mxfp8:keep_backward=all")
  with pytest.raises(mpx.PolicyError, match="not to 'blockwise'"):
    mpx.Fp8Recipe("blockwise", keep_backward="weight_grad")


def _sqnr(x, reference) -> float:
  x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
  return float(10 * np.log10(np.sum(reference**2) / np.sum((x - reference) ** 2)))


def _with_outliers(rng, shape, scale, rows, columns):
  """Gaussian values, a few rows ``rows`` times larger and a few columns ``columns`` times larger."""
  x = rng.standard_normal(shape) * scale
  x[rng.choice(shape[0], 4, replace=False)] *= rows
  x[:, rng.choice(shape[1], 4, replace=False)] *= columns
  return x.astype(np.float32)


@pytest.mark.parametrize(
  "scaling,target",
  all_but(
    [("current", 20), ("delayed", 20), ("rowwise", 25), ("mxfp8", 25), ("blockwise", 25)],
    ("current", 20),
  ),
)
def test_outputs_and_gradients_reach_the_sqnr_targets_on_tensors_with_outliers(scaling, target):
  # torchao's criterion: SQNR against float32 of the output and both gradients,
  # here on activations with outlier tokens and channels and gradients with
  # outlier tokens (an LLM's linear layer).
  rng = np.random.default_rng(11)
  x = _with_outliers(rng, (256, 512), 1.0, 50.0, 20.0)
  w = (rng.standard_normal((512, 256)) * 0.02).astype(np.float32)
  g = _with_outliers(rng, (256, 256), 1e-3, 30.0, 1.0)
  recipe = mpx.Fp8Recipe(scaling)
  state = None
  if recipe.delayed:  # the steady state: histories that recorded these tensors' amaxes
    state = tuple(fp8_scaling.init_history(recipe).at[1].set(np.abs(t).max()) for t in (x, w, g))

  def fp8(a, b):
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=recipe, state=state).astype(jnp.float32)

  def exact(a, b):
    return jax.lax.dot_general(a, b, DIMS, precision="highest")

  results = [_product_and_gradients(f, x, w, g) for f in (fp8, exact)]
  sqnrs = [_sqnr(got, want) for got, want in zip(*results, strict=True)]
  assert min(sqnrs) >= target, sqnrs


def test_delayed_state_gradient_is_the_observed_amax():
  lhs, rhs = _operands()
  recipe = mpx.Fp8Recipe("delayed", history_length=4)
  state = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  g = jnp.full((8, 16), 3.0, jnp.bfloat16)

  def loss(state):
    out = mpx.fp8.fp8_dot_general(lhs, rhs, DIMS, recipe=recipe, state=state)
    return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

  observed = jax.jit(jax.grad(loss))(state)
  amaxes = [float(jnp.abs(t.astype(jnp.float32)).max()) for t in (lhs, rhs, g)]
  for history, amax in zip(observed, amaxes, strict=True):
    assert history.shape == (5,) and history.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(history), [amax, 0, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize(
  ("reduction", "margin", "expected_amax"), [("max", 0, 1000.0), ("most_recent", 0, 100.0)]
)
def test_delayed_scale_reduces_the_history(reduction, margin, expected_amax):
  recipe = mpx.Fp8Recipe("delayed", history_length=3, reduction=reduction, margin=margin)
  history = jnp.array([5e4, 100.0, 1000.0, 10.0])  # the pending slot is never read
  scale = fp8_scaling.history_scales([history], [quantize_lib.E4M3], recipe)[0]
  assert float(scale) == float(
    quantize_lib.scale_for(jnp.float32(expected_amax), quantize_lib.E4M3)
  )
  with_margin = dataclasses.replace(recipe, margin=2)
  assert float(
    fp8_scaling.history_scales([history], [quantize_lib.E4M3], with_margin)[0]
  ) == 4 * float(scale)


def test_delayed_scale_ignores_the_current_tensor():
  # Once something is recorded, the scale comes from the history alone: a value
  # beyond E4M3's max saturates this step, and is recorded for the next one.
  # Current scaling would have fitted it.
  recipe = mpx.Fp8Recipe("delayed", history_length=2)
  empty = fp8_scaling.init_history(recipe)
  lhs = jnp.array([[960.0, 1.0]], jnp.float32)  # 960 = 240 * 4, exact in E4M3 at scale 4
  rhs = jnp.ones((2, 1), jnp.float32)
  small = (jnp.array([0.0, 240.0, 0.0]), empty, empty)
  filled = (jnp.array([0.0, 960.0, 0.0]), empty, empty)

  @jax.jit  # one compile for the three products (op by op, each cast compiles)
  def products(small, filled):
    dot = functools.partial(mpx.fp8.fp8_dot_general, lhs, rhs, DIMS)
    return dot(recipe=recipe, state=small), dot(), dot(recipe=recipe, state=filled)

  delayed, current, refitted = products(small, filled)
  assert float(delayed[0, 0]) == 448.0 + 1.0
  assert float(current[0, 0]) == 960.0 + 1.0
  assert float(refitted[0, 0]) == 961.0


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_scaling_is_current_scaling_with_the_amaxes_recorded_and_scale_one_before(
  reduction,
):
  # A history holding each tensor's own amax gives current scaling's products, bit for
  # bit. An empty one (the first step) gives scale 1, known before the tensor is read
  # (as in Transformer Engine and Flax): 960 saturates at 448 and the 1e-6 gradients,
  # below E5M2's smallest subnormal (2**-16), flush to zero.
  recipe = mpx.Fp8Recipe("delayed", history_length=2, reduction=reduction)
  lhs = jnp.array([[960.0, 1.0], [3.0, -2.0]], jnp.float32)
  rhs = jnp.array([[0.5], [0.25]], jnp.float32)
  g = jnp.array([[1e-6], [-3e-6]], jnp.float32)
  empty = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  # Older entries smaller than the most recent: both reductions read the amax.
  recorded = tuple(jnp.array([0.0, float(jnp.abs(t).max()), 1e-12]) for t in (lhs, rhs, g))

  @functools.partial(jax.jit, static_argnums=0)
  def run(recipe, state):
    out, pullback = jax.vjp(
      lambda a, b: mpx.fp8.fp8_dot_general(a, b, DIMS, recipe=recipe, state=state), lhs, rhs
    )
    return out, *pullback(g)

  delayed, current = run(recipe, recorded), run(mpx.Fp8Recipe("current"), None)
  for d, c in zip(delayed, current, strict=True):
    np.testing.assert_array_equal(np.asarray(d), np.asarray(c))
  assert float(delayed[0][0, 0]) == 960.0 * 0.5 + 0.25
  assert np.asarray(delayed[2]).any()  # the weight gradient is not flushed to zero
  first = run(recipe, empty)
  assert float(first[0][0, 0]) == 448.0 * 0.5 + 0.25
  assert not np.asarray(first[2]).any()


def test_update_rolls_commits_and_keeps_a_running_max():
  history = jnp.array([0.0, 4.0, 2.0, 1.0])
  seen = lambda v: jnp.array([v, 0.0, 0.0, 0.0])  # noqa: E731
  step = jax.jit(mpx.fp8.update_fp8_state)
  h = step(history, seen(3.0), commit=False)
  h = step(h, seen(7.0), commit=jnp.asarray(False))
  h = step(h, seen(5.0), commit=False)
  np.testing.assert_array_equal(np.asarray(h), [7.0, 4.0, 2.0, 1.0])  # max, not last
  h = step(h, seen(0.5), commit=True)
  np.testing.assert_array_equal(np.asarray(h), [0.0, 7.0, 4.0, 2.0])  # oldest (1.0) dropped
  assert h.dtype == history.dtype and h.shape == history.shape
  # Same dtypes and shapes on both branches of a cond, and through a pytree round trip.
  tree = {"a": {"lhs": history, "grad": history}}
  out = jax.lax.cond(True, lambda t: mpx.fp8.update_fp8_state(t, t), lambda t: t, tree)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x, out), out)


@pytest.mark.parametrize(
  "scaling",
  all_but(["current", "delayed", "rowwise", "mxfp8", "blockwise"], "current", "delayed", "mxfp8"),
)
def test_an_empty_batch_runs_every_recipe_and_records_nothing(scaling):
  # The last batch of a sharded epoch may be empty: empty products, zero weight
  # gradients, and (delayed) no amax recorded for the empty tensors.
  recipe = mpx.Fp8Recipe(scaling, history_length=2)
  empty = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  before = (jnp.array([0.0, 5.0, 3.0]), jnp.array([0.0, 1.0, 1.0]), jnp.array([0.0, 2.0, 1.0]))
  state = before if recipe.delayed else None
  x = jnp.zeros((0, 32), jnp.bfloat16)
  w = jnp.full((32, 16), 0.5, jnp.bfloat16)

  @jax.jit
  def run(x, w, state):
    def loss(x, w, state):
      return jnp.sum(mpx.fp8.fp8_dot_general(x, w, DIMS, recipe=recipe, state=state))

    out = mpx.fp8.fp8_dot_general(x, w, DIMS, recipe=recipe, state=state)
    return out, jax.grad(loss, argnums=(0, 1, 2))(x, w, state)

  out, (gx, gw, observed) = run(x, w, state)
  assert out.shape == (0, 16) and gx.shape == (0, 32) and gw.shape == w.shape
  assert not np.asarray(gw.astype(jnp.float32)).any()
  if recipe.delayed:
    assert [float(o[0]) for o in observed] == [0.0, 0.5, 0.0]
    after = mpx.fp8.update_fp8_state(before, observed)
    # The empty tensors' zero amax is recorded, and the next step's scales do not see it.
    np.testing.assert_array_equal(np.asarray(after[0]), [0.0, 0.0, 5.0])
    np.testing.assert_array_equal(np.asarray(after[1]), [0.0, 0.5, 1.0])  # the weight's amax
    for reduction in ("max", "most_recent"):
      r = dataclasses.replace(recipe, reduction=reduction)
      for old, new in ((before[0], after[0]), (before[2], after[2])):
        old_scale = fp8_scaling.history_scales([old], [quantize_lib.E4M3], r)[0]
        assert float(fp8_scaling.history_scales([new], [quantize_lib.E4M3], r)[0]) == float(
          old_scale
        )
    assert float(fp8_scaling.history_scales([empty[0]], [quantize_lib.E4M3], recipe)[0]) == 1.0


@pytest.mark.parametrize("commit", all_but([True, False], True))
def test_histories_updated_together_match_each_updated_alone(commit):
  # update_fp8_state stacks the histories of one shape into one update: the result of
  # each is that of its update alone, whatever else the tree holds (a non-finite amax,
  # other lengths, nn.scan's stacked layers).
  rng = np.random.default_rng(9)
  shapes = [(2,), (5,), (5,), (5,), (3, 5), (5,), (2,)]
  state = [jnp.asarray(rng.uniform(0, 10, s), jnp.float32) for s in shapes]
  observed = [jnp.zeros_like(h).at[..., 0].set(rng.uniform(0, 20, h.shape[:-1])) for h in state]
  observed[2] = observed[2].at[0].set(jnp.inf)

  def alone(h, o):  # the documented rule, in NumPy
    h, seen = np.asarray(h), np.asarray(o)[..., 0]
    pending = np.where(np.isfinite(seen), np.maximum(h[..., 0], seen), h[..., 0])[..., None]
    if commit:
      return np.concatenate([np.zeros_like(pending), pending, h[..., 1:-1]], axis=-1)
    return np.concatenate([pending, h[..., 1:]], axis=-1)

  together = jax.jit(mpx.fp8.update_fp8_state)(state, observed, commit=commit)
  for new, h, o in zip(together, state, observed, strict=True):
    assert new.shape == h.shape and new.dtype == h.dtype
    np.testing.assert_array_equal(np.asarray(new), alone(h, o))
  np.testing.assert_array_equal(
    np.asarray(together[2]), np.asarray(state[2]) if not commit else [0.0, *state[2][:-1]]
  )


@pytest.mark.parametrize("commit", all_but([True, False], True))
def test_update_of_stacked_histories_matches_the_per_layer_update(commit):
  # nn.scan(variable_axes={"fp8_history": 0}) and nnx.vmap stack one history per layer.
  rng = np.random.default_rng(5)
  stacked = jnp.asarray(rng.uniform(0, 10, (3, 2, 5)), jnp.float32)
  observed = jnp.zeros_like(stacked).at[..., 0].set(jnp.asarray(rng.uniform(0, 10, (3, 2))))
  per_layer = [
    mpx.fp8.update_fp8_state(stacked[i, j], observed[i, j], commit=commit)
    for i in range(3)
    for j in range(2)
  ]
  out = jax.jit(mpx.fp8.update_fp8_state)(stacked, observed, commit=commit)
  assert out.shape == stacked.shape and out.dtype == stacked.dtype
  np.testing.assert_array_equal(np.asarray(out).reshape(6, 5), np.stack(per_layer))
  recipe = mpx.Fp8Recipe("delayed", history_length=4)
  assert fp8_scaling.init_history(recipe, batch_shape=(3, 2)).shape == stacked.shape
  scales = jax.vmap(
    jax.vmap(lambda h: fp8_scaling.history_scales([h], [quantize_lib.E4M3], recipe)[0])
  )(stacked)
  np.testing.assert_array_equal(
    np.asarray(fp8_scaling.history_scales([stacked], [quantize_lib.E4M3], recipe)[0]),
    np.asarray(scales),
  )


@pytest.mark.parametrize("jit", all_but([True, False], True), ids=["jit", "eager"])
def test_a_history_shared_by_several_calls_records_the_max_amax(jit):
  # Weight sharing: one set of histories, three calls with lhs amaxes 2, 4, 3,
  # rhs amaxes 1, 1/2, 1/4 and gradient amaxes 5, 7, 6. A sum would record 9, 1.75, 18.
  recipe = mpx.Fp8Recipe("delayed", history_length=2)
  state = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  rhs = jnp.ones((2, 1), jnp.float32)

  def loss(state):
    state = mpx.fp8.fp8_max_grad(state)
    total = jnp.float32(0.0)
    for a, b, g in ((2.0, 1.0, 5.0), (4.0, 0.5, 7.0), (3.0, 0.25, 6.0)):
      out = mpx.fp8.fp8_dot_general(
        jnp.array([[a, 1.0]]), rhs * b, DIMS, recipe=recipe, state=state
      )
      total = total + g * jnp.sum(out)
    return total

  grad = jax.grad(loss)
  observed = (jax.jit(grad) if jit else grad)(state)
  assert all(o.dtype == jnp.float32 and o.shape == (3,) for o in observed)
  np.testing.assert_array_equal(
    np.stack([np.asarray(o) for o in observed]), [[4.0, 0.0, 0.0], [1.0, 0.0, 0.0], [7.0, 0.0, 0.0]]
  )


def test_a_scan_over_a_shared_weight_records_the_max_amax_over_iterations():
  recipe = mpx.Fp8Recipe("delayed", history_length=2)
  state = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  xs = jnp.array([[[2.0, 1.0]], [[5.0, 1.0]], [[3.0, 1.0]]])  # amaxes 2, 5, 3
  w = jnp.full((2, 1), 0.5)

  def loss(state, w):
    state = mpx.fp8.fp8_max_grad(state)

    def body(total, x):
      return total + jnp.sum(mpx.fp8.fp8_dot_general(x, w, DIMS, recipe=recipe, state=state)), None

    return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

  observed, _ = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, w)
  np.testing.assert_array_equal(np.asarray(observed[0]), [5.0, 0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(observed[1]), [0.5, 0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(observed[2]), [1.0, 0.0, 0.0])
  history = mpx.fp8.update_fp8_state(state, observed)
  assert [float(h[1]) for h in history] == [5.0, 0.5, 1.0]


class _SharedLinen(nn.Module):
  @nn.compact
  def __call__(self, xs):
    dense = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones)
    return sum(dense(x) for x in xs)


class _SharedNnx(nnx.Module):
  def __init__(self):
    init = nnx.initializers.ones
    self.dense = nnx.Linear(2, 1, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))

  def __call__(self, xs):
    return sum(self.dense(x) for x in xs)


@pytest.mark.parametrize("adapter", all_but(["linen", "nnx"], "nnx"))
def test_a_shared_flax_layer_records_the_max_amax_with_fp8_max_grad(adapter):
  xs = [jnp.full((1, 2), a) for a in (2.0, 4.0, 3.0)]
  if adapter == "linen":
    model = mpx.linen.apply_policy(_SharedLinen(), "mixed_float8_delayed")
    variables = model.init(jax.random.key(0), xs)
    params, history = variables["params"], variables[mpx.linen.FP8_COLLECTION]

    def forward(history):
      return model.apply({"params": params, mpx.linen.FP8_COLLECTION: history}, xs)
  else:
    module = mpx.nnx.apply_policy(_SharedNnx(), "mixed_float8_delayed")
    graphdef, params, history, rest = nnx.split(module, nnx.Param, mpx.nnx.Fp8History, ...)

    def forward(history):
      return nnx.merge(graphdef, params, history, rest)(xs)

  def loss(history):
    return jnp.sum(forward(mpx.fp8.fp8_max_grad(history)).astype(jnp.float32))

  observed = jax.jit(jax.grad(loss))(history)
  # lhs amaxes 2, 4, 3; the kernel's and the gradient's are 1 in each call.
  pending = sorted(float(h[0]) for h in jax.tree.leaves(observed))
  assert pending == [1.0, 1.0, 4.0]
  assert all(h.dtype == jnp.float32 for h in jax.tree.leaves(observed))


def test_amax_is_reduced_over_a_named_axis():
  recipe = mpx.Fp8Recipe(axis_name="devices")
  lhs = jnp.stack([jnp.ones((4, 8)), jnp.full((4, 8), 300.0)]).astype(jnp.bfloat16)
  rhs = jnp.ones((8, 2), jnp.bfloat16)

  def on_device(lhs):
    scale = quantize_lib.scale_for(quantize_lib.amax(lhs, recipe.axis_name), quantize_lib.E4M3)
    return scale, mpx.fp8.fp8_dot_general(lhs, rhs, DIMS, recipe=recipe)

  scales, out = jax.jit(jax.vmap(on_device, axis_name="devices"))(lhs)
  assert float(scales[0]) == float(scales[1]) == 1.0  # both from 300, not 1
  # Device 0's ones scaled by 300's scale are still exact.
  np.testing.assert_array_equal(np.asarray(out[0].astype(jnp.float32)), 8.0)


def test_policy_strings_round_trip_and_errors():
  presets = (
    "mixed_float8",
    "mixed_float8_delayed",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_float8_blockwise",
  )
  scalings = ("current", "delayed", "rowwise", "mxfp8", "blockwise")
  for name, scaling in zip(presets, scalings, strict=True):
    policy = mpx.get_policy(name)
    assert policy.fp8 is not None and policy.fp8.scaling == scaling
    assert np.dtype(policy.compute_dtype) == jnp.bfloat16
    assert mpx.get_policy(str(policy)) == policy
  spec = "p=f32,c=bf16,o=f32,fp8=delayed:history=1024:reduction=most_recent:margin=1:attention"
  policy = mpx.get_policy(spec)
  assert policy.fp8 == mpx.Fp8Recipe("delayed", 1024, "most_recent", 1, attention=True)
  assert mpx.get_policy(str(policy)) == policy
  assert mpx.get_policy("mixed_bfloat16").fp8 is None
  with pytest.raises(mpx.PolicyError, match="bfloat16 or float32"):
    mpx.get_policy("params=float32,compute=float16,fp8=current")
  with pytest.raises(mpx.PolicyError, match="Cannot parse 'histroy=4'"):
    mpx.get_policy("p=f32,c=bf16,fp8=delayed:histroy=4")
  with pytest.raises(mpx.PolicyError, match="Unknown fp8 scaling 'late'"):
    mpx.Fp8Recipe("late")
  with pytest.raises(mpx.PolicyError, match="most_recent"):
    mpx.Fp8Recipe("delayed", reduction="mean")
  with pytest.raises(mpx.ConfigError, match="needs amax history state"):
    mpx.fp8.fp8_dot_general(*_operands(), DIMS, recipe=mpx.Fp8Recipe("delayed"))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32)(x)
    x = nn.LayerNorm()(x)
    x = nn.DenseGeneral((2, 16))(x)
    x = nn.Einsum((2, 16, 16), "bhd,hdk->bk")(x)
    return nn.Dense(4, name="head")(nn.gelu(x))


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(16, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.b = nnx.LinearGeneral(32, (2, 16), rngs=rngs)
    self.e = nnx.Einsum("bhd,hdk->bk", (2, 16, 16), rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.gelu(self.e(self.b(self.norm(self.a(x))))))


X = jnp.asarray(np.random.default_rng(4).standard_normal((8, 16)), jnp.float32)


@functools.cache  # one init per policy for the whole module
def _linen_loss(policy):
  model = mpx.linen.apply_policy(LinenNet(), policy, rules=HEAD)
  variables = jax.jit(model.init)(jax.random.key(0), X)  # one compile, not one per op

  def loss(params, history, x):
    extra = {} if history is None else {mpx.linen.FP8_COLLECTION: history}
    return jnp.mean(model.apply({"params": params, **extra}, x) ** 2)

  return loss, variables["params"], variables.get(mpx.linen.FP8_COLLECTION)


def _nnx_loss(policy):
  model = mpx.nnx.apply_policy(NnxNet(nnx.Rngs(0)), policy, rules=HEAD)
  graphdef, params, history, rest = nnx.split(model, nnx.Param, mpx.nnx.Fp8History, ...)

  def loss(params, history, x):
    return jnp.mean(nnx.merge(graphdef, params, history, rest)(x) ** 2)

  return loss, params, history


_ADAPTER_CASES = [
  (make, policy)
  for make in (_linen_loss, _nnx_loss)
  for policy in (
    "mixed_float8",
    "mixed_float8_delayed",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_float8_blockwise",
  )
]


@pytest.mark.parametrize(
  ("make", "policy"),
  all_but(_ADAPTER_CASES, (_linen_loss, "mixed_float8_delayed"), (_nnx_loss, "mixed_float8")),
  ids=[f"{policy}-{make.__name__[1:-5]}" for make, policy in _ADAPTER_CASES],
)
def test_every_dense_and_einsum_matmul_is_float8_except_kept_layers(make, policy):
  loss, params, history = make(policy)
  delayed = policy.endswith("delayed")
  assert (len(jax.tree.leaves(history)) == 9) if delayed else not jax.tree.leaves(history)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  report = mpx.audit(jax.value_and_grad(loss, argnums=(0, 1)), params, history, X)
  # Three layers' forward and weight-gradient products, and the input gradients of
  # the two not fed by x, in float8; the head's three in bfloat16.
  assert len(report.fp8_ops) == 8
  assert {op.is_backward for op in report.fp8_ops} == {False, True}
  others = [op for op in report.ops if not op.is_fp8]
  # The head is the only layer with a dimension of 4 (NNX paths are class names).
  assert len(others) == 3 and all(4 in (*op.lhs_shape, *op.rhs_shape) for op in others)
  for op in report.fp8_ops:
    formats = [f.name for f in op.fp8 if f is not None]
    # Gradients are E5M2 per tensor, E4M3 per row or block.
    e5m2_gradient = op.is_backward and policy in ("mixed_float8", "mixed_float8_delayed")
    assert (formats.count("float8_e5m2"), formats.count("float8_e4m3fn")) == (
      (1, 1) if e5m2_gradient else (0, 2)
    )
    # ... and the audit's table says so.
    flag = next(f for f in report.flags(op) if f.startswith("fp8:"))
    assert sorted(flag.removeprefix("fp8:").split(",")) == sorted(
      f.removeprefix("float8_") for f in formats
    )


# Flax's Fp8Test.test_fp8_einsum (tests/linen/linen_test.py) under mpx's API: a linen
# Einsum under each per-tensor fp8 policy, operands exactly representable in float8 (as
# Flax casts them), against jnp.einsum. Delayed scaling outside jax.jit hashed its
# histories into jnp.einsum's static contraction and raised.
_FLAX_EINSUMS = [
  ((16, 32), (32, 64), (16, 64), "mk,kn->mn"),
  ((2, 3, 32), (64, 32), (2, 3, 64), "...k,nk->...n"),
  ((2, 3, 64), (64, 32), (2, 3, 32), "...k,kn->...n"),
]


_FLAX_EINSUM_CASES = [
  (*shapes, policy, jit)
  for shapes in _FLAX_EINSUMS
  for policy in ("mixed_float8", "mixed_float8_delayed")
  for jit in (True, False)
]


# One case in the fast suite (the one that raised), the others in CI's slow pass.
@pytest.mark.parametrize(
  ("x_shape", "y_shape", "g_shape", "eqn", "policy", "jit"),
  all_but(_FLAX_EINSUM_CASES, (*_FLAX_EINSUMS[0], "mixed_float8_delayed", False)),
  ids=[f"{c[3]}-{c[4]}-{'jit' if c[5] else 'eager'}" for c in _FLAX_EINSUM_CASES],
)
def test_flax_fp8_einsum_cases(x_shape, y_shape, g_shape, eqn, policy, jit):
  _, key1, key2, key3 = jax.random.split(jax.random.key(42), 4)
  one = jnp.float32(1.0)
  x = mpx.fp8.quantize_dequantize(jax.random.normal(key1, x_shape), jnp.float8_e4m3fn, scale=one)
  y = mpx.fp8.quantize_dequantize(jax.random.normal(key2, y_shape), jnp.float8_e4m3fn, scale=one)
  g = mpx.fp8.quantize_dequantize(jax.random.normal(key3, g_shape), jnp.float8_e5m2, scale=one)
  layer = mpx.linen.apply_policy(nn.Einsum(y_shape, eqn, use_bias=False), policy)
  variables = layer.init(jax.random.key(0), x)
  assert ("fp8_history" in variables) == policy.endswith("delayed")

  def loss(y, x):
    out = layer.apply({**variables, "params": {"kernel": y}}, x)
    return jnp.sum(out.astype(jnp.float32) * g)

  def loss_ref(y, x):
    return jnp.sum(jnp.einsum(eqn, x, y, precision="highest") * g)

  step = jax.value_and_grad(loss, argnums=(0, 1))
  value, grads = (jax.jit(step) if jit else step)(y, x)
  value_ref, grads_ref = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1)))(y, x)
  for got, want in ((value, value_ref), *zip(grads, grads_ref, strict=True)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2, rtol=1e-2)


def test_linen_and_nnx_fp8_outputs_match_a_manual_float8_layer():
  model = mpx.linen.apply_policy(nn.Dense(16, use_bias=False), "mixed_float8")
  params = model.init(jax.random.key(0), X)
  out = model.apply(params, X)
  assert out.dtype == jnp.float32
  kernel = params["params"]["kernel"].astype(jnp.bfloat16)
  manual = mpx.fp8.fp8_dot_general(X.astype(jnp.bfloat16), kernel, DIMS).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(manual))
  layer = nnx.Linear(16, 16, use_bias=False, rngs=nnx.Rngs(0))
  mpx.nnx.apply_policy(layer, "mixed_float8")
  kernel = layer.kernel[...].astype(jnp.bfloat16)
  manual = mpx.fp8.fp8_dot_general(X.astype(jnp.bfloat16), kernel, DIMS).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(layer(X)), np.asarray(manual))


def test_multisteps_records_the_max_amax_over_micro_batches():
  loss, params, history = _linen_loss("mixed_float8_delayed")
  tx = optax.MultiSteps(standard_promotion(optax.sgd(1e-3)), every_k_schedule=3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, history, opt_state, x):
    grads, observed = jax.grad(loss, argnums=(0, 1))(params, history, x)
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, opt_state, params)
    commit = mpx.fp8.accumulation_boundary(opt_state)
    history = mpx.fp8.update_fp8_state(history, observed, commit=commit)
    return optax.apply_updates(params, updates), history, opt_state

  big = X.at[0, 0].set(1000.0)  # only in the FIRST micro-batch
  first = lhs = history["Dense_0"]["Fp8DotGeneral_0"]["lhs"]
  for i, x in enumerate([big, X, X]):
    params, history, opt_state = step(params, history, opt_state, x)
    lhs = history["Dense_0"]["Fp8DotGeneral_0"]["lhs"]
    if i < 2:  # accumulating: the pending slot holds the running max, nothing committed yet
      assert float(lhs[0]) == 1000.0 and not np.asarray(lhs[1:]).any()
  np.testing.assert_array_equal(np.asarray(lhs[:2]), [0.0, 1000.0])
  assert float(jnp.abs(X).max()) < 10  # the last micro-batch alone would have recorded this
  assert first.shape == lhs.shape and first.dtype == lhs.dtype
  # Every history committed exactly one amax.
  for h in jax.tree.leaves(history):
    assert float(h[0]) == 0.0 and float(h[1]) > 0 and not np.asarray(h[2:]).any()


def test_accumulation_boundary_without_multisteps_is_every_step():
  state = optax.sgd(0.1).init({"w": jnp.ones(2)})
  assert bool(mpx.fp8.accumulation_boundary(state))


def _float16_fp8_step(tx, recipe, use_opt_state):
  """A jitted float16 step of one delayed-fp8 matmul under a dynamic loss scale."""

  def loss(params, history, x):
    w = params["w"].astype(jnp.float16)
    out = mpx.fp8.fp8_dot_general(x, w, DIMS, recipe=recipe, state=history)
    return jnp.sum(out.astype(jnp.float32))

  @jax.jit
  def step(params, history, opt_state, x):
    _, (grads, observed) = mpx.value_and_grad(loss, opt_state, argnums=(0, 1))(params, history, x)
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if use_opt_state:
      history = mpx.fp8.update_fp8_state(history, observed, opt_state=opt_state)
    else:
      history = mpx.fp8.update_fp8_state(
        history, observed, commit=mpx.fp8.accumulation_boundary(opt_state)
      )
    return params, history, opt_state

  return step


_X16 = jnp.asarray(np.random.default_rng(6).uniform(-4, 4, (4, 8)), jnp.float16)
_INF = _X16.at[1, 2].set(jnp.inf)


@pytest.mark.parametrize("use_opt_state", [True, False], ids=["opt_state", "commit"])
def test_a_skipped_step_leaves_the_fp8_history_untouched(use_opt_state):
  recipe = mpx.Fp8Recipe("delayed", history_length=3)
  tx = mpx.dynamic_loss_scale(optax.sgd(1e-3), initial_scale=2.0**8)
  params = {"w": jnp.full((8, 2), 0.5, jnp.float32)}
  history = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  opt_state = tx.init(params)
  step = _float16_fp8_step(tx, recipe, use_opt_state)
  params, history, opt_state = step(params, history, opt_state, _X16)
  assert not bool(mpx.loss_scale_metrics(opt_state)["last_step_skipped"])
  before = [np.asarray(h) for h in history]
  assert all(h[1] > 0 for h in before)
  params, history, opt_state = step(params, history, opt_state, _INF)
  assert bool(mpx.loss_scale_metrics(opt_state)["last_step_skipped"])
  assert not bool(mpx.fp8.accumulation_boundary(opt_state))
  after = [np.asarray(h) for h in history]
  for b, a in zip(before, after, strict=True):
    assert np.isfinite(a).all()
    if use_opt_state:  # bitwise, pending slot included
      assert a.tobytes() == b.tobytes()
    else:  # without the skip, the finite amaxes of the step wait in the pending slot
      assert a[1:].tobytes() == b[1:].tobytes()
  params, history, opt_state = step(params, history, opt_state, _X16)
  # The next good step commits its own amaxes on top, with the scale of step 1.
  for b, h in zip(before, history, strict=True):
    np.testing.assert_array_equal(np.asarray(h)[2:], b[1:-1])
    assert float(h[1]) > 0


def test_a_skipped_multisteps_boundary_leaves_the_fp8_history_untouched():
  recipe = mpx.Fp8Recipe("delayed", history_length=3)
  tx = optax.MultiSteps(
    mpx.dynamic_loss_scale(optax.sgd(1e-3), initial_scale=2.0**8), every_k_schedule=2
  )
  params = {"w": jnp.full((8, 2), 0.5, jnp.float32)}
  history = tuple(fp8_scaling.init_history(recipe) for _ in range(3))
  opt_state = tx.init(params)
  step = _float16_fp8_step(tx, recipe, use_opt_state=True)
  for x in (_X16, _X16):  # one good accumulation: one commit
    params, history, opt_state = step(params, history, opt_state, x)
  committed = [np.asarray(h) for h in history]
  assert all(h[0] == 0 and h[1] > 0 for h in committed)
  # The inf arrives in the first micro-batch; the skip is decided at the boundary.
  params, history, opt_state = step(params, history, opt_state, _INF)
  assert all(np.isfinite(np.asarray(h)).all() for h in history)  # not in the running max
  pending = [np.asarray(h) for h in history]
  params, history, opt_state = step(params, history, opt_state, _X16)
  assert bool(mpx.loss_scale_metrics(opt_state)["last_step_skipped"])
  for p, c, h in zip(pending, committed, history, strict=True):
    assert np.asarray(h).tobytes() == p.tobytes()
    assert p[1:].tobytes() == c[1:].tobytes()
  # Later micro-batches of the next accumulation are not mistaken for skipped ones.
  params, history, opt_state = step(params, history, opt_state, _X16)
  assert float(history[1][0]) > 0


def test_delayed_state_survives_an_orbax_round_trip(tmp_path):
  loss, params, history = _linen_loss("mixed_float8_delayed")
  observed = jax.jit(jax.grad(loss, argnums=1))(params, history, X)
  history = jax.jit(mpx.fp8.update_fp8_state)(history, observed)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "fp8", history)
    ckpt.wait_until_finished()
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "fp8", history)
  chex.assert_trees_all_equal(restored, history)
  chex.assert_trees_all_equal_shapes_and_dtypes(restored, history)
  assert any(float(h[1]) > 0 for h in jax.tree.leaves(restored))


@pytest.mark.slow  # a whole train step; the adapters' float8 coverage is pinned above
@pytest.mark.parametrize("attention", [True, False])
def test_gpt_train_step_runs_its_matmul_flops_in_float8(attention):
  from mpx.demo import DEFAULT_SETTINGS as DEFAULT
  from mpx.demo import CharTransformer

  recipe = mpx.Fp8Recipe("delayed", attention=attention)
  policy = dataclasses.replace(mpx.get_policy("mixed_bfloat16"), fp8=recipe)
  model = mpx.linen.apply_policy(CharTransformer(DEFAULT.model), policy, rules=HEAD)
  tokens = jax.ShapeDtypeStruct((DEFAULT.batch_size, DEFAULT.model.max_len + 1), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  params, history = variables["params"], variables[mpx.linen.FP8_COLLECTION]
  tx = optax.sgd(0.1)

  def train_step(params, history, opt_state, windows):
    def loss(params, history):
      variables = {"params": params, mpx.linen.FP8_COLLECTION: history}
      logits = model.apply(variables, windows[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    grads, observed = jax.grad(loss, argnums=(0, 1))(params, history)
    updates, opt_state = tx.update(grads, opt_state, params)
    history = mpx.fp8.update_fp8_state(history, observed)
    return optax.apply_updates(params, updates), history, opt_state

  opt_state = jax.eval_shape(tx.init, params)
  report = mpx.audit(train_step, params, history, opt_state, tokens, policy=policy)
  for part in (report.filter(backward=False), report.filter(backward=True)):
    share = part.fp8_flops_share
    assert share >= (0.9 if attention else 0.75), str(part)
  # The rest: the logits projection (a keep rule) and, unless the recipe covers
  # them, attention's two activation-by-activation products.
  rest = {op.module_path.split("/")[-1] for op in report.ops if not op.is_fp8}
  assert rest == ({"head"} if attention else {"head", "MultiHeadDotProductAttention_0"})


def test_nnx_histories_update_through_nnx_grad_and_nnx_update():
  model = mpx.nnx.apply_policy(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), "mixed_float8_delayed")
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x = jnp.full((4, 16), 3.0)
  wrt = nnx.DiffState(0, nnx.Any(nnx.Param, mpx.nnx.Fp8History))

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=wrt)(model)
    param_grads, observed = nnx.split_state(grads, nnx.Param, mpx.nnx.Fp8History)
    optimizer.update(model, param_grads)
    history = nnx.state(model, mpx.nnx.Fp8History)
    nnx.update(model, mpx.fp8.update_fp8_state(history, observed))

  for _ in range(2):
    step(model, optimizer, x)
  dot = vars(model)["dot_general"]
  assert isinstance(dot, mpx.nnx.Fp8DotGeneral)
  np.testing.assert_array_equal(np.asarray(dot.lhs[...][:4]), [0.0, 3.0, 3.0, 0.0])  # two commits


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpx
from mpx._src.ops import fp8_scaling as fp8

jax.config.update("jax_numpy_dtype_promotion", "strict")
assert jax.device_count() == 2, jax.devices()
recipe = mpx.Fp8Recipe("delayed", history_length=2)
dims = (((1,), (0,)), ((), ()))
lhs = jnp.ones((8, 16), jnp.bfloat16).at[7, 0].set(300.0)  # the big value on device 1 only
rhs = jnp.ones((16, 4), jnp.bfloat16)
state = tuple(fp8.init_history(recipe) for _ in range(3))

def loss(lhs, state):
  return jnp.sum(mpx.fp8.fp8_dot_general(lhs, rhs, dims, recipe=recipe, state=state)).astype(jnp.float32)

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
sharded = jax.device_put(lhs, NamedSharding(Mesh(jax.devices(), ("data",)), P("data", None)))
(value, (g, observed)), (value1, (g1, observed1)) = step(sharded, state), step(lhs, state)
assert float(observed[0][0]) == 300.0, observed  # the global amax, on every device
assert value == value1 and (np.asarray(g) == np.asarray(g1)).all()
print("ok")
"""


@pytest.mark.slow  # a subprocess with two host devices
def test_sharded_jit_reduces_the_amax_over_all_devices():
  env = {
    **os.environ,
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join(
      [str(pathlib.Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
    ),
  }
  proc = subprocess.run(
    [sys.executable, "-W", "error", "-c", _SHARDED],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_audit_recognises_a_hand_written_quantise_dequantise():
  def f(x, w):
    scale = jnp.asarray(2.0, jnp.bfloat16)
    xq = x.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16) * scale
    wq = jnp.transpose(w.astype(jnp.float8_e5m2).astype(jnp.bfloat16))  # layout ops pass
    return xq @ wq.T, x @ w, xq @ w

  x = jnp.ones((16, 32), jnp.bfloat16)
  report = mpx.audit(f, x, jnp.ones((32, 16), jnp.bfloat16))
  both, neither, one = report.ops
  assert [f.name for f in both.fp8] == ["float8_e4m3fn", "float8_e5m2"] and both.is_fp8  # pyright: ignore[reportOptionalMemberAccess]
  assert both.operand_class == "fp8" and report.flags(both)[-1] == "fp8:e4m3fn,e5m2"
  assert neither.fp8 == (None, None) and not neither.is_fp8 and neither.operand_class == "half"
  assert not one.is_fp8 and report.flags(one)[-1] == "fp8:e4m3fn,-"
  assert report.fp8_flops_share == pytest.approx(1 / 3)
  assert "(33.3% float8)" in report.summary()
