"""The fp8 planner for Flax NNX models: the gradient step under each candidate, and the calibration."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from mpx._src.adapters import keep as keep_lib
from mpx._src.adapters import nnx as nnx_adapter
from mpx._src.adapters.nnx_fp8 import Fp8History
from mpx._src.audit import report as audit_lib
from mpx._src.audit import roofline
from mpx._src.planner import numerics
from mpx._src.planner import plan as plan_lib


def _step(loss_fn: Callable[[Any], jax.Array]) -> Callable[..., Any]:
  # The params and the delayed recipes' amax histories, whose gradient carries the amaxes.
  wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8History))

  def step(model: nnx.Module, *inputs: Any) -> Any:
    return nnx.grad(lambda m: loss_fn(m(*inputs)), argnums=wrt)(model)

  return step


def plan(
  model: nnx.Module,
  *inputs: Any,
  target: str = "h100",
  candidates: Sequence[Any] = plan_lib.CANDIDATES,
  calibration: tuple[Any, ...] | None = None,
  loss_fn: Callable[[Any], jax.Array] | None = None,
  rules: keep_lib.KeepRules | None = None,
  launch_seconds: float = roofline.LAUNCH_SECONDS,
  max_flushed: float = 0.01,
) -> plan_lib.Plan:
  """Decides, per layer, which candidate policy an NNX model's layers should run in, from the compiled program.

  What :func:`mpx.linen.plan` does, for an NNX model: its gradient step
  (``loss_fn(model(*inputs))``, differentiated with respect to its
  ``nnx.Param``\\ s) is compiled for ``target`` under every candidate, each
  on a copy of the model (``mpx.nnx.apply_policy`` works in place; ``model``
  is left as it is), and, with ``calibration``, the model as it is (its own
  weights, float32) gives the numerics. Layers are named by their attribute
  path (``blocks/0/attn/query``).

  Args:
    model: the NNX model as written (no policy applied).
    *inputs: its inputs for the cost model: arrays or
      ``jax.ShapeDtypeStruct``\\ s, the shapes of the real step.
    target: the GPU target (``"h100"``, ``"h200"``, ``"b200"``...).
    candidates: policies (names or :class:`mpx.Policy`); the first is the
      baseline every layer falls back to.
    calibration: a small real batch (a tuple of arrays like ``inputs``) for
      the numerics; ``None`` decides on speed alone.
    loss_fn: ``loss_fn(output)`` to a float32 scalar; ``None``: half the sum
      of squares of the output.
    rules: keep rules every candidate runs under (the plan adds its own).
    launch_seconds: the modelled cost of one kernel launch.
    max_flushed: the largest fraction of an operand's nonzero values a float8
      candidate may flush to zero or saturate.

  Returns:
    The :class:`mpx.fp8.Plan`: ``mpx.nnx.apply_policy(model, plan.policy,
    rules=plan.rules)`` applies it.

  Raises:
    ConfigError: fewer than two candidates, or no GPU target can be compiled for.
  """
  loss_fn = plan_lib.default_loss if loss_fn is None else loss_fn
  step = _step(loss_fn)

  def compile_(policy: Any, step_rules: keep_lib.KeepRules) -> Any:
    copy = nnx.eval_shape(
      lambda: nnx_adapter.apply_policy(nnx.clone(model), policy, rules=step_rules)
    )
    return audit_lib.audit(step, copy, *inputs, target=target)

  capture = None
  if calibration is not None:
    batch = tuple(calibration)
    capture = functools.partial(numerics.capture, lambda m, *x: loss_fn(m(*x)), (model, *batch))
  subject = plan_lib.Subject(
    compile=compile_, capture=capture, rule_path=lambda path: path, framework="nnx"
  )
  return plan_lib.make_plan(
    subject,
    candidates,
    target=target,
    rules=rules,
    launch_seconds=launch_seconds,
    max_flushed=max_flushed,
  )
