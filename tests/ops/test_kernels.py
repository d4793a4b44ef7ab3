"""Tests for the float32 kernels: softmax, float32 accumulation (attention: test_attention.py)."""

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


@pytest.mark.slow
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
