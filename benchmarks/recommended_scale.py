"""Does ``mpx.diagnostics.recommend_scale``'s static scale train the demo's scenario in float16 without skips?

Takes the gradients a float32 step of ``python -m mpx.demo``'s model computes
at initialisation (scale 1, the demo's data-parallel normalisation): the
activation gradients flowing into every block's output, and the weight
gradients. ``mpx.diagnostics.recommend_scale`` turns them into a static power-of-two scale
for float16 (2x headroom below overflow, at most 0.1% flushed). The demo's
float16 configurations then train with that scale, static, next to float32,
on the demo's data, seed and schedule; the table gives their skipped steps and
validation losses. The scale is chosen before training, from step 0 only, as a
user would choose it: whether it stays safe as the gradients change over the
run is what the skipped-step column shows.

Usage::

  python benchmarks/recommended_scale.py            # the demo's defaults (300 steps)
  python benchmarks/recommended_scale.py --quick    # the demo's --quick settings
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import mpx
import mpx.demo as demo

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def weight_gradients(settings: demo.Settings, params: Any, windows: Any) -> Any:
  """Gradients of the demo's objective with respect to the float32 params (scale 1)."""
  model = demo.CharTransformer(settings.model)
  global_tokens = float(settings.global_batch_tokens)

  def objective(p: Any) -> jax.Array:
    logits = model.apply({"params": p}, windows[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
    return losses.sum() / global_tokens

  return settings.jit(jax.grad(objective))(params)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the demo's --quick settings")
  parser.add_argument("--out", default=str(RESULTS / "recommended_scale.json"))
  args = parser.parse_args(argv)
  settings = demo.QUICK_SETTINGS if args.quick else demo.DEFAULT_SETTINGS
  start = time.perf_counter()
  data = demo.make_data(settings, demo.load_corpus())

  model = demo.CharTransformer(settings.model)
  params = settings.jit(model.init)(jax.random.key(settings.seed), data.train[0, :, :-1])["params"]
  tree = {
    "activation_gradients": jnp.asarray(demo.activation_gradients(settings, params, data.train[0])),
    "weight_gradients": weight_gradients(settings, params, jnp.asarray(data.train[0])),
  }
  rec = mpx.diagnostics.recommend_scale(tree, jnp.float16)
  scale = float(rec.scale)
  summary = (
    f"recommend_scale(float16, margin 2, at most 0.1% flushed) on the step-0 gradients: "
    f"{scale:g}; overflow-free up to {float(rec.max_scale):g}, under 0.1% flushed from "
    f"{float(rec.min_scale):g} (feasible: {bool(rec.feasible)}); at that scale "
    f"{float(rec.report.flushed):.4%} flush and {float(rec.report.subnormal):.4%} are subnormal"
  )
  print(summary)

  base = {config.name: config for config in demo.CONFIGS}
  configs = [base["float32"]] + [
    dataclasses.replace(base[name], name=f"{name}_static", loss_scaling=scale)
    for name in ("mixed_float16", "float16_masters")
  ]
  results = [demo.train(config, settings, data) for config in configs]
  float32_val = results[0].eval_losses[-1]
  rows = []
  print(f"\nstatic scale {scale:g} (2**{math.log2(scale):g}), {settings.steps} steps")
  print("| config | loss scale | skipped steps | val loss | val - float32 |")
  print("|---|---|---:|---:|---:|")
  for config, result in zip(configs, results, strict=True):
    row = {
      "config": config.name,
      "loss_scale": "none" if config.name == "float32" else scale,
      "skipped_steps": int(sum(result.skipped)),
      "val_loss": float(result.eval_losses[-1]),
      "val_minus_float32": float(result.eval_losses[-1] - float32_val),
    }
    rows.append(row)
    print(
      f"| {row['config']} | {row['loss_scale']} | {row['skipped_steps']} "
      f"| {row['val_loss']:.4f} | {row['val_minus_float32']:+.4f} |"
    )
  report = {
    **results.header("recommended_scale"),
    "steps": settings.steps,
    "recommendation": {
      "scale": scale,
      "max_scale": float(rec.max_scale),
      "min_scale": float(rec.min_scale),
      "feasible": bool(rec.feasible),
      "text": summary,
    },
    "rows": rows,
    "seconds": time.perf_counter() - start,
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"JSON: {out}")


if __name__ == "__main__":
  main()
