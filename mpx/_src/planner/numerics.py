"""What each candidate does to the numbers of each layer's products, on a real calibration batch.

**Capture.** The model's float32 loss is traced to a jaxpr and run by a small
interpreter that, at each forward product (``dot_general`` or convolution) of a
decided layer, records the operands and adds a zero ``eps`` to the result:
the gradient with respect to ``eps`` is the gradient arriving at that
product (``g``), so one jitted forward and backward pass gives, per layer,
the activations, the weight and the incoming gradient, all float32. Products
inside loops (``lax.scan``, ``while``) are not reached: a layer stacked with
``nn.scan`` / ``nnx.scan`` is left without numerics.

**Errors.** Each candidate's product is recomputed from these operands as the
candidate computes it (:func:`mpx.fp8.fp8_dot_general` with its recipe, on
operands in the compute dtype; the compute dtype's own product otherwise),
forward and both backward products, and compared with float32
(``precision=HIGHEST``). The SQNR of a product is the median over its rows
(every axis but the last) of ``10 log10(|ref|^2 / |got - ref|^2)``, so a few
huge rows cannot carry a layer whose ordinary rows are lost. The flushed
fraction is the share of nonzero operand values that quantise to zero (or
saturate at the format's max) under the recipe's scales: per tensor
(current and delayed scaling; a delayed scale is taken from the batch
itself, as on the first step), per row of the contraction (rowwise), per block of
32 (MXFP8) or 128 (blockwise; its weights' 128 x 128 tiles are taken as rows
of 128) along it; gradients in E5M2 for the per-tensor recipes, E4M3 for
the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from mpx._src.audit import layer_paths
from mpx._src.ops import fp8 as fp8_lib
from mpx._src.ops import quantize as quantize_lib
from mpx._src.planner import cost

# Primitives whose body the interpreter enters (to reach the products inside).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"})
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class Captured:
  """One forward product of a decided layer on the calibration batch, in float32.

  Attributes:
    layer: the layer's path (audit form).
    primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
    params: the product's parameters (dimension numbers...).
    lhs: its left operand.
    rhs: its right operand.
    grad: the gradient arriving at its result.
  """

  layer: str
  primitive: str
  params: dict[str, Any]
  lhs: jax.Array
  rhs: jax.Array
  grad: jax.Array


def _walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: str, hook) -> list[Any]:
  """Evaluates ``jaxpr``, entering calls, with ``hook(eqn, name stack, inputs, output)`` at products."""
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    if eqn.primitive.name in _CALLS:
      sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      closed = sub if isinstance(sub, jex.ClosedJaxpr) else jex.ClosedJaxpr(sub, ())
      outs = _walk(closed.jaxpr, closed.consts, invals, name, hook)
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
      if eqn.primitive.name in _PRODUCTS:
        outs = [hook(eqn, name, invals, outs[0])]
    for v, x in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, jex.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def capture(
  loss: Callable[..., jax.Array],
  args: tuple[Any, ...],
  layers: Sequence[str],
  scopes: Callable[[Any], contextlib.AbstractContextManager[None]] = layer_paths.scopes,
) -> list[Captured]:
  """Records the operands and incoming gradient of every forward product of ``layers``.

  Args:
    loss: ``loss(*args)``, a float32 scalar: the model as written, in float32.
    args: its arguments, concrete arrays (params, model state, the batch).
    layers: the decided layers' paths (audit form).
    scopes: puts layer paths on the name stack while ``loss`` is traced.

  Returns:
    One :class:`Captured` per product reached, in program order.
  """
  with scopes(args):
    closed = jax.make_jaxpr(loss)(*args)
  leaves = jax.tree.leaves(args)
  found: list[tuple[str, str, dict[str, Any], Any]] = []

  def probe(eqn: Any, name: str, invals: list[Any], out: Any) -> Any:
    layer = cost.owner(layer_paths.layer_of(layer_paths.module_path(name + "/x")[0]), layers)
    if layer is not None:
      found.append(
        (layer, eqn.primitive.name, dict(eqn.params), jax.ShapeDtypeStruct(out.shape, out.dtype))
      )
    return out

  jax.eval_shape(lambda *a: _walk(closed.jaxpr, closed.consts, a, "", probe), *leaves)

  def run(eps: list[jax.Array], *a: Any) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    taps, index = [], iter(range(len(eps)))

    def hook(eqn: Any, name: str, invals: list[Any], out: Any) -> Any:
      layer = cost.owner(layer_paths.layer_of(layer_paths.module_path(name + "/x")[0]), layers)
      if layer is None:
        return out
      taps.append((invals[0], invals[1]))
      return out + eps[next(index)].astype(out.dtype)

    (value,) = _walk(closed.jaxpr, closed.consts, a, "", hook)
    return value.astype(jnp.float32), taps

  eps = [jnp.zeros(s.shape, s.dtype) for *_, s in found]
  grads, taps = jax.jit(jax.grad(run, has_aux=True))(eps, *leaves)
  return [
    Captured(layer, primitive, params, lhs, rhs, grad)
    for (layer, primitive, params, _), (lhs, rhs), grad in zip(found, taps, grads, strict=True)
  ]


# ------------------------------------------------------------------------ errors


def _row_sqnr(ref: jax.Array, got: jax.Array) -> jax.Array:
  """The median over rows (all axes but the last) of each row's SQNR in dB (``inf``: exact)."""
  ref = ref.astype(jnp.float32).reshape(-1, ref.shape[-1] if ref.ndim else 1)
  err = got.astype(jnp.float32).reshape(ref.shape) - ref
  signal, noise = jnp.sum(ref * ref, axis=1), jnp.sum(err * err, axis=1)
  db = jnp.where(noise > 0, 10 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)), jnp.inf)
  return jnp.nanmedian(jnp.where(signal > 0, db, jnp.nan))


def _grouping(recipe: Any) -> str | int:
  """How a recipe groups an operand's values under one scale: per tensor, per row, per block."""
  if recipe.scaling in ("current", "delayed"):
    return "tensor"
  return {"rowwise": "row", "mxfp8": 32, "blockwise": 128}[recipe.scaling]


def _lost(x: jax.Array, dtype: Any, axis: int, grouping: str | int) -> tuple:
  """``(values flushed to zero or saturated, nonzero values)`` of ``x`` quantised to ``dtype``.

  One scale per tensor (``"tensor"``), per line along ``axis`` (``"row"``) or
  per block of ``grouping`` elements along it, from the group's amax.
  """
  x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  x = x.reshape(-1, x.shape[-1])
  if grouping == "tensor":
    amax = jnp.max(jnp.abs(x))
  elif grouping == "row":
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  else:
    size = int(grouping)
    x = jnp.pad(x, ((0, 0), (0, -x.shape[1] % size))).reshape(x.shape[0], -1, size)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scale = quantize_lib.scale_for(amax, dtype)
  q = quantize_lib.dequantize(quantize_lib.quantize(x, dtype, scale), scale, jnp.float32)
  saturated = jnp.abs(x) > quantize_lib.fp8_max(dtype) * scale
  lost = ((x != 0) & (q == 0)) | saturated
  return jnp.sum(lost), jnp.sum(x != 0)


def _matrices(lhs: jax.Array, rhs: jax.Array, grad: jax.Array, dims: Any) -> tuple:
  """The product as batched matrices: ``lhs (B, M, K)``, ``rhs (B, K, N)``, ``grad (B, M, N)``."""
  (lc, rc), (lb, rb) = dims
  lf = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
  rf = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
  batch = math.prod(lhs.shape[d] for d in lb)
  m, k = math.prod(lhs.shape[d] for d in lf), math.prod(lhs.shape[d] for d in lc)
  n = math.prod(rhs.shape[d] for d in rf)
  a = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(batch, m, k)
  b = jnp.transpose(rhs, (*rb, *rc, *rf)).reshape(batch, k, n)
  return a, b, grad.reshape(batch, m, n)


def _flushed(lhs: jax.Array, rhs: jax.Array, grad: jax.Array, dims: Any, recipe: Any) -> jax.Array:
  """The largest share of an operand's values a recipe loses, over the three products' operands.

  Rowwise scaling folds the saved operand's scales into the gradient before
  quantising it for each backward product (powers of two: exact), as
  :func:`mpx.fp8.fp8_dot_general` does; the other recipes quantise it as it is.
  """
  a, b, g = _matrices(lhs, rhs, grad, dims)
  grouping = _grouping(recipe)
  e4m3, g_format = (
    quantize_lib.E4M3,
    quantize_lib.E5M2 if grouping == "tensor" else quantize_lib.E4M3,
  )
  g_input, g_weight = g, g
  if grouping == "row":
    lhs_scale = quantize_lib.scale_for(jnp.max(jnp.abs(a), axis=2, keepdims=True), e4m3)
    rhs_scale = quantize_lib.scale_for(jnp.max(jnp.abs(b), axis=1, keepdims=True), e4m3)
    g_input, g_weight = g * rhs_scale, g * lhs_scale
  parts = [
    _lost(a, e4m3, 2, grouping),  # along K: the forward product's contraction
    _lost(b, e4m3, 1, grouping),
    _lost(g_input, g_format, 2, grouping),  # along N: the input gradient's
    _lost(g_weight, g_format, 1, grouping),  # along M: the weight gradient's
  ]
  return jnp.max(jnp.stack([lost / jnp.maximum(total, 1) for lost, total in parts]))


@functools.partial(jax.jit, static_argnames=("dims", "policy"))
def _dot_errors(lhs, rhs, grad, *, dims, policy) -> tuple[jax.Array, jax.Array]:
  """(min over the three products of the row-median SQNR, flushed fraction) of one dot."""
  f32 = jnp.float32

  def reference(a, b):
    return jax.lax.dot_general(a, b, dims, precision="highest", preferred_element_type=f32)

  ref, pullback = jax.vjp(reference, lhs, rhs)
  refs = (ref, *pullback(grad))
  cd = policy.compute_dtype
  recipe = policy.fp8
  if recipe is None:

    def candidate(a, b):
      return jax.lax.dot_general(a, b, dims, preferred_element_type=cd)

  else:
    if recipe.delayed:  # the first step's scales: the batch's own amaxes
      recipe = dataclasses.replace(recipe, scaling="current")

    def candidate(a, b):
      return fp8_lib.fp8_dot_general(a, b, dims, preferred_element_type=cd, recipe=recipe)

  got, pullback = jax.vjp(candidate, lhs.astype(cd), rhs.astype(cd))
  gots = (got, *pullback(grad.astype(cd)))
  sqnr = jnp.min(jnp.stack([_row_sqnr(r, g) for r, g in zip(refs, gots, strict=True)]))
  if recipe is None:
    return sqnr, jnp.float32(0.0)
  return sqnr, _flushed(lhs, rhs, grad, dims, recipe).astype(jnp.float32)


def errors(product: Captured, policy: Any) -> tuple[float, float] | None:
  """``(SQNR in dB, flushed fraction)`` of a candidate on one captured product (see the module docstring).

  Args:
    product: a captured product.
    policy: the candidate's :class:`mpx.Policy`.

  Returns:
    The worst of the forward and both backward products; ``None`` for a
    product this module does not recompute (a convolution).
  """
  if product.primitive != "dot_general":
    return None
  (lc, rc), (lb, rb) = product.params["dimension_numbers"]
  dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
  sqnr, flushed = _dot_errors(product.lhs, product.rhs, product.grad, dims=dims, policy=policy)
  return float(sqnr), float(flushed)


def threshold_db(policy: Any) -> float | None:
  """The SQNR a candidate's products must reach: 20 dB per tensor, 25 dB per row or block, none without float8."""
  if policy.fp8 is None:
    return None
  return 20.0 if _grouping(policy.fp8) == "tensor" else 25.0


def layer_errors(
  captured: Sequence[Captured], policies: dict[str, Any]
) -> dict[str, dict[str, tuple[float, float]]]:
  """Every candidate's worst ``(SQNR dB, flushed fraction)`` per layer.

  Args:
    captured: the captured products.
    policies: ``{candidate name: Policy}``.

  Returns:
    ``{layer: {candidate: (sqnr_db, flushed)}}`` for the layers with at least
    one recomputed product.
  """
  out: dict[str, dict[str, tuple[float, float]]] = {}
  for product in captured:
    for name, policy in policies.items():
      found = errors(product, policy)
      if found is None:
        continue
      before = out.setdefault(product.layer, {}).get(name, (np.inf, 0.0))
      out[product.layer][name] = (min(before[0], found[0]), max(before[1], found[1]))
  return out
