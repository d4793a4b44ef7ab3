"""Tests for mpx.losses.head_softmax_cross_entropy_with_integer_labels: the head fused into the loss."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import mpx
from mpx._src.audit import targets

head_xent = mpx.losses.head_softmax_cross_entropy_with_integer_labels
xent = mpx.losses.softmax_cross_entropy_with_integer_labels
TOKENS, D, VOCAB = 48, 32, 300


def _problem(dtype, batch=(TOKENS,), seed=0):
  """Features in multiples of 1/8 up to 4, a kernel in multiples of 1/32 up to 1: exact in
  every dtype, and so are the head's products in float32 (16 bits), whatever the order of
  their sums. The logits are then the exact product rounded to the dtype, on any backend and
  for any chunk shape, and a float64 reference can compute them."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  features = jnp.clip(jnp.round(8 * jax.random.normal(k1, (*batch, D))), -32, 32) / 8
  kernel = jnp.clip(jnp.round(16 * jax.random.normal(k2, (D, VOCAB))), -32, 32) / 32
  features, kernel = features.astype(dtype), kernel.astype(dtype)
  labels = jax.random.randint(k3, batch, 0, VOCAB)
  cotangent = jax.random.normal(k4, batch)  # of the per-example losses
  return features, kernel, labels, cotangent


def _loss_and_grads(loss, features, kernel, cotangent):
  @jax.jit
  def fn(features, kernel):
    out, pullback = jax.vjp(loss, features, kernel)
    return out, *pullback(cotangent)

  return fn(features, kernel)


def _unfused(features, kernel, labels, **kwargs):
  return xent(jnp.dot(features, kernel), labels, **kwargs)


def _f64(x):
  return np.asarray(x, np.float64)


# 300 classes: 2 chunks of 128 and a padded one; one chunk of 512; 300 chunks of 1. Each dtype
# and each chunking once in the fast suite, the rest of the product slow.
FAST = {(jnp.bfloat16, 128), (jnp.float16, 1), (jnp.float32, 512)}


@pytest.mark.parametrize(
  ("dtype", "chunk_size"),
  [
    pytest.param(dtype, chunk, marks=() if (dtype, chunk) in FAST else pytest.mark.slow)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
    for chunk in (128, 512, 1)
  ],
)
def test_against_float64(dtype, chunk_size):
  features, kernel, labels, cotangent = _problem(dtype)
  loss, d_features, d_kernel = _loss_and_grads(
    lambda f, k: head_xent(f, k, labels, chunk_size=chunk_size), features, kernel, cotangent
  )
  assert loss.dtype == jnp.float32 and d_features.dtype == d_kernel.dtype == dtype
  # The formula on the head's logits (the exact product rounded to the dtype), in float64.
  f, k, g = _f64(features), _f64(kernel), _f64(cotangent)
  x = _f64((f @ k).astype(dtype))
  m = x.max(-1, keepdims=True)
  lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
  rows = np.arange(TOKENS)
  # Float32 arithmetic: a few roundings of the log-sum-exp, and a relative error of the sum of
  # exponentials of at most one rounding per term summed plus three per chunk (the rescaling).
  chunks = -(-VOCAB // chunk_size)
  sum_error = (VOCAB + 3 * chunks + 4) * 2.0**-24
  atol = 8 * np.abs(lse).max() * 2.0**-24 + sum_error
  np.testing.assert_allclose(loss, lse[:, 0] - x[rows, labels], rtol=0, atol=atol)
  onehot = np.zeros_like(x)
  onehot[rows, labels] = 1.0
  d_logits = (np.exp(x - lse) - onehot) * g[:, None]
  # Each logit gradient: float32 arithmetic (the sum's error above, the exponential's and the
  # product's), then rounded once to the dtype (half an ulp, relative). The products accumulate
  # n terms in float32 (n roundings at most) and are rounded once more to the dtype. Hence
  # half an ulp of the dtype and the float32 errors, of the absolute products, and half an ulp
  # of the result.
  half_ulp = float(jnp.finfo(dtype).eps) / 2
  for got, want, bound, n in (
    (d_features, d_logits @ k.T, np.abs(d_logits) @ np.abs(k).T, VOCAB),
    (d_kernel, f.T @ d_logits, np.abs(f).T @ np.abs(d_logits), TOKENS),
  ):
    err = np.abs(_f64(got) - want)
    tol = (half_ulp + sum_error + (n + 4) * 2.0**-24) * bound + half_ulp * np.abs(want)
    assert np.all(err <= tol), np.max(err / tol)


@pytest.mark.parametrize(
  ("dtype", "where"),
  [(jnp.bfloat16, True), pytest.param(jnp.float16, False, marks=pytest.mark.slow)],
)
def test_the_unfused_loss_on_the_same_logits(dtype, where):
  features, kernel, labels, cotangent = _problem(dtype, batch=(4, 12), seed=1)
  kwargs = {"where": jnp.arange(48).reshape(4, 12) % 5 != 0} if where else {}
  got = _loss_and_grads(
    lambda f, k: head_xent(f, k, labels, chunk_size=64, **kwargs), features, kernel, cotangent
  )
  want = _loss_and_grads(lambda f, k: _unfused(f, k, labels, **kwargs), features, kernel, cotangent)
  assert got[0].shape == labels.shape
  if where:  # excluded examples: no loss, no gradient
    excluded = ~kwargs["where"]
    assert np.all(np.asarray(got[0])[excluded] == 0) and np.all(_f64(got[1])[excluded] == 0)
  np.testing.assert_allclose(got[0], want[0], rtol=2**-20, atol=0)
  # The logit gradients agree to float32 rounding before the one rounding to the dtype, so the
  # two differ by an ulp at most where float32 arithmetic straddles a rounding boundary.
  eps = float(jnp.finfo(dtype).eps)
  for mine, theirs in zip(got[1:], want[1:], strict=True):
    mine, theirs = _f64(mine), _f64(theirs)
    np.testing.assert_allclose(mine, theirs, rtol=eps, atol=eps * np.abs(theirs).max())
    assert np.mean(mine == theirs) > 0.9


@pytest.mark.slow  # where's fast representative: the comparison with the unfused loss
def test_where_drops_examples_and_their_gradients():
  features, kernel, labels, cotangent = _problem(jnp.bfloat16)
  keep = jnp.arange(TOKENS) % 3 != 0
  loss, d_features, d_kernel = _loss_and_grads(
    lambda f, k: head_xent(f, k, labels, chunk_size=128, where=keep), features, kernel, cotangent
  )
  np.testing.assert_array_equal(loss[~keep], 0.0)
  np.testing.assert_array_equal(_f64(d_features)[~keep], 0.0)
  kept = _loss_and_grads(
    lambda f, k: head_xent(f, k, labels[keep], chunk_size=128),
    features[keep],
    kernel,
    cotangent[keep],
  )
  np.testing.assert_array_equal(loss[keep], kept[0])
  np.testing.assert_array_equal(_f64(d_features)[keep], _f64(kept[1]))
  # The kernel's gradient sums over examples: the same terms, rounded once, in any order.
  np.testing.assert_allclose(_f64(d_kernel), _f64(kept[2]), rtol=2**-7, atol=1e-6)


def test_a_float32_kernel_is_cast_to_the_features_dtype():
  features, kernel, labels, _ = _problem(jnp.bfloat16)
  master = kernel.astype(jnp.float32)  # exactly the bfloat16 values

  @jax.jit
  def loss_and_grad(k):
    return jax.value_and_grad(lambda k: head_xent(features, k, labels, chunk_size=128).mean())(k)

  (loss, grad), (want_loss, want_grad) = loss_and_grad(master), loss_and_grad(kernel)
  assert grad.dtype == jnp.float32
  np.testing.assert_array_equal(loss, want_loss)
  np.testing.assert_array_equal(grad, want_grad.astype(jnp.float32))


def test_no_tokens_by_vocab_array_in_the_step():
  features, kernel, labels, _ = _problem(jnp.bfloat16)

  def largest(loss):
    def step(f, k):
      return jax.grad(lambda f, k: loss(f, k, labels).mean(), (0, 1))(f, k)

    def sizes(jaxpr):
      for eqn in jaxpr.eqns:
        yield from (v.aval.size for v in eqn.outvars if hasattr(v.aval, "size"))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          yield from sizes(sub)

    return max(sizes(jax.make_jaxpr(step)(features, kernel).jaxpr))

  assert largest(_unfused) == TOKENS * VOCAB  # the logits and their gradients
  # The kernel padded to 5 chunks of 64 classes (and its gradient), no logits.
  assert largest(lambda f, k, y: head_xent(f, k, y, chunk_size=64)) == D * 320


def test_bad_inputs_name_the_fix():
  features, kernel, labels, _ = _problem(jnp.bfloat16)
  with pytest.raises(mpx.LeafTypeError, match=r"features of dtype int32.*astype"):
    head_xent(features.astype(jnp.int32), kernel, labels)
  with pytest.raises(mpx.LeafTypeError, match="kernel of dtype int32"):
    head_xent(features, kernel.astype(jnp.int32), labels)
  with pytest.raises(mpx.LeafTypeError, match="integer class ids"):
    head_xent(features, kernel, labels.astype(jnp.float32))
  with pytest.raises(mpx.TreeStructureError, match=r"embedding\.T"):
    head_xent(features, kernel.T, labels)
  with pytest.raises(mpx.TreeStructureError, match=r"labels of shape \[47\]"):
    head_xent(features, kernel, labels[1:])
  with pytest.raises(mpx.TreeStructureError, match="where of shape"):
    head_xent(features, kernel, labels, where=jnp.ones((TOKENS, VOCAB), jnp.bool_))
  with pytest.raises(mpx.ConfigError, match="chunk_size=0"):
    head_xent(features, kernel, labels, chunk_size=0)


@pytest.mark.skipif(not targets.plugin_available(), reason="needs jax's CUDA plugin")
def test_the_h100_step_holds_no_logits():
  tokens, d, vocab = 8192, 256, 65536
  args = (
    jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16),
    jax.ShapeDtypeStruct((tokens,), jnp.int32),
  )

  def temp_bytes(loss):
    step = jax.jit(jax.grad(lambda f, k, y: loss(f, k, y).mean(), argnums=(0, 1)))
    return mpx.audit(step, *args, target="h100").memory.temp_bytes

  chunked, unfused = temp_bytes(head_xent), temp_bytes(_unfused)
  logits = tokens * vocab * 2
  assert unfused >= logits  # the unfused step holds the bfloat16 logits (or their gradients)
  assert chunked < logits / 2 and chunked < unfused / 3, (chunked, unfused)
