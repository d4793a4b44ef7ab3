"""The train-step helpers: differentiating with the loss scale, and reading its figures.

A train step changes by two lines: ``mpx.value_and_grad(loss_fn, opt_state)``
returns the true loss with the gradients of the scaled loss, and the
loss-scaling transformation's ``update`` unscales them. Metrics, the divergence
check and ``mpx.scale``/``mpx.unscale`` read the same :class:`LossScaleState`,
wherever it sits in a nested optax state (``chain`` tuples, ``named_chain``
dicts, ``MultiSteps``, ``inject_hyperparams``, ``masked``...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.scaling import transform
from mpx._src.scaling.state import find_loss_scale_state, loss_scale_value
from mpx._src.scaling.state import get_loss_scale as get_loss_scale


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Returns the loss-scale figures worth logging, as arrays (jit-friendly).

  Args:
    opt_state: an optax state that contains one :class:`LossScaleState`.

  Returns:
    A dict with keys ``loss_scale``, ``skipped_steps``, ``consecutive_skips``,
    ``last_step_skipped`` (bool: whether the last ``update`` skipped its
    step), ``growth_tracker``, ``diverged``, ``overflow_rate`` (float32: the
    fraction of the last 32 steps that were skipped, read from
    ``skip_history``; steps before the first count as finite) and
    ``nonfinite_leaf`` (int32: the index of the first gradient leaf that
    was not finite in the last skipped step, ``-1`` before any; name it with
    :func:`mpx.diagnostics.nonfinite_gradient_paths`).

  Raises:
    StateError: if ``opt_state`` holds no loss-scale state, or several.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g in ([1.0, 2.0], [jnp.inf, 1.0], [1.0, 1.0], [1.0, jnp.nan]):
    ...   _, state = tx.update({"w": jnp.array(g)}, state, params)
    >>> metrics = mpx.loss_scale_metrics(state)
    >>> metrics["overflow_rate"], metrics["nonfinite_leaf"]  # 2 of the last 32 steps
    (Array(0.0625, dtype=float32), Array(0, dtype=int32))
  """
  s = find_loss_scale_state(opt_state)
  return {
    "loss_scale": s.loss_scale,
    "skipped_steps": s.skipped_steps,
    "consecutive_skips": s.consecutive_skips,
    "last_step_skipped": s.last_step_skipped,
    "growth_tracker": s.growth_tracker,
    "diverged": s.diverged,
    "overflow_rate": jax.lax.population_count(s.skip_history).astype(jnp.float32) / 32,
    "nonfinite_leaf": s.nonfinite_leaf,
  }


def nonfinite_gradient_paths(opt_state: Any, params: Any) -> list[str]:
  """Names the gradient leaf that broke the last skipped step (host side).

  At each skipped step the loss-scaling check records the first leaf, in
  tree order, with an element that was not finite once unscaled
  (``LossScaleState.nonfinite_leaf``); this function turns that index into
  the leaf's path, from the params' structure (the gradients have the same).

  Args:
    opt_state: an optax state that contains one :class:`LossScaleState` (the
      leaf index is read to the host).
    params: the params the gradients were taken of, or any tree with the
      gradients' structure.

  Returns:
    A list with the ``/``-joined path of that leaf; empty when no step has
    been skipped.

  Raises:
    StateError: if ``opt_state`` holds no loss-scale state, or several, or the
      leaf index does not fit ``params`` (params of another model).

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"big": jnp.ones(70_000), "bias": jnp.ones(3), "scale": jnp.ones(3)}
    >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
    >>> grads = {"big": jnp.ones(70_000), "bias": jnp.ones(3), "scale": jnp.full(3, jnp.inf)}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> mpx.diagnostics.nonfinite_gradient_paths(state, params)
    ['scale']
  """
  index = int(jax.device_get(find_loss_scale_state(opt_state).nonfinite_leaf))
  if index < 0:
    return []
  paths = [tree_lib.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  if index >= len(paths):
    raise errors.StateError(
      f"The loss-scale state records gradient leaf {index}, but these params have "
      f"{len(paths)} leaf{'' if len(paths) == 1 else 's'} (indices from 0). Pass the params the "
      "gradients of the skipped step were taken of."
    )
  return [paths[index]]


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
      "To continue anyway, reset the flag with "
      "optax.tree_utils.tree_set(opt_state, diverged=jnp.asarray(False))."
    )


def scale(tree: Any, opt_state_or_scale: Any) -> Any:
  """Multiplies every floating leaf of ``tree`` by the current loss scale.

  For losses differentiated outside :func:`value_and_grad`: a second loss
  whose gradients are added to the first, or the inner gradient of a gradient
  penalty. Floating leaves are converted to float32 (float64 stays float64)
  before the multiplication, so a float16 loss cannot overflow; other leaves
  are returned as they are.

  Args:
    tree: a loss, or any pytree.
    opt_state_or_scale: an optax state holding one :class:`mpx.LossScaleState`,
      or the scale itself as a scalar array.

  Returns:
    ``tree`` with every floating leaf multiplied by the scale.

  Raises:
    StateError: if the scale cannot be found or is not a floating scalar.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> mpx.scale({"loss": jnp.float16(3.0), "step": 7}, jnp.float32(1024))
    {'loss': Array(3072., dtype=float32), 'step': 7}
    >>> # A gradient penalty: scale the inner loss, unscale its gradient.
    >>> s = jnp.float32(2**10)  # or the optimizer state
    >>> def loss_fn(w, x):
    ...   inner = lambda x: mpx.scale(jnp.sum(w * x**2), s)
    ...   grad_x = mpx.unscale(jax.grad(inner)(x), s)  # the true 2 * w * x
    ...   return jnp.sum(w * x**2) + jnp.sum(grad_x**2)
    >>> mpx.value_and_grad(loss_fn, s)(jnp.float32(0.5), jnp.ones(2))
    (Array(3., dtype=float32), Array(10240., dtype=float32))
  """
  return transform.multiply(tree, loss_scale_value(opt_state_or_scale))


def unscale(tree: Any, opt_state_or_scale: Any) -> Any:
  """Divides every floating leaf of ``tree`` by the current loss scale.

  The same operation as the loss-scaling transformation's ``update``: each
  floating leaf is converted to float32 (float64 stays float64) and multiplied
  by ``1 / scale``, which is exact for a power-of-two scale (see
  :func:`mpx.dynamic_loss_scale`); other leaves are returned as they are. Use
  it to read true gradients outside the optimizer (gradient norms for logging,
  a gradient penalty); it does not check that they are finite.

  Args:
    tree: scaled gradients, or any pytree.
    opt_state_or_scale: an optax state holding one :class:`mpx.LossScaleState`,
      or the scale itself as a scalar array.

  Returns:
    ``tree`` with every floating leaf divided by the scale.

  Raises:
    StateError: if the scale cannot be found or is not a floating scalar.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> loss, grads = mpx.value_and_grad(lambda p: (p["w"] ** 2).sum(), state)({"w": jnp.ones(2)})
    >>> grads["w"], mpx.unscale(grads, state)["w"]
    (Array([65536., 65536.], dtype=float32), Array([2., 2.], dtype=float32))
  """
  return transform.multiply(tree, 1 / loss_scale_value(opt_state_or_scale))


def _has_nnx_object(tree: Any) -> bool:
  leaves = jax.tree.leaves(tree, is_leaf=tree_lib.is_nnx_object)
  return any(tree_lib.is_nnx_object(x) for x in leaves)


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

  Flax NNX objects (modules, ``nnx.Rngs``...) among the arguments are
  differentiated with ``flax.nnx.grad``, like ``nnx.value_and_grad`` does:
  the gradients are an ``nnx.State`` of the ``nnx.Param`` variables, and every
  variable ``fun`` writes (BatchNorm statistics, ``nnx.Rngs`` counts, counters)
  is updated in the caller's objects.

  Args:
    fun: returns a floating scalar loss, or ``(loss, aux)`` with ``has_aux``.
    opt_state_or_scale: an optax state holding one :class:`mpx.LossScaleState`,
      or the scale itself as a scalar array.
    argnums: which positional arguments to differentiate (with NNX arguments,
      an ``nnx.DiffState`` too, as for ``nnx.grad``).
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
  loss_scale = loss_scale_value(opt_state_or_scale)

  # `wraps` gives `scaled` the signature of `fun`, which nnx.grad reads to
  # turn keyword arguments into positional ones.
  @functools.wraps(fun)
  def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    if not tree_lib.is_floating_array(loss):
      raise errors.LeafTypeError(
        f"The loss must be a floating-point scalar array, got {loss!r}. Return e.g. "
        "loss.mean() from the loss function."
      )
    return loss.astype(jnp.float32) * loss_scale, (loss, aux)

  def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    if _has_nnx_object((args, kwargs)):
      # jax.grad would differentiate copies of the NNX objects, and their state
      # updates would be lost. Only NNX users get here: `import mpx` needs no Flax.
      from flax import nnx

      grad_fn = nnx.grad(scaled, argnums=argnums, has_aux=True)
    else:
      grad_fn = jax.grad(scaled, argnums=argnums, has_aux=True)
    grads, (loss, aux) = grad_fn(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped
