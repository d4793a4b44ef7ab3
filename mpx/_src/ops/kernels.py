"""Float32 kernels for half-precision models (paper section 3.3).

Two things a layer's ``dtype`` cannot express:

* :func:`softmax`: a softmax (a reduction that overflows or loses mass in
  float16) that runs in float32 between half-precision matmuls, as
  :func:`mpx.dot_product_attention` (``attention.py``) uses it;
* :func:`accumulate_in_float32`: a ``dot_general`` / ``conv_general_dilated``
  that requests float32 accumulation explicitly, forward and backward, while
  keeping half-precision operands and outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from mpx._src import dtypes as dtypes_lib


def _softmax_primal(x: jax.Array, where: Any, axis: Any, masked_value: float | None) -> jax.Array:
  x32 = x.astype(dtypes_lib.at_least_float32(x.dtype))
  if masked_value is None:
    return jax.nn.softmax(x32, axis=axis, where=where).astype(x.dtype)
  return jax.nn.softmax(jnp.where(where, x32, masked_value), axis=axis).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _softmax(x: jax.Array, where: Any, axis: Any, masked_value: float | None) -> jax.Array:
  return _softmax_primal(x, where, axis, masked_value)


def _softmax_fwd(x, where, axis, masked_value):
  y = _softmax_primal(x, where, axis, masked_value)
  # Masked entries of y are 0, so their gradient is too; only a row masked
  # entirely (uniform after filling) needs the mask itself.
  return y, (y, None if masked_value is None else where)


def _softmax_bwd(axis, masked_value, res, g):
  del masked_value
  y, where = res
  wide = dtypes_lib.at_least_float32(y.dtype)
  y, g = y.astype(wide), g.astype(wide)
  dx = y * (g - jnp.sum(g * y, axis=axis, keepdims=True))
  if where is not None:
    dx = jnp.where(where, dx, jnp.zeros((), wide))
  return dx.astype(res[0].dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(x: jax.Array, axis: int | tuple[int, ...] = -1, where: Any = None) -> jax.Array:
  """Softmax computed in float32 and returned in the dtype of ``x``.

  Use it in hand-written attention instead of ``jax.nn.softmax``: its exp and
  sum are reductions that overflow or lose mass in float16 (paper section 3).
  The backward pass saves only the output, in the dtype of ``x`` (which the
  next matmul keeps anyway), and computes ``y * (g - sum(g * y))`` in float32
  from it, as Megatron-LM's fused softmax does; plain autodiff of a float32
  softmax would keep float32 copies of the whole attention matrix.

  Args:
    x: the logits, any floating dtype.
    axis: the axis (or axes) to normalize over.
    where: optional mask of elements to include, as in ``jax.nn.softmax``
      (excluded elements get probability 0).

  Returns:
    The softmax of ``x``, in ``x.dtype``.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> mpx.softmax(jnp.zeros(4, jnp.float16))
    Array([0.25, 0.25, 0.25, 0.25], dtype=float16)
  """
  return cast(jax.Array, _softmax(x, where, axis, None))


_MATMULS = (jex.primitives.dot_general_p, jex.primitives.conv_general_dilated_p)


def _eval_accumulating(closed: jex.ClosedJaxpr, *args: Any) -> list[Any]:
  """Evaluates a jaxpr with every matmul/conv accumulating in float32."""
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]

  env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(closed.jaxpr.invars, args, strict=True))
  for eqn in closed.jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive in _MATMULS:
      out_dtype = eqn.outvars[0].aval.dtype
      params = dict(eqn.params, preferred_element_type=np.dtype(jnp.float32))
      outs = [eqn.primitive.bind(*invals, **params).astype(out_dtype)]
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in closed.jaxpr.outvars]


def accumulate_in_float32(op: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """Wraps ``lax.dot_general`` or ``lax.conv_general_dilated`` to accumulate in float32.

  The product is computed with ``preferred_element_type=float32`` and rounded
  once to the operands' dtype (paper section 3.3, what cuBLAS does for half
  operands, made explicit for every backend). A custom VJP keeps the backward
  matmuls' operands in half precision and makes them accumulate in float32
  too; plain ``preferred_element_type=float32`` would instead make both
  backward matmuls float32 x float32.

  Memory: the residuals saved for the backward pass are the half-precision
  operands, exactly as without the wrapper; each matmul only needs a transient
  float32 result buffer (twice the size of its half output) until it is
  rounded, which XLA usually fuses into the matmul.

  Args:
    op: ``jax.lax.dot_general`` or ``jax.lax.conv_general_dilated``.

  Returns:
    A function with the signature of ``op``, usable as a Flax layer's
    ``dot_general`` / ``conv_general_dilated`` argument.
  """

  @functools.wraps(op)
  def wrapped(lhs: jax.Array, rhs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    kwargs.pop("preferred_element_type", None)

    def plain(a: jax.Array, b: jax.Array) -> jax.Array:
      return op(a, b, *args, **kwargs)

    @jax.custom_vjp
    def product(a: jax.Array, b: jax.Array) -> jax.Array:
      return _eval_accumulating(jax.make_jaxpr(plain)(a, b), a, b)[0]

    def fwd(a: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
      return product(a, b), (a, b)

    def bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
      def transposed(a: jax.Array, b: jax.Array, g: jax.Array) -> Any:
        return jax.vjp(plain, a, b)[1](g)

      a, b = res
      ga, gb = _eval_accumulating(jax.make_jaxpr(transposed)(a, b, g), a, b, g)
      return ga, gb

    product.defvjp(fwd, bwd)
    return product(lhs, rhs)

  return wrapped


dot_general_f32_accumulation = accumulate_in_float32(jax.lax.dot_general)
conv_general_dilated_f32_accumulation = accumulate_in_float32(jax.lax.conv_general_dilated)
