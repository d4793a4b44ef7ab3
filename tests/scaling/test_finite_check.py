"""The finite check of loss scaling against NumPy, and its kernels on an H100 program.

``finite_after_unscale`` returns whether every unscaled gradient element is
finite and the index of the first leaf that is not; these tests pin both
against a NumPy reference for every way the check groups leaves (scalars and
vectors concatenated, larger leaves by shape, rank 4 down to the last axis,
more than 32 of a kind), under ``jit``, ``vmap`` and a mapped ``axis_name``;
and, where jax's CUDA plugin is installed, what the check adds to a program
compiled for an H100: at most a quarter of a kernel per leaf, no loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src.audit import targets
from mpx._src.scaling import finite_check

SCALE = 4.0


def _reference(leaves, scale=SCALE):
  for i, g in enumerate(leaves):
    unscaled = np.asarray(g, np.float32) * np.float32(1 / scale)
    if not np.isfinite(unscaled).all():
      return False, i
  return True, -1


def _leaves():
  # Vectors and a scalar (concatenated), an empty leaf, matrices grouped by shape (two of
  # (4, 64), one of them bfloat16), rank 4 reduced to its last axis (two of them).
  return [
    np.ones((4, 64), np.float32),
    np.ones((96, 33), np.float32),
    np.ones(70_001, np.float32),
    np.ones((), np.float32),
    np.ones(3, np.float16),
    np.ones((0, 5), np.float32),
    np.ones((4, 64), jnp.bfloat16),
    np.ones((3, 3, 4, 8), np.float16),
    np.ones(5, np.float32),
    np.ones((7, 3, 32), np.float32),
    np.ones((3, 3, 4, 8), np.float32),
  ]


def _check(leaves, jit):
  fn = jax.jit(finite_check.finite_after_unscale) if jit else finite_check.finite_after_unscale
  ok, leaf = fn([jnp.asarray(x) for x in leaves], jnp.float32(SCALE))
  assert ok.dtype == jnp.bool_ and leaf.dtype == jnp.int32
  return bool(ok), int(leaf)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_all_finite(jit):
  assert _check(_leaves(), jit) == (True, -1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_non_finite_element_in_each_leaf(jit, bad):
  for i, x in enumerate(_leaves()):
    if not x.size:
      continue
    for pos in {0, x.size // 2, x.size - 1}:
      leaves = _leaves()
      flat = leaves[i].reshape(-1).copy()
      flat[pos] = bad
      leaves[i] = flat.reshape(x.shape)
      assert _check(leaves, jit) == _reference(leaves) == (False, i), (i, pos)


def test_inf_in_the_third_leaf_and_a_later_one():
  leaves = _leaves()
  leaves[2] = leaves[2].copy()
  leaves[2][-1] = np.inf
  leaves[8] = np.full(5, np.nan, np.float32)
  leaves[10] = np.full((3, 3, 4, 8), np.inf, np.float32)
  assert _check(leaves, True) == _reference(leaves) == (False, 2)


def test_finite_gradient_that_overflows_once_unscaled():
  big = np.float32(np.finfo(np.float32).max)
  leaves = [np.ones(3, np.float32), np.array([big], np.float32)]
  ok, leaf = finite_check.finite_after_unscale(leaves, jnp.float32(0.5))  # * 2 overflows
  assert (bool(ok), int(leaf)) == (False, 1)


def test_empty_tree_and_tree_without_elements():
  for tree in ({}, [np.ones((0,), np.float32)]):
    ok, leaf = finite_check.finite_after_unscale(tree, jnp.float32(SCALE))
    assert (bool(ok), int(leaf)) == (True, -1)


def test_random_trees_against_numpy():
  # Shapes from a small pool, so that groups form; up to 80 leaves, past a group of 32.
  rng = np.random.default_rng(0)
  pool = [(), (5,), (0,), (40,), (3, 7), (2, 0), (2, 3, 4), (2, 2, 3, 5), (1, 1, 2, 3)]
  for n in (1, 9, 80):
    leaves = [
      rng.standard_normal(pool[k]).astype(np.float32) for k in rng.integers(0, len(pool), n)
    ]
    for x in leaves:
      if x.size and rng.random() < 0.1:
        x.reshape(-1)[rng.integers(x.size)] = rng.choice([np.inf, -np.inf, np.nan])
    assert _check(leaves, True) == _reference(leaves)
    for i in reversed(range(n)):  # the last bad leaf alone, then none
      if leaves[i].size:
        leaves[i] = np.zeros_like(leaves[i])
      assert _check(leaves, True) == _reference(leaves)


def test_vmap_without_and_with_axis_name():
  tree = {"a": jnp.ones((3, 40)).at[1, 5].set(jnp.nan), "b": jnp.ones((3,)).at[2].set(jnp.inf)}
  ok, leaf = jax.jit(jax.vmap(lambda t: finite_check.finite_after_unscale(t, jnp.float32(2.0))))(
    tree
  )
  assert ok.tolist() == [True, False, False] and leaf.tolist() == [-1, 0, 1]
  ok, leaf = jax.vmap(
    lambda t: finite_check.finite_after_unscale(t, jnp.float32(2.0), axis_name="i"), axis_name="i"
  )(tree)
  assert ok.tolist() == [False] * 3 and leaf.tolist() == [0] * 3  # global: the smallest index


# ------------------------------------------------------------ the H100 program


def _kernels(loss_scale):
  # A GPT block's kinds of leaves and a convolution kernel, 24 times over: 96 leaves.
  shapes = {"kernel": (64, 96), "bias": (96,), "scale": (96,), "conv": (3, 3, 16, 32)}
  params = {
    f"{name}{i}": jax.ShapeDtypeStruct(shape, jnp.float32)
    for i in range(24)
    for name, shape in shapes.items()
  }
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16", loss_scale=loss_scale)

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates), opt_state

  state = jax.eval_shape(tx.init, params)
  grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float16), params)
  report = mpx.audit(jax.jit(step, donate_argnums=(0, 1)), params, state, grads, target="h100")
  grad_bytes = sum(g.size * g.dtype.itemsize for g in jax.tree.leaves(grads))
  # What the check may read and write: each gradient once, and the int32 minimum of the
  # codes of each group of same-shaped matrices (if XLA writes it out) twice.
  group_bytes = 2 * 4 * sum(np.prod(s) for s in shapes.values() if len(s) > 1)
  return report, len(params), grad_bytes + group_bytes


@pytest.mark.skipif(
  not targets.plugin_available(), reason="jax's CUDA plugin (the gpu-target extra) is not installed"
)
@pytest.mark.filterwarnings("ignore::mpx.PrecisionWarning")
def test_h100_program_adds_a_quarter_kernel_per_leaf_and_no_loop():
  base, leaves, _ = _kernels(None)
  report, _, check_bytes = _kernels("dynamic")
  # The check, the skip and the scale's bookkeeping together: at most 24 kernels for 96
  # leaves (a reduction per leaf, the check before this one, added 96 and more).
  assert report.kernel_count - base.kernel_count <= leaves / 4, (base, report)
  assert report.bytes_moved - base.bytes_moved <= check_bytes + 4096
  # The leaf index is a minimum: no while loop (jnp.searchsorted's) in the program.
  assert not [k for k in report.kernels if "while" in k["op_name"]]
