"""The finite check of loss scaling: is every gradient still finite once unscaled?

Each leaf is reduced in rows of 32 elements, fused with the unscaling and the
``isfinite`` test, and the rows' flags of all leaves are reduced together once.
``docs/benchmarks.md`` measures it against the per-leaf ``isfinite`` of jmp
and flax, and shows in the HLO why the rows are 32 long.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import dtypes as dtypes_lib

# The longest row XLA:CPU reduces in one kernel fused with its producer: a
# longer reduction is split into a reduce-window and a reduce, which
# materialises the producer's flags (docs/benchmarks.md, "Loss-scaling
# overhead"). On other backends 32 is as good as any small width.
_ROW = 32


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


def row_flags(finite: jax.Array, width: int = _ROW) -> jax.Array:
  """Reduces a leaf's elementwise flags to one flag per row of at most ``width`` elements, raveled.

  The rows run along the last axis when it allows, so that a leaf sharded
  along any axis keeps its sharding through the reduction.

  Args:
    finite: a bool array, the elementwise ``isfinite`` of one gradient leaf.
    width: the row length (32 in the check; other widths for the benchmark).

  Returns:
    A 1-D bool array: ``all`` over each row, in row-major order.
  """
  shape = finite.shape
  if not shape:
    return finite.reshape(1)
  if shape[-1] % width == 0:
    rows = finite.reshape(*shape[:-1], shape[-1] // width, width)
  elif shape[-1] <= width:
    rows = finite
  elif finite.size % width == 0:
    rows = finite.reshape(-1, width)
  else:  # a reduction XLA may split: correct, one or two kernels more for this leaf
    return jnp.all(finite).reshape(1)
  return jnp.all(rows, axis=-1).ravel()


def finite_after_unscale(
  grads: Any, scale: jax.Array, *, axis_name: Any = None
) -> tuple[jax.Array, jax.Array]:
  """Whether every element of ``grads * (1 / scale)`` is finite, and which leaf first was not.

  Each leaf is unscaled (in float32, or float64) and tested with ``isfinite``
  in rows of 32 elements, one kernel per leaf on XLA:CPU; the rows' flags of
  all leaves (1/32 of a byte per gradient element) are concatenated behind an
  optimization barrier, so that XLA reduces them once instead of splitting the
  reduction back into one per leaf. The unscaled tree is never materialised.

  Args:
    grads: a pytree of floating arrays, the gradients of the scaled loss.
    scale: float32 scalar, the scale they were computed with.
    axis_name: the mapped axis over which the decision is made global, or
      ``None``.

  Returns:
    ``(ok, leaf)``: a bool scalar, ``True`` for a tree without elements; and an
    int32 scalar, the index (into ``jax.tree.leaves(grads)``) of the first
    leaf with a non-finite unscaled element, ``-1`` when ``ok``. Under
    ``axis_name`` both are global: the step is skipped everywhere, and the
    leaf is the smallest index any member saw.
  """
  leaves = jax.tree.leaves(grads)
  if not any(g.size for g in leaves):  # no element, nothing that can be non-finite
    return jnp.asarray(True), jnp.asarray(-1, jnp.int32)
  inv = 1 / scale
  rows = []
  for g in leaves:
    wide = dtypes_lib.at_least_float32(g.dtype)
    rows.append(row_flags(jnp.isfinite(g.astype(wide) * inv.astype(wide))))
  ends = np.cumsum([r.size for r in rows])
  flags = jax.lax.optimization_barrier(jnp.concatenate(rows))
  first = jnp.argmin(flags)  # the first False; 0 when every flag is True
  ok = flags[first]
  # The code of a finite step is len(leaves): one pmin makes both results global.
  # The leaf of the first False flag: how many leaves end at or before it (a vector compare,
  # where jnp.searchsorted is a while loop of a few kernels per iteration on XLA:GPU).
  leaf = jnp.sum(jnp.asarray(ends, jnp.int32) <= first.astype(jnp.int32), dtype=jnp.int32)
  code = jnp.where(ok, len(leaves), leaf).astype(jnp.int32)
  if axis_name is not None:
    code = jax.lax.pmin(code, axis_name)
  ok = code == len(leaves)
  return ok, jnp.where(ok, -1, code)
