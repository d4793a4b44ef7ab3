"""The lean norms on the program XLA builds for an H100: no more kernels or bytes than Flax's own.

Two small models the benchmarks do not run, a convolutional net with
``BatchNorm`` and a pre-LN transformer with ``LayerNorm``, each trained one
step two ways and compiled for an H100 without a GPU (jax's CUDA plugin,
``JAX_PLATFORMS=cpu``; skipped without it): written for bfloat16 by hand, with
``dtype=jnp.bfloat16`` on every layer as Flax's examples do, and as written in
float32 under ``mpx.linen.apply_policy(model, "mixed_bfloat16")``, whose norms
run the lean kernels. The mpx step may launch no more kernels and move no more
bytes than the hand-written one. The same comparison for float16 against jmp's
loss scaling by hand is slow-marked: mpx's loss scaling costs a kernel per
scalar of its state (about ten) and a fifth of a kernel per leaf, jmp's a
kernel per leaf, so it runs a six-stage conv net (20 leaves) and the
transformer (36 leaves); below a dozen leaves jmp's check launches fewer.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import mpx
from mpx._src.audit import targets

pytestmark = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)


class ConvNet(nn.Module):
  """Convolution, BatchNorm, ReLU stages, pooling, a classifier."""

  dtype: jnp.dtype | None = None
  widths: tuple[int, ...] = (16, 32)

  @nn.compact
  def __call__(self, x):
    for features in self.widths:
      x = nn.Conv(features, (3, 3), use_bias=False, dtype=self.dtype)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


class PreLN(nn.Module):
  """Two pre-LN transformer blocks (causal attention, a GELU MLP) and a final LayerNorm."""

  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    for _ in range(2):
      h = nn.LayerNorm(dtype=self.dtype)(x)
      x = x + nn.MultiHeadDotProductAttention(4, dtype=self.dtype)(h, h, mask=mask)
      h = nn.LayerNorm(dtype=self.dtype)(x)
      x = x + nn.Dense(width, dtype=self.dtype)(nn.gelu(nn.Dense(4 * width, dtype=self.dtype)(h)))
    return nn.Dense(16, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


MODELS = {
  "conv_batchnorm": (ConvNet, (16, 8, 8, 3)),
  "pre_ln_transformer": (PreLN, (4, 32, 64)),
}
# For the float16 comparison (see the module docstring): six stages, 20 param leaves, and the
# transformer at the size whose bytes the loss scaling's few kernels are measured against.
DEEPER = {
  "conv_batchnorm": (functools.partial(ConvNet, widths=(16, 16, 32, 32, 64, 64)), (16, 8, 8, 3)),
  "pre_ln_transformer": (PreLN, (8, 64, 128)),
}


def _audit(module, x_shape, tx, *, grad_fn=jax.value_and_grad, cast=None):
  """The H100 report of one train step of ``module`` on a batch of ``x_shape``."""
  # Flax's norms under dtype=bfloat16 and optax's adamw mix float32 into half-precision
  # arithmetic, which strict promotion (conftest.py) rejects; the programs are the same.
  with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
    warnings.simplefilter("ignore", mpx.PrecisionWarning)
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros(x_shape))
    params, stats = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    opt_state = jax.eval_shape(tx.init, params)

    def loss_fn(params, stats, x):
      if cast is not None:
        params, x = cast((params, x))
      out, new_stats = module.apply({"params": params, **stats}, x, mutable=list(stats))
      return jnp.mean(jnp.square(out.astype(jnp.float32))), new_stats

    def step(params, opt_state, stats, x):
      (loss, stats), grads = grad_fn(loss_fn, opt_state, has_aux=True)(params, stats, x)
      updates, opt_state = tx.update(grads, opt_state, params)
      return mpx.apply_updates(params, updates), opt_state, stats, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    return mpx.audit(step, params, opt_state, stats, x, target="h100")


def _by_hand(grad_fn):
  return lambda fn, opt_state, has_aux: grad_fn(fn, has_aux=has_aux)


@pytest.mark.parametrize(
  "name", ["conv_batchnorm", pytest.param("pre_ln_transformer", marks=pytest.mark.slow)]
)
def test_mixed_bfloat16_costs_no_more_than_flax_dtype_arguments(name):
  make, x_shape = MODELS[name]
  tx = optax.sgd(0.1)
  flax_report = _audit(make(dtype=jnp.bfloat16), x_shape, tx, grad_fn=_by_hand(jax.value_and_grad))
  model = mpx.linen.apply_policy(make(), "mixed_bfloat16")
  mpx_report = _audit(
    model, x_shape, mpx.mixed_precision(tx, "mixed_bfloat16"), grad_fn=mpx.value_and_grad
  )
  assert mpx_report.kernel_count <= flax_report.kernel_count, (name, mpx_report, flax_report)
  assert mpx_report.bytes_moved <= flax_report.bytes_moved, (name, mpx_report, flax_report)


def _jmp_step_tx(tx):
  """jmp's float16 recipe as a transformation: unscale, ``jmp.all_finite``, select (by hand)."""
  jmp = pytest.importorskip("jmp")
  scale = jmp.DynamicLossScale(jnp.float32(2.0**15))

  def update(grads, state, params):
    grads = scale.unscale(grads)
    updates, new_state = tx.update(grads, state, params)
    ok = jmp.all_finite(grads)
    return jmp.select_tree(ok, (updates, new_state), (jax.tree.map(jnp.zeros_like, updates), state))

  return optax.GradientTransformation(tx.init, update), scale


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_float16_costs_no_more_than_jmp_by_hand(name):
  make, x_shape = DEEPER[name]
  tx = optax.adamw(1e-3)
  by_hand, scale = _jmp_step_tx(tx)
  jmp = pytest.importorskip("jmp")
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")

  def scaled_grad(fn, has_aux):
    def scaled(*args):
      loss, aux = fn(*args)
      return scale.scale(loss), (loss, aux)

    grad = jax.grad(scaled, has_aux=True)
    return lambda *args: (lambda g, la: ((la[0], la[1]), g))(*grad(*args))

  jmp_report = _audit(
    make(), x_shape, by_hand, grad_fn=_by_hand(scaled_grad), cast=policy.cast_to_compute
  )
  model = mpx.linen.apply_policy(make(), "mixed_float16")
  mpx_report = _audit(
    model, x_shape, mpx.mixed_precision(tx, "mixed_float16"), grad_fn=mpx.value_and_grad
  )
  assert mpx_report.kernel_count <= jmp_report.kernel_count, (name, mpx_report, jmp_report)
  assert mpx_report.bytes_moved <= jmp_report.bytes_moved, (name, mpx_report, jmp_report)
