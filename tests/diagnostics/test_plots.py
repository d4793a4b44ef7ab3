"""Plots: what they draw, read back from the axes."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.colors import to_rgba

import mpx
from mpx._src.diagnostics import plots

FLUSHED, SUBNORMAL, NORMAL, OVERFLOW = plots._COLOURS


def spans(ax):
  """(x0, x1, colour) of the shaded regions, left to right."""
  out = []
  for patch in ax.patches:
    if patch.get_alpha() == 0.15:
      x0, x1 = patch.get_x(), patch.get_x() + patch.get_width()
      out.append((x0, x1, patch.get_facecolor()[:3]))
  return sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize(
  ("shift", "dtype"), [(0, "float16"), (10, "float16"), (3, "float8_e4m3fn")]
)
def test_histogram_regions_and_bars_sit_where_the_format_puts_them(shift, dtype):
  x = jnp.array([2.0**-20, 2.0**-20, 1.5, 0.0], jnp.float32)
  hist = mpx.diagnostics.magnitude_histogram(x)
  report = mpx.diagnostics.range_report(x, dtype, scale=2.0**shift)
  ax = plots.plot_magnitude_histogram(hist, dtype, scale=2.0**shift, report=report)
  fmt = plots.float_bits.get_format(dtype)
  borders = [fmt.flush_exponent + 1, fmt.min_exponent, fmt.max_exponent + 1]
  regions = spans(ax)
  assert [r[2] for r in regions] == [to_rgba(c)[:3] for c in (FLUSHED, SUBNORMAL, NORMAL, OVERFLOW)]
  assert [r[1] for r in regions[:3]] == borders  # fixed: the values move, not the format
  bars = {round(p.get_x()): p.get_height() for p in ax.containers[0] if p.get_height() > 0}
  assert bars == pytest.approx({-20 + shift: 200 / 3, 0 + shift: 100 / 3})
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert any(f"normal: {float(report.normal):.2%}" in label for label in labels)
  assert ("unscaled" in labels) == (shift != 0)
  assert ax.get_xlabel().startswith("log2 |value x scale|") and "1 zeros" in ax.get_xlabel()


def test_loss_scale_plot_marks_the_skipped_steps():
  scales = [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15]
  skipped = [True, False, False, True, False]
  ax = plots.plot_loss_scale(scales, skipped)
  (points,) = ax.collections
  np.testing.assert_array_equal(points.get_offsets(), [[0, 2.0**16], [3, 2.0**16]])
  assert ax.get_yscale() == "log" and ax.get_ylabel() == "loss scale"
  assert "skipped step (2 of 5)" in [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.slow
def test_heatmap_shows_flushed_fractions_hatches_overflow_and_marks_the_scale():
  scales = 2.0 ** np.arange(0, 20, 4)
  values = {"small": jnp.array([2.0**-30, 2.0**-10]), "big": jnp.array([2.0**-3, 1.0e3])}
  reports = {
    k: mpx.diagnostics.range_report(v, jnp.float16, scale=scales) for k, v in values.items()
  }
  ax = plots.plot_flushed_heatmap(reports, scales, mark_scale=2.0**8)
  np.testing.assert_array_equal(
    ax.images[0].get_array(), [np.asarray(r.flushed) for r in reports.values()]
  )
  hatched = sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in ax.patches if p.get_hatch())
  overflow = np.argwhere(np.array([np.asarray(r.overflow) for r in reports.values()]) > 0)
  assert hatched == sorted((float(c), float(r)) for r, c in overflow) and hatched
  (outline,) = [p for p in ax.patches if not p.get_hatch()]
  assert outline.get_x() + 0.5 == 2  # the column of 2**8
  assert [t.get_text() for t in ax.get_yticklabels()] == ["small", "big"]


def test_scales_must_be_powers_of_two():
  hist = mpx.diagnostics.magnitude_histogram(jnp.ones(2))
  with pytest.raises(mpx.ConfigError, match="power of two"):
    plots.plot_magnitude_histogram(hist, scale=3.0)
  report = mpx.diagnostics.range_report(jnp.ones(2), jnp.float16, scale=np.array([1.0, 2.0]))
  with pytest.raises(mpx.ConfigError, match="power of two"):
    plots.plot_flushed_heatmap({"a": report}, [1.0, 3.0])


def test_a_missing_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  with pytest.raises(ImportError, match=r"mpx-mixed-precision\[plots\]"):
    plots.plot_loss_scale([1.0, 2.0])


def test_import_mpx_does_not_import_matplotlib():
  script = "import sys, mpx; print(any(m.startswith('matplotlib') for m in sys.modules))"
  result = subprocess.run(
    [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
