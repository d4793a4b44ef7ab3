"""Small pytree utilities shared by every mpx module: leaf paths, checks, state placement."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpx._src import dtypes, errors

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


def is_nnx_object(x: Any) -> bool:
  """Returns whether ``x`` is a Flax NNX graph object (module, ``Variable``, ``Rngs``...).

  Such objects are mutable and shared by reference: a pytree copy of one (what
  ``jax.tree.map`` makes) is a different object, and state written to the copy
  (batch statistics, RNG counts) never reaches the user's. Flax is not
  imported here: if ``flax.nnx`` has not been imported, no NNX object exists.

  Args:
    x: any object.

  Returns:
    ``True`` for objects that ``flax.nnx.graph.is_graph_node`` accepts.
  """
  graph = sys.modules.get("flax.nnx.graph")
  return graph is not None and bool(graph.is_graph_node(x))


def is_floating_array(x: Any) -> bool:
  """Returns whether ``x`` is an array with an inexact real dtype.

  Typed PRNG keys, integers, booleans and complex arrays are not floating.

  Args:
    x: any object.

  Returns:
    ``True`` for JAX/NumPy arrays of a floating dtype (float8 to float64).
  """
  return is_array(x) and dtypes.is_floating(x.dtype)


def param_like(params: PyTree) -> Callable[[Any], bool]:
  """The predicate that finds the param-shaped parts of an optimizer state.

  A node is param-shaped when it has the params' structure (a master copy,
  a moment, a Kahan buffer), or has it down to the params' positions with,
  at each, ``None`` (the masters of params that need none) or one small
  container of arrays (a quantised moment's codes and scales), the first of
  which has its param's shape. With a single array as params, every array is.

  Args:
    params: the params, as arrays or ``jax.ShapeDtypeStruct``.

  Returns:
    ``is_param_like(node)``, for the ``is_leaf`` of a ``jax.tree.map`` over a state.
  """
  structure = jax.tree.structure(params)
  shapes = [tuple(p.shape) for p in jax.tree.leaves(params)]

  def is_param_like(node: Any) -> bool:
    if structure.num_nodes == 1:  # the params are one array
      return is_array(node) or isinstance(node, jax.ShapeDtypeStruct)
    if jax.tree.structure(node) == structure:
      return True
    try:
      parts = structure.flatten_up_to(node)
    except (ValueError, TypeError):
      return False
    for part, shape in zip(parts, shapes, strict=True):
      if part is None:  # this param has no part here (a float32 param has no master)
        continue
      children = jax.tree.leaves(part)
      nodes = jax.tree.structure(part).num_nodes
      if nodes not in (1, len(children) + 1):
        return False  # nested containers: a whole sub-state, not one param's part
      if not children or getattr(children[0], "shape", None) != shape:
        return False
    return True

  return is_param_like


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """A sharding that replicates an array over the devices of ``sharding``."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  if len(sharding.device_set) == 1:
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
  devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
  mesh = jax.sharding.Mesh(devices, ("devices",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _like_param(param: Any, x: Any) -> jax.sharding.Sharding:
  """The sharding of a leaf ``x`` of ``param``'s part of a state.

  A leaf of the param's shape takes its sharding; a smaller one (a quantised
  moment's per-block scales) keeps the param's mesh axes on its leading axes
  of the param's size and is replicated elsewhere.
  """
  sharding = param.sharding
  if tuple(x.shape) == tuple(param.shape):
    return sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return _replicated(sharding)
  spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
  axes = [
    spec[i] if i < param.ndim and x.shape[i] == param.shape[i] else None
    for i in range(len(x.shape))
  ]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*axes))


def shardings_like_params(state: PyTree, params: PyTree) -> PyTree:
  """Where each leaf of an optimizer state lives: its param-shaped parts like their params.

  The one placement rule of mpx, behind ``mpx.parallel.state_shardings`` and
  :func:`place_state`. Every leaf of a param-shaped part (:func:`param_like`)
  follows its param (:func:`_like_param`); every other leaf (counts, the loss
  scale and its counters, schedule state) is replicated on the devices of the
  first param, so every device takes the same skip decision.

  Args:
    state: the optimizer state, as arrays or ``jax.ShapeDtypeStruct``.
    params: the params it was built for, each with a ``sharding``.

  Returns:
    A tree of ``jax.sharding.Sharding`` with the structure of ``state``.
  """
  flat, structure = jax.tree.flatten(params)
  replicated = _replicated(flat[0].sharding)
  is_param_like = param_like(params)

  def place(node: Any) -> Any:
    if not is_param_like(node):
      return jax.tree.map(lambda _: replicated, node)
    parts = structure.flatten_up_to(node) if structure.num_nodes > 1 else [node]
    placed = [
      jax.tree.map(lambda x, p=p: _like_param(p, x), part)
      for p, part in zip(flat, parts, strict=True)
    ]
    return jax.tree.unflatten(structure, placed) if structure.num_nodes > 1 else placed[0]

  return jax.tree.map(place, state, is_leaf=is_param_like)


def place_state(state: PyTree, params: PyTree) -> PyTree:
  """Places a freshly built optimizer state where a jitted train step will return it.

  ``jit`` keys its executables on whether each argument is committed to a
  device: outputs always are, arrays made eagerly by ``jnp.zeros`` are not. A
  state with committed and uncommitted leaves side by side (moments placed
  on their params' shardings, counters not) therefore compiles the step
  once for ``init``'s state and again for the state ``update`` returned. The
  placement follows the params:

  * uncommitted params (``model.init`` outside ``jit``): nothing is placed,
    and every leaf stays uncommitted like them;
  * committed params: every array leaf is put where
    :func:`shardings_like_params` says (the rule ``mpx.parallel.state_shardings``
    gives for ``jit``): the param-shaped parts on their params' shardings,
    the rest replicated on the params' devices, as the step's outputs will be.

  Under ``jit`` or ``eval_shape`` (traced params) the state is returned as it
  is: the caller's ``out_shardings`` place it.

  Args:
    state: the state built by a transformation's ``init``.
    params: the params it was built for (masters, for an inner state).

  Returns:
    ``state`` with the placement described above.
  """
  leaves = jax.tree.leaves(params)
  tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  if not arrays or len(arrays) < len(leaves) or any(isinstance(p, tracer) for p in arrays):
    return state
  if not any(p.committed for p in arrays):
    return state
  shardings = shardings_like_params(state, params)

  def place(s: Any, sharding: Any) -> Any:
    if not isinstance(s, jax.Array) or isinstance(s, tracer):
      return s
    return s if s.committed and s.sharding == sharding else jax.device_put(s, sharding)

  return jax.tree.map(place, state, shardings)


def find_nodes(tree: PyTree, cls: type) -> list[tuple[str, Any]]:
  """Returns every node of type ``cls`` in ``tree``, nested ones included.

  Used to find a transformation's state (e.g. ``mpx.LossScaleState``) inside an
  optimizer state of any nesting: ``optax.chain`` tuples, ``named_chain``
  dicts, ``MultiSteps``, ``inject_hyperparams``...

  Args:
    tree: any pytree.
    cls: the node type, e.g. a ``NamedTuple`` state class.

  Returns:
    ``(path, node)`` pairs in flattening order, outer nodes before the nodes
    they contain; paths are formatted as by :func:`path_str`.
  """
  found: list[tuple[str, Any]] = []

  def visit(node: Any, prefix: str, skip: Any) -> None:
    def is_match(x: Any) -> bool:
      return x is not skip and isinstance(x, cls)

    for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_match)[0]:
      if is_match(leaf):
        where = "/".join(
          p for p in (prefix, jax.tree_util.keystr(path, simple=True, separator="/")) if p
        )
        found.append((where or "<root>", leaf))
        visit(leaf, where, leaf)

  visit(tree, "", None)
  return found


def check_floating_leaves(tree: PyTree, *, what: str) -> None:
  """Raises if a leaf of ``tree`` is not a floating array.

  Args:
    tree: the tree to check, e.g. gradients.
    what: how the tree is called in the message, e.g. ``"gradients"``.

  Raises:
    LeafTypeError: naming the first offending leaf's path, dtype and the fix.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_floating_array(leaf):
      continue
    kind = f"dtype {leaf.dtype}" if is_array(leaf) else f"type {type(leaf).__name__}"
    raise errors.LeafTypeError(
      f"{what} leaf {path_str(path)!r} has {kind}, but every leaf of the {what} "
      "must be a floating-point array. Keep non-floating state (step counters, integer "
      "buffers, RNG keys) out of the tree you differentiate and pass to tx.init and "
      "tx.update: hold it in a separate argument or Flax collection, e.g. "
      "model.apply({'params': params, 'counters': counters}, x), so that the params, their "
      "gradients and the optimizer state hold floating leaves only."
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
  # Compare path sets, not positions: a leaf missing early in one tree would
  # otherwise shift every later pair and blame a leaf that is present in both.
  set_a, set_b = set(pa), set(pb)
  only_a = [p for p in pa if p not in set_b]
  only_b = [p for p in pb if p not in set_a]
  a_name, b_name = names
  if only_a and only_b:
    detail = (
      f"{only_a[0]!r} is in the {a_name} but not in the {b_name}, and {only_b[0]!r} is in "
      f"the {b_name} but not in the {a_name}"
    )
  elif only_a:
    detail = f"{only_a[0]!r} is in the {a_name} but not in the {b_name}"
  elif only_b:
    detail = f"{only_b[0]!r} is in the {b_name} but not in the {a_name}"
  else:
    # Same leaf paths, different nodes: a list against a tuple, or a None in one tree.
    detail = f"the leaf paths agree and the containers differ: {sa} against {sb}"
  raise errors.TreeStructureError(
    f"The {names[0]} and the {names[1]} must have the same tree structure, but {detail} "
    f"({len(pa)} against {len(pb)} leaves). Pass the {names[1]} the {names[0]} were "
    "computed from."
  )


def check_same_shapes(a: PyTree, b: PyTree, *, names: tuple[str, str]) -> None:
  """Raises if two trees differ in structure or in the shape of a leaf.

  Reads shapes only, so it runs at trace time and costs nothing in the step.

  Args:
    a: the first tree, e.g. gradients.
    b: the second tree, e.g. params.
    names: how the two trees are called in the message.

  Raises:
    TreeStructureError: as :func:`check_same_structure`, or naming the first
      leaf path whose shapes differ, with both shapes.
  """
  check_same_structure(a, b, names=names)
  leaves_b = jax.tree.leaves(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], leaves_b, strict=True):
    shape_x, shape_y = getattr(x, "shape", None), getattr(y, "shape", None)
    if shape_x is None or shape_y is None or tuple(shape_x) == tuple(shape_y):
      continue
    raise errors.TreeStructureError(
      f"{names[0]} leaf {path_str(path)!r} has shape {tuple(shape_x)}, but the {names[1]} leaf "
      f"{path_str(path)!r} has shape {tuple(shape_y)}; each leaf of the {names[0]} must have "
      f"the shape of its leaf in the {names[1]}. Pass the {names[1]} the {names[0]} were "
      "computed from."
    )


RESTORE_ADVICE = (
  "A checkpoint restored without a target comes back as dicts and lists, which lose the state "
  "types: restore with a target built by tx.init, e.g. "
  "ckpt.restore(path, target=jax.eval_shape(tx.init, params)) (orbax's target=/item= argument)."
)


def check_state_type(state: Any, cls: type, owner: str) -> None:
  """Raises unless ``state`` is a ``cls``, the state ``owner``'s ``init`` builds.

  Args:
    state: what ``update`` was given.
    cls: the state class, e.g. :class:`LossScaleState`.
    owner: the transformation's name, for the message.

  Raises:
    StateError: saying what was given instead, and how to get the right state.
  """
  if isinstance(state, cls):
    return
  fields = set(getattr(cls, "_fields", ()))
  if isinstance(state, dict) and fields and fields <= set(state):
    cause = f"a dict with the fields of {cls.__name__}. {RESTORE_ADVICE}"
  else:
    cause = (
      f"a {type(state).__name__}, which its init did not make (the state of another "
      "optimizer, or one part of a chain's state). Pass the state that this transformation's "
      "init or update returned, the whole of it."
    )
  raise errors.StateError(f"The update of {owner} needs its {cls.__name__}, but got {cause}")
