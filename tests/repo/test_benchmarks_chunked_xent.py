"""``chunked_xent.py --smoke`` in a subprocess, compiled for an H100 without one.

No timing assertions: the JSON must hold both losses for the head, and the chunked one must
hold no ``[tokens, vocab]`` logits in its temporaries where the unfused one does (skipped
without jax's CUDA plugin).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mpx._src.audit import targets

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(
    not targets.plugin_available(),
    reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
  ),
]


def test_chunked_xent_smoke(tmp_path):
  out = tmp_path / "out.json"
  proc = subprocess.run(
    [sys.executable, "benchmarks/chunked_xent.py", "--smoke", "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=900,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["command"].startswith("JAX_PLATFORMS=cpu python benchmarks/chunked_xent.py")
  losses = {row["loss"].split(" ")[0] for row in report["rows"]}
  assert losses == {"unfused", "chunked"}, report["rows"]
  for row in report["rows"]:
    assert row["kernels"] > 0 and row["gb_moved"] > 0 and row["temp_mib"] >= 0, row
