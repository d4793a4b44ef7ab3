"""Tests for mpx's attention: the exact unfused path, the dispatch to cuDNN's fused kernel, the audit.

The fused kernel cannot run without a GPU. What runs here: the exact path
against Flax and float64; the call mpx makes to cuDNN, with jax's reference
implementation of that call (``implementation="xla"``) in place of the
kernel, against float64; that off CUDA every call is bitwise the exact path;
and, compiled for an H100 without one, that the program holds cuDNN's fused
attention exactly when cuDNN is installed (else the audit says why not).
"""

import functools

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.audit import compiled, fused_attention, layer_paths, targets
from mpx._src.ops import attention

HALF = (jnp.float16, jnp.bfloat16)


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of its sub-jaxprs (jits, custom VJPs, branches), in order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _residuals(fn, *args):
  leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))
  return [(tuple(leaf.shape), np.dtype(leaf.dtype).name) for leaf in leaves]


def _reference(q, k, v, *, causal):
  """Attention in float64 NumPy (causal: query i sees keys 0..i)."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  scores = np.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  if causal:
    scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("...hqk,...khd->...qhd", weights, v)


def _qkv(dtype, batch=(2,), q_len=8, kv_len=8, heads=2, depth=16, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = [(*batch, q_len, heads, depth), *2 * [(*batch, kv_len, heads, depth)]]
  return [jax.random.normal(k, s).astype(dtype) for k, s in zip(keys, shapes, strict=True)]


# ---------------------------------------------------------------- the exact path


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_flax_in_float32(causal):
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 2, 4))
  mask = nn.make_causal_mask(jnp.ones((2, 5))).astype(bool) if causal else None
  want = nn.dot_product_attention(q, k, v, mask=mask)
  got = mpx.dot_product_attention(q, k, v, is_causal=causal)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_half_operands_float32_softmax():
  q = jnp.ones((1, 4, 2, 8), jnp.float16)
  jaxpr = jax.make_jaxpr(lambda q: mpx.dot_product_attention(q, q, q, implementation="xla"))(q)
  dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
  assert any(
    e.primitive.name == "exp" and e.outvars[0].aval.dtype == jnp.float32 for e in _eqns(jaxpr.jaxpr)
  )


@pytest.mark.slow
def test_attention_gradient_matches_flax_with_a_fully_masked_row():
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 2, 4))
  mask = jnp.tril(jnp.ones((5, 5), bool)).at[2].set(False)[None, None]  # query 2 sees nothing

  def loss(attention_fn, q, k, v):
    return jnp.sum(jnp.sin(attention_fn(q, k, v, mask=mask)))

  got = jax.grad(functools.partial(loss, mpx.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(functools.partial(loss, nn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_attention_backward_keeps_half_weights_and_the_mask_as_passed(dtype):
  q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8)).astype(dtype)
  mask = nn.make_causal_mask(jnp.ones((2, 16)))  # [batch, 1, q, k]: not per head

  def loss(q):
    return jnp.sum(jnp.sin(mpx.dot_product_attention(q, q, q, mask=mask)))

  residuals = _residuals(loss, q)
  weights = [r for r in residuals if r[0] == (2, 4, 16, 16)]
  assert weights == [((2, 4, 16, 16), np.dtype(dtype).name)], residuals
  assert ((2, 1, 16, 16), "bool") in residuals


# -------------------------------------------------------------- the dispatch


@pytest.mark.parametrize(
  ("dtype", "jit"), [(jnp.bfloat16, True), (jnp.float16, False), (jnp.float32, True)]
)
def test_off_cuda_every_call_is_bitwise_the_exact_path(dtype, jit):
  q, k, v = _qkv(dtype)

  def value_and_grads(implementation):
    def loss(q, k, v):
      out = mpx.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
      return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return (jax.jit(fn) if jit else fn)(q, k, v)

  got, want = value_and_grads(None), value_and_grads("xla")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize(
  ("dtype", "causal"),
  [(jnp.bfloat16, True), pytest.param(jnp.float16, False, marks=pytest.mark.slow)],
)
def test_the_fused_call_matches_float64(dtype, causal):
  # The call mpx makes to cuDNN (layout, one batch axis, scale, causal mode), run by jax's
  # reference implementation of the same call: float32 scores and softmax, probabilities
  # rounded to the operands' dtype, as cuDNN computes them.
  q, k, v = _qkv(dtype, batch=(3, 2), q_len=8, kv_len=12 if not causal else 8)
  with jax.numpy_dtype_promotion("standard"):  # jax's reference mixes bfloat16 and float32
    got = attention._cudnn(q, k, v, is_causal=causal, implementation="xla")
  assert got.dtype == dtype and got.shape == q.shape
  want = _reference(q, k, v, causal=causal)
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(
    np.float64(got), want, rtol=0, atol=4 * eps * float(np.abs(want).max())
  )
  exact = mpx.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  np.testing.assert_allclose(np.float64(exact), want, rtol=0, atol=8 * eps * np.abs(want).max())


def test_what_keeps_a_call_off_the_fused_kernel():
  q, k, v = _qkv(jnp.bfloat16)
  blocker = functools.partial(attention.fused_blocker, q, k, v)
  assert blocker(mask=jnp.ones((8, 8), bool)) == "mask"
  assert blocker(bias=jnp.zeros((8, 8), jnp.bfloat16)) == "bias"
  assert blocker(dropout=True) == "dropout"
  assert blocker(dot_general=jax.lax.dot_general) == "dot_general"
  assert blocker(precision=jax.lax.Precision.HIGHEST) == "precision"
  assert attention.fused_blocker(*_qkv(jnp.float32), is_causal=True) == "dtype"
  assert set(attention.REASONS) >= {"mask", "bias", "dropout", "dot_general", "dtype"}


def test_a_call_only_cudnn_can_run_is_refused_with_the_reason():
  q, k, v = _qkv(jnp.float32)
  with pytest.raises(mpx.ConfigError, match="float16 or bfloat16"):
    mpx.dot_product_attention(q, k, v, implementation="cudnn")
  with pytest.raises(mpx.ConfigError, match="implementation='flash'"):
    mpx.dot_product_attention(q, k, v, implementation="flash")


def test_the_unfused_path_names_its_reason_and_the_layer_path_ignores_it():
  q, k, v = _qkv(jnp.bfloat16)
  mask = jnp.tril(jnp.ones((8, 8), bool))
  text = (
    jax.jit(lambda q: mpx.dot_product_attention(q, k, v, mask=mask))
    .lower(q)
    .as_text(debug_info=True)
  )
  assert f"{attention.UNFUSED_SCOPE}_mask" in text
  name = f"jit(f)/jvp(Model)/cond/branch_1_fun/{attention.UNFUSED_SCOPE}_mask/attn/dot_general"
  assert layer_paths.module_path(name, "") == ("Model/attn", False)


# ------------------------------------------------------ the program for an H100

needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)


def _cudnn_traces_here() -> bool:
  """Whether jax can trace cuDNN's fused attention in this process (it checks the library)."""
  spec = jax.ShapeDtypeStruct((1, 8, 1, 16), jnp.bfloat16)
  try:
    jax.eval_shape(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"), spec)
  except RuntimeError:
    return False
  return True


class _Attention(nn.Module):
  causal_mask: bool  # a mask array (Flax's way) or is_causal=True (the fused kernel's)

  @nn.compact
  def __call__(self, x):
    if self.causal_mask:
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
      return nn.MultiHeadDotProductAttention(num_heads=4)(x, mask=mask)
    causal = functools.partial(mpx.dot_product_attention, is_causal=True)
    return nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=causal)(x)


def _audit(module, shape=(2, 128, 256)):
  model = mpx.linen.apply_policy(module, "mixed_bfloat16")
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(variables, x):
    return jax.grad(lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32)))(variables)

  return mpx.audit(step, variables, x, target="h100")


@needs_plugin
def test_the_h100_program_runs_cudnn_attention_exactly_where_cudnn_is_installed():
  report = _audit(_Attention(causal_mask=False))
  # The unfused attention's score products: [batch x heads, q, k] (XLA folds batch and heads).
  has_scores = any(g.result_shape[-2:] == (128, 128) for g in report.gemms)
  if _cudnn_traces_here():
    assert {(a.implementation, a.reason, a.is_backward) for a in report.attention} == {
      ("cudnn", None, False),
      ("cudnn", None, True),
    }
    fused = [g for g in report.gemms if g.kind == "attention"]
    assert [g.is_backward for g in fused] == [False, True]
    # 2 B N S T (H + Hv) forward, (3 H + 2 Hv) backward, over the causal half (T (T + 1) / 2).
    pairs = 2 * 4 * 128 * 129 // 2
    assert [g.flops for g in fused] == [2 * pairs * 128, 2 * pairs * 320]
    assert fused[0].dtypes == (np.dtype(jnp.bfloat16),) * 2
    assert not has_scores
    assert "attention: 2 passes fused (cuDNN flash attention)" in report.summary()
  else:
    assert {(a.implementation, a.reason) for a in report.attention} == {("xla", "no_cudnn")}
    assert not [g for g in report.gemms if g.kind == "attention"] and has_scores
    assert "cuDNN is not installed" in report.summary()


@needs_plugin
@pytest.mark.slow
def test_the_h100_program_says_why_a_masked_attention_is_unfused():
  masked = _audit(_Attention(causal_mask=True))
  assert {(a.implementation, a.reason) for a in masked.attention} == {("xla", "mask")}
  assert {a.module_path for a in masked.attention} == {"_Attention/MultiHeadDotProductAttention_0"}
  assert "pass is_causal=True and no mask" in masked.summary()


def test_an_nnx_layer_called_with_is_causal_reaches_mpx_attention_as_causal():
  model = nnx.MultiHeadAttention(2, 32, decode=False, rngs=nnx.Rngs(0))
  model = mpx.nnx.apply_policy(model, "mixed_bfloat16")
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  got = model(x, is_causal=True)
  want = model(x, mask=nnx.make_causal_mask(jnp.ones((2, 8))))
  np.testing.assert_array_equal(np.float32(got), np.float32(want))


# ----------------------------------------------------------- the audit's reading


_FMHA = (
  "ENTRY %main (q: bf16[2,64,4,32], k: bf16[2,48,4,32], v: bf16[2,48,4,16]) -> "
  "(bf16[2,4,64,16], f32[2,4,64], u8[0]) {\n"
  "  %q = bf16[2,64,4,32]{3,2,1,0} parameter(0)\n"
  "  %k = bf16[2,48,4,32]{3,2,1,0} parameter(1)\n"
  "  %v = bf16[2,48,4,16]{3,2,1,0} parameter(2)\n"
  "  ROOT %fmha = (bf16[2,4,64,16]{3,1,2,0}, f32[2,4,64]{2,1,0}, u8[0]{0}) custom-call(%q, %k, "
  '%v), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/jvp(M)/attn/'
  f'{attention.FUSED_SCOPE}/dot_product_attention_fwd"}}, backend_config={{'
  '"cudnn_fmha_backend_config": {"fmha_scale": 0.17, "intermediate_tensor_shape": '
  '{"element_type": "BF16", "dimensions": ["2", "4", "64", "48"], "tuple_shapes": []}, '
  '"mask_type": "MASK_TYPE"}}\n'
  "}\n"
)


@pytest.mark.parametrize("mask_type", ["NO_MASK", "CAUSAL"])
def test_the_audit_counts_a_fused_attention_calls_products(mask_type):
  text = _FMHA.replace("MASK_TYPE", mask_type)
  (gemm,) = compiled.gemms(text)
  share = (sum(min(i + 1, 48) for i in range(64)) / (64 * 48)) if mask_type == "CAUSAL" else 1
  assert gemm["kind"] == "attention" and gemm["backend"] == "cudnn"
  assert gemm["flops"] == round(2 * 2 * 4 * 64 * 48 * (32 + 16) * share)
  assert (gemm["lhs_shape"], gemm["rhs_shape"]) == ((2, 64, 4, 32), (2, 48, 4, 32))
  assert gemm["module_path"] == "M/attn" and not gemm["is_backward"]
  (call,) = fused_attention.calls(compiled.launches(text))
  assert call == dict(
    module_path="M/attn", is_backward=False, implementation="cudnn", reason=None, count=1
  )


@pytest.mark.parametrize(("t", "s"), [(8, 8), (8, 12), (12, 8), (1, 5)])
def test_the_causal_share_counts_the_scores_a_top_left_causal_mask_keeps(t, s):
  kept = np.tril(np.ones((t, s), bool)).sum()
  assert fused_attention.causal_share(t, s) == kept / (t * s)
