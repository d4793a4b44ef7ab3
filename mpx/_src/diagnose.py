"""The ``python -m mpx.diagnose`` command: the precision diagnostics on a small built-in model.

It trains nothing of importance: a linen MLP on synthetic data stands in for
the user's model, so that the command shows, end to end and in a few seconds
on a CPU, what each diagnostic says and draws:

1. the gradients of a float32 step (loss scale 1), activations and
   parameters, as a log2 magnitude histogram against the target format, at
   scale 1 and at the recommended scale (the paper's Figure 3);
2. the recommended static scale, with its numbers (:func:`mpx.recommend_scale`);
3. per module, the fraction of gradient values flushed to zero at each scale;
4. the loss scale of a short mixed-float16 training run started too high,
   with its skipped steps, and the non-finite locator on its first step.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import (
  histogram,
  linen,
  linen_diagnostics,
  loss_scaling,
  plots,
  range_report,
  scaled_loss,
)

SCALES = 2.0 ** np.arange(0, 33)
INITIAL_SCALE = 2.0**24


class DemoMlp(nn.Module):
  """The built-in model: ``depth`` tanh layers of ``width`` units, then a classifier head.

  Deep, narrow and initialised small (a variance of 0.1 / fan-in), its
  gradients shrink layer by layer toward the input, so that many fall below
  float16's range, as in the paper's Figure 3.
  """

  width: int = 64
  depth: int = 10
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.variance_scaling(0.1, "fan_in", "normal")
    for i in range(self.depth):
      x = jnp.tanh(nn.Dense(self.width, kernel_init=init, name=f"dense_{i}")(x))
    return nn.Dense(self.classes, kernel_init=init, name="head")(x)


def _batch(seed: int, size: int = 256, features: int = 32) -> tuple[jax.Array, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (size, features), jnp.float32)
  labels = jnp.argmax(x @ jax.random.normal(k2, (features, 10), jnp.float32), axis=-1)
  return x, labels


def _loss_fn(model: Any) -> Any:
  def loss_fn(params: Any, x: jax.Array, labels: jax.Array) -> jax.Array:
    logits = model.apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss_fn


def _raw(values: Any) -> Any:
  return values


def run_diagnosis(
  out_dir: str, *, dtype: str = "float16", steps: int = 200, depth: int = 10, seed: int = 0
) -> dict[str, Any]:
  """Runs every diagnostic on the built-in model and writes the PNGs.

  Args:
    out_dir: where the PNGs go (created if missing).
    dtype: the target format of the histogram, recommendation and heat map.
    steps: training steps of the loss-scale trajectory.
    depth: hidden layers of the built-in MLP.
    seed: the seed of the data and the initial weights.

  Returns:
    A summary: the PNG paths, the recommendation's figures, the locator's
    report and the training run's skipped steps.
  """
  os.makedirs(out_dir, exist_ok=True)
  x, labels = _batch(seed)
  model = DemoMlp(depth=depth)
  params = model.init(jax.random.key(seed), x)
  loss_fn = _loss_fn(model)

  # 1-2: the gradients of a float32 step, what a loss scale multiplies: those of the
  # activations and those of the parameters (sums over the batch, so larger).
  stats = linen_diagnostics.collect_activations(loss_fn, params, x, labels, stat=_raw)
  grads = ([stats.output_grads[k] for k in stats.modules], stats.param_grads)
  hist = histogram.magnitude_histogram(grads)
  rec = range_report.recommend_scale(grads, dtype)
  at_one = range_report.range_report(grads, dtype)
  scale = float(rec.scale) if np.isfinite(float(rec.scale)) else 1.0
  from matplotlib.figure import Figure

  fig = Figure(figsize=(9.0, 8.0), layout="constrained")
  top, bottom = fig.subplots(2, 1)
  plots.plot_magnitude_histogram(
    hist,
    dtype,
    report=at_one,
    ax=top,
    title=f"Gradients (activations and parameters) of a float32 step, against {dtype}",
  )
  plots.plot_magnitude_histogram(
    hist,
    dtype,
    scale=scale,
    report=rec.report,
    ax=bottom,
    title=f"The same, multiplied by the recommended scale 2^{int(np.log2(scale))}",
  )
  paths = {"histogram": os.path.join(out_dir, "activation_gradients.png")}
  fig.savefig(paths["histogram"], dpi=110)

  # 3: flushed fractions per module and scale.
  stat = functools.partial(range_report.range_report, dtype=dtype, scale=SCALES)
  ranges = linen_diagnostics.collect_activations(loss_fn, params, x, labels, stat=stat)
  ax = plots.plot_flushed_heatmap(
    {k: ranges.output_grads[k] for k in ranges.modules},
    SCALES,
    mark_scale=scale,
    mark_label="recommended scale",
    title=f"Activation gradients flushed to zero in {dtype}, per module",
  )
  paths["heatmap"] = os.path.join(out_dir, "flushed_heatmap.png")
  ax.figure.savefig(paths["heatmap"], dpi=110)

  # 4: a mixed-float16 run whose loss scale starts too high, and the locator on its first step.
  half = linen.apply_policy(model, "mixed_float16")
  half_loss = _loss_fn(half)
  tx = loss_scaling.dynamic_loss_scale(
    optax.sgd(0.1, momentum=0.9), initial_scale=INITIAL_SCALE, growth_interval=40
  )
  report = linen_diagnostics.locate_nonfinite(
    half_loss, params, x, labels, loss_scale=INITIAL_SCALE
  )

  @jax.jit
  def step(params: Any, opt_state: Any, x: jax.Array, labels: jax.Array) -> Any:
    _, g = scaled_loss.value_and_grad(half_loss, opt_state)(params, x, labels)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  scales, skipped = [], []
  for i in range(steps):
    scales.append(float(scaled_loss.get_loss_scale(opt_state)))
    xb, lb = _batch(seed + 1 + i)
    params, opt_state = step(params, opt_state, xb, lb)
    skipped.append(bool(scaled_loss.loss_scale_metrics(opt_state)["last_step_skipped"]))
  ax = plots.plot_loss_scale(
    scales,
    skipped,
    title=f"Dynamic loss scale, mixed float16, from 2^{int(np.log2(INITIAL_SCALE))}",
  )
  paths["loss_scale"] = os.path.join(out_dir, "loss_scale.png")
  ax.figure.savefig(paths["loss_scale"], dpi=110)
  return {
    "paths": paths,
    "recommendation": rec,
    "at_scale_one": at_one,
    "locator": report,
    "skipped_steps": int(sum(skipped)),
    "steps": steps,
  }


def _fractions(report: range_report.RangeReport) -> str:
  return ", ".join(
    f"{name} {float(getattr(report, name)):.2%}" for name in range_report.RangeReport._fields[:5]
  )


def main(argv: list[str] | None = None) -> None:
  """Runs :func:`run_diagnosis` from the command line and prints what it found.

  Args:
    argv: the arguments, ``sys.argv[1:]`` if ``None``.
  """
  parser = argparse.ArgumentParser(
    prog="python -m mpx.diagnose",
    description="Precision diagnostics (magnitude histogram, recommended scale, flushed "
    "fractions per module, loss-scale trajectory, non-finite locator) on a small built-in "
    "linen MLP; writes PNGs.",
  )
  parser.add_argument("--out", default="mpx_diagnostics", help="output directory for the PNGs")
  parser.add_argument("--dtype", default="float16", help="target format, e.g. float8_e5m2")
  parser.add_argument("--steps", type=int, default=200, help="training steps of the trajectory")
  parser.add_argument("--depth", type=int, default=10, help="hidden layers of the built-in MLP")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  summary = run_diagnosis(
    args.out, dtype=args.dtype, steps=args.steps, depth=args.depth, seed=args.seed
  )
  rec = summary["recommendation"]
  print(f"Gradients of a float32 step (activations and parameters) in {args.dtype} at scale 1:")
  print(f"  {_fractions(summary['at_scale_one'])}")
  print(
    f"Recommended static scale {float(rec.scale):g}: the largest that overflows nothing with "
    f"2x headroom (at most {float(rec.max_scale):g}); at least {float(rec.min_scale):g} keeps "
    f"the flushed fraction <= 0.1% (feasible: {bool(rec.feasible)})."
  )
  print(f"  at {float(rec.scale):g}: {_fractions(rec.report)}")
  print(f"Mixed float16 training: {summary['skipped_steps']} of {summary['steps']} steps skipped.")
  print("Non-finite locator on the first step:")
  print(summary["locator"])
  for name, path in summary["paths"].items():
    print(f"wrote {name}: {path}")
