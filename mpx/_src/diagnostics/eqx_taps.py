"""Activation statistics and the non-finite locator for Equinox models.

Inside the traced function the model is rebuilt (out of place, as
``mpx.eqx.apply_policy`` does) with every module wrapped in a tap whose call
routes its inputs and output through the recorder of
``mpx._src.diagnostics.activations``; the user's model is never changed.
Equinox layers take one example and run under ``jax.vmap``, where a value is
one example's: the taps are ``custom_vmap``'d, so under ``vmap`` (at any
depth) they record the whole batch, in the trace the statistics are returned
from. A call traced elsewhere (inside a ``jax.lax.scan`` body, ``remat``) is
not tapped: its statistics would be tracers of that trace. Module keys are
the paths the policy's path rules see (``blocks/0/attn``); an
``eqx.nn.State`` passes through untapped.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
from jax._src.interpreters import batching
from jax.custom_batching import custom_vmap

from mpx._src.adapters import eqx as eqx_adapter
from mpx._src.adapters import eqx_tree, layer_policy
from mpx._src.diagnostics import activations, histogram, locate
from mpx._src.scaling import state as loss_scale_state

# (recorder, the trace of the forward pass) while a forward pass is traced.
_TAPPING: contextvars.ContextVar[tuple[activations.Recorder, Any] | None] = contextvars.ContextVar(
  "mpx_eqx_tapping", default=None
)


def _is_state(x: Any) -> bool:
  return isinstance(x, eqx.nn.State)


def _lifted(record: Callable[[Any], Any], value: Any) -> Any:
  """``record(value)`` on the whole batch: under ``vmap`` it runs in the rule, on the batched value."""
  states, rest = eqx.partition(value, _is_state, is_leaf=_is_state)
  arrays, static = eqx.partition(rest, eqx.is_array)
  leaves, treedef = jax.tree.flatten(arrays)
  if not any(isinstance(x, batching.BatchTracer) for x in leaves):
    return eqx.combine(record(rest), states, is_leaf=_is_state)

  def identity(*xs: Any) -> list[Any]:
    return list(xs)

  lift = custom_vmap(identity)

  @lift.def_vmap
  def rule(axis_size: int, in_batched: Any, *xs: Any) -> tuple[list[Any], Any]:
    del axis_size
    whole = eqx.combine(jax.tree.unflatten(treedef, xs), static)
    tapped = _lifted(record, whole)
    return jax.tree.leaves(eqx.filter(tapped, eqx.is_array)), list(in_batched)

  recorded = jax.tree.unflatten(treedef, lift(*leaves))
  return eqx.combine(recorded, static, states, is_leaf=_is_state)


class _Tapped(eqx.nn.StatefulLayer):
  """A module whose calls the recorder of the forward pass being traced taps."""

  mpx_tapped: Any
  mpx_key: str = eqx.field(static=True)

  def __getattr__(self, name: str) -> Any:
    if name in ("mpx_tapped", "mpx_key") or name.startswith("__"):
      raise AttributeError(name)
    return getattr(self.mpx_tapped, name)

  def is_stateful(self) -> bool:
    """Whether the tapped module takes and returns an ``eqx.nn.State``."""
    module = self.mpx_tapped
    return isinstance(module, eqx.nn.StatefulLayer) and module.is_stateful()

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the module, its inputs and output tapped (see the module docstring).

    Args:
      *args: the module's positional arguments.
      **kwargs: the module's keyword arguments.

    Returns:
      What the module returns.
    """
    tapping = _TAPPING.get()
    if tapping is None:
      return self.mpx_tapped(*args, **kwargs)
    recorder, trace = tapping
    key: list[str] = []

    def record_input(value: Any) -> Any:
      if jex.get_opaque_trace_state() != trace:
        return value  # Traced inside a scan body, remat...: not tapped.
      key.append(recorder.enter(self.mpx_key))
      return recorder.tap(key[0], "input", value)

    def record_output(value: Any) -> Any:
      return recorder.tap(key[0], "output", value) if key else value

    args, kwargs = _lifted(record_input, (args, kwargs))
    return _lifted(record_output, self.mpx_tapped(*args, **kwargs))


def _tapped(module: Any, path: tuple[Any, ...] = ()) -> Any:
  """``module`` with it and every module below it (but states and wrapped layers) tapped."""
  inner = isinstance(module, eqx_adapter.PolicyLayer)
  new_leaves = []
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    module, is_leaf=lambda x: x is not module and isinstance(x, eqx.Module)
  )
  for key_path, leaf in flat:
    if isinstance(leaf, eqx.Module) and not isinstance(leaf, eqx_tree.OPAQUE):
      child_path = path + eqx_tree.path_parts(key_path)
      # A wrapper's layer is at the wrapper's path: the wrapper is tapped, its layer not.
      if inner and child_path == path:
        leaf = _tapped_children(leaf, child_path)
      else:
        leaf = _tapped(leaf, child_path)
    new_leaves.append(leaf)
  rebuilt = jax.tree.unflatten(treedef, new_leaves)
  if not callable(rebuilt):
    return rebuilt
  key = activations.module_key(layer_policy.join_path(path))
  return _Tapped(mpx_tapped=rebuilt, mpx_key=key)  # pyright: ignore[reportCallIssue]


def _tapped_children(module: Any, path: tuple[Any, ...]) -> Any:
  """``module`` itself untapped, the modules below it tapped."""
  tapped = _tapped(module, path)
  return tapped.mpx_tapped if isinstance(tapped, _Tapped) else tapped


def _prober(
  loss_fn: Callable[..., Any], model: Any, args: tuple, stat: activations.Stat
) -> Callable[[Any], activations.ActivationStats]:
  params, rest = eqx.partition(model, eqx.is_inexact_array)

  def one(rest: Any, a: tuple, p: Any, scale: jax.Array) -> activations.ActivationStats:
    def run(recorder: activations.Recorder, q: Any) -> Any:
      copy = _tapped(eqx.combine(q, rest))
      token = _TAPPING.set((recorder, jex.get_opaque_trace_state()))
      try:
        return loss_fn(copy, *a)
      finally:
        _TAPPING.reset(token)

    return activations.collect(run, p, scale, stat=stat)

  return activations.jit_over_scales(one, rest, args, params)


def collect_activations(
  loss_fn: Callable[..., Any],
  model: Any,
  *args: Any,
  loss_scale: Any = 1.0,
  stat: activations.Stat = histogram.magnitude_histogram,
) -> activations.ActivationStats:
  """Statistics of every Equinox module's output and of the gradient flowing into it.

  Runs ``loss_fn(model, *args)`` forward and backward once, under ``jit``,
  with the loss multiplied by ``loss_scale`` as in a loss-scaled train step
  (:func:`mpx.value_and_grad`), differentiating with respect to the model's
  floating arrays. Every module's ``__call__`` is tapped: a ``-0.0`` is added
  to its floating inputs and outputs (a bitwise no-op), and the gradient
  with respect to it is the gradient flowing into that value. Under
  ``jax.vmap`` a value is the whole batch's. The statistic of each value, by
  default its :class:`mpx.diagnostics.MagnitudeHistogram`, is returned per
  module path (``blocks/0/attn``; ``<root>`` for the model); parameter
  gradients have the structure of ``eqx.filter(model, eqx.is_inexact_array)``.

  Cost: one abstract trace to find the shapes, one compilation, and one
  forward and backward pass that keeps a statistic per module call. Only
  ``__call__`` is tapped; calls inside a ``jax.lax.scan`` body (stacked
  layers) are not.

  Args:
    loss_fn: ``(model, *args) -> loss``, a floating scalar (a stateful
      model's loss function drops the new state).
    model: the Equinox model (with or without :func:`mpx.eqx.apply_policy`).
    *args: the rest of ``loss_fn``'s arguments (a batch, an
      ``eqx.nn.State``); array leaves are traced, other leaves stay Python
      values.
    loss_scale: the scale, or an optax state holding a
      :class:`mpx.LossScaleState`.
    stat: ``value -> pytree of arrays``, applied to the list of floating
      leaves of each value and to each parameter gradient.

  Returns:
    The :class:`mpx.diagnostics.ActivationStats` (``docs/guide/equinox.md``
    shows one).
  """
  scale = loss_scale_state.loss_scale_value(loss_scale)
  return _prober(loss_fn, model, args, stat)(scale)


def locate_nonfinite(
  loss_fn: Callable[..., Any],
  model: Any,
  *args: Any,
  loss_scale: Any = 1.0,
  min_scale: float = 1.0,
) -> locate.NonfiniteReport:
  """Names the Equinox module where a step first became non-finite, forward and backward.

  The Equinox twin of :func:`mpx.linen.locate_nonfinite` (see it for what
  is reported and what it costs), tapping the model as
  :func:`collect_activations` does.

  Args:
    loss_fn: ``(model, *args) -> loss``.
    model: the Equinox model.
    *args: the rest of ``loss_fn``'s arguments (the saved batch).
    loss_scale: the scale of the step, or an optax state holding a
      :class:`mpx.LossScaleState`.
    min_scale: the smallest scale to try (the loss scaler's floor).

  Returns:
    A :class:`mpx.diagnostics.NonfiniteReport`; ``print`` it for an explanation.
  """
  scale = float(loss_scale_state.loss_scale_value(loss_scale))
  probe = _prober(loss_fn, model, args, histogram.magnitude_histogram)
  return locate.locate(probe, scale, float(min_scale))
