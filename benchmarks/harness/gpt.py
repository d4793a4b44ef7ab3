"""The benchmarks' GPT: a GPT-2-style decoder in Flax linen, and its NNX twin.

Written the way a Flax user writes GPT-2 (pre-norm blocks, ``LayerNorm``,
Flax's multi-head attention with a causal mask, a GELU MLP, learned
positions) and with no precision argument set unless a benchmark passes one.
Two benchmarks train it:

* ``run.py`` (through ``setups.py``): GPT-2 small, ``GPTConfig()`` (12 layers,
  d_model 768, 12 heads, context 1024, vocabulary 50,257, the head tied to the
  token embedding: 124,439,808 params), in linen and NNX. Its "bfloat16 by
  hand" configuration passes ``dtype``; mpx's apply a policy to the model as
  written. :meth:`GPTConfig.smoke` keeps the architecture at a size that
  compiles in seconds.
* ``loss_scale_overhead.py``: a 4-layer linen model with an untied head
  (3,454,464 params in 69 leaves), written for float16 by hand: ``dtype``
  float16 for the matmuls, ``residual_dtype`` float32 for the residual stream,
  the norms and the logits.

With ``is_causal=True`` the attention is told it is causal instead of being
given a causal mask array, as mpx's fused attention needs (a mask array is
applied as given; cuDNN's causal mode cannot know the array is causal):
linen's attention layer gets ``attention_fn=functools.partial(
mpx.dot_product_attention, is_causal=True)`` (linen passes no ``is_causal``),
NNX's is called with ``is_causal=True``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mpx

Dtype = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of the decoder and of one training batch.

  Attributes:
    vocab_size: number of token ids.
    max_len: context length (the position embedding's size and the batch's).
    num_layers: transformer blocks.
    d_model: width of the residual stream.
    num_heads: attention heads per block.
    batch_size: sequences per batch.
    tied_head: logits from the token embedding (GPT-2) rather than from a
      separate bias-free ``Dense`` named ``head``.
  """

  vocab_size: int = 50_257
  max_len: int = 1024
  num_layers: int = 12
  d_model: int = 768
  num_heads: int = 12
  batch_size: int = 8
  tied_head: bool = True

  @classmethod
  def smoke(cls) -> GPTConfig:
    """GPT-2 small's architecture at a size a CPU compiles in seconds."""
    return cls(vocab_size=128, max_len=64, num_layers=2, d_model=64, num_heads=4, batch_size=4)


def _cast(x: jax.Array, dtype: Dtype) -> jax.Array:
  return x if dtype is None else x.astype(dtype)


# ---------------------------------------------------------------------------- linen


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual.

  Attributes:
    config: the model's shape.
    dtype: compute dtype of the layers (``None``: Flax's default, the params').
    residual_dtype: if set, the residual stream and the norms stay in this
      dtype while the matmuls run in ``dtype``.
    is_causal: tell the attention it is causal (mpx's attention with
      ``is_causal=True``) instead of passing a causal mask array.
  """

  config: GPTConfig
  dtype: Dtype = None
  residual_dtype: Dtype = None
  is_causal: bool = False

  def _norm(self, x: jax.Array) -> jax.Array:
    """A layer norm; with ``residual_dtype`` set, computed in it and cast to ``dtype`` once."""
    if self.residual_dtype is None:
      return nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)(x)
    return nn.LayerNorm(epsilon=1e-5, dtype=self.residual_dtype)(x).astype(self.dtype)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = self._norm(x)
    if self.is_causal:
      causal = functools.partial(mpx.dot_product_attention, is_causal=True)
      h = nn.MultiHeadDotProductAttention(cfg.num_heads, self.dtype, attention_fn=causal)(h)
    else:
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
      h = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=self.dtype)(h, mask=mask)
    x = x + _cast(h, self.residual_dtype)
    h = self._norm(x)
    h = nn.Dense(4 * cfg.d_model, dtype=self.dtype)(h)
    h = nn.gelu(h)
    return x + _cast(nn.Dense(cfg.d_model, dtype=self.dtype)(h), self.residual_dtype)


class GPT(nn.Module):
  """Decoder-only language model (attributes as :class:`Block`'s)."""

  config: GPTConfig
  dtype: Dtype = None
  residual_dtype: Dtype = None
  is_causal: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    norm_dtype = self.dtype if self.residual_dtype is None else self.residual_dtype
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, name="wte")
    positions = nn.Embed(cfg.max_len, cfg.d_model, dtype=norm_dtype, name="wpe")
    if self.residual_dtype is None:
      x = embed(tokens) + positions(jnp.arange(tokens.shape[1]))
    else:  # sliced, not gathered: the program docs/benchmarks.md measured, op for op
      x = embed(tokens).astype(self.residual_dtype) + positions.embedding[: tokens.shape[1]]
    for _ in range(cfg.num_layers):
      x = Block(cfg, self.dtype, self.residual_dtype, self.is_causal)(x)
    x = nn.LayerNorm(epsilon=1e-5, dtype=norm_dtype, name="ln_f")(x)
    if cfg.tied_head:
      return _cast(embed.attend(x), self.residual_dtype)
    head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, name="head")
    return _cast(head(x), self.residual_dtype)


# ------------------------------------------------------------------------------ NNX


class NnxBlock(nnx.Module):
  """The linen :class:`Block` in NNX (``dtype`` and ``is_causal`` only)."""

  def __init__(
    self, config: GPTConfig, *, dtype: Dtype = None, is_causal: bool = False, rngs: nnx.Rngs
  ):
    d = config.d_model
    self.is_causal = is_causal
    self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(config.num_heads, d, decode=False, dtype=dtype, rngs=rngs)
    self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
    self.fc = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.is_causal:
      x = x + self.attn(self.ln_1(x), is_causal=True)
    else:
      mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
      x = x + self.attn(self.ln_1(x), mask=mask)
    return x + self.proj(nnx.gelu(self.fc(self.ln_2(x))))


class NnxGPT(nnx.Module):
  """The linen :class:`GPT` in NNX, with the tied head (``dtype`` and ``is_causal`` only)."""

  def __init__(
    self, config: GPTConfig, *, dtype: Dtype = None, is_causal: bool = False, rngs: nnx.Rngs
  ):
    if not config.tied_head:
      raise ValueError("NnxGPT has GPT-2's tied head only; pass a GPTConfig with tied_head=True.")
    self.wte = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
    self.wpe = nnx.Embed(config.max_len, config.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List(
      [
        NnxBlock(config, dtype=dtype, is_causal=is_causal, rngs=rngs)
        for _ in range(config.num_layers)
      ]
    )
    self.ln_f = nnx.LayerNorm(config.d_model, epsilon=1e-5, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def make_batch(config: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """A deterministic batch of token ids ``x`` and next-token targets ``y``."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (config.batch_size, config.max_len + 1))
  return {"x": tokens[:, :-1].astype(np.int32), "y": tokens[:, 1:].astype(np.int32)}
