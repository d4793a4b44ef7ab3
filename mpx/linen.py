"""Flax linen integration: run an unmodified linen model under a precision policy."""

from mpx._src.keep import DEFAULT_KEEP_CLASSES as DEFAULT_KEEP_CLASSES
from mpx._src.keep import KeepRules as KeepRules
from mpx._src.kernels import dot_product_attention as dot_product_attention
from mpx._src.kernels import softmax as softmax
from mpx._src.linen import PolicyModel as PolicyModel
from mpx._src.linen import apply_policy as apply_policy

__all__ = (
  "DEFAULT_KEEP_CLASSES",
  "KeepRules",
  "PolicyModel",
  "apply_policy",
  "dot_product_attention",
  "softmax",
)
