"""The non-finite locator: which module first produced an inf or NaN, and would a smaller scale help.

Framework-neutral core of ``mpx.linen.locate_nonfinite`` and
``mpx.nnx.locate_nonfinite``: given a probe that runs one tapped forward and
backward pass at a loss scale (``mpx._src.diagnostics.activations``), it reads the
magnitude histograms in forward order, then in backward order, and probes
smaller scales to tell an overflow that loss scaling absorbs from a value
that is non-finite at every scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from mpx._src import tree as tree_lib
from mpx._src.diagnostics import activations


class NonfiniteLocation(NamedTuple):
  """Where a non-finite value first appeared.

  Attributes:
    module: the module key (see :class:`mpx.diagnostics.ActivationStats`), or the path of
      a parameter for ``value="param_grad"``.
    value: ``"output"`` (the module computed it from finite inputs),
      ``"input"`` (it arrived at the module: produced by code between modules),
      ``"input_grad"`` (the module's backward produced it from a finite output
      gradient), ``"output_grad"`` (it arrived at the module's output from code
      after it, e.g. the loss) or ``"param_grad"`` (every activation gradient
      was finite, this parameter's gradient was not).
  """

  module: str
  value: str


_EXPLAIN = {
  "output": "its output (its inputs were finite: the module produced it)",
  "input": "its input (produced by code between modules, before this call)",
  "input_grad": "the gradient it passes back to its inputs (the gradient into its output "
  "was finite: its backward produced it)",
  "output_grad": "the gradient into its output (produced by code after it, e.g. the loss)",
  "param_grad": "its gradient (every activation gradient was finite)",
}


@dataclasses.dataclass(frozen=True)
class NonfiniteReport:
  """Where a step first became non-finite, and whether a smaller loss scale would fix it.

  ``str(report)`` explains it in words.

  Attributes:
    forward: the first non-finite value of the forward pass, in forward
      order; ``None`` if there is none.
    backward: the first non-finite gradient, in the order backpropagation
      produces them (reverse forward order, then the parameter gradients);
      ``None`` if there is none.
    cause: ``"finite"``: nothing is non-finite at ``loss_scale``;
      ``"overflow"``: the backward pass overflows at ``loss_scale`` but is
      finite at ``finite_scale``, so dynamic loss scaling absorbs it by
      backing off; ``"genuine"``: non-finite in the forward pass (which no
      loss scale changes) or at every scale down to ``min_scale``, e.g. a NaN.
    loss_scale: the scale examined.
    finite_scale: for ``"overflow"``, the largest scale tried at which the
      step is finite; else ``None``.
    probes: every ``(scale, finite)`` pair tried, in order.
    stats: the :class:`mpx.diagnostics.ActivationStats` (magnitude histograms) at
      ``loss_scale``.
  """

  forward: NonfiniteLocation | None
  backward: NonfiniteLocation | None
  cause: Literal["finite", "overflow", "genuine"]
  loss_scale: float
  finite_scale: float | None
  probes: tuple[tuple[float, bool], ...]
  stats: activations.ActivationStats

  def __str__(self) -> str:
    def where(loc: NonfiniteLocation | None, first: str, done: str) -> str:
      if loc is None:
        return done
      owner = "parameter" if loc.value == "param_grad" else "module"
      return f"first {first} at {owner} {loc.module!r}: {_EXPLAIN[loc.value]}"

    lines = [
      f"At loss scale {self.loss_scale:g}:",
      f"  forward: {where(self.forward, 'non-finite value', 'every value is finite')}",
      f"  backward: {where(self.backward, 'non-finite gradient', 'every gradient is finite')}",
    ]
    if self.cause == "overflow":
      lines.append(
        f"  cause: overflow. The step is finite at loss scale {self.finite_scale:g}; dynamic "
        "loss scaling absorbs it by backing off."
      )
    elif self.cause == "genuine":
      why = (
        "the forward pass is non-finite, which no loss scale changes"
        if self.forward is not None
        else f"the step is non-finite at every scale tried, down to {min(s for s, _ in self.probes):g}"
      )
      lines.append(
        f"  cause: genuine: {why}. Keep the module named above in float32 (mpx.KeepRules), "
        "look for NaN in the data, or lower the learning rate."
      )
    else:
      lines.append("  cause: none, the step is finite.")
    return "\n".join(lines)


def _bad(stat: Any) -> bool:
  return bool(np.asarray(stat.infs) + np.asarray(stat.nans) > 0)


def _forward(stats: activations.ActivationStats) -> NonfiniteLocation | None:
  for key, kind in stats.events:
    if _bad((stats.outputs if kind == "output" else stats.inputs)[key]):
      return NonfiniteLocation(key, kind)
  return None


def _backward(stats: activations.ActivationStats) -> NonfiniteLocation | None:
  for key, kind in reversed(stats.events):
    if _bad((stats.output_grads if kind == "output" else stats.input_grads)[key]):
      return NonfiniteLocation(key, f"{kind}_grad")
  is_stat = lambda x: hasattr(x, "nans")  # noqa: E731
  for path, stat in jax.tree_util.tree_flatten_with_path(stats.param_grads, is_leaf=is_stat)[0]:
    if _bad(stat):
      return NonfiniteLocation(tree_lib.path_str(path), "param_grad")
  return None


def locate(
  probe: Callable[[float], activations.ActivationStats], loss_scale: float, min_scale: float
) -> NonfiniteReport:
  """Runs ``probe`` at ``loss_scale``, then at smaller scales if the backward pass is not finite.

  Args:
    probe: ``scale -> ActivationStats`` with magnitude histograms.
    loss_scale: the scale of the step under examination.
    min_scale: the smallest scale to try (the loss scaler's floor).

  Returns:
    The :class:`NonfiniteReport`.
  """
  stats = jax.device_get(probe(loss_scale))
  forward, backward = _forward(stats), _backward(stats)
  probes: list[tuple[float, bool]] = [(loss_scale, forward is None and backward is None)]
  cause: Literal["finite", "overflow", "genuine"] = "finite"
  finite_scale = None
  if forward is not None:
    cause = "genuine"
  elif backward is not None:
    cause = "genuine"

    def finite_at(scale: float) -> bool:
      finite = _backward(jax.device_get(probe(scale))) is None
      probes.append((scale, finite))
      return finite

    # Scales min_scale * 2**j; j = top is loss_scale itself, known to be non-finite.
    top = math.ceil(math.log2(loss_scale / min_scale)) if loss_scale > min_scale else 0
    if top > 0 and finite_at(min_scale):
      low, high = 0, top
      while high - low > 1:  # the largest finite scale, if finiteness is monotone in the scale
        mid = (low + high) // 2
        low, high = (mid, high) if finite_at(min_scale * 2.0**mid) else (low, mid)
      cause, finite_scale = "overflow", min_scale * 2.0**low
  return NonfiniteReport(forward, backward, cause, loss_scale, finite_scale, tuple(probes), stats)
