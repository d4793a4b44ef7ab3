"""Float8 convolutions: E4M3 forward, E5M2 gradients, float32 sums, in the forms XLA:GPU keeps.

The convolution counterpart of :func:`mpx.fp8.fp8_dot_general`, with the same
per-tensor scales, saturation, NaN and delayed-scaling semantics (and the same
three amax histories). What differs is the form each product is written in,
chosen by what XLA:GPU compiles to a float8 kernel for Hopper (checked on the
compiled H100 program, ``tests/ops/test_fp8_conv_target.py``):

* **Forward** (E4M3 x E4M3) and **input gradient** (E5M2 gradient x E5M2
  kernel): a float32 ``conv_general_dilated`` of the dequantised operands,
  ``convert(q) * scale`` for each. XLA's cuDNN fused-convolution rewriter
  matches that pattern on a forward convolution and rewrites it to a cuDNN
  float8 graph convolution (``__cudnn$convForwardGraph``) that takes the
  float8 arrays themselves and applies the scales to its result. So the input
  gradient is written as a *forward* convolution: the gradient, padded with
  float8 zeros, convolved with the flipped kernel.
  (Written as JAX's own transpose, with ``lhs_dilation``, XLA makes it a cuDNN
  backward-input convolution, which the rewriter does not cover, in float32.)
  A strided convolution's input gradient is split into one such convolution
  per phase of the stride (sub-pixel decomposition), so no product meets the
  zeros a dilated gradient would hold.
  The kernel is E5M2 there, rounded from the kernel itself with its own
  E5M2 scale: on an H200 (jax 0.11.2, CUDA 13) cuDNN's graph convolution of
  an E5M2 by an E4M3 operand returned NaN for 1.8 million of 51 million
  outputs, while E4M3 x E4M3 and E5M2 x E5M2 matched float32 (SQNR 28.6 and
  22.6 dB on Gaussian data).
* **Weight gradient** (E4M3 input x E5M2 gradient): one float8 matmul per
  kernel tap, the tap's strided window of the saved input against the
  gradient, contracted over batch and output positions; each is a float8
  ``dot_general`` as in the fp8 dot (a cuBLASLt or Triton float8 GEMM). A
  convolution shaped like a weight gradient is always rewritten by XLA to a
  cuDNN backward-filter convolution, which has no float8 graph form.

On other backends the same programs run with the exact float8 rounding: the
scales are powers of two, so each product is that of ``ml_dtypes``' roundings
of ``x / s``, times the scales, summed in float32.

Covered: any number of spatial axes, any strides, padding and kernel
dilation, any dimension numbers, input and output feature counts that are
multiples of 16. Not covered (run by ``jax.lax.conv_general_dilated`` in the
compute dtype): other feature counts (a 3-channel stem), input dilation
(transposed convolutions), feature or batch groups (depthwise convolutions),
and the rowwise and block-scaled (MXFP8, blockwise) recipes.
Core module: imports neither Flax nor optax.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src.ops import fp8_scaling
from mpx._src.ops.amax_grad import fp8_max_grad
from mpx._src.ops.quantize import (
  E4M3,
  E5M2,
  dequantize,
  partial_amaxes,
  quantize,
  stacked_amaxes,
)
from mpx._src.ops.scaled_dot import scaled_dot
from mpx._src.recipe import Fp8Recipe

Pads = tuple[tuple[int, int], ...]

_CHANNEL_MULTIPLE = 16  # float8 channels per 16-byte vector


def _canonical_dims(n: int) -> jax.lax.ConvDimensionNumbers:
  """``(batch, *spatial, feature)`` inputs and outputs, ``(*spatial, in, out)`` kernels."""
  spatial = tuple(range(1, n + 1))
  return jax.lax.ConvDimensionNumbers(
    lhs_spec=(0, n + 1, *spatial), rhs_spec=(n + 1, n, *range(n)), out_spec=(0, n + 1, *spatial)
  )


def _deq(q: jax.Array, scale: jax.Array) -> jax.Array:
  """``q`` in float32 times its scale: the operand form XLA's cuDNN rewriter folds into a float8 convolution."""
  return q.astype(jnp.float32) * scale.astype(jnp.float32)


def _float8_conv(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  strides: Sequence[int],
  pads: Pads,
  dilation: Sequence[int],
) -> jax.Array:
  """A float32 convolution of two dequantised float8 arrays in the canonical layout."""
  return jax.lax.conv_general_dilated(
    _deq(a, a_scale),
    _deq(b, b_scale),
    tuple(strides),
    pads,
    rhs_dilation=tuple(dilation),
    dimension_numbers=_canonical_dims(a.ndim - 2),
  )


class _Phase(NamedTuple):
  """One spatial axis of one phase of a strided convolution's input gradient.

  The input positions ``h`` with ``(h + pad_low) % stride == first_tap`` take
  the kernel taps ``first_tap, first_tap + stride, ...`` only: a stride-1
  convolution of the gradient (padded by ``gradient_pads``) with those taps
  gives them, ``positions`` of them from ``start`` on, ``stride`` apart.
  """

  first_tap: int
  gradient_pads: tuple[int, int]
  start: int
  positions: int


def _phases(size: int, out: int, kernel: int, stride: int, pad_low: int) -> list[_Phase]:
  phases = []
  for first in range(min(stride, kernel)):
    taps = len(range(first, kernel, stride))
    first_out = -((first - pad_low) // stride)  # the first gradient position it reads, ceil
    start = first - pad_low + stride * first_out
    if start >= size:
      continue
    positions = (size - start + stride - 1) // stride
    low = taps - 1 - first_out
    phases.append(_Phase(first, (low, positions + taps - 1 - out - low), start, positions))
  return phases


def _input_grad(
  gq: jax.Array,
  g_scale: jax.Array,
  wq: jax.Array,
  w_scale: jax.Array,
  in_sizes: Sequence[int],
  strides: Sequence[int],
  pads: Pads,
  dilation: Sequence[int],
) -> jax.Array:
  """The input gradient as forward convolutions of the padded gradient with the flipped kernel.

  With a stride, the sub-pixel decomposition: each phase of the input (its
  positions modulo the stride) is a stride-1 convolution with the kernel taps
  that reach it, so no multiplication meets a zero inserted between gradient
  positions; the phases are interleaved afterwards. A dilated kernel takes
  the direct form instead: the gradient dilated by the stride (float8 zeros
  inserted), one convolution.
  """
  n = gq.ndim - 2
  kernel = wq.shape[:n]
  out_sizes = gq.shape[1:-1]
  axes = list(zip(in_sizes, out_sizes, kernel, strides, pads, dilation, strict=True))

  def conv(g_pads: Sequence[tuple[int, int, int]], taps: tuple[slice, ...]) -> jax.Array:
    # (*spatial, in, out) -> flipped, (*spatial, out, in): the gradient's features are the kernel's outputs.
    w_t = jnp.swapaxes(jnp.flip(wq[taps], tuple(range(n))), -1, -2)
    # Padded with float8 zeros: the operand stays float8 for the cuDNN rewriter.
    g_padded = jax.lax.pad(gq, jnp.zeros((), gq.dtype), [(0, 0, 0), *g_pads, (0, 0, 0)])
    return _float8_conv(g_padded, g_scale, w_t, w_scale, (1,) * n, ((0, 0),) * n, dilation)

  if any(d != 1 for d in dilation):
    g_pads = [
      ((k - 1) * d - lo, size - 1 - (o - 1) * s + lo, s - 1) for size, o, k, s, (lo, _), d in axes
    ]
    return conv(g_pads, (slice(None),) * n)
  dx = jnp.zeros((gq.shape[0], *in_sizes, wq.shape[-2]), jnp.float32)
  per_axis = [_phases(size, o, k, s, lo) for size, o, k, s, (lo, _), _ in axes]
  for phase in itertools.product(*per_axis):
    taps = tuple(slice(p.first_tap, None, s) for p, s in zip(phase, strides, strict=True))
    part = conv([(p.gradient_pads[0], p.gradient_pads[1], 0) for p in phase], taps)
    spread = [
      (p.start, size - p.start - (p.positions - 1) * s - 1, s - 1)
      for p, size, s in zip(phase, in_sizes, strides, strict=True)
    ]
    dx = dx + jax.lax.pad(part, jnp.float32(0), [(0, 0, 0), *spread, (0, 0, 0)])
  return dx


def _weight_grad(
  xq: jax.Array,
  x_scale: jax.Array,
  gq: jax.Array,
  g_scale: jax.Array,
  kernel: Sequence[int],
  strides: Sequence[int],
  pads: Pads,
  dilation: Sequence[int],
) -> jax.Array:
  """The weight gradient, one float8 matmul per kernel tap: float32 ``(*kernel, in, out)``."""
  n = xq.ndim - 2
  out_sizes = gq.shape[1:-1]
  x_padded = jax.lax.pad(
    xq, jnp.zeros((), xq.dtype), [(0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)]
  )
  contract = tuple(range(n + 1))  # batch and positions
  dims = ((contract, contract), ((), ()))
  taps = []
  for tap in np.ndindex(*kernel):
    start = [0, *(t * d for t, d in zip(tap, dilation, strict=True)), 0]
    limit = [
      xq.shape[0],
      *(b + (o - 1) * s + 1 for b, o, s in zip(start[1:-1], out_sizes, strides, strict=True)),
      xq.shape[-1],
    ]
    window = jax.lax.slice(x_padded, start, limit, (1, *strides, 1))
    taps.append(scaled_dot(window, x_scale, gq, g_scale, dims, None, np.dtype(np.float32)))
  return jnp.stack(taps).reshape(*kernel, *taps[0].shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _fp8_conv(
  recipe: Fp8Recipe,
  strides: tuple[int, ...],
  pads: Pads,
  dilation: tuple[int, ...],
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  x: jax.Array,
  w: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> jax.Array:
  return _fp8_conv_fwd(recipe, strides, pads, dilation, dtypes, x, w, states)[0]


def _fp8_conv_fwd(
  recipe: Fp8Recipe,
  strides: tuple[int, ...],
  pads: Pads,
  dilation: tuple[int, ...],
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  x: jax.Array,
  w: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> tuple[jax.Array, Any]:
  histories = None if states is None else states[:2]
  (x_scale, w_scale), amaxes = fp8_scaling.operand_scales(recipe, histories, (x, w), E4M3)
  xq, wq = quantize(x, E4M3, x_scale), quantize(w, E4M3, w_scale)
  out = _float8_conv(xq, x_scale, wq, w_scale, strides, pads, dilation).astype(dtypes[2])
  # cuDNN's float8 convolution writes float32; materialise the rounded output here, or XLA
  # fuses the rounding into every reader, the backward pass's too, and keeps the float32
  # buffer alive until then (twice the bytes of a bfloat16 output, per layer).
  out = jax.lax.optimization_barrier(out)
  kernel_history = None if states is None else states[1:2]
  # The input gradient multiplies the kernel in E5M2, like the gradient (see the module
  # docstring); the kernel is small, so it is rounded a second time, from itself.
  (w5_scale,), _ = fp8_scaling.operand_scales(recipe, kernel_history, [w], E5M2)
  w5 = quantize(w, E5M2, w5_scale)
  g_scale = None if states is None else fp8_scaling.history_scales([states[2]], [E5M2], recipe)[0]
  # The float8 operands are the residuals, as for the dot: the backward products take them as they are.
  return out, (xq, wq, x_scale, w_scale, w5, w5_scale, g_scale, amaxes, states)


def _fp8_conv_bwd(
  recipe: Fp8Recipe,
  strides: tuple[int, ...],
  pads: Pads,
  dilation: tuple[int, ...],
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  residuals: Any,
  g: jax.Array,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
  xq, wq, x_scale, w_scale, w5, w5_scale, g_scale, amaxes, states = residuals
  n = xq.ndim - 2
  if states is None:
    (g_scale,), _ = fp8_scaling.operand_scales(recipe, None, [g], E5M2)
  gq = quantize(g, E5M2, g_scale)
  dx = _input_grad(gq, g_scale, w5, w5_scale, xq.shape[1:-1], strides, pads, dilation)
  dw = _weight_grad(xq, x_scale, gq, g_scale, wq.shape[:n], strides, pads, dilation)
  if recipe.keep_backward != "none":
    # A kept product: the saved operands, dequantised, times the unquantised gradient.
    def conv(a: jax.Array, b: jax.Array) -> jax.Array:
      return jax.lax.conv_general_dilated(
        a, b, strides, pads, rhs_dilation=dilation, dimension_numbers=_canonical_dims(n)
      )

    a, b = dequantize(xq, x_scale, dtypes[0]), dequantize(wq, w_scale, dtypes[1])
    product, pullback = jax.vjp(conv, a, b)
    kept_dx, dw = pullback(g.astype(product.dtype))
    dx = dx if recipe.keep_backward == "weight_grad" else kept_dx
  dx, dw = dx.astype(dtypes[0]), dw.astype(dtypes[1])
  if states is None:
    return dx, dw, None
  # The three amaxes' second stage in one reduction (the operands' first, from the forward).
  seen = stacked_amaxes([*amaxes, partial_amaxes(g)], recipe.axis_name)
  return dx, dw, tuple(fp8_scaling.observed(h, v) for h, v in zip(states, list(seen), strict=True))


_fp8_conv.defvjp(_fp8_conv_fwd, _fp8_conv_bwd)


def covers(
  *,
  lhs_dilation: Sequence[int] | None = None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  recipe: Fp8Recipe | None = None,
  features: tuple[int, int] | None = None,
) -> bool:
  """Whether :func:`fp8_conv_general_dilated` runs a convolution with these settings in float8.

  Args:
    lhs_dilation: the input dilation (transposed convolutions have one).
    feature_group_count: feature groups (depthwise convolutions have many).
    batch_group_count: batch groups.
    recipe: the float8 recipe; ``None`` means current scaling.
    features: ``(input features, output features)``, if known.

  Returns:
    ``False`` for input dilation, groups, the rowwise and block-scaled recipes, and
    feature counts that are not multiples of 16 (a 3-channel stem, say): XLA
    hands those to cuDNN's float8 convolution unpadded, and float8 Tensor
    Core kernels read channels in 16-byte vectors.
  """
  recipe = Fp8Recipe() if recipe is None else recipe
  return (
    all(d == 1 for d in (lhs_dilation or ()))
    and feature_group_count == 1
    and batch_group_count == 1
    and not (recipe.rowwise or recipe.block_scaled)
    and (features is None or all(f % _CHANNEL_MULTIPLE == 0 for f in features))
  )


def fp8_conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  window_strides: Sequence[int],
  padding: str | Sequence[tuple[int, int]],
  lhs_dilation: Sequence[int] | None = None,
  rhs_dilation: Sequence[int] | None = None,
  dimension_numbers: Any = None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  precision: Any = None,
  preferred_element_type: Any = None,
  *,
  recipe: Fp8Recipe | None = None,
  state: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  **unused: Any,
) -> jax.Array:
  """``jax.lax.conv_general_dilated`` with float8 operands: E4M3 forward, E5M2 gradients, float32 sums.

  The input and the kernel are quantised to E4M3 with per-tensor scales (the
  recipe's, as for :func:`mpx.fp8.fp8_dot_general`), convolved with float32
  accumulation, multiplied by the two scales and rounded once to the output
  dtype. In the backward pass the incoming gradient is quantised to E5M2; the
  input gradient is its float8 convolution with the kernel (rounded to E5M2
  in the forward pass), the weight gradient one float8 matmul per kernel tap
  of the saved E4M3 input with it.
  Compiled for an H100 (or another GPU from Ada on, with cuDNN 9.8+), XLA
  runs the forward and input-gradient convolutions as cuDNN float8
  convolutions and the weight gradient as float8 GEMMs; elsewhere the same
  float8-rounded products are computed in float32. See the module docstring
  for the forms and ``docs/guide/fp8.md`` for what the compiled program shows.

  Usable as a Flax ``Conv``'s ``conv_general_dilated`` (``functools.partial``
  with a recipe); :func:`mpx.linen.apply_policy` and :func:`mpx.nnx.apply_policy`
  install it for policies with a per-tensor ``fp8`` recipe. Convolutions it
  does not cover (:func:`covers`: feature counts not multiples of 16, input
  dilation, groups) run as ``jax.lax.conv_general_dilated`` in the compute
  dtype.

  Args:
    lhs: the input.
    rhs: the kernel.
    window_strides: as for ``jax.lax.conv_general_dilated``.
    padding: as for ``jax.lax.conv_general_dilated``.
    lhs_dilation: as for ``jax.lax.conv_general_dilated``.
    rhs_dilation: as for ``jax.lax.conv_general_dilated``.
    dimension_numbers: as for ``jax.lax.conv_general_dilated``.
    feature_group_count: as for ``jax.lax.conv_general_dilated``.
    batch_group_count: as for ``jax.lax.conv_general_dilated``.
    precision: as for ``jax.lax.conv_general_dilated`` (float8 products ignore it).
    preferred_element_type: the output dtype; ``None`` means ``lhs.dtype``.
    recipe: the scaling recipe (current or delayed); ``None`` means current scaling.
    state: for delayed scaling, the amax histories of ``(lhs, rhs,
      gradient)``, as for :func:`mpx.fp8.fp8_dot_general`.
    **unused: other arguments Flax passes (``out_sharding``), ignored.

  Returns:
    The convolution, shaped as ``jax.lax.conv_general_dilated``'s.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  del unused
  recipe = fp8_scaling.checked_recipe(recipe, state)
  dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  features = (rhs.shape[dn.rhs_spec[1]], rhs.shape[dn.rhs_spec[0]])
  if not covers(
    lhs_dilation=lhs_dilation,
    feature_group_count=feature_group_count,
    batch_group_count=batch_group_count,
    recipe=recipe,
    features=features,
  ):
    return jax.lax.conv_general_dilated(
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation,
      rhs_dilation,
      dimension_numbers,
      feature_group_count,
      batch_group_count,
      precision,
      preferred_element_type,
    )
  n = lhs.ndim - 2
  lhs_perm = (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])
  rhs_perm = (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])
  out_perm = (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1])
  x, w = jnp.transpose(lhs, lhs_perm), jnp.transpose(rhs, rhs_perm)
  strides = tuple(int(s) for s in window_strides)
  dilation = tuple(int(d) for d in (rhs_dilation or (1,) * n))
  kernel = w.shape[:n]
  if isinstance(padding, str):
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel, dilation, strict=True)]
    padding = jax.lax.padtype_to_pads(x.shape[1:-1], dilated, strides, padding)
  pads = tuple((int(lo), int(hi)) for lo, hi in padding)
  out_dtype = np.dtype(preferred_element_type or lhs.dtype)
  dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
  if state is not None:
    state = tuple(fp8_max_grad(tuple(state)))
  out = cast(jax.Array, _fp8_conv(recipe, strides, pads, dilation, dtypes, x, w, state))
  return jnp.transpose(out, [int(axis) for axis in np.argsort(out_perm)])
