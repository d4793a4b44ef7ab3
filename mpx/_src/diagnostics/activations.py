"""Every module's activations and their gradients, from one forward and backward pass.

Framework-neutral core of ``mpx.linen.collect_activations`` and
``mpx.nnx.collect_activations``. An adapter routes every module call of the
forward pass through :meth:`Recorder.call`, which adds a perturbation of
``-0.0`` to each floating input and output (``x + (-0.0)`` is ``x`` bitwise,
``-0.0`` and NaN included) and records a statistic of the value. The
gradient of the scaled loss with respect to a perturbation is the gradient
flowing into that value, so one ``jax.vjp`` yields every activation gradient
along with the parameter gradients. The perturbations' shapes come from an
abstract pass first (``jax.eval_shape``: no computation).

Limits: module calls inside lifted transforms (``nn.scan``, ``nnx.scan``,
``remat``...) run in their own trace and are passed through untapped.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.diagnostics import histogram

Stat = Callable[[Any], Any]
ROOT = "<root>"


def module_key(path: str, method: str = "__call__") -> str:
  """The key of a module call: its ``/``-joined path (``<root>`` for the model), ``.method`` if not ``__call__``."""
  key = path or ROOT
  return key if method == "__call__" else f"{key}.{method}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ActivationStats:
  """Statistics of every module's inputs, outputs and their gradients, from one step.

  Made by ``mpx.linen.collect_activations`` and ``mpx.nnx.collect_activations``.
  Modules are keyed by their ``/``-joined path as the policy's path rules
  see it (``Block_0/Mlp_0/Dense_1``, ``layers/1``; ``<root>`` for the model
  itself); a module called more than once gets ``#1``, ``#2``... for the
  later calls, and a method other than ``__call__`` is written
  ``path.method``. A statistic is whatever ``stat`` returned for the floating
  leaves of the value (by default a :class:`mpx.diagnostics.MagnitudeHistogram`). It is a
  pytree (its key lists are static), so it can be returned from ``jit``.

  Attributes:
    modules: the module keys in forward order: the order in which their
      outputs were produced (a parent after its children).
    events: ``(key, "input" | "output")`` pairs in forward order; reversed,
      the order in which reverse-mode differentiation produces the gradients.
    outputs: key -> statistic of the module's output.
    output_grads: key -> statistic of the gradient of the scaled loss with
      respect to the module's output (the gradient flowing into the module).
    inputs: key -> statistic of the module's floating inputs.
    input_grads: key -> statistic of the gradient with respect to those inputs
      (the gradient the module passes back).
    param_grads: the statistic of each parameter gradient, in the params'
      tree structure.
    loss: the unscaled loss.
    loss_scale: float32, the scale the loss was multiplied by.
  """

  outputs: dict[str, Any]
  output_grads: dict[str, Any]
  inputs: dict[str, Any]
  input_grads: dict[str, Any]
  param_grads: Any
  loss: jax.Array
  loss_scale: jax.Array
  modules: tuple[str, ...] = dataclasses.field(metadata={"static": True}, default=())
  events: tuple[tuple[str, str], ...] = dataclasses.field(metadata={"static": True}, default=())


class Recorder:
  """Taps the module calls of one forward pass.

  Args:
    perturbations: ``(key, kind)`` -> the ``-0.0`` arrays added to the
      floating leaves of that value; ``None`` in the abstract pass, which
      records their shapes instead.
    stat: the statistic recorded for each value.
  """

  def __init__(self, perturbations: dict[str, list[jax.Array]] | None, stat: Stat) -> None:
    self._perturbations = perturbations
    self._stat = stat
    self._calls: collections.Counter[str] = collections.Counter()
    self.events: list[tuple[str, str]] = []
    self.shapes: dict[str, list[jax.ShapeDtypeStruct]] = {}
    self.values: dict[str, Any] = {}

  def call(self, key: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Runs one module call, tapping its inputs and its output.

    Args:
      key: the module key (:func:`module_key`); repeated calls are numbered.
      fn: the module call.
      args: its positional arguments.
      kwargs: its keyword arguments.

    Returns:
      ``fn(*args, **kwargs)``, with the floating leaves tapped.
    """
    key = self.enter(key)
    args, kwargs = self.tap(key, "input", (args, kwargs))
    return self.tap(key, "output", fn(*args, **kwargs))

  def enter(self, key: str) -> str:
    """Numbers one call of a module: ``key`` for the first, ``key#1``, ``key#2``... after it.

    Args:
      key: the module key (:func:`module_key`).

    Returns:
      The key of this call, for :meth:`tap`.
    """
    count = self._calls[key]
    self._calls[key] += 1
    return key if count == 0 else f"{key}#{count}"

  def tap(self, key: str, kind: str, value: Any) -> Any:
    """Taps the floating leaves of a call's inputs or output (:meth:`call` does both).

    Args:
      key: the call's key, from :meth:`enter`.
      kind: ``"input"`` or ``"output"``.
      value: the value.

    Returns:
      ``value`` with ``-0.0`` added to its floating leaves.
    """
    name = f"{kind}:{key}"
    self.events.append((key, kind))
    leaves, treedef = jax.tree.flatten(value, is_leaf=tree_lib.is_nnx_object)
    floating = [i for i, x in enumerate(leaves) if tree_lib.is_floating_array(x)]
    if self._perturbations is None:
      self.shapes[name] = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in floating]
      return value
    added = self._perturbations.get(name)
    if added is None or [(p.shape, p.dtype) for p in added] != [
      (leaves[i].shape, leaves[i].dtype) for i in floating
    ]:
      raise errors.MpxError(
        f"The {kind} of module call {key!r} differs between two traces of the same forward "
        "pass. The loss function must call the same modules, with values of the same shapes "
        "and dtypes, every time it is traced."
      )
    leaves = list(leaves)
    for i, p in zip(floating, added, strict=True):
      leaves[i] = leaves[i] + p
    self.values[name] = self._stat(jax.lax.stop_gradient([leaves[i] for i in floating]))
    return jax.tree.unflatten(treedef, leaves)


def collect(
  run: Callable[[Recorder, Any], Any],
  params: Any,
  loss_scale: jax.Array,
  *,
  stat: Stat = histogram.magnitude_histogram,
) -> ActivationStats:
  """Runs ``run`` forward and backward, tapping every module call.

  Args:
    run: ``(recorder, params) -> loss``; routes every module call through
      ``recorder.call`` and returns a floating scalar loss.
    params: the differentiated parameters.
    loss_scale: float32 scalar, multiplies the loss before differentiating.
    stat: the statistic of each value.

  Returns:
    The :class:`ActivationStats`.
  """
  shapes = Recorder(None, stat)
  jax.eval_shape(lambda p: run(shapes, p), params)
  events = tuple(shapes.events)
  zeros = {
    name: [jnp.full(s.shape, -0.0, s.dtype) for s in structs]
    for name, structs in shapes.shapes.items()
  }

  def forward(p: Any, perturbations: dict[str, list[jax.Array]]) -> tuple[jax.Array, Any]:
    recorder = Recorder(perturbations, stat)
    loss = run(recorder, p)
    if tuple(recorder.events) != events:
      raise errors.MpxError(
        "The loss function called different modules in two traces of the same forward pass; "
        "it must call the same modules in the same order every time it is traced."
      )
    if not tree_lib.is_floating_array(loss) or jnp.shape(loss) != ():
      raise errors.LeafTypeError(
        f"The loss must be a floating-point scalar array, got {loss!r}. Return e.g. "
        "loss.mean() from the loss function."
      )
    return loss.astype(jnp.float32) * loss_scale, (loss, recorder.values)

  _, backward, (loss, values) = jax.vjp(forward, params, zeros, has_aux=True)
  param_grads, grads = backward(jnp.ones((), jnp.float32))
  grad_stats = {name: stat(g) for name, g in grads.items()}

  def split(stats: dict[str, Any], kind: str) -> dict[str, Any]:
    return {key: stats[f"{k}:{key}"] for key, k in events if k == kind}

  return ActivationStats(
    outputs=split(values, "output"),
    output_grads=split(grad_stats, "output"),
    inputs=split(values, "input"),
    input_grads=split(grad_stats, "input"),
    param_grads=jax.tree.map(stat, param_grads),
    loss=loss,
    loss_scale=jnp.asarray(loss_scale, jnp.float32),
    modules=tuple(key for key, kind in events if kind == "output"),
    events=events,
  )


def jit_over_scales(fn: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
  """Compiles ``scale -> fn(*args, scale)`` once, with the array leaves of ``args`` as arguments.

  Other leaves (Python flags such as ``train=True``, strings) stay Python
  values, as they were written; the probes of the locator reuse one program.

  Args:
    fn: ``(*args, scale) -> result``.
    *args: its other arguments, any pytrees.

  Returns:
    ``scale -> fn(*args, scale)``, the scale passed as a float32 array.
  """
  leaves, treedef = jax.tree.flatten(args)
  dynamic = [i for i, x in enumerate(leaves) if tree_lib.is_array(x)]

  @jax.jit
  def compiled(arrays: list[Any], scale: jax.Array) -> Any:
    full = list(leaves)
    for i, x in zip(dynamic, arrays, strict=True):
      full[i] = x
    return fn(*jax.tree.unflatten(treedef, full), scale)

  arrays = [leaves[i] for i in dynamic]
  return lambda scale: compiled(arrays, jnp.asarray(scale, jnp.float32))
