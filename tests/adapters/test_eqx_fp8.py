"""Float8 and float32-accumulating products of Equinox layers, and the delayed-scaling histories.

Equinox layers take one example under ``jax.vmap``; a float8 contraction must
still see the whole batch (one amax, one GEMM, the weight gradient contracted
over the batch), so each product is compared bit for bit with
:func:`mpx.fp8.fp8_dot_general` / :func:`mpx.fp8.fp8_conv_general_dilated`
called once on the batch.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src.audit import targets

BF16 = np.dtype(jnp.bfloat16)
PRESETS = (
  "mixed_float8",
  pytest.param("mixed_float8_delayed", marks=pytest.mark.slow),
  pytest.param("mixed_float8_rowwise", marks=pytest.mark.slow),
  "mixed_mxfp8",
  pytest.param("mixed_float8_blockwise", marks=pytest.mark.slow),
)


def _eqns(jaxpr, names):
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      found.append(eqn)
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found.extend(_eqns(inner, names))
  return found


def _float8_operands(fn, *args, names=("dot_general", "scaled_dot")):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [
    all(jnp.dtype(v.aval.dtype).itemsize == 1 for v in eqn.invars[:2])
    for eqn in _eqns(jaxpr, names)
  ]


def test_linear_computes_one_float8_product_over_the_whole_batch_under_nested_vmap():
  linear = eqx.nn.Linear(16, 32, key=jax.random.key(0))
  policied = mpx.eqx.apply_policy(linear, "mixed_float8")
  x = jax.random.normal(jax.random.key(1), (3, 5, 16)) * 4

  def loss(model, x):
    return jnp.sum(jax.vmap(jax.vmap(model))(x) ** 2)

  def reference(model, x):
    w, b, xs = model.weight.astype(BF16), model.bias.astype(BF16), x.astype(BF16)
    y = mpx.fp8.fp8_dot_general(xs.reshape(15, 16), w, (((1,), (1,)), ((), ()))) + b
    return jnp.sum(y.astype(jnp.float32).reshape(3, 5, 32) ** 2)

  got, want = (
    jax.jit(jax.value_and_grad(loss))(policied, x),
    jax.jit(jax.value_and_grad(reference))(linear, x),
  )
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1].weight, want[1].weight)
  np.testing.assert_array_equal(got[1].bias, want[1].bias)
  # One forward product and two backward ones, each over all 15 examples.
  shapes = [
    tuple(eqn.outvars[0].aval.shape)
    for eqn in _eqns(jax.make_jaxpr(jax.grad(loss))(policied, x).jaxpr, ("dot_general",))
  ]
  assert sorted(shapes) == [(16, 3, 5), (32, 3, 5), (32, 16)]


@pytest.mark.slow
def test_conv_computes_one_float8_convolution_over_the_batch():
  conv = eqx.nn.Conv2d(16, 16, 3, padding=1, key=jax.random.key(0))
  policied = mpx.eqx.apply_policy(conv, "mixed_float8")
  x = jax.random.normal(jax.random.key(1), (4, 16, 6, 6))
  got = jax.jit(jax.vmap(policied))(x)
  bf = lambda a: a.astype(BF16)  # noqa: E731
  want = mpx.fp8.fp8_conv_general_dilated(bf(x), bf(conv.weight), (1, 1), ((1, 1), (1, 1)))
  want = jax.jit(lambda w: (w + bf(conv.bias)).astype(jnp.float32))(want)
  np.testing.assert_array_equal(got, want)


class _Net(eqx.Module):
  conv: eqx.nn.Conv2d
  linear: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k1)
    self.linear = eqx.nn.Linear(16 * 16, 16, key=k2)

  def __call__(self, x):
    return self.linear(jax.nn.relu(self.conv(x)).reshape(-1))


@pytest.mark.parametrize("policy", PRESETS)
def test_every_float8_preset_gives_linear_float8_products_forward_and_backward(policy):
  model = mpx.eqx.apply_policy(_Net(jax.random.key(0)), policy)
  x = jnp.ones((2, 16, 4, 4))
  grad = jax.grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))
  per_tensor = mpx.get_policy(policy).fp8.scaling in ("current", "delayed")
  # The linear layer's three products, and under per-tensor recipes the convolution's weight
  # gradient (one float8 matmul per kernel tap).
  dots = _float8_operands(grad, model, x)
  assert set(dots) == {True} and len(dots) == (3 + 9 if per_tensor else 3)
  # mpx's float8 convolution convolves the float32 dequantised float8 operands (the form XLA
  # rewrites to a cuDNN float8 convolution); the other recipes convolve in bfloat16.
  jaxpr = jax.make_jaxpr(grad)(model, x).jaxpr
  convs = {np.dtype(e.invars[0].aval.dtype) for e in _eqns(jaxpr, ("conv_general_dilated",))}
  assert convs == ({np.dtype("float32")} if per_tensor else {BF16})


def test_accumulate_in_float32_requests_float32_products_of_half_operands():
  model = mpx.eqx.apply_policy(
    _Net(jax.random.key(0)), "mixed_bfloat16", accumulate_in_float32=True
  )
  jaxpr = jax.make_jaxpr(jax.grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)))(
    model, jnp.ones((2, 16, 4, 4))
  )
  products = _eqns(jaxpr.jaxpr, ("dot_general", "conv_general_dilated"))
  assert len(products) == 6
  for eqn in products:
    assert {np.dtype(v.aval.dtype) for v in eqn.invars} == {BF16}
    assert np.dtype(eqn.params["preferred_element_type"]) == np.dtype("float32")


class _Stack(eqx.Module):
  layers: eqx.nn.Linear  # stacked by filter_vmap, run by a scan

  def __init__(self, key):
    self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(jax.random.split(key, 3))

  def __call__(self, x):
    dynamic, static = eqx.partition(self.layers, eqx.is_array)
    return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, dynamic)[0]


@pytest.mark.slow
def test_delayed_histories_are_per_stacked_layer_and_follow_the_optimizer_step():
  model = mpx.eqx.apply_policy(_Stack(jax.random.key(0)), "mixed_float8_delayed")
  params, histories = mpx.eqx.partition_fp8(eqx.filter(model, eqx.is_inexact_array))
  assert [h.shape for h in jax.tree.leaves(histories)] == [(3, 17)] * 3
  assert params.layers.mpx_history is None and len(jax.tree.leaves(params)) == 2
  tx = mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**4)
  opt_state = tx.init(params)

  @eqx.filter_jit
  def step(model, opt_state, x):
    loss = lambda m: jnp.sum(jax.vmap(m)(x) ** 2)  # noqa: E731
    _, grads = mpx.value_and_grad(loss, opt_state)(model)
    grads, observed = mpx.eqx.partition_fp8(grads)
    params, _ = mpx.eqx.partition_fp8(eqx.filter(model, eqx.is_inexact_array))
    updates, opt_state = tx.update(grads, opt_state, params)
    model = mpx.eqx.update_fp8_state(
      eqx.apply_updates(model, updates), observed, opt_state=opt_state
    )
    return model, opt_state

  x = jnp.full((4, 8), 2.0)
  model, opt_state = step(model, opt_state, x)
  history = model.layers.mpx_history
  assert float(history.rhs[0, 1]) == 2.0  # the first layer's input amax, committed
  assert bool((history.lhs[:, 1] > 0).all()) and bool((history.grad[:, 1] > 0).all())
  assert float(jnp.abs(history.lhs[:, 0]).sum()) == 0.0  # pending slots reset
  skipped_model, skipped = step(model, opt_state, x.at[0, 0].set(jnp.inf))
  assert bool(mpx.loss_scale_metrics(skipped)["last_step_skipped"])
  for a, b in zip(jax.tree.leaves(skipped_model), jax.tree.leaves(model), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_layer_called_twice_records_the_larger_amax_of_its_calls():
  class Twice(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
      return self.linear(x) + self.linear(4 * x)

  model = mpx.eqx.apply_policy(
    Twice(eqx.nn.Linear(8, 8, key=jax.random.key(0))), "mixed_float8_delayed"
  )
  grads = jax.jit(jax.grad(lambda m: jnp.sum(jax.vmap(m)(jnp.ones((2, 8))))))(model)
  assert float(grads.linear.mpx_history.rhs[0]) == 4.0  # max(1, 4), not the sum 5


@pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)
def test_the_h100_audit_of_an_equinox_train_step_finds_float8_gemms_by_layer_path():
  class Mlp(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.up, self.down = eqx.nn.Linear(64, 128, key=k1), eqx.nn.Linear(128, 64, key=k2)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  model = mpx.eqx.apply_policy(Mlp(jax.random.key(0)), "mixed_float8")
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float8")
  params = eqx.filter(model, eqx.is_inexact_array)
  opt_state = jax.eval_shape(tx.init, params)

  def step(params, opt_state, x):
    loss = lambda p: jnp.mean(jax.vmap(eqx.combine(p, model))(x) ** 2)  # noqa: E731
    _, grads = mpx.value_and_grad(loss, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state

  x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  report = mpx.audit(step, params, opt_state, x, target="h100")  # modelled, no autotuning
  assert report.fp8_flops_share == 1.0, str(report)
  # Forward and weight gradient of both layers, the input gradient of `down` (not of `up`: the
  # batch is not differentiated).
  assert len(report.gemms) == 5 and not report.lost, str(report)
  assert sorted({g.module_path for g in report.gemms}) == ["down", "up"]
