"""``python -m mpx.demo``: the paper's loss-scaling result, reproduced in one command.

Trains a small character-level transformer (Flax linen, written without any
dtype) on ``pydoc_data.topics`` under six configurations that share data,
seed and schedule: ``float32``, ``mixed_bfloat16``, ``mixed_float16`` with
dynamic loss scaling, float16 params with float32 masters and dynamic loss
scaling (layout (b)), the same without loss scaling, and float16 with neither
masters nor loss scaling. Each step differentiates one device's share of a
data-parallel loss, ``sum(token losses) / global_batch_tokens``, so per-token
gradients are as small as in large-batch training; float16 without loss
scaling then loses most activation gradients to underflow, as in section 3.2
and figure 3 of Micikevicius et al., *Mixed Precision Training* (ICLR 2018).

Needs the ``demo`` extra for its progress bars and plots
(``pip install 'mpx-mixed-precision[demo]'``); without it the demo prints
plain progress lines and skips the PNGs. See ``docs/demo.md``.
"""

from mpx.demo._cli import main as main
from mpx.demo._configs import CONFIGS as CONFIGS
from mpx.demo._configs import RunConfig as RunConfig
from mpx.demo._float16 import flushed_fraction as flushed_fraction
from mpx.demo._float16 import log2_histogram as log2_histogram
from mpx.demo._float16 import overflow_fraction as overflow_fraction

__all__ = (
  "CONFIGS",
  "RunConfig",
  "flushed_fraction",
  "log2_histogram",
  "main",
  "overflow_fraction",
)
