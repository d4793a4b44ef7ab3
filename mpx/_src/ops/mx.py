"""Block-scaled float8 matmuls: MXFP8 (E8M0 scales per block of 32) and blockwise (float32 scales per 128).

The OCP Microscaling format (MX v1.0) that Blackwell GPUs multiply natively:
every 32 consecutive elements along the contracted axis share a scale, so
an outlier only coarsens its own block. ``jax.lax.scaled_dot`` is the
product; XLA:GPU compiles it to a Triton block-scaled GEMM (on a B200, a
``tcgen05`` MMA of kind ``mxf8f6f4.block_scale``), and elsewhere into the
dequantised product, so the same program runs on CPU with the exact
rounding.

A block's scale is the smallest power of two that brings its amax within
E4M3's max (so nothing saturates: the OCP rule, ``2**(floor(log2(amax)) -
8)``, may clip the top of a block to 448), within E8M0's range. Every
operand of every product, the gradient included, is E4M3 (with blocks of
32, the gradient's range is the block's). Each of the three products of a
layer contracts another axis, so each operand is quantised in blocks along
the axis its product contracts: the forward pass quantises each input twice,
once for its own product and once for the backward product that needs it,
and saves the second (one byte per element, plus one per 32). Axes are
zero-padded to multiples of 32 where they are contracted.

The blockwise recipe (DeepSeek-V3's) is the same product with blocks of 128
and float32 power-of-two scales, except for the rhs operand (the weight),
scaled per 128 x 128 tile: a tile's scale holds along both of its axes, so
the weight is quantised once for the forward product and the input
gradient's. No Hopper GEMM of XLA applies per-128 float32 scales: compiled
for an H100 (and run on an H200), ``scaled_dot`` becomes a bfloat16 GEMM of
the dequantised operands.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src.ops.quantize import E4M3, quantize, tensor_scale
from mpx._src.recipe import Fp8Recipe

BLOCK = 32
"""Elements per scale along the contracted axis, MXFP8."""
TILE = 128
"""Elements per scale along the contracted axis (and per side of a weight tile), blockwise."""

E8M0 = np.dtype(jnp.float8_e8m0fnu)


class _Blocking(NamedTuple):
  """How a block-scaled recipe lays out its scales."""

  size: int  # elements per scale along a contraction
  scale_dtype: np.dtype  # E8M0 (MXFP8) or float32 (blockwise)
  tiled_rhs: bool  # the rhs (the weight) scaled per size x size tile, not per 1 x size block


def _blocking(recipe: Fp8Recipe) -> _Blocking:
  if recipe.scaling == "blockwise":
    return _Blocking(TILE, np.dtype(np.float32), True)
  return _Blocking(BLOCK, E8M0, False)


def _layout(shape: tuple[int, ...], contracting: Any, batch: Any):
  """How an operand becomes ``(batch, free, contracted)``: the axis order, and the shape in it."""
  free = [d for d in range(len(shape)) if d not in contracting and d not in batch]
  perm = (*batch, *free, *contracting)
  return perm, tuple(shape[d] for d in perm)


def _canonical(x: jax.Array, contracting: Any, batch: Any) -> jax.Array:
  """``x`` as ``(batch, free, contracted)``, each group of axes flattened (in dot_general's order)."""
  perm, moved = _layout(x.shape, contracting, batch)
  nb, nc = len(batch), len(contracting)
  sizes = (moved[:nb], moved[nb : len(moved) - nc], moved[len(moved) - nc :])
  return jnp.transpose(x, perm).reshape(*(math.prod(group) for group in sizes))


def _restore(x: jax.Array, shape: tuple[int, ...], contracting: Any, batch: Any) -> jax.Array:
  """The inverse of :func:`_canonical` for an operand of ``shape``."""
  perm, moved = _layout(shape, contracting, batch)
  return jnp.transpose(x.reshape(moved), tuple(np.argsort(perm)))


def _padded(x: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  pads = [(0, size - n, 0) for n, size in zip(x.shape, sizes, strict=True)]
  if all(p[1] == 0 for p in pads):
    return x
  return jax.lax.pad(x, jnp.zeros((), x.dtype), pads)


def _round_up(n: int, size: int) -> int:
  return -(-n // size) * size


def block_quantize(
  x: jax.Array,
  axis: int,
  *,
  margin: int = 0,
  size: int = BLOCK,
  scale_dtype: Any = E8M0,
) -> tuple[jax.Array, jax.Array]:
  """``x`` in E4M3 with a power-of-two scale per block of ``size`` along ``axis`` (a multiple of ``size`` long).

  Args:
    x: a floating array.
    axis: the blocked axis.
    margin: headroom below E4M3's max, in powers of two.
    size: elements per block (32 for MXFP8, 128 blockwise).
    scale_dtype: the scales' format: E8M0 (MXFP8) or float32.

  Returns:
    ``(q, scale)``: ``q`` E4M3 of ``x``'s shape, ``scale`` in ``scale_dtype`` with
    ``axis`` ``size`` times shorter; ``q * scale`` (per block) approximates ``x``.
  """
  shape = x.shape
  blocks = x.reshape((*shape[:axis], shape[axis] // size, size, *shape[axis + 1 :]))
  # Within E8M0's range, like every scale of tensor_scale ([2**-126, 2**127]).
  scale = tensor_scale(blocks, E4M3, margin=margin, axis=axis + 1)
  q = quantize(blocks, E4M3, scale).reshape(shape)
  return q, jnp.squeeze(scale, axis + 1).astype(scale_dtype)


def tile_quantize(
  x: jax.Array, *, margin: int = 0, size: int = TILE
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(batch, rows, cols)`` ``x`` in E4M3 with one float32 power-of-two scale per ``size x size`` tile.

  DeepSeek-V3's weight layout: a tile's scale holds along both axes, so the
  one quantised array serves the products that contract either axis.

  Args:
    x: a floating array, ``rows`` and ``cols`` multiples of ``size``.
    margin: headroom below E4M3's max, in powers of two.
    size: the tile's side.

  Returns:
    ``(q, along_cols, along_rows)``: ``q`` E4M3 of ``x``'s shape and its
    scales laid out for a product contracting ``cols`` (``(batch, rows,
    cols / size)``) and one contracting ``rows`` (``(batch, rows / size, cols)``).
  """
  batch, rows, cols = x.shape
  tiles = x.reshape(batch, rows // size, size, cols // size, size)
  scale = tensor_scale(tiles, E4M3, margin=margin, axis=(2, 4))
  q = quantize(tiles, E4M3, scale).reshape(x.shape)
  scale = scale[:, :, 0, :, 0]  # (batch, rows / size, cols / size)
  return q, jnp.repeat(scale, size, axis=1), jnp.repeat(scale, size, axis=2)


def _block_scaled_dot(
  a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], dimension_numbers: Any
) -> jax.Array:
  if not (a[0].size and b[0].size):
    # An empty batch (the last step of a sharded epoch): scaled_dot divides by the
    # block count; the plain product of no elements is the same zeros (or nothing).
    return jax.lax.dot_general(a[0], b[0], dimension_numbers, preferred_element_type=jnp.float32)
  return jax.lax.scaled_dot(
    a[0],
    b[0],
    lhs_scale=a[1],
    rhs_scale=b[1],
    dimension_numbers=dimension_numbers,
    preferred_element_type=jnp.float32,
  )


# Products of (batch, rows, cols) arrays: the forward one contracts the last axis of
# both; dgrad contracts g's columns with the rhs's rows; wgrad both arrays' rows.
_FORWARD = (((2,), (2,)), ((0,), (0,)))
_DGRAD = (((2,), (1,)), ((0,), (0,)))
_WGRAD = (((1,), (1,)), ((0,), (0,)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _mx_dot(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  shapes: tuple[tuple[int, ...], tuple[int, ...]],
  lhs: jax.Array,
  rhs: jax.Array,
) -> jax.Array:
  return _mx_dot_fwd(recipe, dimension_numbers, dtypes, shapes, lhs, rhs)[0]


def _mx_dot_fwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  shapes: tuple[tuple[int, ...], tuple[int, ...]],
  lhs: jax.Array,
  rhs: jax.Array,
) -> tuple[jax.Array, Any]:
  del shapes
  (lc, rc), (lb, rb) = dimension_numbers
  a = _canonical(lhs, lc, lb)  # (B, M, K)
  b = _canonical(rhs, rc, rb)  # (B, N, K)
  (batch, m, k), n = a.shape, b.shape[1]
  blocking = _blocking(recipe)
  size = blocking.size
  mp, kp, np_ = _round_up(m, size), _round_up(k, size), _round_up(n, size)
  a, b = _padded(a, (batch, mp, kp)), _padded(b, (batch, np_, kp))
  blocks = functools.partial(
    block_quantize, margin=recipe.margin, size=size, scale_dtype=blocking.scale_dtype
  )
  if blocking.tiled_rhs:  # one quantisation of the weight serves all three products
    b_q, along_k, along_n = tile_quantize(b, margin=recipe.margin, size=size)
    b_cols, b_rows = (b_q, along_k), (b_q, along_n)
  else:
    b_cols, b_rows = blocks(b, 2), blocks(b, 1)
  product = _block_scaled_dot(blocks(a, 2), b_cols, _FORWARD)
  # dot_general's layout, (batch, lhs free, rhs free), is (B, M, N) unflattened.
  out_shape = (
    *(lhs.shape[d] for d in lb),
    *(lhs.shape[d] for d in range(lhs.ndim) if d not in (*lc, *lb)),
    *(rhs.shape[d] for d in range(rhs.ndim) if d not in (*rc, *rb)),
  )
  out = product[:, :m, :n].reshape(out_shape).astype(dtypes[2])
  # Saved for the backward products, blocked along the axes they contract.
  residuals = (blocks(a, 1), b_rows)
  return out, residuals


def _mx_dot_bwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  shapes: tuple[tuple[int, ...], tuple[int, ...]],
  residuals: Any,
  g: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  (lc, rc), (lb, rb) = dimension_numbers
  a_rows, b_rows = residuals
  batch, mp, _ = a_rows[0].shape
  np_ = b_rows[0].shape[1]
  _, lhs_moved = _layout(shapes[0], lc, lb)
  _, rhs_moved = _layout(shapes[1], rc, rb)
  m = math.prod(lhs_moved[len(lb) : len(lhs_moved) - len(lc)])
  n = math.prod(rhs_moved[len(rb) : len(rhs_moved) - len(rc)])
  k = math.prod(lhs_moved[len(lhs_moved) - len(lc) :])
  g3 = _padded(g.reshape(batch, m, n), (batch, mp, np_))
  blocking = _blocking(recipe)
  blocks = functools.partial(
    block_quantize, margin=recipe.margin, size=blocking.size, scale_dtype=blocking.scale_dtype
  )
  ga = _block_scaled_dot(blocks(g3, 2), b_rows, _DGRAD)  # (B, Mp, Kp)
  gb = _block_scaled_dot(blocks(g3, 1), a_rows, _WGRAD)  # (B, Np, Kp)
  ga = _restore(ga[:, :m, :k].astype(dtypes[0]), shapes[0], lc, lb)
  gb = _restore(gb[:, :n, :k].astype(dtypes[1]), shapes[1], rc, rb)
  return ga, gb


_mx_dot.defvjp(_mx_dot_fwd, _mx_dot_bwd)


def mx_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  recipe: Fp8Recipe,
) -> jax.Array:
  """The block-scaled product of :func:`mpx.fp8.fp8_dot_general` (``recipe.block_scaled``: MXFP8, blockwise).

  Args:
    lhs: the left operand.
    rhs: the right operand.
    dimension_numbers: hashable ``dot_general`` dimension numbers.
    dtypes: ``(lhs dtype, rhs dtype, output dtype)``.
    recipe: the recipe (its margin applies to every block).

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.
  """
  shapes = (tuple(lhs.shape), tuple(rhs.shape))
  return _mx_dot(recipe, dimension_numbers, dtypes, shapes, lhs, rhs)
