"""Activation statistics and the non-finite locator for linen models.

One method interceptor (``flax.linen.intercept_methods``), installed around
the user's loss function, routes the outermost method call of every bound
module through the recorder of ``mpx._src.diagnostics.activations``; the module key is
the module's path as the policy's path rules see it
(``mpx._src.adapters.layer_policy.join_path``). Under :func:`mpx.linen.apply_policy`
this interceptor is the outer one, so it sees what flows between layers: the
inputs before a layer's boundary cast and its outputs after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax.core import tracers

from mpx._src.adapters import layer_policy
from mpx._src.diagnostics import activations, histogram, locate
from mpx._src.scaling import state as loss_scale_state


def _run(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``(recorder, params, args) -> loss``, every linen module call tapped."""

  def run(recorder: activations.Recorder, params: Any, args: tuple) -> Any:
    active: set[int] = set()
    trace = tracers.current_trace()

    def interceptor(next_fun: Any, f_args: Any, f_kwargs: Any, context: Any) -> Any:
      module = context.module
      key = id(module)
      # setup builds submodules; a method calling another of its module stays inside it.
      # A call in another trace (inside nn.scan, nn.remat, nn.jit...) is not tapped:
      # its statistics would be tracers of that trace, leaked out of it.
      if (
        context.method_name == "setup"
        or key in active
        or module.scope is None
        or tracers.current_trace() != trace
      ):
        return next_fun(*f_args, **f_kwargs)
      name = activations.module_key(layer_policy.join_path(module.path), context.method_name)
      active.add(key)
      try:
        return recorder.call(name, next_fun, f_args, f_kwargs)
      finally:
        active.discard(key)

    with nn.intercept_methods(interceptor):
      return loss_fn(params, *args)

  return run


def _prober(
  loss_fn: Callable[..., Any], params: Any, args: tuple, stat: activations.Stat
) -> Callable[[Any], activations.ActivationStats]:
  run = _run(loss_fn)

  def one(p: Any, a: tuple, scale: jax.Array) -> activations.ActivationStats:
    return activations.collect(lambda rec, q: run(rec, q, a), p, scale, stat=stat)

  return activations.jit_over_scales(one, params, args)


def collect_activations(
  loss_fn: Callable[..., Any],
  params: Any,
  *args: Any,
  loss_scale: Any = 1.0,
  stat: activations.Stat = histogram.magnitude_histogram,
) -> activations.ActivationStats:
  """Statistics of every linen module's output and of the gradient flowing into it.

  Runs ``loss_fn(params, *args)`` forward and backward once, under ``jit``,
  with the loss multiplied by ``loss_scale`` as in a loss-scaled train step
  (:func:`mpx.value_and_grad`). Every linen module called inside (by
  ``model.apply``, with or without :func:`mpx.linen.apply_policy`) is tapped:
  a ``-0.0`` is added to its floating inputs and outputs (a bitwise no-op),
  and the gradient with respect to it is the gradient flowing into that
  value. The statistic of each value, by default its
  :class:`mpx.diagnostics.MagnitudeHistogram`, is returned per module path.

  Cost: one abstract trace to find the shapes, one compilation, and one
  forward and backward pass that keeps a statistic per module call (a
  histogram is 279 int32 counts). Module calls inside lifted transforms
  (``nn.scan``, ``nn.remat``, ``nn.jit``, ``nn.vmap``) are not tapped: the
  call of the layer that runs the transform is, with its input and output.

  Args:
    loss_fn: ``(params, *args) -> loss``, a floating scalar; calls the linen
      model.
    params: what ``loss_fn`` differentiates: the params (or variables) of the
      model.
    *args: the rest of ``loss_fn``'s arguments (a batch); array leaves are
      traced, other leaves stay Python values.
    loss_scale: the scale, or an optax state holding a
      :class:`mpx.LossScaleState`.
    stat: ``value -> pytree of arrays``, applied to the list of floating
      leaves of each value and to each parameter gradient, e.g.
      ``functools.partial(mpx.diagnostics.range_report, dtype=jnp.float16, scale=2.0**jnp.arange(25))``.

  Returns:
    The :class:`mpx.diagnostics.ActivationStats`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, mpx
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> params = model.init(jax.random.key(0), x)
    >>> loss_fn = lambda p, x: model.apply(p, x).sum()
    >>> stats = mpx.linen.collect_activations(loss_fn, params, x, loss_scale=2.0**10)
    >>> stats.modules
    ('layers_0', 'layers_2', '<root>')
    >>> int(stats.output_grads["layers_2"].counts.sum())  # 2 x 1 gradients, all 2**10
    2
  """
  scale = loss_scale_state.loss_scale_value(loss_scale)
  return _prober(loss_fn, params, args, stat)(scale)


def locate_nonfinite(
  loss_fn: Callable[..., Any],
  params: Any,
  *args: Any,
  loss_scale: Any = 1.0,
  min_scale: float = 1.0,
) -> locate.NonfiniteReport:
  """Names the linen module where a step first became non-finite, forward and backward.

  For a saved batch that produced a NaN loss or a skipped step: runs
  :func:`collect_activations` with magnitude histograms at ``loss_scale`` and
  reports the first module whose output (or input) is non-finite in forward
  order, and the first whose gradient is non-finite in backward order (the
  gradient a module passes back, or the one flowing into it; the parameter
  gradients last). If only the backward pass is non-finite, it runs again at
  ``min_scale`` and, if that is finite, bisects the powers of two in between:
  ``cause="overflow"`` is what dynamic loss scaling absorbs by backing off;
  ``cause="genuine"`` is non-finite at every scale (or in the forward pass,
  which no loss scale changes).

  Cost: one compilation, then one forward and backward pass at
  ``loss_scale``; for a backward-only overflow, one more at ``min_scale`` and
  about ``log2(log2(loss_scale / min_scale))`` for the bisection (5 from
  2**15 down to 1). Run it outside ``jit``.

  Args:
    loss_fn: ``(params, *args) -> loss``; calls the linen model.
    params: the params (or variables) ``loss_fn`` differentiates.
    *args: the rest of ``loss_fn``'s arguments (the saved batch).
    loss_scale: the scale of the step, or an optax state holding a
      :class:`mpx.LossScaleState`.
    min_scale: the smallest scale to try (the loss scaler's floor).

  Returns:
    A :class:`mpx.diagnostics.NonfiniteReport`; ``print`` it for an explanation.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, mpx
    >>> ones = nn.initializers.ones
    >>> model = nn.Sequential([nn.Dense(4, kernel_init=ones), nn.Dense(1)])
    >>> model = mpx.linen.apply_policy(model, "mixed_float16")
    >>> x = jnp.full((2, 3), 3e4)  # 3 x 3e4 overflows float16
    >>> params = model.init(jax.random.key(0), x)
    >>> report = mpx.linen.locate_nonfinite(lambda p, x: model.apply(p, x).sum(), params, x)
    >>> report.forward, report.cause
    (NonfiniteLocation(module='layers_0', value='output'), 'genuine')
  """
  scale = float(loss_scale_state.loss_scale_value(loss_scale))
  probe = _prober(loss_fn, params, args, histogram.magnitude_histogram)
  return locate.locate(probe, scale, float(min_scale))
