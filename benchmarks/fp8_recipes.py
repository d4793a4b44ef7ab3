"""The float8 recipes on the GPU program: GEMM dtypes, fp8 share, memory and kernels, and SQNR.

For each recipe, compiles (never runs) the train-step gradient of a 4-layer MLP (``--batch`` x
``--width``, GELU between layers, every layer covered by the policy) for its GPU with
``mpx.audit(..., target=...)``: the per-tensor and rowwise recipes for an H100, MXFP8 for a B200
(Blackwell multiplies its blocks natively; on an H100 Triton dequantises them to bfloat16), each
beside ``mixed_bfloat16`` on the same GPU. Deviceless compilation: XLA's default kernel configs,
no autotuning. Then the SQNR against float32 of one layer's output and both gradients, on CPU,
on activations with outlier tokens and channels (torchao's criterion). Needs ``python -m
mpx.gpu_target``; prints a table and writes ``results/fp8_recipes.json`` (``--smoke``: only to
``--out``).

``--block`` studies what the quantisation costs instead: the gradient step of one GPT-2 block
(``harness.gpt.Block``, ``--width`` wide, 12 heads of 64 at 768, batch 8 x 1024 tokens; a
delayed step folds its amaxes in with ``update_fp8_state``) compiled for the H100, per recipe and
for ``mixed_bfloat16``: kernel launches, bytes read and written, temp memory and the roofline
model of ``harness.deviceless`` (no autotuning, not a measurement). It writes only to ``--out``.

Usage::

  JAX_PLATFORMS=cpu python benchmarks/fp8_recipes.py [--smoke] [--out PATH]
  JAX_PLATFORMS=cpu python benchmarks/fp8_recipes.py --block [--width 768] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from harness import deviceless, results
from harness.gpt import Block, GPTConfig
from harness.mlp import Mlp

import mpx

RECIPES = {
  "mixed_float8": "h100",
  "mixed_float8_delayed": "h100",
  "mixed_float8_rowwise": "h100",
  "mixed_mxfp8": "b200",
  "mixed_float8_blockwise": "h100",
}
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def target_row(policy: str, target: str, batch: int, width: int) -> dict:
  model = mpx.linen.apply_policy(Mlp(width), policy)
  x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(variables, x):
    return jax.grad(lambda v: jnp.mean(jnp.square(model.apply(v, x))))(variables)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mpx.PrecisionWarning)  # reported in "lost"
    report = mpx.audit(step, variables, x, target=target)
  return {
    "policy": policy,
    "target": target,
    "gemms": len(report.gemms),
    "gemm_dtypes": sorted(
      {f"{g.kind} {a.name} x {b.name}" for g in report.gemms for a, b in [g.dtypes]}
    ),
    "fp8_flops_share": report.fp8_flops_share,
    "temp_bytes": report.memory.temp_bytes,
    "kernel_count": report.kernel_count,
    "bytes_moved": report.bytes_moved,
    "lost": list(report.lost),
  }


BLOCK_POLICIES = ("mixed_bfloat16", "mixed_float8", "mixed_float8_delayed", "mixed_float8_rowwise")


def block_row(policy: str, width: int) -> dict:
  """One GPT-2 block's gradient step under ``policy``, compiled for the H100: kernels, bytes, memory."""
  config = GPTConfig(d_model=width, num_heads=width // 64, max_len=1024, batch_size=8)
  model = mpx.linen.apply_policy(Block(config), policy)
  x = jax.ShapeDtypeStruct((config.batch_size, config.max_len, width), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(variables, x):
    def loss(variables, x):
      return jnp.mean(jnp.square(model.apply(variables, x).astype(jnp.float32)))

    grads, dx = jax.grad(loss, argnums=(0, 1))(variables, x)
    if "fp8_history" in variables:
      history = mpx.fp8.update_fp8_state(variables["fp8_history"], grads["fp8_history"])
      grads = {**grads, "fp8_history": history}
    return grads, dx

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mpx.PrecisionWarning)  # attention's products stay bfloat16
    report = mpx.audit(step, variables, x, target="h100")
  roofline = deviceless.roofline(report, policy)
  return {
    "policy": policy,
    "kernel_count": report.kernel_count,
    "bytes_moved": report.bytes_moved,
    "temp_bytes": report.memory.temp_bytes,
    "fp8_flops_share": report.fp8_flops_share,
    "roofline_ms": None if roofline is None else roofline["ms"],
  }


def block_study(width: int, out: pathlib.Path | None) -> None:
  rows = [block_row(policy, width) for policy in BLOCK_POLICIES]
  base = rows[0]
  print(f"GPT-2 block, width {width}, 8 x 1024 tokens, gradient step compiled for the H100")
  print("(no GPU; no autotuning; the roofline is a model, not a measurement)")
  print("| policy | kernels (+ over bf16) | GB moved (x bf16) | temp MiB (x bf16) | roofline ms |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    ms = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.3f}"
    print(
      f"| {r['policy']} | {r['kernel_count']} ({r['kernel_count'] - base['kernel_count']:+d}) | "
      f"{r['bytes_moved'] / 1e9:.3f} ({r['bytes_moved'] / base['bytes_moved']:.2f}) | "
      f"{r['temp_bytes'] / 2**20:.1f} ({r['temp_bytes'] / base['temp_bytes']:.2f}) | {ms} |"
    )
  if out is not None:
    report = {
      **results.header("fp8_recipes", env="JAX_PLATFORMS=cpu"),
      "block": {"width": width, "heads": width // 64, "batch": 8, "tokens": 1024},
      "note": deviceless.ROOFLINE_NOTE,
      "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"JSON: {out}")


def _sqnr(x, reference) -> float:
  x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
  return float(10 * np.log10(np.sum(reference**2) / np.sum((x - reference) ** 2)))


def _with_outliers(rng, shape, scale, rows, columns):
  x = rng.standard_normal(shape) * scale
  x[rng.choice(shape[0], 4, replace=False)] *= rows
  x[:, rng.choice(shape[1], 4, replace=False)] *= columns
  return x.astype(np.float32)


def sqnr_row(policy: str, size: int) -> dict:
  """SQNR (dB) of one dense layer's output and gradients against float32, on CPU."""
  rng = np.random.default_rng(11)
  x = _with_outliers(rng, (size, 2 * size), 1.0, 50.0, 20.0)
  w = (rng.standard_normal((2 * size, size)) * 0.02).astype(np.float32)
  g = _with_outliers(rng, (size, size), 1e-3, 30.0, 1.0)
  recipe = mpx.get_policy(policy).fp8
  dims = (((1,), (0,)), ((), ()))
  histories = None
  if recipe.delayed:  # the steady state: histories that recorded these tensors' amaxes
    histories = tuple(
      jnp.zeros(recipe.history_length + 1, jnp.float32).at[1].set(np.abs(t).max())
      for t in (x, w, g)
    )

  def fp8(a, b):
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    out = mpx.fp8.fp8_dot_general(a, b, dims, recipe=recipe, state=histories)
    return out.astype(jnp.float32)

  def exact(a, b):
    return jax.lax.dot_general(a, b, dims, precision="highest")

  def product_and_gradients(f):
    @jax.jit  # one compile; op by op the float8 casts compile slowly
    def run(x, w, g):
      out, pullback = jax.vjp(f, x, w)
      return (out, *pullback(g))

    return run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))

  results = [product_and_gradients(f) for f in (fp8, exact)]
  names = ("output", "input_grad", "weight_grad")
  return {n: _sqnr(a, b) for n, a, b in zip(names, *results, strict=True)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--smoke", action="store_true", help="a 256 x 256 MLP")
  parser.add_argument("--block", action="store_true", help="one GPT-2 block (--width, 768 here)")
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="default: results/fp8_recipes.json; --smoke writes only to --out",
  )
  args = parser.parse_args()
  if args.block:
    width = args.width if "--width" in sys.argv else 768
    block_study(width, args.out)
    return
  batch, width = (256, 256) if args.smoke else (args.batch, args.width)
  rows, baselines = [], {}
  for policy, target in RECIPES.items():
    if target not in baselines:
      baselines[target] = target_row("mixed_bfloat16", target, batch, width)
    row = target_row(policy, target, batch, width)
    row["temp_vs_bf16"] = row["temp_bytes"] / baselines[target]["temp_bytes"]
    row["sqnr_db"] = sqnr_row(policy, 128 if args.smoke else 256)
    rows.append(row)
  print(f"4-layer MLP {batch} x {width}, compiled for the GPU (no GPU; no autotuning)")
  print(
    "| policy | target | GEMMs (kind, operands as multiplied) | fp8 share | temp MiB (x bf16) "
    "| kernels | SQNR dB out / dx / dw |"
  )
  print("|---|---|---|---:|---:|---:|---:|")
  for target, base in baselines.items():
    print(
      f"| mixed_bfloat16 | {target} | {', '.join(base['gemm_dtypes'])} | "
      f"{base['fp8_flops_share']:.2f} | {base['temp_bytes'] / 2**20:.1f} | {base['kernel_count']} | |"
    )
  for r in rows:
    s = r["sqnr_db"]
    print(
      f"| {r['policy']} | {r['target']} | {', '.join(r['gemm_dtypes'])} | {r['fp8_flops_share']:.2f} | "
      f"{r['temp_bytes'] / 2**20:.1f} ({r['temp_vs_bf16']:.2f}) | {r['kernel_count']} | "
      f"{s['output']:.1f} / {s['input_grad']:.1f} / {s['weight_grad']:.1f} |"
    )
  out = args.out or (None if args.smoke else RESULTS / "fp8_recipes.json")
  if out is None:
    return
  out.write_text(
    json.dumps(
      {
        **results.header("fp8_recipes", env="JAX_PLATFORMS=cpu"),
        "mlp": {"batch": batch, "width": width, "layers": 4},
        "note": "compiled for the GPU without one: XLA's default kernel configs, no autotuning",
        "baselines": baselines,
        "rows": rows,
      },
      indent=2,
    )
    + "\n"
  )
  print(f"JSON: {out}")


if __name__ == "__main__":
  main()
