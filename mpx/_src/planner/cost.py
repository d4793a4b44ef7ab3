"""The modelled time of each layer of a compiled gradient step, per candidate policy.

Every kernel of a candidate's compiled program (a ``TargetReport``) is timed
with the roofline model plus its launches (:mod:`mpx._src.audit.roofline`)
and charged to the layer that issued it: a GEMM kernel to the layer of its
product (split by share when XLA merged several layers' products), any other
kernel to the layer its ``op_name`` names (quantisation, amax, the split-K
sum...), or to the rest of the program when it names none of the layers the
planner decides on.

Fusion moves work across that line: in a float8 program the activation
before a layer fuses into the kernel that quantises it for that layer, and a
kernel that is "the rest" in the baseline becomes the layer's. So the rest is
taken to cost what it costs in the baseline program, and the difference a
candidate's program shows there is spread over that program's layers in
proportion to the time of their kernels other than GEMMs: the layers' times
then add up, with the baseline's rest, to the candidate's whole program, and
a plan's step time is the baseline's plus the changes of the layers it moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpx._src.audit import layer_paths, roofline


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer's kernels in one candidate's compiled program.

  Attributes:
    seconds: the modelled time of its kernels, with the correction of the
      module docstring.
    gemm_seconds: the part of ``seconds`` in GEMM and convolution kernels.
    flops: the FLOPs of its products.
    fp8_gemms: its GEMM kernels that multiply float8 operands.
    gemms: its GEMM kernels.
    multiplies: the operand dtypes of its GEMM kernels, e.g. ``("bfloat16 x bfloat16",)``.
  """

  seconds: float
  gemm_seconds: float
  flops: float
  fp8_gemms: int
  gemms: int
  multiplies: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """A candidate's compiled program, by layer.

  Attributes:
    seconds: the whole program's modelled time (roofline and launches).
    rest_seconds: the time of the kernels charged to no decided layer.
    layers: ``{layer path: LayerCost}`` (before the correction: see :func:`corrected`).
  """

  seconds: float
  rest_seconds: float
  layers: dict[str, LayerCost]


def owner(path: str, layers: Sequence[str]) -> str | None:
  """The layer of ``layers`` that ``path`` is, or is inside of (the deepest such), else ``None``."""
  best = None
  for layer in layers:
    if (path == layer or path.startswith(layer + "/")) and (best is None or len(layer) > len(best)):
      best = layer
  return best


def decision_layers(reports: Sequence[Any], baseline: Any) -> list[str]:
  """The layers with float8 products in any of the programs, in program order.

  Args:
    reports: the candidates' ``TargetReport`` objects; their ``intended`` audits say
      which products the program asks to compute in float8.
    baseline: the baseline's ``TargetReport``: a float8 product issued by a
      module of the recipe's own inside a layer (delayed scaling's
      ``Fp8DotGeneral_0``) belongs to the layer whose product it replaces,
      the deepest module around it that has a product in the baseline.

  Returns:
    Layer paths as the audit names them (method suffixes dropped: the layer
    of ``wte.attend`` is ``wte``).
  """
  products = {layer_paths.layer_of(op.module_path) for op in baseline.intended.ops}
  found: dict[str, None] = {}
  for report in reports:
    for op in report.intended.ops:
      if op.is_fp8 and op.module_path:
        path = layer_paths.layer_of(op.module_path)
        parts = path.split("/")
        layers = ("/".join(parts[:n]) for n in range(len(parts), 0, -1))
        found[next((p for p in layers if p in products), path)] = None
  return list(found)


def program_cost(report: Any, layers: Sequence[str], *, launch_seconds: float) -> ProgramCost:
  """Charges every kernel of a compiled program to a layer of ``layers`` or to the rest.

  Args:
    report: a ``TargetReport``.
    layers: the decided layers' paths (audit form).
    launch_seconds: the cost of one kernel launch.

  Returns:
    The :class:`ProgramCost`.

  Raises:
    ValueError: no peak is known for the report's device.
  """
  times = roofline.kernel_times(report, launch_seconds=launch_seconds)
  if times is None:
    raise ValueError(f"no peak throughput is known for {report.device_kind}")
  by_kernel: dict[str, list[Any]] = {}
  for g in report.gemms:
    by_kernel.setdefault(g.kernel, []).append(g)
  seconds: dict[str | None, float] = {}
  gemm_seconds: dict[str, float] = {}
  flops: dict[str, float] = {}
  kinds: dict[str, list[Any]] = {}

  def charge(layer: str | None, share: float, t: roofline.KernelTime) -> None:
    seconds[layer] = seconds.get(layer, 0.0) + share * t.seconds
    if layer is not None and t.is_gemm:
      gemm_seconds[layer] = gemm_seconds.get(layer, 0.0) + share * t.seconds

  for t in times:
    products = by_kernel.get(t.name)
    if not products:
      path, _ = layer_paths.module_path(t.op_name.split(";", 1)[0])
      charge(owner(layer_paths.layer_of(path), layers), 1.0, t)
      continue
    total = sum(g.flops for g in products)
    for g in products:
      weight = g.flops / total if total else 1.0 / len(products)
      for path, part in g.merged or ((g.module_path, 1.0),):
        layer = owner(layer_paths.layer_of(path), layers)
        charge(layer, weight * part, t)
        if layer is not None:
          flops[layer] = flops.get(layer, 0.0) + part * g.flops
          kinds.setdefault(layer, []).append(g)
  return ProgramCost(
    seconds=sum(t.seconds for t in times),
    rest_seconds=seconds.get(None, 0.0),
    layers={
      layer: LayerCost(
        seconds=seconds.get(layer, 0.0),
        gemm_seconds=gemm_seconds.get(layer, 0.0),
        flops=flops.get(layer, 0.0),
        fp8_gemms=sum(g.is_fp8 for g in kinds.get(layer, [])),
        gemms=len(kinds.get(layer, [])),
        multiplies=tuple(
          sorted({f"{g.lhs_dtype.name} x {g.rhs_dtype.name}" for g in kinds.get(layer, [])})
        ),
      )
      for layer in layers
    },
  )


def corrected(costs: Mapping[str, ProgramCost], baseline: str) -> dict[str, dict[str, float]]:
  """Each candidate's layer times, with the rest held at the baseline's (see the module docstring).

  Args:
    costs: ``{candidate: ProgramCost}``.
    baseline: the baseline candidate.

  Returns:
    ``{candidate: {layer: seconds}}``: for every candidate, the layers'
    times plus the baseline's rest make the candidate's whole program.
  """
  rest = costs[baseline].rest_seconds
  out = {}
  for name, cost in costs.items():
    moved = cost.rest_seconds - rest  # < 0: the candidate fused some of the rest into layers
    other = {k: c.seconds - c.gemm_seconds for k, c in cost.layers.items()}
    weight = sum(other.values())
    out[name] = {
      k: c.seconds + (moved * other[k] / weight if weight else moved / max(len(cost.layers), 1))
      for k, c in cost.layers.items()
    }
  return out


def step_seconds(
  costs: Mapping[str, ProgramCost],
  layer_seconds: Mapping[str, Mapping[str, float]],
  choice: Callable[[str], str],
  baseline: str,
) -> float:
  """The modelled step time of a plan: the baseline's, plus each moved layer's change."""
  total = costs[baseline].seconds
  for layer in costs[baseline].layers:
    picked = choice(layer)
    total += layer_seconds[picked][layer] - layer_seconds[baseline][layer]
  return total
