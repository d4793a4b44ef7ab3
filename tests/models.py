"""Reference models and small real data sets for the policy and audit tests.

Every model here is written the way a Flax user writes one when precision is
not on their mind: no ``dtype``, ``param_dtype`` or ``preferred_element_type``
argument anywhere. A precision policy must reach them from the outside
(``mpx.linen.apply_policy`` / ``mpx.nnx.apply_policy``); that is the point.

Sizes are tiny (dims multiples of 8, except where the data fixes them: one
input channel and ten classes for the digits) so a full training step lowers,
compiles and runs in well under a second on a CPU.

Data:

* :func:`digits`: scikit-learn's 8x8 handwritten digits (ships with
  scikit-learn), as NHWC float32 images in [0, 1] and int32 labels.
* :func:`text_tokens` / :func:`lm_batch`: a character-level language-modelling
  corpus made of the help topics that ship with Python (``pydoc_data.topics``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

VOCAB_SIZE = 128  # ASCII; every other character maps to UNKNOWN_TOKEN.
UNKNOWN_TOKEN = 0
NUM_CLASSES = 10


# ---------------------------------------------------------------------------
# Linen GPT-style decoder.
# ---------------------------------------------------------------------------


class Mlp(nn.Module):
  """Two-layer GELU MLP of a transformer block."""

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = x.shape[-1]
    x = nn.Dense(self.hidden)(x)
    x = nn.gelu(x)
    return nn.Dense(features)(x)


class CausalSelfAttention(nn.Module):
  """Hand-written multi-head causal self-attention (no Flax attention layer)."""

  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, features = x.shape
    head_dim = features // self.num_heads
    qkv = nn.Dense(3 * features, name="qkv")(x)
    qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * head_dim**-0.5
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, features)
    return nn.Dense(features, name="out")(out)


class Block(nn.Module):
  """Pre-norm transformer block: attention and MLP, each with a residual."""

  num_heads: int
  mlp_hidden: int
  flax_attention: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.LayerNorm()(x)
    if self.flax_attention:
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
      h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, mask=mask)
    else:
      h = CausalSelfAttention(num_heads=self.num_heads)(h)
    x = x + h
    h = nn.LayerNorm()(x)
    return x + Mlp(self.mlp_hidden)(h)


class Decoder(nn.Module):
  """A small GPT-style decoder: token and position embeddings, blocks, logits.

  Attributes:
    vocab_size: number of tokens.
    features: model width.
    num_heads: attention heads per block.
    num_layers: transformer blocks.
    mlp_hidden: hidden width of each MLP.
    max_len: longest sequence the position embedding covers.
    tie_embeddings: compute logits with the token embedding (``Embed.attend``)
      instead of a separate ``Dense`` head.
    flax_attention: use ``nn.MultiHeadDotProductAttention``; ``False`` uses the
      hand-written :class:`CausalSelfAttention`.
  """

  vocab_size: int = VOCAB_SIZE
  features: int = 64
  num_heads: int = 4
  num_layers: int = 2
  mlp_hidden: int = 128
  max_len: int = 64
  tie_embeddings: bool = False
  flax_attention: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embed = nn.Embed(self.vocab_size, self.features, name="tok_embed")
    positions = jnp.arange(tokens.shape[-1])
    x = embed(tokens) + nn.Embed(self.max_len, self.features, name="pos_embed")(positions)
    for _ in range(self.num_layers):
      x = Block(self.num_heads, self.mlp_hidden, self.flax_attention)(x)
    x = nn.LayerNorm(name="ln_final")(x)
    if self.tie_embeddings:
      return embed.attend(x)
    return nn.Dense(self.vocab_size, name="head")(x)


# ---------------------------------------------------------------------------
# Linen Llama-style decoder: blocks under nn.scan over nn.remat, as large models write them.
# ---------------------------------------------------------------------------


class GatedMlp(nn.Module):
  """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    gate = nn.Dense(self.hidden, use_bias=False, name="gate")(x)
    up = nn.Dense(self.hidden, use_bias=False, name="up")(x)
    return nn.Dense(x.shape[-1], use_bias=False, name="down")(nn.silu(gate) * up)


class LlamaBlock(nn.Module):
  """Pre-norm block: RMSNorm, causal self-attention, RMSNorm, gated MLP, with residuals."""

  num_heads: int
  mlp_hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + CausalSelfAttention(self.num_heads, name="attention")(nn.RMSNorm(name="attn_norm")(x))
    return x + GatedMlp(self.mlp_hidden, name="mlp")(nn.RMSNorm(name="mlp_norm")(x))


class ScannedLlamaBlock(nn.Module):
  """One iteration of the decoder's ``nn.scan``: a rematerialised :class:`LlamaBlock`."""

  num_heads: int
  mlp_hidden: int

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    return nn.remat(LlamaBlock)(self.num_heads, self.mlp_hidden, name="block")(x), None


class LlamaDecoder(nn.Module):
  """A small Llama-style decoder: token embedding, blocks, final RMSNorm, head.

  Attributes:
    vocab_size: number of tokens.
    features: model width.
    num_heads: attention heads per block.
    num_layers: blocks.
    mlp_hidden: hidden width of each gated MLP.
    scan: run the ``nn.remat`` blocks under ``nn.scan`` (params and the
      ``"fp8_history"`` collection of delayed fp8 stacked on a leading layer
      axis); ``False`` unrolls them in a Python loop, the same arithmetic.
  """

  vocab_size: int = VOCAB_SIZE
  features: int = 32
  num_heads: int = 2
  num_layers: int = 2
  mlp_hidden: int = 64
  scan: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab_size, self.features, name="tok_embed")(tokens)
    if self.scan:
      blocks = nn.scan(
        ScannedLlamaBlock,
        variable_axes={"params": 0, "fp8_history": 0},
        split_rngs={"params": True},
        length=self.num_layers,
      )
      x, _ = blocks(self.num_heads, self.mlp_hidden, name="layers")(x, None)
    else:
      for i in range(self.num_layers):
        x = nn.remat(LlamaBlock)(self.num_heads, self.mlp_hidden, name=f"layers_{i}")(x)
    x = nn.RMSNorm(name="final_norm")(x)
    return nn.Dense(self.vocab_size, use_bias=False, name="head")(x)


# ---------------------------------------------------------------------------
# Linen ResNet-style CNN with BatchNorm.
# ---------------------------------------------------------------------------


class ResidualBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and an identity shortcut."""

  channels: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    h = nn.Conv(self.channels, (3, 3), use_bias=False)(x)
    h = nn.relu(norm()(h))
    h = nn.Conv(self.channels, (3, 3), use_bias=False)(h)
    h = norm()(h)
    return nn.relu(x + h)


class ResNet(nn.Module):
  """A small ResNet for 8x8x1 images: stem, residual blocks, pooled head.

  Attributes:
    channels: width of every convolution.
    num_blocks: residual blocks after the stem.
    num_classes: logits per image.
  """

  channels: int = 16
  num_blocks: int = 2
  num_classes: int = NUM_CLASSES

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    x = nn.Conv(self.channels, (3, 3), use_bias=False, name="stem")(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for _ in range(self.num_blocks):
      x = ResidualBlock(self.channels)(x, train)
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)


# ---------------------------------------------------------------------------
# NNX GPT-style decoder (the same architecture as Decoder).
# ---------------------------------------------------------------------------


class NnxMlp(nnx.Module):
  """Two-layer GELU MLP of a transformer block."""

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(features, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, features, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(nnx.gelu(self.up(x)))


class NnxBlock(nnx.Module):
  """Pre-norm transformer block with ``nnx.MultiHeadAttention``."""

  def __init__(self, features: int, num_heads: int, mlp_hidden: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(features, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads, features, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(features, rngs=rngs)
    self.mlp = NnxMlp(features, mlp_hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp(self.ln2(x))


class NnxDecoder(nnx.Module):
  """The :class:`Decoder` architecture written in ``flax.nnx``."""

  def __init__(
    self,
    *,
    vocab_size: int = VOCAB_SIZE,
    features: int = 64,
    num_heads: int = 4,
    num_layers: int = 2,
    mlp_hidden: int = 128,
    max_len: int = 64,
    rngs: nnx.Rngs,
  ):
    self.tok_embed = nnx.Embed(vocab_size, features, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, features, rngs=rngs)
    self.blocks = nnx.List(
      [NnxBlock(features, num_heads, mlp_hidden, rngs=rngs) for _ in range(num_layers)]
    )
    self.ln_final = nnx.LayerNorm(features, rngs=rngs)
    self.head = nnx.Linear(features, vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_final(x))


# ---------------------------------------------------------------------------
# NNX Llama-style decoder: blocks stacked with nnx.vmap, run with nnx.scan.
# ---------------------------------------------------------------------------


class NnxLlamaBlock(nnx.Module):
  """RMSNorm, causal self-attention, RMSNorm, gated (SwiGLU) MLP, with a dropout of its own."""

  def __init__(self, features: int, num_heads: int, hidden: int, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(features, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads, features, decode=False, use_bias=False, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(features, rngs=rngs)
    self.gate = nnx.Linear(features, hidden, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(features, hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(hidden, features, use_bias=False, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
    x = x + self.attn(self.attn_norm(x), mask=mask)
    h = self.mlp_norm(x)
    return x + self.dropout(self.down(nnx.silu(self.gate(h)) * self.up(h)))


class NnxLlama(nnx.Module):
  """A Llama-style decoder; ``stacked`` builds the blocks with ``nnx.vmap`` and runs them with
  ``nnx.scan`` over ``nnx.remat``, otherwise a Python loop over separate (rematted) blocks.

  ``__call__`` takes an ``nnx.Rngs`` for the embedding dropout; each block's dropout draws
  from a stream of its own (stacked with the blocks).
  """

  def __init__(
    self,
    *,
    stacked: bool,
    vocab_size: int = VOCAB_SIZE,
    features: int = 32,
    num_heads: int = 2,
    hidden: int = 64,
    num_layers: int = 2,
    rngs: nnx.Rngs,
  ):
    self.stacked = stacked
    self.embed = nnx.Embed(vocab_size, features, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    if stacked:

      @nnx.split_rngs(splits=num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_blocks(rngs: nnx.Rngs) -> NnxLlamaBlock:
        return NnxLlamaBlock(features, num_heads, hidden, rngs=rngs)

      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List(
        [NnxLlamaBlock(features, num_heads, hidden, rngs=rngs) for _ in range(num_layers)]
      )
    self.norm = nnx.RMSNorm(features, rngs=rngs)
    self.head = nnx.Linear(features, vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array, rngs: nnx.Rngs) -> jax.Array:
    x = self.dropout(self.embed(tokens), rngs=rngs)

    @nnx.remat
    def run_block(block: NnxLlamaBlock, x: jax.Array) -> jax.Array:
      return block(x)

    if self.stacked:

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run_blocks(x: jax.Array, block: NnxLlamaBlock) -> jax.Array:
        return run_block(block, x)

      x = run_blocks(x, self.blocks)
    else:
      for block in self.blocks:
        x = run_block(block, x)
    return self.head(self.norm(x))


# ---------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
  """Returns scikit-learn's digits as ``(images [1797, 8, 8, 1] f32 in [0, 1], labels i32)``."""
  from sklearn.datasets import load_digits

  data = load_digits()
  images = (data.images / 16.0).astype(np.float32)[..., None]
  return images, data.target.astype(np.int32)


@functools.cache
def text_tokens() -> np.ndarray:
  """Returns Python's bundled help topics as int32 character codes in ``[0, VOCAB_SIZE)``."""
  from pydoc_data.topics import topics

  text = "\n".join(topics[key] for key in sorted(topics))
  codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  return np.where(codes < VOCAB_SIZE, codes, UNKNOWN_TOKEN).astype(np.int32)


def lm_batch(
  tokens: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Returns a deterministic batch of ``(inputs, next-token targets)`` windows.

  Args:
    tokens: the corpus from :func:`text_tokens`.
    step: the training step; each step draws fresh random windows.
    batch_size: windows per batch.
    seq_len: tokens per window.
    seed: base seed, combined with ``step``.

  Returns:
    Two int32 arrays of shape ``[batch_size, seq_len]``.
  """
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, tokens.shape[0] - seq_len - 1, size=batch_size)
  windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
  return windows[:, :-1], windows[:, 1:]
