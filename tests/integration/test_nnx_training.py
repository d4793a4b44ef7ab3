"""NNX training through mpx.value_and_grad: every state update reaches the model.

The model is Flax's MNIST tutorial CNN (Conv, BatchNorm, Dropout, Linear, with
an ``nnx.Rngs`` passed to ``__call__``), scaled down to scikit-learn's 8x8
digits. Each run is compared, step for step, with the plain NNX loop
(``nnx.value_and_grad`` and ``optax.adam``) on an identical float32 model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import digits
from optax_compat import standard_promotion

import mpx

STEPS = 4
BATCH = 32


def _avg_pool(x):
  # flax's avg_pool divides by an int window size, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    return nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))


class CNN(nnx.Module):
  """Flax's MNIST CNN, for 8x8x1 images."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.1)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
    self.avg_pool = _avg_pool
    self.linear1 = nnx.Linear(2 * 2 * 16, 32, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.1)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def loss_fn(model, batch, rngs):
  logits = model(batch["image"], rngs=rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def _batches():
  images, labels = digits()
  return [
    {
      "image": jnp.asarray(images[i * BATCH : (i + 1) * BATCH]),
      "label": jnp.asarray(labels[i * BATCH : (i + 1) * BATCH]),
    }
    for i in range(STEPS)
  ]


def _adam():
  # optax.adam's bias correction is not strict-promotion clean (an optax matter, not mpx's).
  return standard_promotion(optax.adam(1e-3))


def _reference_run():
  """The plain NNX loop on a float32 model: BatchNorm statistics after each step, RNG count."""
  model = CNN(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _adam(), wrt=nnx.Param)
  rngs = nnx.Rngs(dropout=1)

  @nnx.jit
  def step(model, optimizer, batch, rngs):
    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
    optimizer.update(model, grads)
    return loss

  stats = []
  for batch in _batches():
    step(model, optimizer, batch, rngs)
    stats.append(jax.device_get(nnx.state(model, nnx.BatchStat)))
  return stats, int(rngs.dropout.count[...])


def _mpx_run(policy, *, apply_policy=True, rngs_as_keyword=False):
  model = CNN(rngs=nnx.Rngs(0))
  if apply_policy:
    model = mpx.nnx.apply_policy(model, policy)
  optimizer = nnx.Optimizer(model, mpx.mixed_precision(_adam(), policy), wrt=nnx.Param)
  rngs = nnx.Rngs(dropout=1)

  @nnx.jit
  def step(model, optimizer, batch, rngs):
    grad_fn = mpx.value_and_grad(loss_fn, optimizer.opt_state, has_aux=True)
    if rngs_as_keyword:
      (loss, _), grads = grad_fn(model, batch, rngs=rngs)
    else:
      (loss, _), grads = grad_fn(model, batch, rngs)
    optimizer.update(model, grads)
    return loss

  stats = []
  for batch in _batches():
    step(model, optimizer, batch, rngs)
    stats.append(jax.device_get(nnx.state(model, nnx.BatchStat)))
  assert int(mpx.loss_scale_metrics(optimizer.opt_state)["skipped_steps"]) == 0
  return stats, int(rngs.dropout.count[...])


@functools.cache
def _reference():
  return _reference_run()


def _assert_stats(got, want, *, exact):
  for step, (g, w) in enumerate(zip(got, want, strict=True)):
    assert jax.tree.structure(g) == jax.tree.structure(w)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
      assert x.dtype == np.float32, f"step {step}: batch statistics must stay float32"
      if exact:
        np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
      else:
        # Half-precision convolutions against float32 ones: the statistics, of order 0.01
        # to 1, differed by at most 1.4e-4 (bfloat16) and 8.5e-5 (float16) over 4 steps.
        np.testing.assert_allclose(x, y, rtol=1e-2, atol=5e-4, err_msg=f"step {step}")
  first = jax.tree.leaves(want[0])
  assert any(float(np.abs(x).sum()) > 0 for x in first)  # the statistics did move


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_cnn_under_a_policy_trains_like_nnx_value_and_grad(policy):
  want_stats, want_count = _reference()
  stats, count = _mpx_run(policy)
  assert want_count == 2 * STEPS  # two dropout layers draw one key each per step
  assert count == want_count
  _assert_stats(stats, want_stats, exact=policy == "float32")


@pytest.mark.parametrize("rngs_as_keyword", [False, True], ids=["positional", "keyword"])
def test_state_updates_reach_the_model_without_a_policy(rngs_as_keyword):
  want_stats, want_count = _reference()
  stats, count = _mpx_run("float32", apply_policy=False, rngs_as_keyword=rngs_as_keyword)
  assert count == want_count
  _assert_stats(stats, want_stats, exact=True)


def test_variables_mutated_in_the_forward_pass_and_scaled_param_gradients():
  class Counting(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 2, rngs=rngs)
      self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
      self.calls[...] += 1
      return self.linear(x)

  def loss(model, x):
    return (model(x) ** 2).mean()

  x = jnp.ones((4, 3))
  model, reference = Counting(nnx.Rngs(0)), Counting(nnx.Rngs(0))
  for _ in range(2):
    value, grads = nnx.jit(lambda m, x: mpx.value_and_grad(loss, jnp.float32(2.0**10))(m, x))(
      model, x
    )
    want_value, want_grads = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))(reference, x)
  assert int(model.calls[...]) == int(reference.calls[...]) == 2
  np.testing.assert_array_equal(value, want_value)
  assert isinstance(grads, nnx.State)
  got_leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  assert len(got_leaves) == len(want_leaves) == 2  # kernel and bias: nnx.Param only
  for g, w in zip(got_leaves, want_leaves, strict=True):
    np.testing.assert_array_equal(mpx.unscale(g, jnp.float32(2.0**10)), w)
