"""Magnitude histograms: exact buckets from the bits, against a NumPy reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx

EXPONENTS = mpx.diagnostics.MagnitudeHistogram.EXPONENTS
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
DTYPES = [
  np.float32,
  np.float16,
  ml_dtypes.bfloat16,
  ml_dtypes.float8_e4m3fn,
  ml_dtypes.float8_e5m2,
]


def reference(*arrays):
  """Counts by NumPy on the host, where subnormals are not flushed."""
  with np.errstate(invalid="ignore"):  # NaN payloads of the float8 formats
    x = np.concatenate([np.asarray(a).astype(np.float64).ravel() for a in arrays])
  finite_nonzero = np.isfinite(x) & (x != 0)
  _, e = np.frexp(np.abs(x[finite_nonzero]))  # |x| = m * 2**e, m in [0.5, 1)
  index = np.clip(e - 1, EXPONENTS[0], EXPONENTS[-1]) - EXPONENTS[0]
  counts = np.bincount(index, minlength=len(EXPONENTS))
  return counts, int(np.sum(x == 0)), int(np.sum(np.isinf(x))), int(np.sum(np.isnan(x)))


def random_bits(seed, dtype, size):
  """Every bit pattern is equally likely: subnormals, zeros, infinities and NaNs included."""
  dtype = np.dtype(dtype)
  rng = np.random.default_rng(seed)
  bits = rng.integers(0, 2 ** (8 * dtype.itemsize), size=size, dtype=np.uint64)
  return bits.astype(UINT[dtype.itemsize]).view(dtype)


def check(hist, *arrays):
  counts, zeros, infs, nans = reference(*arrays)
  np.testing.assert_array_equal(np.asarray(hist.counts), counts)
  assert (int(hist.zeros), int(hist.infs), int(hist.nans)) == (zeros, infs, nans)
  assert int(hist.size) == sum(np.asarray(a).size for a in arrays)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES))
def test_matches_numpy_on_random_bit_patterns(seed, dtype):
  x = random_bits(seed, dtype, 257)
  check(jax.jit(mpx.diagnostics.magnitude_histogram)(jnp.asarray(x)), x)


@pytest.mark.slow
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_float32_subnormals_and_edges_land_in_their_buckets(use_jit):
  # XLA:CPU flushes 2**-149 to zero in arithmetic; the histogram reads the bits.
  x = np.array(
    [2.0**-149, 3 * 2.0**-149, 2.0**-127, 2.0**-126, 1.0, 1.9999999, 2.0, 3.4e38, -0.0, 0.0],
    np.float32,
  )
  fn = (
    jax.jit(mpx.diagnostics.magnitude_histogram) if use_jit else mpx.diagnostics.magnitude_histogram
  )
  h = fn({"x": jnp.asarray(x)})
  got = {int(e): int(c) for e, c in zip(EXPONENTS, h.counts, strict=True) if c}
  assert got == {-149: 1, -148: 1, -127: 1, -126: 1, 0: 2, 1: 1, 127: 1}
  assert int(h.zeros) == 2


@pytest.mark.slow
def test_total_and_per_leaf_agree_and_ignore_integer_leaves():
  tree = {
    "a": random_bits(1, np.float32, 50),
    "b": random_bits(2, ml_dtypes.bfloat16, (4, 5)),
    "c": [random_bits(3, np.float16, 7)],
    "step": np.arange(3, dtype=np.int32),
  }
  tree = jax.tree.map(jnp.asarray, tree)
  total = mpx.diagnostics.magnitude_histogram(tree)
  check(total, tree["a"], tree["b"], tree["c"][0])
  per_leaf = jax.tree.map(mpx.diagnostics.magnitude_histogram, tree)
  check(per_leaf["b"], tree["b"])
  floating = [per_leaf["a"], per_leaf["b"], per_leaf["c"][0]]
  summed = jax.tree.map(lambda *h: sum(h), *floating)
  jax.tree.map(np.testing.assert_array_equal, summed, total)
  assert int(per_leaf["step"].size) == 0


def test_fixed_shapes_and_dtypes_for_any_tree():
  empty = mpx.diagnostics.magnitude_histogram({})
  full = mpx.diagnostics.magnitude_histogram({"w": jnp.ones((3, 4), jnp.bfloat16)})
  for h in (empty, full):
    assert h.counts.shape == (len(EXPONENTS),) == (279,)
    assert {x.dtype for x in h} == {np.dtype(np.int32)}
  assert int(empty.size) == 0 and int(full.counts[EXPONENTS == 0][0]) == 12


def test_float64_values_beyond_float32_go_to_the_open_end_buckets():
  with jax.enable_x64(True):
    x = np.array([2.0**-1074, 2.0**-160, 2.0**-149, 2.0**127, 2.0**300, 1.5], np.float64)
    h = mpx.diagnostics.magnitude_histogram(jnp.asarray(x))
    check(h, x)
    assert int(h.counts[0]) == 2 and int(h.counts[-1]) == 1
