"""Precision diagnostics: where a tree of values sits against a format's range.

:func:`magnitude_histogram` bins the magnitudes of a tree by power of two (the
picture of Figure 3 of Micikevicius et al., which explains loss scaling);
:func:`range_report` says which fraction of them a scale makes overflow, stay
normal, become subnormal or flush to zero, and :func:`recommend_scale` picks a
static scale from it. :class:`ActivationStats` and :class:`NonfiniteReport` are
what the Flax taps return (``mpx.linen.collect_activations`` /
``locate_nonfinite``, and the same in ``mpx.nnx``); the ``plot_*`` functions
draw them with matplotlib, imported on the first call, not by this module.
:func:`nonfinite_gradient_paths` names the gradient leaves that made the loss
scale skip a step, and :class:`AuditReport` (of :class:`MatmulOp` s) is what
``mpx.audit`` returns. Importing this module imports neither Flax nor
matplotlib.
"""

from mpx._src.audit.ops import MatmulOp as MatmulOp
from mpx._src.audit.report import AuditReport as AuditReport
from mpx._src.diagnostics.activations import ActivationStats as ActivationStats
from mpx._src.diagnostics.histogram import MagnitudeHistogram as MagnitudeHistogram
from mpx._src.diagnostics.histogram import magnitude_histogram as magnitude_histogram
from mpx._src.diagnostics.locate import NonfiniteReport as NonfiniteReport
from mpx._src.diagnostics.plots import plot_flushed_heatmap as plot_flushed_heatmap
from mpx._src.diagnostics.plots import plot_loss_scale as plot_loss_scale
from mpx._src.diagnostics.plots import plot_magnitude_histogram as plot_magnitude_histogram
from mpx._src.diagnostics.range_report import RangeReport as RangeReport
from mpx._src.diagnostics.range_report import ScaleRecommendation as ScaleRecommendation
from mpx._src.diagnostics.range_report import range_report as range_report
from mpx._src.diagnostics.range_report import recommend_scale as recommend_scale
from mpx._src.scaling.train_step import nonfinite_gradient_paths as nonfinite_gradient_paths

__all__ = (
  "ActivationStats",
  "AuditReport",
  "MagnitudeHistogram",
  "MatmulOp",
  "NonfiniteReport",
  "RangeReport",
  "ScaleRecommendation",
  "magnitude_histogram",
  "nonfinite_gradient_paths",
  "plot_flushed_heatmap",
  "plot_loss_scale",
  "plot_magnitude_histogram",
  "range_report",
  "recommend_scale",
)
