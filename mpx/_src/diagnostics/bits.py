"""Floating-point numbers read from their bits: exponents, fractions and target formats.

The precision tools classify values by their binary exponent and fraction,
computed from the bit pattern with integer operations only. Device arithmetic
would not do: XLA:CPU (and GPUs) flush float32 subnormals to zero in
arithmetic and comparisons (``2**-140 == 0`` is true there), and a fused
bfloat16 computation may keep excess float32 precision. Integer operations on
the bits are exact on every backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors

# Fractions are compared on a 23-bit grid (float32's), with a sticky bit for
# the wider float64 fraction.
FRACTION_BITS = 23
# Power-of-two scales 2**k with k in this range: 1 / scale is then a normal float32.
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 126

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class Decoded(NamedTuple):
  """A floating array read from its bits, element by element.

  Attributes:
    exponent: int32, ``floor(log2(|x|))`` for finite nonzero ``x`` (subnormals
      included); meaningless elsewhere.
    fraction: uint32, the bits of ``|x| / 2**exponent - 1`` on a 23-bit grid;
      a wider fraction (float64) is truncated with its lowest bit set when
      anything was cut off (sticky), which keeps every comparison against a
      threshold with at most 22 fraction bits exact.
    zero: bool, ``x`` is +0 or -0.
    finite_nonzero: bool.
    nonfinite: bool, ``x`` is an infinity or NaN.
  """

  exponent: jax.Array
  fraction: jax.Array
  zero: jax.Array
  finite_nonzero: jax.Array
  nonfinite: jax.Array


def decode(x: jax.Array) -> Decoded:
  """Reads the exponent and fraction of every element of a floating array from its bits.

  Args:
    x: an array of any floating dtype (float8 to float64).

  Returns:
    A :class:`Decoded` of arrays shaped like ``x``.
  """
  x = jnp.asarray(x)
  info = ml_dtypes.finfo(x.dtype)
  nmant, nexp = int(info.nmant), int(info.nexp)
  wide = x.dtype.itemsize == 8
  word = jnp.uint64 if wide else jnp.uint32
  width = 64 if wide else 32
  bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(word)
  mant_mask = word((1 << nmant) - 1)
  mant = bits & mant_mask
  biased = (bits >> word(nmant)) & word((1 << nexp) - 1)
  nonfinite = jnp.isnan(x) | jnp.isinf(x)  # exact on every backend, unlike comparisons
  zero = (biased == 0) & (mant == 0) & ~nonfinite
  subnormal = (biased == 0) & (mant != 0)
  # A subnormal's leading one moves to the implicit bit; its exponent follows.
  length = word(width) - jax.lax.clz(mant)  # bit length of the subnormal's mantissa
  shift = jnp.where(subnormal, word(nmant + 1) - length, word(0))
  normalized = (mant << shift) & mant_mask
  min_exponent = int(info.minexp)  # exponent of the smallest normal number
  exponent = jnp.where(
    subnormal,
    (length.astype(jnp.int32) - 1) + jnp.int32(min_exponent - nmant),
    biased.astype(jnp.int32) + jnp.int32(min_exponent - 1),
  )
  if nmant <= FRACTION_BITS:
    fraction = (normalized << word(FRACTION_BITS - nmant)).astype(jnp.uint32)
  else:
    cut = nmant - FRACTION_BITS
    sticky = ((normalized & word((1 << cut) - 1)) != 0).astype(word)
    fraction = ((normalized >> word(cut)) | sticky).astype(jnp.uint32)
  return Decoded(exponent, fraction, zero, ~zero & ~nonfinite, nonfinite)


@dataclasses.dataclass(frozen=True)
class Format:
  """A target number format, as the thresholds of round-to-nearest-even into it.

  With ``y = |x| * scale`` exact, rounding ``y`` into the format (ties to even)

  * overflows when ``y`` exceeds ``max + ulp(max) / 2``, or equals it and
    ``max`` has an odd last mantissa bit (the tie then rounds away from
    ``max``): to infinity, or to NaN in formats without one (``e4m3fn``);
  * flushes to zero when ``y <= smallest_subnormal / 2``;
  * is normal when ``y >= smallest_normal - smallest_subnormal / 2`` (the
    largest subnormal has an odd mantissa, so the tie rounds up);
  * is subnormal in between.

  Attributes:
    name: the dtype's name, e.g. ``"float8_e4m3fn"``.
    nmant: explicit mantissa bits.
    min_exponent: exponent of the smallest normal number.
    max_exponent: exponent of the largest finite number.
    overflow_fraction: the fraction of ``(max + ulp(max) / 2) / 2**max_exponent``
      on the 23-bit grid.
    overflow_on_tie: whether a value equal to ``max + ulp(max) / 2`` overflows.
    max: the largest finite value.
  """

  name: str
  nmant: int
  min_exponent: int
  max_exponent: int
  overflow_fraction: int
  overflow_on_tie: bool
  max: float

  @property
  def flush_exponent(self) -> int:
    """The exponent of ``smallest_subnormal / 2``: values at or below it flush to zero."""
    return self.min_exponent - self.nmant - 1

  @property
  def normal_fraction(self) -> int:
    """The fraction of ``(smallest_normal - smallest_subnormal / 2) / 2**(min_exponent - 1)``."""
    return (1 << FRACTION_BITS) - (1 << (FRACTION_BITS - self.nmant))


def get_format(dtype: Any) -> Format:
  """Returns the rounding thresholds of a floating format narrower than float32.

  Args:
    dtype: a dtype or its name: ``jnp.float16``, ``"bf16"``,
      ``"float8_e4m3fn"``, ``jnp.float8_e5m2``... Every ml_dtypes format with
      subnormals and at most 21 mantissa bits qualifies.

  Returns:
    The :class:`Format`.

  Raises:
    PolicyError: for any other dtype, listing examples of valid ones.
  """
  dt = dtypes_lib.lookup_dtype(dtype)
  info = ml_dtypes.finfo(dt) if dt is not None and dtypes_lib.is_floating(dt) else None
  if dt is None or info is None or not 1 <= int(info.nmant) <= FRACTION_BITS - 2:
    raise errors.PolicyError(
      f"{dtype!r} is not a format the range report can round into. Pass a floating format "
      "narrower than float32 with subnormal numbers: jnp.float16 (or 'f16'), jnp.bfloat16 "
      "(or 'bf16'), jnp.float8_e4m3fn, jnp.float8_e5m2, or another ml_dtypes float8/float6/"
      "float4 format."
    )
  nmant = int(info.nmant)
  top = float(info.max)
  mantissa, exponent = math.frexp(top)  # top = mantissa * 2**exponent, mantissa in [0.5, 1)
  max_exponent = exponent - 1
  max_mantissa = 2 * mantissa  # in [1, 2)
  overflow_mantissa = max_mantissa + 2.0 ** -(nmant + 1)
  return Format(
    name=dt.name,
    nmant=nmant,
    min_exponent=int(info.minexp),
    max_exponent=max_exponent,
    overflow_fraction=int((overflow_mantissa - 1) * 2**FRACTION_BITS),
    overflow_on_tie=int((max_mantissa - 1) * 2**nmant) % 2 == 1,
    max=top,
  )
