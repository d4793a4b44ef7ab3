"""How closely mixed-precision training tracks float32 training (issues 4 and 5).

Runs the same training loops the tests assert on, and prints the figures the
tests only bound:

* master weights and the composite optimizer (``tests/optim/test_mixed_precision.py``):
  a Flax MLP on scikit-learn's digits, 150 adam steps, under layouts (a) and (b);
* Flax policies (``tests/integration/test_policy_models.py``): a GPT-style linen decoder and an
  NNX decoder on ``pydoc_data.topics`` and a ResNet with BatchNorm on digits,
  300 adamw steps, ``mixed_bfloat16`` against ``float32``.

Usage: ``python benchmarks/precision_tracking.py [--out benchmarks/results/precision_tracking.json]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np
from harness import results

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"
# The test modules, and the modules beside them that they import (tests/models.py ...).
sys.path[:0] = [str(TESTS / "optim"), str(TESTS / "integration"), str(TESTS)]

import test_mixed_precision as layouts  # noqa: E402
import test_policy_models as models  # noqa: E402


def _row(name: str, reference: np.ndarray, mixed: np.ndarray, window: int, skip: int) -> dict:
  return {
    "setup": name,
    "steps": len(reference),
    "f32_first": float(reference[0]),
    "f32_last_mean": float(reference[-window:].mean()),
    "mixed_last_mean": float(mixed[-window:].mean()),
    "last_mean_abs_diff": float(abs(reference[-window:].mean() - mixed[-window:].mean())),
    "max_step_abs_diff": float(np.abs(reference[skip:] - mixed[skip:]).max()),
    "window": window,
    "compared_from_step": skip,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/precision_tracking.json")
  args = parser.parse_args()
  # optax's adam is not strict-promotion clean; the tests wrap it, here it runs as users run it.
  rows = []
  reference = layouts._train("float32")[2]
  for policy in (
    "mixed_float16",
    "mixed_bfloat16",
    "params=float16,compute=float16,output=float32",
    "params=bfloat16,compute=bfloat16,output=float32",
  ):
    _, opt_state, losses = layouts._train(policy)
    row = _row(f"digits MLP, {policy}", reference, losses, window=20, skip=30)
    row["skipped_steps"] = int(jax.device_get(opt_state.skipped_steps))
    rows.append(row)
  for setup in ("linen_decoder", "linen_resnet_batchnorm", "nnx_decoder"):
    ref = models._train(setup, "float32", 3e-3)
    mixed = models._train(setup, "mixed_bfloat16", 3e-3)
    rows.append(_row(f"{setup}, mixed_bfloat16", ref, mixed, window=models.WINDOW, skip=0))

  header = "| setup | steps | f32 last mean | mixed last mean | abs diff | max step diff |"
  print(header)
  print("|---|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['setup']} | {r['steps']} | {r['f32_last_mean']:.4f} | {r['mixed_last_mean']:.4f} "
      f"| {r['last_mean_abs_diff']:.4f} | {r['max_step_abs_diff']:.4f} |"
    )
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
    json.dumps({**results.header("precision_tracking"), "rows": rows}, indent=2) + "\n"
  )


if __name__ == "__main__":
  main()
