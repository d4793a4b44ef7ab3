"""Range reports: what happens to a tree's values when scaled and rounded into a narrow format.

For a target format (float16, bfloat16, the float8 formats...) and a
power-of-two scale, every nonzero value ``x`` is classified by what
round-to-nearest-even makes of ``x * scale``: overflow, normal, subnormal,
flushed to zero, or already non-finite. The classification is computed from
the bits of ``x`` (``mpx._src.diagnostics.bits``), never by a device cast, so it is
exact on every backend, and from one table of counts per exponent, so that
every scale can be judged in one pass over the data (:func:`recommend_scale`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.diagnostics import bits

_MIN_K, _MAX_K = bits.MIN_SCALE_EXPONENT, bits.MAX_SCALE_EXPONENT


class RangeReport(NamedTuple):
  """Where the nonzero values of a tree land once scaled and rounded into a format.

  Fractions are of the nonzero values (non-finite ones included), so the five
  sum to 1 when there is any. Each has the shape of the ``scale`` it was
  computed for (a scalar, or one entry per scale). The counts are exact; each
  fraction is its count divided by ``nonzero`` in float32 (XLA:CPU's
  vectorised division can be one ulp off the correctly rounded quotient).

  Attributes:
    overflow: float32, finite values that round past the format's largest
      value: to infinity, or, in formats without one (``float8_e4m3fn``), to
      NaN under a plain cast, or to the largest value under a saturating cast
      (ml_dtypes clamps the float6 and float4 formats, which have neither
      infinity nor NaN). All of them are counted here.
    normal: float32, values that round to a normal number.
    subnormal: float32, values that round to a nonzero subnormal number.
    flushed: float32, nonzero values that round to zero.
    nonfinite: float32, values that were infinite or NaN before scaling.
    counts: int32, the five counts behind the fractions, in the order above,
      on a last axis of size 5.
    nonzero: int32 scalar, the count the fractions divide.
    zeros: int32 scalar, values equal to zero (not part of the fractions).
  """

  overflow: jax.Array
  normal: jax.Array
  subnormal: jax.Array
  flushed: jax.Array
  nonfinite: jax.Array
  counts: jax.Array
  nonzero: jax.Array
  zeros: jax.Array


class ScaleRecommendation(NamedTuple):
  """A static loss scale for a tree of values, and the numbers behind it.

  Attributes:
    scale: float32, the recommended scale: ``max_scale`` (the largest scale
      that overflows nothing, with the margin); NaN when no scale in
      ``[2**-126, 2**126]`` avoids overflow.
    max_scale: float32, the largest power of two ``s`` such that
      ``s * margin`` overflows no value; NaN if there is none.
    min_scale: float32, the smallest power of two whose flushed fraction is
      at most ``max_flushed``; NaN if there is none.
    feasible: bool, ``min_scale <= max_scale``: one scale meets both bounds.
    report: the :class:`RangeReport` at ``scale``.
  """

  scale: jax.Array
  max_scale: jax.Array
  min_scale: jax.Array
  feasible: jax.Array
  report: RangeReport


def _scale_exponents(scale: Any) -> tuple[jax.Array, jax.Array]:
  """Returns ``(k, valid)`` with ``scale == 2**k`` where ``valid``.

  A concrete scale is checked here; a traced one cannot be, so where it is not
  a power of two in range, ``valid`` is false and the report reads NaN.
  """
  if not isinstance(scale, jax.core.Tracer):
    values = np.asarray(scale, np.float64)
    mantissa, exponent = np.frexp(values)
    bad = (mantissa != 0.5) | (exponent - 1 < _MIN_K) | (exponent - 1 > _MAX_K)
    if np.any(bad):
      raise errors.ConfigError(
        f"scale must be a power of two in [2**-126, 2**126] (as every loss scale of mpx's "
        f"rules is, so that scaling is exact), got {np.asarray(scale)[bad].ravel()[0]!r}. "
        "Round it first: 2.0 ** round(math.log2(scale))."
      )
  raw = jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.uint32)
  k = (raw >> jnp.uint32(23)).astype(jnp.int32) - 127
  valid = ((raw & jnp.uint32(0x807FFFFF)) == 0) & (k >= _MIN_K) & (k <= _MAX_K)
  return k, valid


def power_of_two(k: jax.Array) -> jax.Array:
  """Returns ``2.0**k`` in float32, built from its bits (exact; ``k`` in [-126, 127])."""
  k = jnp.clip(k, -126, 127)
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << jnp.uint32(23), jnp.float32)


class _Table(NamedTuple):
  """Counts per (clipped exponent, mantissa flags) of the finite nonzero values."""

  counts: jax.Array  # int32 (rows, 8)
  zeros: jax.Array
  nonfinite: jax.Array


def _rows(fmt: bits.Format) -> tuple[int, int]:
  # Exponents beyond these flush (overflow) at every scale in [2**-126, 2**126].
  return fmt.flush_exponent - _MAX_K - 1, fmt.max_exponent - _MIN_K + 1


def _table(tree: Any, fmt: bits.Format) -> _Table:
  low, high = _rows(fmt)
  rows = high - low + 1
  zero_bin, nonfinite_bin = 8 * rows, 8 * rows + 1
  total = jnp.zeros(8 * rows + 2, jnp.int32)
  for leaf in jax.tree.leaves(tree):
    if not (tree_lib.is_floating_array(leaf) and leaf.size):
      continue
    d = bits.decode(leaf)
    f = d.fraction
    is_one = f == 0
    overflows = (f > fmt.overflow_fraction) | ((f == fmt.overflow_fraction) & fmt.overflow_on_tie)
    rounds_up_to_normal = f >= fmt.normal_fraction
    flags = (
      is_one.astype(jnp.int32)
      + 2 * overflows.astype(jnp.int32)
      + 4 * rounds_up_to_normal.astype(jnp.int32)
    )
    bucket = 8 * (jnp.clip(d.exponent, low, high) - low) + flags
    bucket = jnp.where(d.zero, zero_bin, jnp.where(d.nonfinite, nonfinite_bin, bucket))
    total = total + jnp.bincount(bucket.ravel(), length=8 * rows + 2).astype(jnp.int32)
  return _Table(total[: 8 * rows].reshape(rows, 8), total[zero_bin], total[nonfinite_bin])


def _report(table: _Table, fmt: bits.Format, k: jax.Array, valid: jax.Array) -> RangeReport:
  """Classifies the table's cells for the scales ``2**k`` (any shape) and counts."""
  low, high = _rows(fmt)
  exponent = jnp.arange(low, high + 1, dtype=jnp.int32)[:, None]  # (rows, 1)
  flags = jnp.arange(8, dtype=jnp.int32)[None, :]  # (1, 8)
  is_one, overflows, up = (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0
  e = exponent + k[..., None, None]  # (..., rows, 8)
  overflow = (e > fmt.max_exponent) | ((e == fmt.max_exponent) & overflows)
  flushed = (e < fmt.flush_exponent) | ((e == fmt.flush_exponent) & is_one)
  normal = ~overflow & ((e >= fmt.min_exponent) | ((e == fmt.min_exponent - 1) & up))
  subnormal = ~(overflow | flushed | normal)

  def count(mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, table.counts, 0), axis=(-2, -1), dtype=jnp.int32)

  nonfinite = jnp.broadcast_to(table.nonfinite, k.shape)
  counts = jnp.stack(
    [count(overflow), count(normal), count(subnormal), count(flushed), nonfinite], axis=-1
  )
  nonzero = jnp.sum(table.counts, dtype=jnp.int32) + table.nonfinite
  fractions = counts.astype(jnp.float32) / jnp.maximum(nonzero, 1).astype(jnp.float32)
  fractions = jnp.where(valid[..., None], fractions, jnp.float32(jnp.nan))
  return RangeReport(
    *(fractions[..., i] for i in range(5)), counts=counts, nonzero=nonzero, zeros=table.zeros
  )


def range_report(tree: Any, dtype: Any, *, scale: Any = 1.0) -> RangeReport:
  """Classifies every nonzero value of ``tree`` by what ``x * scale`` becomes in ``dtype``.

  Each value is multiplied by ``scale`` (exactly: a power of two) and rounded
  to nearest, ties to even, into the target format, as a cast would; the
  report gives the fraction of the nonzero values that overflow, stay normal,
  become subnormal or flush to zero, and of those already non-finite. The
  thresholds (float16: ``x * scale >= 65520`` overflows, ``<= 2**-25``
  flushes, ``< 2**-14 - 2**-25`` is subnormal) are applied to the bits of
  each value with integer arithmetic, so the report is exact on every backend
  (XLA flushes float32 subnormals in arithmetic; the report does not). It
  runs under ``jit``; non-floating leaves are ignored.

  Args:
    tree: any pytree of floating arrays (float8 to float64).
    dtype: the target format: ``jnp.float16``, ``jnp.bfloat16``,
      ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2`` (or their names), or another
      ml_dtypes format with subnormals.
    scale: a power of two in ``[2**-126, 2**126]``, or an array of them (one
      report entry per scale). A traced scale cannot be checked: where it is
      not such a power of two, the fractions are NaN.

  Returns:
    A :class:`RangeReport`.

  Raises:
    PolicyError: ``dtype`` is not a format the report can round into.
    ConfigError: a concrete ``scale`` is not a power of two in range.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> x = jnp.array([1e-8, 1e-6, 1.0, 6e4, 0.0])
    >>> r = mpx.diagnostics.range_report(x, jnp.float16)
    >>> float(r.flushed), float(r.subnormal), float(r.normal), float(r.overflow), int(r.zeros)
    (0.25, 0.25, 0.5, 0.0, 1)
    >>> r = mpx.diagnostics.range_report(x, jnp.float16, scale=2.0**4)  # 6e4 * 16 overflows
    >>> float(r.flushed), float(r.overflow)
    (0.0, 0.25)
  """
  fmt = bits.get_format(dtype)
  k, valid = _scale_exponents(scale)
  return _report(_table(tree, fmt), fmt, k, valid)


def recommend_scale(
  tree: Any, dtype: Any, *, margin: float = 2.0, max_flushed: float = 1e-3
) -> ScaleRecommendation:
  """Recommends a static power-of-two scale for ``tree`` in ``dtype``, with the figures behind it.

  Every scale ``2**k``, ``k`` in ``[-126, 126]``, is judged from one pass
  over the data (the same exact classification as :func:`range_report`):

  * ``max_scale``: the largest scale ``s`` at which ``s * margin`` still
    overflows no value: the data may grow by ``margin`` before a step
    overflows;
  * ``min_scale``: the smallest scale at which at most ``max_flushed`` of the
    nonzero values flush to zero;
  * ``scale``: ``max_scale``, the recommendation (an overflow skips the step,
    a flushed value only loses its contribution); ``feasible`` says whether it
    also meets ``min_scale``. If not, the values span more binades than the
    format holds: keep the layer in float32, or use a format with a wider
    range (bfloat16).

  Args:
    tree: the values the scale applies to, e.g. the gradients of a float32
      step with a scale of 1 (what the loss scale multiplies).
    dtype: the target format, as for :func:`range_report`.
    margin: a power of two >= 1, the headroom kept below overflow.
    max_flushed: the largest acceptable fraction of flushed values, in [0, 1].

  Returns:
    A :class:`ScaleRecommendation`.

  Raises:
    PolicyError: ``dtype`` is not a format the report can round into.
    ConfigError: ``margin`` or ``max_flushed`` is out of range.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> grads = jnp.array([2.0**-30, 2.0**-20, 2.0**-10, 2.0**-4])
    >>> rec = mpx.diagnostics.recommend_scale(grads, jnp.float16)
    >>> float(rec.max_scale), float(rec.min_scale), bool(rec.feasible)
    (262144.0, 64.0, True)
  """
  fmt = bits.get_format(dtype)
  mantissa, exponent = np.frexp(float(margin))
  if mantissa != 0.5 or exponent < 1 or exponent > 64:
    raise errors.ConfigError(
      f"margin must be a power of two >= 1 (the headroom below overflow), got {margin!r}."
    )
  if not 0.0 <= float(max_flushed) <= 1.0:
    raise errors.ConfigError(f"max_flushed must lie in [0, 1], got {max_flushed!r}.")
  table = _table(tree, fmt)
  ks = jnp.arange(_MIN_K, _MAX_K + 1, dtype=jnp.int32)
  always = jnp.ones(ks.shape, jnp.bool_)
  headroom = _report(table, fmt, ks + (exponent - 1), always)
  at = _report(table, fmt, ks, always)
  safe = headroom.overflow == 0
  enough = at.flushed <= jnp.float32(max_flushed)
  nan = jnp.float32(jnp.nan)
  max_k = jnp.max(jnp.where(safe, ks, _MIN_K - 1))
  min_k = jnp.min(jnp.where(enough, ks, _MAX_K + 1))
  max_scale = jnp.where(jnp.any(safe), power_of_two(max_k), nan)
  min_scale = jnp.where(jnp.any(enough), power_of_two(min_k), nan)
  index = jnp.clip(max_k - _MIN_K, 0, ks.size - 1)
  report = jax.tree.map(lambda a: a[index] if a.ndim else a, at)
  report = report._replace(
    **{f: jnp.where(jnp.any(safe), getattr(report, f), nan) for f in RangeReport._fields[:5]}
  )
  return ScaleRecommendation(
    scale=max_scale,
    max_scale=max_scale,
    min_scale=min_scale,
    feasible=jnp.any(safe) & jnp.any(enough) & (min_k <= max_k),
    report=report,
  )
