"""The half-params base: what the wrappers that keep small updates of half params share.

A bfloat16 (or float16) weight loses every update below half its ulp. Three
optax wrappers keep those updates, each with its own state:

* ``mpx.with_master_params`` (``masters.py``) keeps a float32 master of every
  half param (layout (b), paper section 3.1);
* ``mpx.with_kahan_summation`` (``kahan.py``) carries each weight's rounding
  error in a buffer of the param dtype and adds it back on the next step
  (Kahan 1965; layout (c));
* ``mpx.with_stochastic_rounding`` (``stochastic_rounding.py``) rounds each new
  weight up or down at random, with probabilities that make the rounding
  unbiased (Gupta et al. 2015; layout (c)).

The last two keep no float32 copy of the weights (Zamirai et al.,
*Revisiting BFloat16 Training*, 2020). All three run the inner optimizer on
float32 gradients and float32 weights. The masters return float32 updates
(:func:`exact_update`), which land on the cast of the new master; the other
two return updates in the param dtype (:func:`update_toward`) and account for
where ``param + update`` lands. Their states are :class:`HalfParamsState`:
each holds a tree shaped like the params, with a master (buffer, key) at every
half param and ``None`` elsewhere, checks itself against the params, and
reads the weights the optimizer trains. This module holds what they share.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib

FIX = (
  "Restore the optimizer state together with the params it was saved with, using "
  "jax.eval_shape(tx.init, params) as the restore target, or rebuild it with tx.init(params)."
)


class HalfParamsState(abc.ABC):
  """The optimizer states that keep small updates of half-precision params.

  ``MasterParamsState`` keeps float32 masters. The states of
  ``mpx.with_kahan_summation`` and ``mpx.with_stochastic_rounding`` keep none:
  their ``master_params`` is ``None`` at every leaf, since each of their params
  is exactly ``params + updates``. A registered class has a ``master_params``
  attribute (a tree shaped like the params), an ``inner_state`` field, and the
  two methods below, so that ``mpx.check_state`` and ``mpx.get_master_params``
  ask the one such state of an optimizer (:func:`find_half_params_state`)
  instead of switching over the classes. Registration rather than a base
  class, as a ``NamedTuple`` has none.
  """

  @abc.abstractmethod
  def check(self, params: optax.Params, master_dtype: np.dtype | None) -> None:
    """Raises a ``StateError`` if this state does not fit ``params``.

    Args:
      params: the params the state is used with.
      master_dtype: the masters' dtype the run expects, or ``None`` when it
        trains without masters (``mixed_precision(..., master_dtype=None)``).
    """

  @abc.abstractmethod
  def weights(self, params: optax.Params) -> optax.Params:
    """The weights the optimizer trains, at least float32, shaped like ``params``."""


def find_half_params_state(opt_state: optax.OptState) -> Any:
  """Returns the one :class:`HalfParamsState` inside ``opt_state``, or ``None``.

  Args:
    opt_state: any optimizer state, e.g. that of ``mpx.mixed_precision``.

  Returns:
    The state of the one ``mpx.with_master_params``,
    ``mpx.with_kahan_summation`` or ``mpx.with_stochastic_rounding`` inside
    ``opt_state``, or ``None`` if there is none.

  Raises:
    StateError: ``opt_state`` holds more than one such state.
  """
  found = [node for _, node in tree_lib.find_nodes(opt_state, HalfParamsState)]
  if len(found) > 1:
    kinds = sorted({type(node).__name__ for node in found})
    what = f"{kinds[0]} entries" if len(kinds) == 1 else f"entries ({', '.join(kinds)})"
    raise errors.StateError(
      f"The optimizer state holds {len(found)} {what}, so it is ambiguous which one keeps "
      "the half-precision params. Wrap the whole optimizer in one mpx.with_master_params "
      "(or mpx.mixed_precision) instead of each part; around mpx.with_kahan_summation or "
      "mpx.with_stochastic_rounding, pass master_dtype=None to mpx.mixed_precision."
    )
  return found[0] if found else None


def keeps_wide_updates(opt_state: optax.OptState) -> bool:
  """Whether ``opt_state``'s half-params state returns updates wider than the params on purpose.

  ``mpx.with_master_params`` returns float32 updates of half-precision params
  (float32 masters, and remainder masters of bfloat16 params): only a float32
  update lands a weight that crosses zero or shrinks more than twofold
  exactly on the cast of its master. Wrappers around it must pass them on
  unnarrowed.
  """
  found = tree_lib.find_nodes(opt_state, HalfParamsState)
  return any(getattr(node, "wide_updates", False) for _, node in found)


def find_master_params(opt_state: optax.OptState) -> optax.Params | None:
  """Returns the master params held in ``opt_state``, or ``None`` if it has none.

  Args:
    opt_state: any optimizer state, e.g. that of ``mpx.mixed_precision``.

  Returns:
    The ``master_params`` tree of the one :class:`HalfParamsState` inside
    ``opt_state`` (``None`` at leaves without a master: every leaf of a
    compensated state), or ``None``.

  Raises:
    StateError: ``opt_state`` holds more than one :class:`HalfParamsState`.
  """
  state = find_half_params_state(opt_state)
  return None if state is None else state.master_params


def is_none(x: Any) -> bool:
  return x is None


def is_compensated(leaf: Any) -> bool:
  """Whether a param gets compensated updates: half-precision floating params only."""
  return tree_lib.is_floating_array(leaf) and dtypes_lib.is_half(leaf.dtype)


def no_masters(tree: Any) -> Any:
  """``None`` at every leaf of a params-shaped tree: the ``master_params`` of layout (c)."""
  return jax.tree.map(lambda _: None, tree, is_leaf=is_none)


def pair_with_params(tree: Any, params: optax.Params, mismatch: str) -> list[tuple[Any, Any, Any]]:
  """``(path, leaf, param)`` for every leaf of a params-shaped state tree (``None`` leaves too).

  Args:
    tree: the params-shaped tree of a state (masters, buffers or keys).
    params: the params the state is used with.
    mismatch: the start of the error when the structures differ, e.g.
      ``"The master params in the optimizer state do not have"``.

  Raises:
    StateError: ``tree`` does not have the tree structure of ``params``.
  """
  try:
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]
    param_leaves = jax.tree.structure(tree, is_leaf=is_none).flatten_up_to(params)
  except (ValueError, TypeError) as e:
    raise errors.StateError(f"{mismatch} the tree structure of the params ({e}). {FIX}") from None
  return [(path, leaf, param) for (path, leaf), param in zip(pairs, param_leaves, strict=True)]


def check_buffers(
  tree: Any,
  params: optax.Params,
  *,
  what: str,
  fits: Callable[[Any, Any], bool],
  want: Callable[[Any], str],
) -> None:
  """Raises if ``tree`` does not hold a fitting buffer for exactly the half params.

  Runs on shapes and dtypes only, so it costs nothing inside ``jit``.

  Args:
    tree: the params-shaped tree of a compensated state (buffers or keys).
    params: the params the state is used with.
    what: how one buffer is called in the message, e.g. ``"compensation"``.
    fits: whether a buffer fits its param, ``fits(buffer, param)``.
    want: what a buffer must be, for the message, ``want(param)``.

  Raises:
    StateError: naming the first leaf whose buffer is missing, superfluous or
      does not fit, and how to rebuild the state.
  """
  mismatch = f"The {what} tree in the optimizer state does not have"
  for path, leaf, param in pair_with_params(tree, params, mismatch):
    where = f"params leaf {tree_lib.path_str(path)!r}"
    if leaf is None:
      if is_compensated(param):
        raise errors.StateError(
          f"{where} has dtype {param.dtype} but the optimizer state holds no {what} for it, "
          "so its small updates would be rounded away (were the params restored under "
          f"another policy?). {FIX}"
        )
      continue
    if not is_compensated(param):
      kind = getattr(param, "dtype", type(param).__name__)
      raise errors.StateError(
        f"{where} is {kind} but the optimizer state holds a {what} for it; only "
        f"half-precision params have one (were the params restored under another policy?). "
        f"{FIX}"
      )
    if not (tree_lib.is_array(leaf) and fits(leaf, param)):
      got = f"{leaf.dtype}{list(leaf.shape)}" if tree_lib.is_array(leaf) else type(leaf).__name__
      raise errors.StateError(
        f"{where} is {param.dtype}{list(param.shape)} but its {what} is {got}; it must be "
        f"{want(param)}. {FIX}"
      )


def refuse_masters(state: Any, master_dtype: np.dtype | None) -> None:
  """Raises if a run that expects masters found a compensated state instead."""
  if master_dtype is not None:
    raise errors.StateError(
      f"The optimizer state keeps half params with a {type(state).__name__} instead of "
      f"float32 masters, but master_dtype={master_dtype} expects masters. Pass "
      "master_dtype=None, as to mpx.mixed_precision around a compensated optimizer."
    )


def require_params(params: optax.Params | None, name: str) -> optax.Params:
  """Returns ``params``, or raises the error of an ``update`` called without them."""
  if params is None:
    raise errors.ConfigError(
      f"mpx.{name} needs the current params to compensate their updates, but update was "
      "called without them. Call tx.update(grads, opt_state, params)."
    )
  return params


def float32_weights(params: optax.Params, buffers: Any) -> optax.Params:
  """The params, float32 where ``buffers`` has a buffer: the weights the inner optimizer sees."""
  return jax.tree.map(
    lambda b, p: p if b is None else p.astype(dtypes_lib.F32), buffers, params, is_leaf=is_none
  )


def inner_step(
  inner: optax.GradientTransformationExtraArgs,
  grads: optax.Updates,
  inner_state: optax.OptState,
  weights: optax.Params,
  extra_args: dict[str, Any],
) -> tuple[optax.Updates, optax.OptState]:
  """Runs ``inner`` on gradients cast to the dtypes of its float32 ``weights``."""
  grads = jax.tree.map(
    lambda g, w: g.astype(w.dtype) if tree_lib.is_floating_array(g) and g.dtype != w.dtype else g,
    grads,
    weights,
  )
  return inner.update(grads, inner_state, weights, **extra_args)


def update_toward(target: jax.Array, param: jax.Array, wide_dtype: np.dtype) -> jax.Array:
  """The param-dtype update ``u`` for which ``param + u`` is ``target``, where it can be.

  The difference of two param-dtype values is computed in ``wide_dtype``,
  where it is exact whenever it is representable at all; then ``param + u``
  (what ``optax.apply_updates`` computes) is exactly ``target``.
  """
  diff = target.astype(wide_dtype) - param.astype(wide_dtype)
  # A weight flipping from +max to -max needs a difference beyond the param
  # dtype's range, which would round to inf and make p + u non-finite.
  # Clamped, p + u stays finite and the next update lands on the target.
  big = float(jnp.finfo(param.dtype).max)
  diff = jnp.where(jnp.isfinite(target), jnp.clip(diff, -big, big), diff)
  return diff.astype(param.dtype)


def exact_update(target: jax.Array, param: jax.Array, dtype: np.dtype) -> jax.Array:
  """The update ``u`` of the wider ``dtype`` for which :func:`add` ``(param, u)`` is ``target``.

  ``u = target - param`` computed in ``dtype``; ``param + u`` in ``dtype``,
  rounded to the param's dtype, is what ``optax.apply_updates`` computes
  under JAX's default dtype promotion and :func:`add` under any. With a
  float32 ``dtype`` the difference of two half-precision numbers is exact
  whenever it fits float32's 24 significant bits, and then the sum is
  ``target`` bit for bit; a weight growing by any factor lands too, as the
  rounding of the difference is far below the target's ulp. What can miss is
  a target more than ``2**16`` (bfloat16) or ``2**13`` (float16) times
  smaller than the param, with bits below float32's resolution at the param
  (``param + u`` lies on float32's grid there; see ``mpx.with_master_params``
  for when a master has such bits), and bfloat16 values beyond float32's
  arithmetic: subnormals, which XLA flushes, and moves between values near
  the format's max, whose difference overflows and is clamped. Where
  ``target`` equals ``param`` the update is ``-0.0``, since ``param +
  (-0.0)`` is ``param`` bitwise, ``-0.0`` and infinities included; a
  ``target`` of ``-0.0`` is reached from ``-0.0`` only (``p + (-p)`` is
  ``+0.0``).

  Args:
    target: the value the param should take, in the param's dtype.
    param: the current param.
    dtype: the update's dtype, at least as wide as the param's.

  Returns:
    The update, of ``dtype``.
  """
  t, p = target.astype(dtype), param.astype(dtype)
  same = (t == p) & (jnp.signbit(t) == jnp.signbit(p))
  diff = jnp.where(same, -0.0, t - p)  # inf - inf: no move, not NaN
  big = float(jnp.finfo(dtype).max)
  return jnp.where(jnp.isfinite(t), jnp.clip(diff, -big, big), diff)


def add(param: Any, update: Any) -> Any:
  """``param + update`` as ``optax.apply_updates`` computes it under default dtype promotion.

  The sum is taken in the dtype JAX's standard promotion gives the two
  (float32 for a half param and a float32 update) and rounded to the param's
  dtype, with explicit conversions, so it also runs under strict promotion,
  where optax's ``param + update`` raises for mixed dtypes.

  Args:
    param: a param leaf, or ``None``.
    update: its update.

  Returns:
    The new param, of the param's dtype (``None`` for a ``None`` param).
  """
  if param is None:
    return None
  param, update = jnp.asarray(param), jnp.asarray(update)
  with jax.numpy_dtype_promotion("standard"):
    wide = jnp.promote_types(param.dtype, update.dtype)
  return (param.astype(wide) + update.astype(wide)).astype(param.dtype)


def widened(leaf: Any) -> Any:
  """A floating leaf converted to at least float32; other leaves as they are."""
  if not tree_lib.is_floating_array(leaf):
    return leaf
  return leaf.astype(dtypes_lib.at_least_float32(leaf.dtype))


def weights_of(stored: Any, params: optax.Params, *, compensation: bool) -> optax.Params:
  """The weights the optimizer trains, from a state's params-shaped tree and the params.

  Args:
    stored: masters (``compensation=False``: the master is the weight) or
      Kahan buffers (``compensation=True``: the weight is ``param + buffer``
      in float32); ``None`` or ``optax.MaskedNode`` where a param has none.
    params: the params the state belongs to.
    compensation: whether ``stored`` holds buffers rather than masters.

  Returns:
    A tree with the structure of ``params``: at least float32 at every
    floating leaf, other leaves as they are.

  Raises:
    StateError: ``stored`` does not have the structure of ``params``.
  """

  def absent(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)

  def one(s: Any, p: Any) -> Any:
    if absent(s):
      return widened(p)
    if compensation:
      return widened(p) + s.astype(widened(p).dtype)
    return s

  try:
    return jax.tree.map(one, stored, params, is_leaf=absent)
  except ValueError as e:
    raise errors.StateError(
      f"The optimizer state's masters or compensation buffers do not have the tree structure "
      f"of the params ({e}). Pass the params this optimizer state belongs to."
    ) from None
