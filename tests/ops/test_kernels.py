"""Tests for the float32 kernels: softmax, attention, float32 accumulation."""

import functools

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import mpx
from mpx._src.ops import kernels

_DOT_DIMS = (((1,), (0,)), ((), ()))


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of its sub-jaxprs (jits, custom VJPs), in order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _matmul_lines(fn, *args):
  text = jax.jit(fn).lower(*args).as_text()
  return [line for line in text.splitlines() if "dot_general" in line or "convolution" in line]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_softmax_in_float32(dtype):
  x = jnp.array([0.0, 10.0, 20.0, 30.0], dtype)
  got = mpx.softmax(x)
  assert got.dtype == dtype
  want = np.exp(np.float64(x) - 30.0) / np.exp(np.float64(x) - 30.0).sum()
  np.testing.assert_allclose(np.float64(got), want, rtol=1e-2, atol=1e-6)
  jaxpr = jax.make_jaxpr(mpx.softmax)(x).jaxpr
  assert any(str(v.aval.dtype) == "float32" for e in _eqns(jaxpr) for v in e.outvars)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_flax_in_float32(causal):
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 2, 4))
  mask = nn.make_causal_mask(jnp.ones((2, 5))).astype(bool) if causal else None
  want = nn.dot_product_attention(q, k, v, mask=mask)
  got = mpx.dot_product_attention(q, k, v, is_causal=causal)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_half_operands_float32_softmax():
  q = jnp.ones((1, 4, 2, 8), jnp.float16)
  jaxpr = jax.make_jaxpr(lambda q: mpx.dot_product_attention(q, q, q))(q).jaxpr
  dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
  assert any(
    e.primitive.name == "exp" and e.outvars[0].aval.dtype == jnp.float32 for e in _eqns(jaxpr)
  )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_accumulating_dot_general_backward_keeps_half_operands(dtype):
  a = jax.random.normal(jax.random.key(0), (4, 8)).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (8, 16)).astype(dtype)
  dot = kernels.dot_general_f32_accumulation

  def loss(a, b):
    return dot(a, b, _DOT_DIMS).astype(jnp.float32).sum()

  lines = _matmul_lines(jax.value_and_grad(loss, argnums=(0, 1)), a, b)
  half = {jnp.float16: "f16", jnp.bfloat16: "bf16"}[dtype]
  assert len(lines) == 3
  for line in lines:
    operands = line.split(":")[-1].split("->")[0]
    assert operands.count(f"x{half}>") == 2 and "f32>" not in operands
    assert line.endswith("xf32>")
  got = jax.grad(loss, argnums=(0, 1))(a, b)
  want = jax.grad(lambda a, b: (a @ b).astype(jnp.float32).sum(), argnums=(0, 1))(
    a.astype(jnp.float32), b.astype(jnp.float32)
  )
  for g, w in zip(got, want, strict=True):
    assert g.dtype == dtype
    np.testing.assert_allclose(np.float32(g), w, rtol=2e-2, atol=2e-2)


def test_accumulating_conv_backward_keeps_half_operands():
  x = jnp.ones((2, 6, 6, 3), jnp.bfloat16)
  k = jnp.ones((3, 3, 3, 8), jnp.bfloat16)
  conv = kernels.conv_general_dilated_f32_accumulation

  def loss(x, k):
    y = conv(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert y.dtype == jnp.bfloat16
    return y.astype(jnp.float32).sum()

  lines = _matmul_lines(jax.value_and_grad(loss, argnums=(0, 1)), x, k)
  assert len(lines) == 3
  for line in lines:
    operands = line.split(":")[-1].split("->")[0]
    assert operands.count("xbf16>") == 2 and line.endswith("xf32>")


def _residuals(fn, *args):
  leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))
  return [(tuple(leaf.shape), np.dtype(leaf.dtype).name) for leaf in leaves]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_gradient_matches_float32_autodiff(dtype, masked):
  x = (4.0 * jax.random.normal(jax.random.key(0), (3, 16))).astype(dtype)
  w = jax.random.normal(jax.random.key(1), (3, 16))
  where = jnp.arange(16) % 3 != 0 if masked else None

  def loss(x):
    return jnp.sum(mpx.softmax(x, where=where).astype(jnp.float32) * w)

  def reference(x):
    return jnp.sum(jax.nn.softmax(x.astype(jnp.float32), where=where) * w)

  got, want = jax.grad(loss)(x), jax.grad(reference)(x)
  assert got.dtype == dtype
  # The backward pass reads the output rounded to the input's dtype.
  eps = float(jnp.finfo(dtype).eps) if dtype != jnp.float32 else 1e-6
  np.testing.assert_allclose(np.float32(got), want, rtol=4 * eps, atol=4 * eps * np.abs(want).max())
  if masked:
    assert not np.float32(got)[:, ::3].any()


def test_attention_gradient_matches_flax_with_a_fully_masked_row():
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 2, 4))
  mask = jnp.tril(jnp.ones((5, 5), bool)).at[2].set(False)[None, None]  # query 2 sees nothing

  def loss(attention, q, k, v):
    return jnp.sum(jnp.sin(attention(q, k, v, mask=mask)))

  got = jax.grad(functools.partial(loss, mpx.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(functools.partial(loss, nn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_attention_backward_keeps_half_weights_and_the_mask_as_passed(dtype):
  q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8)).astype(dtype)
  mask = nn.make_causal_mask(jnp.ones((2, 16)))  # [batch, 1, q, k]: not per head

  def loss(q):
    return jnp.sum(jnp.sin(mpx.dot_product_attention(q, q, q, mask=mask)))

  residuals = _residuals(loss, q)
  weights = [r for r in residuals if r[0] == (2, 4, 16, 16)]
  assert weights == [((2, 4, 16, 16), np.dtype(dtype).name)], residuals
  assert ((2, 1, 16, 16), "bool") in residuals
