"""Flax linen integration: run an unmodified linen model under a precision policy.

:func:`apply_policy` wraps a model so that its ``init``, ``apply`` and
``tabulate`` run every layer under the policy (see its docstring for what each
layer receives); :class:`mpx.KeepRules` gives chosen layers a policy of their
own, and :data:`DEFAULT_KEEP_CLASSES` lists the normalisation layers kept in
float32 by default. :func:`plan` decides which layers to run in which float8
recipe from the step compiled for a GPU. Importing this module imports
``flax.linen``, never ``flax.nnx``.
"""

from mpx._src.adapters.linen import DEFAULT_KEEP_CLASSES as DEFAULT_KEEP_CLASSES
from mpx._src.adapters.linen import PolicyModel as PolicyModel
from mpx._src.adapters.linen import apply_policy as apply_policy
from mpx._src.adapters.linen_fp8 import FP8_COLLECTION as FP8_COLLECTION
from mpx._src.adapters.linen_fp8 import Fp8ConvGeneralDilated as Fp8ConvGeneralDilated
from mpx._src.adapters.linen_fp8 import Fp8DotGeneral as Fp8DotGeneral
from mpx._src.diagnostics.linen_taps import collect_activations as collect_activations
from mpx._src.diagnostics.linen_taps import locate_nonfinite as locate_nonfinite
from mpx._src.planner.linen import plan as plan

__all__ = (
  "DEFAULT_KEEP_CLASSES",
  "FP8_COLLECTION",
  "Fp8ConvGeneralDilated",
  "Fp8DotGeneral",
  "PolicyModel",
  "apply_policy",
  "collect_activations",
  "locate_nonfinite",
  "plan",
)
