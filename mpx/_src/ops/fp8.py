"""Float8 matmuls: quantisation, the float8 dot, and the amax-history state.

Micikevicius et al., *FP8 Formats for Deep Learning* (2022): E4M3 (max 448)
for the forward operands, E5M2 (max 57,344) for the gradients, each tensor
multiplied by a per-tensor scale that moves its largest magnitude (amax) to
the top of the format, products accumulated in float32.

The dot hands the float8 operands themselves to ``dot_general`` (divide by the
scale, clamp to the format's max, cast to float8), asks for a float32 result
and multiplies it by the two scales: XLA:GPU compiles that to a float8 GEMM
(Triton or cuBLASLt) with the scaling in its epilogue, forward and backward.
(The quantise-dequantise form, a ``dot_general`` of ``convert(float8) *
scale`` operands, compiles to a bfloat16 GEMM for an H100 under XLA's default
flags: XLA erases the round trip.) On other backends the same program runs
with the exact float8 rounding. Scales are powers of two, so dividing and
multiplying by them is exact: the product is exactly that of ``ml_dtypes``'
roundings of ``x / s``, times the scales.

Delayed scaling keeps, per tensor, one float32 array of ``history_length + 1``
entries: ``[pending, most recent, ..., oldest]``. The forward pass reads the
committed part to choose the scale (or, while nothing is committed, the
tensor's own amax); the amax each call observes comes back as the *gradient*
of the pending slot, combined over the calls that share a history by ``max``
(:func:`fp8_max_grad`), and :func:`update_fp8_state` folds it in (a running
max over micro-batches) and, at an accumulation boundary not skipped by the
loss scale, commits it to the history. Core module: imports neither Flax nor
optax.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src.ops import mx
from mpx._src.ops.amax_grad import as_float32, fp8_max_grad
from mpx._src.ops.quantize import (
  E4M3,
  E5M2,
  amax,
  dequantize,
  fp8_max,
  quantize,
  scale_dtype,
  scale_for,
)
from mpx._src.recipe import Fp8Recipe


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


def _history_scale(history: jax.Array, dtype: Any, recipe: Fp8Recipe) -> jax.Array:
  """The delayed scale from ``[pending, most recent, ..., oldest]`` (1 while it is empty).

  It depends on the history alone, never on the tensor being quantised, so the
  quantisation need not wait for that tensor's amax (XLA can compute the amax
  in the same pass that quantises).
  """
  committed = as_float32(history)[..., 1:]
  reference = jnp.max(committed, axis=-1) if recipe.reduction == "max" else committed[..., 0]
  return scale_for(reference, dtype, margin=recipe.margin)


def _observed(history: jax.Array, value: jax.Array) -> jax.Array:
  """The cotangent of a history: ``value`` in the pending slot, zeros elsewhere."""
  cotangent = jnp.zeros(history.shape, jnp.float32).at[..., 0].set(value.astype(jnp.float32))
  return jax.lax.convert_element_type(cotangent, history.dtype)


def _scales(
  recipe: Fp8Recipe,
  states: Sequence[jax.Array] | None,
  tensors: Sequence[jax.Array],
  amaxes: Sequence[jax.Array],
  dtype: Any,
) -> list[jax.Array]:
  if states is None:
    return [scale_for(a, dtype, margin=recipe.margin) for a in amaxes]
  return [_delayed_scale(h, x, dtype, recipe) for h, x in zip(states, tensors, strict=True)]


def _delayed_scale(history: jax.Array, x: jax.Array, dtype: Any, recipe: Fp8Recipe) -> jax.Array:
  """The scale from the history; from ``x``'s own amax while nothing is recorded (the first step).

  A ``cond``, not a select: once the history holds an amax, quantising ``x``
  does not wait for ``x``'s amax, which is the point of delayed scaling. The
  bootstrap branch measures it itself for the same reason.
  """
  recorded = jnp.max(as_float32(history)[..., 1:]) > 0
  return jax.lax.cond(
    recorded,
    lambda: _history_scale(history, dtype, recipe),
    lambda: scale_for(amax(x, recipe.axis_name), dtype, margin=recipe.margin),
  )


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
  used = {d for dims in taken for d in dims}
  return [d for d in range(ndim) if d not in used]


def _transposed_products(
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


def _rowwise(x: jax.Array, dtype: Any, contracting: Sequence[int], recipe: Fp8Recipe):
  """``x`` quantised with one scale per index of its other axes: the amax over ``contracting``.

  Returns:
    ``(q, scale)``, the scale float32 of ``x``'s rank with size 1 on the
    contracting axes.
  """
  value = jnp.max(jnp.abs(x), axis=tuple(contracting), keepdims=True).astype(jnp.float32)
  if recipe.axis_name is not None:
    value = jax.lax.pmax(value, recipe.axis_name)
  scale = scale_for(value, dtype, margin=recipe.margin)
  return quantize(x, dtype, scale), scale


def _in_output_layout(
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


def _scaled_dot(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  dimension_numbers: Any,
  precision: Any,
  dtype: np.dtype,
) -> jax.Array:
  """``dot_general`` of two float8 arrays in float32, times their scales, in ``dtype``.

  The float8 operands themselves reach ``dot_general``, which XLA:GPU compiles
  to a float8 GEMM (Triton or cuBLASLt) accumulating in float32; the scales
  (per tensor, or per row of each operand: constant along the contraction)
  apply to its float32 result, in the GEMM's epilogue. (A dot of dequantised
  operands is a bfloat16 GEMM there: XLA erases the round trip through
  float8.)
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
    _in_output_layout(a_scale, a.ndim, ac, ab, 0, b_free),
    _in_output_layout(b_scale, b.ndim, bc, bb, a_free, 0),
  )
  return _rescaled(product, scales, dtype)


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
  if recipe.rowwise:
    (lhs_q, lhs_scale), (rhs_q, rhs_scale) = (
      _rowwise(lhs, E4M3, lc, recipe),
      _rowwise(rhs, E4M3, rc, recipe),
    )
    amaxes = None
  else:
    amaxes = [amax(lhs, recipe.axis_name), amax(rhs, recipe.axis_name)]
    histories = None if states is None else states[:2]
    lhs_scale, rhs_scale = _scales(recipe, histories, (lhs, rhs), amaxes, E4M3)
    lhs_q, rhs_q = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
  out = _scaled_dot(lhs_q, lhs_scale, rhs_q, rhs_scale, dimension_numbers, precision, out_dtype)
  # The float8 operands are the residuals: a quarter of float32's bytes, and the
  # backward products take them as they are.
  residuals = (lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, states)
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
  lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, states = residuals
  lhs_dims, lhs_perm, rhs_dims, rhs_perm = _transposed_products(
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
    rhs_in_g = _in_output_layout(rhs_scale, rhs_q.ndim, rc, rb, lhs_free, 0).astype(wide)
    g_a, g_a_scale = _rowwise(g * rhs_in_g, E4M3, g_over_rhs_free, recipe)
    ga = _scaled_dot(g_a, g_a_scale, rhs_q, one, lhs_dims, precision, lhs_dtype)
    lhs_in_g = _in_output_layout(lhs_scale, lhs_q.ndim, lc, lb, 0, rhs_free).astype(wide)
    g_b, g_b_scale = _rowwise(g * lhs_in_g, E4M3, g_over_lhs_free, recipe)
    gb = _scaled_dot(lhs_q, one, g_b, g_b_scale, rhs_dims, precision, rhs_dtype)
    ga, gb = _kept(
      recipe, residuals, dtypes, dimension_numbers, precision, g, ga, gb, lhs_perm, rhs_perm
    )
    return ga, gb, None
  g_amax = amax(g, recipe.axis_name)
  histories = None if states is None else states[2:]
  (g_scale,) = _scales(recipe, histories, [g], [g_amax], E5M2)
  g_q = quantize(g, E5M2, g_scale)
  ga = _scaled_dot(g_q, g_scale, rhs_q, rhs_scale, lhs_dims, precision, lhs_dtype)
  gb = _scaled_dot(lhs_q, lhs_scale, g_q, g_scale, rhs_dims, precision, rhs_dtype)
  ga, gb = _kept(
    recipe, residuals, dtypes, dimension_numbers, precision, g, ga, gb, lhs_perm, rhs_perm
  )
  if states is None:
    return ga, gb, None
  observed = [*amaxes, g_amax]
  return ga, gb, tuple(_observed(h, v) for h, v in zip(states, observed, strict=True))


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


def checked_recipe(recipe: Fp8Recipe | None, state: Any) -> Fp8Recipe:
  """``recipe`` (current scaling if ``None``), checked against the state passed with it.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  recipe = Fp8Recipe() if recipe is None else recipe
  if recipe.delayed != (state is not None):
    raise errors.ConfigError(
      f"The fp8 recipe {recipe} {'needs' if recipe.delayed else 'takes no'} amax history "
      "state; pass state=(lhs, rhs, grad) histories with delayed scaling only (apply_policy "
      "does this for you)."
    )
  return recipe


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
      :func:`update_fp8_state`), or already passed through
      :func:`fp8_max_grad`; their gradient is the amax each tensor had.
    **unused: other arguments Flax passes (``out_sharding``), ignored.

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  del unused
  recipe = checked_recipe(recipe, state)
  out_dtype = np.dtype(preferred_element_type or lhs.dtype)
  (lc, rc), (lb, rb) = dimension_numbers
  dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))  # hashable: a static argument
  dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
  if recipe.block_scaled:
    return mx.mx_dot_general(lhs, rhs, dims, dtypes, recipe)
  if state is not None:
    state = tuple(fp8_max_grad(tuple(state)))
  return _fp8_dot(recipe, dims, precision, dtypes, lhs, rhs, state)


def init_history(recipe: Fp8Recipe, *, batch_shape: Sequence[int] = ()) -> jax.Array:
  """An empty amax history: ``float32[*batch_shape, history_length + 1]`` of zeros.

  Args:
    recipe: a delayed-scaling recipe.
    batch_shape: leading axes, one history per entry (e.g. ``(layers,)`` for
      the histories of layers stacked by ``nn.scan`` or ``nnx.vmap``).

  Returns:
    The zero history.
  """
  return jnp.zeros((*batch_shape, recipe.history_length + 1), jnp.float32)
