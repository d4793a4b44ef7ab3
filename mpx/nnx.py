"""Flax NNX integration: set an NNX model's layers to a precision policy, in place.

:func:`apply_policy` writes the policy into every layer of the graph and casts
its params (see its docstring for what each layer receives);
:class:`mpx.KeepRules` gives chosen layers a policy of their own, and
:data:`DEFAULT_KEEP_CLASSES` lists the normalisation layers kept in float32 by
default; :func:`plan` decides which layers to run in which float8 recipe from the
step compiled for a GPU.
"""

from mpx._src.adapters.nnx import DEFAULT_KEEP_CLASSES as DEFAULT_KEEP_CLASSES
from mpx._src.adapters.nnx import apply_policy as apply_policy
from mpx._src.adapters.nnx_fp8 import Fp8ConvGeneralDilated as Fp8ConvGeneralDilated
from mpx._src.adapters.nnx_fp8 import Fp8DotGeneral as Fp8DotGeneral
from mpx._src.adapters.nnx_fp8 import Fp8Einsum as Fp8Einsum
from mpx._src.adapters.nnx_fp8 import Fp8History as Fp8History
from mpx._src.diagnostics.nnx_taps import collect_activations as collect_activations
from mpx._src.diagnostics.nnx_taps import locate_nonfinite as locate_nonfinite
from mpx._src.planner.nnx import plan as plan

__all__ = (
  "DEFAULT_KEEP_CLASSES",
  "Fp8ConvGeneralDilated",
  "Fp8DotGeneral",
  "Fp8Einsum",
  "Fp8History",
  "apply_policy",
  "collect_activations",
  "locate_nonfinite",
  "plan",
)
