"""The fp8 planner on the suite's models: which layers float8 pays for, and the planned step's time.

For each model (GPT-2 small in linen and NNX, ResNet-50, the width-4096 Llama block of
``fp8_block.py``), ``mpx.linen.plan`` / ``mpx.nnx.plan`` compiles the gradient step for the
target under ``mixed_bfloat16``, ``mixed_float8`` and ``mixed_float8_rowwise`` (deviceless, no
autotuning), charges every kernel to its layer and picks per layer; the planned step is
compiled and checked (``plan.verify()``). Prints each plan's table and its code; the JSON keeps
the rows, every candidate's modelled step time, the planned step's, and how long planning took
(wall and CPU seconds: the machine may be shared). ``--calibrate N`` adds the numerics on the
first ``N`` examples of the model's benchmark batch (random weights: ``jax.random.key(0)``).

Usage::

  JAX_PLATFORMS=cpu python benchmarks/fp8_plan.py --models gpt2_linen resnet50 block
  JAX_PLATFORMS=cpu python benchmarks/fp8_plan.py --smoke    # tiny models (CI: the code path)

Writes ``results/fp8_plan.json`` (``results/fp8_plan_smoke.json`` with ``--smoke``; ``--out``
elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import gpt, llama_block, resnet50, results  # noqa: E402

import mpx  # noqa: E402

MODELS = ("gpt2_linen", "gpt2_nnx", "resnet50", "block")
RESULTS = HERE / "results"


def _shape(batch: dict[str, Any], key: str) -> Any:
  return jax.ShapeDtypeStruct(batch[key].shape, batch[key].dtype)


def subject(name: str, smoke: bool) -> tuple[Callable[..., Any], Any, Any, dict[str, Any]]:
  """``(plan function, model, input shape, the benchmark batch)`` of one model."""
  if name in ("gpt2_linen", "gpt2_nnx"):
    cfg = gpt.GPTConfig.smoke() if smoke else gpt.GPTConfig()
    batch = gpt.make_batch(cfg)
    if name == "gpt2_linen":
      return mpx.linen.plan, gpt.GPT(cfg), _shape(batch, "x"), batch
    return mpx.nnx.plan, gpt.NnxGPT(cfg, rngs=nnx.Rngs(0)), _shape(batch, "x"), batch
  if name == "resnet50":
    cfg = resnet50.ResNetConfig.smoke() if smoke else resnet50.ResNetConfig()
    batch = resnet50.make_batch(cfg)
    return mpx.linen.plan, resnet50.ResNet50(cfg), _shape(batch, "x"), batch
  cfg = llama_block.BlockConfig.smoke() if smoke else llama_block.BlockConfig()
  x = llama_block.inputs(cfg)
  example = jax.random.normal(jax.random.key(1), (1, *x.shape[1:]), jnp.float32)
  return mpx.linen.plan, llama_block.Block(cfg), x, {"x": example}


def _family(path: str) -> str:
  """A layer's family: the numbers of its first component, and numeric components, as ``N``."""
  first, *rest = path.split("/")
  return "/".join([re.sub(r"\d+", "N", first), *("N" if p.isdigit() else p for p in rest)])


def family_table(rows: list[dict[str, Any]], candidates: list[str]) -> str:
  """A plan's rows grouped by family and shape: counts, summed ms, choices (Markdown)."""
  groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for row in rows:
    groups.setdefault((_family(row["path"]), row["shapes"]), []).append(row)
  lines = [
    "| layers | count | GEMM (fwd M x N x K) | FLOPs | "
    + " | ".join(f"{c} ms" for c in candidates)
    + " | choice |",
    "|---|---:|---|---:|" + "---:|" * len(candidates) + "---|",
  ]
  for (family, shapes), members in groups.items():
    ms = " | ".join(f"{sum(r['predicted_ms'][c] for r in members):.3f}" for c in candidates)
    choices = ", ".join(sorted({r["choice"] for r in members}))
    share = 100 * sum(r["flops_share"] for r in members)
    lines.append(f"| `{family}` | {len(members)} | {shapes} | {share:.1f}% | {ms} | {choices} |")
  return "\n".join(lines)


def plan_model(name: str, target: str, smoke: bool, calibrate: int) -> dict[str, Any]:
  """Plans one model and returns its JSON entry."""
  plan_fn, model, x, batch = subject(name, smoke)
  kwargs = {"calibration": (batch["x"][:calibrate],)} if calibrate else {}
  wall, cpu = time.perf_counter(), time.process_time()
  plan = plan_fn(model, x, target=target, **kwargs)
  seconds = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
  plan.verify()
  rows = [dataclasses.asdict(row) for row in plan.rows]
  return {
    "model": name,
    "table": str(plan),
    "families": family_table(rows, list(plan.candidates)),
    "note": plan.note,
    "code": plan.to_code(),
    "rows": rows,
    "step_ms": plan.step_ms,
    "plan_ms": plan.predicted_ms,
    "layer_sum_ms": plan.layer_sum_ms,
    "speedup": plan.speedup,
    "never_slower": plan.predicted_ms <= plan.step_ms[plan.candidates[0]],
    "policy": str(plan.policy),
    "path_rules": len(plan.rules.paths),
    "plan_seconds": seconds,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
  parser.add_argument("--target", default="h100")
  parser.add_argument("--calibrate", type=int, default=0, metavar="N")
  parser.add_argument("--smoke", action="store_true", help="tiny models")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args(argv)
  entries = []
  for name in args.models:
    entry = plan_model(name, args.target, args.smoke, args.calibrate)
    print(f"## {name}\n\n{entry['table']}\n\n{entry['families']}\n\n{entry['code']}\n")
    print(
      f"planned in {entry['plan_seconds']['wall']:.0f} s wall, "
      f"{entry['plan_seconds']['cpu']:.0f} s CPU\n"
    )
    entries.append(entry)
  report = {
    **results.header("fp8_plan", argv, env="JAX_PLATFORMS=cpu"),
    "target": args.target,
    "note": "modelled, no autotuning: roofline plus 2.7 us per kernel launch",
    "models": entries,
  }
  out = args.out or RESULTS / ("fp8_plan_smoke.json" if args.smoke else "fp8_plan.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str) + "\n")
  print(f"JSON: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
