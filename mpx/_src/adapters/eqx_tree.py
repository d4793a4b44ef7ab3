"""Walking and casting an Equinox model: paths, sub-modules, and the casts of mpx's wrappers.

Shared by the Equinox adapter (``mpx._src.adapters.eqx``) and its diagnostics
taps (``mpx._src.diagnostics.eqx_taps``). A module's path is the attribute
names and indices from the model down (``layers/3/attention/query_proj``), as
keep rules match them; mpx's own wrapper fields
(``mpx._src.tree.WRAPPER_FIELDS``) are left out of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax

from mpx._src import casting
from mpx._src import tree as tree_lib
from mpx._src.adapters import eqx_fp8

# What a wrapper's casts never touch: the model's state, other wrappers' layers, histories.
OPAQUE: tuple[type, ...] = (eqx.nn.State, eqx.nn.StateIndex, eqx_fp8.Fp8History)


def _cast(tree: Any, dtype: Any, opaque: Any) -> Any:
  return jax.tree.map(
    lambda x: x if opaque(x) else casting.cast_tree(x, dtype), tree, is_leaf=opaque
  )


def cast_data(tree: Any, dtype: Any) -> Any:
  """Casts the floating arrays of a call's arguments or results; states and modules pass as they are.

  Args:
    tree: the arguments (or the results) of a layer's call.
    dtype: the target dtype.

  Returns:
    ``tree`` with its floating arrays cast; ``eqx.nn.State`` objects and
    modules passed as arguments are returned unchanged.
  """
  return _cast(tree, dtype, lambda x: isinstance(x, (eqx.nn.State, eqx.Module)))


def cast_params(layer: Any, dtype: Any) -> Any:
  """Casts the floating arrays below a wrapper, down to the wrappers that cast their own.

  Args:
    layer: a wrapper's layer.
    dtype: the wrapper's compute dtype.

  Returns:
    ``layer`` with its floating arrays cast, except those of states,
    histories and nested wrappers with a boundary of their own (a layer kept
    in another precision casts its params itself, from the stored ones).
  """

  def opaque(x: Any) -> bool:
    # A wrapper (or a diagnostics tap around one) with a boundary casts its own params.
    boundary = isinstance(x, eqx.Module) and getattr(x, "mpx_boundary", None) is not None
    return boundary or isinstance(x, OPAQUE)

  return _cast(layer, dtype, opaque)


def path_parts(key_path: Any) -> tuple[Any, ...]:
  """The attribute names and indices of a JAX key path, without the wrappers' own fields.

  Args:
    key_path: a key path from ``jax.tree_util.tree_flatten_with_path``.

  Returns:
    Its parts, e.g. ``("layers", 3, "attention")``.
  """
  parts = []
  for key in key_path:
    part = getattr(key, "name", getattr(key, "idx", getattr(key, "key", key)))
    if part not in tree_lib.WRAPPER_FIELDS:
      parts.append(part)
  return tuple(parts)


def children(module: Any) -> list[tuple[Any, Any]]:
  """``(key path, value)`` of a module's leaves, its sub-modules taken whole.

  Args:
    module: an Equinox module.

  Returns:
    The pairs, in flattening order.
  """

  def is_child(x: Any) -> bool:
    return x is not module and isinstance(x, eqx.Module)

  return jax.tree_util.tree_flatten_with_path(module, is_leaf=is_child)[0]


def iter_modules(model: Any) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
  """Every module of a model with its path and parent, parents first.

  Args:
    model: an Equinox module.

  Yields:
    ``(path parts, module, parent module)``; the parent of ``model`` is ``None``.
  """
  stack: list[tuple[tuple[Any, ...], Any, Any]] = [((), model, None)]
  while stack:
    path, module, parent = stack.pop()
    yield path, module, parent
    nested = [
      (path + path_parts(kp), child, module)
      for kp, child in children(module)
      if isinstance(child, eqx.Module) and not isinstance(child, OPAQUE)
    ]
    stack.extend(reversed(nested))
