"""Range reports and scale recommendations: exact agreement with a NumPy + ml_dtypes reference."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from marks import all_but

import mpx

TARGETS = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
OTHER_TARGETS = [
  ml_dtypes.float8_e4m3fnuz,
  ml_dtypes.float8_e5m2fnuz,
  ml_dtypes.float8_e4m3b11fnuz,
  ml_dtypes.float8_e3m4,
  ml_dtypes.float8_e4m3,
]
# Formats with neither infinity nor NaN: ml_dtypes clamps what overflows to the largest value.
SATURATING = [ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn, ml_dtypes.float4_e2m1fn]
INPUTS = [
  np.float32,
  np.float16,
  ml_dtypes.bfloat16,
  ml_dtypes.float8_e4m3fn,
  ml_dtypes.float8_e5m2,
]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
FIELDS = ("overflow", "normal", "subnormal", "flushed", "nonfinite")


def round_to_odd_float32(y):
  """Rounds float64 ``y`` to float32 by round-to-odd.

  ml_dtypes casts float64 through float32 with round-to-nearest-even, which
  rounds twice; rounding to odd first makes the second rounding (to any format
  at least two bits narrower, as every target is) equal to one direct rounding.
  """
  with np.errstate(over="ignore"):
    t = y.astype(np.float32)
  big = np.float32(np.finfo(np.float32).max)
  t = np.where(np.isinf(t), np.copysign(big, y).astype(np.float32), t)
  inexact = t.astype(np.float64) != y
  away = np.abs(t.astype(np.float64)) > np.abs(y)
  t = np.where(inexact & away, np.nextafter(t, np.float32(0)), t)
  return (t.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def reference(arrays, target, k):
  """The report's counts by casting with ml_dtypes on the host (no flushing of subnormals there)."""
  with np.errstate(invalid="ignore"):
    x = np.concatenate([np.asarray(a).astype(np.float64).ravel() for a in arrays])
  finite_nonzero = np.isfinite(x) & (x != 0)
  y = np.abs(x[finite_nonzero]) * 2.0**k  # exact: a power of two, in float64's range
  with np.errstate(over="ignore", invalid="ignore"):
    r = round_to_odd_float32(y).astype(target).astype(np.float64)
  tiny = float(ml_dtypes.finfo(target).smallest_normal)
  counts = {
    "overflow": int(np.sum(~np.isfinite(r))),
    "normal": int(np.sum(np.isfinite(r) & (r >= tiny))),
    "subnormal": int(np.sum((r != 0) & (r < tiny))),
    "flushed": int(np.sum(r == 0)),
    "nonfinite": int(np.sum(~np.isfinite(x))),
  }
  return counts, int(np.sum(x != 0)), int(np.sum(x == 0))


def assert_matches(report, arrays, target, k):
  counts, nonzero, zeros = reference(arrays, target, k)
  got = dict(zip(FIELDS, np.asarray(report.counts).tolist(), strict=True))
  assert got == counts, (np.dtype(target).name, k, got, counts)
  assert (int(report.nonzero), int(report.zeros)) == (nonzero, zeros)
  exact = [np.float32(counts[f]) / np.float32(max(nonzero, 1)) for f in FIELDS]
  np.testing.assert_array_max_ulp(np.array([getattr(report, f) for f in FIELDS]), exact, maxulp=1)


def random_bits(rng, dtype, size):
  dtype = np.dtype(dtype)
  bits = rng.integers(0, 2 ** (8 * dtype.itemsize), size=size, dtype=np.uint64)
  return bits.astype(UINT[dtype.itemsize]).view(dtype)


def boundaries(target):
  """Every rounding threshold of ``target`` and its float32 neighbours, in float64."""
  info = ml_dtypes.finfo(target)
  top = float(info.max)
  half_ulp_top = 2.0 ** (math.frexp(top)[1] - 1 - int(info.nmant)) / 2
  sub, tiny = float(info.smallest_subnormal), float(info.smallest_normal)
  points = np.array([top, top + half_ulp_top, tiny, tiny - sub / 2, tiny - sub, sub, sub / 2, 1.0])
  p32 = points.astype(np.float32)
  up, down = np.nextafter(p32, np.float32(np.inf)), np.nextafter(p32, np.float32(0))
  return np.concatenate([points, up.astype(np.float64), down.astype(np.float64)])


def at_boundaries_after_scaling(target, k):
  """float32 values that land exactly on ``target``'s thresholds once multiplied by ``2**k``."""
  x = boundaries(target) * 2.0**-k
  with np.errstate(over="ignore"):
    x32 = x.astype(np.float32)
  exact = x32.astype(np.float64) == x
  return np.concatenate([x32[exact], -x32[exact]])


SCALE_EXPONENTS = st.one_of(st.integers(-30, 30), st.sampled_from([-126, -100, 100, 126]))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
  seed=st.integers(0, 2**32 - 1),
  target=st.sampled_from(TARGETS),
  inputs=st.lists(st.sampled_from(INPUTS), min_size=1, max_size=3),
  k=SCALE_EXPONENTS,
)
def test_matches_the_ml_dtypes_reference_on_random_trees(seed, target, inputs, k):
  rng = np.random.default_rng(seed)
  tree = {
    f"leaf{i}": random_bits(rng, dtype, int(rng.integers(1, 40))) for i, dtype in enumerate(inputs)
  }
  tree["edges"] = at_boundaries_after_scaling(target, k)
  tree["specials"] = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149], np.float32)
  arrays = list(tree.values())
  report = jax.jit(mpx.diagnostics.range_report, static_argnums=1)(
    jax.tree.map(jnp.asarray, tree), target, scale=jnp.float32(2.0**k)
  )
  assert_matches(report, arrays, target, k)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS + OTHER_TARGETS, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("k", all_but([-126, -7, 0, 3, 15, 126], -126, 0, 126))
def test_every_threshold_of_every_format(target, k):
  x = at_boundaries_after_scaling(target, k)
  assert x.size >= 8
  assert_matches(mpx.diagnostics.range_report(jnp.asarray(x), target, scale=2.0**k), [x], target, k)


def classes(values, target, scale=1.0):
  """The class of each value, one report per value."""
  out = []
  for v in values:
    r = mpx.diagnostics.range_report(jnp.array([v], jnp.float32), target, scale=scale)
    out.append(next(f for f in FIELDS if float(getattr(r, f)) == 1.0))
  return out


def test_float16_thresholds_by_hand():
  below = float(np.nextafter(np.float32(65520), np.float32(0)))
  above_half = float(np.nextafter(np.float32(2.0**-25), np.float32(1)))
  tie_to_normal = 2.0**-14 - 2.0**-25
  below_tie = float(np.nextafter(np.float32(tie_to_normal), np.float32(0)))
  values = [2.0**-24, 2.0**-25, above_half, 2.0**-14, tie_to_normal, below_tie, 65504, below, 65520]
  assert classes(values, jnp.float16) == [
    "subnormal",  # the smallest subnormal
    "flushed",  # half of it: the tie rounds to even, zero
    "subnormal",  # just above half rounds up
    "normal",
    "normal",  # halfway to the smallest normal: the tie rounds to even, up
    "subnormal",
    "normal",  # the largest float16
    "normal",  # rounds down to 65504
    "overflow",  # 65520: the tie rounds to even, infinity
  ]


def test_float8_and_bfloat16_thresholds_by_hand():
  # e4m3fn has no infinity: 464 (halfway to the missing 480) rounds to even, 448.
  assert classes([448, 464, 464.00003, 2.0**-9, 2.0**-10], ml_dtypes.float8_e4m3fn) == [
    "normal",
    "normal",
    "overflow",
    "subnormal",
    "flushed",
  ]
  # e5m2 has one: 57344 is its largest value, 61440 the tie that rounds up to infinity.
  assert classes([57344, 61439.996, 61440, 2.0**-16, 2.0**-17], ml_dtypes.float8_e5m2) == [
    "normal",
    "normal",
    "overflow",
    "subnormal",
    "flushed",
  ]
  top = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  tie = 2.0**127 * (2 - 2.0**-8)
  assert classes([top, tie, 2.0**-133, 2.0**-134], ml_dtypes.bfloat16) == [
    "normal",
    "overflow",
    "subnormal",
    "flushed",
  ]


@pytest.mark.parametrize("target", SATURATING, ids=lambda t: np.dtype(t).name)
def test_formats_that_saturate_count_what_rounds_past_their_largest_value(target):
  top = float(ml_dtypes.finfo(target).max)
  tie = top + 2.0 ** (math.frexp(top)[1] - 1 - int(ml_dtypes.finfo(target).nmant)) / 2
  below = float(np.nextafter(np.float32(tie), np.float32(0)))
  above = float(np.nextafter(np.float32(tie), np.float32(np.inf)))
  values = np.array([top, below, above], np.float32)
  # Every one of them casts to the largest value; the last one only by clamping.
  np.testing.assert_array_equal(values.astype(target).astype(np.float32), [top] * 3)
  assert classes(values, target) == ["normal", "normal", "overflow"]


def test_float32_subnormal_inputs_are_read_from_their_bits():
  # XLA:CPU flushes float32 subnormals in arithmetic (x * 2**k would be 0 there);
  # scaled exactly, 2**-149 * 2**126 = 2**-23 is a float16 subnormal.
  x = jnp.array([2.0**-149, 2.0**-140], jnp.float32)
  assert classes([2.0**-149], jnp.float16, scale=2.0**126) == ["subnormal"]
  assert classes([2.0**-140], ml_dtypes.bfloat16, scale=2.0**10) == ["subnormal"]
  assert_matches(
    mpx.diagnostics.range_report(x, jnp.float16, scale=2.0**125), [np.asarray(x)], np.float16, 125
  )


def test_a_scale_array_gives_one_entry_per_scale():
  rng = np.random.default_rng(0)
  x = random_bits(rng, np.float32, 500) * np.float32(0)  # zeros and NaNs
  x = np.concatenate([x, rng.standard_normal(500).astype(np.float32) * np.float32(1e-6)])
  ks = np.arange(-4, 30, 3)
  batched = jax.jit(lambda x: mpx.diagnostics.range_report(x, "f16", scale=2.0**ks))(jnp.asarray(x))
  assert batched.overflow.shape == ks.shape and batched.nonzero.shape == ()
  for i, k in enumerate(ks):
    assert_matches(jax.tree.map(lambda a, i=i: a[i] if a.ndim else a, batched), [x], np.float16, k)


def test_traced_scale_that_is_not_a_power_of_two_reads_nan():
  x = jnp.ones(3)
  report = jax.jit(lambda s: mpx.diagnostics.range_report(x, jnp.float16, scale=s))(
    jnp.float32(3.0)
  )
  assert all(np.isnan(float(getattr(report, f))) for f in FIELDS)
  good = jax.jit(lambda s: mpx.diagnostics.range_report(x, jnp.float16, scale=s))(
    jnp.float32(2.0**16)
  )
  assert float(good.overflow) == 1.0


@pytest.mark.parametrize("scale", [3.0, 2.0**127, 0.0, -2.0, float("nan")])
def test_concrete_bad_scales_are_rejected(scale):
  with pytest.raises(mpx.ConfigError, match="power of two in"):
    mpx.diagnostics.range_report(jnp.ones(2), jnp.float16, scale=scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, "float128", "e4m3"])
def test_unsupported_formats_are_rejected(dtype):
  with pytest.raises(mpx.PolicyError, match="float8_e4m3fn"):
    mpx.diagnostics.range_report(jnp.ones(2), dtype)


def test_names_are_accepted():
  x = jnp.array([1e-6, 7e4])
  a = mpx.diagnostics.range_report(x, "half")
  b = mpx.diagnostics.range_report(x, np.float16)
  c = mpx.diagnostics.range_report(x, "float8_e5m2")
  assert float(a.overflow) == float(b.overflow) == 0.5 and float(c.overflow) == 0.5


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
  seed=st.integers(0, 2**32 - 1),
  target=st.sampled_from(TARGETS),
  margin_bits=st.integers(0, 3),
  max_flushed=st.sampled_from([0.0, 1e-3, 0.1]),
)
def test_recommendation_is_the_brute_force_search(seed, target, margin_bits, max_flushed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(64) * 2.0 ** rng.integers(-40, 10, 64)).astype(np.float32)
  x[:3] = [0.0, np.nan, 2.0**-149]
  rec = mpx.diagnostics.recommend_scale(
    jnp.asarray(x), target, margin=2.0**margin_bits, max_flushed=max_flushed
  )
  ks = range(-126, 127)
  no_overflow = [k for k in ks if reference([x], target, k + margin_bits)[0]["overflow"] == 0]
  # c / 63 is never within an ulp of the thresholds 0, 1e-3 and 0.1.
  enough = [k for k in ks if reference([x], target, k)[0]["flushed"] / 63 <= max_flushed]
  want_max = 2.0 ** max(no_overflow) if no_overflow else math.nan
  want_min = 2.0 ** min(enough) if enough else math.nan
  np.testing.assert_equal(float(rec.max_scale), want_max)
  np.testing.assert_equal(float(rec.min_scale), want_min)
  np.testing.assert_equal(float(rec.scale), want_max)
  assert bool(rec.feasible) == bool(no_overflow and enough and min(enough) <= max(no_overflow))
  if no_overflow:
    assert_matches(rec.report, [x], target, max(no_overflow))


def test_recommendation_when_no_scale_avoids_overflow():
  x = jnp.array([3e38], jnp.float32)  # 3e38 * 2**-126 * 2 is still above e2m1's largest value, 6
  rec = mpx.diagnostics.recommend_scale(x, ml_dtypes.float4_e2m1fn)
  assert np.isnan(float(rec.scale)) and np.isnan(float(rec.report.normal))
  assert not bool(rec.feasible)


@pytest.mark.parametrize(
  ("kw", "match"), [({"margin": 3.0}, "margin"), ({"max_flushed": 2.0}, "max_flushed")]
)
def test_recommendation_arguments_are_checked(kw, match):
  with pytest.raises(mpx.ConfigError, match=match):
    mpx.diagnostics.recommend_scale(jnp.ones(2), jnp.float16, **kw)
