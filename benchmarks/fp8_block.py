"""A Llama-style decoder block at width 4096: bfloat16 against every float8 recipe, and the fp8 plan.

The block of ``harness/llama_block.py`` (Llama-3-8B's: width 4,096, 32 query and 8 key/value
heads, SwiGLU of 14,336, sequence 4,096, batch 2) is planned with ``mpx.linen.plan`` for the
target over every recipe: its gradient step is compiled for the GPU under each (deviceless,
no autotuning) and the table gives, per recipe, the roofline step time with and without the
kernel-launch term (2.7 us a kernel), the GEMM kernels' part of it (the GEMM-only speedup:
what float8 saves before its quantisation kernels), the attention core's part (its kernels
other than the four projections: scores, softmax, RoPE; the speedup with it held at the
baseline's, as a fused attention would run it in every recipe), the kernel count and the float8
share of the FLOPs; then the planner's per-layer table, and the planned block compiled and checked
(``plan.verify()``). On a GPU (``--measure``), each recipe's step and the planned step are
also timed (median of ``--repeats`` calls). The attention is the policy's
(``mpx.dot_product_attention``, called with ``is_causal=True``): cuDNN's fused flash attention
where cuDNN is installed where the step is traced (for a deviceless compile, the
``nvidia-cudnn-cu12`` wheel beside jax's CUDA plugin), else mpx's exact unfused path; each
row of the JSON says which the compiled program runs.

Usage::

  JAX_PLATFORMS=cpu python benchmarks/fp8_block.py           # the H100 program, no GPU
  python benchmarks/fp8_block.py --measure                   # on a GPU: also timed
  JAX_PLATFORMS=cpu python benchmarks/fp8_block.py --smoke   # a tiny block (CI: the code path)

Writes ``results/fp8_block.json`` (``results/fp8_block_smoke.json`` with ``--smoke``; ``--out``
elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import jax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import llama_block, results  # noqa: E402
from harness.recipes import RECIPES  # noqa: E402

import mpx  # noqa: E402
from mpx._src.audit import roofline  # noqa: E402
from mpx._src.planner import cost  # noqa: E402
from mpx._src.planner import linen as planner_linen  # noqa: E402
from mpx._src.planner import plan as plan_lib  # noqa: E402

RESULTS = HERE / "results"


def _attention(report: Any) -> str:
  fused = any(k["kind"] == "cudnn" for k in report.kernels)
  return "cuDNN fused attention" if fused else "unfused attention (XLA: scores written to memory)"


def _attention_core_ms(report: Any) -> float:
  """The modelled time of the attention's kernels but its four projections (scores, softmax...)."""
  core = "Block/attention"
  layers = [core, *(f"{core}/{p}" for p in ("q", "k", "v", "o"))]
  return (
    1e3
    * cost.program_cost(report, layers, launch_seconds=roofline.LAUNCH_SECONDS).layers[core].seconds
  )


def program_row(name: str, report: Any, base: dict[str, float] | None) -> dict[str, Any]:
  """One compiled step's figures (modelled, no autotuning), with speedups over ``base``."""
  roof = roofline.roofline(report)
  if roof is None:
    raise ValueError(f"no peaks known for {report.device_kind}")
  row = {
    "name": name,
    "roofline_ms": roof["ms"],
    "with_launch_ms": roof["with_launch_ms"],
    "attention_core_ms": _attention_core_ms(report),
    "gemm_ms": roof["gemm_ms"],
    "kernels": report.kernel_count,
    "fp8_flops_share": report.fp8_flops_share,
    "attention": _attention(report),
  }
  if base is not None:
    row["speedup"] = base["with_launch_ms"] / roof["with_launch_ms"]
    row["speedup_without_launch"] = base["roofline_ms"] / roof["ms"]
    row["gemm_speedup"] = base["gemm_ms"] / roof["gemm_ms"]
    # What the step would gain with the attention core's time as in the baseline program
    # (a fused flash attention runs it the same in every recipe).
    rest = roof["with_launch_ms"] - row["attention_core_ms"]
    row["speedup_without_attention_core"] = (
      base["with_launch_ms"] - base["attention_core_ms"]
    ) / rest
  return row


def block_step(model: Any, policy: Any, rules: Any, x: Any) -> tuple[Any, tuple[Any, ...]]:
  """``(jitted gradient step, its arguments)`` of the block under a policy and keep rules."""
  wrapped = mpx.linen.apply_policy(model, policy, rules=rules)
  batch = jax.random.normal(jax.random.key(1), x.shape, x.dtype)
  diff, rest = planner_linen._split(wrapped.init(jax.random.key(0), batch))  # pyright: ignore[reportPrivateUsage]
  step = jax.jit(planner_linen._step(wrapped, plan_lib.default_loss))  # pyright: ignore[reportPrivateUsage]
  return step, (diff, rest, batch)


def measure_ms(model: Any, policy: Any, rules: Any, x: Any, repeats: int) -> float:
  """The median wall time of the block's gradient step under a policy, on this GPU."""
  step, args = block_step(model, policy, rules, x)
  jax.block_until_ready(step(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def format_table(rows: list[dict[str, Any]]) -> str:
  """The Markdown table of the recipes and the plan."""
  lines = [
    "| step | roofline + launch ms | speedup | roofline ms | speedup | GEMM ms | GEMM speedup "
    "| attention core ms | speedup without it | kernels | fp8 share | measured ms "
    "| measured speedup |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    measured = r.get("measured_ms")
    lines.append(
      f"| {r['name']} | {r['with_launch_ms']:.3f} | {r.get('speedup', 1.0):.2f}x "
      f"| {r['roofline_ms']:.3f} | {r.get('speedup_without_launch', 1.0):.2f}x "
      f"| {r['gemm_ms']:.3f} | {r.get('gemm_speedup', 1.0):.2f}x | {r['attention_core_ms']:.3f} "
      f"| {r.get('speedup_without_attention_core', 1.0):.2f}x | {r['kernels']:,} "
      f"| {r['fp8_flops_share']:.3f} | {'-' if measured is None else format(measured, '.3f')} "
      f"| {'-' if measured is None else format(r['measured_speedup'], '.2f') + 'x'} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--smoke", action="store_true", help="a tiny block")
  parser.add_argument("--measure", action="store_true", help="also time each step on this GPU")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args(argv)
  config = llama_block.BlockConfig.smoke() if args.smoke else llama_block.BlockConfig()
  model, x = llama_block.Block(config), llama_block.inputs(config)
  start = time.perf_counter()
  plan = mpx.linen.plan(model, x, target=args.target, candidates=RECIPES)
  plan_seconds = time.perf_counter() - start
  verified = plan.verify()
  base = program_row(RECIPES[0], plan.reports[RECIPES[0]], None)
  rows = [base] + [program_row(r, plan.reports[r], base) for r in RECIPES[1:]]
  rows.append(program_row("plan (compiled)", verified, base))
  if args.measure:
    for row, (policy, rules) in zip(
      rows, [*((r, None) for r in RECIPES), (plan.policy, plan.rules)], strict=True
    ):
      row["measured_ms"] = measure_ms(model, policy, rules, x, args.repeats)
      row["measured_speedup"] = rows[0]["measured_ms"] / row["measured_ms"]
  report = {
    **results.header("fp8_block", argv, env="" if args.measure else "JAX_PLATFORMS=cpu"),
    "target": args.target,
    "config": dataclasses.asdict(config),
    "matmul_flops": config.matmul_flops(),
    "note": f"{plan.target}: modelled, no autotuning (roofline, launches at "
    f"{1e6 * plan.launch_seconds:g} us a kernel); measured only with --measure on a GPU",
    "rows": rows,
    "plan": {
      "policy": str(plan.policy),
      "rules": [[p, str(q)] for p, q in plan.rules.paths],
      "predicted_ms": plan.predicted_ms,
      "speedup": plan.speedup,
      "table": str(plan),
      "code": plan.to_code(),
      "seconds": plan_seconds,
    },
  }
  print(format_table(rows))
  print()
  print(str(plan))
  print(f"\nattention in this compile: {base['attention']}; plan in {plan_seconds:.0f} s")
  out = args.out or RESULTS / ("fp8_block_smoke.json" if args.smoke else "fp8_block.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str) + "\n")
  print(f"JSON: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
