"""The finite check of loss scaling: is every gradient still finite once unscaled?

The check reads the *scaled* gradients in a few bucketed reductions, so that
XLA fuses it without materialising the unscaled tree; ``docs/benchmarks.md``
measures it against the per-leaf ``isfinite`` of jmp and flax.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Leaves up to this size are checked together in one concatenated reduction;
# larger ones get one reduction each. Tuned on the GPT of
# benchmarks/loss_scale_overhead.py (docs/benchmarks.md).
_CONCAT_LIMIT = 2**16


def unscaled_dtype(dtype: np.dtype) -> np.dtype:
  """Returns the dtype a floating leaf of ``dtype`` is unscaled in: float32, or float64."""
  return dtype if dtype.itemsize > 4 else np.dtype(np.float32)


def all_finite(tree: Any) -> jax.Array:
  """Returns whether every element of every array leaf of ``tree`` is finite.

  Args:
    tree: any pytree of arrays.

  Returns:
    A bool scalar; ``True`` for a tree without leaves.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> bool(mpx.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


def finite_after_unscale(grads: Any, scale: jax.Array) -> jax.Array:
  """Whether every element of ``grads * (1 / scale)`` is finite, in few kernels.

  ``sum(|g|) * (1 / scale)`` is finite exactly when no element is inf or NaN
  and no unscaled ``|g_i| * (1 / scale)`` overflows (``|g_i| <= sum(|g|)``),
  so one scalar decides. It is conservative only when the L1 norm of a bucket
  of scaled gradients exceeds float32's max (3.4e38): that step is skipped and
  the scale backs off, the right response to gradients that large. Reading the
  *scaled* gradients lets XLA fuse the check without materialising the
  unscaled tree, and the buckets cut the kernels per leaf from about three (a
  per-leaf ``isfinite`` reduction) to about one.

  Args:
    grads: a pytree of floating arrays, the gradients of the scaled loss.
    scale: float32 scalar, the scale they were computed with.

  Returns:
    A bool scalar; ``True`` for a tree without leaves.
  """
  small, totals = [], []
  for g in jax.tree.leaves(grads):
    g = g.astype(unscaled_dtype(g.dtype))
    if g.size <= _CONCAT_LIMIT and g.dtype == np.dtype(np.float32):
      small.append(g.ravel())
    else:
      totals.append(jnp.sum(jnp.abs(g)).astype(jnp.float32))
  if small:
    totals.append(jnp.sum(jnp.abs(jnp.concatenate(small))))
  if not totals:
    return jnp.asarray(True)
  return jnp.isfinite(jnp.sum(jnp.stack(totals)) * (1 / scale))
