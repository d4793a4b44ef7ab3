"""Softmax cross-entropy on half-precision logits, without float32 logits in memory.

The usual mixed-precision loss, ``optax.softmax_cross_entropy_with_integer_labels(
logits.astype(jnp.float32), labels)``, has autodiff keep float32 copies of the
logits (the exponentials, saved for the backward pass) and produce float32
logit gradients that are rounded to the logits' dtype afterwards: for a
language model's head, three float32 ``[tokens, vocab]`` arrays, written and
read again. :func:`softmax_cross_entropy_with_integer_labels` computes the
same float32 formula with a custom VJP: the forward pass converts the logits
inside its two reductions (the maximum, then the sum of exponentials; XLA
fuses the conversion into them, so no float32 copy is written) and saves only
the logits as given and two float32 numbers per example; the backward pass
recomputes the exponentials in float32 inside the one kernel that writes the
logit gradients, in the logits' dtype.

Its values are those of optax's loss on float32-converted logits, bit for
bit: the same operations in the same order (jax's ``logsumexp``), each in
float32; and its logit gradients are autodiff's float32 gradients of that
loss, rounded once to the logits' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors


def _wide(x: jax.Array, where: jax.Array | None) -> jax.Array:
  """The logits in (at least) float32, masked as ``jax.nn.logsumexp`` masks them."""
  wide = x.astype(dtypes_lib.at_least_float32(x.dtype))
  return wide if where is None else jnp.where(where, wide, jnp.zeros((), wide.dtype))


def _normalizer(x: jax.Array, axis: int, where: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``jax.nn.logsumexp``'s maximum and sum of exponentials, each kept (keepdims).

  Written out rather than called because the backward pass needs both, and
  computed as ``logsumexp`` computes them so that the loss is bitwise its.
  """
  wide = _wide(x, where)
  amax = jnp.max(wide, axis=axis, where=where, initial=-np.inf, keepdims=True)
  amax = jnp.where(jnp.isfinite(amax), amax, jnp.zeros((), amax.dtype))
  sumexp = jnp.sum(jnp.exp(wide - amax), axis=axis, where=where, keepdims=True)
  return amax, sumexp


def _loss(
  logits: jax.Array, labels: jax.Array, where: jax.Array | None, axis: int
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  amax, sumexp = _normalizer(logits, axis, where)
  log_normalizer = jnp.squeeze(jnp.log(sumexp) + amax, axis)
  label_logits = jnp.take_along_axis(logits, jnp.expand_dims(labels, axis), axis=axis)
  # Converting the picked logit is converting the logits and picking: exact either way.
  out = log_normalizer - jnp.squeeze(label_logits, axis).astype(log_normalizer.dtype)
  if where is not None:
    out = jnp.where(jnp.any(where, axis), out, jnp.zeros((), out.dtype))
  return out, (amax, sumexp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(
  logits: jax.Array, labels: jax.Array, where: jax.Array | None, axis: int
) -> jax.Array:
  return _loss(logits, labels, where, axis)[0]


def _cross_entropy_fwd(logits, labels, where, axis):
  out, (amax, sumexp) = _loss(logits, labels, where, axis)
  return out, (logits, labels, where, amax, sumexp)


def _cross_entropy_bwd(axis, res, g):
  logits, labels, where, amax, sumexp = res
  if where is not None:
    g = jnp.where(jnp.any(where, axis), g, jnp.zeros((), g.dtype))
  g = jnp.expand_dims(g, axis)
  # d lse / d x = exp(x - amax) / sumexp, in the order autodiff of logsumexp
  # multiplies it out; the label's -g is subtracted after, as its scatter adds it.
  grad = jnp.exp(_wide(logits, where) - amax) * (g / sumexp)
  if where is not None:
    grad = jnp.where(where, grad, jnp.zeros((), grad.dtype))
  index = labels if labels.dtype.itemsize >= 4 else labels.astype(jnp.int32)
  classes = jax.lax.broadcasted_iota(index.dtype, logits.shape, axis % logits.ndim)
  grad = jnp.where(classes == jnp.expand_dims(index, axis), grad - g, grad)
  return grad.astype(logits.dtype), None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def softmax_cross_entropy_with_integer_labels(
  logits: jax.Array,
  labels: jax.Array,
  axis: int | tuple[int, ...] = -1,
  where: jax.Array | None = None,
) -> jax.Array:
  r"""Softmax cross-entropy with integer labels, in float32, from half-precision logits.

  A drop-in for ``optax.softmax_cross_entropy_with_integer_labels`` (same
  arguments and values) for logits in float16 or bfloat16, which are never
  converted to float32 in memory:

  .. math::

    \ell_i = \log \sum_j e^{x_{ij}} - x_{i y_i}
      = m_i + \log \sum_j e^{x_{ij} - m_i} - x_{i y_i},
    \qquad m_i = \max_j x_{ij},

  each term computed in float32 (the maximum is exact; the exponentials and
  their sum are float32). The backward pass returns the logit gradients
  :math:`g_i\,(\mathrm{softmax}(x_i) - \mathrm{onehot}(y_i))` in the logits'
  dtype, computed in float32 and rounded once. It saves the logits as given
  (no float32 copy) and two float32 numbers per example.

  Compared with optax's loss on ``logits.astype(jnp.float32)``: the loss is
  bitwise equal, and the logit gradients are autodiff's float32 gradients of
  it rounded to the logits' dtype. Float32 logits work too (the same values,
  no memory saved).

  Args:
    logits: unnormalised log-probabilities, ``[batch..., classes]``, any
      floating dtype.
    labels: integer class ids, ``[batch...]``, in ``[0, classes)``.
    axis: the class axis, or axes (then a label is a flat index into
      ``logits``'s slice over those axes, as in optax).
    where: elements to include, of shape ``[batch...]`` or that of
      ``logits``; excluded examples get loss 0.

  Returns:
    The cross-entropy per example, ``[batch...]``, in float32 (float64 for
    float64 logits).

  Raises:
    LeafTypeError: ``logits`` are not floating or ``labels`` are not integers.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> logits = jnp.array([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]], jnp.bfloat16)
    >>> mpx.losses.softmax_cross_entropy_with_integer_labels(logits, jnp.array([0, 1]))
    Array([0.2752967, 2.9549096], dtype=float32)
  """
  logits, labels = jnp.asarray(logits), jnp.asarray(labels)
  if not dtypes_lib.is_floating(logits.dtype):
    raise errors.LeafTypeError(
      f"logits of dtype {logits.dtype}: the cross-entropy takes floating logits (float16, "
      "bfloat16, float32...); cast them, e.g. logits.astype(jnp.bfloat16)."
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise errors.LeafTypeError(
      f"labels of dtype {labels.dtype}: the cross-entropy takes integer class ids; for "
      "one-hot or soft labels use optax.softmax_cross_entropy."
    )
  if where is not None:
    where = jnp.asarray(where, jnp.bool_)
    if where.ndim != logits.ndim:  # per example: broadcast over the classes
      where = jnp.expand_dims(where, axis)
  if isinstance(axis, tuple):  # the classes on one trailing axis, as optax does it
    shape, classes = logits.shape, tuple(a % logits.ndim for a in axis)
    batch = tuple(a for a in range(logits.ndim) if a not in classes)
    logits = logits.transpose(batch + classes).reshape(*[logits.shape[a] for a in batch], -1)
    if where is not None:
      where = jnp.broadcast_to(where, shape).transpose(batch + classes).reshape(logits.shape)
    axis = -1
  return _cross_entropy(logits, labels, where, axis)
