"""A layer's call with its contractions replaced, computed on the whole batch under ``jax.vmap``.

Equinox layers take one example and are batched by ``jax.vmap``; their
matmuls and convolutions are ``x @ self.weight`` and
``jax.lax.conv_general_dilated``, with no knob through which a policy could
pass another contraction. :func:`call` traces the layer's call to a jaxpr
and evaluates it with every ``dot_general`` / ``conv_general_dilated``
replaced by the caller's function (mpx's float8 or float32-accumulating
ones). Those functions hold per-tensor statistics (float8 amaxes) and custom
VJPs that must see the whole batch: vmapped one example at a time, each
example would get its own scale and the weight gradient would become a
batch of outer products summed afterwards. So the call is a ``custom_vjp``
whose forward and backward are ``custom_vmap``'d (the composition JAX
documents for a function with both rules): under ``vmap``, at any depth and
also when ``vmap`` batches a ``scan`` whose body holds the layer, the rule
traces the *vmapped* layer and replaces the contractions of that batched
program, so each contraction runs once over every example.

The backward pass re-traces the layer from its saved inputs and takes the
VJP of the replaced program: the quantisation of the operands is recomputed
there (elementwise work beside the GEMMs), and the layer's inputs, not the
float8 copies, are what the forward pass saves. Framework-neutral: the
Equinox adapter passes the layer's call in as a function of arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax._src.interpreters import partial_eval as pe
from jax.custom_batching import custom_vmap

#: ``(context, lhs, rhs, **params) -> product``: a replacement for one primitive, given the
#: ``context`` arrays passed to :func:`call` (a delayed recipe's amax histories) and the
#: primitive's own parameters.
Replacement = Callable[..., jax.Array]


def _replaced(
  fn: Callable[..., list[Any]], replacements: dict[str, Replacement], n_context: int
) -> Callable[..., list[Any]]:
  """``fn`` of ``(*context, *args)``, evaluated with the named primitives replaced."""

  def run(*flat: Any) -> list[Any]:
    context, args = flat[:n_context], flat[n_context:]
    closed = jax.make_jaxpr(fn)(*args)
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, args, strict=True))
    for eqn in closed.jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      replacement = replacements.get(eqn.primitive.name)
      if replacement is not None:
        params = {k: v for k, v in eqn.params.items() if k != "out_sharding"}
        outs = [replacement(context, *invals, **params).astype(eqn.outvars[0].aval.dtype)]
      else:
        outs = eqn.primitive.bind(*invals, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in closed.jaxpr.outvars]

  return run


def _axes(batched: Sequence[bool]) -> list[int | None]:
  return [0 if b else None for b in batched]


class _Lifted:
  """The custom-VJP, custom-vmap call of one layer function ``fn(*args) -> list of arrays``."""

  def __init__(
    self,
    fn: Callable[..., list[Any]],
    replacements: dict[str, Replacement],
    n_context: int,
    n_args: int,
  ) -> None:
    self.fn = fn
    self.replacements = replacements
    self.n_context = n_context
    self.n_inputs = n_context + n_args

  def _plain(self) -> Callable[..., list[Any]]:
    return _replaced(self.fn, self.replacements, self.n_context)

  def _batched(self, in_batched: Sequence[bool]) -> _Lifted | None:
    """The same call on a batch (``None`` where a context array is batched: one call per example)."""
    if any(in_batched[: self.n_context]):
      return None
    fn = jax.vmap(self.fn, in_axes=_axes(in_batched[self.n_context : self.n_inputs]))
    return _Lifted(fn, self.replacements, self.n_context, self.n_inputs - self.n_context)

  def forward(self) -> Callable[..., list[Any]]:
    """The primal call; under ``vmap``, the call of the batched layer."""
    plain = self._plain()
    primal = custom_vmap(plain)

    @primal.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *flat: Any) -> tuple[list[Any], Any]:
      del axis_size
      lifted = self._batched(in_batched)
      if lifted is None:  # Per-example context (an ensemble's histories): one call each.
        outs = jax.vmap(plain, in_axes=_axes(in_batched))(*flat)
      else:
        outs = lifted.forward()(*flat)
      return outs, [True] * len(outs)

    return primal

  def backward(self) -> Callable[..., list[Any]]:
    """``(*inputs, *output cotangents) -> input cotangents``; under ``vmap``, the batched layer's."""
    n = self.n_inputs
    plain = self._plain()

    def pulled_back(*flat: Any) -> list[Any]:
      return list(jax.vjp(plain, *flat[:n])[1](list(flat[n:])))

    def vjp(*flat: Any) -> list[Any]:
      # Without the forward products, which the VJP traces and does not use: XLA would drop
      # them too, but the audit of the lowered program would count them.
      closed = jax.make_jaxpr(pulled_back)(*flat)
      jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, True, instantiate=True)
      return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, closed.consts))(*flat)

    pullback = custom_vmap(vjp)

    @pullback.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *flat: Any) -> tuple[list[Any], Any]:
      del axis_size
      lifted = self._batched(in_batched[:n])
      if lifted is None:
        outs = jax.vmap(vjp, in_axes=_axes(in_batched))(*flat)
        return outs, [True] * len(outs)
      # The batched program's VJP already sums over the batch for inputs every example shares.
      return lifted.backward()(*flat), list(in_batched[:n])

    return pullback

  def __call__(self, *flat: Any) -> list[Any]:
    forward, backward = self.forward(), self.backward()

    @jax.custom_vjp
    def layer(*flat: Any) -> list[Any]:
      return forward(*flat)

    def layer_fwd(*flat: Any) -> tuple[list[Any], tuple[Any, ...]]:
      return forward(*flat), flat

    def layer_bwd(saved: tuple[Any, ...], cotangents: list[Any]) -> tuple[Any, ...]:
      return tuple(backward(*saved, *cotangents))

    layer.defvjp(layer_fwd, layer_bwd)
    return layer(*flat)


def call(
  fn: Callable[..., list[Any]],
  context: Sequence[jax.Array],
  args: Sequence[jax.Array],
  replacements: dict[str, Replacement],
) -> list[Any]:
  """Computes ``fn(*args)`` with its contractions replaced, on the whole batch under ``vmap``.

  Args:
    fn: a function of arrays returning a list of arrays (the layer's call,
      its params among ``args``).
    context: arrays the replacements read (a delayed recipe's histories);
      their gradient is what the replacements' VJPs give them.
    args: ``fn``'s arguments.
    replacements: maps ``"dot_general"`` and/or ``"conv_general_dilated"``
      to ``f(context, lhs, rhs, **params)``; other primitives run as they are.

  Returns:
    ``fn(*args)``, each named contraction computed by its replacement.
  """
  return _Lifted(fn, replacements, len(context), len(args))(*context, *args)
