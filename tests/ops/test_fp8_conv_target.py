"""The float8 convolutions on the program XLA builds for an H100: cuDNN float8 convolutions and GEMMs.

Compiled without a GPU through jax's CUDA plugin (``JAX_PLATFORMS=cpu``),
skipped without it, as ``tests/ops/test_fp8_target.py``. XLA's cuDNN rewriter
turns a forward convolution of dequantised float8 operands into a cuDNN float8
graph convolution; the op writes the input gradient as such a convolution and
the weight gradient as float8 matmuls (see ``mpx/_src/ops/fp8_conv.py``).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.audit import report as report_lib
from mpx._src.audit import targets

pytestmark = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BATCH, SIZE, WIDTH = 8, 16, 32


class LinenCnn(nn.Module):
  """A 3x3 convolution, a strided 3x3 one, a strided 1x1 one: a bottleneck's kinds."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(WIDTH, (3, 3), name="conv")(x))
    x = nn.relu(nn.Conv(WIDTH, (3, 3), strides=(2, 2), name="down")(x))
    return nn.Conv(2 * WIDTH, (1, 1), strides=(2, 2), name="proj")(x)


class NnxCnn(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(WIDTH, WIDTH, (3, 3), rngs=rngs)
    self.down = nnx.Conv(WIDTH, WIDTH, (3, 3), strides=(2, 2), rngs=rngs)
    self.proj = nnx.Conv(WIDTH, 2 * WIDTH, (1, 1), strides=(2, 2), rngs=rngs)

  def __call__(self, x):
    return self.proj(nnx.relu(self.down(nnx.relu(self.conv(x)))))


def _linen_step(policy):
  model = mpx.linen.apply_policy(LinenCnn(), policy)
  x = jax.ShapeDtypeStruct((BATCH, SIZE, SIZE, WIDTH), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(variables, x):
    return jax.grad(lambda v: jnp.mean(jnp.square(model.apply(v, x))))(variables)

  return step, variables, x


def _nnx_step(policy):
  graphdef, state = nnx.split(
    nnx.eval_shape(lambda: mpx.nnx.apply_policy(NnxCnn(nnx.Rngs(0)), policy))
  )
  x = jax.ShapeDtypeStruct((BATCH, SIZE, SIZE, WIDTH), jnp.float32)

  def step(state, x):
    return jax.grad(lambda s: jnp.mean(jnp.square(nnx.merge(graphdef, s)(x))))(state)

  return step, state, x


def _audit(make, policy):
  step, variables, x = make(policy)
  with warnings.catch_warnings():
    warnings.simplefilter("error", mpx.PrecisionWarning)  # nothing lost on the way
    return report_lib.audit(step, variables, x, target="h100")


@pytest.mark.parametrize(
  ("make", "policy"),
  [
    pytest.param(_linen_step, "mixed_float8_delayed", id="mixed_float8_delayed-linen"),
    *(
      pytest.param(make, policy, id=f"{policy}-{name}", marks=pytest.mark.slow)
      for policy, make, name in (
        ("mixed_float8", _linen_step, "linen"),
        ("mixed_float8", _nnx_step, "nnx"),
        ("mixed_float8_delayed", _nnx_step, "nnx"),
      )
    ),
  ],
)
def test_every_convolution_of_an_fp8_policy_is_float8_on_an_h100(make, policy):
  report = _audit(make, policy)
  assert report.fp8_flops_share == 1.0 and not report.lost
  assert all(g.result_dtype == np.float32 for g in report.gemms)  # float32 accumulation
  convs = [g for g in report.gemms if g.kind == "convolution"]
  assert all(g.backend == "cudnn" for g in convs)
  forward = [g for g in convs if not g.is_backward]
  input_grads = [g for g in convs if g.is_backward]
  weight_grads = [g for g in report.gemms if g.kind == "dot"]
  # Three forward convolutions, E4M3 x E4M3.
  assert len(forward) == 3 and all(g.dtypes == (E4M3, E4M3) for g in forward)
  # The input gradients of down and proj (the input needs none): E5M2 gradient x E5M2
  # kernel (cuDNN computed NaNs for E5M2 x E4M3 on an H200), one convolution per phase
  # of the stride that some kernel tap reaches (4 for down's 3x3, 1 for proj's 1x1),
  # together exactly the forward FLOPs: no product meets a zero between gradient positions.
  assert len(input_grads) == 5 and all(g.dtypes == (E5M2, E5M2) for g in input_grads)
  assert sum(g.flops for g in input_grads) == sum(g.flops for g in forward[1:])
  # The weight gradients: float8 GEMMs of the E4M3 input and the E5M2 gradient.
  assert weight_grads and all(g.is_backward and set(g.dtypes) == {E4M3, E5M2} for g in weight_grads)
  assert len(weight_grads) == 3


def test_mixed_bfloat16_convolutions_are_the_bfloat16_baseline():
  report = _audit(_linen_step, "mixed_bfloat16")
  assert report.fp8_flops_share == 0.0 and report.half_flops_share == 1.0
  # The same 8 products, all cuDNN convolutions in bfloat16.
  assert len(report.gemms) == 8 and {g.kind for g in report.gemms} == {"convolution"}
