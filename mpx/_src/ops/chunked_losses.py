"""The head's matmul and the cross-entropy fused, chunk by chunk of the vocabulary.

:func:`mpx.losses.softmax_cross_entropy_with_integer_labels` takes the logits,
so the head must write them: ``[tokens, vocab]`` in the compute dtype, and
their gradients as large again. For a 128k vocabulary at 8k tokens that is
2 GiB each in bfloat16. :func:`head_softmax_cross_entropy_with_integer_labels`
takes the head's input and kernel instead and never holds more than one
``[tokens, chunk_size]`` slice of the logits: a loop over vocabulary chunks
computes each slice with the head's matmul and folds it into a running
(maximum, sum of exponentials) in float32; the backward pass loops again,
recomputes each slice, and turns it into that slice's logit gradients, which
two matmuls consume at once (the features' gradient, accumulated in float32
over the chunks, and the chunk's columns of the kernel's gradient). The price
is the head's forward matmul run twice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors


def _columns(kernel: jax.Array, i: jax.Array, chunk: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(kernel, i * chunk, chunk, axis=1)


def _chunk_logits(features: jax.Array, columns: jax.Array) -> jax.Array:
  """A chunk's logits, ``[tokens, chunk]``, as the head writes them, widened to float32.

  The product accumulates in float32 (asked for, not left to the backend: a
  CPU may multiply half precision in another order or width) and is rounded
  to the compute dtype: an H100's GEMM writes the chunk in that dtype.
  """
  wide = dtypes_lib.at_least_float32(features.dtype)
  logits = jnp.dot(features, columns, preferred_element_type=wide).astype(features.dtype)
  return logits.astype(wide)


def _classes(i: jax.Array, chunk: int) -> jax.Array:
  return i * chunk + jax.lax.iota(jnp.int32, chunk)


def _forward(
  features: jax.Array, kernel: jax.Array, labels: jax.Array, vocab: int, chunk: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The per-example loss, maximum logit and sum of exponentials, all float32, ``[tokens]``."""
  wide = dtypes_lib.at_least_float32(features.dtype)

  def body(i, carry):
    amax, sumexp, label_logit = carry
    classes = _classes(i, chunk)
    x = _chunk_logits(features, _columns(kernel, i, chunk))
    x = jnp.where(classes < vocab, x, jnp.asarray(-np.inf, wide))  # the padding is no class
    new_max = jnp.maximum(amax, jnp.max(x, axis=-1))
    # The first chunk rescales an empty sum: exp(-inf) is 0, not nan, as new_max is finite.
    sumexp = sumexp * jnp.exp(amax - new_max) + jnp.sum(jnp.exp(x - new_max[:, None]), axis=-1)
    hit = classes == labels[:, None]
    label_logit = label_logit + jnp.sum(jnp.where(hit, x, jnp.zeros((), wide)), axis=-1)
    return new_max, sumexp, label_logit

  tokens = features.shape[0]
  init = (
    jnp.full((tokens,), -np.inf, wide),
    jnp.zeros((tokens,), wide),
    jnp.zeros((tokens,), wide),
  )
  amax, sumexp, label_logit = jax.lax.fori_loop(0, kernel.shape[1] // chunk, body, init)
  return amax + jnp.log(sumexp) - label_logit, amax, sumexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_cross_entropy(
  features: jax.Array,
  kernel: jax.Array,
  labels: jax.Array,
  keep: jax.Array,
  vocab: int,
  chunk: int,
) -> jax.Array:
  out, _, _ = _forward(features, kernel, labels, vocab, chunk)
  return jnp.where(keep, out, jnp.zeros((), out.dtype))


def _head_cross_entropy_fwd(features, kernel, labels, keep, vocab, chunk):
  out, amax, sumexp = _forward(features, kernel, labels, vocab, chunk)
  out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out, (features, kernel, labels, keep, amax, sumexp)


def _head_cross_entropy_bwd(vocab, chunk, res, g):
  del vocab  # the padded classes are harmless here (see below)
  features, kernel, labels, keep, amax, sumexp = res
  g = jnp.where(keep, g, jnp.zeros((), g.dtype)).astype(sumexp.dtype)[:, None]
  amax, scale = amax[:, None], g / sumexp[:, None]

  def body(i, carry):
    d_features, d_kernel = carry
    classes = _classes(i, chunk)
    columns = _columns(kernel, i, chunk)
    x = _chunk_logits(features, columns)
    # softmax(x) * g as the unfused loss multiplies it out: x - amax is exact, so the
    # probabilities carry no error from the log-normaliser's magnitude. The label's -g after.
    grad = jnp.exp(x - amax) * scale
    grad = jnp.where(classes == labels[:, None], grad - g, grad)
    # The padding's gradients need no mask: its kernel columns are zeros, so they add nothing
    # to the features' gradient, and the pad's own VJP drops their columns of the kernel's.
    grad = grad.astype(features.dtype)
    d_features = d_features + jnp.dot(grad, columns.T, preferred_element_type=d_features.dtype)
    d_columns = jnp.dot(features.T, grad)
    return d_features, jax.lax.dynamic_update_slice_in_dim(d_kernel, d_columns, i * chunk, axis=1)

  init = (jnp.zeros(features.shape, sumexp.dtype), jnp.zeros_like(kernel))
  d_features, d_kernel = jax.lax.fori_loop(0, kernel.shape[1] // chunk, body, init)
  return d_features.astype(features.dtype), d_kernel, None, None


_head_cross_entropy.defvjp(_head_cross_entropy_fwd, _head_cross_entropy_bwd)


def head_softmax_cross_entropy_with_integer_labels(
  features: jax.Array,
  kernel: jax.Array,
  labels: jax.Array,
  *,
  chunk_size: int = 8192,
  where: jax.Array | None = None,
) -> jax.Array:
  r"""The cross-entropy of a linear head's logits, chunked over the vocabulary, in float32.

  Equal, to float32 rounding, to
  ``softmax_cross_entropy_with_integer_labels(jnp.dot(features, kernel), labels)``
  (the head's logits in the compute dtype, the loss on them in float32), but
  the ``[tokens, vocab]`` logits and their gradients never exist: a loop over
  chunks of ``chunk_size`` classes computes each chunk's logits
  :math:`x_{ij}` with the head's matmul (float32 accumulation, rounded to the
  compute dtype, as the unfused head rounds them) and keeps, per example, a
  running maximum :math:`m_i` and sum of exponentials in float32:

  .. math::

    \ell_i = m_i + \log \sum_j e^{x_{ij} - m_i} - x_{i y_i}.

  The backward pass loops over the chunks again, recomputes their logits and
  forms the logit gradients :math:`g_i\,(\mathrm{softmax}(x_i) -
  \mathrm{onehot}(y_i))` in float32, rounded once to the compute dtype as the
  unfused loss rounds them; from them the features' gradient accumulates in
  float32 over the chunks and each chunk writes its columns of the kernel's
  gradient. The pass saves the inputs and two float32 numbers per example (the
  maximum and the sum of exponentials, as the unfused loss does: the
  probabilities are then free of the log-normaliser's rounding, which float32
  gradients would show); it costs one more head matmul than the unfused head.

  The compute dtype is the features': a kernel of another dtype (float32
  master weights with bfloat16 features) is cast to it first, as a Flax
  ``Dense(dtype=features.dtype)`` casts it, and its gradient comes back in its
  own dtype.

  Args:
    features: the head's input, ``[batch..., d]``, any floating dtype
      (typically the compute dtype, float16 or bfloat16).
    kernel: the head's kernel, ``[d, vocab]``: a ``Dense`` head's ``kernel``,
      or ``embedding.T`` for a head tied to the embedding table.
    labels: integer class ids, ``[batch...]``, in ``[0, vocab)``.
    chunk_size: classes per chunk (the last chunk is padded; the padding
      counts as no class). Memory holds a few ``[tokens, chunk_size]``
      arrays; larger chunks mean fewer, larger matmuls.
    where: examples to include, a boolean ``[batch...]``; excluded examples
      get loss 0 and no gradient. Unlike the unfused loss, no per-class mask.

  Returns:
    The cross-entropy per example, ``[batch...]``, in float32 (float64 for
    float64 features).

  Raises:
    LeafTypeError: ``features`` or ``kernel`` are not floating, or ``labels``
      not integers.
    TreeStructureError: the shapes do not fit (``kernel`` not ``[d, vocab]``
      with the features' ``d``, ``labels`` or ``where`` not ``[batch...]``).
    ConfigError: ``chunk_size`` is below 1.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> features = jnp.array([[0.5, -1.0], [1.5, 0.25]], jnp.bfloat16)
    >>> kernel = jnp.array([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0]], jnp.bfloat16)
    >>> labels = jnp.array([0, 2])
    >>> mpx.losses.head_softmax_cross_entropy_with_integer_labels(
    ...   features, kernel, labels, chunk_size=2
    ... )
    Array([0.11409557, 0.70025396], dtype=float32)
    >>> mpx.losses.softmax_cross_entropy_with_integer_labels(features @ kernel, labels)
    Array([0.11409557, 0.70025396], dtype=float32)
  """
  features, kernel, labels = jnp.asarray(features), jnp.asarray(kernel), jnp.asarray(labels)
  for name, x in (("features", features), ("kernel", kernel)):
    if not dtypes_lib.is_floating(x.dtype):
      raise errors.LeafTypeError(
        f"{name} of dtype {x.dtype}: the head's cross-entropy takes floating features and "
        f"kernel (float16, bfloat16, float32...); cast them, e.g. {name}.astype(jnp.bfloat16)."
      )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise errors.LeafTypeError(
      f"labels of dtype {labels.dtype}: the head's cross-entropy takes integer class ids; for "
      "one-hot or soft labels compute the logits and use optax.softmax_cross_entropy."
    )
  if features.ndim < 1 or kernel.ndim != 2 or kernel.shape[0] != features.shape[-1]:
    raise errors.TreeStructureError(
      f"features of shape {list(features.shape)} and kernel of shape {list(kernel.shape)}: "
      "the kernel must be [d, vocab] with the features' last dimension d; for a head tied to "
      "an embedding table of shape [vocab, d], pass its transpose, embedding.T."
    )
  batch = features.shape[:-1]
  for name, x in (("labels", labels), ("where", where)):
    if x is not None and np.shape(x) != batch:
      raise errors.TreeStructureError(
        f"{name} of shape {list(np.shape(x))} with features of shape {list(features.shape)}: "
        f"{name} must have the features' batch shape {list(batch)} (one per example)."
      )
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise errors.ConfigError(
      f"chunk_size={chunk_size!r}: the classes per chunk must be a positive int, e.g. 8192."
    )
  vocab = kernel.shape[1]
  chunk = min(chunk_size, vocab)
  # Cast and pad outside the custom VJP: autodiff then returns the kernel's gradient in its
  # own dtype and shape. (A chunk-major copy of the kernel would make each chunk's columns
  # contiguous, but costs a kernel-sized temporary: 1 GiB for a 128k x 4096 head.)
  kernel = jnp.pad(kernel.astype(features.dtype), ((0, 0), (0, -vocab % chunk)))
  keep = jnp.ones(batch, jnp.bool_) if where is None else jnp.asarray(where, jnp.bool_)
  flat = features.reshape(-1, features.shape[-1])
  labels = labels.reshape(-1).astype(jnp.int32)
  return jnp.reshape(
    _head_cross_entropy(flat, kernel, labels, keep.reshape(-1), vocab, chunk), batch
  )
