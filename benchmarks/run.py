"""mpx's benchmark suite: GPT-2 small (linen and NNX) and ResNet-50 under every precision configuration.

One process per (model, configuration), so that each compiles alone and, on
a GPU, reports its own peak memory (``--smoke`` runs them all in this process,
one after the other, since its tiny models have no memory to report). The configurations and models are listed
in ``benchmarks/setups.py``.

CPU mode (always; no accelerator needed): deterministic figures of the
compiled train step (forward, backward, adamw update): XLA's flops and bytes
accessed (``cost_analysis()``), temp bytes (``memory_analysis()``), the bytes
of the residuals autodiff saves for the backward pass (relative to the
float32 step of the same model), the StableHLO ``convert`` ops, and the audit
(:func:`mpx.audit`) half-precision share of matmul FLOPs with its flags. The
table and the JSON report them; ``--smoke`` runs the same at tiny sizes (CI).

GPU mode (added when the workers find a CUDA device): the median step time
over ``--steps`` steps after warm-up, MFU against the device's dense bfloat16
peak, peak memory (``memory_stats()``), the loss-scaling overhead as time
(``mpx_f16`` against the same step without loss scaling; and
``loss_scale_overhead.py``'s ``where`` and ``lax.cond`` skips, timed on the
device), and the GEMM kernels of the compiled HLO with their operand types;
a float32 GEMM in a mixed configuration fails the run.

Target mode (``--target h100``, ``h100x8``, ``a100``...; needs jax's CUDA plugin, no GPU):
each step compiled for that GPU without one, and its optimised program read
(``benchmarks/deviceless.py``): GEMM kernels by backend and the dtypes they
multiply, the fp8 share, XLA's memory for the GPU, kernels launched and bytes
moved, collectives (several GPUs: data-parallel, batch sharded, the rest
replicated), and a roofline estimate of the step time (a model, not a
measurement; no autotuning). GPT-2 (linen) and ResNet-50 by default; JSON in
``results/target_<target>[_smoke].json``. Set ``JAX_PLATFORMS=cpu``.

Usage::

  python benchmarks/run.py                 # full sizes (CPU: compiles only)
  python benchmarks/run.py --smoke         # tiny sizes, in one process (CI)
  python benchmarks/run.py --models resnet50 --configs f32 mpx_bf16
  JAX_PLATFORMS=cpu python benchmarks/run.py --target h100     # compiled for an H100, no GPU
  JAX_PLATFORMS=cpu python benchmarks/run.py --target h100x8   # 8 H100s, data-parallel
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from mpx._src.audit import device_peaks  # noqa: E402  (no JAX backend is initialised by it

#: The models of a ``--target`` run unless ``--models`` says.
TARGET_MODELS = ("gpt2_linen", "resnet50")
#: Saved-residual bytes of the ``mpx_bf16`` step over the float32 step's: at most these.
RESIDUAL_TARGETS = {"gpt2_linen": 0.55, "gpt2_nnx": 0.55, "resnet50": 0.60}


# ------------------------------------------------------------------ the worker


def _audit_fields(report: Any) -> dict[str, Any]:
  return {
    "matmul_flops": report.total_flops,
    "half_flops_share": report.half_flops_share,
    "float32_matmuls": len(report.float32_ops),
    "tf32_matmuls": len(report.tf32_ops),
    "upcast_matmuls": len(report.upcast_ops),
    "float16_sums": sum(r.kind == "sum" for r in report.float16_reductions),
    "float16_exps": sum(r.kind == "exp" for r in report.float16_reductions),
    "bfloat16_sums": sum(r.kind == "sum" and not r.is_float16 for r in report.reductions),
    # FLOPs over the H100 SXM peaks per operand class: an estimate, not a measurement.
    "estimated_matmul_ms_h100": {
      k: 1e3 * v for k, v in report.estimate_matmul_seconds("H100 SXM").items()
    },
    "summary": report.summary(),
  }


def _gpu_figures(
  setup: Any, compiled: Any, report: Any, *, smoke: bool, steps: int
) -> dict[str, Any]:
  import jax
  from harness import gpu_figures, setups

  device = jax.devices()[0]
  carry, batch = setups.device_carry(setup)
  times = gpu_figures.time_steps(compiled, carry, batch, steps=steps, warmup=5)
  step_ms = gpu_figures.median_ms(times)
  peak = gpu_figures.half_peak_tflops(device.device_kind)
  gemms = gpu_figures.gemm_kernels(compiled.as_text())
  figures: dict[str, Any] = {
    "device_kind": device.device_kind,
    "steps": steps,
    "step_ms_median": step_ms,
    "step_ms_min": 1e3 * min(times),
    "matmul_tflops_per_s": report.total_flops / (step_ms / 1e3) / 1e12,
    "peak_name": peak[0] if peak else None,
    "peak_tflops": peak[1] if peak else None,
    "mfu": report.total_flops / (step_ms / 1e3) / (peak[1] * 1e12) if peak else None,
    "peak_memory_bytes": gpu_figures.peak_memory_bytes(),
    "gemms": [g.__dict__ for g in gemms],
    "float32_gemms": sum(g.is_float32 for g in gemms),
  }
  if setup.config == "mpx_f16":  # the same step without loss scaling
    plain = setups.build(setup.model, setup.config, smoke=smoke, loss_scale=None)
    carry_spec, batch_spec = setups.abstract_carry(plain)
    plain_compiled = jax.jit(plain.step, donate_argnums=0).lower(carry_spec, batch_spec).compile()
    carry, batch = setups.device_carry(plain)
    plain_ms = gpu_figures.median_ms(
      gpu_figures.time_steps(plain_compiled, carry, batch, steps=steps, warmup=5)
    )
    figures["no_loss_scaling_step_ms_median"] = plain_ms
    figures["loss_scaling_overhead_ms"] = step_ms - plain_ms
  return figures


def worker(
  model: str,
  config: str,
  *,
  smoke: bool,
  steps: int,
  out: pathlib.Path,
  target: str | None = None,
) -> None:
  """Measures one configuration of one model (compiled for ``target`` if given) and writes its row as JSON."""
  if target:
    from harness import deviceless

    out.write_text(json.dumps(deviceless.row(model, config, target, smoke=smoke), indent=2) + "\n")
    return
  import jax
  from harness import figures, gpu_figures, setups

  import mpx

  start = time.perf_counter()
  setup = setups.build(model, config, smoke=smoke)
  with setups.precision_scope(setup):
    carry, batch = setups.abstract_carry(setup)
    lowered = jax.jit(setup.step, donate_argnums=0).lower(carry, batch)
    compiled = lowered.compile()
    params, _, state = carry
    residuals = figures.saved_residual_bytes(setup.loss_fn, params, state, batch, has_aux=True)
  report = mpx.audit(lowered, policy=setup.policy)
  row: dict[str, Any] = {
    "model": model,
    "config": config,
    "param_count": sum(x.size for x in jax.tree.leaves(params)),
    "param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
    **figures.compiler_figures(compiled),
    "residual_bytes": residuals,
    "converts": figures.count_converts(lowered.as_text()),
    "audit": _audit_fields(report),
    "backend": jax.default_backend(),
  }
  if gpu_figures.is_gpu():
    row["gpu"] = _gpu_figures(setup, compiled, report, smoke=smoke, steps=steps)
  row["seconds"] = time.perf_counter() - start
  out.write_text(json.dumps(row, indent=2) + "\n")
  if row.get("gpu") and config in setups.MIXED and row["gpu"]["float32_gemms"]:
    raise SystemExit(
      f"{model}/{config}: {row['gpu']['float32_gemms']} float32 GEMMs in a mixed configuration"
    )


# ------------------------------------------------------------------ the parent


def _run_worker(job: tuple[str, str], args: argparse.Namespace, tmp: pathlib.Path) -> dict:
  model, config = job
  out = tmp / f"{model}-{config}.json"
  if args.work_dir and out.exists():  # measured by an earlier, interrupted run
    return json.loads(out.read_text())
  if args.deadline is not None and time.monotonic() > args.deadline:
    return {"model": model, "config": config, "not_run": f"past --deadline {args.deadline_s:g} s"}
  if args.smoke:  # tiny models: one process for all, so that CI's smoke run stays under a minute
    try:
      worker(model, config, smoke=True, steps=args.steps, out=out, target=args.target)
    except Exception as e:  # reported in the row, like a failed worker
      return {"model": model, "config": config, "error": f"{type(e).__name__}: {e}"}
    return json.loads(out.read_text())
  command = [sys.executable, __file__, "--worker", model, config, "--worker-out", str(out)]
  command += ["--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
  command += ["--target", args.target] if args.target else []
  try:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"model": model, "config": config, "error": f"timed out after {args.timeout} s"}
  row = json.loads(out.read_text()) if out.exists() else {"model": model, "config": config}
  print(f"{model}/{config}: rc {proc.returncode}, {row.get('seconds', 0):.0f} s", file=sys.stderr)
  if proc.returncode:
    row["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    row["stderr_tail"] = proc.stderr[-4000:]
  return row


def _add_ratios(rows: list[dict]) -> None:
  baselines = {r["model"]: r for r in rows if r["config"] == "f32" and "residual_bytes" in r}
  for row in rows:
    base = baselines.get(row["model"])
    if base is not None and "residual_bytes" in row:
      row["residual_ratio"] = row["residual_bytes"] / base["residual_bytes"]


def _targets(rows: list[dict]) -> list[dict]:
  """The lean-norm targets, each with its measured value."""
  by = {(r["model"], r["config"]): r for r in rows}
  checks = []
  for model, target in RESIDUAL_TARGETS.items():
    mpx_row, hand = by.get((model, "mpx_bf16")), by.get((model, "bf16_flax"))
    if mpx_row and "residual_ratio" in mpx_row:
      checks.append(
        {
          "target": f"{model}: saved residuals of mpx_bf16 / f32 <= {target}",
          "value": round(mpx_row["residual_ratio"], 3),
          "met": mpx_row["residual_ratio"] <= target,
        }
      )
    if mpx_row and hand and "converts" in mpx_row and "converts" in hand:
      checks.append(
        {
          "target": f"{model}: converts of mpx_bf16 <= bf16_flax ({hand['converts']})",
          "value": mpx_row["converts"],
          "met": mpx_row["converts"] <= hand["converts"],
        }
      )
  return checks


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
  return "-" if value is None else format(value / scale, spec)


def format_table(rows: list[dict]) -> str:
  """The CPU-mode (compiler) table, and the GPU table when there are GPU figures."""
  lines = [
    "| model | config | GFLOP | GB accessed | temp MiB | residual MiB | residual ratio | converts "
    "| half-FLOP share | TF32 / upcast matmuls | f16 sums / exps | est. matmul ms (H100) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "error" in r or "not_run" in r:
      why = f"error: {r['error']}" if "error" in r else f"not run: {r['not_run']}"
      lines.append(f"| {r['model']} | {r['config']} | {why} " + "|" * 10)
      continue
    a = r["audit"]
    lines.append(
      f"| {r['model']} | {r['config']} | {_fmt(r['flops'], '.1f', 1e9)} "
      f"| {_fmt(r['bytes_accessed'], '.2f', 1e9)} | {_fmt(r['temp_bytes'], '.0f', 2**20)} "
      f"| {_fmt(r['residual_bytes'], '.0f', 2**20)} | {_fmt(r.get('residual_ratio'), '.3f')} "
      f"| {r['converts']} | {_fmt(a['half_flops_share'], '.3f')} "
      f"| {a['tf32_matmuls']} / {a['upcast_matmuls']} | {a['float16_sums']} / {a['float16_exps']} "
      f"| {a['estimated_matmul_ms_h100']['total']:.3g} |"
    )
  gpu_rows = [r for r in rows if r.get("gpu")]
  if gpu_rows:
    lines += [
      "",
      "| model | config | step ms (median) | MFU | peak memory GiB | f32 GEMMs | loss-scaling ms |",
      "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in gpu_rows:
      g = r["gpu"]
      lines.append(
        f"| {r['model']} | {r['config']} | {g['step_ms_median']:.2f} | {_fmt(g['mfu'], '.3f')} "
        f"| {_fmt(g['peak_memory_bytes'], '.2f', 2**30)} | {g['float32_gemms']} "
        f"| {_fmt(g.get('loss_scaling_overhead_ms'), '.2f')} |"
      )
    g = gpu_rows[0]["gpu"]
    lines.append(
      f"\nMFU: matmul FLOPs per second over the {g['peak_name']} dense bfloat16 peak, "
      f"{g['peak_tflops']} TFLOP/s (device_kind {g['device_kind']!r}); peaks known: "
      + ", ".join(f"{k} {v['half']:g}" for k, v in device_peaks.PEAK_TFLOPS.items())
    )
  return "\n".join(lines)


def _loss_scale_skips_on_gpu(args: argparse.Namespace) -> dict[str, Any]:
  """``loss_scale_overhead.py`` on the device: the ``where`` and ``lax.cond`` skips, timed."""
  out = RESULTS / "loss_scale_overhead_gpu.json"
  command = [sys.executable, str(HERE / "loss_scale_overhead.py"), "--out", str(out)]
  command += ["--repeats", str(args.steps)] + (["--tiny"] if args.smoke else [])
  proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
  if proc.returncode:
    return {"error": proc.stderr[-2000:]}
  report = json.loads(out.read_text())
  return {r["name"]: 1e3 * r["wall_s_median"] for r in report["results"]}


def _target_report(
  rows: list[dict], args: argparse.Namespace, argv: list[str] | None, start: float
) -> int:
  """Writes and prints a ``--target`` run: JSON, then the table."""
  from harness import deviceless, results, setups

  report: dict[str, Any] = {
    **results.header("run", argv, env="JAX_PLATFORMS=cpu"),
    "target": args.target,
    "smoke": args.smoke,
    "note": deviceless.NOTE,
    "roofline_note": deviceless.ROOFLINE_NOTE,
    "collective_note": deviceless.COLLECTIVE_NOTE,
    "measured_step_times": "none: no GPU was used; the roofline figures are a model",
    "configs": {c: setups.CONFIGS[c] for c in args.configs},
    "rows": rows,
    "seconds": time.perf_counter() - start,
  }
  name = f"target_{args.target}" + ("_smoke" if args.smoke else "")
  out = pathlib.Path(args.out or RESULTS / f"{name}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(deviceless.format_table(rows))
  print(f"{len(rows)} configurations in {report['seconds']:.0f} s; JSON: {out}")
  failed = [r for r in rows if "error" in r]
  for r in failed:
    print(f"FAILED {r['model']}/{r['config']}: {r['error']}", file=sys.stderr)
  return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
  from harness import results, setups

  parser = argparse.ArgumentParser(
    description=(__doc__ or "").splitlines()[0],
    epilog="Models: " + ", ".join(setups.MODELS) + ". Configs: " + ", ".join(setups.CONFIGS),
  )
  parser.add_argument("--smoke", action="store_true", help="tiny models (CI)")
  parser.add_argument(
    "--target",
    help="compile for this GPU without one (h100, h100x8, 2xh100x8, a100, h200, b200, l4) "
    "and audit that program; needs jax's CUDA plugin and JAX_PLATFORMS=cpu",
  )
  parser.add_argument(
    "--write-docs",
    action="store_true",
    help="rewrite docs/benchmarks.md's target section from results/target_h100[x8].json",
  )
  parser.add_argument("--models", nargs="+", default=None, metavar="MODEL")
  parser.add_argument("--configs", nargs="+", default=list(setups.CONFIGS), metavar="CONFIG")
  parser.add_argument("--out", help="JSON path (default benchmarks/results/run[_smoke].json)")
  parser.add_argument("--steps", type=int, default=50, help="timed steps per configuration (GPU)")
  parser.add_argument("--jobs", type=int, default=1, help="workers at once (CPU mode)")
  parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
  parser.add_argument(
    "--work-dir", help="keep each worker's JSON here and reuse those present (resume a long run)"
  )
  parser.add_argument(
    "--deadline",
    type=float,
    dest="deadline_s",
    help="start no worker (nor the GPU loss-scaling timings) after this many seconds; the rows "
    "left are reported as not run (a GPU lease of fixed length)",
  )
  parser.add_argument("--worker", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
  parser.add_argument("--worker-out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(
      *args.worker,
      smoke=args.smoke,
      steps=args.steps,
      out=pathlib.Path(args.worker_out),
      target=args.target,
    )
    return 0
  if args.write_docs:
    from harness import deviceless

    multi = RESULTS / "target_h100x8.json"
    deviceless.write_docs(
      HERE.parent / "docs" / "benchmarks.md",
      json.loads((RESULTS / "target_h100.json").read_text()),
      json.loads(multi.read_text()) if multi.exists() else None,
    )
    return 0
  if args.models is None:
    args.models = list(TARGET_MODELS if args.target else setups.MODELS)
  unknown = set(args.models) - set(setups.MODELS) | set(args.configs) - set(setups.CONFIGS)
  if unknown:
    parser.error(f"unknown models/configs {sorted(unknown)}")

  start = time.perf_counter()
  args.deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
  jobs = [(m, c) for m in args.models for c in args.configs]
  with (
    tempfile.TemporaryDirectory() as tmp,
    concurrent.futures.ThreadPoolExecutor(1 if args.smoke else args.jobs) as pool,
  ):
    work = pathlib.Path(args.work_dir or tmp)
    work.mkdir(parents=True, exist_ok=True)
    rows = list(pool.map(lambda job: _run_worker(job, args, work), jobs))
  if args.target:
    return _target_report(rows, args, argv, start)
  _add_ratios(rows)
  report: dict[str, Any] = {
    **results.header("run", argv),
    "smoke": args.smoke,
    "backend": next((r["backend"] for r in rows if "backend" in r), None),
    "configs": {c: setups.CONFIGS[c] for c in args.configs},
    "rows": rows,
    "targets": _targets(rows),
  }
  if report["backend"] == "gpu":
    if args.deadline is None or time.monotonic() < args.deadline:
      report["loss_scale_skips_gpu_ms"] = _loss_scale_skips_on_gpu(args)
    else:
      report["loss_scale_skips_gpu_ms"] = {"not_run": f"past --deadline {args.deadline_s:g} s"}
  else:
    report["gpu"] = "not measured: no GPU in this run"
  report["seconds"] = time.perf_counter() - start
  out = pathlib.Path(args.out or RESULTS / ("run_smoke.json" if args.smoke else "run.json"))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")

  print(format_table(rows))
  for row in rows:
    if row["config"] == "f32" and "audit" in row:
      print(f"\naudit of the float32 baseline, {row['model']}:\n{row['audit']['summary']}")
  print()
  if "loss_scale_skips_gpu_ms" in report:
    print(f"loss-scale skips on the GPU, ms per step: {report['loss_scale_skips_gpu_ms']}")
  for check in report["targets"]:
    print(f"{'met' if check['met'] else 'MISSED'}: {check['target']}: {check['value']}")
  if report["backend"] != "gpu":
    print("GPU figures: not measured (no GPU in this run).")
  print(f"{len(rows)} configurations in {report['seconds']:.0f} s; JSON: {out}")
  failed = [r for r in rows if "error" in r]
  for r in (r for r in rows if "not_run" in r):
    print(f"NOT RUN {r['model']}/{r['config']}: {r['not_run']}", file=sys.stderr)
  for r in failed:
    print(f"FAILED {r['model']}/{r['config']}: {r['error']}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
