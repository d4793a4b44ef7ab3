"""Equinox reference models for the adapter and training tests, written without any dtype.

A ViT-style model (patch embedding, stacked pre-norm blocks run by a
``jax.lax.scan`` over layers built with ``eqx.filter_vmap``, Equinox's
``MultiheadAttention``, a ``LayerNorm`` and a linear head) and a ResNet-style
CNN (convolutions and ``BatchNorm`` with its statistics in an
``eqx.nn.State``), both for the 8x8x1 digits of ``tests/models.py``. Like the
Flax models there, they take one example and are batched with ``jax.vmap``,
as Equinox models are; precision reaches them only from
``mpx.eqx.apply_policy``. Sizes are tiny so that a train step compiles in
about a second on a CPU; feature counts are multiples of 16 (float8
convolutions need them), except where the data fixes them.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

NUM_CLASSES = 10
PATCH = 2  # 8x8 images: 16 patches of 2x2 pixels.


class Block(eqx.Module):
  """A pre-norm transformer block: attention and an MLP, each with a residual."""

  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, width: int, heads: int, *, key: jax.Array) -> None:
    k1, k2 = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(width)
    self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
    self.norm2 = eqx.nn.LayerNorm(width)
    self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h)
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class ViT(eqx.Module):
  """A vision transformer for one ``[8, 8, 1]`` image; its blocks are one stacked ``Block``."""

  patch_embedding: eqx.nn.Linear
  positions: jax.Array
  blocks: Block
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, *, width: int = 32, depth: int = 2, heads: int = 2, key: jax.Array) -> None:
    keys = jax.random.split(key, 4)
    self.patch_embedding = eqx.nn.Linear(PATCH * PATCH, width, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (16, width))
    make = lambda k: Block(width, heads, key=k)  # noqa: E731
    self.blocks = eqx.filter_vmap(make)(jax.random.split(keys[2], depth))
    self.norm = eqx.nn.LayerNorm(width)
    self.head = eqx.nn.Linear(width, NUM_CLASSES, key=keys[3])

  def __call__(self, image: jax.Array) -> jax.Array:
    patches = image.reshape(4, PATCH, 4, PATCH).transpose(0, 2, 1, 3).reshape(16, PATCH * PATCH)
    x = jax.vmap(self.patch_embedding)(patches) + self.positions
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)

    def layer(x: jax.Array, params: Block) -> tuple[jax.Array, None]:
      return eqx.combine(params, static)(x), None

    x, _ = jax.lax.scan(layer, x, dynamic)
    return self.head(jnp.mean(jax.vmap(self.norm)(x), axis=0))


class ResidualBlock(eqx.Module):
  """Two 3x3 convolutions with batch norm and a residual."""

  conv1: eqx.nn.Conv2d
  norm1: eqx.nn.BatchNorm
  conv2: eqx.nn.Conv2d
  norm2: eqx.nn.BatchNorm

  def __init__(self, channels: int, *, key: jax.Array) -> None:
    k1, k2 = jax.random.split(key)
    self.conv1 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=k1)
    self.norm1 = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")
    self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=k2)
    self.norm2 = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")

  def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
    y, state = self.norm1(self.conv1(x), state)
    y, state = self.norm2(self.conv2(jax.nn.relu(y)), state)
    return jax.nn.relu(x + y), state


class ResNet(eqx.Module):
  """A small ResNet for one ``[1, 8, 8]`` (channels first) image."""

  stem: eqx.nn.Conv2d
  stem_norm: eqx.nn.BatchNorm
  blocks: list[ResidualBlock]
  head: eqx.nn.Linear

  def __init__(self, *, channels: int = 16, depth: int = 2, key: jax.Array) -> None:
    keys = jax.random.split(key, depth + 2)
    self.stem = eqx.nn.Conv2d(1, channels, 3, padding=1, key=keys[0])
    self.stem_norm = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")
    self.blocks = [ResidualBlock(channels, key=k) for k in keys[1:-1]]
    self.head = eqx.nn.Linear(channels, NUM_CLASSES, key=keys[-1])

  def __call__(self, image: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
    x, state = self.stem_norm(self.stem(image), state)
    x = jax.nn.relu(x)
    for block in self.blocks:
      x, state = block(x, state)
    return self.head(jnp.mean(x, axis=(1, 2))), state


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The mean softmax cross-entropy."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def vit_loss(model: ViT, batch: dict) -> jax.Array:
  """The loss of a batch of ``[B, 8, 8, 1]`` images."""
  return xent(jax.vmap(model)(batch["x"]), batch["y"])


def resnet_loss(model: ResNet, state: eqx.nn.State, batch: dict) -> tuple[jax.Array, eqx.nn.State]:
  """The loss of a batch, and the new batch-norm state (batch statistics over ``"batch"``)."""
  images = jnp.moveaxis(batch["x"], -1, 1)  # NHWC -> per-image CHW
  forward = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
  logits, state = forward(images, state)
  return xent(logits, batch["y"]), state
