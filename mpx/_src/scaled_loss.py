"""Reading the loss scale out of an optimizer state, and differentiating with it.

A train step changes by two lines: ``mpx.value_and_grad(loss_fn, opt_state)``
returns the true loss with the gradients of the scaled loss, and the
loss-scaling transformation's ``update`` unscales them. Metrics and the
divergence check read the same :class:`LossScaleState`, wherever it sits in a
nested optax state (``chain`` tuples, ``named_chain`` dicts, ``MultiSteps``,
``inject_hyperparams``, ``masked``...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.loss_scaling import LossScaleState


def _value(x: Any) -> Any:
  # Flax NNX wraps optimizer-state leaves in Variables; read through them.
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
  return jax.tree.map(_value, found[0][1], is_leaf=lambda x: hasattr(x, "get_value"))


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
    >>> tx = optax.chain(optax.add_decayed_weights(1e-4), mpx.dynamic_loss_scale(optax.sgd(0.1)))
    >>> mpx.get_loss_scale(tx.init({"w": jnp.ones(2)}))
    Array(32768., dtype=float32)
  """
  return find_loss_scale_state(opt_state).loss_scale


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Returns the loss-scale figures worth logging, as arrays (jit-friendly).

  Args:
    opt_state: an optax state that contains one :class:`LossScaleState`.

  Returns:
    A dict with keys ``loss_scale``, ``skipped_steps``, ``consecutive_skips``,
    ``growth_tracker`` and ``diverged``.

  Raises:
    StateError: if ``opt_state`` holds no loss-scale state, or several.
  """
  s = find_loss_scale_state(opt_state)
  return {
    "loss_scale": s.loss_scale,
    "skipped_steps": s.skipped_steps,
    "consecutive_skips": s.consecutive_skips,
    "growth_tracker": s.growth_tracker,
    "diverged": s.diverged,
  }


def check_loss_scale(opt_state: Any) -> None:
  """Raises on the host if training has diverged (call it every few steps).

  Args:
    opt_state: an optax state that contains one :class:`LossScaleState`.

  Returns:
    None; the check only raises.

  Raises:
    LossScaleDivergedError: if gradients overflowed while the scale was
      already at its floor.
    StateError: if ``opt_state`` holds no loss-scale state, or several.
  """
  s = jax.device_get(find_loss_scale_state(opt_state))
  if bool(np.asarray(s.diverged)):
    raise errors.LossScaleDivergedError(
      "Gradients were not finite even though the loss scale was already at its floor "
      f"(current scale {float(s.loss_scale)!r}, {int(s.skipped_steps)} skipped steps, the last "
      f"{int(s.consecutive_skips)} in a row), so lowering the scale cannot help: the model "
      "itself produces inf or NaN. Look for NaN in the data, lower the learning rate, keep "
      "numerically sensitive ops (softmax, norms, losses) in float32, or train in bfloat16. "
      "To continue anyway, reset the flag with state._replace(diverged=False)."
    )


def _scale_of(opt_state_or_scale: Any) -> jax.Array:
  if tree_lib.is_array(opt_state_or_scale) or isinstance(opt_state_or_scale, float):
    scale = jnp.asarray(opt_state_or_scale)
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
      raise errors.StateError(
        f"A loss scale must be a floating scalar, got shape {scale.shape} and dtype "
        f"{scale.dtype}. Pass the optimizer state or mpx.get_loss_scale(opt_state)."
      )
    return scale.astype(jnp.float32)
  return get_loss_scale(opt_state_or_scale).astype(jnp.float32)


def value_and_grad(
  fun: Callable[..., Any],
  opt_state_or_scale: Any,
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """Like ``jax.value_and_grad``, but differentiates the loss times the scale.

  The loss is converted to float32 and multiplied by the current scale before
  differentiating (paper section 3.2), so the returned gradients are those of
  the *scaled* loss: pass them to the loss-scaling transformation, which
  unscales them. The returned loss is ``fun``'s own value, unscaled.

  Args:
    fun: returns a floating scalar loss, or ``(loss, aux)`` with ``has_aux``.
    opt_state_or_scale: an optax state holding one :class:`LossScaleState`,
      or the scale itself as a scalar array.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function of ``fun``'s arguments returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Raises:
    StateError: if the scale cannot be found or is not a floating scalar.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> loss, grads = mpx.value_and_grad(lambda w: (w**2).sum(), jnp.float32(8))(jnp.ones(2))
    >>> loss, grads
    (Array(2., dtype=float32), Array([16., 16.], dtype=float32))
  """
  scale = _scale_of(opt_state_or_scale)

  def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    if not tree_lib.is_floating_array(loss):
      raise errors.LeafTypeError(
        f"The loss must be a floating-point scalar array, got {loss!r}. Return e.g. "
        "loss.mean() from the loss function."
      )
    return loss.astype(jnp.float32) * scale, (loss, aux)

  grad_fn = jax.grad(scaled, argnums=argnums, has_aux=True)

  def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    grads, (loss, aux) = grad_fn(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped
