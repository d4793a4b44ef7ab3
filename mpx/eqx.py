"""Equinox integration: an Equinox model under a precision policy, and its float8 state.

:func:`apply_policy` returns the model with its layers wrapped in
:class:`PolicyLayer` (see its docstring for what each layer receives);
:class:`mpx.KeepRules` gives chosen layers a policy of their own, and
:data:`DEFAULT_KEEP_CLASSES` lists the normalisation layers kept in float32 by
default. The train step is mpx's own: :func:`mpx.value_and_grad` differentiates
an Equinox model's inexact arrays (as ``eqx.filter_value_and_grad`` does) and
:func:`mpx.mixed_precision` takes ``eqx.filter(model, eqx.is_inexact_array)``;
:func:`select_state` keeps an ``eqx.nn.State`` across a skipped step. Under
delayed float8 scaling, :class:`Fp8History`, :func:`partition_fp8` and
:func:`update_fp8_state` carry the amax histories. :func:`collect_activations`
and :func:`locate_nonfinite` are the precision diagnostics. Importing this
module imports Equinox, never Flax; ``import mpx`` imports neither.
"""

from mpx._src.adapters.eqx import DEFAULT_KEEP_CLASSES as DEFAULT_KEEP_CLASSES
from mpx._src.adapters.eqx import PolicyLayer as PolicyLayer
from mpx._src.adapters.eqx import apply_policy as apply_policy
from mpx._src.adapters.eqx import select_state as select_state
from mpx._src.adapters.eqx_fp8 import Fp8History as Fp8History
from mpx._src.adapters.eqx_fp8 import partition_fp8 as partition_fp8
from mpx._src.adapters.eqx_fp8 import update_fp8_state as update_fp8_state
from mpx._src.diagnostics.eqx_taps import collect_activations as collect_activations
from mpx._src.diagnostics.eqx_taps import locate_nonfinite as locate_nonfinite

__all__ = (
  "DEFAULT_KEEP_CLASSES",
  "Fp8History",
  "PolicyLayer",
  "apply_policy",
  "collect_activations",
  "locate_nonfinite",
  "partition_fp8",
  "select_state",
  "update_fp8_state",
)
