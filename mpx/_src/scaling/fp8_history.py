"""Between steps: fold the amaxes a step observed into the delayed-scaling histories.

The commit rule reads the optimizer state: a step the loss scale skipped
commits nothing, and inside ``optax.MultiSteps`` only an accumulation
boundary commits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.scaling.state import LossScaleState, unwrap


def _update_history(history: jax.Array, observed: jax.Array, commit: jax.Array) -> jax.Array:
  # The last axis is the history; leading axes are layers stacked by nn.scan or nnx.vmap.
  seen = observed[..., :1]
  # A non-finite amax (an overflow the loss scale will skip) would make every delayed
  # scale built on it fall back to 1 for history_length steps.
  pending = jnp.where(jnp.isfinite(seen), jnp.maximum(history[..., :1], seen), history[..., :1])
  # Elementwise over the slots (a shift, not a concatenation), so that XLA can update many
  # histories stacked together in one kernel (see update_fp8_state).
  slot = jax.lax.broadcasted_iota(jnp.int32, history.shape, history.ndim - 1)
  shifted = jnp.pad(history[..., :-1], [(0, 0)] * (history.ndim - 1) + [(1, 0)])
  committed = jnp.where(slot == 1, pending, shifted)
  return jnp.where(commit, committed, jnp.where(slot == 0, pending, history))


def update_fp8_state(
  state: Any, observed: Any, *, commit: Any = None, opt_state: Any = None
) -> Any:
  """Folds the amaxes a step observed into the delayed-scaling state.

  Each leaf of ``state`` is one tensor's ``[pending, most recent, ...,
  oldest]`` along its last axis (leading axes, as ``nn.scan`` or ``nnx.vmap``
  stack the histories of several layers, are updated entry by entry); the
  matching leaf of ``observed`` is its gradient from ``jax.grad`` (the amax
  in the pending slot). The pending slot becomes the running max
  ``max(pending, observed)``, so over the micro-batches of a gradient
  accumulation it holds the largest amax of any of them (what one large
  batch would have seen), not the last one; non-finite amaxes are left out.
  With ``commit`` the pending amax becomes the most recent entry, the others
  move down one place, the oldest drops and the pending slot is reset to
  zero. A zero amax (an empty tensor, as in the last batch of a sharded epoch,
  or an all-zero one, which any scale represents) is recorded like any other;
  the scale ignores zero entries (``reduction="most_recent"`` takes the most
  recent non-zero one).

  Pass ``opt_state``, the optimizer state ``tx.update`` just returned: it
  says whether this step ends an ``optax.MultiSteps`` accumulation (commit)
  and whether the loss scale skipped it, in which case ``state`` comes back
  unchanged, as the params do. Without ``opt_state``, ``commit`` (default
  ``True``: a step without accumulation) decides alone. Do not pass the
  observed amaxes through the optimizer: ``MultiSteps`` averages what it
  accumulates.

  Args:
    state: the histories (a linen ``"fp8_history"`` collection, an NNX
      ``State`` of :class:`mpx.nnx.Fp8History`, any pytree of them).
    observed: the gradient of the loss with respect to ``state``.
    commit: a boolean (Python or a scalar array, traceable); ``None`` means
      ``True``, or what ``opt_state`` says.
    opt_state: the optimizer state after this step's update, or ``None``.

  Returns:
    The new state, with ``state``'s structure and dtypes.

  Raises:
    ConfigError: both ``commit`` and ``opt_state`` given.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> history = jnp.array([0.0, 4.0, 2.0])   # pending, most recent, older
    >>> mpx.fp8.update_fp8_state(history, jnp.array([3.0, 0.0, 0.0]), commit=False)
    Array([3., 4., 2.], dtype=float32)
    >>> mpx.fp8.update_fp8_state(history, jnp.array([3.0, 0.0, 0.0]))
    Array([0., 3., 4.], dtype=float32)
  """
  if opt_state is None:
    skipped = jnp.asarray(False)
    commit = jnp.asarray(True if commit is None else commit, jnp.bool_)
  elif commit is not None:
    raise errors.ConfigError(
      "update_fp8_state got both commit= and opt_state=; pass opt_state (it decides the "
      "commit and the skip) or commit alone."
    )
  else:
    commit, skipped = _step_outcome(opt_state)
  histories, treedef = jax.tree.flatten(state)
  seen = treedef.flatten_up_to(observed)
  # The histories of one shape are stacked and updated together: one kernel where XLA
  # launches one per history otherwise (18 for a GPT-2 block's six layers).
  groups: dict[tuple[Any, ...], list[int]] = {}
  for i, history in enumerate(histories):
    groups.setdefault((history.shape, history.dtype), []).append(i)
  updated = list(histories)
  for members in groups.values():
    stacked = jnp.stack([histories[i] for i in members])
    new = _update_history(stacked, jnp.stack([seen[i] for i in members]), commit)
    new = jnp.where(skipped, stacked, new)
    for k, i in enumerate(members):
      updated[i] = new[k]
  return jax.tree.unflatten(treedef, updated)


def _is_multisteps(node: Any) -> bool:
  # optax.MultiStepsState, recognised by its fields: this module imports no optimizer code.
  return hasattr(node, "mini_step") and hasattr(node, "gradient_step")


def _find_multisteps(tree: Any) -> list[Any]:
  found: list[Any] = []
  jax.tree.map(
    lambda n: found.append(n) if _is_multisteps(n) else None, tree, is_leaf=_is_multisteps
  )
  return found


def _loss_scales(tree: Any) -> list[LossScaleState]:
  return [node for _, node in tree_lib.find_nodes(tree, LossScaleState)]


def _step_outcome(opt_state: Any) -> tuple[jax.Array, jax.Array]:
  """``(commit, skipped)`` for the step whose update returned ``opt_state``.

  ``skipped``: the loss scale skipped this step. Inside ``MultiSteps`` the
  loss scale runs only at the accumulation boundary, and between boundaries
  its state still describes the previous one, so only a boundary can be
  skipped there. ``commit``: an update was applied, at a boundary and not
  skipped.
  """
  multisteps = _find_multisteps(opt_state)
  if len(multisteps) > 1:
    raise errors.StateError(
      f"The optimizer state holds {len(multisteps)} optax.MultiSteps states; fp8 history "
      "commits need one. Pass commit= to update_fp8_state yourself."
    )
  scales = _loss_scales(opt_state)
  if len(scales) > 1:
    raise errors.StateError(
      f"The optimizer state holds {len(scales)} loss-scale states; fp8 history updates need "
      "one to tell a skipped step. Pass commit= to update_fp8_state yourself."
    )
  boundary = jnp.asarray(True) if not multisteps else unwrap(multisteps[0].mini_step) == 0
  if not scales:
    return boundary, jnp.asarray(False)
  skipped = jnp.asarray(unwrap(scales[0].consecutive_skips)) > 0
  if multisteps and _loss_scales(multisteps[0].inner_opt_state):
    skipped = skipped & boundary
  return boundary & ~skipped, skipped


def accumulation_boundary(opt_state: Any) -> jax.Array:
  """Whether the optimizer step that produced ``opt_state`` applied an update.

  With ``optax.MultiSteps`` that is the last micro-batch of an accumulation
  (its ``mini_step`` is back at 0); without it, every step. Never a step the
  loss scale skipped: its non-finite gradients leave the params untouched.

  Args:
    opt_state: the optimizer state returned by ``tx.update``.

  Returns:
    A boolean scalar, for :func:`update_fp8_state`'s ``commit``
    (``update_fp8_state(..., opt_state=opt_state)`` also leaves a skipped
    step's amaxes out of the pending slot).

  Raises:
    StateError: more than one ``MultiSteps`` or loss-scale state.
  """
  return _step_outcome(opt_state)[0]
