"""The ``python -m mpx.diagnose`` command: the precision diagnostics on a small built-in model.

It trains nothing of importance: a linen MLP on synthetic data stands in for
the user's model, so that the command shows, end to end and in a few seconds
on a CPU, what each diagnostic says and draws:

1. the gradients of a float32 step (loss scale 1), activations and
   parameters, as a log2 magnitude histogram against the target format, at
   scale 1 and at the recommended scale (the paper's Figure 3);
2. the recommended static scale, with its numbers (:func:`mpx.diagnostics.recommend_scale`);
3. per module, the fraction of gradient values flushed to zero at each scale;
4. the loss scale of a short mixed-float16 training run started too high,
   with its skipped steps, and the non-finite locator on its first step.

The figures are computed first and printed before anything is drawn, so the
text report survives a missing or failing matplotlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import errors
from mpx._src.adapters import linen
from mpx._src.diagnostics import bits, histogram, linen_taps, plots, range_report
from mpx._src.scaling import train_step, transform
from mpx.demo import _progress as progress

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


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  """What :func:`diagnose` found, before anything is drawn.

  Attributes:
    dtype: the target format.
    histogram: the log2 magnitude histogram of the float32 step's gradients.
    at_scale_one: their range report at scale 1.
    recommendation: the recommended static scale and its figures.
    flushed: per module, the range report of its activation gradients at
      every scale of ``SCALES``.
    locator: the non-finite locator's report on the first mixed-float16 step.
    scales: the loss scale before each training step.
    skipped: whether each training step was skipped.
  """

  dtype: str
  histogram: Any
  at_scale_one: range_report.RangeReport
  recommendation: range_report.ScaleRecommendation
  flushed: dict[str, range_report.RangeReport]
  locator: Any
  scales: list[float]
  skipped: list[bool]

  @property
  def scale(self) -> float:
    """The recommended scale, 1 where there is none (a tree without nonzero values)."""
    scale = float(self.recommendation.scale)
    return scale if np.isfinite(scale) else 1.0


def _float32_gradients(
  loss_fn: Any, params: Any, x: jax.Array, labels: jax.Array, dtype: str
) -> tuple[Any, range_report.RangeReport, range_report.ScaleRecommendation]:
  """Stages 1-2: the histogram, range report and recommended scale of a float32 step's gradients.

  Those are what a loss scale multiplies: the activations' gradients and the
  parameters' (sums over the batch, so larger).
  """
  progress.stage("[1/4] gradients of a float32 step and the recommended scale")
  stats = linen_taps.collect_activations(loss_fn, params, x, labels, stat=_raw)
  grads = ([stats.output_grads[k] for k in stats.modules], stats.param_grads)
  return (
    histogram.magnitude_histogram(grads),
    range_report.range_report(grads, dtype),
    range_report.recommend_scale(grads, dtype),
  )


def _flushed_per_module(
  loss_fn: Any, params: Any, x: jax.Array, labels: jax.Array, dtype: str
) -> dict[str, range_report.RangeReport]:
  """Stage 3: per module, the range report of its activation gradients at every scale."""
  progress.stage(f"[2/4] flushed fractions per module at {len(SCALES)} scales")
  stat = functools.partial(range_report.range_report, dtype=dtype, scale=SCALES)
  ranges = linen_taps.collect_activations(loss_fn, params, x, labels, stat=stat)
  return {k: ranges.output_grads[k] for k in ranges.modules}


def _mixed_float16_run(
  model: DemoMlp, params: Any, x: jax.Array, labels: jax.Array, *, steps: int, seed: int
) -> tuple[Any, list[float], list[bool]]:
  """Stage 4: a mixed-float16 run whose loss scale starts too high.

  Returns:
    The non-finite locator's report on its first step, and the loss scale
    before and the skip of each training step.
  """
  progress.stage("[3/4] the non-finite locator on a mixed-float16 step")
  half_loss = _loss_fn(linen.apply_policy(model, "mixed_float16"))
  tx = transform.dynamic_loss_scale(
    optax.sgd(0.1, momentum=0.9), initial_scale=INITIAL_SCALE, growth_interval=40
  )
  report = linen_taps.locate_nonfinite(half_loss, params, x, labels, loss_scale=INITIAL_SCALE)

  @jax.jit
  def step(params: Any, opt_state: Any, x: jax.Array, labels: jax.Array) -> Any:
    loss, g = train_step.value_and_grad(half_loss, opt_state)(params, x, labels)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  progress.stage(f"[4/4] {steps} mixed-float16 training steps")
  bar = progress.Progress(steps, "mixed float16")
  opt_state = tx.init(params)
  scales, skipped = [], []
  for i in range(steps):
    scales.append(float(train_step.get_loss_scale(opt_state)))
    xb, lb = _batch(seed + 1 + i)
    params, opt_state, loss = step(params, opt_state, xb, lb)
    skipped.append(bool(train_step.loss_scale_metrics(opt_state)["last_step_skipped"]))
    bar.update(float(loss), scales[-1])
  bar.close()
  return report, scales, skipped


def diagnose(
  *, dtype: str = "float16", steps: int = 200, depth: int = 10, seed: int = 0
) -> Diagnosis:
  """Runs every diagnostic on the built-in model, drawing nothing.

  Announces each stage on stderr (compilation dominates on a CPU) and shows
  the training run's progress (tqdm when installed).

  Args:
    dtype: the target format of the histogram, recommendation and heat map.
    steps: training steps of the loss-scale trajectory.
    depth: hidden layers of the built-in MLP.
    seed: the seed of the data and the initial weights.

  Returns:
    A :class:`Diagnosis`.
  """
  x, labels = _batch(seed)
  model = DemoMlp(depth=depth)
  params = model.init(jax.random.key(seed), x)
  loss_fn = _loss_fn(model)
  hist, at_one, rec = _float32_gradients(loss_fn, params, x, labels, dtype)
  flushed = _flushed_per_module(loss_fn, params, x, labels, dtype)
  locator, scales, skipped = _mixed_float16_run(model, params, x, labels, steps=steps, seed=seed)
  return Diagnosis(
    dtype=dtype,
    histogram=hist,
    at_scale_one=at_one,
    recommendation=rec,
    flushed=flushed,
    locator=locator,
    scales=scales,
    skipped=skipped,
  )


def draw(diagnosis: Diagnosis, out_dir: str) -> dict[str, str]:
  """Writes the three PNGs of a diagnosis.

  Args:
    diagnosis: what :func:`diagnose` returned.
    out_dir: where the PNGs go (created if missing).

  Returns:
    ``{"histogram": path, "heatmap": path, "loss_scale": path}``.

  Raises:
    ImportError: matplotlib is not installed (the ``plots`` extra).
  """
  from matplotlib.figure import Figure

  os.makedirs(out_dir, exist_ok=True)
  dtype, scale = diagnosis.dtype, diagnosis.scale
  fig = Figure(figsize=(9.0, 8.0), layout="constrained")
  top, bottom = fig.subplots(2, 1)
  plots.plot_magnitude_histogram(
    diagnosis.histogram,
    dtype,
    report=diagnosis.at_scale_one,
    ax=top,
    title=f"Gradients (activations and parameters) of a float32 step, against {dtype}",
  )
  plots.plot_magnitude_histogram(
    diagnosis.histogram,
    dtype,
    scale=scale,
    report=diagnosis.recommendation.report,
    ax=bottom,
    title=f"The same, multiplied by the recommended scale 2^{int(np.log2(scale))}",
  )
  paths = {"histogram": os.path.join(out_dir, "activation_gradients.png")}
  fig.savefig(paths["histogram"], dpi=110)

  ax = plots.plot_flushed_heatmap(
    diagnosis.flushed,
    SCALES,
    mark_scale=scale,
    mark_label="recommended scale",
    title=f"Activation gradients flushed to zero in {dtype}, per module",
  )
  paths["heatmap"] = os.path.join(out_dir, "flushed_heatmap.png")
  ax.figure.savefig(paths["heatmap"], dpi=110)

  ax = plots.plot_loss_scale(
    diagnosis.scales,
    diagnosis.skipped,
    title=f"Dynamic loss scale, mixed float16, from 2^{int(np.log2(INITIAL_SCALE))}",
  )
  paths["loss_scale"] = os.path.join(out_dir, "loss_scale.png")
  ax.figure.savefig(paths["loss_scale"], dpi=110)
  return paths


def _fractions(report: range_report.RangeReport) -> str:
  return ", ".join(
    f"{name} {float(getattr(report, name)):.2%}" for name in range_report.RangeReport._fields[:5]
  )


def text_report(diagnosis: Diagnosis) -> str:
  """Returns what the command prints about a diagnosis.

  Args:
    diagnosis: what :func:`diagnose` returned.

  Returns:
    The recommendation's figures, the training run's skipped steps and the
    locator's report, as lines of text.
  """
  rec = diagnosis.recommendation
  return "\n".join(
    [
      f"Gradients of a float32 step (activations and parameters) in {diagnosis.dtype} at scale 1:",
      f"  {_fractions(diagnosis.at_scale_one)}",
      f"Recommended static scale {float(rec.scale):g}: the largest that overflows nothing with "
      f"2x headroom (at most {float(rec.max_scale):g}); at least {float(rec.min_scale):g} keeps "
      f"the flushed fraction <= 0.1% (feasible: {bool(rec.feasible)}).",
      f"  at {float(rec.scale):g}: {_fractions(rec.report)}",
      f"Mixed float16 training: {sum(diagnosis.skipped)} of {len(diagnosis.skipped)} steps "
      "skipped.",
      "Non-finite locator on the first step:",
      str(diagnosis.locator),
    ]
  )


def _int_at_least(minimum: int) -> Callable[[str], int]:
  """An argparse type: an integer of at least ``minimum``, else a message saying so."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"{value} is too small: pass {minimum} or more")
    return value

  return parse


def _target_format(text: str) -> str:
  try:
    bits.get_format(text)
  except errors.PolicyError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


_PLOTS_EXTRA = 'pip install "mpx-mixed-precision[plots]"'


def _has_matplotlib() -> bool:
  try:
    import matplotlib  # noqa: F401  # pyright: ignore[reportUnusedImport]
  except ImportError:
    return False
  return True


def build_parser() -> argparse.ArgumentParser:
  """Returns the command's argument parser; it validates every value before any work starts.

  Returns:
    The ``argparse.ArgumentParser`` of ``python -m mpx.diagnose``.
  """
  parser = argparse.ArgumentParser(
    prog="python -m mpx.diagnose",
    description="Precision diagnostics (magnitude histogram, recommended scale, flushed "
    "fractions per module, loss-scale trajectory, non-finite locator) on a small built-in "
    "linen MLP. Prints a text report, then writes three PNGs when matplotlib is installed "
    f"({_PLOTS_EXTRA}).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--out", default="mpx_diagnostics", help="output directory for the PNGs")
  parser.add_argument(
    "--dtype",
    type=_target_format,
    default="float16",
    help="target format: float16, bfloat16, float8_e4m3fn, float8_e5m2 (or another ml_dtypes "
    "format with subnormals)",
  )
  parser.add_argument(
    "--steps",
    type=_int_at_least(1),
    default=200,
    help="training steps of the loss-scale trajectory",
  )
  parser.add_argument(
    "--depth", type=_int_at_least(1), default=10, help="hidden layers of the built-in MLP"
  )
  parser.add_argument(
    "--seed", type=_int_at_least(0), default=0, help="seed of the data and the weights"
  )
  parser.add_argument(
    "--plots",
    choices=("auto", "always", "never"),
    default="auto",
    help="'auto' draws the PNGs when matplotlib is installed and says how to install it "
    "otherwise; 'always' fails at once without matplotlib; 'never' prints the text only",
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  """Runs the diagnostics from the command line: the text report, then the PNGs.

  Arguments are checked before any work starts. Without matplotlib the text
  report is printed all the same, with a note on how to get the plots; only
  ``--plots always`` turns a missing matplotlib into an error (exit status 2).

  Args:
    argv: the arguments, ``sys.argv[1:]`` if ``None``.
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  draw_plots = args.plots != "never" and _has_matplotlib()
  if args.plots == "always" and not draw_plots:
    parser.error(f"--plots always needs matplotlib: {_PLOTS_EXTRA}")
  diagnosis = diagnose(dtype=args.dtype, steps=args.steps, depth=args.depth, seed=args.seed)
  print(text_report(diagnosis), flush=True)
  if draw_plots:
    for name, path in draw(diagnosis, args.out).items():
      print(f"wrote {name}: {path}")
  elif args.plots == "auto":
    print(f"No plots: matplotlib is not installed ({_PLOTS_EXTRA}).", file=sys.stderr)
