"""Kahan-compensated updates of half-precision params, without float32 masters (layout (c))."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import tree as tree_lib
from mpx._src.dtypes import F32
from mpx._src.optim import base


class KahanState(NamedTuple):
  """State of :func:`with_kahan_summation`.

  Attributes:
    compensation: a tree shaped like the params holding, for every
      half-precision param, the part of its weight that the param dtype could
      not hold (same shape and dtype as the param), and ``None`` for every
      other leaf.
    inner_state: the state of the inner transformation, built on float32
      weights.
  """

  compensation: optax.Params
  inner_state: optax.OptState

  @property
  def master_params(self) -> optax.Params:
    """``None`` at every leaf: no masters, each param is exactly ``params + updates``."""
    return base.no_masters(self.compensation)

  def check(self, params: optax.Params, master_dtype: np.dtype | None) -> None:
    """Raises if a run expects masters, or the buffers do not fit ``params``."""
    base.refuse_masters(self, master_dtype)
    check_compensation(self, params)

  def weights(self, params: optax.Params) -> optax.Params:
    """The compensated weights ``float32(p) + float32(c)``, other params at least float32."""
    return base.weights_of(self.compensation, params, compensation=True)


base.HalfParamsState.register(KahanState)


def check_compensation(state: KahanState, params: optax.Params) -> None:
  """Raises if ``state`` does not hold a buffer like its param for exactly the half params.

  Args:
    state: the state of :func:`with_kahan_summation`.
    params: the params the state is used with.

  Raises:
    StateError: naming the first leaf whose buffer is missing, superfluous or
      not of its param's shape and dtype.
  """
  base.check_buffers(
    state.compensation,
    params,
    what="compensation",
    fits=lambda c, p: (c.shape, c.dtype) == (p.shape, p.dtype),
    want=lambda p: f"{p.dtype}{list(p.shape)}, the param's own shape and dtype",
  )


def _sum_in(p: jax.Array, d: jax.Array) -> jax.Array:
  """``p + d`` rounded to their dtype, as a float32 array: what ``optax.apply_updates`` returns.

  Not ``(p + d).astype(float32)``: XLA computes a half-precision sum in float32
  and may drop the rounding to the half dtype before a cast back to float32.
  ``reduce_precision`` rounds exactly as the cast does (the float32 sum of two
  half values rounded again to half is their correctly rounded sum, float32
  having more than twice their significant bits plus two).
  """
  info = jnp.finfo(p.dtype)
  total = p.astype(F32) + d.astype(F32)
  return jax.lax.reduce_precision(total, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def with_kahan_summation(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Compensated (Kahan) updates of half-precision params, without float32 masters.

  Keeps, next to every bfloat16 or float16 param ``p``, a compensation buffer
  ``c`` of the same dtype holding what the last rounding of ``p`` cut off, so
  that ``p + c`` tracks the weight to about twice the param dtype's precision
  (16 significant bits for bfloat16). Each step, per half-precision leaf and in
  float32:

  .. math::

     w &= p + c, \\qquad u = \\mathrm{inner}(g, w), \\qquad x = w + u, \\\\
     d &= \\mathrm{cast}(x) - p, \\qquad p' = p \\oplus d, \\qquad
     c' = \\mathrm{cast}(x - p'),

  where ``cast`` rounds to the param dtype, ``d`` is the returned update and
  ``⊕`` is the addition in the param dtype that ``optax.apply_updates``
  computes. The inner optimizer sees float32 gradients and the float32 weights
  ``w``, so its moments are float32 (use :func:`mpx.with_state_dtype` inside
  this wrapper to store them narrower). Params of other dtypes get the inner
  updates unchanged. This is Kahan's compensated summation with the
  compensation kept in the param dtype, the form Zamirai et al. (2020) use for
  bfloat16 training; ``c`` has the opposite sign of Kahan's.

  What is exact: ``c'`` is computed from ``p'`` itself, the very value
  ``optax.apply_updates(params, updates)`` (or ``mpx.apply_updates``) returns,
  so the buffer accounts for every param bit for bit, also in the rare steps
  where ``d`` is not representable and ``p'`` misses ``cast(x)`` (a weight
  crossing zero or halving, see :func:`mpx.with_master_params`). ``w = p + c``
  and ``x - p'`` are exact in float32 in every ordinary step (``|c|`` is below
  an ulp of ``p``); what is rounded is ``x`` (once, in float32) and ``c'`` (to
  the param dtype), which bounds the error a step adds to ``p + c`` by half an
  ulp of ``c``: at most ``2**-16 |p|`` in bfloat16 (``2**-22 |p|`` in float16).

  A skipped step of an outer loss-scaling wrapper leaves the buffers untouched
  (``mpx.dynamic_loss_scale(with_kahan_summation(inner))``); in
  :func:`mpx.mixed_precision` pass ``master_dtype=None``.

  Args:
    inner: the optimizer, e.g. ``optax.adamw(3e-4)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`KahanState` and whose ``update`` requires ``params`` and forwards
    extra arguments to ``inner``.

  Raises:
    ConfigError: at ``update``, ``params`` is missing.
    StateError: at ``update``, the buffers do not fit the params.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> tx = mpx.with_kahan_summation(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> for _ in range(100):  # plain bfloat16 stays at 1.0: 1e-3 < half an ulp
    ...   updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"]  # the bfloat16 value nearest to 1.1
    Array([1.10156, 1.10156], dtype=bfloat16)
    >>> weight = params["w"].astype(jnp.float32) + state.compensation["w"].astype(jnp.float32)
    >>> weight.round(3)  # the compensated weight
    Array([1.1, 1.1], dtype=float32)

  References:
    Kahan, *Further remarks on reducing truncation errors*, CACM 1965.
    Zamirai, Zhang, Aberger, De Sa, *Revisiting BFloat16 Training*, 2020.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> KahanState:
    compensation = jax.tree.map(
      lambda p: jnp.zeros_like(p) if base.is_compensated(p) else None, params
    )
    weights = base.float32_weights(params, compensation)
    inner_state = tree_lib.place_state(inner.init(weights), weights)
    return KahanState(compensation, inner_state)

  def update_fn(
    updates: optax.Updates,
    state: KahanState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, KahanState]:
    params = base.require_params(params, "with_kahan_summation")
    tree_lib.check_same_structure(updates, params, names=("gradients", "params"))
    check_compensation(state, params)
    comp = state.compensation
    weights = jax.tree.map(
      lambda c, p: p if c is None else p.astype(F32) + c.astype(F32),
      comp,
      params,
      is_leaf=base.is_none,
    )
    inner_updates, inner_state = base.inner_step(
      inner, updates, state.inner_state, weights, extra_args
    )
    targets = jax.tree.map(
      lambda c, w, u: None if c is None else w + u.astype(F32),
      comp,
      weights,
      inner_updates,
      is_leaf=base.is_none,
    )
    param_updates = jax.tree.map(
      lambda x, p, u: u if x is None else base.update_toward(x.astype(p.dtype), p, F32),
      targets,
      params,
      inner_updates,
      is_leaf=base.is_none,
    )
    # The buffer keeps what p + d, the param optax.apply_updates returns, misses of x.
    new_comp = jax.tree.map(
      lambda x, p, d: None if x is None else (x - _sum_in(p, d)).astype(p.dtype),
      targets,
      params,
      param_updates,
      is_leaf=base.is_none,
    )
    return param_updates, KahanState(new_comp, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
