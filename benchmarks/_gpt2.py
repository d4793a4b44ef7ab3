"""A GPT-2-small-style decoder, as an ordinary Flax linen model and as its NNX twin.

Written the way a Flax user writes GPT-2 (pre-norm blocks, ``LayerNorm``,
Flax's multi-head attention with a causal mask, a tanh-GELU MLP, learned
positions, the head tied to the token embedding) and with no precision
argument set: ``dtype`` is ``None`` unless a configuration passes one, which
is how the "bfloat16 by hand" configuration is written. The default config is
GPT-2 small (12 layers, d_model 768, 12 heads, context 1024, vocabulary
50,257: 124,439,808 params); :meth:`GPT2Config.smoke` keeps the architecture at
a size that compiles in seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Dtype = Any


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """Shape of the decoder and of one training batch."""

  vocab_size: int = 50_257
  max_len: int = 1024
  num_layers: int = 12
  d_model: int = 768
  num_heads: int = 12
  batch_size: int = 8

  @classmethod
  def smoke(cls) -> GPT2Config:
    """The same architecture at a size a CPU compiles in seconds."""
    return cls(vocab_size=128, max_len=64, num_layers=2, d_model=64, num_heads=4, batch_size=4)


# ---------------------------------------------------------------------------- linen


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

  config: GPT2Config
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)(x)
    h = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=self.dtype)(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)(x)
    h = nn.Dense(4 * cfg.d_model, dtype=self.dtype)(h)
    h = nn.gelu(h)
    return x + nn.Dense(cfg.d_model, dtype=self.dtype)(h)


class GPT2(nn.Module):
  """Decoder-only language model; logits from the token embedding (tied head)."""

  config: GPT2Config
  dtype: Dtype = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, name="wte")
    positions = nn.Embed(cfg.max_len, cfg.d_model, dtype=self.dtype, name="wpe")
    x = embed(tokens) + positions(jnp.arange(tokens.shape[1]))
    for _ in range(cfg.num_layers):
      x = Block(cfg, self.dtype)(x)
    x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
    return embed.attend(x)


# ------------------------------------------------------------------------------ NNX


class NnxBlock(nnx.Module):
  """The linen :class:`Block` in NNX."""

  def __init__(self, config: GPT2Config, *, dtype: Dtype = None, rngs: nnx.Rngs):
    d = config.d_model
    self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(config.num_heads, d, decode=False, dtype=dtype, rngs=rngs)
    self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
    self.fc = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + self.attn(self.ln_1(x), mask=mask)
    return x + self.proj(nnx.gelu(self.fc(self.ln_2(x))))


class NnxGPT2(nnx.Module):
  """The linen :class:`GPT2` in NNX."""

  def __init__(self, config: GPT2Config, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.wte = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
    self.wpe = nnx.Embed(config.max_len, config.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List(
      [NnxBlock(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.ln_f = nnx.LayerNorm(config.d_model, epsilon=1e-5, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def make_batch(config: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
  """A deterministic batch of token ids ``x`` and next-token targets ``y``."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (config.batch_size, config.max_len + 1))
  return {"x": tokens[:, :-1].astype(np.int32), "y": tokens[:, 1:].astype(np.int32)}
