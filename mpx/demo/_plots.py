"""The demo's three figures, drawn with matplotlib's Agg canvas (no display needed).

matplotlib is optional (the ``demo`` extra): :func:`save_plots` returns
``None`` when it cannot be imported and the caller prints a note.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import numpy as np

from mpx.demo import _float16

_REFERENCE = "float32"


def _figure(width: float = 8.0, height: float = 4.8) -> Any:
  from matplotlib.figure import Figure  # pyright: ignore[reportMissingImports]

  return Figure(figsize=(width, height), layout="constrained")


# Runs that match one another draw identical curves: each gets its own line style and
# hollow marker shape, widest first, so the ones drawn later stay visible on top.
_STYLES = (
  {"linestyle": "-", "marker": "o", "linewidth": 3.0, "markersize": 9},
  {"linestyle": "--", "marker": "s", "linewidth": 2.2, "markersize": 7},
  {"linestyle": "-.", "marker": "^", "linewidth": 1.6, "markersize": 6},
  {"linestyle": ":", "marker": "D", "linewidth": 1.4, "markersize": 4},
  {"linestyle": "-", "marker": "v", "linewidth": 1.0, "markersize": 4},
  {"linestyle": "--", "marker": "P", "linewidth": 1.0, "markersize": 4},
)


def _style(k: int) -> dict[str, Any]:
  return {**_STYLES[k % len(_STYLES)], "markerfacecolor": "none", "zorder": 2 + k}


def _same_as(values: np.ndarray, earlier: dict[str, np.ndarray], tolerance: float) -> str | None:
  """The name of an earlier curve that ``values`` lies on (to ``tolerance``), if any."""
  for name, other in earlier.items():
    if other.shape == values.shape and np.allclose(other, values, rtol=0, atol=tolerance):
      return name
  return None


def _validation_curves(rows: list[dict[str, Any]], unigram: float, path: pathlib.Path) -> None:
  fig = _figure()
  ax = fig.add_subplot()
  drawn: dict[str, np.ndarray] = {}
  for k, r in enumerate(rows):
    steps = np.asarray(r["curves"]["eval_steps"], float)
    losses = np.asarray([np.nan if v is None else v for v in r["curves"]["val_loss"]], float)
    label = r["name"]
    finite = np.isfinite(losses)
    if r["first_nonfinite_step"]:
      label += f" (loss not finite from step {r['first_nonfinite_step']})"
    elif (twin := _same_as(losses, drawn, 0.01)) is not None:
      label += f" (on {twin}'s curve)"
    drawn[r["name"]] = losses
    if r["name"] == _REFERENCE:  # wide and underneath, so the runs that match it stay visible
      style = {"color": "black", "linewidth": 5, "alpha": 0.35, "zorder": 1}
    else:
      style = _style(k)
    (line,) = ax.plot(steps, losses, label=label, **style)
    if not finite.all() and finite.any():
      last = np.flatnonzero(finite)[-1]
      ax.plot(steps[last], losses[last], marker="X", markersize=10, color=line.get_color())
  ax.axhline(unigram, color="grey", linestyle="--", linewidth=1, label="unigram model (no context)")
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss (nats per character)")
  ax.set_title("Validation loss, character-level transformer on pydoc_data.topics")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  fig.savefig(path, dpi=120)


def _safe_window(values: np.ndarray) -> tuple[float, float]:
  """Powers of two: the smallest scale at which under 1% of ``values`` flush, the largest without overflow."""
  exponents = range(-10, 80)
  flush_ok = [e for e in exponents if _float16.flushed_fraction(values, 2.0**e) < 0.01]
  overflow_ok = [e for e in exponents if _float16.overflow_fraction(values, 2.0**e) == 0.0]
  return 2.0 ** min(flush_ok, default=80), 2.0 ** max(overflow_ok, default=-10)


def _loss_scales(
  rows: list[dict[str, Any]], gradients: np.ndarray, growth_interval: int, path: pathlib.Path
) -> None:
  fig = _figure(8.0, 4.4)
  ax = fig.add_subplot()
  scaled = [r for r in rows if r["loss_scaling"] == "dynamic"]
  start = f" from {_scale_name(scaled[0]['curves']['loss_scale'][0])}" if scaled else ""
  title = (
    f"Dynamic loss scale{start}, doubled after {growth_interval} finite steps\n"
    "and halved, the step skipped, when the gradients overflow"
  )
  low, high = _safe_window(gradients)
  ax.axhline(
    low,
    color="red",
    linestyle=":",
    label=f"below {_scale_name(low)}: 1% or more of the sampled activation gradients flush",
  )
  ax.axhline(
    high,
    color="purple",
    linestyle=":",
    label=f"above {_scale_name(high)}: the largest sampled activation gradient overflows",
  )
  drawn: dict[str, np.ndarray] = {}
  for k, r in enumerate(scaled):
    scales = np.asarray(r["curves"]["loss_scale"], float)
    steps = np.arange(1, scales.size + 1)
    skipped = np.asarray(r["curves"]["skipped_at"], int)
    label = f"{r['name']} ({skipped.size} skipped)"
    if (twin := _same_as(scales, drawn, 0.0)) is not None:
      label += f", the same trajectory as {twin}"
    drawn[r["name"]] = scales
    line_style = {key: _style(k)[key] for key in ("linestyle", "linewidth", "zorder")}
    (line,) = ax.step(steps, scales, where="post", label=label, **line_style)
    if skipped.size:
      ax.plot(
        skipped,
        scales[skipped - 1],
        _STYLES[k % len(_STYLES)]["marker"],
        color=line.get_color(),
        markerfacecolor="none",
        markersize=10 - 2 * k,
        zorder=10 + k,
      )
  if scaled:
    ax.plot(
      [],
      [],
      "o",
      color="black",
      markerfacecolor="none",
      label="skipped step (non-finite gradients)",
    )
  else:
    ax.text(0.5, 0.5, "no run with loss scaling", ha="center", transform=ax.transAxes)
  ax.set_yscale("log", base=2)
  ax.legend(fontsize="small")
  ax.set_xlabel("step")
  ax.set_ylabel("loss scale used by the step")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  fig.savefig(path, dpi=120)


def _gradient_histogram(
  values: np.ndarray, source: str, shown: tuple[str, float] | None, path: pathlib.Path
) -> None:
  fig = _figure(9.0, 5.8)
  ax = fig.add_subplot()
  low, high = -44, 18
  series = [(f"float32 activation gradients ({source})", 1.0)]
  if shown is not None:
    series.append((f"x {_scale_name(shown[1])}, {shown[0]}'s final loss scale", shown[1]))
  for k, (label, scale) in enumerate(series):
    hist = _float16.log2_histogram(values, low=low, high=high, scale=scale)
    percent = 100.0 * np.asarray(hist["counts"], float) / max(1, hist["total"])
    flushed = _float16.flushed_fraction(values, scale)
    ax.bar(
      np.asarray(hist["exponents"]) + 0.5,
      percent,
      width=1.0,
      alpha=0.55 if k == 0 else 0.45,
      edgecolor="black",
      linewidth=0.3,
      label=f"{label}: {100 * flushed:.1f}% flush to 0",
    )
  tiny = _float16.SMALLEST_SUBNORMAL_LOG2
  ax.axvspan(low, tiny - 1, color="red", alpha=0.12, label="flushed to 0 in float16 (<= 2^-25)")
  ax.axvspan(
    tiny - 1,
    tiny,
    color="red",
    alpha=0.06,
    hatch="//",
    label="below 2^-24 but rounded up to it (2^-25 .. 2^-24)",
  )
  ax.axvspan(
    _float16.SMALLEST_SUBNORMAL_LOG2,
    _float16.SMALLEST_NORMAL_LOG2,
    color="orange",
    alpha=0.15,
    label="float16 subnormals (2^-24 .. 2^-14)",
  )
  ax.axvline(
    math.log2(_float16.LARGEST), color="purple", linestyle="--", label="float16 overflow (65504)"
  )
  ax.set_xlim(low, high)
  ax.set_xlabel("log2 |gradient|")
  ax.set_ylabel("% of values")
  ax.set_title(
    "Activation gradients (d loss / d block output) vs float16's range (cf. paper, Fig. 3)"
  )
  ax.grid(alpha=0.3)
  fig.legend(fontsize="small", loc="outside lower center", ncols=2)
  fig.savefig(path, dpi=120)


def _scale_name(scale: float) -> str:
  exponent = math.log2(scale)
  return f"2^{int(exponent)}" if exponent.is_integer() else f"{scale:g}"


def save_plots(
  out: pathlib.Path,
  rows: list[dict[str, Any]],
  *,
  unigram: float,
  gradients: np.ndarray,
  gradient_source: str,
  growth_interval: int,
) -> list[pathlib.Path] | None:
  """Draws the validation curves, the loss-scale trajectories and the gradient histogram.

  Args:
    out: the directory the PNGs go to.
    rows: the table's rows (``mpx.demo._report.summarize``).
    unigram: the unigram model's validation loss, drawn as a reference line.
    gradients: the float32 activation gradients.
    gradient_source: which run's params they were measured at.
    growth_interval: finite steps between loss-scale growths, for the title.

  Returns:
    The paths written, or ``None`` if matplotlib is not installed.
  """
  try:
    import matplotlib  # pyright: ignore[reportMissingImports]  # noqa: F401
  except ImportError:
    return None
  paths = [out / "val_loss.png", out / "loss_scale.png", out / "activation_gradients.png"]
  _validation_curves(rows, unigram, paths[0])
  _loss_scales(rows, gradients, growth_interval, paths[1])
  scaled = [r for r in rows if r["loss_scaling"] == "dynamic"]
  preferred = sorted(scaled, key=lambda r: r["name"] != "mixed_float16")
  shown = (preferred[0]["name"], preferred[0]["final_loss_scale"]) if preferred else None
  _gradient_histogram(gradients, gradient_source, shown, paths[2])
  return paths
