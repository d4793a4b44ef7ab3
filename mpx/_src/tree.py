"""Small pytree utilities shared by every mpx module: leaf paths and checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpx._src import errors

PyTree = Any


def path_str(path: jax.tree_util.KeyPath) -> str:
  """Formats a key path the way mpx error messages show it.

  Args:
    path: a key path from ``jax.tree_util.tree_flatten_with_path``.

  Returns:
    The path joined with ``/``, e.g. ``params/Dense_0/kernel``; ``<root>`` for
    the empty path of a bare leaf.
  """
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def is_array(x: Any) -> bool:
  """Returns whether ``x`` is a JAX or NumPy array (tracers included)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_floating_array(x: Any) -> bool:
  """Returns whether ``x`` is an array with an inexact real dtype.

  Typed PRNG keys, integers, booleans and complex arrays are not floating.

  Args:
    x: any object.

  Returns:
    ``True`` for JAX/NumPy arrays of a floating dtype (float8 to float64).
  """
  return is_array(x) and np.issubdtype(x.dtype, np.floating)


def check_floating_leaves(
    tree: PyTree, *, what: str, allow: Callable[[Any], bool] | None = None
) -> None:
  """Raises if a leaf of ``tree`` is not a floating array.

  Args:
    tree: the tree to check, e.g. gradients.
    what: how the tree is called in the message, e.g. ``"gradients"``.
    allow: optional predicate for leaves that are accepted anyway.

  Raises:
    LeafTypeError: naming the first offending leaf's path, dtype and the fix.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_floating_array(leaf) or (allow is not None and allow(leaf)):
      continue
    kind = f"dtype {leaf.dtype}" if is_array(leaf) else f"type {type(leaf).__name__}"
    raise errors.LeafTypeError(
        f"{what} leaf {path_str(path)!r} has {kind}, but every leaf of the {what} "
        "must be a floating-point array. Differentiate only with respect to floating "
        "parameters (keep integer state such as step counters or batch statistics out of "
        "the differentiated tree), or set non-differentiable leaves to None."
    )


def check_same_structure(a: PyTree, b: PyTree, *, names: tuple[str, str]) -> None:
  """Raises if two trees do not have the same structure.

  Args:
    a: the first tree, e.g. gradients.
    b: the second tree, e.g. params.
    names: how the two trees are called in the message.

  Raises:
    TreeStructureError: naming the first path that is in one tree and not in
      the other.
  """
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  if sa == sb:
    return
  pa = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
  pb = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(b)[0]]
  for x, y in zip(pa, pb):
    if x != y:
      detail = f"the first difference is {x!r} in the {names[0]} against {y!r} in the {names[1]}"
      break
  else:
    longer, extra = (names[0], pa[len(pb)]) if len(pa) > len(pb) else (names[1], pb[len(pa)])
    detail = f"the {longer} have an extra leaf {extra!r}"
  raise errors.TreeStructureError(
      f"The {names[0]} and the {names[1]} must have the same tree structure, but {detail} "
      f"({len(pa)} against {len(pb)} leaves). Pass the {names[1]} the {names[0]} were "
      "computed from."
  )
