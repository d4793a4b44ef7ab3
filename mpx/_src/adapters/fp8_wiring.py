"""The float8 wiring both Flax adapters share: which contractions a float8 policy replaces, and with what.

Under a policy with a :class:`mpx.Fp8Recipe`, the linen and NNX adapters give
the layers left at Flax's default contraction :func:`mpx.fp8.fp8_dot_general`
instead, and the convolutions left at Flax's default
:func:`mpx.fp8.fp8_conv_general_dilated`; a layer with a contraction of its
own (a custom ``dot_general``, ``dot_general_cls``, ``conv_general_dilated``
or ``conv_general_dilated_cls``) keeps it. Each adapter stores a delayed recipe's amax
histories its own way (linen variables, NNX ``Variable`` attributes), under
the names :data:`HISTORY_NAMES`; the rest is here, Flax-free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import recipe as recipe_lib
from mpx._src.ops import attention, fp8_conv, kernels
from mpx._src.ops import fp8 as fp8_lib

HISTORY_NAMES = ("lhs", "rhs", "grad")
"""The amax histories of one delayed-scaling contraction, in the order of its ``state``."""

# JAX's own contraction and mpx's float32-accumulating one: the defaults a float8 policy replaces.
_REPLACEABLE_DOTS = (None, jax.lax.dot_general, kernels.dot_general_f32_accumulation)

# Likewise for convolutions.
_REPLACEABLE_CONVS = (
  None,
  jax.lax.conv_general_dilated,
  kernels.conv_general_dilated_f32_accumulation,
)

History = tuple[jax.Array, jax.Array, jax.Array]


def uses_default_dot(fields: Mapping[str, Any]) -> bool:
  """Whether a layer's ``dot_general`` is a default that a float8 policy replaces.

  Args:
    fields: the layer's attributes by name (``vars(layer)``).

  Returns:
    ``True`` for a layer with a ``dot_general`` left at JAX's (or mpx's
    float32-accumulating) contraction and no ``dot_general_cls``.
  """
  return (
    "dot_general" in fields
    and fields["dot_general"] in _REPLACEABLE_DOTS
    and fields.get("dot_general_cls") is None
  )


def uses_default_conv(fields: Mapping[str, Any], recipe: recipe_lib.Fp8Recipe) -> bool:
  """Whether a layer's ``conv_general_dilated`` is a default that ``recipe`` replaces.

  Args:
    fields: the layer's attributes by name (``vars(layer)``).
    recipe: the layer's float8 recipe.

  Returns:
    ``True`` for a layer with a ``conv_general_dilated`` left at JAX's (or mpx's float32-accumulating)
    and no ``conv_general_dilated_cls``, under a per-tensor recipe (current
    or delayed; see :func:`mpx.fp8.fp8_conv_general_dilated`).
  """
  return (
    "conv_general_dilated" in fields
    and fields["conv_general_dilated"] in _REPLACEABLE_CONVS
    and fields.get("conv_general_dilated_cls") is None
    and fp8_conv.covers(recipe=recipe)
  )


def conv_general_dilated(
  recipe: recipe_lib.Fp8Recipe, state: History | None = None
) -> Callable[..., Any]:
  """:func:`mpx.fp8.fp8_conv_general_dilated` with ``recipe`` (and a delayed recipe's histories) bound.

  Args:
    recipe: the float8 recipe.
    state: the ``(lhs, rhs, grad)`` amax histories of a delayed recipe.

  Returns:
    A ``conv_general_dilated``.
  """
  return functools.partial(fp8_conv.fp8_conv_general_dilated, recipe=recipe, state=state)


def dot_general(recipe: recipe_lib.Fp8Recipe, state: History | None = None) -> Callable[..., Any]:
  """:func:`mpx.fp8.fp8_dot_general` with ``recipe`` (and a delayed recipe's histories) bound.

  Args:
    recipe: the float8 recipe.
    state: the ``(lhs, rhs, grad)`` amax histories of a delayed recipe.

  Returns:
    A ``dot_general``.
  """
  return functools.partial(fp8_lib.fp8_dot_general, recipe=recipe, state=state)


def einsum(recipe: recipe_lib.Fp8Recipe, state: History | None = None) -> Callable[..., Any]:
  """``jnp.einsum`` contracting through :func:`dot_general`.

  Args:
    recipe: the float8 recipe.
    state: the ``(lhs, rhs, grad)`` amax histories of a delayed recipe.

  Returns:
    An ``einsum``.
  """
  if state is None:
    return functools.partial(jnp.einsum, _dot_general=dot_general(recipe))
  return functools.partial(_einsum_with_state, state, recipe=recipe)


def _einsum_with_state(
  state: History, subscripts: str, *operands: jax.Array, recipe: recipe_lib.Fp8Recipe, **kwargs: Any
) -> jax.Array:
  # jnp.einsum takes its contraction as a static argument, hashed by its jit: the
  # histories go through a jit of their own instead, traced like the operands. (Bound
  # into the static contraction they were hashed, which failed outside jax.jit, where
  # they are concrete arrays; and each call would have compiled anew.)
  options = tuple(sorted(kwargs.items()))
  return _traced_einsum(state, operands, subscripts=subscripts, recipe=recipe, options=options)


@functools.partial(jax.jit, static_argnames=("subscripts", "recipe", "options"))
def _traced_einsum(
  state: History,
  operands: tuple[jax.Array, ...],
  *,
  subscripts: str,
  recipe: recipe_lib.Fp8Recipe,
  options: tuple[tuple[str, Any], ...],
) -> jax.Array:
  return jnp.einsum(subscripts, *operands, _dot_general=dot_general(recipe, state), **dict(options))


def attention_fn(recipe: recipe_lib.Fp8Recipe, current: Any) -> Callable[..., Any] | None:
  """The float8 ``attention_fn`` for an attention layer, if the recipe covers attention.

  Args:
    recipe: the layer's float8 recipe.
    current: the layer's ``attention_fn``.

  Returns:
    :func:`mpx.dot_product_attention` with float8 matmuls
    (``recipe.for_attention()``), where ``recipe.attention`` is set and the
    layer uses mpx's attention; ``None`` to leave the layer alone.
  """
  if not recipe.attention or current is not attention.dot_product_attention:
    return None
  return functools.partial(
    attention.dot_product_attention, dot_general=dot_general(recipe.for_attention())
  )
