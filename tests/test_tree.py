"""Tests for the tree utilities: leaf paths, leaf predicates and the two tree checks."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpx._src import errors
from mpx._src import tree as tree_lib


class Adam(NamedTuple):
  mu: object
  nu: object


def _paths(tree):
  return [tree_lib.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_path_str_joins_keys_with_slashes():
  tree = {
    "params": {"Dense_0": {"kernel": 1, "bias": 2}},
    "layers": [3, (4, 5)],
    "opt": Adam(mu=6, nu=7),
  }
  assert _paths(tree) == [
    "layers/0",
    "layers/1/0",
    "layers/1/1",
    "opt/mu",
    "opt/nu",
    "params/Dense_0/bias",
    "params/Dense_0/kernel",
  ]


def test_path_str_of_a_bare_leaf_is_root():
  assert _paths(jnp.ones(2)) == ["<root>"]


@pytest.mark.parametrize(
  ("leaf", "is_array", "is_floating"),
  [
    (jnp.ones(2, jnp.float32), True, True),
    (jnp.ones(2, jnp.bfloat16), True, True),
    (jnp.ones(2, jnp.float16), True, True),
    (np.ones(2, np.float64), True, True),
    (np.ones(2, ml_dtypes.bfloat16), True, True),
    (np.ones(2, ml_dtypes.float8_e4m3fn), True, True),
    (np.float32(1.0), True, True),
    (jnp.ones(2, jnp.int32), True, False),
    (np.ones(2, np.uint8), True, False),
    (jnp.ones(2, bool), True, False),
    (jnp.ones(2, jnp.complex64), True, False),
    (jax.random.key(0), True, False),
    (jax.random.PRNGKey(0), True, False),
    (np.zeros(2, jax.dtypes.float0), True, False),
    (1.0, False, False),
    (1, False, False),
    ("kernel", False, False),
    (None, False, False),
  ],
  ids=lambda v: type(v).__name__ if not hasattr(v, "dtype") else str(v.dtype),
)
def test_leaf_predicates(leaf, is_array, is_floating):
  assert tree_lib.is_array(leaf) is is_array
  assert tree_lib.is_floating_array(leaf) is is_floating


def test_floating_leaves_check_is_traceable():
  seen = []

  @jax.jit
  def f(x, i):
    seen.append(tree_lib.is_floating_array(x))
    seen.append(tree_lib.is_floating_array(i))
    return x

  f(jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.int32))
  assert seen == [True, False]


def test_check_floating_leaves_accepts_floating_trees():
  grads = {
    "params": {"Dense_0": {"kernel": jnp.ones((2, 2), jnp.bfloat16), "bias": np.zeros(2)}},
    "frozen": None,  # None subtrees are not leaves: they are how frozen params are written
  }
  tree_lib.check_floating_leaves(grads, what="gradients")
  tree_lib.check_floating_leaves({}, what="gradients")


def test_check_floating_leaves_names_the_first_bad_leaf_in_tree_order():
  tree = {"b": {"x": "s"}, "a": [jnp.ones(1), jnp.ones(1, jnp.int8)]}
  with pytest.raises(errors.LeafTypeError, match="grads leaf 'a/1' has dtype int8"):
    tree_lib.check_floating_leaves(tree, what="grads")


@pytest.mark.parametrize(
  "tree",
  [
    {"params": {"Dense_0": {"kernel": jnp.ones(2)}}},
    [jnp.ones(1), (None, jnp.ones(2))],
    Adam(mu={"w": jnp.ones(1)}, nu={"w": jnp.ones(1)}),
    jnp.ones(3),
  ],
)
def test_check_same_structure_accepts_equal_structures(tree):
  # Leaf values and dtypes are free; only the structure must agree.
  other = jax.tree.map(lambda x: x.astype(jnp.bfloat16) * 0, tree)
  tree_lib.check_same_structure(tree, other, names=("gradients", "params"))


def test_check_same_structure_uses_the_given_names():
  with pytest.raises(errors.TreeStructureError) as info:
    tree_lib.check_same_structure(
      {"mu": jnp.ones(1)}, {"nu": jnp.ones(1)}, names=("updates", "master params")
    )
  message = str(info.value)
  assert "'mu' is in the updates but not in the master params" in message
  assert "'nu' is in the master params but not in the updates" in message
  assert "Pass the master params the updates were computed from." in message


class _Wrapper(NamedTuple):
  value: object
  inner_state: object


def test_find_nodes_finds_nested_nodes_with_their_paths():
  inner = _Wrapper(1.0, ())
  outer = _Wrapper(2.0, {"opt": (inner,)})
  tree = ({"a": jnp.ones(2)}, outer)
  found = tree_lib.find_nodes(tree, _Wrapper)
  assert [path for path, _ in found] == ["1", "1/inner_state/opt/0"]
  assert found[0][1] is outer and found[1][1] is inner
  assert tree_lib.find_nodes({"a": jnp.ones(2)}, _Wrapper) == []
  assert [p for p, _ in tree_lib.find_nodes(inner, _Wrapper)] == ["<root>"]


def test_check_same_shapes_reads_shapes_only():
  params = {"w": jnp.ones((2, 3)), "frozen": None, "lr": 0.1}
  tree_lib.check_same_shapes(
    {"w": jnp.zeros((2, 3), jnp.float16), "frozen": None, "lr": 0.5}, params, names=("a", "b")
  )
  abstract = jax.eval_shape(lambda: {"w": jnp.zeros((3, 2)), "frozen": None, "lr": 0.0})
  with pytest.raises(errors.TreeStructureError, match=r"a leaf 'w' has shape \(3, 2\), but the b"):
    tree_lib.check_same_shapes(abstract, params, names=("a", "b"))
