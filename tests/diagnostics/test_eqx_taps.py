"""The precision diagnostics on Equinox models: activation statistics, the non-finite locator, paths.

Equinox layers run one example at a time under ``jax.vmap``; the taps must
record the whole batch, and name layers by the paths keep rules use.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src.scaling import train_step


class Block(eqx.Module):
  linear: eqx.nn.Linear
  norm: eqx.nn.LayerNorm

  def __init__(self, key):
    self.linear = eqx.nn.Linear(8, 8, key=key)
    self.norm = eqx.nn.LayerNorm(8)

  def __call__(self, x):
    return self.norm(jax.nn.relu(self.linear(x)))


class Net(eqx.Module):
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, key, depth=2):
    keys = jax.random.split(key, depth + 1)
    self.blocks = [Block(k) for k in keys[:-1]]
    self.head = eqx.nn.Linear(8, 2, key=keys[-1])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _loss(model, x):
  return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)


X = jax.random.normal(jax.random.key(1), (5, 8))


def test_the_locator_names_the_equinox_path_of_an_overflow_from_whole_batch_statistics():
  model = mpx.eqx.apply_policy(Net(jax.random.key(0), depth=1), "mixed_float16")
  # The first layer computes 3e4 * sum(|x|) in float16: its output overflows.
  big = eqx.tree_at(lambda m: m.blocks[0].linear.weight, model, jnp.full((8, 8), 3e4))
  report = mpx.eqx.locate_nonfinite(_loss, big, jnp.abs(X))
  assert report.forward == ("blocks/0/linear", "output")
  assert report.cause == "genuine"
  stats = report.stats  # every module, in forward order, keyed by path
  assert stats.modules == ("blocks/0/linear", "blocks/0/norm", "blocks/0", "head", "<root>")

  # Every value is the batch's (5 examples) in its histogram, NaNs and infinities included.
  def size(h):
    return int(h.counts.sum() + h.zeros + h.infs + h.nans)

  sizes = {key: size(h) for key, h in stats.outputs.items()}
  assert sizes == {key: 5 * (2 if key in ("head", "<root>") else 8) for key in stats.modules}
  assert size(stats.output_grads["blocks/0/linear"]) == 40
  assert int(stats.outputs["blocks/0/linear"].infs) == 40
  # Parameter gradients in the structure of the model's inexact arrays.
  params = eqx.filter(model, eqx.is_inexact_array)
  is_histogram = lambda x: hasattr(x, "counts")  # noqa: E731
  assert jax.tree.structure(stats.param_grads, is_leaf=is_histogram) == jax.tree.structure(params)


@pytest.mark.slow
def test_the_locator_tells_a_backward_overflow_that_a_smaller_scale_absorbs():
  model = mpx.eqx.apply_policy(Net(jax.random.key(0)), "mixed_float16")
  report = mpx.eqx.locate_nonfinite(_loss, model, X, loss_scale=2.0**40)
  assert report.forward is None and report.cause == "overflow"
  assert report.backward is not None and report.finite_scale < 2.0**40


@pytest.mark.slow
def test_gradient_paths_and_range_reports_name_equinox_paths():
  model = mpx.eqx.apply_policy(Net(jax.random.key(0)), "mixed_float16")
  params = eqx.filter(model, eqx.is_inexact_array)
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16")
  opt_state = tx.init(params)

  @eqx.filter_jit
  def step(model, opt_state):
    _, grads = mpx.value_and_grad(_loss, opt_state)(model, X)
    grads = eqx.tree_at(lambda g: g.head.weight, grads, jnp.full((2, 8), jnp.inf))
    _, opt_state = tx.update(grads, opt_state, params)
    return opt_state, mpx.diagnostics.range_report(grads, jnp.float16)

  opt_state, report = step(model, opt_state)
  assert train_step.nonfinite_gradient_paths(opt_state, params) == ["head/weight"]
  assert 0 < float(np.asarray(report.nonfinite).max()) < 1
