"""The per-tensor scales of the float8 dot and convolution: current scaling, and delayed scaling's histories.

Delayed scaling keeps, per tensor, one float32 array of ``history_length + 1``
entries: ``[pending, most recent, ..., oldest]``. The forward pass reads the
committed part to choose the scale; the amax each call observes comes back as
the *gradient* of the pending slot, combined over the calls that share a
history by ``max`` (:func:`mpx.fp8.fp8_max_grad`), and
:func:`mpx.fp8.update_fp8_state` folds it in between steps.

Each scale is known before the tensor it scales is read:

* delayed scaling's comes from the history alone, so XLA fuses the
  quantisation into the kernel that produces the tensor (or into the one pass
  that reads it), with the amax to record as a side output of that pass;
* current scaling's is the tensor's own, from one reduction
  (:func:`mpx._src.ops.quantize.tensor_scale`) that the quantisation waits
  for: two passes over the tensor, the least a scale that depends on all of
  it allows.

Core module: imports neither Flax nor optax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import errors
from mpx._src.ops.amax_grad import as_float32
from mpx._src.ops.quantize import E5M2, partial_amaxes, scale_for, tensor_scale
from mpx._src.recipe import Fp8Recipe


def checked_recipe(recipe: Fp8Recipe | None, state: Any) -> Fp8Recipe:
  """``recipe`` (current scaling if ``None``), checked against the state passed with it.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  recipe = Fp8Recipe() if recipe is None else recipe
  if recipe.delayed != (state is not None):
    raise errors.ConfigError(
      f"The fp8 recipe {recipe} {'needs' if recipe.delayed else 'takes no'} amax history "
      "state; pass state=(lhs, rhs, grad) histories with delayed scaling only (apply_policy "
      "does this for you)."
    )
  return recipe


def init_history(recipe: Fp8Recipe, *, batch_shape: Sequence[int] = ()) -> jax.Array:
  """An empty amax history: ``float32[*batch_shape, history_length + 1]`` of zeros.

  Args:
    recipe: a delayed-scaling recipe.
    batch_shape: leading axes, one history per entry (e.g. ``(layers,)`` for
      the histories of layers stacked by ``nn.scan`` or ``nnx.vmap``).

  Returns:
    The zero history.
  """
  return jnp.zeros((*batch_shape, recipe.history_length + 1), jnp.float32)


def _reduce_last_axis(x: jax.Array, combine: Any) -> jax.Array:
  """``x`` reduced along its last axis by ``combine`` of neighbours, in order, with 0 as identity.

  A ``reduce`` is a kernel of its own on a GPU, and the scale it feeds would
  be another; ``combine`` of slices fuses with the scale's arithmetic into one
  small kernel per history (a few levels for any history length).
  """
  while x.shape[-1] > 1:
    if x.shape[-1] % 2:
      x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
    x = combine(x[..., 0::2], x[..., 1::2])
  return x[..., 0]


def _most_recent_recorded(newer: jax.Array, older: jax.Array) -> jax.Array:
  # A zero entry is a step that saw no element (an empty batch) or only zeros.
  return jnp.where(newer > 0, newer, older)


def history_scales(
  histories: Sequence[jax.Array], dtypes: Sequence[Any], recipe: Fp8Recipe
) -> list[jax.Array]:
  """The delayed scales from histories ``[pending, most recent, ..., oldest]``: 1 while none committed.

  A scale depends on its history alone, never on the tensor being quantised,
  so the quantisation need not wait for that tensor's amax. Zero entries
  (steps that saw an empty or all-zero tensor) do not count: ``most_recent``
  takes the most recent non-zero amax. Histories of one shape (a layer's) are
  stacked and share one small kernel; each on its own would be a kernel of its
  own (XLA:GPU merges no independent scalar computations).

  Args:
    histories: histories of one shape, each one history or histories stacked
      along leading axes.
    dtypes: each one's float8 format.
    recipe: the delayed recipe (its reduction and margin).

  Returns:
    For each history, its float32 scale (one per stacked history).
  """
  committed = jnp.stack([as_float32(h) for h in histories])[..., 1:]
  combine = jnp.maximum if recipe.reduction == "max" else _most_recent_recorded
  reference = _reduce_last_axis(committed, combine)
  # Each scale from its own slice: a vector of scales, sliced, costs a kernel per slice.
  return [scale_for(reference[i], dtype, margin=recipe.margin) for i, dtype in enumerate(dtypes)]


def observed(history: jax.Array, value: jax.Array) -> jax.Array:
  """The cotangent of a history: ``value`` in the pending slot, zeros elsewhere."""
  cotangent = jnp.zeros(history.shape, jnp.float32).at[..., 0].set(value.astype(jnp.float32))
  return jax.lax.convert_element_type(cotangent, history.dtype)


def operand_scales(
  recipe: Fp8Recipe,
  histories: Sequence[jax.Array] | None,
  tensors: Sequence[jax.Array],
  dtype: Any,
  *,
  gradient_history: jax.Array | None = None,
) -> tuple[list[jax.Array], list[jax.Array] | None]:
  """Each tensor's per-tensor scale, and under delayed scaling the amax each observed.

  Args:
    recipe: a per-tensor recipe (current or delayed).
    histories: the tensors' histories (delayed scaling), or ``None``.
    tensors: the tensors to quantise.
    dtype: their float8 format.
    gradient_history: under delayed scaling, the gradient's history: its
      E5M2 scale comes last in ``scales``, from the same kernel.

  Returns:
    ``(scales, amaxes)``: the float32 scales, and under delayed scaling the
    first stage of the amaxes to record (:func:`partial_amaxes`; the
    backward pass reduces them with the gradient's in one more kernel), or
    ``None`` under current scaling.
  """
  if histories is None:
    scales = [
      tensor_scale(x, dtype, margin=recipe.margin, axis_name=recipe.axis_name) for x in tensors
    ]
    return scales, None
  dtypes = [dtype] * len(histories)
  if gradient_history is not None:
    histories, dtypes = [*histories, gradient_history], [*dtypes, E5M2]
  return history_scales(histories, dtypes, recipe), [partial_amaxes(x) for x in tensors]
