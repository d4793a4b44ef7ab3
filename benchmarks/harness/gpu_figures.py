"""GPU-only measurements: step time, MFU, peak memory and the GEMM kernels XLA chose.

Used by ``run.py`` only when a CUDA device is present; everything here reads
the device or the GPU-compiled HLO, so nothing of it runs on a CPU (except
:func:`gemm_kernels` on a given HLO text, which the tests exercise).

Peaks are NVIDIA's dense (no structured sparsity) bfloat16 Tensor Core
figures from the datasheets, from the table the audit's time estimate uses
(``mpx._src.audit.device_peaks``: H100 SXM 989 TFLOP/s, H100 PCIe 756, H200 989,
A100 312, L40S 362, L4 121); MFU is the matmul FLOPs of one step (forward and
backward, from :func:`mpx.audit`) per second over that peak, for every
configuration alike (a float32 step is measured against the bfloat16 peak
too, which is what it gives up).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Any

import jax

from mpx._src.audit import device_peaks


def is_gpu() -> bool:
  """Whether JAX's default backend is a GPU."""
  return jax.default_backend() == "gpu"


def half_peak_tflops(device_kind: str) -> tuple[str, float] | None:
  """The dense bfloat16 peak of a device (mpx's table), or ``None`` when the table lacks it.

  Args:
    device_kind: ``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"``.

  Returns:
    ``(the table's name for the device, TFLOP/s)``.
  """
  name = device_peaks.device_name(device_kind)
  return None if name is None else (name, device_peaks.PEAK_TFLOPS[name]["half"])


def time_steps(compiled: Any, carry: Any, batch: Any, *, steps: int, warmup: int) -> list[float]:
  """Seconds per step of ``compiled(carry, batch) -> (carry, loss)``, one by one.

  Args:
    compiled: the compiled train step (its carry may be donated).
    carry: the initial carry, on the device.
    batch: the batch, on the device (the same batch every step).
    steps: timed steps.
    warmup: untimed steps first.

  Returns:
    The wall time of each timed step, from the call to ``block_until_ready``
    of its outputs.
  """
  for _ in range(warmup):
    carry, loss = compiled(carry, batch)
  jax.block_until_ready((carry, loss))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    carry, loss = compiled(carry, batch)
    jax.block_until_ready((carry, loss))
    times.append(time.perf_counter() - start)
  return times


def median_ms(times: list[float]) -> float:
  """The median of ``times`` (seconds) in milliseconds."""
  return 1e3 * statistics.median(times)


def peak_memory_bytes() -> int | None:
  """``peak_bytes_in_use`` of the default device since the process started, if reported."""
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else int(peak)


# ----------------------------------------------------------- GEMMs in the HLO


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One matrix-product kernel of a GPU-compiled HLO module.

  Attributes:
    kind: ``"cublas"``, ``"cublasLt"``, ``"triton"``, ``"cudnn"`` (a cuDNN
      convolution or GEMM fusion) or ``"xla"`` (a dot XLA emitted itself).
    name: the HLO instruction.
    operand_dtypes: the HLO element types of the product's two operands
      (inside the fusion for Triton and cuDNN fusions: what the kernel
      multiplies, after any fused conversion).
    result_dtype: the element type of the product.
    precision: the precision / algorithm text of the product, if any.
  """

  kind: str
  name: str
  operand_dtypes: tuple[str, ...]
  result_dtype: str
  precision: str

  @property
  def is_float32(self) -> bool:
    """Whether an operand is float32 (or wider): not a half-precision GEMM."""
    return any(d in ("f32", "f64") for d in self.operand_dtypes)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_ELEMENT = re.compile(r"^\(?\s*([a-z][a-z0-9]*)\[")  # f32, bf16, f8e4m3fn, f8e5m2


def _split_type(rest: str) -> tuple[str, str]:
  """``"bf16[2,3]{1,0} dot(...)..."`` -> (type, remainder); tuple types are balanced."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].strip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _operands(call: str) -> list[str]:
  """The operand names of ``opcode(%a, %b), attrs`` (shapes before names allowed)."""
  depth, args = 0, ""
  for ch in call[call.index("(") :]:
    depth += {"(": 1, ")": -1}.get(ch, 0)
    args += ch
    if depth == 0:
      break
  return re.findall(r"%([\w.\-]+)", args)


def _element(type_text: str) -> str:
  match = _ELEMENT.match(type_text)
  return match.group(1) if match else "?"


def _precision(call: str) -> str:
  found = re.findall(
    r'(operand_precision"?\s*[:=]\s*(?:\[[^\]]*\]|\{[^}]*\})|algorithm"?\s*[:=]\s*"?\w+)', call
  )
  return "; ".join(found)


def gemm_kernels(hlo_text: str) -> list[Gemm]:
  """Lists the GEMM and convolution kernels of a GPU-compiled HLO module.

  Reads ``compiled.as_text()``: cuBLAS / cuBLASLt custom calls
  (``__cublas$gemm``, ``__cublas$lt$matmul``), cuDNN convolutions
  (``__cudnn$conv...``), fusions whose backend kind is a Triton GEMM
  (``__triton_gemm``, ``__triton_nested_gemm_fusion``) or a cuDNN fusion, and
  dots left in other fusions or at top level.

  Args:
    hlo_text: the optimized HLO text of a module compiled for a GPU.

  Returns:
    One :class:`Gemm` per kernel, in text order.
  """
  types: dict[str, str] = {}
  computations: dict[str, list[tuple[str, str, str]]] = {}
  current = None
  for line in hlo_text.splitlines():
    if (comp := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
      current = comp.group(1)
      computations[current] = []
      for param, param_type in re.findall(r"([\w.\-]+):\s*([a-z]+\d*\[[^\]]*\])", line):
        types[param] = param_type
      continue
    match = _INSTRUCTION.match(line)
    if match is None:
      continue
    name, rest = match.groups()
    type_text, call = _split_type(rest)
    types[name] = type_text
    if current is not None:
      computations[current].append((name, type_text, call))

  def product_in(computation: str) -> tuple[str, str, str] | None:
    for name, type_text, call in computations.get(computation, []):
      if call.startswith(("dot(", "convolution(")):
        return name, type_text, call
    return None

  gemms, inside = [], set()
  for instructions in computations.values():
    for name, type_text, call in instructions:
      kind = product = None
      target = re.search(r'custom_call_target="([^"]+)"', call)
      if call.startswith("custom-call(") and target:
        t = target.group(1)
        if t.startswith("__cublas$lt"):
          kind = "cublasLt"
        elif t.startswith("__cublas"):
          kind = "cublas"
        elif t.startswith("__cudnn$conv"):
          kind = "cudnn"
        if kind:
          product = (name, type_text, call)
      elif call.startswith("fusion("):
        backend = re.search(r'"kind"\s*:\s*"([^"]+)"', call)
        called = re.search(r"calls=%([\w.\-]+)", call)
        if backend and called and ("triton" in backend.group(1) or "cudnn" in backend.group(1)):
          found = product_in(called.group(1))
          if found is None:  # a nested Triton fusion: look one level down
            for _, _, inner in computations.get(called.group(1), []):
              sub = re.search(r"calls=%([\w.\-]+)", inner)
              found = found or (product_in(sub.group(1)) if sub else None)
          if found is not None:
            kind = "triton" if "triton" in backend.group(1) else "cudnn"
            product = found
            inside.add(found[0])
      if kind is None or product is None:
        continue
      operands = [_element(types.get(o, "?")) for o in _operands(product[2])[:2]]
      gemms.append(
        Gemm(kind, name, tuple(operands), _element(product[1]), _precision(product[2] + call))
      )
  for instructions in computations.values():
    for name, type_text, call in instructions:
      if call.startswith(("dot(", "convolution(")) and name not in inside:
        operands = [_element(types.get(o, "?")) for o in _operands(call)[:2]]
        gemms.append(Gemm("xla", name, tuple(operands), _element(type_text), _precision(call)))
  return gemms
