"""Saved-residual bytes and convert ops of each model's train step, float32 against the mixed configurations.

The residual bytes (``figures.saved_residual_bytes``) and convert counts
(``figures.count_converts``) that ``run.py`` reports, for a few
configurations side by side in one process, without compiling anything (a
full-size GPT-2 takes seconds). It uses nothing of mpx but its public API, so
it also measures another version of mpx put first on ``PYTHONPATH``, e.g. the
one before the lean norms and softmax::

  python benchmarks/residual_table.py
  mkdir /tmp/mpx-before && git archive ea21779 mpx | tar -x -C /tmp/mpx-before
  PYTHONPATH=/tmp/mpx-before python benchmarks/residual_table.py --configs f32 mpx_bf16

A configuration that the installed mpx cannot build (``mpx_bf16_flax_norms``
before ``KeepRules.lean_norms`` existed) is reported as such.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
from harness import figures, setups  # noqa: E402

import mpx  # noqa: E402

DEFAULT_CONFIGS = ("f32", "bf16_flax", "mpx_bf16", "mpx_bf16_flax_norms")


def measure(model: str, config: str, *, smoke: bool) -> dict[str, Any]:
  """Residual bytes and convert count of one configuration's train step."""
  try:
    setup = setups.build(model, config, smoke=smoke)
  except TypeError as e:  # an older mpx without the option this configuration needs
    return {"model": model, "config": config, "error": str(e)}
  with setups.precision_scope(setup):
    carry, batch = setups.abstract_carry(setup)
    params, _, state = carry
    residuals = figures.saved_residual_bytes(setup.loss_fn, params, state, batch, has_aux=True)
    lowered = jax.jit(setup.step, donate_argnums=0).lower(carry, batch)
  return {
    "model": model,
    "config": config,
    "residual_bytes": residuals,
    "converts": figures.count_converts(lowered.as_text()),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny models")
  parser.add_argument("--models", nargs="+", default=list(setups.MODELS))
  parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
  parser.add_argument("--out", help="JSON path (default: print only)")
  args = parser.parse_args(argv)
  rows = [measure(m, c, smoke=args.smoke) for m in args.models for c in args.configs]
  base = {
    r["model"]: r["residual_bytes"] for r in rows if r["config"] == "f32" and "error" not in r
  }
  print(f"mpx from {pathlib.Path(mpx.__file__).parent}")
  print("| model | config | residual MiB | ratio to f32 | converts |\n|---|---|---:|---:|---:|")
  for r in rows:
    if "error" in r:
      print(f"| {r['model']} | {r['config']} | n/a: {r['error']} | | |")
      continue
    ratio = r["residual_bytes"] / base[r["model"]] if r["model"] in base else float("nan")
    r["residual_ratio"] = ratio
    print(
      f"| {r['model']} | {r['config']} | {r['residual_bytes'] / 2**20:.0f} | {ratio:.3f} "
      f"| {r['converts']} |"
    )
  if args.out:
    out = {"mpx": str(pathlib.Path(mpx.__file__).parent), "smoke": args.smoke, "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
  main()
