"""The header every results file of the benchmarks opens with: what ran, when, where, with what."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import sys
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "numpy", "mpx-mixed-precision")


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "missing"


def header(benchmark: str, argv: list[str] | None = None, *, env: str = "") -> dict[str, Any]:
  """The command, date, package versions and machine of a benchmark run.

  Args:
    benchmark: the script's name without ``.py`` (``"run"``, ``"fp8_speed"``...).
    argv: the script's arguments (``sys.argv[1:]`` when ``None``).
    env: environment settings the command needs, written before it
      (``"JAX_PLATFORMS=cpu"`` for a deviceless GPU-target compile).

  Returns:
    ``{"benchmark", "command", "date", "versions", "machine", "devices"}``; ``devices``
    lists the device kinds jax sees (a deviceless GPU-target run sees the CPU only).
  """
  import jax

  args = sys.argv[1:] if argv is None else argv
  command = " ".join([*([env] if env else []), "python", f"benchmarks/{benchmark}.py", *args])
  return {
    "benchmark": benchmark,
    "command": command,
    "date": datetime.date.today().isoformat(),
    "versions": {name: _version(name) for name in PACKAGES},
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    "devices": sorted({d.device_kind for d in jax.devices()}),
  }
