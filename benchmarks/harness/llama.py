"""The Llama decoder of ``scaling_plan.py``: GQA attention with RoPE, SwiGLU, RMSNorm, scanned blocks.

Written as a Flax user writes it, with no dtype anywhere (``mpx.linen.apply_policy`` brings
the precision) and every param annotated with its logical axes
(``nn.with_logical_partitioning``): ``embed`` (the model width), ``heads`` (query heads x
head dim), ``kv`` (key/value heads x head dim), ``mlp`` (the gated MLP's width), ``vocab`` and
``layers`` (``nn.scan``'s stacked axis), and the activations with theirs
(``nn.with_logical_constraint``: ``batch``, ``length``, ``act_*``). :data:`RULES` maps them onto
the mesh axes ``"data"`` (FSDP: the params' width and the activations' batch) and ``"model"``
(tensor parallelism, Megatron-style: the projections that fan out split their outputs, those
that fan in split their inputs, and the activations between are split like them). Without the
activations' constraints XLA's sharding propagation may keep the weights in place and move
activations instead (it did, on the tiny model): FSDP is a choice the program has to state.
The constraints take effect under a mesh (``jax.set_mesh``) and ``nn.logical_axis_rules``.

The blocks run under ``nn.scan`` over ``nn.remat``: the program holds one block, a ``while``
loop runs it once per layer, and the backward pass recomputes each block's activations from
its input.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import spmd


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama's shape.

  Attributes:
    name: the label of the benchmark's rows.
    vocab_size: tokens.
    features: the model width.
    num_layers: blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention).
    mlp_hidden: the gated MLP's width.
    rope_theta: RoPE's base.
  """

  name: str
  vocab_size: int
  features: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  mlp_hidden: int
  rope_theta: float = 500_000.0

  @property
  def head_dim(self) -> int:
    """The width of one head."""
    return self.features // self.num_heads

  @property
  def param_count(self) -> int:
    """The number of params (untied embedding and head, as Llama-3-8B)."""
    kv = 2 * self.features * self.num_kv_heads * self.head_dim
    attention = 2 * self.features * self.features + kv
    block = attention + 3 * self.features * self.mlp_hidden + 2 * self.features
    return self.num_layers * block + 2 * self.vocab_size * self.features + self.features


# Llama-3.2-1B ties its embedding and head; these configs untie them (as Llama-3-8B), so the
# 1B row has 1.50B params rather than 1.24B.
LLAMA_1B = LlamaConfig("llama_1b", 128256, 2048, 16, 32, 8, 8192)
LLAMA_8B = LlamaConfig("llama_8b", 128256, 4096, 32, 32, 8, 14336)
TINY = LlamaConfig("tiny", 1024, 256, 2, 16, 8, 512)

#: Logical axis -> mesh axis. FSDP splits the width of every matrix and the batch over "data";
#: tensor parallelism splits heads, the MLP's width and the vocabulary over "model", in the
#: params and in the activations.
RULES = (
  ("embed", "data"),
  ("heads", "model"),
  ("kv", "model"),
  ("mlp", "model"),
  ("vocab", "model"),
  ("layers", None),
  ("norm", None),
  ("batch", "data"),
  ("length", None),
  ("act_embed", None),
  ("act_heads", "model"),
  ("act_kv", "model"),
  ("act_mlp", "model"),
  ("act_vocab", "model"),
  ("act_head_dim", None),
)


def _constrain(x: jax.Array, *axes: str) -> jax.Array:
  return spmd.with_logical_constraint(x, ("batch", "length", *axes))


def _dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
  return nn.Dense(features, use_bias=False, kernel_init=init, name=name)


def _norm(name: str) -> nn.RMSNorm:
  return nn.RMSNorm(
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), name=name
  )


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` (batch, length, heads, head dim), in ``x``'s dtype."""
  length, dim = x.shape[1], x.shape[-1]
  freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
  """Causal grouped-query self-attention with separate q, k, v and o projections."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, length, _ = x.shape
    kv_dim = c.num_kv_heads * c.head_dim
    q = _dense(c.features, ("embed", "heads"), "q")(x).reshape(batch, length, c.num_heads, -1)
    k = _dense(kv_dim, ("embed", "kv"), "k")(x).reshape(batch, length, c.num_kv_heads, -1)
    v = _dense(kv_dim, ("embed", "kv"), "v")(x).reshape(batch, length, c.num_kv_heads, -1)
    q = _constrain(q, "act_heads", "act_head_dim")
    k, v = (_constrain(t, "act_kv", "act_head_dim") for t in (k, v))
    q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
    group = c.num_heads // c.num_kv_heads
    q = q.reshape(batch, length, c.num_kv_heads, group, c.head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) * c.head_dim**-0.5
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(batch, length, c.features)
    out = _constrain(out, "act_heads")
    return _dense(c.features, ("heads", "embed"), "o")(out)


class Mlp(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    gate = _constrain(_dense(c.mlp_hidden, ("embed", "mlp"), "gate")(x), "act_mlp")
    up = _constrain(_dense(c.mlp_hidden, ("embed", "mlp"), "up")(x), "act_mlp")
    return _dense(c.features, ("mlp", "embed"), "down")(nn.silu(gate) * up)


class Block(nn.Module):
  """Pre-norm block; ``(x, None) -> (x, None)`` for ``nn.scan``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    x = x + _constrain(Attention(self.config, name="attention")(_norm("attn_norm")(x)), "act_embed")
    x = x + _constrain(Mlp(self.config, name="mlp")(_norm("mlp_norm")(x)), "act_embed")
    return _constrain(x, "act_embed"), None


class Llama(nn.Module):
  """Token embedding, ``num_layers`` blocks under ``nn.scan`` over ``nn.remat``, norm, head."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    x = nn.Embed(c.vocab_size, c.features, embedding_init=embed_init, name="embed")(tokens)
    x = _constrain(x, "act_embed")
    blocks = nn.scan(
      nn.remat(Block, prevent_cse=False),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=c.num_layers,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = blocks(c, name="layers")(x, None)
    x = _norm("final_norm")(x)
    return _constrain(_dense(c.vocab_size, ("embed", "vocab"), "head")(x), "act_vocab")
