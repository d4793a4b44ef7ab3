"""A small character-level GPT, written in plain Flax linen with no dtype argument.

Adapted from ``benchmarks/gpt.py``: the same pre-norm decoder (learned
positions, Flax attention, GELU MLP, untied head), but with every dtype left
out, so a precision policy reaches it from the outside through
``mpx.linen.apply_policy``, the way a user's model does. Each block passes its
output through ``Module.perturb``: a zero variable in the ``perturbations``
collection whose gradient is the gradient flowing into that activation
(:func:`mpx.demo._train.activation_gradients` reads it). Without that
collection, ``perturb`` is the identity, so training never sees it.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of the model.

  Attributes:
    vocab_size: number of token ids.
    max_len: longest sequence the position embedding covers.
    num_layers: transformer blocks.
    d_model: width of the residual stream.
    num_heads: attention heads per block.
    mlp_ratio: hidden width of each MLP, in multiples of ``d_model``.
  """

  vocab_size: int
  max_len: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_ratio: int = 4


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention and a GELU MLP, each residual.

  Attributes:
    config: the model's shape.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the block.

    Args:
      x: the residual stream, shape ``(batch, length, d_model)``.

    Returns:
      The new residual stream, same shape.
    """
    cfg = self.config
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads)(h, mask=mask)
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(cfg.mlp_ratio * cfg.d_model)(h))
    x = x + nn.Dense(cfg.d_model)(h)
    return self.perturb("output", x)


class CharTransformer(nn.Module):
  """Decoder-only language model: token and position embeddings, blocks, logits.

  Attributes:
    config: the model's shape.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Computes next-token logits.

    Args:
      tokens: int32 ids, shape ``(batch, length)`` with ``length <= max_len``.

    Returns:
      Logits of shape ``(batch, length, vocab_size)``, in the policy's output dtype.
    """
    cfg = self.config
    positions = jnp.arange(tokens.shape[1])
    x = nn.Embed(cfg.vocab_size, cfg.d_model, name="tokens")(tokens)
    x = x + nn.Embed(cfg.max_len, cfg.d_model, name="positions")(positions)
    for _ in range(cfg.num_layers):
      x = Block(cfg)(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(cfg.vocab_size, use_bias=False, name="head")(x)
