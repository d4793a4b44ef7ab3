"""The fp8 planner for Flax linen models: the gradient step under each candidate, and the calibration."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from mpx._src.adapters import keep as keep_lib
from mpx._src.adapters import linen as linen_adapter
from mpx._src.adapters.linen_fp8 import FP8_COLLECTION
from mpx._src.audit import report as audit_lib
from mpx._src.audit import roofline
from mpx._src.planner import numerics
from mpx._src.planner import plan as plan_lib

# Collections the gradient is taken with respect to: the params, and the delayed
# recipes' amax histories, whose gradient carries the amaxes.
_DIFFERENTIATED = ("params", FP8_COLLECTION)


def _step(model: Any, loss_fn: Callable[[Any], jax.Array]) -> Callable[..., Any]:
  def step(diff: Any, rest: Any, *inputs: Any) -> Any:
    def loss(d: Any) -> jax.Array:
      out = model.apply({**d, **rest}, *inputs, mutable=list(rest) or False)
      return loss_fn(out[0] if rest else out)

    return jax.grad(loss)(diff)

  return step


def _split(variables: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  diff = {k: v for k, v in variables.items() if k in _DIFFERENTIATED}
  return diff, {k: v for k, v in variables.items() if k not in _DIFFERENTIATED}


def _capture(
  model: nn.Module, batch: tuple[Any, ...], variables: Any, loss_fn: Callable[[Any], jax.Array]
) -> Callable[[Sequence[str]], list[numerics.Captured]]:
  """The calibration: the model as written, in float32, on ``batch``."""

  def capture(layers: Sequence[str]) -> list[numerics.Captured]:
    found = model.init(jax.random.key(0), *batch) if variables is None else variables
    params, rest = found["params"], {k: v for k, v in found.items() if k != "params"}

    def loss(params: Any, rest: Any, *x: Any) -> jax.Array:
      out = model.apply({"params": params, **rest}, *x, mutable=list(rest) or False)
      return loss_fn(out[0] if rest else out)

    return numerics.capture(loss, (params, rest, *batch), layers)

  return capture


def plan(
  model: nn.Module,
  *inputs: Any,
  target: str = "h100",
  candidates: Sequence[Any] = plan_lib.CANDIDATES,
  calibration: tuple[Any, ...] | None = None,
  loss_fn: Callable[[Any], jax.Array] | None = None,
  variables: Any = None,
  rules: keep_lib.KeepRules | None = None,
  launch_seconds: float = roofline.LAUNCH_SECONDS,
  max_flushed: float = 0.01,
) -> plan_lib.Plan:
  """Decides, per layer, which candidate policy a linen model's layers should run in, from the compiled program.

  The model's gradient step (``loss_fn`` of ``model.apply(variables,
  *inputs)``, differentiated with respect to the params) is compiled for
  ``target`` under every candidate (``mpx.linen.apply_policy(model,
  candidate, rules=rules)``), without a GPU (jax's CUDA plugin,
  ``JAX_PLATFORMS=cpu``; see :func:`mpx.audit`). The layers the float8
  candidates change are the decided layers. Every kernel of each compiled
  program is charged to the layer that issued it (its GEMMs, the
  quantisation and amax kernels around them, split-K sums; a GEMM XLA merged
  from several layers is split between them) and timed with the roofline
  model plus ``launch_seconds`` per kernel launch (modelled, no autotuning;
  ``mpx._src.audit.roofline``).

  With ``calibration``, a small real batch, each decided layer's forward
  product and both backward products are recomputed from the operands and
  gradients of that batch as every candidate computes them, against float32:
  the SQNR (the median over rows, so a few huge rows cannot hide ordinary ones
  lost) and the fraction of operand values flushed to zero or saturated
  (``mpx._src.planner.numerics``).

  Each layer gets the fastest candidate whose kernels multiply float8 as
  asked and whose numerics pass (a float8 candidate's SQNR at least 20 dB per
  tensor, 25 dB per row or block; at most ``max_flushed`` of an operand
  flushed), if it is faster than the first candidate (the baseline); else the
  baseline: small GEMMs, where the quantisation costs more than float8
  saves, stay in it. The layers' times add up only approximately where
  neighbours run in different candidates (XLA fuses their boundary
  differently), so the planned model is compiled too: unless it is at least
  0.1% faster than every layer in one candidate that all of them may run in
  (the baseline always qualifies), that candidate is the plan. In the model,
  a plan is never slower than the baseline.

  Cost: one compile for the target per candidate and one for the plan, and
  with ``calibration`` one CPU compile and run of the float32 forward and
  backward pass and of each product's candidates.

  Args:
    model: the linen model as written (no policy applied).
    *inputs: its inputs for the cost model: arrays or
      ``jax.ShapeDtypeStruct``\\ s, the shapes of the real step.
    target: the GPU target (``"h100"``, ``"h200"``, ``"b200"``...).
    candidates: policies (names or :class:`mpx.Policy`); the first is the
      baseline every layer falls back to.
    calibration: a small real batch (a tuple of arrays like ``inputs``) for
      the numerics; ``None`` decides on speed alone.
    loss_fn: ``loss_fn(output)`` to a float32 scalar; ``None``: half the sum
      of squares of the output.
    variables: the variables to calibrate with (trained params, say);
      ``None`` initialises the model with ``jax.random.key(0)``.
    rules: keep rules every candidate runs under (the plan adds its own).
    launch_seconds: the modelled cost of one kernel launch.
    max_flushed: the largest fraction of an operand's nonzero values a float8
      candidate may flush to zero or saturate.

  Returns:
    The :class:`mpx.fp8.Plan`: ``mpx.linen.apply_policy(model, plan.policy,
    rules=plan.rules)`` applies it.

  Raises:
    ConfigError: fewer than two candidates, or no GPU target can be compiled for.
  """
  loss_fn = plan_lib.default_loss if loss_fn is None else loss_fn

  def compile_(policy: Any, step_rules: keep_lib.KeepRules) -> Any:
    wrapped = linen_adapter.apply_policy(model, policy, rules=step_rules)
    diff, rest = _split(jax.eval_shape(wrapped.init, jax.random.key(0), *inputs))
    return audit_lib.audit(_step(wrapped, loss_fn), diff, rest, *inputs, target=target)

  subject = plan_lib.Subject(
    compile=compile_,
    capture=None
    if calibration is None
    else _capture(model, tuple(calibration), variables, loss_fn),
    rule_path=lambda path: path.split("/", 1)[1] if "/" in path else "",
    framework="linen",
  )
  return plan_lib.make_plan(
    subject,
    candidates,
    target=target,
    rules=rules,
    launch_seconds=launch_seconds,
    max_flushed=max_flushed,
  )
