"""The float8 recipes timed on a GPU: an MLP's gradient step and the bare GEMMs, beside bfloat16.

Run where a GPU is lent (``fp8_recipes.py`` reads the program compiled for one without it). For
each ``--sizes`` entry ``BxW`` (tokens x width) and each recipe, the gradient of a 4-layer MLP
(``fp8_recipes.Mlp``: GELU between layers, every layer covered by the policy; ``24 B W^2``
matmul FLOPs a step) is jitted, compiled and timed (median of ``--repeats`` calls after warm-up,
each waited for); the GEMM kernels of the program XLA built for this GPU (autotuned: it runs on
one) are listed with the operand types they multiply. Then the bare ``W x W x W`` products:
bfloat16 and E4M3 x E4M3 with float32 accumulation (the ceilings the step is measured against),
and ``jax.lax.scaled_dot`` with one float32 scale per 1x128 / 128x128 block (the DeepSeek-V3
layout): which kernel this GPU's XLA gives it. Prints a table, writes
``results/fp8_speed[_smoke].json``.

Usage::

  python benchmarks/fp8_speed.py                      # on a GPU
  python benchmarks/fp8_speed.py --sizes 8192x4096 --repeats 50
  python benchmarks/fp8_speed.py --smoke              # tiny, any backend (CI: the code path)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import gpu_figures, results  # noqa: E402
from harness.mlp import Mlp  # noqa: E402
from harness.recipes import RECIPES  # noqa: E402

import mpx  # noqa: E402

RESULTS = HERE / "results"


def _median_ms(run: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(run())  # warm-up
  jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def _kernels(compiled: Any) -> list[str]:
  """``kind a x b`` of each GEMM kernel of a compiled program, sorted, with counts."""
  gemms = gpu_figures.gemm_kernels(compiled.as_text())
  names = [f"{g.kind} {' x '.join(g.operand_dtypes)}" for g in gemms]
  return [f"{names.count(n)}x {n}" for n in sorted(set(names))]


def step_row(policy: str, tokens: int, width: int, repeats: int) -> dict[str, Any]:
  """Times the MLP's gradient step under ``policy``."""
  model = mpx.linen.apply_policy(Mlp(width), policy)
  x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def step(variables, x):
    return jax.grad(lambda v: jnp.mean(jnp.square(model.apply(v, x))))(variables)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mpx.PrecisionWarning)
    compiled = jax.jit(step).lower(variables, x).compile()
  ms = _median_ms(lambda: compiled(variables, x), repeats)
  flops = 24 * tokens * width**2
  return {
    "policy": policy,
    "tokens": tokens,
    "width": width,
    "step_ms": ms,
    "tflops_per_s": flops / (ms / 1e3) / 1e12,
    "gemms": _kernels(compiled),
  }


def gemm_rows(size: int, repeats: int) -> list[dict[str, Any]]:
  """The bare ``size``-cubed products: bfloat16, E4M3, and 128-block ``scaled_dot``."""
  key_a, key_b = jax.random.split(jax.random.key(2))
  a = jax.random.normal(key_a, (size, size), jnp.float32)
  b = jax.random.normal(key_b, (size, size), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  cases: dict[str, tuple[Callable, tuple]] = {
    "bf16 x bf16 -> f32 acc": (
      lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32),
      (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)),
    ),
    "e4m3 x e4m3 -> f32 acc": (
      lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32),
      (a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)),
    ),
  }
  blocks = 128
  if size % blocks == 0 and hasattr(jax.lax, "scaled_dot"):
    # (batch 1, M, K) x (batch 1, N, K), float32 scales per 1x128 (lhs) and 128 along K (rhs).
    lhs = a.astype(jnp.float8_e4m3fn)[None]
    rhs = b.T.astype(jnp.float8_e4m3fn)[None]
    lhs_scale = jnp.ones((1, size, size // blocks), jnp.float32)
    rhs_scale = jnp.ones((1, size, size // blocks), jnp.float32)
    block_dims = (((2,), (2,)), ((0,), (0,)))

    def blockwise(lhs, rhs, ls, rs):
      return jax.lax.scaled_dot(
        lhs,
        rhs,
        lhs_scale=ls,
        rhs_scale=rs,
        dimension_numbers=block_dims,
        preferred_element_type=jnp.float32,
      )

    cases["scaled_dot e4m3, f32 scale per 128"] = (blockwise, (lhs, rhs, lhs_scale, rhs_scale))
  rows = []
  for name, (f, args) in cases.items():
    try:
      compiled = jax.jit(f).lower(*args).compile()
      ms = _median_ms(lambda: compiled(*args), repeats)  # noqa: B023  (called at once)
      rows.append(
        {
          "product": name,
          "size": size,
          "ms": ms,
          "tflops_per_s": 2 * size**3 / (ms / 1e3) / 1e12,
          "gemms": _kernels(compiled),
        }
      )
    except Exception as e:  # reported in the table: which form this XLA refuses
      rows.append({"product": name, "size": size, "error": f"{type(e).__name__}: {e}"[:300]})
  return rows


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=["8192x4096", "8192x8192"])
  parser.add_argument("--gemm-size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
  parser.add_argument("--smoke", action="store_true", help="128x128, 2 repeats, any backend")
  parser.add_argument("--out", help="JSON path (default results/fp8_speed[_smoke].json)")
  args = parser.parse_args(argv)
  if not args.smoke and not gpu_figures.is_gpu():
    parser.error("no GPU: this benchmark times a GPU (use --smoke to run its code path anywhere)")
  sizes = ["128x128"] if args.smoke else args.sizes
  repeats = 2 if args.smoke else args.repeats
  device = jax.devices()[0]
  steps = []
  for size in sizes:
    tokens, width = (int(n) for n in size.split("x"))
    for policy in args.recipes:
      steps.append(step_row(policy, tokens, width, repeats))
      print(json.dumps(steps[-1]), flush=True)  # kept in the log if the run is cut short
  base = {(r["tokens"], r["width"]): r["step_ms"] for r in steps if r["policy"] == RECIPES[0]}
  for r in steps:
    if (r["tokens"], r["width"]) in base:
      r["speedup_vs_bf16"] = base[r["tokens"], r["width"]] / r["step_ms"]
  gemms = gemm_rows(128 if args.smoke else args.gemm_size, repeats)
  report = {
    **results.header("fp8_speed", argv),
    "backend": jax.default_backend(),
    "note": "median wall time of jitted calls, each waited for; XLA autotuned on this device",
    "steps": steps,
    "gemms": gemms,
  }
  print(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print("| MLP tokens x width | recipe | step ms | TFLOP/s | x bf16 | GEMM kernels |")
  print("|---|---|---:|---:|---:|---|")
  for r in steps:
    print(
      f"| {r['tokens']}x{r['width']} | {r['policy']} | {r['step_ms']:.3f} | {r['tflops_per_s']:.0f} "
      f"| {r.get('speedup_vs_bf16', float('nan')):.2f} | {'; '.join(r['gemms'])} |"
    )
  print("\n| product | size | ms | TFLOP/s | kernels |")
  print("|---|---:|---:|---:|---|")
  for r in gemms:
    if "error" in r:
      print(f"| {r['product']} | {r['size']} | error: {r['error']} | | |")
    else:
      print(
        f"| {r['product']} | {r['size']} | {r['ms']:.3f} | {r['tflops_per_s']:.0f} "
        f"| {'; '.join(r['gemms'])} |"
      )
  out = pathlib.Path(args.out or RESULTS / f"fp8_speed{'_smoke' if args.smoke else ''}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"JSON: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
