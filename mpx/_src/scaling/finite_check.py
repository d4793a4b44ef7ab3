"""The finite check of loss scaling: is every gradient still finite once unscaled?

The check maps each element of leaf ``i`` of ``n`` to an int32 *code*: ``i``
where ``g * (1 / scale)`` is not finite, ``n`` where it is. The minimum of all
codes is the first non-finite leaf, or ``n`` when there is none, and it is taken
in a few kernels for the whole tree, where a reduction per leaf costs a kernel
per leaf (about 2.7 µs of launch latency each on an H100):

* leaves of one dimension or none (biases, norm scales: most leaves, few bytes)
  are concatenated, up to :data:`GROUP` per reduction;
* larger leaves are grouped by shape, up to :data:`GROUP` per group: the
  elementwise minimum of the group's codes is reduced in the gradients' own
  layout, which the concatenation of a raveled leaf would not keep (XLA gives
  a convolution's weight gradient cuDNN's layout and would write a transposed
  copy of its codes), and with each gradient's last step fused in (the sum of
  a split-K GEMM's partial products, the slice of a merged GEMM), which XLA
  writes out rather than fuse into a concatenation. Each group is reduced to
  one value per row of the layout its gradient arrives in: down to the last
  axis for rank 4 or more (convolution kernels, in cuDNN's layout), along the
  last axis otherwise. XLA runs a row reduction in one kernel with the codes
  computed inside it, where it splits a reduction to a scalar in two and, on
  small leaves, writes the group's elementwise minimum out first;
* the groups' results join the concatenation, whose reductions are combined.

Two details keep the concatenations fused. XLA's algebraic simplifier rewrites
a reduction of a concatenation into one reduction per operand; a reshape after
a padding of at least one element hides the concatenation from that rule. And
XLA:GPU fuses the producers of about 45 operands into one reduction and writes
the others out, hence groups of :data:`GROUP`. On the H100 programs of the
benchmarks' GPT-2 small (196 leaves) and ResNet-50 (161 leaves), dynamic loss
scaling adds 0.15 and 0.21 kernels per leaf and 0.13% and 0.21% of the bytes
(modelled, no autotuning; ``benchmarks/loss_scale_chains.py``).

Under GSPMD (``jit`` over sharded gradients) a concatenation of sharded leaves
would be resharded, and a reduction per leaf is an all-reduce per leaf. The
check is therefore a ``custom_partitioning`` op: on one device it is the
computation above; partitioned, each device runs it on its own shards (their
shardings kept) and one scalar ``pmin`` over the mesh makes the code global.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from mpx._src import dtypes as dtypes_lib

#: Leaves per group, and operands per concatenation: XLA:GPU fuses the producers of 44
#: leaves into one reduction and writes some of them out at 46 (H100 program).
GROUP = 32
# The concatenations are padded to a multiple of this many elements, by at least one.
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

  The check before this one (one reduction per leaf): ``benchmarks/`` still
  measures it. The rows run along the last axis when it allows, so that a leaf
  sharded along any axis keeps its sharding through the reduction.

  Args:
    finite: a bool array, the elementwise ``isfinite`` of one gradient leaf.
    width: the row length.

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


def _leaf_codes(count: int, index: int, g: jax.Array, inv: jax.Array) -> jax.Array:
  """``index`` where ``g * inv`` (in float32, or float64) is not finite, ``count`` where it is."""
  wide = dtypes_lib.at_least_float32(g.dtype)
  finite = jnp.isfinite(g.astype(wide) * inv.astype(wide))
  return jnp.where(finite, np.int32(count), np.int32(index))


def _min_of_concatenation(pieces: Sequence[jax.Array], count: int) -> jax.Array:
  """The minimum of 1-D int32 arrays, concatenated in one fused reduction (see above)."""
  flat = jnp.concatenate(pieces)
  flat = jnp.pad(flat, (0, _ROW - flat.size % _ROW), constant_values=np.int32(count))
  return jnp.min(flat.reshape(-1, _ROW))


def _local_code(count: int, indices: tuple[int, ...], inv: jax.Array, *leaves: jax.Array):
  """The code of ``leaves`` (leaf ``indices`` of ``count``) as held here: see the module docstring."""
  pieces, by_shape = [], {}
  for i, g in zip(indices, leaves, strict=True):
    codes = _leaf_codes(count, i, g, inv)
    if g.ndim <= 1:
      pieces.append(codes.ravel())
    else:
      by_shape.setdefault(g.shape, []).append(codes)
  for shape, codes in by_shape.items():
    # Reduced along the minor axis of the layout the gradient arrives in: a row reduction.
    reduced = tuple(range(len(shape) - 1)) if len(shape) >= 4 else -1
    for start in range(0, len(codes), GROUP):
      least = functools.reduce(jnp.minimum, codes[start : start + GROUP])
      pieces.append(jnp.min(least, axis=reduced).reshape(-1))
  mins = [
    _min_of_concatenation(pieces[start : start + GROUP], count)
    for start in range(0, len(pieces), GROUP)
  ]
  return functools.reduce(jnp.minimum, mins)


def _evenly_split(sharding: Any, shape: tuple[int, ...], mesh: Any) -> NamedSharding:
  """``sharding`` without the splits of dimensions it would pad: padding is not data."""
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  kept = []
  for size, axes in zip(shape, spec, strict=True):
    names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    kept.append(axes if size % int(np.prod([mesh.shape[a] for a in names])) == 0 else None)
  return NamedSharding(mesh, PartitionSpec(*kept))


def _partition(count, indices, mesh, arg_shapes, result_shape):
  del result_shape
  shardings = tuple(_evenly_split(a.sharding, a.shape, mesh) for a in arg_shapes)
  used = {name for s in shardings for name in jax.tree.leaves(tuple(s.spec))}
  axes = tuple(a for a in mesh.axis_names if a in used)

  def lower_fn(inv, *leaves):
    code = _local_code(count, indices, inv, *leaves)
    # The one collective of the check: a scalar, over the axes some gradient is split along.
    return jax.lax.pmin(code, axes) if axes else code

  return mesh, lower_fn, NamedSharding(mesh, PartitionSpec()), shardings


def _infer_sharding(count, indices, mesh, arg_shapes, result_shape):
  del count, indices, arg_shapes, result_shape
  return NamedSharding(mesh, PartitionSpec())


def _sharding_rule(count, indices, mesh, operand_types, result_types):
  del count, indices, mesh, result_types
  # Every dimension of every operand is reduced away: the result is one scalar.
  dims = [[f"f{k}_{d}" for d in range(len(t.shape))] for k, t in enumerate(operand_types)]
  rule = ", ".join(" ".join(d) for d in dims) + " ->"
  return rule, {"reduction_factors": tuple(f for d in dims for f in d)}


_global_code = custom_partitioning(_local_code, static_argnums=(0, 1))
_global_code.def_partition(
  partition=_partition, infer_sharding_from_operands=_infer_sharding, sharding_rule=_sharding_rule
)


def _code(count: int, indices: tuple[int, ...], inv: jax.Array, leaves: Sequence[jax.Array]):
  """The global code; under ``vmap`` (which ``custom_partitioning`` has no rule for), per member."""

  @custom_batching.custom_vmap
  def code(inv, *leaves):
    return _global_code(count, indices, inv, *leaves)

  @code.def_vmap
  def _(axis_size, in_batched, inv, *leaves):
    del axis_size
    axes = [0 if batched else None for batched in in_batched]
    local = functools.partial(_local_code, count, indices)
    return jax.vmap(local, in_axes=axes)(inv, *leaves), True

  return code(inv, *jax.lax.stop_gradient(tuple(leaves)))


def finite_after_unscale(
  grads: Any, scale: jax.Array, *, axis_name: Any = None
) -> tuple[jax.Array, jax.Array]:
  """Whether every element of ``grads * (1 / scale)`` is finite, and which leaf first was not.

  Each leaf is unscaled (in float32, or float64) and tested with ``isfinite``
  inside one fused reduction per 32 leaves (see the module docstring); the
  unscaled tree is never materialised. Under ``jit`` over sharded gradients,
  each device reduces its own shards and one scalar all-reduce makes the
  result global.

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
  held = [(i, g) for i, g in enumerate(leaves) if g.size]
  if not held:  # no element, nothing that can be non-finite
    return jnp.asarray(True), jnp.asarray(-1, jnp.int32)
  indices, arrays = zip(*held, strict=True)
  code = _code(len(leaves), tuple(indices), 1 / scale, arrays)
  if axis_name is not None:
    code = jax.lax.pmin(code, axis_name)
  ok = code == len(leaves)
  return ok, jnp.where(ok, -1, code)
