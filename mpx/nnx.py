"""Flax NNX integration: set an NNX model's layers to a precision policy."""

from mpx._src.keep import DEFAULT_KEEP_CLASSES as DEFAULT_KEEP_CLASSES
from mpx._src.keep import KeepRules as KeepRules
from mpx._src.kernels import dot_product_attention as dot_product_attention
from mpx._src.kernels import softmax as softmax
from mpx._src.nnx import apply_policy as apply_policy

__all__ = (
  "DEFAULT_KEEP_CLASSES",
  "KeepRules",
  "apply_policy",
  "dot_product_attention",
  "softmax",
)
