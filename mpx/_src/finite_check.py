"""The finite check of loss scaling: is every gradient still finite once unscaled?

The check reads the *scaled* gradients in a few bucketed reductions, so that
XLA fuses it without materialising the unscaled tree; ``docs/benchmarks.md``
measures it against the per-leaf ``isfinite`` of jmp and flax.
"""

from __future__ import annotations

import functools
import math
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


def _concatenated(leaf: Any) -> bool:
  """Whether a gradient leaf is checked in the shared bucket of small float32 leaves."""
  return (
    math.prod(leaf.shape) <= _CONCAT_LIMIT and unscaled_dtype(np.dtype(leaf.dtype)) == np.float32
  )


def buckets(grads: Any) -> tuple[tuple[int, ...], ...]:
  """The buckets of :func:`finite_after_unscale`, as indices into ``jax.tree.leaves(grads)``.

  Reads shapes and dtypes only, so any tree with the gradients' structure,
  shapes and floating dtypes (the params) gives the same buckets.

  Args:
    grads: the gradients, or a tree shaped like them.

  Returns:
    One tuple of leaf indices per bucket, in the order of the check: each leaf
    larger than 2**16 elements (or float64) alone, then every smaller leaf
    together.
  """
  leaves = jax.tree.leaves(grads)
  small = tuple(i for i, g in enumerate(leaves) if _concatenated(g))
  large = [(i,) for i, g in enumerate(leaves) if not _concatenated(g)]
  return (*large, small) if small else tuple(large)


def finite_after_unscale(
  grads: Any, scale: jax.Array, *, axis_name: Any = None
) -> tuple[jax.Array, jax.Array]:
  """Whether every element of ``grads * (1 / scale)`` is finite, and where it first was not.

  ``sum(|g|) * (1 / scale)`` is finite exactly when no element is inf or NaN
  and no unscaled ``|g_i| * (1 / scale)`` overflows (``|g_i| <= sum(|g|)``),
  so one scalar decides. It is conservative only when the L1 norm of the
  scaled gradients exceeds float32's max (3.4e38): that step is skipped and
  the scale backs off, the right response to gradients that large. Reading the
  *scaled* gradients lets XLA fuse the check without materialising the
  unscaled tree, and the buckets (:func:`buckets`) cut the kernels per leaf
  from about three (a per-leaf ``isfinite`` reduction) to about one.

  The L1 norms of the buckets are summed as a running total, whose first
  non-finite entry names the bucket that broke the step: the attribution
  costs a cumulative sum over a vector of a few dozen entries, no kernel per
  leaf.

  Args:
    grads: a pytree of floating arrays, the gradients of the scaled loss.
    scale: float32 scalar, the scale they were computed with.
    axis_name: the mapped axis over which the decision is made global, or
      ``None``.

  Returns:
    ``(ok, bucket)``: a bool scalar, ``True`` for a tree without leaves; and an
    int32 scalar, the index (into :func:`buckets`) of the first bucket whose
    running L1 norm was not finite, ``-1`` when ``ok``. Under ``axis_name``
    both are global: the step is skipped everywhere, and the bucket is the
    smallest index any member saw.
  """
  leaves = jax.tree.leaves(grads)
  plan = buckets(grads)
  totals = []
  for bucket in plan:
    parts = [leaves[i].astype(unscaled_dtype(np.dtype(leaves[i].dtype))) for i in bucket]
    # A leaf alone keeps its shape: raveling a column-sharded gradient would gather it.
    x = parts[0] if len(parts) == 1 else jnp.concatenate([p.ravel() for p in parts])
    totals.append(jnp.sum(jnp.abs(x)).astype(jnp.float32))
  if not totals:
    return jnp.asarray(True), jnp.asarray(-1, jnp.int32)
  finite = jnp.isfinite(jnp.cumsum(jnp.stack(totals)) * (1 / scale))
  # The code of a finite step is len(plan): one pmin makes both results global.
  code = jnp.where(finite[-1], len(plan), jnp.argmin(finite)).astype(jnp.int32)
  if axis_name is not None:
    code = jax.lax.pmin(code, axis_name)
  ok = code == len(plan)
  return ok, jnp.where(ok, -1, code)
