"""Tests for mpx.losses: the cross-entropy of half-precision logits, against optax and float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src.audit import compiled as hlo
from mpx._src.audit import targets

xent = mpx.losses.softmax_cross_entropy_with_integer_labels
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _problem(dtype, shape=(64, 1000), seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  logits = (4.0 * jax.random.normal(k1, shape)).astype(dtype)
  labels = jax.random.randint(k2, shape[:-1], 0, shape[-1])
  cotangent = jax.random.normal(k3, shape[:-1])  # of the per-example losses
  return logits, labels, cotangent


def _loss_and_grad(loss, logits, cotangent, jit):
  def fn(logits):
    out, pullback = jax.vjp(loss, logits)
    return out, pullback(cotangent)[0]

  return (jax.jit(fn) if jit else fn)(logits)


def _optax_in_float32(logits, labels, **kwargs):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels, **kwargs
  )


@pytest.mark.parametrize(
  ("dtype", "jit", "where"),
  [
    *[(dtype, True, None) for dtype in DTYPES],
    pytest.param(jnp.bfloat16, False, None, marks=pytest.mark.slow),
    (jnp.float16, True, "examples"),
    (jnp.bfloat16, True, "classes"),
  ],
)
def test_bitwise_optax_on_float32_logits(dtype, jit, where):
  logits, labels, cotangent = _problem(dtype)
  kwargs = {}
  if where == "examples":
    kwargs["where"] = jnp.arange(64) % 5 != 0
  elif where == "classes":
    kwargs["where"] = (jnp.arange(1000) % 7 != 0) | (jnp.arange(1000) == labels[:, None])
  got = _loss_and_grad(lambda x: xent(x, labels, **kwargs), logits, cotangent, jit)
  want = _loss_and_grad(lambda x: _optax_in_float32(x, labels, **kwargs), logits, cotangent, jit)
  assert got[0].dtype == jnp.float32 and got[1].dtype == dtype
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(np.float32(got[1]), np.float32(want[1]))


@pytest.mark.slow
def test_class_axes_as_optax_takes_them():
  logits, _, _ = _problem(jnp.bfloat16, shape=(2, 3, 4, 10))
  labels = jax.random.randint(jax.random.key(5), (2, 10), 0, 12)
  got = jax.jit(jax.value_and_grad(lambda x: xent(x, labels, axis=(1, 2)).sum()))(logits)
  want = jax.jit(jax.value_and_grad(lambda x: _optax_in_float32(x, labels, axis=(1, 2)).sum()))(
    logits
  )
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(np.float32(got[1]), np.float32(want[1]))


def _round(x, dtype):
  return np.asarray(np.asarray(x, np.float64).astype(dtype), np.float64)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_against_float64(dtype):
  logits, labels, cotangent = _problem(dtype, shape=(256, 2048), seed=1)
  loss, grad = _loss_and_grad(lambda x: xent(x, labels), logits, cotangent, jit=True)
  x, g = np.asarray(logits, np.float64), np.asarray(cotangent, np.float64)[:, None]
  m = x.max(-1, keepdims=True)
  lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
  rows = np.arange(256)
  want_loss = lse[:, 0] - x[rows, labels]
  # The loss is float32 arithmetic: within a few float32 roundings of the log-sum-exp.
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=8 * 2.0**-24 * np.abs(lse).max())
  onehot = np.zeros_like(x)
  onehot[rows, labels] = 1.0
  want = (np.exp(x - lse) - onehot) * g
  # Rounded once to the logits' dtype: each gradient is the float64 one correctly rounded,
  # except within float32 arithmetic's error of a rounding boundary, where either neighbour is.
  # That error is relative (2**-16 bounds the exponential, the row's sum and the product), but
  # for the label's p - 1 it is relative to g (the subtraction cancels).
  band = 2.0**-16 * (np.abs(want) + onehot * np.abs(g))
  low, high = _round(want - band, dtype), _round(want + band, dtype)
  got = np.asarray(grad, np.float64)
  assert np.all((low <= got) & (got <= high))
  exact = low == high
  assert exact.mean() > 0.95 and np.array_equal(got[exact], low[exact]), exact.mean()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_backward_pass_saves_no_float32_logits(dtype):
  logits, labels, _ = _problem(dtype)
  residuals = jax.tree.leaves(
    jax.eval_shape(lambda x: jax.vjp(lambda x: xent(x, labels), x)[1], logits)
  )
  big = [(r.shape, r.dtype) for r in residuals if r.size >= logits.size]
  assert big == [(logits.shape, logits.dtype)], big


def test_bad_inputs_name_the_fix():
  with pytest.raises(mpx.LeafTypeError, match="floating logits"):
    xent(jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32))
  with pytest.raises(mpx.LeafTypeError, match=r"optax\.softmax_cross_entropy"):
    xent(jnp.zeros((2, 3), jnp.bfloat16), jnp.zeros((2, 3), jnp.float32))


@pytest.mark.skipif(not targets.plugin_available(), reason="needs jax's CUDA plugin")
def test_the_h100_program_holds_no_float32_logits():
  device = targets.devices(targets.parse("h100"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  logits = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16, sharding=sharding)
  labels = jax.ShapeDtypeStruct((512,), jnp.int32, sharding=sharding)

  def compiled(loss):
    step = jax.jit(jax.grad(lambda x, y: loss(x, y).mean()))
    return step.lower(logits, labels).compile()

  def float32_logit_buffers(program):
    # What the program's kernels write (every buffer but the arguments), not the values
    # inside a fusion.
    launched = hlo.launches(program.as_text())
    return [i["name"] for i, _, _ in launched if (f32, (512, 4096)) in hlo.arrays(i["type"])]

  f32 = np.dtype(np.float32)
  mine, theirs = compiled(xent), compiled(_optax_in_float32)
  assert float32_logit_buffers(theirs)  # the float32 logits the usual loss writes
  assert not float32_logit_buffers(mine)
  temp = [c.memory_analysis().temp_size_in_bytes for c in (mine, theirs)]
  assert temp[0] < 2**20 < temp[1], temp
