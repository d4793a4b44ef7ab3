"""mpx: mixed-precision training for JAX, Flax and optax.

Implements the three techniques of Micikevicius et al., *Mixed Precision
Training* (ICLR 2018): float32 master weights, loss scaling, and
half-precision arithmetic accumulated in float32.

The Flax integrations are the submodules :mod:`mpx.linen` and :mod:`mpx.nnx`,
imported on first use: ``import mpx`` does not import Flax.
"""

import importlib as _importlib
import typing as _typing

from mpx._src.adapters.keep import KeepRules as KeepRules
from mpx._src.audit.ops import MatmulOp as MatmulOp
from mpx._src.audit.report import AuditReport as AuditReport
from mpx._src.audit.report import audit as audit
from mpx._src.casting import cast_tree as cast_tree
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
from mpx._src.errors import ConfigError as ConfigError
from mpx._src.errors import LeafTypeError as LeafTypeError
from mpx._src.errors import LossScaleDivergedError as LossScaleDivergedError
from mpx._src.errors import MpxError as MpxError
from mpx._src.errors import PolicyError as PolicyError
from mpx._src.errors import PrecisionWarning as PrecisionWarning
from mpx._src.errors import StateError as StateError
from mpx._src.errors import TreeStructureError as TreeStructureError
from mpx._src.ops.amax_grad import fp8_max_grad as fp8_max_grad
from mpx._src.ops.fp8 import fp8_dot_general as fp8_dot_general
from mpx._src.ops.fp8 import quantize_dequantize as quantize_dequantize
from mpx._src.ops.kernels import accumulate_in_float32 as accumulate_in_float32
from mpx._src.ops.kernels import dot_product_attention as dot_product_attention
from mpx._src.ops.kernels import softmax as softmax
from mpx._src.optim.kahan import KahanState as KahanState
from mpx._src.optim.kahan import with_kahan_summation as with_kahan_summation
from mpx._src.optim.masters import MasterParamsState as MasterParamsState
from mpx._src.optim.masters import apply_updates as apply_updates
from mpx._src.optim.masters import with_master_params as with_master_params
from mpx._src.optim.mixed_precision import check_state as check_state
from mpx._src.optim.mixed_precision import get_master_params as get_master_params
from mpx._src.optim.mixed_precision import mixed_precision as mixed_precision
from mpx._src.optim.state_dtype import with_state_dtype as with_state_dtype
from mpx._src.optim.stochastic_rounding import StochasticRoundingState as StochasticRoundingState
from mpx._src.optim.stochastic_rounding import with_stochastic_rounding as with_stochastic_rounding
from mpx._src.parallel import all_reduce_gradients as all_reduce_gradients
from mpx._src.policy import Policy as Policy
from mpx._src.policy import get_policy as get_policy
from mpx._src.recipe import Fp8Recipe as Fp8Recipe
from mpx._src.scaling.finite_check import all_finite as all_finite
from mpx._src.scaling.fp8_history import accumulation_boundary as accumulation_boundary
from mpx._src.scaling.fp8_history import update_fp8_state as update_fp8_state
from mpx._src.scaling.state import LossScaleState as LossScaleState
from mpx._src.scaling.state import get_loss_scale as get_loss_scale
from mpx._src.scaling.train_step import check_loss_scale as check_loss_scale
from mpx._src.scaling.train_step import loss_scale_metrics as loss_scale_metrics
from mpx._src.scaling.train_step import nonfinite_gradient_paths as nonfinite_gradient_paths
from mpx._src.scaling.train_step import scale as scale
from mpx._src.scaling.train_step import unscale as unscale
from mpx._src.scaling.train_step import value_and_grad as value_and_grad
from mpx._src.scaling.transform import dynamic_loss_scale as dynamic_loss_scale
from mpx._src.scaling.transform import no_loss_scale as no_loss_scale
from mpx._src.scaling.transform import static_loss_scale as static_loss_scale

if _typing.TYPE_CHECKING:
  from mpx import linen as linen
  from mpx import nnx as nnx

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("linen", "nnx")

__all__ = (
  "ActivationStats",
  "AuditReport",
  "ConfigError",
  "Fp8Recipe",
  "KahanState",
  "KeepRules",
  "LeafTypeError",
  "LossScaleDivergedError",
  "LossScaleState",
  "MagnitudeHistogram",
  "MasterParamsState",
  "MatmulOp",
  "MpxError",
  "NonfiniteReport",
  "Policy",
  "PolicyError",
  "PrecisionWarning",
  "RangeReport",
  "ScaleRecommendation",
  "StateError",
  "StochasticRoundingState",
  "TreeStructureError",
  "accumulate_in_float32",
  "accumulation_boundary",
  "all_finite",
  "all_reduce_gradients",
  "apply_updates",
  "audit",
  "cast_tree",
  "check_loss_scale",
  "check_state",
  "dot_product_attention",
  "dynamic_loss_scale",
  "fp8_dot_general",
  "fp8_max_grad",
  "get_loss_scale",
  "get_master_params",
  "get_policy",
  "linen",
  "loss_scale_metrics",
  "magnitude_histogram",
  "mixed_precision",
  "nnx",
  "no_loss_scale",
  "nonfinite_gradient_paths",
  "plot_flushed_heatmap",
  "plot_loss_scale",
  "plot_magnitude_histogram",
  "quantize_dequantize",
  "range_report",
  "recommend_scale",
  "scale",
  "softmax",
  "static_loss_scale",
  "unscale",
  "update_fp8_state",
  "value_and_grad",
  "with_kahan_summation",
  "with_master_params",
  "with_state_dtype",
  "with_stochastic_rounding",
)


def __getattr__(name: str) -> _typing.Any:
  # PEP 562: the Flax submodules load on first access, so pure JAX and optax
  # users of mpx never import Flax.
  if name in _LAZY_SUBMODULES:
    return _importlib.import_module(f"mpx.{name}")
  raise AttributeError(f"module 'mpx' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY_SUBMODULES})
