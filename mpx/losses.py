"""Losses for half-precision logits: float32 arithmetic without float32 logits in memory.

:func:`softmax_cross_entropy_with_integer_labels` is optax's loss of the same
name for float16 or bfloat16 logits: the log-sum-exp accumulates in float32
inside the reductions, and the backward pass writes the logit gradients in the
logits' dtype. A model whose policy keeps its logits in half precision (e.g.
``"params=float32,compute=bfloat16,output=bfloat16"``) then never holds its
``[tokens, vocab]`` logits in float32.
:func:`head_softmax_cross_entropy_with_integer_labels` goes further for large
vocabularies: it takes the head's input and kernel, fuses the head's matmul
into the loss chunk by chunk of the vocabulary, and never holds the
``[tokens, vocab]`` logits at all. Importing this module does not import Flax.
"""

from mpx._src.ops.chunked_losses import (
  head_softmax_cross_entropy_with_integer_labels as head_softmax_cross_entropy_with_integer_labels,
)
from mpx._src.ops.losses import (
  softmax_cross_entropy_with_integer_labels as softmax_cross_entropy_with_integer_labels,
)

__all__ = (
  "head_softmax_cross_entropy_with_integer_labels",
  "softmax_cross_entropy_with_integer_labels",
)
