"""The Equinox layers' float8 and float32-accumulating contractions, and the delayed-scaling histories.

Under a policy with a :class:`mpx.Fp8Recipe`, :func:`mpx.eqx.apply_policy`
computes the products of ``eqx.nn.Linear`` layers with
:func:`mpx.fp8.fp8_dot_general` and those of ``eqx.nn.Conv`` layers with
:func:`mpx.fp8.fp8_conv_general_dilated` (with ``accumulate_in_float32``,
mpx's float32-accumulating contractions instead), through
``mpx._src.adapters.eqx_contractions``, which runs them once over the whole
batch under ``jax.vmap``. A delayed recipe's amax histories are an
:class:`Fp8History` module inside the layer's wrapper: Equinox keeps a model's
state in its pytree and changes it out of place, and these change with the
*gradient* (the amax each tensor had in the backward pass arrives as the
gradient of its history), which an ``eqx.nn.State`` threaded through the
forward pass cannot carry. :func:`partition_fp8` splits them from the params
(and their gradients), :func:`update_fp8_state` folds what a step observed
into them. What is shared with the Flax adapters is in
``mpx._src.adapters.fp8_wiring``.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from mpx._src import recipe as recipe_lib
from mpx._src.adapters import eqx_contractions, fp8_wiring
from mpx._src.ops import fp8_conv, fp8_scaling, kernels
from mpx._src.ops.amax_grad import fp8_max_grad
from mpx._src.scaling import fp8_history


class Fp8History(eqx.Module):
  """The amax histories of one float8 layer under delayed scaling.

  Each is ``float32[history_length + 1]`` (``[pending, most recent, ...,
  oldest]``, see :func:`mpx.fp8.update_fp8_state`), with the leading axes of
  the layer's weight when the layer is a stack (built by
  ``eqx.filter_vmap``), so that a ``jax.lax.scan`` over the stack gives each
  layer its own. They are floating arrays of the model: split them from the
  params with :func:`mpx.eqx.partition_fp8`.

  Attributes:
    lhs: the history of the left operand (the weight of ``eqx.nn.Linear``,
      which computes ``weight @ x``; the input of ``eqx.nn.Conv``).
    rhs: the history of the right operand.
    grad: the history of the incoming gradient.
  """

  lhs: jax.Array
  rhs: jax.Array
  grad: jax.Array


def _is_history(x: Any) -> bool:
  return isinstance(x, Fp8History)


def new_history(recipe: recipe_lib.Fp8Recipe, layer: Any) -> Fp8History:
  """Empty histories for ``layer`` (an ``eqx.nn.Linear`` or ``eqx.nn.Conv``, alone or stacked).

  Args:
    layer: the layer; a stack's extra leading weight axes become the histories'.
    recipe: the delayed recipe.

  Returns:
    The :class:`Fp8History`.
  """
  weight = layer.weight
  ndim = 2 + getattr(layer, "num_spatial_dims", 0)
  batch_shape = tuple(weight.shape[: weight.ndim - ndim])
  return Fp8History(*(fp8_scaling.init_history(recipe, batch_shape=batch_shape) for _ in range(3)))


def replaced_contractions(
  layer: Any, recipe: recipe_lib.Fp8Recipe | None, accumulate_in_float32: bool
) -> dict[str, Any]:
  """What replaces the contractions of a layer's call (empty: none replaced).

  Args:
    layer: an ``eqx.nn.Linear`` or ``eqx.nn.Conv`` (anything else: empty).
    recipe: its policy's float8 recipe, or ``None``.
    accumulate_in_float32: whether to request float32 accumulation.

  Returns:
    ``{"dot_general": ..., "conv_general_dilated": ...}`` for
    :func:`mpx._src.adapters.eqx_contractions.call`: float8 contractions
    under a recipe (a convolution only where the recipe covers it, see
    :func:`mpx.fp8.fp8_conv_general_dilated`), else float32-accumulating
    ones with ``accumulate_in_float32``.
  """
  if isinstance(layer, eqx.nn.Conv):
    if recipe is not None and fp8_conv.covers(recipe=recipe):
      return {"conv_general_dilated": _Fp8(fp8_wiring.conv_general_dilated, recipe)}
    if recipe is None and accumulate_in_float32:
      return {"conv_general_dilated": _Plain(kernels.conv_general_dilated_f32_accumulation)}
  elif isinstance(layer, eqx.nn.Linear):
    if recipe is not None:
      return {"dot_general": _Fp8(fp8_wiring.dot_general, recipe)}
    if accumulate_in_float32:
      return {"dot_general": _Plain(kernels.dot_general_f32_accumulation)}
  return {}


class _Fp8:
  """A float8 contraction with its recipe bound; the context is a delayed recipe's histories."""

  def __init__(self, wiring: Any, recipe: recipe_lib.Fp8Recipe) -> None:
    self.wiring, self.recipe = wiring, recipe

  def __call__(self, context: Any, lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
    state = tuple(context) if self.recipe.delayed else None
    return self.wiring(self.recipe, state)(lhs, rhs, **params)


class _Plain:
  """A contraction that reads no context."""

  def __init__(self, op: Any) -> None:
    self.op = op

  def __call__(self, context: Any, lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
    del context
    return self.op(lhs, rhs, **params)


def call(
  layer: Any,
  history: Fp8History | None,
  replacements: dict[str, Any],
  args: tuple,
  kwargs: dict,
) -> Any:
  """One call of ``layer`` with its contractions replaced (see ``eqx_contractions``).

  Args:
    layer: the layer, its params already in the compute dtype.
    history: its histories under a delayed recipe, else ``None``.
    replacements: from :func:`replaced_contractions`.
    args: the call's positional arguments.
    kwargs: the call's keyword arguments.

  Returns:
    What ``layer(*args, **kwargs)`` returns.
  """
  dynamic, static = eqx.partition((layer, args, kwargs), eqx.is_array)
  leaves, treedef = jax.tree.flatten(dynamic)
  out_tree: list[Any] = []

  def fn(*values: Any) -> list[Any]:
    module, a, k = eqx.combine(jax.tree.unflatten(treedef, values), static)
    out_leaves, tree = jax.tree.flatten(module(*a, **k))
    out_tree[:] = [tree]
    return out_leaves

  context = [] if history is None else [history.lhs, history.rhs, history.grad]
  outs = eqx_contractions.call(fn, context, leaves, replacements)
  return jax.tree.unflatten(out_tree[0], outs)


def max_grad_histories(tree: Any) -> Any:
  """``tree`` with every :class:`Fp8History` typed by :func:`mpx.fp8.fp8_max_grad`.

  Applied once per forward pass, where the histories enter, so that a layer
  called several times records the largest amax of its calls, not their sum.
  """
  return jax.tree.map(lambda x: fp8_max_grad(x) if _is_history(x) else x, tree, is_leaf=_is_history)


def partition_fp8(tree: Any) -> tuple[Any, Any]:
  """Splits the float8 amax histories from the rest of an Equinox tree.

  Works on the model, on ``eqx.filter(model, eqx.is_inexact_array)`` and on
  the gradients :func:`mpx.value_and_grad` returns (the gradient of a
  history is the amax each tensor had in the step, see
  :func:`mpx.fp8.update_fp8_state`).

  Args:
    tree: an Equinox model under a delayed float8 policy, or a tree of its
      structure.

  Returns:
    ``(rest, histories)``: two trees of ``tree``'s structure (as
    ``eqx.partition`` makes them), the first with ``None`` at every history,
    the second with ``None`` everywhere else. ``rest`` of the model's
    inexact arrays is what the optimizer updates.

  Example:
    >>> import equinox as eqx, jax, mpx
    >>> model = mpx.eqx.apply_policy(
    ...   eqx.nn.Linear(16, 16, key=jax.random.key(0)), "mixed_float8_delayed"
    ... )
    >>> params, histories = mpx.eqx.partition_fp8(eqx.filter(model, eqx.is_inexact_array))
    >>> len(jax.tree.leaves(params)), len(jax.tree.leaves(histories))
    (2, 3)
  """
  spec = jax.tree.map(_is_history, tree, is_leaf=_is_history)
  histories, rest = eqx.partition(tree, spec, is_leaf=_is_history)
  return rest, histories


def update_fp8_state(
  model: Any, observed: Any, *, commit: Any = None, opt_state: Any = None
) -> Any:
  """Folds the amaxes a step observed into a model's delayed-scaling histories.

  The Equinox form of :func:`mpx.fp8.update_fp8_state` (see it for the
  rule): ``observed`` is the histories' part of the gradients
  (:func:`partition_fp8`), and the model comes back with new histories,
  out of place. With ``opt_state``, a step the loss scale skipped leaves
  them unchanged, bit for bit.

  Args:
    model: the model under a delayed float8 policy.
    observed: the histories' gradients, ``partition_fp8(grads)[1]``.
    commit: as for :func:`mpx.fp8.update_fp8_state`.
    opt_state: the optimizer state ``tx.update`` just returned, or ``None``.

  Returns:
    ``model`` with every :class:`Fp8History` updated.
  """
  _, histories = partition_fp8(model)
  new = fp8_history.update_fp8_state(histories, observed, commit=commit, opt_state=opt_state)
  return eqx.combine(new, model)
