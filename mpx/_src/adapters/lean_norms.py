"""A Flax normalisation layer's call, computed by the lean float32 kernels instead of Flax's code.

Where a ``LayerNorm``, ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` computes in float32 inside
a half-precision parent, the adapters hand its call here instead of casting
its input to float32 and running Flax's body: the layer's own params and
running statistics (read and written through the adapter's accessors) go
through :mod:`mpx._src.ops.normalization`, whose backward pass saves the
half-precision input and float32 per-row statistics only. The layer object,
its params, their names and the statistics update stay Flax's. Flax-free: the
layer's configuration is read from the attributes both Flax APIs share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mpx._src import tree as tree_lib
from mpx._src.ops import normalization

#: The layer kinds the kernels cover: Flax's LayerNorm, RMSNorm, BatchNorm and GroupNorm.
KINDS = ("layer", "rms", "batch", "group")

Param = Callable[[str, tuple[int, ...]], jax.Array]
Stats = Callable[[tuple[int, ...]], tuple[jax.Array, jax.Array]]
SetStats = Callable[[jax.Array, jax.Array], None]


def _parse(kind: str, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
  """``(x, use_running_average)`` of a call, or ``None`` for a call the kernels do not cover."""
  if not args:
    return None
  x, *rest = args
  kwargs = dict(kwargs)
  use_running_average = kwargs.pop("use_running_average", None) if kind == "batch" else None
  if kind == "batch" and rest:
    use_running_average = rest.pop(0)
  mask = kwargs.pop("mask", None)
  if kind == "rms" and rest:  # NNX's RMSNorm takes the mask positionally.
    mask = rest.pop(0)
  if rest or kwargs or mask is not None or not tree_lib.is_floating_array(x):
    return None
  return x, use_running_average


def call(
  layer: Any,
  kind: str,
  args: tuple,
  kwargs: dict,
  *,
  dtype: Any,
  param: Param,
  stats: Stats,
  set_stats: SetStats,
  call_overrides_attribute: bool,
) -> jax.Array | None:
  """Computes one call of a Flax normalisation layer with the lean kernels.

  Args:
    layer: the linen or NNX layer (its ``epsilon``, ``use_scale``,
      ``use_bias``, ``reduction_axes`` / ``feature_axes`` or ``axis``,
      ``momentum``, ``use_running_average``, ``use_fast_variance``,
      ``num_groups`` / ``group_size`` and ``axis_name`` are read).
    kind: one of :data:`KINDS`.
    args: the call's positional arguments.
    kwargs: the call's keyword arguments.
    dtype: the dtype of the output (the parent's compute dtype).
    param: ``(name, shape) -> value`` of the layer's ``scale`` / ``bias``.
    stats: ``shape -> (mean, var)``, the running statistics (BatchNorm).
    set_stats: writes new running statistics (BatchNorm in train mode).
    call_overrides_attribute: whether a ``use_running_average`` argument wins
      over the attribute (NNX); otherwise setting both is Flax's error (linen).

  Returns:
    The layer's output in ``dtype``, or ``None`` for a call the kernels do not
    cover (a ``mask``, statistics averaged over a named device axis, an
    unknown argument, a ``GroupNorm`` with other than its default reduction
    axes or with groups that do not divide the channels): the adapter then
    runs Flax's own code, which raises Flax's own errors.
  """
  parsed = _parse(kind, args, kwargs)
  if parsed is None or getattr(layer, "axis_name", None) is not None:
    return None
  x, use_running_average = parsed
  if kind == "batch":
    use_running_average = _running_average(layer, use_running_average, call_overrides_attribute)
    if use_running_average is None:
      return None
  layout = _layout(kind, layer, x.shape, call_overrides_attribute)
  if layout is None:
    return None
  shape, view, feature_axes, reduction_axes = layout
  scale = param("scale", shape) if layer.use_scale else None
  bias = param("bias", shape) if kind != "rms" and layer.use_bias else None
  if kind == "batch" and use_running_average:
    mean, var = stats(shape)
    return normalization.normalize_with_statistics(
      x,
      mean,
      var,
      scale,
      bias,
      reduction_axes=reduction_axes,
      feature_axes=feature_axes,
      epsilon=layer.epsilon,
      dtype=dtype,
    )
  y, mean, var = normalization.normalize(
    x.reshape(view),
    scale,
    bias,
    reduction_axes=reduction_axes,
    feature_axes=feature_axes,
    epsilon=layer.epsilon,
    subtract_mean=kind != "rms",
    fast_variance=layer.use_fast_variance,
    dtype=dtype,
  )
  y = y.reshape(x.shape)
  if kind == "batch":
    _update_statistics(layer.momentum, stats(shape), set_stats, mean, var)
  return y


def _running_average(layer: Any, argument: Any, call_overrides_attribute: bool) -> Any:
  """Whether a BatchNorm call normalises with its running statistics (``None``: not covered)."""
  attribute = layer.use_running_average
  if argument is None:
    return attribute
  if attribute is not None and not call_overrides_attribute:
    return None  # Both set: Flax's code raises its own error.
  return argument


def _layout(
  kind: str, layer: Any, shape: tuple[int, ...], call_overrides_attribute: bool
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
  """How a layer normalises an input of ``shape``, or ``None`` for a layout left to Flax's code.

  Returns:
    ``(param shape, view, feature axes, reduction axes)``: the input is
    normalised as ``x.reshape(view)`` over the reduction axes of that view,
    its params varying along the feature axes. The view is ``shape`` itself
    except for GroupNorm, which splits the channels into (groups, group size).
  """
  ndim = len(shape)
  if kind == "batch":
    feature_axes = normalization.canonical_axes(ndim, layer.axis)
    reduction_axes = tuple(a for a in range(ndim) if a not in feature_axes)
  elif kind == "group":
    return _group_layout(layer, shape, call_overrides_attribute)
  else:
    feature_axes = normalization.canonical_axes(ndim, layer.feature_axes)
    reduction_axes = normalization.canonical_axes(ndim, layer.reduction_axes)
  return tuple(shape[a] for a in feature_axes), shape, feature_axes, reduction_axes


def _group_layout(layer: Any, shape: tuple[int, ...], call_overrides_attribute: bool) -> Any:
  """GroupNorm's layout (see :func:`_layout`): statistics per example and group of channels."""
  ndim, channels = len(shape), shape[-1]
  default_axes = tuple(range(1, ndim))
  axes = layer.reduction_axes
  if ndim < 2 or (axes is not None and normalization.canonical_axes(ndim, axes) != default_axes):
    return None
  num_groups, group_size = layer.num_groups, layer.group_size
  if group_size is not None:
    # Linen takes one of the two (Flax raises on both); NNX stores both, consistent.
    if num_groups is not None and not call_overrides_attribute:
      return None
    num_groups = channels // group_size if channels % group_size == 0 else None
  if not num_groups or num_groups <= 0 or channels % num_groups:
    return None
  view = (*shape[:-1], num_groups, channels // num_groups)
  return (channels,), view, (ndim - 1, ndim), (*default_axes[:-1], ndim)


def _update_statistics(
  momentum: float,
  old: tuple[jax.Array, jax.Array],
  set_stats: SetStats,
  mean: jax.Array,
  var: jax.Array,
) -> None:
  """Moves a BatchNorm's running statistics toward this batch's."""
  old_mean, old_var = old
  # The update is not part of the loss: no gradient flows into it.
  mean, var = jax.lax.stop_gradient((mean, var))
  set_stats(
    momentum * old_mean + (1 - momentum) * mean.astype(old_mean.dtype),
    momentum * old_var + (1 - momentum) * var.astype(old_var.dtype),
  )
