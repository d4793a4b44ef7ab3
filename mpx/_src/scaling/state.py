"""The state of loss scaling, and reading the loss scale out of an optimizer state.

:class:`LossScaleState` sits anywhere in a nested optax state (``chain``
tuples, ``named_chain`` dicts, ``MultiSteps``, ``inject_hyperparams``,
``masked``...); the train-step helpers, the fp8 history commit and the
diagnostics find it here. This module imports neither optax nor the
optimizer wrappers, so that the tools which only read the scale do not stand
on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from mpx._src import dtypes, errors
from mpx._src import tree as tree_lib

if TYPE_CHECKING:
  import optax


class LossScaleState(NamedTuple):
  """State of every loss-scaling transformation.

  Attributes:
    loss_scale: float32 scalar, the scale of the next step's loss.
    growth_tracker: int32 scalar, finite steps counted toward the next growth.
    hysteresis_tracker: int32 scalar, overflows left before the scale backs off.
    skipped_steps: int32 scalar, total non-finite steps (saturating).
    consecutive_skips: int32 scalar, non-finite steps since the last finite one
      (saturating).
    diverged: bool scalar, set (and kept) once gradients overflowed while the
      scale was already at its floor; see :func:`mpx.check_loss_scale`.
    skip_history: uint32 scalar, the last 32 steps as bits: bit ``i`` is set
      when the step ``i`` updates ago was skipped (bit 0: the last one).
    nonfinite_leaf: int32 scalar, in the last skipped step, the index (into
      ``jax.tree.leaves(grads)``) of the first gradient leaf with an element
      that was not finite once unscaled; ``-1`` before any skip. Kept until
      the next skip; :func:`mpx.diagnostics.nonfinite_gradient_paths` names it.
    inner_state: the state of the wrapped transformation.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_tracker: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  diverged: jax.Array
  skip_history: jax.Array
  nonfinite_leaf: jax.Array
  inner_state: optax.OptState

  @property
  def last_step_skipped(self) -> jax.Array:
    """Whether the last ``update`` skipped its step (``consecutive_skips > 0``), a bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax, mpx
      >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2)}
      >>> _, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init(params), params)
      >>> state.last_step_skipped
      Array(True, dtype=bool)
    """
    return self.consecutive_skips > 0


def unwrap(x: Any) -> Any:
  """``x``, read through the NNX ``Variable`` that Flax NNX wraps optimizer-state leaves in."""
  return x.get_value() if hasattr(x, "get_value") else x


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """Returns the single :class:`LossScaleState` inside ``opt_state``.

  Args:
    opt_state: any optax state tree.

  Returns:
    The loss-scale state (its leaves unwrapped from NNX variables, if any).

  Raises:
    StateError: if there is none, or more than one.
  """
  found = tree_lib.find_nodes(opt_state, LossScaleState)
  if len(found) != 1:
    where = ", ".join(repr(p) for p, _ in found)
    problem = "contains none" if not found else f"contains {len(found)}, at {where}"
    raise errors.StateError(
      f"Expected exactly one LossScaleState in the optimizer state, but it {problem}. Build "
      "the optimizer with a single mpx.dynamic_loss_scale, mpx.static_loss_scale or "
      "mpx.no_loss_scale around it, and pass its state (or the scale array itself)."
    )
  return jax.tree.map(unwrap, found[0][1], is_leaf=lambda x: hasattr(x, "get_value"))


def get_loss_scale(opt_state: Any) -> jax.Array:
  """Returns the current loss scale held anywhere inside ``opt_state``.

  Args:
    opt_state: an optax state that contains one :class:`LossScaleState`.

  Returns:
    The float32 scalar scale.

  Raises:
    StateError: if ``opt_state`` holds no loss-scale state, or several.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> inner = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1))
    >>> tx = mpx.dynamic_loss_scale(inner)  # decay sees unscaled gradients
    >>> mpx.get_loss_scale(tx.init({"w": jnp.ones(2)}))
    Array(32768., dtype=float32)
  """
  return find_loss_scale_state(opt_state).loss_scale


def loss_scale_value(opt_state_or_scale: Any) -> jax.Array:
  """Returns the loss scale as a float32 scalar, given as a number, an array, or an optax state.

  Args:
    opt_state_or_scale: an optax state holding one :class:`LossScaleState`,
      a Python number, or a floating scalar array.

  Returns:
    The float32 scalar scale.

  Raises:
    StateError: the state holds no loss-scale state or several, or the array
      is not a floating scalar.
  """
  x = opt_state_or_scale
  if isinstance(x, int | float) and not isinstance(x, bool):
    return jnp.asarray(x, jnp.float32)
  if tree_lib.is_array(x):
    scale = jnp.asarray(x)
    if scale.shape != () or not dtypes.is_floating(scale.dtype):
      raise errors.StateError(
        f"A loss scale must be a floating scalar, got shape {scale.shape} and dtype "
        f"{scale.dtype}. Pass the optimizer state or mpx.get_loss_scale(opt_state)."
      )
    return scale.astype(jnp.float32)
  return get_loss_scale(x).astype(jnp.float32)
