"""What every run of the demo shares: sizes, schedule, seed and the batches themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpx.demo import _data
from mpx.demo._model import ModelConfig


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a run depends on besides its configuration (shared by all runs).

  Attributes:
    model: the model's shape; ``max_len`` is also the training sequence length.
    batch_size: sequences per step (the local batch).
    steps: optimizer steps.
    learning_rate: adamw's peak learning rate (linear warmup over the first
      tenth of the run, cosine decay to a tenth of the peak).
    eval_every: steps between validation losses.
    eval_sequences: validation sequences, the same for every evaluation.
    global_batch_tokens: token count of the mirrored global batch that
      normalises the loss.
    seed: seeds the parameter initialisation and the batch sampling.
    fast_compile: compile with XLA's backend optimisations off (``--quick``):
      about half the compile time of a tiny model, slower steps.
  """

  model: ModelConfig
  batch_size: int
  steps: int
  learning_rate: float
  eval_every: int
  eval_sequences: int
  global_batch_tokens: int = 2**19
  seed: int = 0
  fast_compile: bool = False

  def jit(self, fun: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit`` with these settings' compiler options.

    Args:
      fun: the function to compile.

    Returns:
      The jitted function.
    """
    options = {"xla_backend_optimization_level": 0} if self.fast_compile else None
    return jax.jit(fun, compiler_options=options)

  @property
  def growth_interval(self) -> int:
    """Finite steps between loss-scale growths in the float16 runs: 15 growths per run.

    mpx's default rule grows every 2000 steps, so in a run this short the
    scale would hold still at its initial 2**15; growing often shows the rule
    at work: doubling until the gradients overflow, then halving and skipping
    that step.
    """
    return max(1, self.steps // 15)

  @property
  def local_tokens(self) -> int:
    """Tokens per step on this device."""
    return self.batch_size * self.model.max_len

  @property
  def mirrored_devices(self) -> int:
    """How many devices of this batch size make up the global batch."""
    return self.global_batch_tokens // self.local_tokens

  def check(self) -> None:
    """Raises ``ValueError`` unless the settings describe a valid data-parallel step.

    Returns:
      ``None`` when the global batch is a power-of-two multiple of the local one.
    """
    devices = self.global_batch_tokens / self.local_tokens
    if devices < 1 or devices != int(devices) or int(devices) & (int(devices) - 1):
      raise ValueError(
        f"The global batch ({self.global_batch_tokens} tokens) must be a power-of-two multiple "
        f"of the local batch ({self.batch_size} x {self.model.max_len} = {self.local_tokens} "
        "tokens), so that the mirrored devices are a whole number and the all-reduce stand-in "
        "is exact. Choose a batch size and sequence length whose product divides it."
      )
    if self.steps < 1:
      raise ValueError(f"steps must be at least 1, got {self.steps}.")


DEFAULT_SETTINGS = Settings(
  model=ModelConfig(vocab_size=_data.VOCAB_SIZE, max_len=64, num_layers=2, d_model=64, num_heads=4),
  batch_size=16,
  steps=300,
  learning_rate=6e-3,
  eval_every=20,
  eval_sequences=64,
)
"""The default run: 120,576 parameters, 1,024 tokens per step, 300 steps."""

QUICK_SETTINGS = Settings(
  model=ModelConfig(vocab_size=_data.VOCAB_SIZE, max_len=32, num_layers=1, d_model=32, num_heads=2),
  batch_size=8,
  steps=30,
  learning_rate=1e-2,
  eval_every=10,
  eval_sequences=16,
  # Four times the default's global batch: smaller per-token gradients, so that
  # float16 without loss scaling fails within these 30 steps too.
  global_batch_tokens=2**21,
  fast_compile=True,
)
"""``--quick``: the same table from a tiny model and a few steps (what CI runs)."""


@dataclasses.dataclass(frozen=True)
class Data:
  """The batches every run sees, drawn once.

  Attributes:
    train: int32 windows of shape ``(steps, batch_size, max_len + 1)``.
    valid: int32 validation windows, ``(eval_sequences, max_len + 1)``.
    probe: one validation batch of training size, ``(batch_size, max_len + 1)``,
      on which activation gradients are measured.
  """

  train: np.ndarray
  valid: np.ndarray
  probe: np.ndarray


def make_data(settings: Settings, corpus: _data.Corpus) -> Data:
  """Draws the training, validation and probe windows from ``corpus``.

  Args:
    settings: sizes and seed.
    corpus: the character ids.

  Returns:
    The :class:`Data` shared by all runs.
  """
  seq_len, batch = settings.model.max_len, settings.batch_size
  train = _data.sample_windows(
    corpus.train, count=settings.steps * batch, seq_len=seq_len, seed=settings.seed
  )
  valid = _data.sample_windows(
    corpus.valid, count=settings.eval_sequences + batch, seq_len=seq_len, seed=settings.seed + 1
  )
  return Data(
    train=train.reshape(settings.steps, batch, seq_len + 1),
    valid=valid[: settings.eval_sequences],
    probe=valid[settings.eval_sequences :],
  )
