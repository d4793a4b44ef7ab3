"""Magnitude histograms: how many values of a tree fall in each power-of-two bucket.

The picture behind loss scaling (paper Figure 3) is a log2 histogram of
activation-gradient magnitudes, most of them below float16's range. This
module computes it for any pytree, exactly (from the bits; see
``mpx._src.diagnostics.bits``) and with a fixed-size result, so that it can run
inside a jitted train step and be logged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import tree as tree_lib
from mpx._src.diagnostics import bits

# Buckets 2**e <= |x| < 2**(e + 1) for e in [-149, 127] cover every finite
# nonzero float32 (subnormals from 2**-149). The two end buckets are open:
# -150 holds |x| < 2**-149 and 128 holds |x| >= 2**128 (float64 values only).
MIN_EXPONENT, MAX_EXPONENT = -150, 128
EXPONENTS = np.arange(MIN_EXPONENT, MAX_EXPONENT + 1)
NUM_BUCKETS = len(EXPONENTS)
_ZERO, _INF, _NAN = NUM_BUCKETS, NUM_BUCKETS + 1, NUM_BUCKETS + 2


class MagnitudeHistogram(NamedTuple):
  """Counts of values per power-of-two magnitude bucket (a pytree of int32 arrays).

  ``counts[i]`` is the number of finite nonzero values with
  ``2**e <= |x| < 2**(e + 1)``, ``e = EXPONENTS[i]`` (``-150`` to ``128``;
  the first bucket also holds everything smaller, the last everything larger,
  which only float64 values can reach). Zeros (either sign), infinities and
  NaNs are counted apart. Histograms add: ``jax.tree.map(jnp.add, a, b)``.

  Attributes:
    counts: int32 array of shape ``(279,)``, one count per exponent of
      :attr:`EXPONENTS`.
    zeros: int32 scalar, values equal to zero.
    infs: int32 scalar, infinities of either sign.
    nans: int32 scalar, NaNs.
  """

  counts: jax.Array
  zeros: jax.Array
  infs: jax.Array
  nans: jax.Array

  EXPONENTS = EXPONENTS

  @property
  def nonfinite(self) -> jax.Array:
    """int32: infinities and NaNs."""
    return self.infs + self.nans

  @property
  def size(self) -> jax.Array:
    """int32: every value counted (nonzero, zero and non-finite)."""
    return jnp.sum(self.counts, axis=-1, dtype=jnp.int32) + self.zeros + self.infs + self.nans


def _leaf_counts(x: jax.Array) -> jax.Array:
  d = bits.decode(x)
  bucket = jnp.clip(d.exponent, MIN_EXPONENT, MAX_EXPONENT) - MIN_EXPONENT
  bucket = jnp.where(d.zero, _ZERO, bucket)
  bucket = jnp.where(jnp.isinf(x), _INF, bucket)
  bucket = jnp.where(jnp.isnan(x), _NAN, bucket)
  return jnp.bincount(bucket.ravel(), length=NUM_BUCKETS + 3).astype(jnp.int32)


def magnitude_histogram(tree: Any) -> MagnitudeHistogram:
  """Counts the values of every floating leaf of ``tree`` per power-of-two magnitude.

  Bucket ``e`` counts the finite nonzero values with ``2**e <= |x| < 2**(e+1)``,
  read exactly from each value's bits (float32 subnormals included, which
  XLA would flush to zero in arithmetic). One scatter-add per leaf; the
  result has a fixed size, so the function runs under ``jit`` and inside a
  train step. Non-floating leaves (integers, PRNG keys) are ignored.

  For one histogram per leaf, map it over the tree:
  ``jax.tree.map(mpx.diagnostics.magnitude_histogram, tree)``.

  Args:
    tree: any pytree, e.g. gradients or activations.

  Returns:
    The :class:`MagnitudeHistogram` of all floating leaves together.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> h = mpx.diagnostics.magnitude_histogram({"a": jnp.array([0.75, 3.0, 0.0]), "b": jnp.array([jnp.inf])})
    >>> {int(e): int(c) for e, c in zip(h.EXPONENTS, h.counts) if c}
    {-1: 1, 1: 1}
    >>> int(h.zeros), int(h.infs), int(h.nans)
    (1, 1, 0)
    >>> per_leaf = jax.tree.map(mpx.diagnostics.magnitude_histogram, {"a": jnp.ones(3), "b": jnp.zeros(2)})
    >>> int(per_leaf["a"].counts.sum()), int(per_leaf["b"].zeros)
    (3, 2)
  """
  total = jnp.zeros(NUM_BUCKETS + 3, jnp.int32)
  for leaf in jax.tree.leaves(tree):
    if tree_lib.is_floating_array(leaf) and leaf.size:
      total = total + _leaf_counts(leaf)
  return MagnitudeHistogram(
    counts=total[:NUM_BUCKETS], zeros=total[_ZERO], infs=total[_INF], nans=total[_NAN]
  )
