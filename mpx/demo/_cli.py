"""``python -m mpx.demo``: the command line, the run order and what gets printed."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import platform
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import flax
import jax
import optax

import mpx
from mpx.demo import _configs, _data, _float16, _plots, _report, _settings, _train
from mpx.demo._settings import DEFAULT_SETTINGS as DEFAULT
from mpx.demo._settings import QUICK_SETTINGS as QUICK


def _parser() -> argparse.ArgumentParser:
  names = "\n".join(f"  {c.name:<26}{c.shows}" for c in _configs.CONFIGS)
  names += "\nopt-in (not run by default):\n" + "\n".join(
    f"  {c.name:<26}{c.shows}" for c in (*_configs.EXTRA_CONFIGS, *_configs.FP8_CONFIGS)
  )
  parser = argparse.ArgumentParser(
    prog="python -m mpx.demo",
    description=textwrap.fill(
      "Trains a small character-level transformer on Python's own help text "
      "(pydoc_data.topics) under six precision configurations and shows why each part of mpx "
      "exists: float32 master weights, loss scaling, and float16/bfloat16 compute. Prints a "
      "table, writes it as JSON and draws three PNGs (validation loss, loss scale, activation "
      "gradients against float16's range).",
      width=88,
    ),
    epilog=f"configurations (--configs):\n{names}",
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--quick", action="store_true", help="tiny model and few steps, under a minute on 2 CPU cores"
  )
  parser.add_argument(
    "--steps", type=int, help=f"optimizer steps (default {DEFAULT.steps}, quick {QUICK.steps})"
  )
  parser.add_argument(
    "--configs",
    default=",".join(c.name for c in _configs.CONFIGS),
    help="comma-separated subset of the configurations below (default: all six)",
  )
  parser.add_argument(
    "--out", default="demo_out", help="directory for the JSON and PNGs (default demo_out/)"
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="seed of the initialisation and the batches"
  )
  return parser


def _settings_from(args: argparse.Namespace) -> _settings.Settings:
  base = QUICK if args.quick else DEFAULT
  steps = base.steps if args.steps is None else args.steps
  eval_every = base.eval_every if args.steps is None else max(1, steps // 15)
  return dataclasses.replace(base, steps=steps, eval_every=eval_every, seed=args.seed)


def _header(settings: _settings.Settings, corpus: _data.Corpus, param_count: int) -> list[str]:
  m, device = settings.model, jax.devices()[0]
  devices = settings.mirrored_devices
  return [
    f"mpx {mpx.__version__} demo | jax {jax.__version__}, flax {flax.__version__}, optax "
    f"{optax.__version__} | device: {device.platform} ({device.device_kind})",
    f"model: {param_count:,} params; {m.num_layers} blocks, d_model {m.d_model}, {m.num_heads} "
    f"heads, context {m.max_len}, {m.vocab_size} characters",
    f"data: pydoc_data.topics, {corpus.train.size:,} training and {corpus.valid.size:,} "
    "validation characters",
    f"each step: {settings.batch_size} x {m.max_len} = {settings.local_tokens:,} tokens; it "
    f"differentiates sum(token losses) / {settings.global_batch_tokens:,}: one device's share of "
    f"a data-parallel step over a global batch of {settings.global_batch_tokens:,} tokens "
    f"({devices} devices like this one). The optimizer gets {devices} x the local gradient in "
    "place of the all-reduce; the loss reported is the per-token mean.",
    f"optimizer: adamw, peak learning rate {settings.learning_rate:g} (warmup, cosine decay), "
    f"{settings.steps} steps, seed {settings.seed}; identical for every run."
    + (
      " Quick mode: XLA backend optimisations off to compile faster."
      if settings.fast_compile
      else ""
    ),
  ]


def _environment() -> dict[str, Any]:
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "versions": {
      "mpx": mpx.__version__,
      "jax": jax.__version__,
      "flax": flax.__version__,
      "optax": optax.__version__,
      "python": platform.python_version(),
    },
    "device": f"{device.platform} ({device.device_kind})",
  }


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo.

  Args:
    argv: command-line arguments without the program name (default: ``sys.argv[1:]``).

  Returns:
    The exit status, 0 on success.
  """
  parser = _parser()
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.configs.split(",") if n.strip()]
  unknown = [n for n in names if n not in _configs.BY_NAME]
  if unknown or not names:
    parser.error(
      f"unknown configuration(s) {', '.join(unknown) or '(none given)'}; choose from "
      f"{', '.join(_configs.BY_NAME)}"
    )
  configs = [c for c in _configs.BY_NAME.values() if c.name in names]
  settings = _settings_from(args)
  try:
    settings.check()
  except ValueError as error:
    parser.error(str(error))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  start = time.perf_counter()
  corpus = _data.load_corpus()
  data = _settings.make_data(settings, corpus)
  for line in _header(settings, corpus, _train.param_count(settings)):
    print(textwrap.fill(line, width=100, subsequent_indent="  "), flush=True)
  results = [_train.train(config, settings, data) for config in configs]

  source = next((r for r in results if r.config.name == "float32"), results[0])
  sample = _report.GradientSample(
    values=_train.activation_gradients(settings, source.params, data.probe),
    source=f"the {source.config.name} run",
  )
  unigram = _data.unigram_loss(corpus)
  rows = _report.summarize(results, sample, settings)
  notes = _report.explain(rows, unigram=unigram, sample=sample)
  print()
  print(_report.table(rows))
  print()
  for line in notes:
    print(f"* {line}")
  pngs = _plots.save_plots(
    out,
    rows,
    unigram=unigram,
    gradients=sample.values,
    gradient_source=sample.source,
    growth_interval=settings.growth_interval,
  )
  if pngs is None:
    print("* matplotlib is not installed (pip install 'mpx-mixed-precision[demo]'): no PNGs.")
  wall = time.perf_counter() - start
  payload = {
    "command": " ".join(["python -m mpx.demo", *(argv if argv is not None else sys.argv[1:])]),
    "quick": bool(args.quick),
    **_environment(),
    "settings": {
      **dataclasses.asdict(settings),
      "local_tokens": settings.local_tokens,
      "mirrored_devices": settings.mirrored_devices,
    },
    "param_count": results[0].param_count,
    "unigram_val_loss": unigram,
    "fail_margin": _report.FAIL_MARGIN,
    "match_margin": _report.MATCH_MARGIN,
    "gradient_sample": {
      "what": "d(sum(token losses) / global_batch_tokens) / d(block output), float32 model",
      "source": sample.source,
      "values": int(sample.values.size),
      "histogram_scale_1": _float16.log2_histogram(sample.values),
    },
    "runs": rows,
    "notes": notes,
    "pngs": [p.name for p in pngs] if pngs else [],
    "wall_seconds": wall,
  }
  _report.write_json(out / "results.json", payload)
  print(f"* wrote {out / 'results.json'}" + (f" and {len(pngs)} PNGs" if pngs else ""))
  print(f"* wall time {wall:.1f} s")
  return 0
