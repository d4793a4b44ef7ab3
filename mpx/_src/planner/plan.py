"""The fp8 plan: per layer, the fastest candidate whose numerics pass, as a policy and keep rules.

Framework-neutral: the linen and NNX parts (``mpx._src.planner.linen``,
``mpx._src.planner.nnx``) hand over a :class:`Subject`, which compiles the
model's gradient step under a policy and keep rules for the target and, with a
calibration batch, captures its products; everything else is here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import errors
from mpx._src import policy as policy_lib
from mpx._src.adapters import keep as keep_lib
from mpx._src.audit import layer_paths
from mpx._src.audit import ops as audit_ops
from mpx._src.planner import cost as cost_lib
from mpx._src.planner import numerics as numerics_lib
from mpx._src.planner import rules as rules_lib

#: The candidates :func:`mpx.linen.plan` and :func:`mpx.nnx.plan` compare by default.
CANDIDATES = ("mixed_bfloat16", "mixed_float8", "mixed_float8_rowwise")
NOTE = "modelled, no autotuning: roofline plus {us:g} us per kernel launch"
#: A mix of candidates must beat every layer in one candidate by this share of the step to be
#: worth its rules (the block of fp8_block.py mixed three recipes over five rules for 0.01%).
MIX_MARGIN = 0.001


def default_loss(output: Any) -> jax.Array:
  """Half the sum of squares of the floating outputs, in float32.

  A sum whose gradient is the output itself: a plain sum's constant gradient
  lets XLA fold the last layer's backward products into reductions, which a
  real loss does not.
  """
  leaves = [x for x in jax.tree.leaves(output) if jnp.issubdtype(x.dtype, jnp.floating)]
  return sum((0.5 * jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves), jnp.float32(0))


@dataclasses.dataclass(frozen=True)
class Subject:
  """What a framework part hands the planner.

  Attributes:
    compile: ``(policy, rules) -> TargetReport``: the model's gradient step
      under the policy and rules, compiled for the target.
    capture: ``layers -> [Captured]``: the products of those layers on the
      calibration batch (``numerics.capture``), or ``None`` without one.
    rule_path: the keep-rule path of a layer path as the audit names it
      (linen: without the root class; NNX: the same).
    framework: ``"linen"`` or ``"nnx"`` (for :meth:`Plan.to_code`).
  """

  compile: Callable[[policy_lib.Policy, keep_lib.KeepRules], Any]
  capture: Callable[[Sequence[str]], list[numerics_lib.Captured]] | None
  rule_path: Callable[[str], str]
  framework: str


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """One decided layer of a :class:`Plan`.

  Attributes:
    path: the layer's keep-rule path (``Block_0/Dense_0``, ``blocks/0/fc``).
    shapes: its forward products as ``M x N x K`` GEMMs.
    flops_share: its share of the baseline step's matmul FLOPs.
    predicted_ms: per candidate, the modelled time of its kernels in a step.
    sqnr_db: per candidate, the worst SQNR of its forward and backward
      products against float32 on the calibration batch (``None`` without one).
    flushed: per candidate, the largest fraction of an operand's values
      flushed to zero or saturated (``None`` without a calibration batch).
    choice: the candidate the plan gives it.
    reason: why.
  """

  path: str
  shapes: str
  flops_share: float
  predicted_ms: dict[str, float]
  sqnr_db: dict[str, float] | None
  flushed: dict[str, float] | None
  choice: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which layers of a model run in which float8 recipe, and what the compiled program predicts.

  ``mpx.linen.apply_policy(model, plan.policy, rules=plan.rules)`` (or
  ``mpx.nnx.apply_policy``) applies it; ``str(plan)`` is its table,
  :meth:`to_code` the Python that recreates it, :meth:`verify` compiles the
  planned model and checks that every layer runs in the chosen format.

  Attributes:
    policy: the model-level policy (the candidate of most of the decided FLOPs).
    rules: keep rules giving the other layers their candidate.
    rows: one :class:`PlanRow` per decided layer, in program order.
    target: the GPU target the step was compiled for.
    candidates: the candidates' names; the first is the baseline.
    step_ms: per candidate, the modelled time of the whole step in it.
    predicted_ms: the modelled time of the planned step, compiled.
    layer_sum_ms: the baseline's step time plus each moved layer's modelled
      change (what the rows add up to; neighbours in different candidates
      fuse differently, so the compiled plan is what ``predicted_ms`` and
      :attr:`speedup` use).
    launch_seconds: the launch cost per kernel the model used.
    framework: ``"linen"`` or ``"nnx"``.
    reports: per candidate, the ``TargetReport`` of its compiled step (the
      kernels the plan's times come from), and under ``"plan"`` that of the
      planned step.
    note: why the plan overrides the layers' own choices (``""`` when it does not).
  """

  policy: policy_lib.Policy
  rules: keep_lib.KeepRules
  rows: tuple[PlanRow, ...]
  target: str
  candidates: tuple[str, ...]
  step_ms: dict[str, float]
  predicted_ms: float
  layer_sum_ms: float
  launch_seconds: float
  framework: str
  reports: dict[str, Any] = dataclasses.field(repr=False, compare=False)
  subject: Subject = dataclasses.field(repr=False, compare=False)
  note: str = ""

  @property
  def speedup(self) -> float:
    """The baseline candidate's modelled step time over the plan's."""
    return self.step_ms[self.candidates[0]] / self.predicted_ms

  @property
  def choices(self) -> dict[str, str]:
    """``{layer path: candidate}``."""
    return {row.path: row.choice for row in self.rows}

  def __str__(self) -> str:
    calibrated = any(row.sqnr_db for row in self.rows)
    header = ("layer", "GEMM (fwd M x N x K)", "FLOPs", *(f"{c} ms" for c in self.candidates))
    header += ("choice", "reason")
    rows = []
    for row in self.rows:
      cells = []
      for c in self.candidates:
        cell = f"{row.predicted_ms[c]:.3f}"
        if calibrated and row.sqnr_db and c in row.sqnr_db and row.flushed:
          cell += f" {row.sqnr_db[c]:.1f}dB {100 * row.flushed[c]:.1f}%"
        cells.append(cell)
      rows.append(
        (row.path, row.shapes, f"{100 * row.flops_share:.1f}%", *cells, row.choice, row.reason)
      )
    base = self.candidates[0]
    steps = ", ".join(f"{c} {ms:.3f} ms" for c, ms in self.step_ms.items())
    lines = [
      f"fp8 plan for {self.target} ({NOTE.format(us=1e6 * self.launch_seconds)})",
      f"step: {steps}; plan {self.predicted_ms:.3f} ms compiled, {self.speedup:.3f}x over "
      f"{base} (the layers' own choices add up to {self.layer_sum_ms:.3f} ms)",
      f"policy {rules_lib.name(self.policy)}, {len(self.rules.paths)} path rules"
      + (
        " (cells: ms, then the worst SQNR and flushed share on the calibration batch)"
        if calibrated
        else ""
      ),
      *([f"note: {self.note}"] if self.note else []),
      *audit_ops.table(header, rows),
    ]
    return "\n".join(lines)

  def to_code(self) -> str:
    """The Python that applies this plan to ``model`` (imports, the keep rules, ``apply_policy``)."""
    return rules_lib.code(self.policy, self.rules, self.framework)

  def verify(self) -> Any:
    """Checks each decided layer's kernels in the planned model compiled for the target.

    The planner compiled ``apply_policy(model, plan.policy, rules=plan.rules)``'s
    step for the target (its time is :attr:`predicted_ms`); this reads that
    program.

    Returns:
      The ``TargetReport`` of the planned step.

    Raises:
      PlanError: a layer planned in float8 has a GEMM kernel multiplying
        something else, or a layer kept out of it has a float8 GEMM kernel.
    """
    report = self.reports["plan"]
    wanted = {row.path for row in self.rows}
    kernels: dict[str, list[Any]] = {}
    for g in report.gemms:
      for path, _ in g.merged or ((g.module_path, 1.0),):
        row = _row_of(layer_paths.layer_of(path), wanted, self.subject.rule_path)
        if row is not None:
          kernels.setdefault(row, []).append(g)
    wrong = []
    for row in self.rows:
      fp8 = policy_lib.get_policy(row.choice).fp8 is not None
      found = kernels.get(row.path, [])
      bad = [g for g in found if g.is_fp8 != fp8]
      if bad or (fp8 and not found):
        multiplied = sorted({f"{g.lhs_dtype.name} x {g.rhs_dtype.name}" for g in bad}) or [
          "nothing"
        ]
        wrong.append(f"{row.path} (planned {row.choice}): kernels multiply {', '.join(multiplied)}")
    if wrong:
      raise errors.PlanError(
        f"The planned model compiled for {self.target} does not run every layer as planned: "
        + "; ".join(wrong)
        + ". Check that apply_policy got plan.policy and rules=plan.rules, unchanged."
      )
    return report


def _row_of(path: str, wanted: set[str], rule_path: Callable[[str], str]) -> str | None:
  """The plan row (keep-rule path) that an audit path is, or is inside of."""
  parts = path.split("/")
  for n in range(len(parts), 0, -1):
    candidate = rule_path("/".join(parts[:n]))
    if candidate in wanted:
      return candidate
  return None


@contextlib.contextmanager
def _quiet():
  # A float8 candidate whose kernels cannot take a layer's shapes is data, not a warning.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.PrecisionWarning)
    yield


def _label(policy: Any) -> str:
  return policy if isinstance(policy, str) else str(policy)


def _shapes(report: Any, layer: str) -> str:
  dims = [
    "x".join(map(str, op.gemm_dims))
    for op in report.intended.ops
    if not op.is_backward and layer_paths.layer_of(op.module_path) == layer
  ]
  return ", ".join(dict.fromkeys(dims)) or "-"


def make_plan(
  subject: Subject,
  candidates: Sequence[Any],
  *,
  target: str,
  rules: keep_lib.KeepRules | None,
  launch_seconds: float,
  max_flushed: float,
) -> Plan:
  """Compiles every candidate, models each layer, reads the numerics, and picks (see ``plan``'s docstring)."""
  if len(candidates) < 2:
    raise errors.ConfigError(
      f"The planner compares candidates against the first one; got {list(candidates)!r}. Pass at "
      "least two, e.g. ('mixed_bfloat16', 'mixed_float8')."
    )
  names = [_label(c) for c in candidates]
  policies = {name: policy_lib.get_policy(c) for name, c in zip(names, candidates, strict=True)}
  base_rules = keep_lib.KeepRules() if rules is None else rules
  with _quiet():
    reports = {name: subject.compile(policies[name], base_rules) for name in names}
  layers = cost_lib.decision_layers(list(reports.values()), reports[names[0]])
  costs = {
    name: cost_lib.program_cost(r, layers, launch_seconds=launch_seconds)
    for name, r in reports.items()
  }
  seconds = cost_lib.corrected(costs, names[0])
  numbers = (
    numerics_lib.layer_errors(subject.capture(layers), policies) if subject.capture else None
  )
  base = names[0]
  total_flops = reports[base].total_flops or 1
  rows, allowed = [], set(names)
  for layer in layers:
    choice, reason, fit = _choose(layer, names, policies, costs, seconds, numbers, max_flushed)
    allowed &= fit
    found = numbers.get(layer) if numbers is not None else None
    rows.append(
      PlanRow(
        path=subject.rule_path(layer),
        shapes=_shapes(reports[base], layer),
        flops_share=costs[base].layers[layer].flops / total_flops,
        predicted_ms={n: 1e3 * seconds[n][layer] for n in names},
        sqnr_db={n: v[0] for n, v in found.items()} if found else None,
        flushed={n: v[1] for n, v in found.items()} if found else None,
        choice=choice,
        reason=reason,
      )
    )
  choice_of = {layer: row.choice for layer, row in zip(layers, rows, strict=True)}
  layer_sum = cost_lib.step_seconds(costs, seconds, choice_of.__getitem__, base)
  policy, planned = rules_lib.policy_and_rules(
    {row.path: row.choice for row in rows},
    {row.path: costs[base].layers[layer].flops for row, layer in zip(rows, layers, strict=True)},
    names,
    base_rules,
  )
  # The layers' times add up only approximately where neighbours run in different
  # candidates (fusion changes at the boundary): the plan is compiled, and if it is
  # slower than running every layer in one candidate they all may run in, that wins.
  single = min(allowed, key=lambda n: costs[n].seconds)
  if len({row.choice for row in rows}) <= 1 and planned == base_rules:
    compiled = reports[rows[0].choice if rows else base]
  else:
    with _quiet():
      compiled = subject.compile(policies[policy], planned)
  compiled_seconds = cost_lib.program_cost(compiled, layers, launch_seconds=launch_seconds).seconds
  note = ""
  mixed = planned != base_rules
  if compiled_seconds > costs[single].seconds * (1 - (MIX_MARGIN if mixed else 0.0)):
    note = (
      f"the layers' choices compiled together ({len(planned.paths) - len(base_rules.paths)} "
      f"path rules over {policy}) take {1e3 * compiled_seconds:.3f} ms, not {100 * MIX_MARGIN:g}% "
      f"less than every layer in {single} ({1e3 * costs[single].seconds:.3f} ms): the plan is "
      f"{single}; each reason is the layer's own"
    )
    rows = [dataclasses.replace(row, choice=single) for row in rows]
    policy, planned = single, base_rules
    compiled, compiled_seconds = reports[single], costs[single].seconds
  return Plan(
    policy=policies[policy],
    rules=planned,
    rows=tuple(rows),
    target=target,
    candidates=tuple(names),
    step_ms={n: 1e3 * costs[n].seconds for n in names},
    predicted_ms=1e3 * compiled_seconds,
    layer_sum_ms=1e3 * layer_sum,
    launch_seconds=launch_seconds,
    framework=subject.framework,
    reports={**reports, "plan": compiled},
    note=note,
    subject=subject,
  )


def _choose(
  layer: str,
  names: list[str],
  policies: dict[str, policy_lib.Policy],
  costs: dict[str, cost_lib.ProgramCost],
  seconds: dict[str, dict[str, float]],
  numbers: dict[str, dict[str, tuple[float, float]]] | None,
  max_flushed: float,
) -> tuple[str, str, set[str]]:
  """``(candidate, reason, the candidates the layer may run in)`` for one layer."""
  base = names[0]
  fit: dict[str, float] = {base: seconds[base][layer]}
  rejected = []
  for name in names[1:]:
    policy, found = policies[name], costs[name].layers[layer]
    if policy.fp8 is not None and not found.gemms:
      # XLA rewrote the product into kernels that name no layer (a block-scaled
      # dot decomposed for a GPU without block-scaled MMAs): nothing to charge it.
      rejected.append(f"{name}: no GEMM kernel of its program names this layer")
      continue
    if policy.fp8 is not None and found.fp8_gemms < found.gemms:
      rejected.append(f"{name}: its kernels multiply {', '.join(found.multiplies)}")
      continue
    measured = (numbers or {}).get(layer, {}).get(name)
    limit = numerics_lib.threshold_db(policy)
    failed = []
    if measured is not None and limit is not None and measured[0] < limit:
      failed.append(f"SQNR {measured[0]:.1f} dB < {limit:g} dB")
    if measured is not None and policy.fp8 is not None and measured[1] > max_flushed:
      failed.append(f"{100 * measured[1]:.1f}% of values flushed (> {100 * max_flushed:g}%)")
    if failed:
      rejected.append(f"{name}: {', '.join(failed)}")
      continue
    fit[name] = seconds[name][layer]
  here = seconds[base][layer]
  others = {n: t for n, t in fit.items() if n != base}
  best = min(others, key=others.__getitem__) if others else None
  if best is not None and others[best] < here:
    reason = f"{1e3 * (here - others[best]):.3f} ms faster than {base}"
  elif best is not None:
    reason = f"does not pay: {best} {1e3 * others[best]:.3f} ms >= {1e3 * here:.3f} ms"
    best = None
  else:
    reason = ""
  if numbers is not None and layer not in numbers:
    rejected.append("no calibration numerics (a product inside a loop, or a convolution)")
  reason = "; ".join(r for r in (reason, *rejected) if r)
  return (best or base), reason or "no candidate applies", set(fit)
