"""The MLP of the float8 studies: three GELU layers and a linear one, all ``width`` wide."""

from __future__ import annotations

from flax import linen as nn


class Mlp(nn.Module):
  """``width``-wide MLP: 3 x (Dense, GELU), then Dense; the fp8 recipes' test bed."""

  width: int

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(self.width)(x)
