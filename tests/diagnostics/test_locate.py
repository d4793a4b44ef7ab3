"""The non-finite locator on small models with one layer rigged to fail, linen and NNX."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx

SCALE = 2.0**10
X = jax.random.normal(jax.random.key(1), (2, 8), jnp.float32)

# What the rigged layer does to its input h (a tanh output, |h| < 1), under float16:
RIGS = {
  "none": lambda h: h,
  # 3000 * h is fine forward; the gradient it passes back is 3000 times the one it gets.
  "backward_overflow": lambda h: h * jnp.asarray(3000, h.dtype),
  "forward_overflow": lambda h: h * jnp.asarray(1e4, h.dtype) * jnp.asarray(1e2, h.dtype),
  "forward_nan": lambda h: jnp.sqrt(h - jnp.asarray(2, h.dtype)),
  # The unselected branch's gradient is 0 * inf = NaN where h <= 0, at every scale.
  "backward_nan": lambda h: jnp.where(h > 0, jnp.sqrt(jnp.maximum(h, 0) * 0 + h), h),
}


class LinenRig(nn.Module):
  rig: str

  @nn.compact
  def __call__(self, h):
    return RIGS[self.rig](h)


class LinenNet(nn.Module):
  rig: str

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(8, name="inp")(x))
    h = LinenRig(self.rig, name="rigged")(h)
    h = nn.Dense(8, name="mid")(h)
    return nn.Dense(1, name="out")(h)


class NnxRig(nnx.Module):
  def __init__(self, rig):
    self.rig = rig

  def __call__(self, h):
    return RIGS[self.rig](h)


class NnxNet(nnx.Module):
  def __init__(self, rig, rngs):
    self.inp = nnx.Linear(8, 8, rngs=rngs)
    self.rigged = NnxRig(rig)
    self.mid = nnx.Linear(8, 8, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    h = self.rigged(jnp.tanh(self.inp(x)))
    return self.out(self.mid(h))


def loss(y):
  return jnp.mean(y.astype(jnp.float32))


def locate_linen(rig, x=X, **kw):
  model = mpx.linen.apply_policy(LinenNet(rig), "mixed_float16")
  params = model.init(jax.random.key(0), x)
  return mpx.linen.locate_nonfinite(lambda p, x: loss(model.apply(p, x)), params, x, **kw)


def locate_nnx(rig, x=X, **kw):
  model = mpx.nnx.apply_policy(NnxNet(rig, nnx.Rngs(0)), "mixed_float16")
  return mpx.nnx.locate_nonfinite(lambda m, x: loss(m(x)), model, x, **kw)


LOCATE = {"linen": locate_linen, "nnx": locate_nnx}


@pytest.mark.slow
@pytest.mark.parametrize("api", list(LOCATE))
def test_a_finite_step(api):
  report = LOCATE[api]("none", loss_scale=SCALE)
  assert (report.forward, report.backward, report.cause) == (None, None, "finite")
  assert report.probes == ((SCALE, True),)


@pytest.mark.slow
@pytest.mark.parametrize("api", list(LOCATE))
def test_a_backward_overflow_is_named_and_absorbed_by_a_smaller_scale(api):
  report = LOCATE[api]("backward_overflow", loss_scale=SCALE)
  assert report.forward is None
  assert report.backward == ("rigged", "input_grad")  # its output gradient was finite
  assert report.cause == "overflow"
  # The bisection's answer is consistent with what it tried: finite there, not at twice that.
  tried = dict(report.probes)
  assert tried[report.finite_scale] is True and report.finite_scale < SCALE
  assert tried.get(2 * report.finite_scale, False) is False and tried[SCALE] is False
  assert "'rigged'" in str(report) and "absorbs" in str(report)
  # ... and at the scale it found, the locator sees a finite step.
  assert LOCATE[api]("backward_overflow", loss_scale=report.finite_scale).cause == "finite"


@pytest.mark.slow
@pytest.mark.parametrize("api", list(LOCATE))
def test_a_backward_nan_is_genuine(api):
  report = LOCATE[api]("backward_nan", loss_scale=SCALE)
  assert report.forward is None
  assert report.backward == ("rigged", "input_grad")
  assert report.cause == "genuine" and report.finite_scale is None
  assert report.probes == ((SCALE, False), (1.0, False))
  grads = report.stats.input_grads["rigged"]
  assert int(grads.nans) > 0 and int(report.stats.output_grads["rigged"].nans) == 0


@pytest.mark.slow
@pytest.mark.parametrize("api", list(LOCATE))
@pytest.mark.parametrize("rig", ["forward_overflow", "forward_nan"])
def test_a_forward_failure_is_named_and_genuine_at_any_scale(api, rig):
  report = LOCATE[api](rig, loss_scale=SCALE)
  assert report.forward == ("rigged", "output")  # its input was finite
  assert report.cause == "genuine"
  assert report.probes == ((SCALE, False),)  # no loss scale changes the forward pass
  stats = report.stats
  bad = stats.outputs["rigged"]
  assert int(bad.infs if rig == "forward_overflow" else bad.nans) > 0
  assert int(stats.inputs["rigged"].nonfinite) == 0
  assert "forward pass is non-finite" in str(report)


def test_a_value_broken_between_modules_is_named_at_the_next_input():
  class Between(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(8, name="a")(x) * jnp.asarray(1e4, jnp.float16)  # not a module
      h = h * jnp.asarray(1e2, jnp.float16)
      return nn.Dense(1, name="b")(h)

  model = mpx.linen.apply_policy(Between(), "mixed_float16")
  params = model.init(jax.random.key(0), X)
  report = mpx.linen.locate_nonfinite(lambda p, x: loss(model.apply(p, x)), params, X)
  assert report.forward == ("b", "input")


def test_a_parameter_gradient_is_named_when_every_activation_gradient_is_finite():
  class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1, name="d", kernel_init=nn.initializers.zeros)(x)

  model = mpx.linen.apply_policy(Tiny(), "mixed_float16")
  x = jnp.full((4, 8), 1e4, jnp.float32)
  params = model.init(jax.random.key(0), x)
  # The kernel's float16 gradient sums 4 x 1e4 x scale: it overflows from scale 2 up, while
  # every activation gradient stays at most the scale.
  report = mpx.linen.locate_nonfinite(
    lambda p, x: jnp.sum(model.apply(p, x).astype(jnp.float32)), params, x, loss_scale=4.0
  )
  assert report.forward is None
  assert report.backward == ("params/d/kernel", "param_grad")
  assert report.cause == "overflow" and report.finite_scale == 1.0


def test_min_scale_bounds_the_search():
  report = locate_linen("backward_overflow", loss_scale=SCALE, min_scale=SCALE / 2)
  assert report.cause == "genuine" and report.probes == ((SCALE, False), (SCALE / 2, False))
  assert np.isclose(report.loss_scale, SCALE)
