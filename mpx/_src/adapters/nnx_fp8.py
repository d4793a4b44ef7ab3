"""The NNX layers' float8 contractions: ``Fp8DotGeneral``, ``Fp8Einsum``, ``Fp8ConvGeneralDilated``, ``Fp8History``.

Under a policy with a :class:`mpx.Fp8Recipe`, the NNX adapter
(``mpx._src.adapters.nnx``) gives ``Linear``, ``LinearGeneral`` and ``Einsum``
layers a float8 ``dot_general`` / ``einsum_op`` here, and ``Conv`` layers a
float8 ``conv_general_dilated``; a delayed recipe's amax
histories are :class:`Fp8History` variables of the module installed in the
layer. What is shared with the linen adapter is in
``mpx._src.adapters.fp8_wiring``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mpx._src import recipe as recipe_lib
from mpx._src.adapters import fp8_wiring
from mpx._src.ops import fp8_scaling


class Fp8History(nnx.Variable):
  """One tensor's amax history for delayed fp8 scaling: ``float32[history_length + 1]``.

  A layer of an ``nnx.vmap`` stack has one per layer: ``float32[layers, history_length + 1]``.

  ``[pending, most recent, ..., oldest]``; see :func:`mpx.fp8.update_fp8_state`.
  Select them with ``nnx.split(model, nnx.Param, mpx.nnx.Fp8History, ...)``.
  """


class Fp8DotGeneral(nnx.Module):
  """A ``dot_general`` with float8 operands whose delayed-scaling state is NNX variables.

  :func:`mpx.nnx.apply_policy` installs one as the ``dot_general`` of each ``Linear``
  and ``LinearGeneral`` under a policy with a delayed :class:`mpx.Fp8Recipe`,
  with three :class:`Fp8History` variables: ``lhs``, ``rhs`` and ``grad``.

  Args:
    recipe: the delayed-scaling recipe.
    batch_shape: the leading axes of the layer's stack (``(layers,)`` for a
      layer built under ``nnx.vmap``), so that ``nnx.scan`` over the stack
      hands each layer its own histories.
  """

  def __init__(self, recipe: recipe_lib.Fp8Recipe, *, batch_shape: tuple[int, ...] = ()) -> None:
    self.recipe = recipe
    for name in fp8_wiring.HISTORY_NAMES:
      setattr(self, name, Fp8History(fp8_scaling.init_history(recipe, batch_shape=batch_shape)))

  def _histories(self) -> fp8_wiring.History:
    lhs, rhs, grad = (getattr(self, name)[...] for name in fp8_wiring.HISTORY_NAMES)
    return lhs, rhs, grad

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """Computes :func:`mpx.fp8.fp8_dot_general` with this layer's histories.

    Args:
      *args: as for ``jax.lax.dot_general``.
      **kwargs: as for ``jax.lax.dot_general``.

    Returns:
      The product.
    """
    return fp8_wiring.dot_general(self.recipe, self._histories())(*args, **kwargs)


class Fp8ConvGeneralDilated(Fp8DotGeneral):
  """A ``conv_general_dilated`` for ``nnx.Conv`` with :class:`Fp8DotGeneral`'s histories."""

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """Computes :func:`mpx.fp8.fp8_conv_general_dilated` with this layer's histories.

    Args:
      *args: as for ``jax.lax.conv_general_dilated``.
      **kwargs: as for ``jax.lax.conv_general_dilated``.

    Returns:
      The convolution.
    """
    return fp8_wiring.conv_general_dilated(self.recipe, self._histories())(*args, **kwargs)


class Fp8Einsum(Fp8DotGeneral):
  """An ``einsum_op`` for ``nnx.Einsum`` whose contraction is :class:`Fp8DotGeneral`'s."""

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """``jnp.einsum`` with this layer's float8 ``dot_general``.

    Args:
      *args: as for ``jnp.einsum``.
      **kwargs: as for ``jnp.einsum``.

    Returns:
      The contraction.
    """
    return fp8_wiring.einsum(self.recipe, self._histories())(*args, **kwargs)


def _stack_shape(module: nnx.Module) -> tuple[int, ...]:
  """The leading axes of a ``Linear``, ``LinearGeneral``, ``Einsum`` or ``Conv`` built under ``nnx.vmap``.

  ``nnx.vmap`` stacks the kernel but leaves the layer's static fields as one
  layer's, so the axes the kernel has beyond what those fields give are the
  stack's. ``()`` for a layer built alone, or inside the vmapped constructor.
  """
  if "kernel_shape" in vars(module):  # Einsum, Conv
    ndim = len(module.kernel_shape)  # pyright: ignore[reportAttributeAccessIssue]
  elif "batch_axis" in vars(module):  # LinearGeneral
    fields: Any = module
    ndim = len(fields.batch_axis) + len(fields.in_features) + len(fields.out_features)
  else:  # Linear
    ndim = 2
  shape = module.kernel.shape  # pyright: ignore[reportAttributeAccessIssue]
  return tuple(shape[: len(shape) - ndim])


def configure(module: nnx.Module, recipe: recipe_lib.Fp8Recipe) -> None:
  """Gives a ``Linear``, ``LinearGeneral``, ``Einsum`` or ``Conv`` a float8 contraction (not if customised).

  Args:
    module: the layer.
    recipe: its policy's float8 recipe.
  """
  fields = vars(module)
  attention = fp8_wiring.attention_fn(recipe, fields.get("attention_fn"))
  if attention is not None:
    module.attention_fn = attention  # pyright: ignore[reportAttributeAccessIssue]
  if fp8_wiring.uses_default_conv(fields, recipe):
    if recipe.delayed:
      conv = Fp8ConvGeneralDilated(recipe, batch_shape=_stack_shape(module))
      module.conv_general_dilated = nnx.data(conv)  # pyright: ignore[reportAttributeAccessIssue]
    else:
      module.conv_general_dilated = fp8_wiring.conv_general_dilated(recipe)  # pyright: ignore[reportAttributeAccessIssue]
  elif fp8_wiring.uses_default_dot(fields):
    if recipe.delayed:
      dot = Fp8DotGeneral(recipe, batch_shape=_stack_shape(module))
      module.dot_general = nnx.data(dot)  # pyright: ignore[reportAttributeAccessIssue]
    else:
      module.dot_general = fp8_wiring.dot_general(recipe)  # pyright: ignore[reportAttributeAccessIssue]
  elif fields.get("einsum_op") is jnp.einsum:
    if recipe.delayed:
      einsum = Fp8Einsum(recipe, batch_shape=_stack_shape(module))
      module.einsum_op = nnx.data(einsum)  # pyright: ignore[reportAttributeAccessIssue]
    else:
      module.einsum_op = fp8_wiring.einsum(recipe)  # pyright: ignore[reportAttributeAccessIssue]
