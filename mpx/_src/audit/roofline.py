"""A roofline model of a program compiled for a GPU: a time per kernel from its FLOPs, bytes and launch.

A model, not a measurement. Each kernel of a :class:`TargetReport` takes
``max(FLOPs / dense peak for its operands' class, bytes / memory bandwidth)``
per execution, plus a fixed launch cost; the program takes the sum. It
ignores caches (a kernel's bytes are what its operands and results occupy: an
upper bound on its traffic), overlap between kernels, and how far real
kernels stay below the peaks; no autotuning ran, so the kernels are XLA's
defaults for the target. The peaks are NVIDIA's dense datasheet figures
(``mpx._src.audit.device_peaks``), the bandwidth the target spec's.

The launch term: a kernel that moves a few KiB still costs the time to launch
it and drain it. :data:`LAUNCH_SECONDS` is 2.7 µs per kernel, the cost per
kernel measured on an H200 (jax 0.11.2) in the project's GPU session of
2026-11-26, as quoted in issue 36; it was not re-measured for an H100, and
every function here takes the figure as a parameter.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mpx._src.audit import device_peaks, targets

#: Seconds per kernel launch (see the module docstring for where it comes from).
LAUNCH_SECONDS = 2.7e-6
NOTE = (
  "roofline model, not a measurement; no autotuning: sum over kernels of max(FLOPs / dense "
  "peak for the kernel's operand dtype, bytes / memory bandwidth)"
)


@dataclasses.dataclass(frozen=True)
class KernelTime:
  """The modelled time of one kernel of a compiled program, over all its executions.

  Attributes:
    name: the kernel's instruction name.
    op_name: its JAX name stack.
    compute_seconds: its FLOPs over the peak of their operand class.
    memory_seconds: its bytes over the memory bandwidth.
    launches: its executions per run.
    launch_seconds: the cost of one launch.
    is_gemm: whether it computes a matrix product or a convolution.
  """

  name: str
  op_name: str
  compute_seconds: float
  memory_seconds: float
  launches: int
  launch_seconds: float
  is_gemm: bool

  @property
  def bound_seconds(self) -> float:
    """``max(compute, memory)``: the roofline without the launch."""
    return max(self.compute_seconds, self.memory_seconds)

  @property
  def seconds(self) -> float:
    """The roofline plus the launches."""
    return self.bound_seconds + self.launches * self.launch_seconds


def memory_bandwidth(gpu: str) -> float:
  """The memory bandwidth (bytes/s) of a GPU of ``targets.GPUS``, from its target spec."""
  match = re.search(r"memory_bandwidth:\s*(\d+)", targets.spec_text(gpu))
  if match is None:
    raise ValueError(f"no memory_bandwidth in the target spec of {gpu}")
  return float(match.group(1))


def operand_class(gemm: Any, *, float32_peak: bool = False) -> str:
  """The ``device_peaks`` operand class of a compiled product: the wider of its operands'.

  Args:
    gemm: a ``TargetGemm``.
    float32_peak: float32 operands at the float32 peak (``precision=HIGHEST``)
      rather than TF32's (JAX's default precision).

  Returns:
    ``"fp8"``, ``"half"``, ``"float64"``, ``"float32"`` or ``"tf32"``.
  """
  if gemm.is_fp8:
    return "fp8"
  if gemm.is_half:
    return "half"
  if any(d.name == "float64" for d in gemm.dtypes):
    return "float64"
  return "float32" if float32_peak else "tf32"


def peaks(report: Any) -> tuple[str, dict[str, float], float] | None:
  """``(device name, dense peaks in TFLOP/s, memory bandwidth in bytes/s)``; ``None`` if unknown."""
  name = device_peaks.device_name(report.device_kind)
  if name is None:
    return None
  return name, device_peaks.PEAK_TFLOPS[name], memory_bandwidth(targets.parse(report.target).gpu)


def kernel_times(
  report: Any, *, float32_peak: bool = False, launch_seconds: float = LAUNCH_SECONDS
) -> list[KernelTime] | None:
  """The modelled time of every kernel of a compiled program.

  Args:
    report: a ``TargetReport``.
    float32_peak: see :func:`operand_class`.
    launch_seconds: the cost of one kernel launch.

  Returns:
    One :class:`KernelTime` per kernel of ``report.kernels``, in program
    order; ``None`` when no peak is known for the device.
  """
  found = peaks(report)
  if found is None:
    return None
  _, peak, bandwidth = found
  flops: dict[str, dict[str, float]] = {}  # kernel -> operand class -> FLOPs per run
  for g in report.gemms:
    per = flops.setdefault(g.kernel, {})
    cls = operand_class(g, float32_peak=float32_peak)
    per[cls] = per.get(cls, 0.0) + g.flops
  return [
    KernelTime(
      name=k["name"],
      op_name=k["op_name"],
      compute_seconds=sum(f / (peak[c] * 1e12) for c, f in flops.get(k["name"], {}).items()),
      memory_seconds=k["bytes"] * k["count"] / bandwidth,
      launches=k["count"],
      launch_seconds=launch_seconds,
      is_gemm=k["name"] in flops,
    )
    for k in report.kernels
  ]


def roofline(
  report: Any, *, float32_peak: bool = False, launch_seconds: float = LAUNCH_SECONDS
) -> dict[str, Any] | None:
  """The roofline estimate of one run of a compiled program (see the module docstring).

  Args:
    report: a ``TargetReport``.
    float32_peak: see :func:`operand_class`.
    launch_seconds: the cost of one kernel launch.

  Returns:
    ``ms`` (the roofline without launches), ``launch_ms`` (launches times
    ``launch_seconds``), ``with_launch_ms`` (their sum), ``compute_bound_ms`` /
    ``memory_bound_ms`` (the share of ``ms`` from kernels bound by one or
    the other), ``gemm_ms`` (the GEMM and convolution kernels' part of
    ``ms``), the peaks and bandwidth used and the note; ``None`` when no peak
    is known for the device.
  """
  times = kernel_times(report, float32_peak=float32_peak, launch_seconds=launch_seconds)
  found = peaks(report)
  if times is None or found is None:
    return None
  name, peak, bandwidth = found
  compute = sum(t.compute_seconds for t in times if t.compute_seconds > t.memory_seconds)
  memory = sum(t.memory_seconds for t in times if t.compute_seconds <= t.memory_seconds)
  launch = sum(t.launches * t.launch_seconds for t in times)
  return {
    "ms": 1e3 * (compute + memory),
    "launch_ms": 1e3 * launch,
    "with_launch_ms": 1e3 * (compute + memory + launch),
    "launch_us_per_kernel": 1e6 * launch_seconds,
    "compute_bound_ms": 1e3 * compute,
    "memory_bound_ms": 1e3 * memory,
    "gemm_ms": 1e3 * sum(t.bound_seconds for t in times if t.is_gemm),
    "peaks_tflops": {"device": name, **peak},
    "memory_bandwidth_bytes_per_s": bandwidth,
    "note": NOTE,
  }
