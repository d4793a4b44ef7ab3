"""The finite check of loss scaling against NumPy, and its kernels on an H100 program.

``finite_after_unscale`` returns whether every unscaled gradient element is
finite and the index of the first leaf that is not; these tests pin both
against a NumPy reference for every way a leaf is cut into rows of 32, under
``jit``, ``vmap`` and a mapped ``axis_name``; and, where jax's CUDA plugin is
installed, what the check adds to a program compiled for an H100: one
reduction per leaf and a fixed few, no loop.
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
  # One leaf for each way a leaf is cut into rows: last axis a multiple of 32,
  # size a multiple of 32, size not a multiple of 32 (padded), a scalar, an empty leaf.
  return [
    np.ones((4, 64), np.float32),
    np.ones((96, 33), np.float32),
    np.ones(70_001, np.float32),
    np.ones((), np.float32),
    np.ones(3, np.float16),
    np.ones((0, 5), np.float32),
    np.ones((2, 2), jnp.bfloat16),
    np.ones((300, 300), np.float16),
    np.ones(5, np.float32),
    np.ones((7, 3, 32), np.float32),  # 10 leaves: two groups of 8
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
  rng = np.random.default_rng(0)
  for _ in range(20):
    n = int(rng.integers(1, 20))
    leaves = [
      rng.standard_normal(rng.integers(0, 70, size=rng.integers(0, 3))).astype(np.float32)
      for _ in range(n)
    ]
    for x in leaves:
      if x.size and rng.random() < 0.2:
        x.reshape(-1)[rng.integers(x.size)] = rng.choice([np.inf, -np.inf, np.nan])
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
  params = {
    f"p{i}": jax.ShapeDtypeStruct((64, 96) if i % 2 else (96,), jnp.float32) for i in range(24)
  }
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16", loss_scale=loss_scale)

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates, opt_state), opt_state

  state = jax.eval_shape(tx.init, params)
  report = mpx.audit(jax.jit(step, donate_argnums=(0, 1)), params, state, params, target="h100")
  # The groups' kernels: XLA names the last one after the concatenate it fuses into.
  return report, [k for k in report.kernels if k["op_name"].endswith(("reduce_and", "concatenate"))]


@pytest.mark.skipif(
  not targets.plugin_available(), reason="jax's CUDA plugin (the gpu-target extra) is not installed"
)
@pytest.mark.filterwarnings("ignore::mpx.PrecisionWarning")
def test_h100_program_checks_each_leaf_once_without_a_loop():
  base, _ = _kernels(None)
  report, checks = _kernels("dynamic")
  assert sum(k["count"] for k in checks) <= 24 + 1  # one reduction per leaf, one over all
  # The leaf index is a vector compare: no while loop (jnp.searchsorted's) in the program.
  assert not [k for k in report.kernels if "while" in k["op_name"]]
  # Everything dynamic loss scaling adds beyond the reductions: a fixed few kernels for the
  # final reduction, the leaf index and the state's scalars.
  assert report.kernel_count - base.kernel_count <= 24 + 14
