"""The linen layers' float8 contraction: ``Fp8DotGeneral``, ``Fp8ConvGeneralDilated``, ``nn.Einsum``'s body.

Under a policy with a :class:`mpx.Fp8Recipe`, the linen adapter
(``mpx._src.adapters.linen``) gives ``Dense`` and ``DenseGeneral`` copies a
float8 ``dot_general`` here, and ``Conv`` copies a float8 ``conv_general_dilated``;
a delayed recipe's amax histories are linen variables in the ``"fp8_history"``
collection. Linen's ``Einsum`` has no
``dot_general`` knob, so the adapter runs its body from :func:`einsum_call`.
What is shared with the NNX adapter is in ``mpx._src.adapters.fp8_wiring``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mpx._src import errors
from mpx._src import recipe as recipe_lib
from mpx._src.adapters import fp8_wiring
from mpx._src.ops import fp8_scaling

FP8_COLLECTION = "fp8_history"
"""The linen collection that holds the amax histories of delayed fp8 scaling."""


class Fp8ConvGeneralDilated(nn.Module):
  """A ``conv_general_dilated`` with float8 operands whose delayed-scaling state is linen variables.

  :func:`mpx.linen.apply_policy` installs it as the ``conv_general_dilated_cls`` of
  ``Conv`` layers under a policy with a delayed :class:`mpx.Fp8Recipe`, with the
  same three histories as :class:`Fp8DotGeneral` (``lhs``, ``rhs``, ``grad``).

  Attributes:
    recipe: the delayed-scaling recipe.
  """

  recipe: recipe_lib.Fp8Recipe

  @nn.compact
  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    """Computes :func:`mpx.fp8.fp8_conv_general_dilated` with this layer's histories.

    Args:
      *args: as for ``jax.lax.conv_general_dilated``.
      **kwargs: as for ``jax.lax.conv_general_dilated``.

    Returns:
      The convolution.
    """
    conv = fp8_wiring.conv_general_dilated(self.recipe, _histories(self, self.recipe))
    return conv(*args, **kwargs)


class Fp8DotGeneral(nn.Module):
  """A ``dot_general`` with float8 operands whose delayed-scaling state is linen variables.

  :func:`mpx.linen.apply_policy` installs it as the ``dot_general_cls`` of ``Dense`` and
  ``DenseGeneral`` layers under a policy with a delayed :class:`mpx.Fp8Recipe`.
  It keeps three ``float32[history_length + 1]`` amax histories, ``lhs``,
  ``rhs`` and ``grad``, in the ``"fp8_history"`` collection (see
  :func:`mpx.fp8.update_fp8_state`).

  Attributes:
    recipe: the delayed-scaling recipe.
  """

  recipe: recipe_lib.Fp8Recipe

  @nn.compact
  def __call__(
    self,
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **unused: Any,
  ) -> jax.Array:
    """Computes :func:`mpx.fp8.fp8_dot_general` with this layer's histories.

    Args:
      lhs: the left operand.
      rhs: the right operand.
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: as for ``jax.lax.dot_general``.
      preferred_element_type: the output dtype (``None``: ``lhs.dtype``).
      **unused: ignored (``out_sharding``).

    Returns:
      The product.
    """
    dot = fp8_wiring.dot_general(self.recipe, _histories(self, self.recipe))
    return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _histories(module: nn.Module, recipe: recipe_lib.Fp8Recipe) -> fp8_wiring.History:
  """The layer's amax histories in the ``"fp8_history"`` collection (made on ``init``)."""
  lhs, rhs, grad = (
    module.variable(FP8_COLLECTION, name, fp8_scaling.init_history, recipe).value
    for name in fp8_wiring.HISTORY_NAMES
  )
  return lhs, rhs, grad


def configure(
  module: nn.Module,
  recipe: recipe_lib.Fp8Recipe,
  fields: set[str],
  *,
  set_field: Callable[[nn.Module, str, Any], None],
) -> None:
  """Gives a ``Dense`` / ``DenseGeneral`` copy a float8 ``dot_general``, a ``Conv`` copy a float8 convolution.

  A layer with its own contraction (or convolution) keeps it.

  Args:
    module: the layer's copy for this call.
    recipe: its policy's float8 recipe.
    fields: the names of its dataclass fields.
    set_field: writes one field of the copy.
  """
  attention = fp8_wiring.attention_fn(recipe, getattr(module, "attention_fn", None))
  if attention is not None:
    set_field(module, "attention_fn", attention)
  # ConvLocal's unshared kernels are no convolution: only Conv's shared weights go float8.
  if (
    "conv_general_dilated_cls" in fields
    and getattr(module, "shared_weights", False)
    and fp8_wiring.uses_default_conv(vars(module), recipe)
  ):
    if recipe.delayed:
      set_field(module, "conv_general_dilated", None)
      set_field(
        module, "conv_general_dilated_cls", functools.partial(Fp8ConvGeneralDilated, recipe=recipe)
      )
    else:
      set_field(module, "conv_general_dilated", fp8_wiring.conv_general_dilated(recipe))
    return
  # Delayed scaling goes through dot_general_cls: only a layer with that field takes it.
  if "dot_general_cls" not in fields or not fp8_wiring.uses_default_dot(vars(module)):
    return
  if recipe.delayed:
    set_field(module, "dot_general", None)
    set_field(module, "dot_general_cls", functools.partial(Fp8DotGeneral, recipe=recipe))
  else:
    set_field(module, "dot_general", fp8_wiring.dot_general(recipe))


def einsum_call(
  module: Any, recipe: recipe_lib.Fp8Recipe, inputs: jax.Array, einsum_str: str | None = None
) -> jax.Array:
  """The body of ``nn.Einsum.__call__`` with its contraction through :func:`mpx.fp8.fp8_dot_general`."""
  einsum_str = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str)
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise errors.ConfigError(
      f"nn.Einsum needs an explicit two-operand equation such as 'bd,dk->bk', got {einsum_str!r}."
    )
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias, broadcast_shape = None, None
  if module.use_bias:
    bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  einsum = fp8_wiring.einsum(recipe, _histories(module, recipe) if recipe.delayed else None)
  y = einsum(
    einsum_str,
    inputs,
    kernel,
    precision=module.precision,
    preferred_element_type=module.preferred_element_type,
  )
  if bias is not None:
    y += jnp.reshape(bias, broadcast_shape)  # pyright: ignore[reportArgumentType]
  return y
