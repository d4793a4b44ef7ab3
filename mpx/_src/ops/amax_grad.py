"""A float32 whose cotangents accumulate by ``max``: how fp8 amaxes come back as gradients.

One amax history can feed several float8 calls (a shared layer, a ``scan``
over one history). Its "gradient" is the amax each call observed, and those
must combine by ``max``, not by ``+``. :func:`fp8_max_grad` gives the history
an extended dtype whose cotangent rules do that. Uses JAX internals
(extended dtypes): pinned by the tests of :mod:`mpx._src.ops.fp8`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_util, earray
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes
from jax._src.interpreters import pxla


class _AmaxRules:
  """JAX's rules for :data:`AMAX_FLOAT32`: a float32 whose cotangents accumulate by ``max``.

  When one history feeds several calls (a shared layer, a ``scan`` over one
  module), autodiff adds the calls' cotangents with the ``add`` of their dtype.
  Each call's cotangent is the amax it observed; adding them would record the
  sum, which over-estimates the amax and under-scales every later call. With
  ``max`` the history records what one call over all the data would have seen.
  """

  @staticmethod
  def physical_element_aval(dtype: Any) -> jax_core.ShapedArray:
    del dtype
    return jax_core.ShapedArray((), np.dtype(np.float32))

  @staticmethod
  def convert_from(dtype: Any, other: Any) -> bool:
    del dtype
    return np.dtype(other) == np.float32

  @staticmethod
  def convert_to(other: Any, dtype: Any) -> bool:
    del dtype
    return np.dtype(other) == np.float32

  @staticmethod
  def add(dtype: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    larger = jax.lax.max(as_float32(x), as_float32(y))
    return jax.lax.convert_element_type(larger, dtype)

  @staticmethod
  def zero(dtype: Any) -> jax.Array:
    # Amaxes are non-negative: 0 is the identity of their max.
    return jax.lax.convert_element_type(np.float32(0.0), dtype)

  @staticmethod
  def tangent_dtype(dtype: Any) -> Any:
    return dtype

  @staticmethod
  def full(shape: Any, fill_value: Any, dtype: Any) -> jax.Array:
    value = jax.lax.convert_element_type(fill_value, np.float32)
    return jax.lax.convert_element_type(jax.lax.full(shape, value, np.float32), dtype)

  @staticmethod
  def global_sharded_result_handler(aval: Any, out_sharding: Any, committed: bool) -> Any:
    # Outside jit (eager autodiff) the converted history is materialised: wrap
    # its float32 buffers.
    physical = jax_core.physical_aval(aval)
    handler = pxla.global_result_handlers[jax_core.ShapedArray](physical, out_sharding, committed)
    return lambda buffers: earray.EArray(aval, handler(buffers))


class _AmaxType(jax_dtypes.extended):
  pass


class _AmaxDType(jax_dtypes.ExtendedDType):
  _rules = _AmaxRules
  name = "amax_float32"

  @property
  def type(self) -> type:
    return _AmaxType

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _AmaxDType)

  def __hash__(self) -> int:
    return hash(_AmaxDType)

  def __repr__(self) -> str:
    return self.name


AMAX_FLOAT32 = _AmaxDType()


def _add_extended(x: Any, y: Any) -> Any:
  return x.aval.dtype._rules.add(x.aval.dtype, x, y)


# Eager (un-jitted) autodiff adds materialised cotangents through this table, which
# has no entry for extended dtypes; under jit their own rules.add is used already.
ad_util.raw_jaxval_adders.setdefault(earray.EArray, _add_extended)


def as_float32(x: jax.Array) -> jax.Array:
  return jax.lax.convert_element_type(x, np.float32) if x.dtype == AMAX_FLOAT32 else x


def fp8_max_grad(state: Any) -> Any:
  """The histories of ``state``, typed so that autodiff combines several uses by ``max``.

  A history read by several calls in one differentiated function (a layer
  applied twice, a ``jax.lax.scan`` or ``nn.scan`` over one module with
  broadcast histories) gets, as its gradient, the combination of what each
  call observed. Plain float32 histories combine by sum; histories passed
  through this function combine by max, so the gradient is the largest amax
  of any call, as one call over all the data would have observed. Apply it
  inside the differentiated function, where the histories enter, before
  anything reads them; the gradient with respect to the original float32
  histories is then the max. :func:`fp8_dot_general` applies it to its own
  ``state``, which is enough when each history is read once.

  Args:
    state: a pytree of float32 histories (already converted leaves pass).

  Returns:
    ``state`` with every leaf of dtype :data:`AMAX_FLOAT32` (float32 in
    memory; read it with ``jax.lax.convert_element_type(h, jnp.float32)``).
  """

  def one(history: jax.Array) -> jax.Array:
    if history.dtype == AMAX_FLOAT32:
      return history
    return jax.lax.convert_element_type(jnp.asarray(history, jnp.float32), AMAX_FLOAT32)

  return jax.tree.map(one, state)
