"""A small GPT-style Flax linen model and its float16-compute adamw train step.

The default config (4 layers, d_model 256, vocabulary 512, context 128) has
3,454,464 float32 parameters in 69 leaves: the model the loss-scaling cost
figures of docs/benchmarks.md are quoted on. ``GPTConfig.tiny()`` gives the same
69-leaf structure at a size the smoke test compiles in seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of the benchmark model and of one training batch."""

  vocab_size: int = 512
  max_len: int = 128
  num_layers: int = 4
  d_model: int = 256
  num_heads: int = 4
  mlp_ratio: int = 4
  batch_size: int = 8

  @classmethod
  def tiny(cls) -> GPTConfig:
    """Same leaf structure (69 leaves), a few thousand parameters."""
    return cls(vocab_size=32, max_len=8, d_model=16, num_heads=2, batch_size=2)


class Block(nn.Module):
  """Pre-norm transformer block; matmuls in float16, layer norms in float32."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.float16)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads, dtype=jnp.float16, param_dtype=jnp.float32
    )(h, h, mask=mask)
    x = x + h.astype(jnp.float32)
    h = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.float16)
    h = nn.Dense(cfg.mlp_ratio * cfg.d_model, dtype=jnp.float16)(h)
    h = nn.gelu(h)
    h = nn.Dense(cfg.d_model, dtype=jnp.float16)(h)
    return x + h.astype(jnp.float32)


class GPT(nn.Module):
  """Decoder-only language model with learned positions and an untied head."""

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.float16)(tokens)
    pos = self.param(
      "pos_embedding", nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model), jnp.float32
    )
    x = x.astype(jnp.float32) + pos[None, : tokens.shape[1]]
    for _ in range(cfg.num_layers):
      x = Block(cfg)(x)
    x = nn.LayerNorm(dtype=jnp.float32)(x).astype(jnp.float16)
    logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float16)(x)
    return logits.astype(jnp.float32)


def make_batch(config: GPTConfig, seed: int = 0) -> dict[str, jax.Array]:
  """A deterministic batch of token ids and next-token targets."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (config.batch_size, config.max_len + 1))
  return {"x": jnp.asarray(tokens[:, :-1], jnp.int32), "y": jnp.asarray(tokens[:, 1:], jnp.int32)}


def init_params(config: GPTConfig, seed: int = 0) -> PyTree:
  """Float32 parameters of ``GPT(config)``."""
  batch = make_batch(config)
  return GPT(config).init(jax.random.key(seed), batch["x"])["params"]


def make_loss_fn(config: GPTConfig) -> Callable[[PyTree, dict[str, jax.Array]], jax.Array]:
  """Mean next-token cross entropy, computed in float32."""
  model = GPT(config)

  def loss_fn(params: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
    logits = cast(jax.Array, model.apply({"params": params}, batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4


def make_optimizer() -> optax.GradientTransformation:
  """The inner optimizer every candidate wraps."""
  return optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
