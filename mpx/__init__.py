"""mpx: mixed-precision training for JAX, Flax and optax.

Implements the three techniques of Micikevicius et al., *Mixed Precision
Training* (ICLR 2018): float32 master weights, loss scaling, and
half-precision arithmetic accumulated in float32.
"""

from mpx._src.casting import cast_tree as cast_tree
from mpx._src.errors import ConfigError as ConfigError
from mpx._src.errors import LeafTypeError as LeafTypeError
from mpx._src.errors import LossScaleDivergedError as LossScaleDivergedError
from mpx._src.errors import MpxError as MpxError
from mpx._src.errors import PolicyError as PolicyError
from mpx._src.errors import PrecisionWarning as PrecisionWarning
from mpx._src.errors import StateError as StateError
from mpx._src.errors import TreeStructureError as TreeStructureError
from mpx._src.policy import Policy as Policy
from mpx._src.policy import get_policy as get_policy

__version__ = "0.1.0"

__all__ = (
    "ConfigError",
    "LeafTypeError",
    "LossScaleDivergedError",
    "MpxError",
    "Policy",
    "PolicyError",
    "PrecisionWarning",
    "StateError",
    "TreeStructureError",
    "cast_tree",
    "get_policy",
)
