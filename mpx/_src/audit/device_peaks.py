"""Peak matrix-multiply throughput of common GPUs, per operand class, for estimates only.

Dense figures (no structured sparsity) from NVIDIA's datasheets, in TFLOP/s.
The operand classes are those of :attr:`mpx.diagnostics.MatmulOp.operand_class`:
``"half"`` (float16 and bfloat16 Tensor Cores), ``"tf32"`` (float32 operands
at JAX's default precision, which cuBLAS runs on TF32 Tensor Cores),
``"float32"`` (``precision=HIGHEST``: true float32), ``"float64"`` and
``"fp8"``. Real kernels reach a fraction of these peaks; a time computed from
them is a lower bound.
"""

from __future__ import annotations

import re

from mpx._src import errors

PEAK_TFLOPS: dict[str, dict[str, float]] = {
  "H100 SXM": {"half": 989.0, "tf32": 494.7, "float32": 66.9, "float64": 66.9, "fp8": 1979.0},
  "H100 PCIe": {"half": 756.0, "tf32": 378.0, "float32": 51.2, "float64": 51.2, "fp8": 1513.0},
  "H200": {"half": 989.0, "tf32": 494.7, "float32": 66.9, "float64": 66.9, "fp8": 1979.0},
  "A100": {"half": 312.0, "tf32": 156.0, "float32": 19.5, "float64": 19.5},
  "L40S": {"half": 362.0, "tf32": 183.0, "float32": 91.6, "fp8": 733.0},
  "L4": {"half": 121.0, "tf32": 60.0, "float32": 30.3, "fp8": 242.0},
}

# Substrings of jax's device_kind, most specific first ("NVIDIA H100 80GB HBM3" is an SXM part).
_DEVICE_KINDS = (
  ("H200", "H200"),
  ("H100 PCIe", "H100 PCIe"),
  ("H100", "H100 SXM"),
  ("A100", "A100"),
  ("L40S", "L40S"),
  ("L4", "L4"),
)


def device_name(device: str) -> str | None:
  """Returns the table's name for a device, or ``None`` when the table does not know it.

  Args:
    device: a key of :data:`PEAK_TFLOPS`, or a ``jax.Device.device_kind``
      such as ``"NVIDIA H100 80GB HBM3"``.

  Returns:
    A key of :data:`PEAK_TFLOPS`, or ``None``.
  """
  if device in PEAK_TFLOPS:
    return device
  return next((name for key, name in _DEVICE_KINDS if re.search(rf"\b{key}\b", device)), None)


def peak_tflops(device: str) -> dict[str, float]:
  """Returns the peaks of a device, per operand class.

  Args:
    device: a key of :data:`PEAK_TFLOPS` or a ``jax.Device.device_kind``.

  Returns:
    ``{operand class: TFLOP/s}``.

  Raises:
    ConfigError: the device is not in the table.
  """
  name = device_name(device)
  if name is None:
    raise errors.ConfigError(
      f"No peak throughput is known for the device {device!r}. Pass one of "
      f"{', '.join(PEAK_TFLOPS)} (or a jax device_kind naming one of them)."
    )
  return PEAK_TFLOPS[name]
