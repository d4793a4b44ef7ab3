"""Attention for half-precision models: cuDNN's fused kernel where a call allows it, else exact.

:func:`dot_product_attention` is the ``attention_fn`` the policies give Flax
attention layers. Its contract: both matmuls take the compute dtype, the
softmax between them runs in float32. Two implementations keep it:

* the fused one, cuDNN's flash attention (``jax.nn.dot_product_attention(...,
  implementation="cudnn")``): the scores are computed tile by tile in float32
  inside the kernel and never written to memory; the softmax statistics it
  saves for the backward pass are float32;
* the exact unfused one (the only one before): the scores in the compute
  dtype, :func:`mpx.softmax` (float32 inside) and the weights in the compute
  dtype for the second matmul, each written to memory.

Which one a call gets is decided from what it passes (static: shapes, dtypes,
mask kind), and then per platform with ``jax.lax.platform_dependent``: one
trace, and each lowering takes its own branch, so a step traced on a CPU for
an H100 target compiles the fused kernel while the same step run on the CPU
stays the exact path, bit for bit what it was. Each implementation runs under
a name scope (:data:`FUSED_SCOPE`, or :data:`UNFUSED_SCOPE` and a reason of
:data:`REASONS`) that reaches the compiled program's ``op_name`` metadata, so
the audit can say which attention a step got, and why.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src.ops import kernels

#: The name scope of the fused (cuDNN) attention.
FUSED_SCOPE = "mpx_attention_cudnn"
#: The name scope of the exact unfused attention, followed by ``_<reason>``.
UNFUSED_SCOPE = "mpx_attention_xla"
#: A regular expression matching both scopes.
SCOPES = rf"{FUSED_SCOPE}|{UNFUSED_SCOPE}_\w+"
#: Why a call runs the unfused attention: reason token -> what it means.
REASONS = {
  "requested": "implementation='xla' was passed",
  "dtype": "the operands are not float16 or bfloat16",
  "bias": "an additive bias was passed",
  "mask": "a mask array was passed (for causal attention pass is_causal=True and no mask)",
  "dropout": "attention dropout is active",
  "dot_general": "a custom dot_general (e.g. float8 matmuls) was passed",
  "precision": "a matmul precision was passed",
  "no_cudnn": "cuDNN is not installed where the step was traced, so its fused attention could "
  "not be built",
  "unsupported": "cuDNN's fused attention does not take these shapes (head dim, lengths)",
  "platform": "the program runs on a platform other than a CUDA GPU",
}
_FUSED_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _exact(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  bias: jax.Array | None,
  mask: jax.Array | None,
  broadcast_dropout: bool,
  dropout_rng: jax.Array | None,
  dropout_rate: float,
  deterministic: bool,
  precision: Any,
  is_causal: bool,
  dot_general: Any,
) -> jax.Array:
  """The unfused attention: scores, float32 softmax and weights in the operands' dtype."""
  dtype = query.dtype
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  contract = jax.lax.dot_general if dot_general is None else dot_general
  logits = jnp.einsum(
    "...qhd,...khd->...hqk", query, key, precision=precision, _dot_general=contract
  )
  if bias is not None:
    logits = logits + bias.astype(dtype)
  if is_causal:
    causal = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  # Masked logits are filled with the lowest value, as Flax does (a row masked
  # entirely gets uniform weights), inside the softmax's custom VJP, so the
  # backward pass keeps the mask as given instead of broadcast to every head.
  fill = None
  if mask is not None:  # Flax's masks are float32 (make_causal_mask): keep 1 byte each.
    mask, fill = jnp.asarray(mask, jnp.bool_), float(jnp.finfo(dtype).min)
  weights = cast(jax.Array, kernels._softmax(logits, mask, -1, fill))
  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      raise errors.ConfigError(
        f"Attention dropout (rate {dropout_rate}) needs a dropout_rng; pass one, or "
        "deterministic=True."
      )
    keep_prob = 1.0 - dropout_rate
    shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = jnp.where(keep, weights / jnp.asarray(keep_prob, dtype), jnp.zeros((), dtype))
  return jnp.einsum(
    "...hqk,...khd->...qhd", weights, value, precision=precision, _dot_general=contract
  )


def _cudnn(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  is_causal: bool,
  implementation: Literal["cudnn", "xla"] = "cudnn",
) -> jax.Array:
  """cuDNN's flash attention on ``[batch..., length, heads, depth]`` operands.

  ``implementation="xla"`` runs jax's reference implementation of the same
  call (float32 scores and softmax, probabilities in the operands' dtype), to
  check the call where cuDNN cannot run.
  """
  *batch, q_len, heads, depth = query.shape
  as_4d = lambda t: t.reshape(-1, *t.shape[-3:])  # noqa: E731  (cuDNN takes one batch axis)
  out = jax.nn.dot_product_attention(
    as_4d(query),
    as_4d(key),
    as_4d(value),
    scale=1.0 / float(np.sqrt(depth)),
    is_causal=is_causal,
    implementation=implementation,
  )
  return out.reshape(*batch, q_len, heads, value.shape[-1])


@functools.lru_cache(maxsize=128)
def _cudnn_blocker(
  q_shape: tuple[int, ...],
  kv_shape: tuple[int, ...],
  v_shape: tuple[int, ...],
  dtype: Any,
  is_causal: bool,
) -> str | None:
  """Why cuDNN's fused attention cannot be built for these operands here, or ``None``.

  jax checks, while tracing, that the cuDNN library loads and that it takes
  the shapes; tracing the call alone (``eval_shape``: nothing is compiled or
  run) asks both questions without committing the step to the answer.
  """
  spec = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  try:
    jax.eval_shape(
      functools.partial(_cudnn, is_causal=is_causal), spec(q_shape), spec(kv_shape), spec(v_shape)
    )
  except RuntimeError:  # "cuDNN not found." / "cuDNN is not detected."
    return "no_cudnn"
  except (NotImplementedError, ValueError):
    return "unsupported"
  return None


def cudnn_blocker_cache_clear() -> None:
  """Forgets which shapes cuDNN could not be traced for (jax's CUDA plugin was just loaded)."""
  _cudnn_blocker.cache_clear()


def fused_blocker(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  bias: Any = None,
  mask: Any = None,
  dropout: bool = False,
  precision: Any = None,
  is_causal: bool = False,
  dot_general: Any = None,
) -> str | None:
  """Why a call of :func:`dot_product_attention` cannot run cuDNN's fused attention.

  Static: decided from what the call passes (shapes, dtypes, the kind of
  mask), never from array values.

  Args:
    query: the query, in the compute dtype.
    key: the key, likewise.
    value: the value, likewise.
    bias: the call's bias.
    mask: the call's mask.
    dropout: whether attention dropout is active.
    precision: the call's matmul precision.
    is_causal: the call's ``is_causal``.
    dot_general: the call's ``dot_general``.

  Returns:
    A key of :data:`REASONS`, or ``None`` when the fused attention can be
    built for a CUDA GPU.
  """
  if query.dtype not in _FUSED_DTYPES:
    return "dtype"
  checks = (
    ("bias", bias is not None),
    ("mask", mask is not None),
    ("dropout", dropout),
    ("dot_general", dot_general is not None),
    ("precision", precision is not None),
  )
  for reason, blocks in checks:
    if blocks:
      return reason
  return _cudnn_blocker(
    tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, bool(is_causal)
  )


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  broadcast_dropout: bool = True,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype: Any = None,
  precision: Any = None,
  module: Any = None,
  is_causal: bool = False,
  dot_general: Any = None,
  implementation: str | None = None,
  **unused: Any,
) -> jax.Array:
  """Flax-compatible attention whose softmax runs in float32; cuDNN's flash attention on a GPU.

  A drop-in ``attention_fn`` for ``nn.MultiHeadDotProductAttention`` and
  ``nnx.MultiHeadAttention``; ``apply_policy`` installs it on attention
  layers left at Flax's default when ``KeepRules.softmax_in_float32`` is set.
  Both matmuls take ``dtype`` operands and the softmax runs in float32, in one
  of two implementations chosen per call:

  * **fused** (cuDNN's flash attention, ``jax.nn.dot_product_attention(...,
    implementation="cudnn")``), when the program runs on a CUDA GPU and the
    call allows it: float16 or bfloat16 operands, no mask array (causal
    attention: ``is_causal=True``), no bias, no active dropout, no custom
    ``dot_general`` or ``precision``, and shapes cuDNN takes (head dim a
    multiple of 8, at most 128 when traced off a Hopper GPU). The scores stay
    in float32 inside the kernel (they are not rounded to ``dtype`` before
    the softmax, as in the unfused path) and are never written to memory;
    the probabilities are rounded to ``dtype`` for the second matmul, as in
    the unfused path. A causal kernel skips the masked half of the work.
  * **exact** (unfused) otherwise, and always off CUDA: the scores in
    ``dtype``, :func:`mpx.softmax` (float32 inside; the backward pass keeps
    the ``dtype`` weights and the mask as passed, not float32 copies), then
    the weights in ``dtype``. (Flax's own ``force_fp32_for_softmax`` leaves
    the weights in float32, so the following matmul would run in float32.)

  The choice between them is static (what the call passes) and made per
  platform when the step is lowered (``jax.lax.platform_dependent``): a step
  compiled for a GPU without one (``mpx.audit(..., target="h100")``) gets the
  fused kernel, the same step run on a CPU the exact path. Where cuDNN is not
  installed, the fused kernel cannot be built and the call runs the exact
  path; the audit says so. ``module`` is accepted and ignored: attention
  weights are not sown.

  Args:
    query: ``[batch..., q_length, heads, depth]``.
    key: ``[batch..., kv_length, heads, depth]``.
    value: ``[batch..., kv_length, heads, v_depth]``.
    bias: optional additive bias, broadcastable to the weights.
    mask: optional boolean mask, broadcastable to the weights.
    broadcast_dropout: share the dropout mask over batch and heads.
    dropout_rng: key for attention dropout.
    dropout_rate: attention dropout rate.
    deterministic: disable dropout.
    dtype: the compute dtype (default: that of ``query``).
    precision: matmul precision.
    module: ignored.
    is_causal: causal attention (query ``i`` sees keys ``0..i``), without a
      mask array: the fused kernel's causal mode.
    dot_general: the contraction of both matmuls (``None``:
      ``jax.lax.dot_general``), e.g. :func:`mpx.fp8.fp8_dot_general`.
    implementation: ``None`` (fused where the call and the platform allow
      it, else exact), ``"xla"`` (always exact) or ``"cudnn"`` (always fused;
      an error where the call does not allow it, and the step then lowers
      for CUDA GPUs only).
    **unused: other arguments Flax may pass.

  Returns:
    ``[batch..., q_length, heads, v_depth]`` in ``dtype``.

  Raises:
    ConfigError: ``implementation`` is not one of the three, or is
      ``"cudnn"`` for a call the fused kernel cannot run.
  """
  del module, unused
  if implementation not in (None, "xla", "cudnn"):
    raise errors.ConfigError(
      f"implementation={implementation!r}: pass None (fused where possible), 'xla' or 'cudnn'."
    )
  dtype = jnp.dtype(dtype or query.dtype)
  query, key, value = (t.astype(dtype) for t in (query, key, value))
  dropout = not deterministic and dropout_rate > 0.0
  exact = functools.partial(
    _exact,
    bias=bias,
    mask=mask,
    broadcast_dropout=broadcast_dropout,
    dropout_rng=dropout_rng,
    dropout_rate=dropout_rate,
    deterministic=deterministic,
    precision=precision,
    is_causal=is_causal,
    dot_general=dot_general,
  )
  reason = (
    "requested"
    if implementation == "xla"
    else fused_blocker(
      query,
      key,
      value,
      bias=bias,
      mask=mask,
      dropout=dropout,
      precision=precision,
      is_causal=is_causal,
      dot_general=dot_general,
    )
  )
  if implementation == "cudnn" and reason is not None:
    raise errors.ConfigError(
      f"implementation='cudnn': cuDNN's fused attention cannot run this call: {REASONS[reason]}."
      " Pass implementation=None to fall back to the exact attention where it cannot."
    )

  def unfused(why: str, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    with jax.named_scope(f"{UNFUSED_SCOPE}_{why}"):
      return exact(q, k, v)

  def fused(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    with jax.named_scope(FUSED_SCOPE):
      return _cudnn(q, k, v, is_causal=is_causal)

  if reason is not None:
    return unfused(reason, query, key, value)
  if implementation == "cudnn":
    return fused(query, key, value)
  return jax.lax.platform_dependent(
    query, key, value, cuda=fused, default=functools.partial(unfused, "platform")
  )
