"""``fp8_block.py --smoke`` and ``fp8_plan.py --smoke`` in subprocesses, compiled for an H100 without one.

No timing assertions: the scripts' JSON must hold every recipe and model, and every plan must
be no slower than ``mixed_bfloat16`` in the model (skipped without jax's CUDA plugin).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mpx._src.audit import targets

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)


def _run(script, tmp_path, *args):
  out = tmp_path / "out.json"
  proc = subprocess.run(
    [sys.executable, f"benchmarks/{script}", "--smoke", *args, "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=1800,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


def test_fp8_block_smoke(tmp_path):
  report, stdout = _run("fp8_block.py", tmp_path)
  names = [row["name"] for row in report["rows"]]
  assert names[:-1] == [
    "mixed_bfloat16",
    "mixed_float8",
    "mixed_float8_delayed",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_float8_blockwise",
  ]
  assert names[-1] == "plan (compiled)"
  base, plan = report["rows"][0], report["rows"][-1]
  assert plan["with_launch_ms"] <= base["with_launch_ms"]
  for row in report["rows"][1:]:
    assert row["with_launch_ms"] > row["roofline_ms"] > 0 and row["gemm_speedup"] > 0
  assert report["command"].startswith("JAX_PLATFORMS=cpu python benchmarks/fp8_block.py")
  assert "modelled, no autotuning" in report["note"] and "fp8 plan for h100" in stdout


def test_fp8_plan_smoke(tmp_path):
  report, _ = _run("fp8_plan.py", tmp_path, "--models", "gpt2_nnx", "resnet50")
  assert [m["model"] for m in report["models"]] == ["gpt2_nnx", "resnet50"]
  for model in report["models"]:
    assert model["never_slower"] and model["rows"]
    assert "apply_policy(model" in model["code"]
    assert model["plan_seconds"]["wall"] > 0
  assert "blocks/0/attn/query" in {row["path"] for row in report["models"][0]["rows"]}
