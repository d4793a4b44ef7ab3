"""The roofline model of a compiled program, on a made-up report (no compile)."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from mpx._src.audit import roofline


def _gemm(kernel, flops, dtype):
  dt = np.dtype(dtype)
  half = dt.itemsize <= 2
  return types.SimpleNamespace(
    kernel=kernel, flops=flops, dtypes=(dt, dt), is_half=half, is_fp8=dt.itemsize == 1
  )


def _report():
  bandwidth = roofline.memory_bandwidth("h100")
  return types.SimpleNamespace(
    target="h100",
    device_kind="NVIDIA H100 80GB HBM3",
    gemms=[_gemm("gemm_a", 989e9, jnp.bfloat16), _gemm("gemm_b", 494.7e9, np.float32)],
    kernels=[
      # 1 ms of bfloat16 FLOPs against a few bytes: compute-bound.
      {"name": "gemm_a", "op_name": "a", "count": 1, "bytes": 1000},
      # 1 ms of TF32 FLOPs, run twice by a loop (FLOPs are per run already), 4 ms of bytes.
      {"name": "gemm_b", "op_name": "b", "count": 2, "bytes": int(2e-3 * bandwidth)},
      # an elementwise kernel: bytes only, 3 ms.
      {"name": "loop_fusion", "op_name": "c", "count": 3, "bytes": int(1e-3 * bandwidth)},
    ],
  )


def test_roofline_takes_the_slower_of_flops_and_bytes_per_kernel_plus_launches():
  assert roofline.memory_bandwidth("h100") == 3352320000000.0
  report = _report()
  roof = roofline.roofline(report)
  assert roof["compute_bound_ms"] == pytest.approx(1.0)
  assert roof["memory_bound_ms"] == pytest.approx(7.0)
  assert roof["gemm_ms"] == pytest.approx(5.0)
  assert roof["ms"] == pytest.approx(8.0)
  # Six launches (1 + 2 + 3) at the default 2.7 us each.
  assert roofline.LAUNCH_SECONDS == 2.7e-6
  assert roof["launch_ms"] == pytest.approx(6 * 2.7e-3)
  assert roof["with_launch_ms"] == pytest.approx(8.0 + 6 * 2.7e-3)
  assert "not a measurement" in roof["note"]
  assert roofline.roofline(report, launch_seconds=1e-3)["with_launch_ms"] == pytest.approx(14.0)
  # float32 operands at the float32 peak (66.9 TFLOP/s), not TF32's.
  highest = roofline.roofline(report, float32_peak=True)
  assert highest["compute_bound_ms"] == pytest.approx(1.0 + 494.7 / 66.9)


def test_kernel_times_per_kernel_and_unknown_devices():
  times = roofline.kernel_times(_report(), launch_seconds=0.0)
  assert [t.name for t in times] == ["gemm_a", "gemm_b", "loop_fusion"]
  assert [t.is_gemm for t in times] == [True, True, False]
  assert [t.seconds for t in times] == pytest.approx([1e-3, 4e-3, 3e-3])
  report = _report()
  report.device_kind = "an unknown GPU"
  assert roofline.roofline(report) is None and roofline.kernel_times(report) is None
