"""Float8 quantisation: the format's max, amaxes, power-of-two scales, quantise and dequantise.

The primitives every float8 recipe shares (:mod:`mpx._src.ops.fp8` for
per-tensor and per-row scales, :mod:`mpx._src.ops.mx` for block scales,
:mod:`mpx._src.ops.fp8_conv` for convolutions). Scales are powers of two, so
dividing and multiplying by them is exact.

A scale is computed on float32 bits, not with ``frexp``/``ldexp``: exact, with
no division, and a few integer operations that XLA fuses into one small kernel
(or into the kernel that uses the scale) instead of several. A per-tensor amax
is reduced in two stages that mpx chooses (:func:`partial_amaxes`, then one
more reduction), with the scale's arithmetic fused into the second.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)

_EXPONENT_BITS = 0x7F800000
_MANTISSA_BITS = 0x007FFFFF
_SMALLEST_SCALE = 0x00800000  # 2**-126, float32's smallest normal: a subnormal scale would flush
_LARGEST_SCALE = 0x7F000000  # 2**127


def fp8_max(dtype: Any) -> float:
  """The largest finite value of a float8 format (448 for E4M3, 57,344 for E5M2)."""
  return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis_name: str | None = None) -> jax.Array:
  """The largest magnitude of ``x`` as a float32 scalar, reduced over ``axis_name`` if given.

  Args:
    x: any floating array (0 if it has no elements).
    axis_name: a named axis to ``pmax`` over, or ``None``.

  Returns:
    A float32 scalar (NaN if ``x`` holds a NaN).
  """
  # No initial value for the reduction unless there is nothing to reduce: XLA:GPU
  # applies it after the reduction, in a kernel of its own.
  value = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), x.dtype)
  value = value.astype(jnp.float32)
  return value if axis_name is None else jax.lax.pmax(value, axis_name)


def _scale_bits(magnitude: jax.Array, dtype: Any, margin: int) -> jax.Array:
  """The int32 bits of the smallest power of two ``s`` with ``magnitude / s <= fp8_max / 2**margin``.

  Exact, with no division: with ``fp8_max = m_F * 2**e_F`` and ``magnitude =
  m * 2**e`` (``1 <= m, m_F < 2``), ``s`` is ``2**(e - e_F + margin)``, times
  2 when ``m > m_F``. Adding ``0x800000 - 1 - mantissa(m_F)`` to the bits
  carries into the exponent exactly then. Clamped to ``[2**-126, 2**127]``;
  ``magnitude`` is non-negative. What infinity or NaN gives is meaningless (a
  huge scale, ``2**120`` for an infinite E4M3 amax; some NaNs wrap to the
  smallest).
  """
  top = int(np.array(fp8_max(dtype), np.float32).view(np.int32))
  carry = _MANTISSA_BITS - (top & _MANTISSA_BITS)
  # 2**0 has the bits 127 << 23: subtract e_F - margin from the exponent field.
  offset = (top & _EXPONENT_BITS) - (margin << 23) - (127 << 23)
  bits = jax.lax.bitcast_convert_type(magnitude.astype(jnp.float32), jnp.int32)
  # (A NaN's bits may wrap past 2**31 here; masked, they give 0, clamped like 0.)
  exponent = (bits + np.int32(carry)) & np.int32(_EXPONENT_BITS)
  return jnp.clip(exponent - np.int32(offset), _SMALLEST_SCALE, _LARGEST_SCALE)


def scale_for(amax_value: jax.Array, dtype: Any, *, margin: int = 0) -> jax.Array:
  """The power-of-two scale that maps ``amax_value`` to at most ``fp8_max(dtype) / 2**margin``.

  ``x / s`` then fits the format; ``s`` is a power of two, so both the
  division and the dequantising product are exact. It is the smallest such
  power of two (no bit wasted), and at least ``2**-126``, float32's smallest
  normal number.

  Args:
    amax_value: a float32 array (a scalar, or one amax per row or block).
    dtype: the float8 format.
    margin: headroom in powers of two.

  Returns:
    A float32 array of ``amax_value``'s shape; 1 where ``amax_value`` is zero
    or not finite.
  """
  scale = jax.lax.bitcast_convert_type(_scale_bits(amax_value, dtype, margin), jnp.float32)
  usable = (amax_value > 0) & jnp.isfinite(amax_value)
  return jnp.where(usable, scale, jnp.float32(1.0))


def tensor_scale(
  x: jax.Array,
  dtype: Any,
  *,
  margin: int = 0,
  axis: int | Sequence[int] | None = None,
  axis_name: str | None = None,
) -> jax.Array:
  """``x``'s own power-of-two scale (current scaling), over ``axis`` (all axes by default).

  :func:`scale_for` of ``x``'s amax, computed on the amax's bits with no
  select after it. Per tensor, it takes two kernels: the first stage of the
  amax (:func:`partial_amaxes`), and one that reduces the scales of those
  rows (the bits grow with the magnitude, so their max is the tensor's
  scale; ``frexp``, ``ldexp`` and the select made three more). So it differs
  from :func:`scale_for` where the amax is zero (an empty or all-zero tensor:
  ``2**-126`` instead of 1, which represents zeros as exactly) or not finite
  (a meaningless scale instead of 1: the finite values beside a NaN or
  infinity may flush to zero or saturate, the non-finite ones pass through
  :func:`quantize` as they are, and the product is not finite either way).

  Args:
    x: a floating array.
    dtype: the float8 format.
    margin: headroom in powers of two.
    axis: the axes reduced; the others keep one scale per index (rowwise).
    axis_name: a named axis to ``pmax`` over, or ``None``.

  Returns:
    A float32 scalar (``axis=None``), or an array of ``x``'s rank with size 1
    on the reduced axes.
  """
  if axis is None:
    # The scale's bits grow with the magnitude, so the largest of the rows' scales (or
    # the elements', for a tensor of one row) is the tensor's: computed before the last
    # max, they fuse into its kernel, where XLA:GPU fuses no arithmetic after a
    # reduction to a scalar (a kernel of its own).
    rows = jnp.abs(x).astype(jnp.float32) if 0 < x.size <= _ROW else partial_amaxes(x)
    value = jnp.max(jax.lax.bitcast_convert_type(_scale_bits(rows, dtype, margin), jnp.float32))
    return value if axis_name is None else jax.lax.pmax(value, axis_name)
  axes = tuple(np.atleast_1d(axis).tolist())
  if all(x.shape[a] for a in axes):
    # The reduction stays a plain max: XLA fuses it into the pass that produces x.
    # (Each element's scale, reduced by max, gives the same scale with no kernel
    # after the reduction, but XLA:GPU then writes out the elements' bits, one more
    # pass over x: 9% more bytes for a 3072-wide MLP step.)
    magnitude = jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)
  else:  # nothing to reduce (an empty batch): zeros, which any scale represents
    magnitude = jnp.zeros([1 if a in axes else n for a, n in enumerate(x.shape)], jnp.float32)
  value = jax.lax.bitcast_convert_type(_scale_bits(magnitude, dtype, margin), jnp.float32)
  return value if axis_name is None else jax.lax.pmax(value, axis_name)


# The longest row XLA:GPU reduces in one kernel: a longer row, or a whole tensor, it splits into
# two kernels (a tree reduction). Measured on the H100 target (jaxlib 0.10), as is _PARTIALS.
_ROW = 16384
# Up to this many partial amaxes, an elementwise function of them fuses into the kernel
# that reduces them; more, and XLA:GPU writes the function's values out in a kernel first.
_PARTIALS = 3072


def partial_amaxes(x: jax.Array) -> jax.Array:
  """The first of the two stages of ``x``'s amax: the largest magnitudes of rows of ``x``.

  A row is the trailing axes, the first of them split if needed, so that it
  holds at most ``_ROW`` elements and XLA:GPU reduces each in one kernel,
  fused into the one that produces ``x`` where it can. Only that one axis is
  reshaped: merging axes would transpose a tensor laid out in another order
  (attention's heads) first.

  Args:
    x: a floating array.

  Returns:
    A float32 vector (one 0 if ``x`` has no elements) whose max is ``x``'s amax.
  """
  if not x.size:
    return jnp.zeros((1,), jnp.float32)
  shape = list(x.shape) or [1]
  kept = len(shape) - 1
  while kept > 0 and math.prod(shape[kept - 1 :]) <= _ROW:
    kept -= 1
  count, row = math.prod(shape[:kept]), math.prod(shape[kept:])
  if count > _PARTIALS:
    # Move the least of the last kept axis into the rows that brings the count within
    # _PARTIALS: splitting one axis is a bitcast in any layout.
    n = shape[kept - 1]
    fits = [m for m in range(2, n + 1) if n % m == 0 and count // m <= _PARTIALS]
    if fits and fits[0] * row <= _ROW:
      shape[kept - 1 : kept] = [n // fits[0], fits[0]]
  rows = jnp.max(jnp.abs(x).reshape(shape), axis=tuple(range(kept, len(shape))))
  return rows.reshape(-1).astype(jnp.float32)


def stacked_amaxes(partials: Sequence[jax.Array], axis_name: str | None = None) -> jax.Array:
  """The amaxes of several tensors from their :func:`partial_amaxes`, in one reduction.

  Args:
    partials: each tensor's partial amaxes.
    axis_name: a named axis to ``pmax`` over (one collective for all), or ``None``.

  Returns:
    A float32 vector, one amax per tensor.
  """
  # Magnitudes are non-negative: zero padding leaves each max as it is.
  longest = max(p.shape[0] for p in partials)
  rows = jnp.stack([jnp.pad(p, (0, longest - p.shape[0])) for p in partials])
  value = jnp.max(rows, axis=1)
  return value if axis_name is None else jax.lax.pmax(value, axis_name)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """Rounds ``x / scale`` to a float8 format, saturating finite values at its max.

  Args:
    x: a floating array.
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: a float32 power of two (from :func:`scale_for` or
      :func:`tensor_scale`), a scalar or broadcastable against ``x``.

  Returns:
    ``x / scale`` in ``dtype``: finite values beyond the max become the max
    (with their sign), NaN stays NaN, infinities follow the format
    (E5M2 keeps them, E4M3FN has none and gives NaN).
  """
  wide = scale_dtype(x.dtype)
  limit = jnp.asarray(fp8_max(dtype), wide)
  scaled = x.astype(wide) / scale.astype(wide)
  saturated = jnp.clip(scaled, -limit, limit)
  if np.isnan(np.float32(np.inf).astype(dtype)) and np.size(scale) == 1:
    # A format with no infinity (E4M3FN): ``scaled - scaled`` is +0 for a finite value
    # (``a - +0`` is ``a``, signed zeros too) and NaN for an infinity or a NaN, which
    # the format gives them. No mask: XLA:GPU wrote a select's mask out in a pass of
    # its own when the quantisation also transposes (a kernel's float8 copy: 7% of a
    # 3072-wide MLP step's bytes). Per-row scales keep the select: without it XLA
    # planned 4% more temp memory for the rowwise MLP step (0.77x bfloat16's).
    clamped = saturated - (scaled - scaled)
  else:
    clamped = jnp.where(jnp.isfinite(scaled), saturated, scaled)
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


def quantize_dequantize(
  x: jax.Array,
  dtype: Any,
  *,
  scale: jax.Array | None = None,
  margin: int = 0,
  straight_through: bool = False,
) -> jax.Array:
  """``x`` rounded through a float8 format and back, with current scaling unless ``scale`` is given.

  Its gradient, by default, is what autodiff makes of the casts: the
  cotangent is itself rounded to the float8 format (scaled like ``x``), and
  zero where ``x`` saturated. With ``straight_through=True`` (the
  straight-through estimator, as torchao's differentiable float8 casts) the
  cotangent passes unchanged where ``x / scale`` is within the format's
  range, and is zero where it saturated, since the output stays at the max
  there.

  Args:
    x: a floating array.
    dtype: the float8 format.
    scale: the scale; ``None`` uses :func:`scale_for` of ``x``'s own amax.
    margin: headroom for the current scale.
    straight_through: whether the gradient is the identity within range.

  Returns:
    An array of ``x``'s dtype and shape.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> x = jnp.array([1.0, 0.3, -500.0])
    >>> mpx.fp8.quantize_dequantize(x, jnp.float8_e4m3fn, scale=jnp.float32(1.0))
    Array([ 1.000e+00,  3.125e-01, -4.480e+02], dtype=float32)
  """
  if scale is None:
    scale = scale_for(amax(x), dtype, margin=margin)
  if straight_through:
    return _straight_through(x, scale, np.dtype(dtype))
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _straight_through(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def _straight_through_fwd(
  x: jax.Array, scale: jax.Array, dtype: np.dtype
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  return _straight_through(x, scale, dtype), (x, scale)


def _straight_through_bwd(
  dtype: np.dtype, residuals: tuple[jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array]:
  x, scale = residuals
  wide = scale_dtype(x.dtype)
  saturated = jnp.abs(x.astype(wide) / scale.astype(wide)) > fp8_max(dtype)
  return jnp.where(saturated, jnp.zeros_like(g), g), jnp.zeros_like(scale)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)
