"""Activation statistics and the non-finite locator for NNX models.

The model is split (``nnx.split``) and merged afresh inside the traced
function, so the user's objects are never touched and the state a forward
pass writes (BatchNorm statistics, RNG counts) is discarded. NNX has no method
interceptor: every module of the private copy gets its class swapped for a
cached same-named subclass whose ``__call__`` routes the call through the
recorder of ``mpx._src.diagnostics.activations``
(``mpx._src.adapters.class_swap``, the mechanism ``mpx.nnx.apply_policy`` uses
for boundary casts). Module keys are graph paths joined as the policy's
path rules see them (``mpx._src.adapters.layer_policy.join_path``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from mpx._src.adapters import class_swap, layer_policy
from mpx._src.diagnostics import activations, histogram, locate
from mpx._src.scaling import state as loss_scale_state

# (recorder, id(module) -> path, modules in a call) of the forward pass being traced.
_TAPPING: contextvars.ContextVar[tuple[activations.Recorder, dict[int, str], set[int]] | None] = (
  contextvars.ContextVar("mpx_nnx_tapping", default=None)
)


def _call_tapped(module: Any, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """A module call, routed through the recorder of the forward pass being traced (if any)."""
  tapping = _TAPPING.get()
  path = None if tapping is None else tapping[1].get(id(module))
  if tapping is None or path is None or id(module) in tapping[2]:
    return call(*args, **kwargs)
  recorder, _, active = tapping
  active.add(id(module))
  try:
    return recorder.call(activations.module_key(path), call, args, kwargs)
  finally:
    active.discard(id(module))


_TAPPED = class_swap.CallSwap("tapped", _call_tapped)


def _prober(
  loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, stat: activations.Stat
) -> Callable[[Any], activations.ActivationStats]:
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def one(pure: Any, rest: Any, a: tuple, scale: jax.Array) -> activations.ActivationStats:
    def run(recorder: activations.Recorder, p: Any) -> Any:
      # Fresh variables, made in this trace: NNX refuses writes from another one. That holds
      # for NNX objects among the arguments too (an `nnx.Rngs` whose counts a dropout advances).
      state, others, fresh_args = jax.tree.map(lambda x: x, (params, rest, a))
      nnx.replace_by_pure_dict(state, p)
      copy = nnx.merge(graphdef, state, others)
      paths = {}
      for path, node in nnx.iter_graph(copy):
        if isinstance(node, nnx.Module) and callable(node):
          _TAPPED.swap(node)
          paths[id(node)] = layer_policy.join_path(path)
      token = _TAPPING.set((recorder, paths, set()))
      try:
        return loss_fn(copy, *fresh_args)
      finally:
        _TAPPING.reset(token)

    return activations.collect(run, pure, scale, stat=stat)

  return activations.jit_over_scales(one, nnx.to_pure_dict(params), rest, args)


def collect_activations(
  loss_fn: Callable[..., Any],
  model: nnx.Module,
  *args: Any,
  loss_scale: Any = 1.0,
  stat: activations.Stat = histogram.magnitude_histogram,
) -> activations.ActivationStats:
  """Statistics of every NNX module's output and of the gradient flowing into it.

  Runs ``loss_fn(model, *args)`` forward and backward once, under ``jit``,
  with the loss multiplied by ``loss_scale`` as in a loss-scaled train step
  (:func:`mpx.value_and_grad`), differentiating with respect to the model's
  ``nnx.Param`` variables. It runs on a private copy of the model
  (``nnx.split`` / ``nnx.merge``): the model's state (BatchNorm statistics,
  RNG counts) is not updated. Every module's ``__call__`` is tapped: a
  ``-0.0`` is added to its floating inputs and outputs (a bitwise no-op), and
  the gradient with respect to it is the gradient flowing into that value.
  The statistic of each value, by default its :class:`mpx.diagnostics.MagnitudeHistogram`,
  is returned per module path (``layers/0``; ``<root>`` for the model);
  parameter gradients are keyed like ``model``'s pure state dict.

  Cost: one abstract trace to find the shapes, one compilation, and one
  forward and backward pass that keeps a statistic per module call. Only
  ``__call__`` is tapped (not ``generate`` or other methods); calls inside
  NNX transforms (``nnx.scan``, ``nnx.remat``) are not tapped.

  Args:
    loss_fn: ``(model, *args) -> loss``, a floating scalar.
    model: the NNX model (with or without :func:`mpx.nnx.apply_policy`).
    *args: the rest of ``loss_fn``'s arguments (a batch); array leaves are
      traced, other leaves stay Python values.
    loss_scale: the scale, or an optax state holding a
      :class:`mpx.LossScaleState`.
    stat: ``value -> pytree of arrays``, applied to the list of floating
      leaves of each value and to each parameter gradient.

  Returns:
    The :class:`mpx.diagnostics.ActivationStats`.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.relu, nnx.Linear(4, 1, rngs=rngs))
    >>> stats = mpx.nnx.collect_activations(lambda m, x: m(x).sum(), model, jnp.ones((2, 3)))
    >>> stats.modules
    ('layers/0', 'layers/2', '<root>')
    >>> sorted(stats.param_grads["layers"][2])
    ['bias', 'kernel']
  """
  scale = loss_scale_state.loss_scale_value(loss_scale)
  return _prober(loss_fn, model, args, stat)(scale)


def locate_nonfinite(
  loss_fn: Callable[..., Any],
  model: nnx.Module,
  *args: Any,
  loss_scale: Any = 1.0,
  min_scale: float = 1.0,
) -> locate.NonfiniteReport:
  """Names the NNX module where a step first became non-finite, forward and backward.

  The NNX twin of :func:`mpx.linen.locate_nonfinite` (see it for what is
  reported and what it costs), on a private copy of the model as
  :func:`collect_activations` runs it.

  Args:
    loss_fn: ``(model, *args) -> loss``.
    model: the NNX model.
    *args: the rest of ``loss_fn``'s arguments (the saved batch).
    loss_scale: the scale of the step, or an optax state holding a
      :class:`mpx.LossScaleState`.
    min_scale: the smallest scale to try (the loss scaler's floor).

  Returns:
    A :class:`mpx.diagnostics.NonfiniteReport`; ``print`` it for an explanation.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), jnp.log)
    >>> report = mpx.nnx.locate_nonfinite(lambda m, x: m(x).sum(), model, -jnp.ones((2, 3)))
    >>> report.forward, report.cause
    (NonfiniteLocation(module='<root>', value='output'), 'genuine')
  """
  scale = float(loss_scale_state.loss_scale_value(loss_scale))
  probe = _prober(loss_fn, model, args, histogram.magnitude_histogram)
  return locate.locate(probe, scale, float(min_scale))
