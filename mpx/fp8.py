"""Float8 matmuls: the float8 dot and convolution, and the delayed-scaling state.

Most users need none of these names: the ``"mixed_float8"`` and
``"mixed_float8_delayed"`` policies (recipes: :class:`mpx.Fp8Recipe`) make
``mpx.linen.apply_policy`` and ``mpx.nnx.apply_policy`` route the model's
dense and einsum contractions through :func:`fp8_dot_general` and its
convolutions through :func:`fp8_conv_general_dilated`. A train step
with delayed scaling calls :func:`update_fp8_state` between steps (with
:func:`accumulation_boundary` deciding when a history commits) and, where
one history is read by several calls, types it with :func:`fp8_max_grad`;
:func:`quantize_dequantize` is the rounding itself. :class:`Plan` is what
``mpx.linen.plan`` and ``mpx.nnx.plan`` return: which layers to run in which
recipe. Importing this module does not import Flax.
"""

from mpx._src.errors import PlanError as PlanError
from mpx._src.ops.amax_grad import fp8_max_grad as fp8_max_grad
from mpx._src.ops.fp8 import fp8_dot_general as fp8_dot_general
from mpx._src.ops.fp8_conv import fp8_conv_general_dilated as fp8_conv_general_dilated
from mpx._src.ops.quantize import quantize_dequantize as quantize_dequantize
from mpx._src.planner.plan import Plan as Plan
from mpx._src.planner.plan import PlanRow as PlanRow
from mpx._src.scaling.fp8_history import accumulation_boundary as accumulation_boundary
from mpx._src.scaling.fp8_history import update_fp8_state as update_fp8_state

__all__ = (
  "Plan",
  "PlanError",
  "PlanRow",
  "accumulation_boundary",
  "fp8_conv_general_dilated",
  "fp8_dot_general",
  "fp8_max_grad",
  "quantize_dequantize",
  "update_fp8_state",
)
