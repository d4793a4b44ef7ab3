"""Tests for the float32 kernels: softmax, attention, float32 accumulation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpx
from mpx._src import kernels

_DOT_DIMS = (((1,), (0,)), ((), ()))


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
  jaxpr = jax.make_jaxpr(mpx.softmax)(x)
  assert any(str(v.aval.dtype) == "float32" for e in jaxpr.eqns for v in e.outvars)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_flax_in_float32(causal):
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 2, 4))
  mask = nn.make_causal_mask(jnp.ones((2, 5))).astype(bool) if causal else None
  want = nn.dot_product_attention(q, k, v, mask=mask)
  got = mpx.dot_product_attention(q, k, v, is_causal=causal)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_half_operands_float32_softmax():
  q = jnp.ones((1, 4, 2, 8), jnp.float16)
  jaxpr = jax.make_jaxpr(lambda q: mpx.dot_product_attention(q, q, q))(q)
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
  assert any(
    e.primitive.name == "exp" and e.outvars[0].aval.dtype == jnp.float32 for e in jaxpr.eqns
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
