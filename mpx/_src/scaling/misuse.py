"""Warnings about loss scaling used wrongly, given at ``init`` and when ``update`` is traced.

* half-precision params trained without float32 masters (paper section 3.1);
* gradients of the unscaled loss handed to a loss-scaling ``update`` (a
  forgotten :func:`mpx.value_and_grad`).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import jax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.optim import base as half_params


def warn_without_masters(params: Any, inner_state: Any) -> None:
  """Warns about half-precision params trained without float32 masters (paper section 3.1)."""
  half = [
    (path, leaf.dtype)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    if tree_lib.is_floating_array(leaf) and dtypes_lib.is_half(leaf.dtype)
  ]
  if not half or half_params.find_master_params(inner_state) is not None:
    return
  path, dtype = half[0]
  warnings.warn(
    f"{len(half)} params (e.g. {tree_lib.path_str(path)!r}, {dtype}) are stored in half "
    "precision and the optimizer keeps no float32 master copy, so every update smaller than "
    "half an ulp of its weight is rounded away and training stalls (paper section 3.1). "
    "Keep float32 masters: use mpx.mixed_precision(inner, policy) with its default "
    "master_dtype=jnp.float32, or wrap the optimizer as loss_scale(mpx.with_master_params(inner)).",
    errors.PrecisionWarning,
    stacklevel=3,
  )


def _computed_from(outputs: list[Any], sources: list[Any]) -> bool | None:
  """Whether a traced output was computed from one of ``sources``, in the trace being built.

  Walks the equations recorded so far backwards from ``outputs`` (each
  ``jit`` tracer knows the equation that made it). Every input of an
  equation counts as a dependency, so the answer errs toward ``True``.

  Returns:
    ``None`` when it cannot tell: an output is not a tracer of the current
    ``jit`` trace (eager values, ``vmap``), or JAX records tracers otherwise.
  """
  tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]
  if not outputs or not all(isinstance(x, tracer) and hasattr(x, "parent") for x in outputs):
    return None
  wanted = {id(x) for x in sources}
  seen: set[int] = set()
  stack = list(outputs)
  while stack:
    x = stack.pop()
    if id(x) in seen:
      continue
    seen.add(id(x))
    if id(x) in wanted:
      return True
    parent = getattr(x, "parent", None)
    if parent is None:
      continue
    inputs = getattr(parent, "in_tracers", None)
    if inputs is None:
      return None
    stack.extend(inputs)
  return False


# The traces (one per step function and input signature) already warned about.
_warned_traces: weakref.WeakSet[Any] = weakref.WeakSet()


def _traced_function(trace: Any) -> str | None:
  """What ``jit`` is tracing, e.g. ``"train_step at train.py:12"``, if JAX says."""
  debug_info = getattr(getattr(trace, "frame", None), "debug_info", None)
  return getattr(debug_info, "func_src_info", None)


def warn_if_unscaled(grads: Any, params: Any, loss_scale: Any) -> None:
  """Warns once per traced step when the gradients were differentiated without the loss scale.

  A train step that keeps ``jax.value_and_grad`` under a loss scale hands
  true gradients to ``update``, which divides them by the scale (2**15):
  SGD then barely moves, silently. The check runs while ``update`` is traced
  together with the gradient computation (one ``jit``): it warns when the
  gradients were computed from ``params`` but not from the state's loss
  scale, which every scaled loss multiplies by (:func:`mpx.value_and_grad`,
  :func:`mpx.scale`, or by hand, ``loss * opt_state.loss_scale``). A
  dependency test, not a magnitude test, so gradients that are legitimately
  tiny or huge never trigger it. It stays silent when it cannot tell:
  gradients passed into the traced function, an eager ``update``, other
  tracers than ``jit``'s, or an inner ``update`` (under ``MultiSteps``) that
  sees the accumulated mean rather than the params' gradients.

  Each trace warns once (a second step function, or a retrace with new
  shapes, warns again), at the line that called ``update``, whatever
  Python's once-per-location registry has seen there: two step functions
  that share a helper calling ``update`` (``nnx.Optimizer.update``) each
  warn.
  """
  if params is None:
    return
  grads_leaves, param_leaves = jax.tree.leaves(grads), jax.tree.leaves(params)
  if _computed_from(grads_leaves, param_leaves) is not True:
    return
  if _computed_from(grads_leaves, [loss_scale]) is not False:
    return
  trace = getattr(grads_leaves[0], "_trace", None)
  if trace in _warned_traces:
    return
  if trace is not None:
    _warned_traces.add(trace)
  function = _traced_function(trace)
  message = (
    "The gradients passed to the loss-scaling update were computed from the params but not "
    "from the loss scale: the loss was differentiated unscaled (jax.value_and_grad or "
    "jax.grad), so update divides true gradients by the scale and SGD-like optimizers barely "
    "move. Differentiate with mpx.value_and_grad(loss_fn, opt_state) instead of "
    "jax.value_and_grad(loss_fn); in a hand-written step, differentiate "
    "mpx.scale(loss, opt_state). This warning is shown once per traced step function"
    + (f" (this one: {function})." if function else ".")
  )
  # As warnings.warn(..., stacklevel=3) attributes it, to the caller of the loss-scaling
  # update, but without Python's registry, which would show it once per calling line.
  caller = sys._getframe(2)
  warnings.warn_explicit(
    message,
    errors.PrecisionWarning,
    caller.f_code.co_filename,
    caller.f_lineno,
    module=caller.f_globals.get("__name__"),
    module_globals=caller.f_globals,
  )
