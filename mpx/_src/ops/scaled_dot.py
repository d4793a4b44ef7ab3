"""The float8 product: ``dot_general`` of float8 operands, accumulated in float32, times their scales.

Shared by the float8 dot (:mod:`mpx._src.ops.fp8`, all three of its products)
and the float8 convolution's weight gradient (:mod:`mpx._src.ops.fp8_conv`).
The float8 operands themselves reach ``dot_general``, which XLA:GPU compiles
to a float8 GEMM (Triton or cuBLASLt) with the scaling in its epilogue. (A dot
of dequantised operands, ``convert(float8) * scale``, compiles to a bfloat16
GEMM for an H100 under XLA's default flags: XLA erases the round trip.)
Core module: imports neither Flax nor optax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src.ops.quantize import scale_dtype


def _rescaled(product: jax.Array, scales: Sequence[jax.Array], dtype: np.dtype) -> jax.Array:
  """A product of float8 operands (float32, or ``dtype``), times their scales (one at a time), in ``dtype``.

  One multiplication per scale: the scales are powers of two, so each product
  is exact unless it leaves the format's range, and multiplying them together
  first could underflow to zero where the result itself does not.
  """
  for scale in scales:
    product = product * scale.astype(product.dtype)
  return product.astype(dtype)


def _free_dims(ndim: int, *taken: Sequence[int]) -> list[int]:
  """The axes of an operand of rank ``ndim`` that are in none of ``taken``."""
  used = {d for dims in taken for d in dims}
  return [d for d in range(ndim) if d not in used]


def in_output_layout(
  scale: jax.Array,
  ndim: int,
  contracting: Sequence[int],
  batch: Sequence[int],
  before: int,
  after: int,
) -> jax.Array:
  """An operand's scale laid out like ``dot_general``'s result: (batch, lhs free, rhs free).

  A per-tensor (scalar) scale is returned as it is. A per-row scale (size 1
  on the contracting axes) loses those axes, puts its batch axes first and
  gets ``before`` size-1 axes after them (the other operand's free axes, for
  the rhs) and ``after`` at the end (for the lhs).
  """
  if scale.ndim == 0:
    return scale
  kept = [d for d in range(ndim) if d not in contracting]
  free = [d for d in kept if d not in batch]
  scale = jnp.squeeze(scale, tuple(contracting))
  scale = jnp.transpose(scale, [kept.index(d) for d in (*batch, *free)])
  nb = len(batch)
  return scale.reshape((*scale.shape[:nb], *(1,) * before, *scale.shape[nb:], *(1,) * after))


def scaled_dot(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  dimension_numbers: Any,
  precision: Any,
  dtype: np.dtype,
) -> jax.Array:
  """``dot_general`` of two float8 arrays in float32, times their scales, in ``dtype``.

  Args:
    a: the left float8 operand.
    a_scale: its scale: a scalar, or per row (size 1 on the contracting axes).
    b: the right float8 operand.
    b_scale: its scale, likewise.
    dimension_numbers: hashable ``dot_general`` dimension numbers.
    precision: as for ``jax.lax.dot_general``.
    dtype: the result's dtype.

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.
  """
  (ac, bc), (ab, bb) = dimension_numbers
  a_free = a.ndim - len(ac) - len(ab)
  b_free = b.ndim - len(bc) - len(bb)
  # The product comes out in ``dtype`` when its range is float32's (bfloat16):
  # the GEMM still accumulates in float32, and a power-of-two scale commutes
  # with the rounding, so the result is the same down to bfloat16's smallest
  # normal number. What it saves: per-row scales are no epilogue XLA fuses, so
  # the product is written out before they apply (half the bytes in
  # bfloat16); and when the contraction is sharded (FSDP's weight gradient),
  # the partial products are what XLA reduce-scatters (bfloat16, not float32).
  in_dtype = scale_dtype(dtype) == dtype
  product = jax.lax.dot_general(
    a,
    b,
    dimension_numbers,
    precision=precision,
    preferred_element_type=dtype if in_dtype else jnp.float32,
  )
  scales = (
    in_output_layout(a_scale, a.ndim, ac, ab, 0, b_free),
    in_output_layout(b_scale, b.ndim, bc, bb, a_free, 0),
  )
  return _rescaled(product, scales, dtype)


def transposed_products(
  dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int
) -> tuple[Any, tuple[int, ...], Any, tuple[int, ...]]:
  """The two backward products of ``dot_general(lhs, rhs, dimension_numbers)`` with gradient ``g``.

  ``dot_general`` orders its result as (batch, lhs free, rhs free). The
  gradient of ``lhs`` is ``g`` contracted with ``rhs`` over the rhs free axes,
  that of ``rhs`` is ``lhs`` contracted with ``g`` over the lhs free axes; each
  comes out as (batch, kept, other's contracting) and is permuted back to its
  operand's layout.

  Returns:
    ``(lhs_dims, lhs_perm, rhs_dims, rhs_perm)``: ``transpose(dot_general(g,
    rhs, lhs_dims), lhs_perm)`` is the lhs gradient and
    ``transpose(dot_general(lhs, g, rhs_dims), rhs_perm)`` the rhs one.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf, rf = _free_dims(lhs_ndim, lc, lb), _free_dims(rhs_ndim, rc, rb)
  g_batch = tuple(range(len(lb)))
  g_lhs_free = tuple(range(len(lb), len(lb) + len(lf)))
  g_rhs_free = tuple(range(len(lb) + len(lf), len(lb) + len(lf) + len(rf)))
  # g . rhs: (batch, lhs free, lhs contracting in the order of the rhs axes they meet).
  lhs_dims = ((g_rhs_free, tuple(rf)), (g_batch, tuple(rb)))
  lhs_order = [*lb, *lf, *(lc[i] for i in np.argsort(rc))]
  # lhs . g: (batch, rhs contracting in the order of the lhs axes they meet, rhs free).
  rhs_dims = ((tuple(lf), g_lhs_free), (tuple(lb), g_batch))
  rhs_order = [*rb, *(rc[i] for i in np.argsort(lc)), *rf]
  return lhs_dims, tuple(np.argsort(lhs_order)), rhs_dims, tuple(np.argsort(rhs_order))
