"""Exact float32 masters in 4 bytes: a bfloat16 param and a 16-bit remainder.

A float32 number is 32 bits; a bfloat16 number is its high 16 bits. The
bfloat16 param the model uses and an int16 *remainder* beside it can
therefore hold a float32 master bit for bit, at half the cost of a float32
master next to the param (layout (b)). The split (:func:`split`) rounds the
master to the nearest bfloat16 with ties away from zero, so that the master
is ``(param_bits << 16) + remainder`` in 32-bit integer arithmetic; the
remainder's sign says whether the param was rounded up (in magnitude).

Why ties away from zero, and not the ties-to-even of ``astype``: with ties to
even, 65,537 float32 numbers round to each even bfloat16 number (both
neighbouring halfway points) and 65,535 to each odd one, so no 16-bit
remainder can tell all masters of an even param apart. Rounding halfway
points always away from zero gives every bfloat16 number exactly 65,536
masters, and the split is a bijection on every float32 number but NaN. The
param differs from ``master.astype(jnp.bfloat16)`` only when the master lies
exactly halfway between two bfloat16 numbers and the lower one (in
magnitude) is even: its low 16 bits are exactly ``0x8000``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.dtypes import F32
from mpx._src.optim import base

BF16 = np.dtype(jnp.bfloat16)
_INT16 = np.dtype(np.int16)
_HALF = 0x8000


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits float32 values into bfloat16 params and int16 remainders, exactly.

  ``param`` is the bfloat16 number nearest to ``master``, halfway cases
  rounded away from zero; ``remainder`` is the low 16 bits of ``master``,
  read as a signed number, so that :func:`join` gives ``master`` back bit
  for bit for every float32 value except NaN. A NaN master gives a quiet NaN
  param of the master's sign and a zero remainder (the payload is dropped).
  Masters of magnitude at least ``bfloat16.max`` plus half its ulp get an
  infinite param, as with ``astype``, and a remainder that recovers them.

  Args:
    master: a float32 array.

  Returns:
    ``(param, remainder)``: a bfloat16 and an int16 array of ``master``'s shape.
  """
  bits = jax.lax.bitcast_convert_type(master.astype(F32), jnp.uint32)
  high = (bits + jnp.uint32(_HALF)) >> 16
  nan = jnp.isnan(master)
  high = jnp.where(nan, ((bits >> 16) & jnp.uint32(0x8000)) | jnp.uint32(0x7FC0), high)
  low = jnp.where(nan, jnp.uint32(0), bits & jnp.uint32(0xFFFF))
  param = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)
  remainder = jax.lax.bitcast_convert_type(low.astype(jnp.uint16), jnp.int16)
  return param, remainder


def join(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master of a bfloat16 ``param`` and its int16 ``remainder``.

  ``(param_bits << 16) + remainder`` in 32-bit integer arithmetic (wrapping),
  read as a float32: the inverse of :func:`split`.

  Args:
    param: a bfloat16 array.
    remainder: an int16 array of the same shape.

  Returns:
    The float32 array.
  """
  high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << 16
  low = remainder.astype(jnp.int32).astype(jnp.uint32)  # two's complement: wraps below zero
  return jax.lax.bitcast_convert_type(high + low, F32)


def remainder_toward(master: jax.Array, param: jax.Array) -> jax.Array:
  """The int16 remainder with which ``param`` gives back ``master``, or comes nearest to it.

  Exact (``join(param, r) == master`` bit for bit) whenever ``param`` is the
  param :func:`split` gives; otherwise the remainder of the float32 value
  nearest to ``master`` among those ``param`` can reach (an update that could
  not land on its target, see :func:`with_remainder_masters`).
  """
  high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << 16
  bits = jax.lax.bitcast_convert_type(master.astype(F32), jnp.uint32)
  diff = jax.lax.bitcast_convert_type(bits - high, jnp.int32)
  # The remainders a param can take without turning its float32 value into NaN: below
  # +-0 the bits wrap to the other sign's NaNs, above +-inf lie NaNs.
  lowest = jnp.where(param == 0, 0, -_HALF).astype(jnp.int32)
  highest = jnp.where(jnp.isinf(param), 0, _HALF - 1).astype(jnp.int32)
  exact = (diff >= lowest) & (diff <= highest)
  lo, hi = lowest.astype(jnp.int16), highest.astype(jnp.int16)
  nearer_hi = jnp.abs(join(param, hi) - master) < jnp.abs(join(param, lo) - master)
  return jnp.where(exact, diff.astype(jnp.int16), jnp.where(nearer_hi, hi, lo))


class RemainderMastersState(NamedTuple):
  """State of ``mpx.with_master_params(inner, remainder=True)``.

  Attributes:
    remainders: a tree shaped like the params holding an int16 array of the
      param's shape for every bfloat16 param (its master is
      ``join(param, remainder)``), and ``None`` for every other leaf.
    inner_state: the state of the inner transformation, built on the float32
      masters.
  """

  remainders: optax.Params
  inner_state: optax.OptState

  wide_updates = True
  """Its updates are float32 for bfloat16 params (``base.exact_update``): loss scaling must not
  narrow them."""

  @property
  def master_params(self) -> optax.Params:
    """``None`` at every leaf: no float32 copy is stored, each param is ``params + updates``."""
    return base.no_masters(self.remainders)

  def check(self, params: optax.Params, master_dtype: np.dtype | None) -> None:
    """Raises if a run expects masters wider than float32, or the remainders do not fit."""
    if master_dtype is not None and master_dtype != F32:
      base.refuse_masters(self, master_dtype)
    check_remainders(self, params)

  def weights(self, params: optax.Params) -> optax.Params:
    """The float32 masters ``join(p, r)``, other params at least float32."""
    return jax.tree.map(
      lambda r, p: base.widened(p) if r is None else join(p, r),
      self.remainders,
      params,
      is_leaf=base.is_none,
    )


base.HalfParamsState.register(RemainderMastersState)


def check_remainders(state: RemainderMastersState, params: optax.Params) -> None:
  """Raises if ``state`` does not hold an int16 remainder for exactly the bfloat16 params.

  Args:
    state: the state of ``with_master_params(..., remainder=True)``.
    params: the params the state is used with.

  Raises:
    StateError: naming the first leaf whose remainder is missing, superfluous
      or not an int16 array of its param's shape.
  """
  base.check_buffers(
    state.remainders,
    params,
    what="remainder",
    fits=lambda r, p: (r.shape, r.dtype, p.dtype) == (p.shape, _INT16, BF16),
    want=lambda p: f"int16{list(p.shape)} beside a bfloat16 param",
  )


def _check_params(params: optax.Params) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if tree_lib.is_floating_array(leaf) and leaf.dtype != BF16 and leaf.dtype.itemsize < 4:
      raise errors.ConfigError(
        f"params leaf {tree_lib.path_str(path)!r} has dtype {leaf.dtype}, but "
        "mpx.with_master_params(..., remainder=True) keeps a 16-bit remainder beside "
        "bfloat16 params only: a float32 master is a bfloat16 number and 16 more bits, "
        f"which {leaf.dtype} is not. Store the params in bfloat16 (param_dtype=bfloat16), or "
        "use mpx.with_master_params(inner) for float32 masters of float16 params."
      )


def with_remainder_masters(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Float32 masters of bfloat16 params, stored as 16-bit remainders (see ``with_master_params``)."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> RemainderMastersState:
    _check_params(params)
    remainders = jax.tree.map(
      lambda p: (
        jnp.zeros_like(p, jnp.int16) if tree_lib.is_floating_array(p) and p.dtype == BF16 else None
      ),
      params,
    )
    remainders = tree_lib.place_state(remainders, params)
    weights = RemainderMastersState(remainders, ()).weights(params)
    inner_state = tree_lib.place_state(inner.init(weights), weights)
    return RemainderMastersState(remainders, inner_state)

  def update_fn(
    updates: optax.Updates,
    state: RemainderMastersState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, RemainderMastersState]:
    params = base.require_params(params, "with_master_params")
    tree_lib.check_state_type(state, RemainderMastersState, "mpx.with_master_params")
    tree_lib.check_same_structure(updates, params, names=("gradients", "params"))
    _check_params(params)
    check_remainders(state, params)
    weights = state.weights(params)
    inner_updates, inner_state = base.inner_step(
      inner, updates, state.inner_state, weights, extra_args
    )
    rems = state.remainders
    masters = jax.tree.map(
      lambda r, w, u: None if r is None else w + u.astype(F32),
      rems,
      weights,
      inner_updates,
      is_leaf=base.is_none,
    )
    param_updates = jax.tree.map(
      lambda m, p, u: u if m is None else base.exact_update(split(m)[0], p, F32),
      masters,
      params,
      inner_updates,
      is_leaf=base.is_none,
    )
    # Relative to the param p + u that mpx.apply_updates and optax.apply_updates return.
    new_rems = jax.tree.map(
      lambda m, p, u: None if m is None else remainder_toward(m, base.add(p, u)),
      masters,
      params,
      param_updates,
      is_leaf=base.is_none,
    )
    return param_updates, RemainderMastersState(new_rems, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
