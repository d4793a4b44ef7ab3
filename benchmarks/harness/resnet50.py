"""ResNet-50 (He et al. 2016, the v1.5 bottleneck with the stride on the 3x3 convolution) in linen.

An ordinary linen model with BatchNorm and no precision argument set:
``dtype`` is ``None`` unless a configuration passes one (the "bfloat16 by
hand" configuration). The default config is ResNet-50 on 224x224 ImageNet-shaped
batches (25,557,032 params); :meth:`ResNetConfig.smoke` keeps the bottleneck
architecture at a size that compiles in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Shape of the network and of one training batch."""

  stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
  width: int = 64
  num_classes: int = 1000
  image_size: int = 224
  batch_size: int = 64

  @classmethod
  def smoke(cls) -> ResNetConfig:
    """The same bottleneck architecture at a size a CPU compiles in seconds."""
    return cls(stage_sizes=(1, 1, 1, 1), width=8, num_classes=16, image_size=32, batch_size=4)


class Bottleneck(nn.Module):
  """1x1, 3x3 (strided), 1x1 convolutions with BatchNorm; projection shortcut when shapes change."""

  features: int
  strides: int
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype
    )
    h = nn.relu(norm()(conv(self.features, (1, 1))(x)))
    h = conv(self.features, (3, 3), (self.strides, self.strides))(h)
    h = nn.relu(norm()(h))
    h = conv(4 * self.features, (1, 1))(h)
    # Zero-initialised last scale: each block starts as the identity (Goyal et al. 2017).
    h = norm(scale_init=nn.initializers.zeros)(h)
    if x.shape != h.shape:
      x = conv(4 * self.features, (1, 1), (self.strides, self.strides), name="proj")(x)
      x = norm(name="proj_norm")(x)
    return nn.relu(x + h)


class ResNet50(nn.Module):
  """Stem, four bottleneck stages, global average pooling, a dense classifier."""

  config: ResNetConfig
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    cfg = self.config
    x = nn.Conv(cfg.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                dtype=self.dtype, name="stem")(x)  # fmt: skip
    x = nn.BatchNorm(
      use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype, name="stem_norm"
    )(x)
    x = nn.max_pool(nn.relu(x), (3, 3), (2, 2), padding="SAME")
    for stage, blocks in enumerate(cfg.stage_sizes):
      for block in range(blocks):
        strides = 2 if stage > 0 and block == 0 else 1
        x = Bottleneck(cfg.width * 2**stage, strides, self.dtype)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(cfg.num_classes, dtype=self.dtype, name="head")(x)


def make_batch(config: ResNetConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """A deterministic batch of NHWC float32 images ``x`` and int32 labels ``y``."""
  rng = np.random.default_rng(seed)
  size = config.image_size
  images = rng.standard_normal((config.batch_size, size, size, 3), dtype=np.float32)
  labels = rng.integers(0, config.num_classes, config.batch_size).astype(np.int32)
  return {"x": images, "y": labels}
