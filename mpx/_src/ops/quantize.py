"""Float8 quantisation: the format's max, amaxes, power-of-two scales, quantise and dequantise.

The primitives every float8 recipe shares (:mod:`mpx._src.ops.fp8` for
per-tensor and per-row scales, :mod:`mpx._src.ops.mx` for block scales).
Scales are powers of two, so dividing and multiplying by them is exact.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def fp8_max(dtype: Any) -> float:
  """The largest finite value of a float8 format (448 for E4M3, 57,344 for E5M2)."""
  return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis_name: str | None = None) -> jax.Array:
  """The largest magnitude of ``x`` as a float32 scalar, reduced over ``axis_name`` if given.

  Args:
    x: any floating array.
    axis_name: a named axis to ``pmax`` over, or ``None``.

  Returns:
    A float32 scalar (NaN if ``x`` holds a NaN).
  """
  value = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return value if axis_name is None else jax.lax.pmax(value, axis_name)


def scale_for(amax_value: jax.Array, dtype: Any, *, margin: int = 0) -> jax.Array:
  """The power-of-two scale that maps ``amax_value`` to at most ``fp8_max(dtype) / 2**margin``.

  ``x / s`` then fits the format; ``s`` is a power of two, so both the
  division and the dequantising product are exact.

  Args:
    amax_value: a float32 scalar.
    dtype: the float8 format.
    margin: headroom in powers of two.

  Returns:
    A float32 scalar; 1 where ``amax_value`` is zero or not finite.
  """
  ratio = amax_value / jnp.float32(fp8_max(dtype) / 2.0**margin)
  mantissa, exponent = jnp.frexp(ratio)  # ratio = m * 2**e, 0.5 <= m < 1
  exponent = exponent - (mantissa == 0.5).astype(exponent.dtype)
  usable = (amax_value > 0) & jnp.isfinite(amax_value)
  return jnp.where(usable, jnp.ldexp(jnp.float32(1.0), exponent), jnp.float32(1.0))


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """Rounds ``x / scale`` to a float8 format, saturating finite values at its max.

  Args:
    x: a floating array.
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: a float32 scalar (a power of two from :func:`scale_for`).

  Returns:
    ``x / scale`` in ``dtype``: finite values beyond the max become the max
    (with their sign), NaN stays NaN, infinities follow the format
    (E5M2 keeps them, E4M3FN has none and gives NaN).
  """
  wide = scale_dtype(x.dtype)
  limit = jnp.asarray(fp8_max(dtype), wide)
  scaled = x.astype(wide) / scale.astype(wide)
  clamped = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -limit, limit), scaled)
  return clamped.astype(dtype)


def scale_dtype(dtype: Any) -> np.dtype:
  """The dtype scaling by a power of two is exact in: ``dtype``, or float32 if its range is narrower.

  A float32 scale may lie outside float16's range (below ``2**-24`` for a
  float16 tensor of amax under about ``1e-5``): cast to float16 it would
  become 0 or inf. bfloat16 has float32's exponent range.
  """
  if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:
    return np.dtype(np.float32)
  return np.dtype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q`` cast to ``dtype`` and multiplied by ``scale``: the form XLA fuses into a float8 GEMM.

  Args:
    q: a float8 array.
    scale: its float32 scale.
    dtype: the compute dtype.

  Returns:
    The dequantised array in ``dtype``.
  """
  wide = scale_dtype(dtype)
  return (q.astype(wide) * scale.astype(wide)).astype(dtype)
