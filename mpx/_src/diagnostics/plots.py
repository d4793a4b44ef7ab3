"""Plots of the precision diagnostics: magnitude histograms, the loss scale, flushed fractions.

matplotlib is imported inside each function (``pip install
"mpx-mixed-precision[plots]"``), never by ``import mpx``. Figures are built
with matplotlib's object API (no ``pyplot``, no display needed); every
function draws into the given ``ax`` or a new figure and returns the axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpx._src import errors
from mpx._src.diagnostics import bits as float_bits
from mpx._src.diagnostics.histogram import EXPONENTS, MagnitudeHistogram
from mpx._src.diagnostics.range_report import RangeReport

# Region colours: flushed, subnormal, normal, overflow.
_COLOURS = ("#d62728", "#ff7f0e", "#2ca02c", "#9467bd")


def _axes(ax: Any, size: tuple[float, float]) -> Any:
  if ax is not None:
    return ax
  try:
    from matplotlib.figure import Figure
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('mpx plots need matplotlib: pip install "mpx-mixed-precision[plots]"') from e
  return Figure(figsize=size, layout="constrained").add_subplot()


def _log2(scale: float) -> int:
  mantissa, exponent = np.frexp(float(scale))
  if mantissa != 0.5:
    raise errors.ConfigError(f"A plotted scale must be a power of two, got {scale!r}.")
  return int(exponent) - 1


def plot_magnitude_histogram(
  hist: MagnitudeHistogram,
  dtype: Any = "float16",
  *,
  scale: float = 1.0,
  report: RangeReport | None = None,
  ax: Any = None,
  title: str | None = None,
) -> Any:
  """Draws a log2 magnitude histogram against a format's ranges (paper Figure 3).

  Bars give the percentage of the nonzero values in each power-of-two bucket
  of ``|x| * scale``; the shaded bands are where the format flushes to zero,
  is subnormal, normal, and overflows (drawn at bucket edges: within the
  buckets on a border, :func:`mpx.diagnostics.range_report` has the exact split). With a
  scale other than 1 the unscaled histogram is outlined and an arrow marks
  the shift.

  Args:
    hist: a :class:`mpx.diagnostics.MagnitudeHistogram` of the unscaled values.
    dtype: the target format, as for :func:`mpx.diagnostics.range_report`.
    scale: the power-of-two scale the values are multiplied by.
    report: ``mpx.diagnostics.range_report(values, dtype, scale=scale)``, if at hand:
      the legend then gives each region's exact fraction.
    ax: matplotlib axes to draw into; a new figure if ``None``.
    title: the axes title.

  Returns:
    The matplotlib axes.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> grads = jnp.array([2.0**-30, 2.0**-20, 2.0**-12, 2.0**-3])
    >>> ax = mpx.diagnostics.plot_magnitude_histogram(mpx.diagnostics.magnitude_histogram(grads), "f16", scale=2.0**12)
    >>> [t.get_text() for t in ax.get_legend().get_texts()][:2]
    ['float16 flushed to zero', 'float16 subnormal']
    >>> ax.figure.savefig("/dev/null", format="png")
  """
  fmt = float_bits.get_format(dtype)
  shift = _log2(scale)
  counts = np.asarray(hist.counts, np.float64)
  nonzero = counts.sum() + float(hist.infs) + float(hist.nans)
  percent = 100.0 * counts / max(nonzero, 1.0)
  ax = _axes(ax, (8.0, 4.5))
  flush_top, normal_low, normal_high = (
    fmt.flush_exponent + 1,
    fmt.min_exponent,
    fmt.max_exponent + 1,
  )
  used = EXPONENTS[np.nonzero(counts)[0]]
  low = min(int(used.min()) if used.size else 0, flush_top) - 4
  high = max(int(used.max()) + 1 + max(shift, 0) if used.size else 0, normal_high) + 4
  low = min(low, low + shift)
  fractions = [None] * 4 if report is None else [
    float(report.flushed), float(report.subnormal), float(report.normal), float(report.overflow)
  ]  # fmt: skip
  names = ("flushed to zero", "subnormal", "normal", "overflow")
  spans = (
    (low, flush_top),
    (flush_top, normal_low),
    (normal_low, normal_high),
    (normal_high, high),
  )
  for (a, b), name, colour, frac in zip(spans, names, _COLOURS, fractions, strict=True):
    label = f"{fmt.name} {name}" + ("" if frac is None else f": {frac:.2%} of values")
    ax.axvspan(a, b, color=colour, alpha=0.15, lw=0, label=label)
  ax.bar(EXPONENTS + shift, percent, width=1.0, align="edge", color="#1f77b4", label="values")
  if shift:
    ax.stairs(
      percent, np.append(EXPONENTS, EXPONENTS[-1] + 1), color="0.35", ls="--", label="unscaled"
    )
    peak = int(EXPONENTS[np.argmax(counts)]) + 0.5
    y = float(percent.max()) * 1.04
    ax.annotate(
      "",
      xy=(peak + shift, y),
      xytext=(peak, y),
      arrowprops={"arrowstyle": "->", "color": "0.2", "lw": 1.5},
    )
    ax.text(peak + shift / 2, y, f"x 2^{shift}", ha="center", va="bottom")
    ax.set_ylim(0, float(percent.max()) * 1.15)
  hidden = f"{int(hist.zeros)} zeros and {int(hist.infs) + int(hist.nans)} inf/NaN not drawn"
  ax.set_xlim(low, high)
  ax.set_xlabel(f"log2 |value x scale|   ({hidden})")
  ax.set_ylabel("% of nonzero values")
  ax.set_title(title or f"Magnitudes against {fmt.name} at scale 2^{shift}")
  ax.legend(loc="best", fontsize="small")
  return ax


def plot_loss_scale(
  scales: Sequence[float] | np.ndarray,
  skipped: Sequence[bool] | np.ndarray | None = None,
  *,
  ax: Any = None,
  title: str | None = None,
) -> Any:
  """Draws the loss scale step by step, with the skipped steps marked.

  Args:
    scales: the loss scale used at each step (log it from
      :func:`mpx.loss_scale_metrics` *before* each update).
    skipped: whether each step was skipped (``last_step_skipped`` after the
      update); ``None`` draws no markers.
    ax: matplotlib axes to draw into; a new figure if ``None``.
    title: the axes title.

  Returns:
    The matplotlib axes.

  Example:
    >>> import mpx
    >>> ax = mpx.diagnostics.plot_loss_scale([2.0**16, 2.0**15, 2.0**15], [True, False, False])
    >>> ax.get_ylabel(), ax.get_legend().get_texts()[1].get_text()
    ('loss scale', 'skipped step (1 of 3)')
  """
  scales = np.asarray(scales, np.float64)
  steps = np.arange(scales.size)
  ax = _axes(ax, (8.0, 3.5))
  ax.step(steps, scales, where="post", color="#1f77b4", label="loss scale")
  if skipped is not None:
    bad = np.asarray(skipped, bool)
    ax.scatter(
      steps[bad], scales[bad], marker="x", color=_COLOURS[0], zorder=3,
      label=f"skipped step ({int(bad.sum())} of {bad.size})",
    )  # fmt: skip
  ax.set_yscale("log", base=2)
  ax.set_xlabel("step")
  ax.set_ylabel("loss scale")
  ax.set_title(title or "Dynamic loss scale")
  ax.legend(loc="best", fontsize="small")
  return ax


def plot_flushed_heatmap(
  reports: Mapping[str, RangeReport],
  scales: Sequence[float] | np.ndarray,
  *,
  mark_scale: float | None = None,
  mark_label: str = "current scale",
  ax: Any = None,
  title: str | None = None,
) -> Any:
  """Draws, per module and per scale, the fraction of values flushed to zero.

  Rows are modules (in the order of ``reports``), columns the scales; cells
  where anything overflows are hatched. Collect the reports with
  ``stat=functools.partial(mpx.diagnostics.range_report, dtype=..., scale=scales)``
  (see :func:`mpx.linen.collect_activations`).

  Args:
    reports: module key -> :class:`mpx.diagnostics.RangeReport` with one entry per scale,
      e.g. ``stats.output_grads``.
    scales: the powers of two the reports were computed at.
    mark_scale: a scale to outline (the current loss scale), if any.
    mark_label: what the outlined scale is, for the axis label.
    ax: matplotlib axes to draw into; a new figure if ``None``.
    title: the axes title.

  Returns:
    The matplotlib axes.

  Example:
    >>> import jax.numpy as jnp, numpy as np, mpx
    >>> scales = 2.0 ** np.arange(0, 20, 4)
    >>> grads = {"dense_0": jnp.array([2.0**-30, 1e-3]), "head": jnp.array([1e-3, 10.0])}
    >>> reports = {k: mpx.diagnostics.range_report(g, jnp.float16, scale=scales) for k, g in grads.items()}
    >>> ax = mpx.diagnostics.plot_flushed_heatmap(reports, scales, mark_scale=2.0**8)
    >>> ax.images[0].get_array().tolist()[0]  # dense_0: 2**-30 needs a scale of 2**6
    [0.5, 0.5, 0.0, 0.0, 0.0]
  """
  names = list(reports)
  shifts = [_log2(s) for s in np.asarray(scales, np.float64)]
  flushed = np.array([np.asarray(reports[n].flushed, np.float64) for n in names])
  overflow = np.array([np.asarray(reports[n].overflow, np.float64) for n in names])
  ax = _axes(ax, (max(6.0, 0.35 * len(shifts) + 3), max(2.5, 0.4 * len(names) + 1.5)))
  image = ax.imshow(flushed, aspect="auto", cmap="magma_r", vmin=0.0, vmax=1.0)
  rows, cols = np.nonzero(overflow > 0)
  for r, c in zip(rows, cols, strict=True):
    ax.add_patch(_rectangle((c - 0.5, r - 0.5), hatch="xx", fill=False, ec=_COLOURS[3], lw=0))
  if mark_scale is not None and _log2(mark_scale) in shifts:
    c = shifts.index(_log2(mark_scale))
    ax.add_patch(_rectangle((c - 0.5, -0.5), height=len(names), fill=False, ec="#1f77b4", lw=2))
  ax.set_xticks(range(len(shifts)), [f"2^{s}" for s in shifts], rotation=90, fontsize="small")
  ax.set_yticks(range(len(names)), names, fontsize="small")
  marked = f"; outlined: {mark_label}" if mark_scale is not None else ""
  ax.set_xlabel(f"loss scale (hatched: some values overflow{marked})")
  ax.set_ylabel("module")
  ax.set_title(title or "Fraction of values flushed to zero")
  ax.figure.colorbar(image, ax=ax, label="flushed fraction")
  return ax


def _rectangle(xy: tuple[float, float], *, height: float = 1.0, **kw: Any) -> Any:
  from matplotlib.patches import Rectangle

  return Rectangle(xy, 1.0, height, **kw)
