"""Float8 matmuls: the float8 ``dot_general`` and its custom VJP, with per-tensor and per-row scales.

Micikevicius et al., *FP8 Formats for Deep Learning* (2022): E4M3 (max 448)
for the forward operands, E5M2 (max 57,344) for the gradients, each tensor
multiplied by a per-tensor scale that moves its largest magnitude (amax) to
the top of the format, products accumulated in float32.

The dot hands the float8 operands themselves to ``dot_general``
(:func:`mpx._src.ops.scaled_dot.scaled_dot`), asks for a float32 result and
multiplies it by the two scales: XLA:GPU compiles that to a float8 GEMM
(Triton or cuBLASLt) with the scaling in its epilogue, forward and backward.
On other backends the same program runs with the exact float8 rounding.
Scales are powers of two, so dividing and multiplying by them is exact: the
product is exactly that of ``ml_dtypes``' roundings of ``x / s``, times the
scales. The scales and the delayed-scaling state are in
:mod:`mpx._src.ops.fp8_scaling`; the block-scaled recipes in
:mod:`mpx._src.ops.mx`. Core module: imports neither Flax nor optax.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src.ops import fp8_scaling, mx
from mpx._src.ops.amax_grad import fp8_max_grad
from mpx._src.ops.quantize import (
  E4M3,
  E5M2,
  dequantize,
  partial_amaxes,
  quantize,
  scale_dtype,
  stacked_amaxes,
  tensor_scale,
)
from mpx._src.ops.scaled_dot import in_output_layout, scaled_dot, transposed_products
from mpx._src.recipe import Fp8Recipe


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_dot(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  lhs: jax.Array,
  rhs: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> jax.Array:
  return _fp8_dot_fwd(recipe, dimension_numbers, precision, dtypes, lhs, rhs, states)[0]


def _rowwise(x: jax.Array, dtype: Any, contracting: Sequence[int], recipe: Fp8Recipe):
  """``x`` quantised with one scale per index of its other axes: the scale over ``contracting``.

  Returns:
    ``(q, scale)``, the scale float32 of ``x``'s rank with size 1 on the
    contracting axes.
  """
  scale = tensor_scale(
    x, dtype, margin=recipe.margin, axis=tuple(contracting), axis_name=recipe.axis_name
  )
  return quantize(x, dtype, scale), scale


def _fp8_dot_fwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  lhs: jax.Array,
  rhs: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> tuple[jax.Array, Any]:
  out_dtype = dtypes[2]
  (lc, rc), _ = dimension_numbers
  amaxes, g_scale = None, None
  if recipe.rowwise:
    (lhs_q, lhs_scale), (rhs_q, rhs_scale) = (
      _rowwise(lhs, E4M3, lc, recipe),
      _rowwise(rhs, E4M3, rc, recipe),
    )
  else:
    histories, g_history = (None, None) if states is None else (states[:2], states[2])
    # The gradient's delayed scale, read here with the other two: one small kernel per
    # layer rather than one per history.
    scales, amaxes = fp8_scaling.operand_scales(
      recipe, histories, (lhs, rhs), E4M3, gradient_history=g_history
    )
    lhs_scale, rhs_scale, *g_scales = scales
    g_scale = g_scales[0] if g_scales else None
    lhs_q, rhs_q = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
  out = scaled_dot(lhs_q, lhs_scale, rhs_q, rhs_scale, dimension_numbers, precision, out_dtype)
  # The float8 operands are the residuals: a quarter of float32's bytes, and the
  # backward products take them as they are.
  residuals = (lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, g_scale, states)
  return out, residuals


def _fp8_dot_bwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  residuals: Any,
  g: jax.Array,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
  lhs_dtype, rhs_dtype, _ = dtypes
  lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, g_scale, states = residuals
  lhs_dims, lhs_perm, rhs_dims, rhs_perm = transposed_products(
    dimension_numbers, lhs_q.ndim, rhs_q.ndim
  )
  if recipe.rowwise:
    # Each backward product contracts an axis along which one saved operand's
    # scales vary (the rhs's over its free axes, the lhs's over its rows). Those
    # scales are powers of two: fold them into the gradient (exact in float32),
    # which is then quantised once per product, per row along the axes that
    # product keeps, and the saved float8 operands are used as they are.
    (g_over_rhs_free, _), _ = lhs_dims
    (_, g_over_lhs_free), _ = rhs_dims
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_free = lhs_q.ndim - len(lc) - len(lb)
    rhs_free = rhs_q.ndim - len(rc) - len(rb)
    # In g's own dtype (float32 for float16, whose range a scale may leave):
    # a power-of-two product is exact there, and a bfloat16 g is not widened.
    wide = scale_dtype(g.dtype)
    g = g.astype(wide)
    one = jnp.float32(1.0)
    # E4M3 for the gradient too (torchao's rowwise, DeepSeek-V3's tiles): with a
    # scale per row its range is the row's, and E4M3 has one more mantissa bit.
    rhs_in_g = in_output_layout(rhs_scale, rhs_q.ndim, rc, rb, lhs_free, 0).astype(wide)
    g_a, g_a_scale = _rowwise(g * rhs_in_g, E4M3, g_over_rhs_free, recipe)
    ga = scaled_dot(g_a, g_a_scale, rhs_q, one, lhs_dims, precision, lhs_dtype)
    lhs_in_g = in_output_layout(lhs_scale, lhs_q.ndim, lc, lb, 0, rhs_free).astype(wide)
    g_b, g_b_scale = _rowwise(g * lhs_in_g, E4M3, g_over_lhs_free, recipe)
    gb = scaled_dot(lhs_q, one, g_b, g_b_scale, rhs_dims, precision, rhs_dtype)
    ga, gb = _kept(
      recipe, residuals, dtypes, dimension_numbers, precision, g, ga, gb, lhs_perm, rhs_perm
    )
    return ga, gb, None
  if states is None:
    (g_scale,), _ = fp8_scaling.operand_scales(recipe, None, [g], E5M2)
  g_q = quantize(g, E5M2, g_scale)
  ga = scaled_dot(g_q, g_scale, rhs_q, rhs_scale, lhs_dims, precision, lhs_dtype)
  gb = scaled_dot(lhs_q, lhs_scale, g_q, g_scale, rhs_dims, precision, rhs_dtype)
  ga, gb = _kept(
    recipe, residuals, dtypes, dimension_numbers, precision, g, ga, gb, lhs_perm, rhs_perm
  )
  if states is None:
    return ga, gb, None
  # The three amaxes' second stage in one reduction (the operands' first, from the forward).
  seen = stacked_amaxes([*amaxes, partial_amaxes(g)], recipe.axis_name)
  return ga, gb, tuple(fp8_scaling.observed(h, v) for h, v in zip(states, list(seen), strict=True))


def _kept(
  recipe: Fp8Recipe,
  residuals: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  dimension_numbers: Any,
  precision: Any,
  g: jax.Array,
  ga: jax.Array,
  gb: jax.Array,
  lhs_perm: tuple[int, ...],
  rhs_perm: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
  """The two gradients (float8 products ``ga``, ``gb`` laid out as products), with those the recipe keeps in the compute dtype.

  A kept product multiplies the dequantised saved operands (their float8
  values, exact in the compute dtype) by the unquantised gradient, as the
  layer would without float8; XLA drops the float8 product it replaces.
  """
  ga, gb = jnp.transpose(ga, lhs_perm), jnp.transpose(gb, rhs_perm)
  if recipe.keep_backward == "none":
    return ga, gb
  lhs_q, rhs_q, lhs_scale, rhs_scale = residuals[:4]
  a, b = dequantize(lhs_q, lhs_scale, dtypes[0]), dequantize(rhs_q, rhs_scale, dtypes[1])
  product, pullback = jax.vjp(
    lambda a, b: jax.lax.dot_general(a, b, dimension_numbers, precision=precision), a, b
  )
  kept_ga, kept_gb = pullback(g.astype(product.dtype))
  return (ga if recipe.keep_backward == "weight_grad" else kept_ga), kept_gb


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  precision: Any = None,
  preferred_element_type: Any = None,
  *,
  recipe: Fp8Recipe | None = None,
  state: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  **unused: Any,
) -> jax.Array:
  """``jax.lax.dot_general`` with float8 operands: E4M3 forward, E5M2 gradients, float32 sums.

  Both operands are quantised to E4M3 with per-tensor scales and multiplied
  as float8 arrays, the product accumulated in float32, multiplied by the two
  scales and rounded once to the output dtype. In the backward pass the
  incoming gradient is quantised to E5M2 the same way and both backward
  products (E5M2 x E4M3) take the saved E4M3 operands. XLA:GPU compiles each
  of the three to a float8 GEMM on Hopper, Ada and Blackwell GPUs (checked on
  the compiled H100 program by :func:`mpx.audit` with ``target="h100"``);
  elsewhere the same float8-rounded products are computed in float32.

  Usable as a Flax layer's ``dot_general`` (``functools.partial`` with a
  recipe); :func:`mpx.linen.apply_policy` and :func:`mpx.nnx.apply_policy`
  install it for policies with an ``fp8`` recipe.

  Args:
    lhs: the left operand (the activations of a layer).
    rhs: the right operand (the kernel).
    dimension_numbers: as for ``jax.lax.dot_general``.
    precision: as for ``jax.lax.dot_general``.
    preferred_element_type: the output dtype; ``None`` means ``lhs.dtype``.
    recipe: the scaling recipe; ``None`` means current scaling.
    state: for delayed scaling, the amax histories of ``(lhs, rhs,
      gradient)``, each ``float32[history_length + 1]`` (see
      :func:`mpx.fp8.update_fp8_state`), or already passed through
      :func:`mpx.fp8.fp8_max_grad`; their gradient is the amax each tensor had.
    **unused: other arguments Flax passes (``out_sharding``), ignored.

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  del unused
  recipe = fp8_scaling.checked_recipe(recipe, state)
  out_dtype = np.dtype(preferred_element_type or lhs.dtype)
  (lc, rc), (lb, rb) = dimension_numbers
  dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))  # hashable: a static argument
  dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
  if recipe.block_scaled:
    return mx.mx_dot_general(lhs, rhs, dims, dtypes, recipe)
  if state is not None:
    state = tuple(fp8_max_grad(tuple(state)))
  return _fp8_dot(recipe, dims, precision, dtypes, lhs, rhs, state)
