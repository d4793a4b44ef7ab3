"""MXFP8 matmuls: E4M3 values with one power-of-two (E8M0) scale per block of 32 along the contraction.

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
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src.ops.quantize import E4M3, quantize, scale_for
from mpx._src.recipe import Fp8Recipe

BLOCK = 32
"""Elements per scale, along the contracted axis."""

E8M0 = np.dtype(jnp.float8_e8m0fnu)
_SMALLEST_E8M0 = 2.0**-127


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


def _round_up(n: int) -> int:
  return -(-n // BLOCK) * BLOCK


def block_quantize(x: jax.Array, axis: int, *, margin: int = 0) -> tuple[jax.Array, jax.Array]:
  """``x`` in E4M3 with an E8M0 scale per block of 32 along ``axis`` (a multiple of 32 long).

  Args:
    x: a floating array.
    axis: the blocked axis.
    margin: headroom below E4M3's max, in powers of two.

  Returns:
    ``(q, scale)``: ``q`` E4M3 of ``x``'s shape, ``scale`` E8M0 with
    ``axis`` 32 times shorter; ``q * scale`` (per block) approximates ``x``.
  """
  shape = x.shape
  blocks = x.reshape((*shape[:axis], shape[axis] // BLOCK, BLOCK, *shape[axis + 1 :]))
  value = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True).astype(jnp.float32)
  scale = jnp.maximum(scale_for(value, E4M3, margin=margin), jnp.float32(_SMALLEST_E8M0))
  q = quantize(blocks, E4M3, scale).reshape(shape)
  return q, jnp.squeeze(scale, axis + 1).astype(E8M0)


def _block_scaled_dot(
  a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], dimension_numbers: Any
) -> jax.Array:
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
  mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
  a, b = _padded(a, (batch, mp, kp)), _padded(b, (batch, np_, kp))
  margin = recipe.margin
  product = _block_scaled_dot(
    block_quantize(a, 2, margin=margin), block_quantize(b, 2, margin=margin), _FORWARD
  )
  # dot_general's layout, (batch, lhs free, rhs free), is (B, M, N) unflattened.
  out_shape = (
    *(lhs.shape[d] for d in lb),
    *(lhs.shape[d] for d in range(lhs.ndim) if d not in (*lc, *lb)),
    *(rhs.shape[d] for d in range(rhs.ndim) if d not in (*rc, *rb)),
  )
  out = product[:, :m, :n].reshape(out_shape).astype(dtypes[2])
  # Saved for the backward products, blocked along the axes they contract.
  residuals = (block_quantize(a, 1, margin=margin), block_quantize(b, 1, margin=margin))
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
  margin = recipe.margin
  ga = _block_scaled_dot(block_quantize(g3, 2, margin=margin), b_rows, _DGRAD)  # (B, Mp, Kp)
  gb = _block_scaled_dot(block_quantize(g3, 1, margin=margin), a_rows, _WGRAD)  # (B, Np, Kp)
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
  """The MXFP8 product of :func:`mpx.fp8.fp8_dot_general` (``recipe.scaling == "mxfp8"``).

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
