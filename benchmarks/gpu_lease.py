"""One lease of a GPU, measured in full: mpx beside what users write by hand, with the model's prediction.

Usage::

  BUDGET=480 OUT=/tmp/gpu bash benchmarks/gpu_lease.sh          # on a GPU machine
  python benchmarks/gpu_lease.py --smoke --out /tmp/lease       # anywhere: tiny models

Each study runs in a worker process of its own, under its own share of the
time budget (compile time included), in order of value:

* ``gpt2``: GPT-2 small (batch 8, context 1024) under f32 (TF32), ``bf16_flax``,
  ``mpx_bf16``, ``jmp_f16``, ``mpx_f16`` and ``mpx_f16`` without loss scaling;
* ``resnet50``: ResNet-50 at batch 256, the same and ``mpx_bf16_flax_norms``;
* ``launch``: the cost of one more kernel launch, from chains of N tiny kernels;
* ``llama_block``: a Llama-style decoder block at width 4096 (``fp8_block.py``'s),
  its gradient step under ``mixed_bfloat16`` and each float8 recipe.

A worker compiles its configurations in parallel threads, then times them
*interleaved*: ``--rounds`` rounds, each running every configuration for
``--steps`` steps, so that clock and thermal drift hits all of them alike; the
step time is the median over every timed step. Beside it: XLA's planned memory
of the program (its buffer assignment: arguments, outputs, temporaries), the
process's peak, and the roofline model's prediction for the same step
(``mpx.audit(..., target=<this GPU>)``, compiled without autotuning, with the
launch cost per kernel), so that each lease also tells how far the model can be
trusted. Writes ``OUT/gpu_lease.json`` and ``OUT/gpu_lease.md`` (the table for
docs/benchmarks.md, with device, date, versions and command).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: The studies, in order of value, and the configurations each times (harness/setups.py's names;
#: "<config>/no_loss_scale" is the same step without loss scaling).
STUDIES: dict[str, dict[str, Any]] = {
  "gpt2": {
    "model": "gpt2_linen",
    "configs": ["f32", "bf16_flax", "mpx_bf16", "jmp_f16", "mpx_f16", "mpx_f16/no_loss_scale"],
  },
  "resnet50": {
    "model": "resnet50",
    "batch_size": 256,
    "configs": [
      "f32",
      "bf16_flax",
      "mpx_bf16",
      "mpx_bf16_flax_norms",
      "jmp_f16",
      "mpx_f16",
      "mpx_f16/no_loss_scale",
    ],
  },
  "launch": {},
  "llama_block": {},
}
#: Which configuration each is compared with: (numerator, denominator, what the ratio says).
RATIOS = (
  ("mpx_bf16", "bf16_flax", "mpx bf16 / Flax by hand (target <= 1.00)"),
  ("mpx_f16", "jmp_f16", "mpx f16 / jmp (target <= 1.00)"),
  ("f32", "mpx_bf16", "float32 (TF32) / mpx bf16: the speedup"),
  ("mixed_bfloat16", "mixed_float8", "bf16 / fp8 tensorwise: fp8's speedup"),
  ("mixed_bfloat16", "mixed_float8_rowwise", "bf16 / fp8 rowwise: fp8's speedup"),
  ("mixed_bfloat16", "mixed_mxfp8", "bf16 / MXFP8: fp8's speedup"),
)
_TARGETS = {"H100": "h100", "H200": "h200", "A100": "a100", "B200": "b200", "L4": "l4"}


def _target_of(device_kind: str) -> str | None:
  return next((t for name, t in _TARGETS.items() if name in device_kind), None)


# ------------------------------------------------------------------ a worker


def _build(model: str, config: str, *, smoke: bool, batch_size: int | None) -> Any:
  from harness import setups

  base, _, variant = config.partition("/")
  loss_scale = None if variant == "no_loss_scale" else "dynamic"
  return setups.build(model, base, smoke=smoke, loss_scale=loss_scale, batch_size=batch_size)


def _compile(setup: Any, predict_for: str | None) -> dict[str, Any]:
  """The compiled step, its planned memory and kernels, and the model's prediction."""
  import jax
  from harness import setups

  import mpx

  with setups.precision_scope(setup):
    carry, batch = setups.abstract_carry(setup)
    start = time.perf_counter()
    compiled = jax.jit(setup.step, donate_argnums=0).lower(carry, batch).compile()
    compile_s = time.perf_counter() - start
    predicted = None
    if predict_for is not None:
      report = mpx.audit(jax.jit(setup.step, donate_argnums=0), carry, batch, target=predict_for)
      predicted = _predicted_ms(report)
  memory = compiled.memory_analysis()
  planned = None
  if memory is not None:
    planned = int(
      memory.argument_size_in_bytes
      + memory.output_size_in_bytes
      - memory.alias_size_in_bytes
      + memory.temp_size_in_bytes
    )
  return {"compiled": compiled, "compile_s": compile_s, "planned": planned, "predicted": predicted}


def _predicted_ms(report: Any) -> float | None:
  """The roofline model's step time of a compiled program, launches included; ``None`` if unknown."""
  from mpx._src.audit import roofline

  found = roofline.roofline(report)
  return None if found is None else found["with_launch_ms"]


def _time_interleaved(
  runs: dict[str, Callable[[], Any]], *, rounds: int, steps: int, warmup: int = 3
) -> dict[str, list[float]]:
  """Seconds per step of each configuration, the configurations taking turns round by round.

  Args:
    runs: per configuration, a function that runs one step and returns what to wait for.
    rounds: timed rounds; a first, untimed round of ``warmup`` steps each warms them up.
    steps: steps per configuration and round.
    warmup: steps per configuration in the untimed round.

  Returns:
    Per configuration, the seconds of each timed step.
  """
  import jax

  times: dict[str, list[float]] = {name: [] for name in runs}
  for round_ in range(rounds + 1):
    for name, run in runs.items():
      for _ in range(steps if round_ else warmup):
        start = time.perf_counter()
        jax.block_until_ready(run())
        if round_:
          times[name].append(time.perf_counter() - start)
  return times


def _carried(compiled: Any, carry: Any, batch: Any) -> Callable[[], Any]:
  """One train step that carries its own state from call to call."""
  state = {"carry": carry}

  def run() -> Any:
    state["carry"], loss = compiled(state["carry"], batch)
    return state["carry"], loss

  return run


def _setup_study(study: str, args: argparse.Namespace) -> dict[str, Any]:
  import jax
  from harness import setups

  spec = STUDIES[study]
  device = jax.devices()[0]
  predict_for = None if args.smoke else _target_of(device.device_kind)
  built = {
    # --smoke keeps the tiny models' own batch: it checks the code path, not the figures.
    c: _build(
      spec["model"], c, smoke=args.smoke, batch_size=None if args.smoke else spec.get("batch_size")
    )
    for c in spec["configs"]
  }
  with concurrent.futures.ThreadPoolExecutor(len(built)) as pool:
    compiled = dict(
      zip(built, pool.map(lambda s: _compile(s, predict_for), built.values()), strict=True)
    )
  runs = {
    config: _carried(compiled[config]["compiled"], *setups.device_carry(setup))
    for config, setup in built.items()
  }
  times = _time_interleaved(runs, rounds=args.rounds, steps=args.steps)
  rows = []
  for config in built:
    t = times[config]
    per_round = [statistics.median(t[i : i + args.steps]) for i in range(0, len(t), args.steps)]
    entry = compiled[config]
    rows.append(
      {
        "config": config,
        "step_ms": 1e3 * statistics.median(t),
        "round_ms": [1e3 * x for x in per_round],
        "compile_s": entry["compile_s"],
        "planned_memory_bytes": entry["planned"],
        "predicted_ms": entry["predicted"],
      }
    )
  stats = device.memory_stats() or {}
  return {
    "study": study,
    "model": spec["model"],
    "batch_size": spec.get("batch_size"),
    "device_kind": device.device_kind,
    "rounds": args.rounds,
    "steps_per_round": args.steps,
    "rows": rows,
    "process_peak_bytes": stats.get("peak_bytes_in_use"),
  }


def _launch_study(args: argparse.Namespace) -> dict[str, Any]:
  """Seconds per extra kernel: chains of N tiny dependent kernels, timed, against N."""
  import jax
  import jax.numpy as jnp

  from mpx._src.audit import compiled as compiled_lib

  def chain(n: int):
    def f(x):
      for _ in range(n):  # the barrier keeps XLA from fusing the adds into one kernel
        x = jax.lax.optimization_barrier(x + 1.0)
      return x

    return f

  x = jnp.zeros((256,), jnp.float32)
  lengths = (8, 64) if args.smoke else (16, 256, 1024)
  rows = []
  for n in lengths:
    compiled = jax.jit(chain(n)).lower(x).compile()
    kernels = len(compiled_lib.launches(compiled.as_text() or ""))
    for _ in range(3):
      jax.block_until_ready(compiled(x))
    samples = []
    for _ in range(args.rounds * args.steps):
      start = time.perf_counter()
      jax.block_until_ready(compiled(x))
      samples.append(time.perf_counter() - start)
    rows.append({"chain": n, "kernels": kernels, "ms": 1e3 * statistics.median(samples)})
  first, last = rows[0], rows[-1]
  slope = (last["ms"] - first["ms"]) / max(last["kernels"] - first["kernels"], 1)
  return {
    "study": "launch",
    "device_kind": jax.devices()[0].device_kind,
    "rows": rows,
    "us_per_kernel": 1e3 * slope,
  }


def _block_study(args: argparse.Namespace) -> dict[str, Any]:
  """The width-4096 Llama block's gradient step under bf16 and each float8 recipe, interleaved."""
  import fp8_block  # pyright: ignore[reportMissingImports]
  import jax
  from harness import llama_block
  from harness.recipes import RECIPES

  import mpx

  config = llama_block.BlockConfig.smoke() if args.smoke else llama_block.BlockConfig()
  model, x = llama_block.Block(config), llama_block.inputs(config)
  device = jax.devices()[0]
  predict_for = None if args.smoke else _target_of(device.device_kind)
  runs, rows = {}, []
  for recipe in RECIPES:
    step, step_args = fp8_block.block_step(model, recipe, None, x)
    start = time.perf_counter()
    try:
      jax.block_until_ready(step(*step_args))  # compiles
    except Exception as e:  # a recipe this GPU cannot run (MXFP8 before Blackwell): say so
      rows.append({"config": recipe, "not_run": f"{type(e).__name__}: {str(e)[:200]}"})
      continue
    compile_s = time.perf_counter() - start
    predicted = None
    if predict_for is not None:
      predicted = _predicted_ms(mpx.audit(step, *step_args, target=predict_for))
    runs[recipe] = functools.partial(step, *step_args)
    rows.append({"config": recipe, "compile_s": compile_s, "predicted_ms": predicted})
  times = _time_interleaved(runs, rounds=args.rounds, steps=args.steps, warmup=1)
  for row in rows:
    if row["config"] in times:
      row["step_ms"] = 1e3 * statistics.median(times[row["config"]])
  return {
    "study": "llama_block",
    "model": "llama_block",
    "config": dataclasses.asdict(config),
    "device_kind": device.device_kind,
    "rows": rows,
  }


def worker(study: str, args: argparse.Namespace) -> dict[str, Any]:
  """Runs one study in this process and returns its JSON-ready result."""
  if study == "launch":
    return _launch_study(args)
  if study == "llama_block":
    return _block_study(args)
  return _setup_study(study, args)


# ------------------------------------------------------------------ the lease


def _ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  out = []
  for result in results:
    ms = {r["config"]: r["step_ms"] for r in result.get("rows", []) if "step_ms" in r}
    for num, den, what in RATIOS:
      if num in ms and den in ms:
        out.append({"study": result["study"], "ratio": ms[num] / ms[den], "what": what})
    if "mpx_f16" in ms and "mpx_f16/no_loss_scale" in ms:
      share = (ms["mpx_f16"] - ms["mpx_f16/no_loss_scale"]) / ms["mpx_f16"]
      out.append(
        {"study": result["study"], "ratio": share, "what": "loss scaling's share of mpx_f16"}
      )
  return out


def table(report: dict[str, Any]) -> str:
  """The markdown table of a lease (what docs/benchmarks.md quotes)."""
  lines = [
    f"Measured on {report['device_kind']}, {report['date']}; {report['versions_line']}.",
    f"Command: `{report['command']}`. Step times are medians over {report['rounds']} interleaved "
    f"rounds of {report['steps']} steps; predicted = roofline model with launch cost, no autotuning.",
    "",
    "| study | config | step ms (measured) | predicted ms | measured / predicted | planned memory GiB |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for result in report["studies"]:
    for r in result.get("rows", []):
      if "step_ms" not in r:
        if "not_run" in r:
          lines.append(f"| {result['study']} | {r['config']}: not run ({r['not_run']}) | | | | |")
        continue
      pred, mem, ms = r.get("predicted_ms"), r.get("planned_memory_bytes"), r["step_ms"]
      cells = [
        "-" if pred is None else f"{pred:.2f}",
        "-" if pred is None else f"{ms / pred:.2f}",
        "-" if mem is None else f"{mem / 2**30:.2f}",
      ]
      lines.append(f"| {result['study']} | {r['config']} | {ms:.2f} | " + " | ".join(cells) + " |")
    if "not_run" in result:
      lines.append(f"| {result['study']} | not run: {result['not_run']} | | | | |")
    if result.get("study") == "launch" and "us_per_kernel" in result:
      lines.append(f"| launch | cost per kernel | {result['us_per_kernel']:.2f} us | | | |")
  lines += ["", "| ratio | value |", "|---|---:|"]
  lines += [f"| {r['study']}: {r['what']} | {r['ratio']:.3f} |" for r in report["ratios"]]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  """Runs every study within the budget; writes the JSON and the table."""
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True, help="a folder for the results")
  parser.add_argument("--budget", type=float, default=480.0, help="seconds for every study")
  parser.add_argument("--studies", nargs="+", default=list(STUDIES), choices=list(STUDIES))
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="tiny models, any backend")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.worker:
    result = worker(args.worker, args)
    (args.out / f"{args.worker}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0

  from harness import results as results_lib

  start = time.monotonic()
  studies = []
  for i, study in enumerate(args.studies):
    left = args.budget - (time.monotonic() - start)
    share = left / (len(args.studies) - i) if study in ("launch", "llama_block") else left * 0.45
    if left < 20:
      studies.append({"study": study, "not_run": f"the budget of {args.budget:g} s was spent"})
      continue
    command = [sys.executable, __file__, "--worker", study, "--out", str(args.out)]
    command += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    command += ["--smoke"] if args.smoke else []
    print(f"[{time.monotonic() - start:.0f} s] {study}: up to {share:.0f} s", flush=True)
    try:
      subprocess.run(command, check=True, timeout=share, env=os.environ.copy())
      studies.append(json.loads((args.out / f"{study}.json").read_text()))
    except subprocess.TimeoutExpired:
      studies.append({"study": study, "not_run": f"past its {share:.0f} s share of the budget"})
    except subprocess.CalledProcessError as e:
      studies.append({"study": study, "not_run": f"the worker failed (exit {e.returncode})"})
  header = results_lib.header("gpu_lease", argv)
  versions = header["versions"]
  report = {
    **header,
    "device_kind": next((s["device_kind"] for s in studies if "device_kind" in s), "unknown"),
    "versions_line": ", ".join(f"{k} {v}" for k, v in versions.items()),
    "budget_s": args.budget,
    "seconds": time.monotonic() - start,
    "rounds": args.rounds,
    "steps": args.steps,
    "studies": studies,
    "ratios": _ratios(studies),
  }
  (args.out / "gpu_lease.json").write_text(json.dumps(report, indent=2) + "\n")
  text = table(report)
  (args.out / "gpu_lease.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
