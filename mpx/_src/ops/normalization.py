"""Normalisation computed in float32 that saves only its half-precision input for the backward pass.

A normalisation layer kept in float32 inside a half-precision model (paper
section 3: statistics are reductions) casts its input to float32 and, under
plain autodiff, saves float32 copies of whole activations for the backward pass
(the centred input, its product with the inverse deviation, the squares):
three to four float32 arrays per layer where the matmuls around it save one
half-precision array. The functions here compute exactly what Flax's
``LayerNorm``, ``RMSNorm`` and ``BatchNorm`` compute, in float32, but with a
custom VJP whose residuals are the input in its own (half) dtype and the
float32 per-row statistics; the backward pass recomputes the normalised input
from them in float32 (one fused elementwise pass) and applies the closed-form
gradient:

.. math::

  \\hat x = (x - \\mu)\\,r,\\quad r = (\\sigma^2 + \\epsilon)^{-1/2},\\quad
  y = \\gamma \\hat x + \\beta

  \\partial x = r\\,(g' - \\overline{g'} - \\hat x\\,\\overline{g'\\hat x}),
  \\quad g' = \\gamma\\,\\partial y

where bars are means over the reduction axes (without the middle term for
RMSNorm, whose :math:`\\mu` is 0). Flax-free: the adapters pass the params in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from mpx._src.dtypes import F32


@dataclasses.dataclass(frozen=True)
class _Config:
  """The static part of one normalisation (a ``nondiff_argnums`` argument, hence hashable)."""

  reduction_axes: tuple[int, ...]
  feature_axes: tuple[int, ...]
  epsilon: float
  subtract_mean: bool
  fast_variance: bool
  dtype: np.dtype


def canonical_axes(ndim: int, axes: Any) -> tuple[int, ...]:
  """Returns ``axes`` (an int or a sequence, negative allowed) as sorted non-negative ints.

  Args:
    ndim: the rank of the array.
    axes: an axis or a sequence of axes.

  Returns:
    The sorted, deduplicated axes in ``[0, ndim)``.
  """
  axes = axes if isinstance(axes, tuple | list) else (axes,)
  return tuple(sorted({a % ndim for a in axes}))


def _feature(param: jax.Array | None, x: jax.Array, feature_axes: tuple[int, ...]) -> Any:
  """A per-feature param as float32, shaped to broadcast against ``x``."""
  if param is None:
    return None
  shape = [x.shape[a] if a in feature_axes else 1 for a in range(x.ndim)]
  return param.astype(F32).reshape(shape)


def _param_cotangent(
  value: jax.Array, param: Any, x: jax.Array, feature_axes: tuple[int, ...]
) -> Any:
  """Sums a full-size float32 cotangent down to a param's shape and dtype."""
  if param is None:
    return None
  summed = jnp.sum(value, axis=tuple(a for a in range(x.ndim) if a not in feature_axes))
  return summed.reshape(param.shape).astype(param.dtype)


def _as_param(summed: jax.Array, param: Any) -> Any:
  """A sum over every axis but the feature axes, kept as size-1 axes, in a param's shape and dtype."""
  return None if param is None else summed.reshape(param.shape).astype(param.dtype)


def _unwrap(primal: Any) -> Any:
  return jax.tree.map(lambda p: p.value, primal)


def _is_zero(cotangent: Any) -> bool:
  return isinstance(cotangent, SymbolicZero)


# ------------------------------------------------------- statistics from the input


def _statistics(x32: jax.Array, cfg: _Config) -> tuple[jax.Array, jax.Array]:
  """Mean and variance over the reduction axes, kept as size-1 axes, as Flax computes them."""
  axes = cfg.reduction_axes
  if not cfg.subtract_mean:
    var = jnp.mean(x32 * x32, axes, keepdims=True)
    return jnp.zeros_like(var), var
  mean = jnp.mean(x32, axes, keepdims=True)
  if cfg.fast_variance:
    # Flax's use_fast_variance: E[x^2] - E[x]^2, clipped at 0 against round-off.
    var = jnp.maximum(0.0, jnp.mean(x32 * x32, axes, keepdims=True) - mean * mean)
  else:
    var = jnp.mean(jnp.square(x32 - mean), axes, keepdims=True)
  return mean, var


def _affine(x32, mean, rstd, scale, bias, x, cfg: _Config) -> jax.Array:
  # The order of Flax's _normalize: (x - mean) * (rsqrt(var + eps) * scale) + bias.
  mul = rstd if scale is None else rstd * _feature(scale, x, cfg.feature_axes)
  y = (x32 - mean) * mul
  if bias is not None:
    y = y + _feature(bias, x, cfg.feature_axes)
  return y.astype(cfg.dtype)


def _normalize_primal(x, scale, bias, cfg: _Config):
  x32 = x.astype(F32)
  mean, var = _statistics(x32, cfg)
  rstd = jax.lax.rsqrt(var + cfg.epsilon)
  y = _affine(x32, mean, rstd, scale, bias, x, cfg)
  return (y, _squeeze(mean, cfg), _squeeze(var, cfg)), (mean, rstd)


def _squeeze(stat: jax.Array, cfg: _Config) -> jax.Array:
  return jnp.squeeze(stat, cfg.reduction_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _normalize(x, scale, bias, cfg):
  return _normalize_primal(x, scale, bias, cfg)[0]


def _normalize_fwd(x, scale, bias, cfg):
  x, scale, bias = _unwrap((x, scale, bias))
  outputs, (mean, rstd) = _normalize_primal(x, scale, bias, cfg)
  # The residuals: the input in its own dtype, float32 per-row statistics, the params.
  return outputs, (x, scale, bias, mean, rstd)


def _normalize_bwd(cfg, res, cotangents):
  x, scale, bias, mean, rstd = res
  g_y, g_mean, g_var = cotangents
  axes = cfg.reduction_axes
  count = math.prod(x.shape[a] for a in axes)
  centred = x.astype(F32) - mean
  xhat = centred * rstd
  dx = jnp.zeros(x.shape, F32)
  d_scale = d_bias = None
  if not _is_zero(g_y):
    g = g_y.astype(F32)
    gamma = 1.0 if scale is None else _feature(scale, x, cfg.feature_axes)
    param_axes = tuple(a for a in range(x.ndim) if a not in cfg.feature_axes)
    if param_axes == axes:
      # BatchNorm: the params' sums are the statistics' sums, gamma is constant along them:
      # one pass over x and g reduces the two, the second computes dx from them directly.
      sum_g = jnp.sum(g, axes, keepdims=True)
      sum_gx = jnp.sum(g * xhat, axes, keepdims=True)
      d_bias, d_scale = _as_param(sum_g, bias), _as_param(sum_gx, scale)
      centre = sum_g if cfg.subtract_mean else 0.0
      dx = rstd * (g * gamma - gamma / count * (centre + xhat * sum_gx))
    else:
      d_bias = _param_cotangent(g, bias, x, cfg.feature_axes)
      d_scale = _param_cotangent(g * xhat, scale, x, cfg.feature_axes)
      inner = g * gamma - xhat * jnp.mean(g * gamma * xhat, axes, keepdims=True)
      if cfg.subtract_mean:
        inner = inner - jnp.mean(g * gamma, axes, keepdims=True)
      dx = rstd * inner
  # The statistics outputs (BatchNorm's running averages read them).
  if cfg.subtract_mean and not _is_zero(g_mean):
    dx = dx + jnp.expand_dims(g_mean.astype(F32), axes) / count
  if not _is_zero(g_var):
    dx = dx + jnp.expand_dims(g_var.astype(F32), axes) * (2.0 / count) * centred
  return dx.astype(x.dtype), d_scale, d_bias


_normalize.defvjp(_normalize_fwd, _normalize_bwd, symbolic_zeros=True)


def normalize(
  x: jax.Array,
  scale: jax.Array | None,
  bias: jax.Array | None,
  *,
  reduction_axes: Any,
  feature_axes: Any,
  epsilon: float,
  subtract_mean: bool = True,
  fast_variance: bool = True,
  dtype: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Normalises ``x`` over ``reduction_axes`` in float32, saving only ``x`` and the statistics.

  Computes what Flax's ``LayerNorm`` (``subtract_mean=True``), ``RMSNorm``
  (``subtract_mean=False``) and ``BatchNorm`` in train mode (the reduction
  axes are the batch axes) compute with float32 statistics and compute dtype:
  ``(x - mean) * rsqrt(var + epsilon) * scale + bias``, everything in
  float32 whatever the dtype of ``x``. The backward pass keeps ``x`` in its own
  dtype and the float32 mean and inverse deviation per normalised row, and
  recomputes the rest.

  Args:
    x: the input, any floating dtype.
    scale: the per-feature scale (shape: ``x``'s sizes along
      ``feature_axes``), or ``None``.
    bias: the per-feature bias, or ``None``.
    reduction_axes: the axis or axes the statistics are computed over.
    feature_axes: the axis or axes ``scale`` and ``bias`` vary along.
    epsilon: added to the variance.
    subtract_mean: centre the input (LayerNorm, BatchNorm); ``False`` is RMSNorm.
    fast_variance: Flax's ``use_fast_variance``: ``E[x^2] - E[x]^2``.
    dtype: the dtype of ``y``; ``None`` means that of ``x``.

  Returns:
    ``(y, mean, var)``: ``y`` in ``dtype``; the float32 mean (zeros without
    ``subtract_mean``) and variance, with the reduction axes removed.
  """
  cfg = _Config(
    reduction_axes=canonical_axes(x.ndim, reduction_axes),
    feature_axes=canonical_axes(x.ndim, feature_axes),
    epsilon=float(epsilon),
    subtract_mean=subtract_mean,
    fast_variance=fast_variance,
    dtype=np.dtype(x.dtype if dtype is None else dtype),
  )
  return _normalize(x, scale, bias, cfg)


# ------------------------------------------------------- given statistics (eval)


def _given_primal(x, mean, var, scale, bias, cfg: _Config):
  x32 = x.astype(F32)
  mean32 = jnp.expand_dims(mean.astype(F32), cfg.reduction_axes)
  rstd = jax.lax.rsqrt(jnp.expand_dims(var.astype(F32), cfg.reduction_axes) + cfg.epsilon)
  return _affine(x32, mean32, rstd, scale, bias, x, cfg), (mean32, rstd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _normalize_given(x, mean, var, scale, bias, cfg):
  return _given_primal(x, mean, var, scale, bias, cfg)[0]


def _given_fwd(x, mean, var, scale, bias, cfg):
  x, mean, var, scale, bias = _unwrap((x, mean, var, scale, bias))
  y, (mean32, rstd) = _given_primal(x, mean, var, scale, bias, cfg)
  return y, (x, mean, var, scale, bias, mean32, rstd)


def _given_bwd(cfg, res, g_y):
  x, mean, var, scale, bias, mean32, rstd = res
  if _is_zero(g_y):
    return None, None, None, None, None
  g = g_y.astype(F32)
  centred = x.astype(F32) - mean32
  g_hat = g if scale is None else g * _feature(scale, x, cfg.feature_axes)
  axes = cfg.reduction_axes
  d_mean = -jnp.sum(g_hat * rstd, axes).astype(mean.dtype)
  d_var = (jnp.sum(g_hat * centred, axes) * -0.5 * jnp.squeeze(rstd, axes) ** 3).astype(var.dtype)
  return (
    (g_hat * rstd).astype(x.dtype),
    d_mean,
    d_var,
    _param_cotangent(g * centred * rstd, scale, x, cfg.feature_axes),
    _param_cotangent(g, bias, x, cfg.feature_axes),
  )


_normalize_given.defvjp(_given_fwd, _given_bwd, symbolic_zeros=True)


def normalize_with_statistics(
  x: jax.Array,
  mean: jax.Array,
  var: jax.Array,
  scale: jax.Array | None,
  bias: jax.Array | None,
  *,
  reduction_axes: Any,
  feature_axes: Any,
  epsilon: float,
  dtype: Any = None,
) -> jax.Array:
  """Normalises ``x`` with given statistics in float32 (BatchNorm in eval mode), saving only ``x``.

  Args:
    x: the input, any floating dtype.
    mean: the mean, shaped as ``x`` without ``reduction_axes``.
    var: the variance, shaped as ``mean``.
    scale: the per-feature scale, or ``None``.
    bias: the per-feature bias, or ``None``.
    reduction_axes: the axes the statistics do not vary along.
    feature_axes: the axis or axes ``scale`` and ``bias`` vary along.
    epsilon: added to the variance.
    dtype: the dtype of the result; ``None`` means that of ``x``.

  Returns:
    ``(x - mean) * rsqrt(var + epsilon) * scale + bias`` in ``dtype``.
  """
  cfg = _Config(
    reduction_axes=canonical_axes(x.ndim, reduction_axes),
    feature_axes=canonical_axes(x.ndim, feature_axes),
    epsilon=float(epsilon),
    subtract_mean=True,
    fast_variance=False,
    dtype=np.dtype(x.dtype if dtype is None else dtype),
  )
  return _normalize_given(x, mean, var, scale, bias, cfg)
