"""One Llama-style decoder block, the fp8 block study's model (``fp8_block.py``, ``fp8_plan.py``).

Llama-3-8B's block: RMSNorm, grouped-query attention with RoPE (32 query heads, 8 key/value
heads of 128), RMSNorm, a SwiGLU MLP of width 14,336; no bias, no dtype anywhere (a policy
brings the precision). The attention goes through the layer's ``attention_fn``, left at Flax's
default so that ``mpx.linen.apply_policy`` gives it the policy's attention
(:func:`mpx.dot_product_attention`): called with ``is_causal=True`` and no mask array where
that function takes it (the form a fused flash-attention kernel can run), with a causal mask
under Flax's own. The key and value heads are repeated to the query heads before it, as Flax's
attention functions take equal head counts.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .llama import rope


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """The block's shape and its batch.

  Attributes:
    width: the model width.
    heads: query heads.
    kv_heads: key/value heads.
    ffn: the SwiGLU MLP's width.
    seq: tokens per sequence.
    batch: sequences per step.
  """

  width: int = 4096
  heads: int = 32
  kv_heads: int = 8
  ffn: int = 14336
  seq: int = 4096
  batch: int = 2

  @classmethod
  def smoke(cls) -> BlockConfig:
    """The same block at a size a CPU compiles in seconds."""
    return cls(width=256, heads=4, kv_heads=2, ffn=512, seq=128, batch=2)

  @property
  def head_dim(self) -> int:
    """The width of one head."""
    return self.width // self.heads

  def matmul_flops(self) -> int:
    """The FLOPs of the block's dense layers in one step (forward and backward: 3x the forward)."""
    tokens = self.batch * self.seq
    kv = self.kv_heads * self.head_dim
    params = 2 * self.width * self.width + 2 * self.width * kv + 3 * self.width * self.ffn
    return 3 * 2 * tokens * params


class Attention(nn.Module):
  """Causal grouped-query self-attention; the score-and-weight part is ``attention_fn``."""

  config: BlockConfig
  attention_fn: Callable[..., jax.Array] = nn.dot_product_attention

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, length, _ = x.shape
    kv = c.kv_heads * c.head_dim
    q = nn.Dense(c.width, use_bias=False, name="q")(x).reshape(batch, length, c.heads, -1)
    k = nn.Dense(kv, use_bias=False, name="k")(x).reshape(batch, length, c.kv_heads, -1)
    v = nn.Dense(kv, use_bias=False, name="v")(x).reshape(batch, length, c.kv_heads, -1)
    q, k = rope(q, 500_000.0), rope(k, 500_000.0)
    k, v = (jnp.repeat(t, c.heads // c.kv_heads, axis=2) for t in (k, v))
    if "is_causal" in inspect.signature(self.attention_fn).parameters:
      out = self.attention_fn(q, k, v, is_causal=True)
    else:
      out = self.attention_fn(q, k, v, mask=nn.make_causal_mask(jnp.ones((batch, length))))
    return nn.Dense(c.width, use_bias=False, name="o")(out.reshape(batch, length, c.width))


class Block(nn.Module):
  """Pre-norm decoder block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

  config: BlockConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    x = x + Attention(c, name="attention")(nn.RMSNorm(name="attn_norm")(x))
    h = nn.RMSNorm(name="mlp_norm")(x)
    gate = nn.Dense(c.ffn, use_bias=False, name="gate")(h)
    up = nn.Dense(c.ffn, use_bias=False, name="up")(h)
    return x + nn.Dense(c.width, use_bias=False, name="down")(nn.silu(gate) * up)


def inputs(config: BlockConfig) -> Any:
  """The block's input for the cost model: ``float32[batch, seq, width]`` as a shape."""
  return jax.ShapeDtypeStruct((config.batch, config.seq, config.width), jnp.float32)
