"""Tests of the GPU-target benchmarks: ``run.py --target``, ``loss_scale_kernels.py`` and others.

The table of ``deviceless.py`` on made-up rows, the
docs section rendered from the committed results, and ``--target h100
--smoke`` / ``--target h100x8 --smoke`` / ``loss_scale_kernels.py --smoke``
in subprocesses (compiled for the GPU without one; skipped without jax's
CUDA plugin). No timing assertions.
"""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import deviceless, setups

from mpx._src.audit import targets

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------- run.py --target


def test_target_table_cells():
  row = {
    "gemms": [
      {"backend": "triton", "kind": "dot", "lhs": "bfloat16", "rhs": "bfloat16", "count": 3},
      {"backend": "cudnn", "kind": "convolution", "lhs": "float16", "rhs": "float32", "count": 1},
    ],
    "collectives": [{"kind": "all-reduce", "dtype": "float32", "count": 2, "bytes": 3 * 2**20}],
  }
  assert deviceless.gemm_cell(row) == "3 triton bf16, 1 cudnn conv f16xf32"
  assert deviceless.collective_cell(row) == "2 all-reduce f32 3.0 MiB"


needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(), reason="jax's CUDA plugin (the gpu-target extra) is missing"
)
TARGET_CONFIGS = ["f32", "mpx_f16"]  # float32 and a mixed step with loss scaling


def _run_target(tmp_path, target, models, configs):
  out = tmp_path / f"target_{target}.json"
  proc = subprocess.run(
    [
      sys.executable,
      str(ROOT / "benchmarks" / "run.py"),
      "--target",
      target,
      "--smoke",
      "--models",
      *models,
      "--configs",
      *configs,
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=1800,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert [(r["model"], r["config"]) for r in report["rows"]] == [
    (m, c) for m in models for c in configs
  ]
  assert not [r for r in report["rows"] if "error" in r]
  assert "no GPU was used" in report["note"] and "not a measurement" in report["roofline_note"]
  assert "roofline model, not a measurement" in proc.stdout
  return report


@needs_plugin
def test_run_target_h100_smoke(tmp_path):
  """``run.py --target h100 --smoke``: what the compiled H100 program multiplies, and its memory."""
  report = _run_target(tmp_path, "h100", ["gpt2_linen", "resnet50"], TARGET_CONFIGS)
  for row in report["rows"]:
    assert row["target"] == "h100" and "H100" in row["device_kind"]
    assert row["gemm_count"] > 0 and sum(g["count"] for g in row["gemms"]) == row["gemm_count"]
    if row["config"] == "f32":
      assert row["half_flops_share"] == 0.0 and row["float32_gemms"] == row["gemm_count"]
      assert {(g["lhs"], g["rhs"]) for g in row["gemms"]} == {("float32", "float32")}
    else:  # every product of a mixed configuration multiplies half-precision operands
      assert row["half_flops_share"] == 1.0 and row["float32_gemms"] == 0, row["gemms"]
    if row["model"] == "resnet50":
      assert any(g["kind"] == "convolution" for g in row["gemms"])
    assert row["fp8_flops_share"] == 0.0 and not row["lost"]
    memory = row["memory"]
    assert memory["argument_bytes"] > 0 and memory["temp_bytes"] > 0
    assert memory["output_bytes"] > 0 and memory["alias_bytes"] > 0  # the carry is donated
    assert row["kernel_count"] > row["gemm_count"] and row["bytes_moved"] > 0
    assert row["collectives"] == []
    assert row["roofline"]["ms"] > 0 and row["roofline"]["gemm_ms"] <= row["roofline"]["ms"]
  by = {(r["model"], r["config"]): r for r in report["rows"]}
  for model in ("gpt2_linen", "resnet50"):  # half-precision activations: less temp memory
    assert by[model, "mpx_f16"]["memory"]["temp_bytes"] < by[model, "f32"]["memory"]["temp_bytes"]


@needs_plugin
def test_run_target_h100x8_smoke_has_the_gradient_all_reduce(tmp_path):
  """``run.py --target h100x8 --smoke``: data-parallel, so the gradients are all-reduced."""
  report = _run_target(tmp_path, "h100x8", ["gpt2_linen"], ["mpx_bf16"])
  (row,) = report["rows"]
  assert row["num_devices"] == 8 and row["batch_per_gpu"] == _gpt_smoke_batch()
  all_reduce = [c for c in row["collectives"] if c["kind"] == "all-reduce"]
  assert all_reduce and all(c["bytes"] > 0 and c["count"] > 0 for c in all_reduce)
  # at least the gradients of every parameter (half precision or wider) cross the GPUs
  assert sum(c["bytes"] for c in all_reduce) >= 2 * row["param_count"]
  assert all(c["model_ms"] > 0 for c in all_reduce)
  assert "all-reduce" in report["rows"][0]["summary"]


def _gpt_smoke_batch():
  from harness import gpt

  return gpt.GPTConfig.smoke().batch_size


def test_docs_target_section_is_the_rendering_of_the_results():
  """docs/benchmarks.md's H100 section is ``run.py --write-docs`` of the committed JSON, verbatim."""
  results = ROOT / "benchmarks" / "results"
  single = json.loads((results / "target_h100.json").read_text())
  multi_path = results / "target_h100x8.json"
  multi = json.loads(multi_path.read_text()) if multi_path.exists() else None
  assert not single["smoke"] and single["target"] == "h100"
  doc = (ROOT / "docs" / "benchmarks.md").read_text()
  assert deviceless.docs_section(single, multi) in doc
  for row in single["rows"]:
    if row["config"] in setups.MIXED:
      assert row["half_flops_share"] == 1.0, (row["model"], row["config"])


def _smoke(script, *args):
  """Runs ``benchmarks/<script> --smoke`` on CPU; its completed process, having succeeded."""
  proc = subprocess.run(
    [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=1200,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@needs_plugin
def test_loss_scale_kernels_smoke():
  """``loss_scale_kernels.py --smoke``: the kernels dynamic loss scaling adds, on the H100 program."""
  proc = _smoke("loss_scale_kernels.py")
  summaries = re.findall(r"vs (.+?): ([+-]\d+) kernels", proc.stdout)
  assert [label for label, _ in summaries] == ["mpx_f16 without loss scaling", "mpx_bf16"]
  assert all(int(n) > 0 for _, n in summaries)  # the check and the state update are kernels
  assert "reduce_min" in proc.stdout  # the finite check (the first non-finite leaf), by op name
  assert "while" not in proc.stdout  # the leaf index needs no loop


@needs_plugin
def test_fp8_recipes_smoke(tmp_path):
  """``fp8_recipes.py --smoke``: each recipe's GEMMs are float8 on its GPU (blockwise: bfloat16
  on the H100, reported lost), SQNR above 20 dB."""
  out = tmp_path / "fp8_recipes_smoke.json"
  proc = _smoke("fp8_recipes.py", "--out", str(out))
  report = json.loads(out.read_text())
  assert [r["policy"] for r in report["rows"]] == [
    "mixed_float8",
    "mixed_float8_delayed",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_float8_blockwise",
  ]
  for row in report["rows"]:
    assert row["gemms"] == 11 and min(row["sqnr_db"].values()) > 20, row
    if row["policy"] == "mixed_float8_blockwise":  # no Hopper GEMM applies per-128 scales
      assert row["fp8_flops_share"] == 0.0 and row["lost"], row
    else:
      assert row["fp8_flops_share"] == 1.0 and not row["lost"], row
  assert "no autotuning" in proc.stdout and "| mixed_mxfp8 | b200 |" in proc.stdout


@needs_plugin
def test_chunked_xent_smoke(tmp_path):
  """``chunked_xent.py --smoke``: the unfused and the chunked head loss on the H100 program."""
  out = tmp_path / "chunked_xent_smoke.json"
  proc = _smoke("chunked_xent.py", "--out", str(out))
  report = json.loads(out.read_text())
  assert report["command"].startswith("JAX_PLATFORMS=cpu python benchmarks/chunked_xent.py")
  assert [row["loss"] for row in report["rows"]] == ["unfused", "chunked"], report["rows"]
  for row in report["rows"]:
    assert row["kernels"] > 0 and row["gb_moved"] > 0 and row["temp_mib"] >= 0, row
  assert "no autotuning" in proc.stdout


# ------------------------------------------------------------- scaling_plan.py


def test_scaling_plan_reads_every_form_of_replica_groups():
  import scaling_plan

  # The iota form: 2 groups of 8, devices in order (tensor parallelism within each host).
  assert scaling_plan.replica_groups("replica_groups=[2,8]<=[16], x=1", 16) == [
    list(range(8)),
    list(range(8, 16)),
  ]
  # Transposed: 8 groups of 2, one GPU of each host (FSDP across hosts).
  groups = scaling_plan.replica_groups("replica_groups=[8,2]<=[2,8]T(1,0)", 16)
  assert groups[0] == [0, 8] and groups[7] == [7, 15]
  assert scaling_plan.replica_groups("replica_groups={{0,2},{1,3}}", 4) == [[0, 2], [1, 3]]
  assert scaling_plan.replica_groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]
  assert scaling_plan.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
  # The mesh form: the groups run along the named axes of a mesh of device ids.
  within = (
    "replica_groups=mesh['axis_0'=8,'axis_1'=1,'axis_2'=2], device_ids=([2,8]T(1,0)) {'axis_0'}"
  )
  assert scaling_plan.replica_groups(within, 16) == [list(range(8)), list(range(8, 16))]
  across = scaling_plan.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0'}", 16)
  assert across == [[i, i + 8] for i in range(8)]
  with pytest.raises(ValueError, match="cannot read"):
    scaling_plan.replica_groups("replica_groups=<an unknown form>", 4)


@needs_plugin
def test_scaling_plan_smoke_shards_the_state_and_gathers_float8_weights(tmp_path):
  """``scaling_plan.py --smoke``: a tiny Llama, FSDP over 8 GPUs under ``mixed_float8``."""
  from harness import llama

  out = tmp_path / "scaling_plan_smoke.json"
  proc = subprocess.run(
    [sys.executable, str(ROOT / "benchmarks" / "scaling_plan.py"), "--smoke", "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "no autotuning" in proc.stdout and "not a measurement" in proc.stdout
  report = json.loads(out.read_text())
  assert report["smoke"] and "no GPU was used" in report["note"]
  (row,) = report["rows"]
  assert (row["model"], row["target"], row["policy"], row["layout"]) == (
    "tiny",
    "h100x8",
    "mixed_float8",
    "fsdp",
  )
  n = row["num_devices"]
  assert n == 8 and row["mesh"] == {"data": 8}
  memory = row["memory"]
  assert memory["fits"] and memory["temp_bytes"] > 0
  assert memory["total_bytes"] + memory["headroom_bytes"] == memory["device_bytes"]
  # FSDP: each GPU holds 1/8 of the float32 params and of adamw's two moments (the
  # norm scales, the step count and the loss scale are replicated, a few KiB).
  state = 3 * row["param_bytes"] / n
  assert state < memory["argument_bytes"] < 1.02 * state, (memory, row["param_bytes"])
  for c in row["collectives"]:
    assert {"kind", "dtype", "group_size", "across_hosts", "count", "bytes", "model_ms"} <= set(c)
    assert c["group_size"] == n and not c["across_hosts"]  # one host
  gathered = collections.Counter()
  for c in row["collectives"]:
    if c["kind"] == "all-gather":
      gathered[c["dtype"]] += c["bytes"]
  # The blocks' weights are gathered in float8 (one byte each), every layer's at least
  # once: the scan body's gathers count once per layer.
  config = llama.TINY
  kv = config.num_kv_heads * config.head_dim
  block_weights = (
    config.num_layers * config.features * (2 * config.features + 2 * kv + 3 * config.mlp_hidden)
  )
  assert gathered["float8_e4m3fn"] >= block_weights / n, gathered
  assert gathered["float8_e4m3fn"] > 10 * (gathered["bfloat16"] + gathered["float32"]), gathered
  flops, t = row["flops"], row["time"]
  # nn.remat recomputes the forward: the program multiplies more than the model's FLOPs.
  assert flops["matmul_executed_per_gpu"] > flops["model_per_gpu"]
  assert flops["matmul_executed_by_class"]["fp8"] > flops["matmul_executed_by_class"]["half"]
  assert 0 < t["step_ms_overlapped"] <= t["step_ms_serial"]
  assert t["comm_across_hosts_ms"] == 0 and 0 < t["mfu_serial"] <= t["mfu_overlapped"] < 1
