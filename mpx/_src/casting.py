"""Casting the floating leaves of a pytree, and nothing else: the one casting rule of mpx.

Every policy method, the Flax adapters' boundary casts and the linen parameter
rounding go through :func:`cast_tree`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import tree as tree_lib

T = TypeVar("T")


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
  if not tree_lib.is_floating_array(x) or x.dtype == dtype:
    return x
  if isinstance(x, jax.Array):
    return x.astype(dtype)
  # A host leaf rounds exactly as a device leaf does, and as silently: NumPy
  # would warn where a value overflows to inf, JAX never does.
  with np.errstate(over="ignore", invalid="ignore"):
    return x.astype(dtype)


def cast_tree(tree: T, dtype: dtypes_lib.DTypeLike) -> T:
  """Casts every floating array leaf of ``tree`` to ``dtype``, and nothing else.

  The rule, used by every :class:`mpx.Policy` method and by the Flax
  integrations' casts at policy boundaries:

  * JAX arrays (and tracers) with a floating dtype are cast with ``astype``;
    sharding is preserved, and a leaf that already has the target dtype is
    returned as is, so no ``convert`` op is emitted.
  * NumPy arrays and NumPy scalars with a floating dtype are cast with NumPy
    and stay on the host (a data loader's batch is not moved to a device); they
    round bit for bit as on the device, without NumPy's overflow warning.
  * Flax NNX objects (modules, ``nnx.Rngs``, ``nnx.Variable`` and its
    subclasses such as ``nnx.Param``) are returned unchanged, as opaque leaves,
    never copied: they are mutable and shared by reference, so a copy would
    receive the writes (RNG counts, batch statistics) meant for the caller's
    object. An ``nnx.State`` holds such ``Variable`` objects (for
    ``nnx.state(model)``, the model's own), so it comes back unchanged too; to
    change an NNX model's precision use :func:`mpx.nnx.apply_policy`, or cast
    ``state.to_pure_dict()``.
  * Everything else is returned unchanged: integer, boolean and complex arrays,
    typed PRNG keys (``jax.random.key``) and legacy ``uint32`` keys, ``None``,
    strings and other Python objects, and Python ``float`` scalars, which JAX
    treats as weakly typed (they take the dtype of the arrays they meet and
    never cause an upcast).

  Works inside ``jit``, ``grad``, ``vmap`` and ``scan``.

  Args:
    tree: any pytree.
    dtype: the target dtype, or a name such as ``"bf16"``.

  Returns:
    A tree with the same structure in which each floating array leaf has
    ``dtype``.

  Raises:
    PolicyError: if ``dtype`` is not a supported floating dtype.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> tree = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
    >>> jax.tree.map(lambda x: x.dtype, mpx.cast_tree(tree, "bf16"))
    {'step': dtype('int32'), 'w': dtype(bfloat16)}
  """
  target = dtypes_lib.parse_dtype(dtype)
  return jax.tree.map(lambda x: _cast_leaf(x, target), tree, is_leaf=tree_lib.is_nnx_object)
