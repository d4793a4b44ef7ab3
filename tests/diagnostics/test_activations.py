"""Activation statistics per module, for linen and NNX: keys, values, gradients, no side effects."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpx

F16, F32 = jnp.float16, jnp.float32
SCALE = 2.0**10


def raw(values):
  """A statistic that keeps the values themselves."""
  return values


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name="a")(x)
    return nn.Dense(2, name="b")(nn.relu(h))


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(3, 4, rngs=rngs)
    self.b = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], F32)


def reference(wa, ba, wb, bb, x, dtype=F32):
  """Outputs and output gradients of the two layers, computed by hand."""
  c = lambda v: v.astype(dtype)  # noqa: E731
  a = lambda x: c(x) @ c(wa) + c(ba)  # noqa: E731
  b = lambda h: c(h) @ c(wb) + c(bb)  # noqa: E731
  loss = lambda y: jnp.sum(y.astype(F32) ** 2)  # noqa: E731
  ha = a(x)
  y = b(nn.relu(ha))
  grad_y = jax.grad(lambda y: loss(y) * SCALE)(y)
  _, tail = jax.vjp(lambda h: b(nn.relu(h)), ha)
  (grad_ha,) = tail(grad_y)
  return {"a": ha, "b": y}, {"a": grad_ha, "b": grad_y}


def linen_setup(policy=None):
  model = LinenMlp() if policy is None else mpx.linen.apply_policy(LinenMlp(), policy)
  params = model.init(jax.random.key(0), X)
  p = params["params"]
  weights = (p["a"]["kernel"], p["a"]["bias"], p["b"]["kernel"], p["b"]["bias"])
  return (lambda v, x: jnp.sum(model.apply(v, x).astype(F32) ** 2)), params, weights


def nnx_setup(policy=None):
  model = NnxMlp(nnx.Rngs(0))
  if policy is not None:
    mpx.nnx.apply_policy(model, policy)
  weights = (model.a.kernel[...], model.a.bias[...], model.b.kernel[...], model.b.bias[...])
  return (lambda m, x: jnp.sum(m(x).astype(F32) ** 2)), model, weights


COLLECT = {
  "linen": (linen_setup, mpx.linen.collect_activations),
  "nnx": (nnx_setup, mpx.nnx.collect_activations),
}


@pytest.mark.slow
@pytest.mark.parametrize("api", list(COLLECT))
@pytest.mark.parametrize("policy", [None, "mixed_float16"], ids=["f32", "mixed_f16"])
def test_outputs_and_the_gradients_flowing_into_them(api, policy):
  setup, collect = COLLECT[api]
  loss_fn, target, weights = setup(policy)
  stats = collect(loss_fn, target, X, loss_scale=SCALE, stat=raw)
  assert stats.modules == ("a", "b", "<root>")
  assert [k for k, _ in stats.events] == ["<root>", "a", "a", "b", "b", "<root>"]
  dtype = F32 if policy is None else F16
  outs, grads = reference(*weights, X, dtype)
  for key in ("a", "b"):
    (out,), (grad,) = stats.outputs[key], stats.output_grads[key]
    assert out.dtype == grad.dtype == dtype  # what flows between the layers
    np.testing.assert_allclose(np.asarray(out, F32), np.asarray(outs[key], F32), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(grad, F32), np.asarray(grads[key], F32), rtol=2e-3)
  # The layer's input gradient is the gradient the previous layer's output receives... through relu.
  (grad_in_b,) = stats.input_grads["b"]
  (out_a,) = stats.outputs["a"]
  np.testing.assert_array_equal(
    np.asarray(grad_in_b) * (np.asarray(out_a) > 0), np.asarray(stats.output_grads["a"][0])
  )
  assert float(stats.loss_scale) == SCALE


@pytest.mark.parametrize("api", list(COLLECT))
def test_parameter_gradients_are_those_of_the_scaled_loss(api):
  setup, collect = COLLECT[api]
  loss_fn, target, _ = setup()
  stats = collect(loss_fn, target, X, loss_scale=SCALE, stat=raw)
  if api == "linen":
    want = jax.grad(lambda v: loss_fn(v, X) * SCALE)(target)
  else:
    want = nnx.to_pure_dict(nnx.grad(lambda m: loss_fn(m, X) * SCALE)(target))
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), stats.param_grads, want)
  np.testing.assert_allclose(stats.loss, loss_fn(target, X), rtol=1e-6)


def test_taps_leave_the_values_bitwise_unchanged():
  loss_fn, params, _ = linen_setup("mixed_float16")
  x = X.at[0, 0].set(-0.0)
  stats = mpx.linen.collect_activations(lambda v, x: loss_fn(v, x), params, x, stat=raw)
  plain = jax.jit(loss_fn)(params, x)
  assert np.asarray(stats.loss).tobytes() == np.asarray(plain).tobytes()
  (root_in,) = stats.inputs["<root>"]
  assert np.asarray(root_in).tobytes() == np.asarray(x).tobytes()  # -0.0 stays -0.0


@pytest.mark.slow
def test_histograms_by_default_and_a_range_report_statistic():
  loss_fn, params, _ = linen_setup("mixed_float16")
  stats = mpx.linen.collect_activations(loss_fn, params, X, loss_scale=SCALE)
  assert isinstance(stats.outputs["a"], mpx.diagnostics.MagnitudeHistogram)
  assert int(stats.outputs["a"].size) == 8 and int(stats.output_grads["b"].size) == 4
  assert isinstance(stats.param_grads["params"]["a"]["kernel"], mpx.diagnostics.MagnitudeHistogram)
  scales = 2.0 ** np.arange(0, 30, 4)
  stat = functools.partial(mpx.diagnostics.range_report, dtype=F16, scale=scales)
  ranges = mpx.linen.collect_activations(loss_fn, params, X, loss_scale=SCALE, stat=stat)
  grads = mpx.linen.collect_activations(loss_fn, params, X, loss_scale=SCALE, stat=raw)
  want = mpx.diagnostics.range_report(grads.output_grads["a"], F16, scale=scales)
  jax.tree.map(np.testing.assert_array_equal, ranges.output_grads["a"], want)
  assert ranges.output_grads["a"].flushed.shape == scales.shape


def test_the_scale_can_come_from_the_optimizer_state():
  loss_fn, params, _ = linen_setup()
  state = mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**7).init(params)
  stats = mpx.linen.collect_activations(loss_fn, params, X, loss_scale=state, stat=raw)
  ref = mpx.linen.collect_activations(loss_fn, params, X, loss_scale=2.0**7, stat=raw)
  assert float(stats.loss_scale) == 2.0**7
  jax.tree.map(np.testing.assert_array_equal, stats.output_grads, ref.output_grads)


class Shared(nn.Module):
  @nn.compact
  def __call__(self, x, *, train: bool):
    dense = nn.Dense(3, name="shared")
    y = dense(dense(x))
    return nn.Dropout(0.5, deterministic=not train)(y)


def test_repeated_calls_are_numbered_and_python_arguments_stay_python():
  model = Shared()
  params = model.init(jax.random.key(0), X, train=False)
  loss_fn = lambda p, x, train: model.apply(p, x, train=train).sum()  # noqa: E731
  stats = mpx.linen.collect_activations(loss_fn, params, X, False)
  assert stats.modules == ("shared", "shared#1", "Dropout_0", "<root>")


class NnxWithNorm(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 3, rngs=rngs)
    self.norm = nnx.BatchNorm(3, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.norm(self.dense(x)))


def host(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def test_nnx_model_state_is_untouched_and_keys_are_graph_paths():
  model = NnxWithNorm(nnx.Rngs(0))
  before = jax.tree.map(host, nnx.to_pure_dict(nnx.state(model)))
  cls = type(model.dense)
  stats = mpx.nnx.collect_activations(lambda m, x: m(x).sum(), model, X)
  after = jax.tree.map(host, nnx.to_pure_dict(nnx.state(model)))
  jax.tree.map(np.testing.assert_array_equal, after, before)  # batch stats, RNG counts
  assert type(model.dense) is cls  # the user's modules keep their classes
  assert stats.modules == ("dense", "norm", "drop", "<root>")
  assert set(stats.param_grads) == {"dense", "norm"}


def test_a_loss_that_is_not_a_scalar_is_rejected():
  loss_fn, params, _ = linen_setup()
  with pytest.raises(mpx.LeafTypeError, match="floating-point scalar"):
    mpx.linen.collect_activations(lambda v, x: jnp.ones(2) * loss_fn(v, x), params, X)
