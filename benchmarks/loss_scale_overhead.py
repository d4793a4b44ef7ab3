"""Overhead of dynamic loss scaling on a GPT train step.

Compiles the same float16-compute GPT train step (forward, backward, adamw,
params and optimizer state donated) without loss scaling and with each
candidate formulation (``loss_scale_steps.py`` writes the steps and the model),
and reports per candidate:

* ``reads``: extra bytes accessed (XLA ``cost_analysis()``) over the baseline,
  divided by one read of the float32 gradient tree (4 bytes x param count);
* ``fusions/leaf``: extra fusions in the optimized HLO per parameter leaf
  (each fusion is one kernel launch on a GPU);
* flops, temp memory (``memory_analysis()``), and a CPU wall-time ratio
  (median of a few steps; noisy on a shared machine, unlike the compiler figures);
* ``atomic``: whether one step with an overflowing float16 backward leaves the
  params and the inner optimizer state bitwise unchanged (checked, not assumed).

Run: ``python benchmarks/loss_scale_overhead.py [--out PATH] [--repeats N] [--tiny]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import figures, gpt, results
from harness import loss_scale_steps as steps
from harness.loss_scale_steps import Batch, Candidate, PyTree

DEFAULT_OUT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "results", "loss_scale_overhead.json"
)
TARGET_READS = 3.0
TARGET_FUSIONS_PER_LEAF = 1.5
# Multiplies the loss in the atomicity check: the float16 backward overflows.
POISON = 1e30


# ------------------------------------------------------------- measuring


def _tree_bytes_equal(a: PyTree, b: PyTree) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if len(la) != len(lb):
    return False
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
      return False
  return True


def _host(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def check_atomic(
  cand: Candidate, compiled: Any, params: PyTree, batch: Batch
) -> tuple[bool, PyTree, PyTree]:
  """One overflowing step, then one finite step: the skip must be a bitwise identity.

  Returns:
    ``(atomic, params, state)``: whether the overflowing step left params and
    inner state bit for bit unchanged while the finite step then moved the
    params, and the params and state after both steps.
  """
  if cand.inner_state is None:
    raise ValueError(f"candidate {cand.name!r} has no skip to check")
  state = cand.init(params)
  params_before = _host(params)
  inner_before = _host(cand.inner_state(state))
  poisoned = dict(batch, loss_mult=jnp.float32(POISON))
  new_params, new_state, _ = compiled(jax.tree.map(jnp.array, params), state, poisoned)
  skipped = _tree_bytes_equal(new_params, params_before) and _tree_bytes_equal(
    cand.inner_state(new_state), inner_before
  )
  new_params, new_state, _ = compiled(new_params, new_state, batch)
  moved = not _tree_bytes_equal(new_params, params_before)
  return skipped and moved, new_params, new_state


def measure(cand: Candidate, params: PyTree, batch: Batch, *, repeats: int) -> dict[str, Any]:
  """Compile ``cand``; collect its compiler figures, atomicity and wall time."""
  state = cand.init(params)
  t0 = time.perf_counter()
  compiled = jax.jit(cand.step, donate_argnums=cand.donate).lower(params, state, batch).compile()
  compile_s = time.perf_counter() - t0
  compiler = figures.compiler_figures(compiled)
  result: dict[str, Any] = {
    "name": cand.name,
    "description": cand.description,
    "donate_argnums": list(cand.donate),
    "bytes_accessed": compiler["bytes_accessed"],
    "flops": compiler["flops"],
    "temp_bytes": int(compiler["temp_bytes"]),
    "fusions": int(compiler["fusions"]),
    "compile_s": compile_s,
    "atomic": None,
  }
  # The atomicity check's two steps double as the warm-up of the timed steps.
  if cand.inner_state is None:
    p, s, _ = compiled(jax.tree.map(jnp.array, params), state, batch)
  else:
    result["atomic"], p, s = check_atomic(cand, compiled, params, batch)
  times = []
  for _ in range(max(repeats, 1)):
    t0 = time.perf_counter()
    p, s, loss = compiled(p, s, batch)
    jax.block_until_ready((p, s, loss))
    times.append(time.perf_counter() - t0)
  result["wall_s_median"] = statistics.median(times)
  return result


def run(
  config: gpt.GPTConfig,
  *,
  repeats: int = 3,
  names: list[str] | None = None,
  candidates: list[Candidate] | None = None,
) -> dict[str, Any]:
  """Measure the baseline and the candidates; return the JSON-ready report."""
  params = steps.init_params(config)
  batch = steps.make_batch(config)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  n_leaves = len(jax.tree.leaves(params))
  grad_read = 4.0 * n_params
  cands = candidates if candidates is not None else steps.make_candidates(config)
  if names:
    cands = [c for c in cands if c.name == "baseline" or c.name in names]
  rows = [measure(c, params, batch, repeats=repeats) for c in cands]
  base = rows[0]
  for row in rows:
    row["reads"] = (row["bytes_accessed"] - base["bytes_accessed"]) / grad_read
    row["extra_fusions_per_leaf"] = (row["fusions"] - base["fusions"]) / n_leaves
    row["extra_flops"] = row["flops"] - base["flops"]
    row["wall_ratio"] = row["wall_s_median"] / base["wall_s_median"]
    row["meets_target"] = bool(
      row["atomic"]
      and row["reads"] <= TARGET_READS
      and row["extra_fusions_per_leaf"] <= TARGET_FUSIONS_PER_LEAF
    )
  return {
    **results.header("loss_scale_overhead"),
    "backend": jax.default_backend(),
    "config": dataclasses.asdict(config),
    "param_count": int(n_params),
    "leaf_count": n_leaves,
    "grad_read_bytes": grad_read,
    "target": {"reads": TARGET_READS, "extra_fusions_per_leaf": TARGET_FUSIONS_PER_LEAF},
    "repeats": repeats,
    "results": rows,
  }


def format_table(report: dict[str, Any]) -> str:
  """Markdown table of the report's rows."""
  head = (
    "| candidate | reads | fusions/leaf | extra MFLOP | temp MiB | wall ratio (noisy) | atomic |\n"
    "|---|---:|---:|---:|---:|---:|---|"
  )
  lines = [head]
  for r in report["results"]:
    lines.append(
      f"| {r['name']} | {r['reads']:.2f} | {r['extra_fusions_per_leaf']:.2f} | "
      f"{r['extra_flops'] / 1e6:.2f} | {r['temp_bytes'] / 2**20:.1f} | {r['wall_ratio']:.3f} | "
      f"{r['atomic']} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="tiny model (smoke run)")
  parser.add_argument("--only", nargs="*", help="candidate names to run (baseline always runs)")
  args = parser.parse_args(argv)
  config = steps.TINY_CONFIG if args.tiny else steps.CONFIG
  t0 = time.perf_counter()
  report = run(config, repeats=args.repeats, names=args.only)
  report["total_s"] = time.perf_counter() - t0
  print(
    f"GPT {report['param_count']:,} params, {report['leaf_count']} leaves; "
    f"1 read = {report['grad_read_bytes'] / 2**20:.2f} MiB; jax {jax.__version__} "
    f"({report['backend']}); {report['total_s']:.0f} s"
  )
  print(format_table(report))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
