"""mpx: mixed-precision training for JAX, Flax and optax.

Implements the three techniques of Micikevicius et al., *Mixed Precision
Training* (ICLR 2018): float32 master weights, loss scaling, and
half-precision arithmetic accumulated in float32.

The Flax integrations are the submodules :mod:`mpx.linen` and :mod:`mpx.nnx`,
imported on first use: ``import mpx`` does not import Flax. The precision
diagnostics (histograms, range reports, plots) are :mod:`mpx.diagnostics` and
the float8 building blocks :mod:`mpx.fp8`, the sharded-training helpers
:mod:`mpx.parallel` and the half-precision losses :mod:`mpx.losses`, also
imported on first use.
"""

import importlib as _importlib
import typing as _typing
import warnings as _warnings

from mpx._src.adapters.keep import KeepRules as KeepRules
from mpx._src.audit.report import audit as audit
from mpx._src.casting import cast_tree as cast_tree
from mpx._src.errors import ConfigError as ConfigError
from mpx._src.errors import LeafTypeError as LeafTypeError
from mpx._src.errors import LossScaleDivergedError as LossScaleDivergedError
from mpx._src.errors import MpxError as MpxError
from mpx._src.errors import PolicyError as PolicyError
from mpx._src.errors import PrecisionWarning as PrecisionWarning
from mpx._src.errors import StateError as StateError
from mpx._src.errors import TreeStructureError as TreeStructureError
from mpx._src.ops.attention import dot_product_attention as dot_product_attention
from mpx._src.ops.kernels import accumulate_in_float32 as accumulate_in_float32
from mpx._src.ops.kernels import softmax as softmax
from mpx._src.optim.kahan import KahanState as KahanState
from mpx._src.optim.kahan import with_kahan_summation as with_kahan_summation
from mpx._src.optim.low_bit import QuantizedMoment as QuantizedMoment
from mpx._src.optim.masters import MasterParamsState as MasterParamsState
from mpx._src.optim.masters import apply_updates as apply_updates
from mpx._src.optim.masters import with_master_params as with_master_params
from mpx._src.optim.mixed_precision import check_state as check_state
from mpx._src.optim.mixed_precision import get_master_params as get_master_params
from mpx._src.optim.mixed_precision import mixed_precision as mixed_precision
from mpx._src.optim.remainder import RemainderMastersState as RemainderMastersState
from mpx._src.optim.state_dtype import with_state_dtype as with_state_dtype
from mpx._src.optim.stochastic_rounding import StochasticRoundingState as StochasticRoundingState
from mpx._src.optim.stochastic_rounding import with_stochastic_rounding as with_stochastic_rounding
from mpx._src.policy import Policy as Policy
from mpx._src.policy import get_policy as get_policy
from mpx._src.recipe import Fp8Recipe as Fp8Recipe
from mpx._src.scaling.finite_check import all_finite as all_finite
from mpx._src.scaling.state import LossScaleState as LossScaleState
from mpx._src.scaling.state import get_loss_scale as get_loss_scale
from mpx._src.scaling.train_step import check_loss_scale as check_loss_scale
from mpx._src.scaling.train_step import loss_scale_metrics as loss_scale_metrics
from mpx._src.scaling.train_step import scale as scale
from mpx._src.scaling.train_step import unscale as unscale
from mpx._src.scaling.train_step import value_and_grad as value_and_grad
from mpx._src.scaling.transform import dynamic_loss_scale as dynamic_loss_scale
from mpx._src.scaling.transform import no_loss_scale as no_loss_scale
from mpx._src.scaling.transform import static_loss_scale as static_loss_scale

if _typing.TYPE_CHECKING:
  from mpx import diagnostics as diagnostics
  from mpx import fp8 as fp8
  from mpx import linen as linen
  from mpx import losses as losses
  from mpx import nnx as nnx
  from mpx import parallel as parallel

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("diagnostics", "fp8", "linen", "losses", "nnx", "parallel")

# Names that moved to a namespace after 0.1.0: old top-level name -> namespace. They
# still resolve, with a DeprecationWarning, for one release.
_MOVED = {
  **dict.fromkeys(
    (
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
    ),
    "diagnostics",
  ),
  **dict.fromkeys(
    (
      "accumulation_boundary",
      "fp8_dot_general",
      "fp8_max_grad",
      "quantize_dequantize",
      "update_fp8_state",
    ),
    "fp8",
  ),
  **dict.fromkeys(("all_gather_params", "all_reduce_gradients", "state_shardings"), "parallel"),
}

__all__ = (
  "ConfigError",
  "Fp8Recipe",
  "KahanState",
  "KeepRules",
  "LeafTypeError",
  "LossScaleDivergedError",
  "LossScaleState",
  "MasterParamsState",
  "MpxError",
  "Policy",
  "PolicyError",
  "PrecisionWarning",
  "QuantizedMoment",
  "RemainderMastersState",
  "StateError",
  "StochasticRoundingState",
  "TreeStructureError",
  "accumulate_in_float32",
  "all_finite",
  "apply_updates",
  "audit",
  "cast_tree",
  "check_loss_scale",
  "check_state",
  "diagnostics",
  "dot_product_attention",
  "dynamic_loss_scale",
  "fp8",
  "get_loss_scale",
  "get_master_params",
  "get_policy",
  "linen",
  "loss_scale_metrics",
  "losses",
  "mixed_precision",
  "nnx",
  "no_loss_scale",
  "parallel",
  "scale",
  "softmax",
  "static_loss_scale",
  "unscale",
  "value_and_grad",
  "with_kahan_summation",
  "with_master_params",
  "with_state_dtype",
  "with_stochastic_rounding",
)


def __getattr__(name: str) -> _typing.Any:
  # PEP 562: the submodules load on first access, so pure JAX and optax users
  # of mpx never import Flax.
  if name in _LAZY_SUBMODULES:
    return _importlib.import_module(f"mpx.{name}")
  if name in _MOVED:
    namespace = _MOVED[name]
    _warnings.warn(
      f"mpx.{name} moved to mpx.{namespace}.{name}; the top-level name is deprecated "
      "and will be removed in the next release.",
      DeprecationWarning,
      stacklevel=2,
    )
    return getattr(_importlib.import_module(f"mpx.{namespace}"), name)
  raise AttributeError(f"module 'mpx' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY_SUBMODULES})
