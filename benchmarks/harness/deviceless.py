"""The suite's train steps compiled for a GPU this machine does not have, and what that program is.

``run.py --target h100`` (``h100x8``, ``2xh100x8``, ``a100``...) calls :func:`row` once per
(model, configuration): the step is compiled for the target with :func:`mpx.audit`'s
``target=`` (jax's CUDA plugin, deviceless; no GPU is used) and the optimised program is read:
its GEMM and convolution kernels with their backend and the dtypes they multiply, XLA's
buffer assignment for the GPU, the kernels launched and the bytes they read and write, and,
on several GPUs, the collectives. No autotuning runs without the GPU: every kernel is XLA's
default choice for the target.

On several GPUs the step is data-parallel: the batch is sharded over all GPUs (each GPU gets
the single-GPU batch, so the per-GPU program compares with the one-GPU run) and params,
optimizer state and model state are replicated; XLA inserts the gradient all-reduce.

The roofline estimate is a model of the program, not a measurement (the library's,
``mpx._src.audit.roofline``, which the fp8 planner uses too): each kernel takes
``max(FLOPs / peak for its operand dtype, bytes / memory bandwidth)``, summed over the
kernels. It ignores caches (bytes are what each kernel's operands and results occupy: an
upper bound on its traffic), overlap and the efficiency of real kernels. The table's
``roofline ms`` leaves out the launches, as results written before 2026-11-28 did; each
row's JSON adds ``launch_ms`` (kernel launches times 2.7 us, the cost measured on an H200)
and ``with_launch_ms``.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
from jax.sharding import PartitionSpec

import mpx
from mpx._src.audit import roofline as roofline_lib
from mpx._src.audit import targets

from . import setups

NOTE = (
  "no GPU was used: compiled for the target without autotuning (kernel choices are XLA's defaults)"
)
ROOFLINE_NOTE = roofline_lib.NOTE
#: NVLink 4 (H100 SXM): 900 GB/s in both directions together, so 450 GB/s each way.
NVLINK_BYTES_PER_S = {"h100": 450e9, "h200": 450e9, "b200": 900e9, "a100": 300e9}
COLLECTIVE_NOTE = (
  "ring all-reduce model, not a measurement: 2 (n - 1) / n x bytes / NVLink bandwidth per "
  "direction, no overlap with compute"
)


def roofline(report: Any, config: str) -> dict[str, Any] | None:
  """The roofline estimate of one run of a compiled program (``mpx._src.audit.roofline``).

  Args:
    report: a ``TargetReport``.
    config: the configuration (``f32_highest`` takes the float32 peak for float32 operands).

  Returns:
    ``roofline.roofline``'s dict: ``ms`` without the launch term (the figure of results
    written before 2026-11-28), ``launch_ms`` and ``with_launch_ms``; ``None`` when no peak
    is known for the device.
  """
  return roofline_lib.roofline(report, float32_peak=config == "f32_highest")


def _gemm_groups(report: Any) -> list[dict[str, Any]]:
  groups: dict[tuple[str, str, str, str], dict[str, Any]] = {}
  for g in report.gemms:
    key = (g.backend, g.kind, g.lhs_dtype.name, g.rhs_dtype.name)
    entry = groups.setdefault(
      key,
      {"backend": key[0], "kind": key[1], "lhs": key[2], "rhs": key[3], "count": 0, "flops": 0},
    )
    entry["count"] += 1
    entry["flops"] += g.flops
  return sorted(groups.values(), key=lambda e: -e["flops"])


def _collective_groups(report: Any, num_devices: int, gpu: str) -> list[dict[str, Any]]:
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for c in report.collectives:
    entry = groups.setdefault(
      (c.kind, c.dtype.name), {"kind": c.kind, "dtype": c.dtype.name, "count": 0, "bytes": 0}
    )
    entry["count"] += c.count
    entry["bytes"] += c.bytes * c.count
  link = NVLINK_BYTES_PER_S.get(gpu)
  for entry in groups.values():
    if entry["kind"] == "all-reduce" and link and num_devices > 1:
      ring = 2 * (num_devices - 1) / num_devices
      entry["model_ms"] = 1e3 * ring * entry["bytes"] / link
  return sorted(groups.values(), key=lambda e: -e["bytes"])


def _global_batch(batch: Any, num_devices: int) -> Any:
  """The batch of ``num_devices`` GPUs, each with the single-GPU batch."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((num_devices * x.shape[0], *x.shape[1:]), x.dtype), batch
  )


def row(model: str, config: str, target: str, *, smoke: bool) -> dict[str, Any]:
  """Compiles one configuration's train step for ``target`` and returns its row.

  Args:
    model: a key of ``setups.MODELS``.
    config: a key of ``setups.CONFIGS``.
    target: an ``mpx.audit`` target name (``"h100"``, ``"h100x8"``...).
    smoke: the tiny models.

  Returns:
    The row (JSON-ready): the GEMMs by backend and dtypes, the FLOP shares, XLA's memory
    for the target, kernels and bytes, collectives, the roofline estimate and the audit's
    summary.
  """
  start = time.perf_counter()
  target_ = targets.parse(target)
  setup = setups.build(model, config, smoke=smoke)
  with setups.precision_scope(setup):
    carry, batch = setups.abstract_carry(setup)
    n = target_.num_devices
    kwargs: dict[str, Any] = {}
    if n > 1:  # data-parallel: the batch over every GPU, the carry replicated
      batch = _global_batch(batch, n)
      axes = ("hosts", "data") if target_.hosts > 1 else ("data",)
      kwargs = {"in_specs": (None, PartitionSpec(axes)), "mesh_axes": axes}
    report = mpx.audit(jax.jit(setup.step, donate_argnums=0), carry, batch, target=target, **kwargs)
  params = carry[0]
  m = report.memory
  return {
    "model": model,
    "config": config,
    "target": str(target_),
    "device_kind": report.device_kind,
    "num_devices": n,
    "batch_per_gpu": int(jax.tree.leaves(batch)[0].shape[0]) // n,
    "param_count": sum(x.size for x in jax.tree.leaves(params)),
    "param_leaves": len(jax.tree.leaves(params)),
    "gemm_count": len(report.gemms),
    "gemms": _gemm_groups(report),
    "matmul_flops": report.total_flops,
    "half_flops_share": report.half_flops_share,
    "fp8_flops_share": report.fp8_flops_share,
    "float32_gemms": sum(not g.is_half for g in report.gemms),
    "memory": {
      "argument_bytes": m.argument_bytes,
      "output_bytes": m.output_bytes,
      "alias_bytes": m.alias_bytes,
      "temp_bytes": m.temp_bytes,
      "peak_bytes": m.peak_bytes,
    },
    "kernel_count": report.kernel_count,
    "bytes_moved": report.bytes_moved,
    "collectives": _collective_groups(report, n, target_.gpu),
    "roofline": roofline(report, config),
    "lost": list(report.lost),
    "summary": report.summary(),
    "seconds": time.perf_counter() - start,
  }


# ------------------------------------------------------------------ the table


def _mib(x: float | None) -> str:
  return "-" if x is None else f"{x / 2**20:,.0f}"


def _dtype(name: str) -> str:
  return {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}.get(
    name, name.replace("float8_", "f8")
  )


def gemm_cell(row_: dict[str, Any]) -> str:
  """``243 triton bf16`` style: GEMM count per backend and operand dtypes."""
  parts = []
  for g in row_["gemms"]:
    dt = _dtype(g["lhs"]) if g["lhs"] == g["rhs"] else f"{_dtype(g['lhs'])}x{_dtype(g['rhs'])}"
    conv = " conv" if g["kind"] == "convolution" else ""
    parts.append(f"{g['count']} {g['backend']}{conv} {dt}")
  return ", ".join(parts) or "-"


def collective_cell(row_: dict[str, Any]) -> str:
  """``2 all-reduce f32 474 MiB`` style, per kind and dtype."""
  return (
    ", ".join(
      f"{c['count']} {c['kind']} {_dtype(c['dtype'])} {c['bytes'] / 2**20:,.1f} MiB"
      for c in row_["collectives"]
    )
    or "-"
  )


def format_table(rows: list[dict[str, Any]]) -> str:
  """The Markdown table of a ``--target`` run (per GPU), with its notes."""
  multi = any(r.get("num_devices", 1) > 1 for r in rows)
  head = (
    "| model | config | GEMMs (backend, dtypes as multiplied) | half share | fp8 share "
    "| temp MiB | args MiB | kernels | MiB moved | roofline ms |"
  )
  sep = "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
  if multi:
    head += " collectives per GPU (count, dtype, bytes) | all-reduce model ms |"
    sep += "---|---:|"
  lines = [head, sep]
  for r in rows:
    if "error" in r or "not_run" in r:
      why = f"error: {r['error']}" if "error" in r else f"not run: {r['not_run']}"
      lines.append(f"| {r['model']} | {r['config']} | {why} |")
      continue
    roof = r["roofline"]
    line = (
      f"| {r['model']} | {r['config']} | {gemm_cell(r)} | {r['half_flops_share']:.3f} "
      f"| {r['fp8_flops_share']:.3f} | {_mib(r['memory']['temp_bytes'])} "
      f"| {_mib(r['memory']['argument_bytes'])} | {r['kernel_count']:,} "
      f"| {_mib(r['bytes_moved'])} | {'-' if roof is None else format(roof['ms'], '.2f')} |"
    )
    if multi:
      model_ms = sum(c.get("model_ms", 0.0) for c in r["collectives"])
      line += f" {collective_cell(r)} | {model_ms:.2f} |"
    lines.append(line)
  ok = [r for r in rows if "error" not in r and "not_run" not in r]
  if ok:
    first = ok[0]
    lines.append("")
    lines.append(f"* Target {first['target']} ({first['device_kind']}): {NOTE}.")
    if first["roofline"]:
      p = first["roofline"]["peaks_tflops"]
      lines.append(
        f"* Roofline ms: {ROOFLINE_NOTE}; {p['device']} dense peaks (TFLOP/s): "
        + ", ".join(f"{k} {v:g}" for k, v in p.items() if k != "device")
        + f"; memory bandwidth {first['roofline']['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. "
        "float32 operands count at the TF32 peak (JAX's default precision), at the float32 peak "
        "in f32_highest (operand_precision={highest,highest} in the compiled HLO)."
      )
    if multi:
      lines.append(f"* All-reduce model ms: {COLLECTIVE_NOTE}.")
    for r in ok:
      for line in r["lost"]:
        lines.append(f"* lost ({r['model']}/{r['config']}): {line}")
  return "\n".join(lines)


# ------------------------------------------------------------------ the docs

DOCS_BEGIN = "<!-- run.py --write-docs: begin (generated from benchmarks/results/target_*.json) -->"
DOCS_END = "<!-- run.py --write-docs: end -->"
PUBLISHED = (
  "Published measurements: none is quoted. No measured step time of these programs (this GPT-2 "
  "step at batch 8 x 1024 tokens, this ResNet-50 step at batch 64, adamw, JAX) is published; "
  "the public H100 figures we know of (llm.c's GPT-2 124M runs, MLPerf's ResNet-50 time to "
  "train) are other implementations at other batch sizes, and turning them into a step time of "
  "this program would take assumptions we cannot check without a GPU."
)


def _command(report: dict[str, Any]) -> str:
  command = report["command"]
  return command if command.startswith("JAX_PLATFORMS") else f"JAX_PLATFORMS=cpu {command}"


def _jax_version(report: dict[str, Any]) -> str:
  # Results written before harness.results (2026-11-28) name jax's version on its own.
  return report["versions"]["jax"] if "versions" in report else report["jax_version"]


def _loss_scaling_lines(rows: list[dict[str, Any]]) -> list[str]:
  by = {(r["model"], r["config"]): r for r in rows if "error" not in r and "not_run" not in r}
  lines = []
  for model in dict.fromkeys(r["model"] for r in rows):
    f16, bf16 = by.get((model, "mpx_f16")), by.get((model, "mpx_bf16"))
    if f16 is None or bf16 is None:
      continue
    extra = f16["kernel_count"] - bf16["kernel_count"]
    moved = 100 * (f16["bytes_moved"] / bf16["bytes_moved"] - 1)
    lines.append(
      f"* {model}: `mpx_f16` (dynamic loss scaling) launches {extra:+,} kernels over `mpx_bf16` "
      f"({extra / f16['param_leaves']:+.2f} per param leaf, {f16['param_leaves']} leaves) and "
      f"moves {moved:+.2f}% bytes."
    )
  return lines


def _other_collective_lines(rows: list[dict[str, Any]]) -> list[str]:
  """A line per configuration whose program has collectives other than all-reduces."""
  lines = []
  for r in rows:
    other = [c for c in r.get("collectives", []) if c["kind"] != "all-reduce"]
    if other:
      lines.append(
        f"* {r['model']}/{r['config']}: not only the gradient all-reduce: "
        + collective_cell({"collectives": other})
        + " per GPU."
      )
  return lines


def docs_section(single: dict[str, Any], multi: dict[str, Any] | None) -> str:
  """The docs/benchmarks.md section of a one-GPU and a multi-GPU ``--target`` run's JSON."""
  scaling = _loss_scaling_lines(single["rows"])
  lines = [
    DOCS_BEGIN,
    f"### On an {single['target'].upper()} (compiled without a GPU)",
    "",
    f"{NOTE[0].upper()}{NOTE[1:]}. `benchmarks/run.py --target {single['target']}` compiles "
    "each train step (donated carry) for the GPU with jax's CUDA plugin (deviceless ahead-of-time "
    "compilation, `mpx.audit(..., target=...)`) and reads the optimised program: the GEMM and "
    "convolution kernels with their backend and the dtypes they multiply (after the conversions "
    "XLA fused into them), XLA's buffer assignment for the GPU (temp, arguments), the kernels "
    "launched per step and the bytes their operands and results occupy (an upper bound on "
    "traffic). On a real GPU the autotuner may choose other tilings, or cuBLAS instead of "
    "Triton, for a GEMM.",
    "",
    f"Run {single['date']} with jax {_jax_version(single)} on {single['machine']}:",
    "",
    "```",
    _command(single),
    # rows of later runs merged into the JSON, each with the command that made them
    *(f"JAX_PLATFORMS=cpu {c}" for c in single.get("merged_commands", [])),
    *([_command(multi)] if multi else []),
    "python benchmarks/run.py --write-docs   # this section, from the JSON of the two runs",
    "```",
    "",
    format_table(single["rows"]),
    "",
    *([*scaling, ""] if scaling else []),
    PUBLISHED,
  ]
  if multi:
    lines += [
      "",
      f"#### {multi['target']}: data-parallel",
      "",
      f"`--target {multi['target']}`: the batch sharded over the GPUs (each GPU gets the "
      "one-GPU batch above), params, optimizer and model state replicated; the collectives are "
      "the ones XLA inserted, with the bytes each GPU sends per step. Figures per GPU.",
      "",
      format_table(multi["rows"]),
      *_other_collective_lines(multi["rows"]),
    ]
  lines.append(DOCS_END)
  return "\n".join(lines)


def write_docs(doc: pathlib.Path, single: dict[str, Any], multi: dict[str, Any] | None) -> None:
  """Replaces the generated section of ``doc`` (between the markers) with :func:`docs_section`."""
  text = doc.read_text()
  section = docs_section(single, multi)
  if DOCS_BEGIN in text:
    head, rest = text.split(DOCS_BEGIN, 1)
    text = head + section + rest.split(DOCS_END, 1)[1]
  else:  # first time: after the "GPU figures: not measured" subsection
    anchor = "### Saved residuals at full size"
    text = text.replace(anchor, section + "\n\n" + anchor, 1)
  doc.write_text(text)
