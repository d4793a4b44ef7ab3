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

The scenario's pieces are public too, for scripts that measure something on
it (``benchmarks/half_all_reduce.py``, ``benchmarks/recommended_scale.py``):
the settings of the default and ``--quick`` runs, the corpus and its batches,
the model, a configuration's optimizer, one training run, and the activation
gradients of a float32 model.
"""

from mpx.demo._cli import main as main
from mpx.demo._configs import CONFIGS as CONFIGS
from mpx.demo._configs import RunConfig as RunConfig
from mpx.demo._data import load_corpus as load_corpus
from mpx.demo._float16 import flushed_fraction as flushed_fraction
from mpx.demo._float16 import log2_histogram as log2_histogram
from mpx.demo._float16 import overflow_fraction as overflow_fraction
from mpx.demo._model import CharTransformer as CharTransformer
from mpx.demo._settings import DEFAULT_SETTINGS as DEFAULT_SETTINGS
from mpx.demo._settings import QUICK_SETTINGS as QUICK_SETTINGS
from mpx.demo._settings import Settings as Settings
from mpx.demo._settings import make_data as make_data
from mpx.demo._train import activation_gradients as activation_gradients
from mpx.demo._train import make_optimizer as make_optimizer
from mpx.demo._train import train as train

__all__ = (
  "CONFIGS",
  "DEFAULT_SETTINGS",
  "QUICK_SETTINGS",
  "CharTransformer",
  "RunConfig",
  "Settings",
  "activation_gradients",
  "flushed_fraction",
  "load_corpus",
  "log2_histogram",
  "main",
  "make_data",
  "make_optimizer",
  "overflow_fraction",
  "train",
)
