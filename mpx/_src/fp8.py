"""Float8 matmuls: the scaling recipes, the quantise-dequantise dot, and the amax-history state.

Micikevicius et al., *FP8 Formats for Deep Learning* (2022): E4M3 (max 448)
for the forward operands, E5M2 (max 57,344) for the gradients, each tensor
multiplied by a per-tensor scale that moves its largest magnitude (amax) to
the top of the format, products accumulated in float32.

The dot is written in the form XLA:GPU rewrites into a cuBLASLt float8 GEMM:
scale, clamp to the format's max, cast to float8, cast back and multiply by
the scale, then ``dot_general``. On other backends the same program runs with
the exact float8 rounding. Scales are powers of two, so dividing and
multiplying by them is exact in bfloat16 and float32: the dequantised tensor
is exactly ``ml_dtypes``' rounding of ``x / s``, times ``s``.

Delayed scaling keeps, per tensor, one float32 array of ``history_length + 1``
entries: ``[pending, most recent, ..., oldest]``. The forward pass reads the
committed part to choose the scale (or, while nothing is committed, the
tensor's own amax); the amax each call observes comes back as the *gradient*
of the pending slot, combined over the calls that share a history by ``max``
(:func:`fp8_max_grad`), and :func:`update_fp8_state` folds it in (a running
max over micro-batches) and, at an accumulation boundary not skipped by the
loss scale, commits it to the history. Core module: imports neither Flax nor
optax.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_util, earray
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes
from jax._src.interpreters import pxla

from mpx._src import errors

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_SCALINGS = ("current", "delayed")
_REDUCTIONS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How the float8 matmuls of a policy choose their per-tensor scales.

  * ``"current"`` scaling: each tensor's scale comes from its own amax,
    measured just before it is quantised. No state; one extra reduction over
    every operand (and over every gradient in the backward pass).
  * ``"delayed"`` scaling (the recipe of NVIDIA Transformer Engine's
    ``DelayedScaling``): the scale comes from the amaxes recorded in earlier
    steps, ``max`` over the last ``history_length`` or the ``most_recent``
    one; the current amax is only recorded, so quantising does not wait for
    it. The history is state (see :func:`update_fp8_state`); while it is
    empty (the first optimizer step) each tensor's own amax sets its scale,
    as in current scaling (Transformer Engine uses 1 there, which saturates
    large values and flushes small gradients to zero in E5M2).

  The scale ``s`` is the power of two that brings the amax to at most
  ``fp8_max / 2**margin``; values beyond the format's max after scaling are
  clamped to it (saturation), NaN stays NaN.

  Attributes:
    scaling: ``"current"`` or ``"delayed"``.
    history_length: amaxes kept per tensor (delayed scaling).
    reduction: ``"max"`` or ``"most_recent"``: how the history gives the
      amax that sets the scale (delayed scaling).
    margin: extra headroom, in powers of two, below the format's max.
    axis_name: a named axis (``pmap``, ``shard_map``) over which the amaxes
      are reduced with ``jax.lax.pmax``, so that devices sharing a tensor
      share its scale; under ``jit`` with shardings the amax of a sharded
      tensor is already global and this stays ``None``.
    attention: also run the two matmuls of attention layers (scores and
      weighted values) in float8, with current scaling whatever ``scaling``
      says (their operands are activations, fresh each call). Needs
      ``KeepRules.softmax_in_float32`` (mpx's attention function); the
      softmax between them stays float32.

  Raises:
    PolicyError: an unknown scaling or reduction, a history length below 1,
      or a negative margin.

  Example:
    >>> import mpx
    >>> print(mpx.Fp8Recipe("delayed", history_length=1024, reduction="most_recent"))
    delayed:history=1024:reduction=most_recent
  """

  scaling: str = "current"
  history_length: int = 16
  reduction: str = "max"
  margin: int = 0
  axis_name: str | None = None
  attention: bool = False

  def __post_init__(self) -> None:
    for name in ("history_length", "margin"):
      object.__setattr__(self, name, _whole_number(name, getattr(self, name)))
    if self.axis_name is not None and not (
      isinstance(self.axis_name, str) and re.fullmatch(_AXIS_NAME, self.axis_name)
    ):
      raise errors.PolicyError(
        f"The fp8 axis name must be a non-empty string of letters, digits, '_', '-' or '.' "
        f"(it is written into policy strings, between ':' and ','), got {self.axis_name!r}."
      )
    if self.scaling not in _SCALINGS:
      raise errors.PolicyError(
        f"Unknown fp8 scaling {self.scaling!r}; write 'current' (each tensor's own amax, no "
        "state) or 'delayed' (an amax history kept as state)."
      )
    if self.reduction not in _REDUCTIONS:
      raise errors.PolicyError(
        f"Unknown amax history reduction {self.reduction!r}; write 'max' or 'most_recent'."
      )
    if self.history_length < 1:
      raise errors.PolicyError(
        f"history_length must be at least 1, got {self.history_length}; 1 keeps the most "
        "recent amax only."
      )
    if self.margin < 0:
      raise errors.PolicyError(f"margin must be a non-negative power of two, got {self.margin}.")

  @property
  def delayed(self) -> bool:
    """Whether the recipe keeps an amax history (state)."""
    return self.scaling == "delayed"

  def __str__(self) -> str:
    # Only what differs from the defaults, so that a preset prints as written; every
    # such field, whatever the scaling, so that parse_recipe(str(r)) == r.
    parts = [self.scaling]
    defaults = Fp8Recipe(self.scaling)
    if self.history_length != defaults.history_length:
      parts.append(f"history={self.history_length}")
    if self.reduction != defaults.reduction:
      parts.append(f"reduction={self.reduction}")
    parts += [f"margin={self.margin}"] if self.margin else []
    parts += [f"axis={self.axis_name}"] if self.axis_name else []
    parts += ["attention"] if self.attention else []
    return ":".join(parts)

  def for_attention(self) -> Fp8Recipe:
    """The current-scaling recipe of attention matmuls (same margin and axis)."""
    return dataclasses.replace(self, scaling="current", attention=False)


_RECIPE_KEYS = {"history": "history_length", "reduction": "reduction", "margin": "margin"}
_AXIS_NAME = r"[A-Za-z0-9_.\-]+"
_RECIPE_FORM = (
  "'delayed:history=<n>:reduction=<max|most_recent>:margin=<n>:axis=<name>:attention' "
  "(every part optional) or 'current' (with margin, axis, attention)"
)


def _whole_number(name: str, value: Any) -> int:
  """``value`` as a Python int; a bool, a fraction or a non-number is a :class:`PolicyError`."""
  if not isinstance(value, bool):
    try:
      return operator.index(value)
    except TypeError:
      pass
  raise errors.PolicyError(f"{name} must be a whole number, got {value!r}.")


def parse_recipe(spec: str) -> Fp8Recipe:
  """Parses a recipe as written in a policy string, the inverse of ``str(recipe)``.

  Args:
    spec: ``"current"``, ``"delayed"`` or e.g.
      ``"delayed:history=1024:reduction=most_recent:margin=1:axis=data"``.

  Returns:
    The :class:`Fp8Recipe`.

  Raises:
    PolicyError: an unknown part.
  """
  # Everything but the axis name ignores case, like the rest of a policy string; JAX's
  # axis names are case-sensitive.
  scaling, *parts = (part.strip() for part in spec.strip().split(":"))
  fields: dict[str, Any] = {"scaling": scaling.lower()}
  for part in parts:
    key, sep, value = (s.strip() for s in part.partition("="))
    key = key.lower()
    if key == "attention" and not sep:
      fields["attention"] = True
    elif not sep or key not in (*_RECIPE_KEYS, "axis"):
      raise errors.PolicyError(
        f"Cannot parse {part!r} in the fp8 recipe {spec!r}: write {_RECIPE_FORM}."
      )
    elif key == "axis":
      if not re.fullmatch(_AXIS_NAME, value):
        raise errors.PolicyError(
          f"Cannot parse {part!r} in the fp8 recipe {spec!r}: the axis name must be letters, "
          "digits, '_', '-' or '.', e.g. 'axis=data'."
        )
      fields["axis_name"] = value
    elif key == "reduction":
      fields["reduction"] = value.lower()
    elif re.fullmatch(r"[+-]?\d+", value):
      fields[_RECIPE_KEYS[key]] = int(value)
    else:
      raise errors.PolicyError(
        f"Cannot parse {part!r} in the fp8 recipe {spec!r}: {key} takes a whole number, e.g. "
        f"'{key}={Fp8Recipe.history_length if key == 'history' else 1}'."
      )
  return Fp8Recipe(**fields)


def fp8_max(dtype: Any) -> float:
  """The largest finite value of a float8 format (448 for E4M3, 57,344 for E5M2)."""
  return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis_name: str | None = None) -> jax.Array:
  """The largest magnitude of ``x`` as a float32 scalar, reduced over ``axis_name`` if given.

  Args:
    x: any floating array.
    axis_name: a named axis to ``pmax`` over, or ``None``.

  Returns:
    A float32 scalar (NaN if ``x`` holds a NaN).
  """
  value = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return value if axis_name is None else jax.lax.pmax(value, axis_name)


def scale_for(amax_value: jax.Array, dtype: Any, *, margin: int = 0) -> jax.Array:
  """The power-of-two scale that maps ``amax_value`` to at most ``fp8_max(dtype) / 2**margin``.

  ``x / s`` then fits the format; ``s`` is a power of two, so both the
  division and the dequantising product are exact.

  Args:
    amax_value: a float32 scalar.
    dtype: the float8 format.
    margin: headroom in powers of two.

  Returns:
    A float32 scalar; 1 where ``amax_value`` is zero or not finite.
  """
  ratio = amax_value / jnp.float32(fp8_max(dtype) / 2.0**margin)
  mantissa, exponent = jnp.frexp(ratio)  # ratio = m * 2**e, 0.5 <= m < 1
  exponent = exponent - (mantissa == 0.5).astype(exponent.dtype)
  usable = (amax_value > 0) & jnp.isfinite(amax_value)
  return jnp.where(usable, jnp.ldexp(jnp.float32(1.0), exponent), jnp.float32(1.0))


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """Rounds ``x / scale`` to a float8 format, saturating finite values at its max.

  Args:
    x: a floating array.
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: a float32 scalar (a power of two from :func:`scale_for`).

  Returns:
    ``x / scale`` in ``dtype``: finite values beyond the max become the max
    (with their sign), NaN stays NaN, infinities follow the format
    (E5M2 keeps them, E4M3FN has none and gives NaN).
  """
  wide = _scale_dtype(x.dtype)
  limit = jnp.asarray(fp8_max(dtype), wide)
  scaled = x.astype(wide) / scale.astype(wide)
  clamped = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -limit, limit), scaled)
  return clamped.astype(dtype)


def _scale_dtype(dtype: Any) -> np.dtype:
  """The dtype scaling by a power of two is exact in: ``dtype``, or float32 if its range is narrower.

  A float32 scale may lie outside float16's range (below ``2**-24`` for a
  float16 tensor of amax under about ``1e-5``): cast to float16 it would
  become 0 or inf. bfloat16 has float32's exponent range.
  """
  if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:
    return np.dtype(np.float32)
  return np.dtype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q`` cast to ``dtype`` and multiplied by ``scale``: the form XLA fuses into a float8 GEMM.

  Args:
    q: a float8 array.
    scale: its float32 scale.
    dtype: the compute dtype.

  Returns:
    The dequantised array in ``dtype``.
  """
  wide = _scale_dtype(dtype)
  return (q.astype(wide) * scale.astype(wide)).astype(dtype)


def quantize_dequantize(
  x: jax.Array,
  dtype: Any,
  *,
  scale: jax.Array | None = None,
  margin: int = 0,
  straight_through: bool = False,
) -> jax.Array:
  """``x`` rounded through a float8 format and back, with current scaling unless ``scale`` is given.

  Its gradient, by default, is what autodiff makes of the casts: the
  cotangent is itself rounded to the float8 format (scaled like ``x``), and
  zero where ``x`` saturated. With ``straight_through=True`` (the
  straight-through estimator, as torchao's differentiable float8 casts) the
  cotangent passes unchanged where ``x / scale`` is within the format's
  range, and is zero where it saturated, since the output stays at the max
  there.

  Args:
    x: a floating array.
    dtype: the float8 format.
    scale: the scale; ``None`` uses :func:`scale_for` of ``x``'s own amax.
    margin: headroom for the current scale.
    straight_through: whether the gradient is the identity within range.

  Returns:
    An array of ``x``'s dtype and shape.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> x = jnp.array([1.0, 0.3, -500.0])
    >>> mpx.quantize_dequantize(x, jnp.float8_e4m3fn, scale=jnp.float32(1.0))
    Array([ 1.000e+00,  3.125e-01, -4.480e+02], dtype=float32)
  """
  if scale is None:
    scale = scale_for(amax(x), dtype, margin=margin)
  if straight_through:
    return _straight_through(x, scale, np.dtype(dtype))
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _straight_through(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def _straight_through_fwd(
  x: jax.Array, scale: jax.Array, dtype: np.dtype
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  return _straight_through(x, scale, dtype), (x, scale)


def _straight_through_bwd(
  dtype: np.dtype, residuals: tuple[jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array]:
  x, scale = residuals
  wide = _scale_dtype(x.dtype)
  saturated = jnp.abs(x.astype(wide) / scale.astype(wide)) > fp8_max(dtype)
  return jnp.where(saturated, jnp.zeros_like(g), g), jnp.zeros_like(scale)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


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
    larger = jax.lax.max(_as_float32(x), _as_float32(y))
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


def _as_float32(x: jax.Array) -> jax.Array:
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


def _history_scale(history: jax.Array, dtype: Any, recipe: Fp8Recipe) -> jax.Array:
  """The delayed scale from ``[pending, most recent, ..., oldest]`` (1 while it is empty).

  It depends on the history alone, never on the tensor being quantised, so the
  quantisation need not wait for that tensor's amax (XLA can compute the amax
  in the same pass that quantises).
  """
  committed = _as_float32(history)[..., 1:]
  reference = jnp.max(committed, axis=-1) if recipe.reduction == "max" else committed[..., 0]
  return scale_for(reference, dtype, margin=recipe.margin)


def _observed(history: jax.Array, value: jax.Array) -> jax.Array:
  """The cotangent of a history: ``value`` in the pending slot, zeros elsewhere."""
  cotangent = jnp.zeros(history.shape, jnp.float32).at[..., 0].set(value.astype(jnp.float32))
  return jax.lax.convert_element_type(cotangent, history.dtype)


def _scales(
  recipe: Fp8Recipe,
  states: Sequence[jax.Array] | None,
  tensors: Sequence[jax.Array],
  amaxes: Sequence[jax.Array],
  dtype: Any,
) -> list[jax.Array]:
  if states is None:
    return [scale_for(a, dtype, margin=recipe.margin) for a in amaxes]
  return [_delayed_scale(h, x, dtype, recipe) for h, x in zip(states, tensors, strict=True)]


def _delayed_scale(history: jax.Array, x: jax.Array, dtype: Any, recipe: Fp8Recipe) -> jax.Array:
  """The scale from the history; from ``x``'s own amax while nothing is recorded (the first step).

  A ``cond``, not a select: once the history holds an amax, quantising ``x``
  does not wait for ``x``'s amax, which is the point of delayed scaling. The
  bootstrap branch measures it itself for the same reason.
  """
  recorded = jnp.max(_as_float32(history)[..., 1:]) > 0
  return jax.lax.cond(
    recorded,
    lambda: _history_scale(history, dtype, recipe),
    lambda: scale_for(amax(x, recipe.axis_name), dtype, margin=recipe.margin),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_dot(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  lhs: jax.Array,
  rhs: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> jax.Array:
  return _fp8_dot_fwd(recipe, dimension_numbers, precision, dtypes, lhs, rhs, states)[0]


def _plain_dot(dimension_numbers: Any, precision: Any) -> Any:
  def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, dimension_numbers, precision=precision)

  return dot


def _fp8_dot_fwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  lhs: jax.Array,
  rhs: jax.Array,
  states: tuple[jax.Array, ...] | None,
) -> tuple[jax.Array, Any]:
  out_dtype = dtypes[2]
  amaxes = [amax(lhs, recipe.axis_name), amax(rhs, recipe.axis_name)]
  histories = None if states is None else states[:2]
  lhs_scale, rhs_scale = _scales(recipe, histories, (lhs, rhs), amaxes, E4M3)
  lhs_q, rhs_q = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
  a, b = dequantize(lhs_q, lhs_scale, lhs.dtype), dequantize(rhs_q, rhs_scale, rhs.dtype)
  # The product in the operands' dtype unless a wider one was asked for: cuBLASLt's
  # float8 GEMMs accumulate in float32 (their only compute type), as XLA:CPU does for
  # bfloat16 products, which it cannot return in float32 for every layout.
  preferred = out_dtype if out_dtype != np.dtype(lhs.dtype) else None
  out = jax.lax.dot_general(
    a, b, dimension_numbers, precision=precision, preferred_element_type=preferred
  ).astype(out_dtype)
  # The float8 operands are the residuals: a quarter of float32's bytes, and the
  # backward products dequantise them again, in the form XLA recognises.
  residuals = (lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, states)
  return out, residuals


def _fp8_dot_bwd(
  recipe: Fp8Recipe,
  dimension_numbers: Any,
  precision: Any,
  dtypes: tuple[np.dtype, np.dtype, np.dtype],
  residuals: Any,
  g: jax.Array,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
  lhs_dtype, rhs_dtype, _ = dtypes
  lhs_q, rhs_q, lhs_scale, rhs_scale, amaxes, states = residuals
  g_amax = amax(g, recipe.axis_name)
  histories = None if states is None else states[2:]
  (g_scale,) = _scales(recipe, histories, [g], [g_amax], E5M2)
  g_dq = dequantize(quantize(g, E5M2, g_scale), g_scale, g.dtype)
  a, b = dequantize(lhs_q, lhs_scale, lhs_dtype), dequantize(rhs_q, rhs_scale, rhs_dtype)

  product, pullback = jax.vjp(_plain_dot(dimension_numbers, precision), a, b)
  ga, gb = pullback(g_dq.astype(product.dtype))
  if states is None:
    return ga, gb, None
  observed = [*amaxes, g_amax]
  return ga, gb, tuple(_observed(h, v) for h, v in zip(states, observed, strict=True))


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  precision: Any = None,
  preferred_element_type: Any = None,
  *,
  recipe: Fp8Recipe | None = None,
  state: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  **unused: Any,
) -> jax.Array:
  """``jax.lax.dot_general`` with float8 operands: E4M3 forward, E5M2 gradients, float32 sums.

  Both operands are quantised to E4M3 with per-tensor scales and dequantised
  right before the product. In the backward pass the incoming gradient is
  quantised to E5M2 the same way and both backward products take the saved
  E4M3 operands. The products are requested in the operands' dtype:
  cuBLASLt's float8 GEMMs accumulate in float32 (their only compute type)
  and round once to that dtype, and XLA:CPU computes bfloat16 products in
  float32 as well. This is the quantise-dequantise
  form that XLA:GPU rewrites into cuBLASLt float8 GEMMs on Hopper and Ada
  GPUs; elsewhere it computes the same float8-rounded products.

  Usable as a Flax layer's ``dot_general`` (``functools.partial`` with a
  recipe); :func:`mpx.linen.apply_policy` and :func:`mpx.nnx.apply_policy`
  install it for policies with an ``fp8`` recipe.

  Args:
    lhs: the left operand (the activations of a layer).
    rhs: the right operand (the kernel).
    dimension_numbers: as for ``jax.lax.dot_general``.
    precision: as for ``jax.lax.dot_general``.
    preferred_element_type: the output dtype; ``None`` means ``lhs.dtype``.
    recipe: the scaling recipe; ``None`` means current scaling.
    state: for delayed scaling, the amax histories of ``(lhs, rhs,
      gradient)``, each ``float32[history_length + 1]`` (see
      :func:`update_fp8_state`), or already passed through
      :func:`fp8_max_grad`; their gradient is the amax each tensor had.
    **unused: other arguments Flax passes (``out_sharding``), ignored.

  Returns:
    The product, shaped as ``jax.lax.dot_general``'s.

  Raises:
    ConfigError: a delayed recipe without state, or state without one.
  """
  del unused
  recipe = Fp8Recipe() if recipe is None else recipe
  if recipe.delayed != (state is not None):
    raise errors.ConfigError(
      f"The fp8 recipe {recipe} {'needs' if recipe.delayed else 'takes no'} amax history "
      "state; pass state=(lhs, rhs, grad) histories with delayed scaling only (apply_policy "
      "does this for you)."
    )
  out_dtype = np.dtype(preferred_element_type or lhs.dtype)
  (lc, rc), (lb, rb) = dimension_numbers
  dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))  # hashable: a static argument
  dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
  if state is not None:
    state = tuple(fp8_max_grad(tuple(state)))
  return _fp8_dot(recipe, dims, precision, dtypes, lhs, rhs, state)


def init_history(recipe: Fp8Recipe, *, batch_shape: Sequence[int] = ()) -> jax.Array:
  """An empty amax history: ``float32[*batch_shape, history_length + 1]`` of zeros.

  Args:
    recipe: a delayed-scaling recipe.
    batch_shape: leading axes, one history per entry (e.g. ``(layers,)`` for
      the histories of layers stacked by ``nn.scan`` or ``nnx.vmap``).

  Returns:
    The zero history.
  """
  return jnp.zeros((*batch_shape, recipe.history_length + 1), jnp.float32)


def _update_history(history: jax.Array, observed: jax.Array, commit: jax.Array) -> jax.Array:
  # The last axis is the history; leading axes are layers stacked by nn.scan or nnx.vmap.
  seen = observed[..., :1]
  # A non-finite amax (an overflow the loss scale will skip) would make every delayed
  # scale built on it fall back to 1 for history_length steps.
  pending = jnp.where(jnp.isfinite(seen), jnp.maximum(history[..., :1], seen), history[..., :1])
  committed = jnp.concatenate([jnp.zeros_like(pending), pending, history[..., 1:-1]], axis=-1)
  return jnp.where(commit, committed, history.at[..., :1].set(pending))


def update_fp8_state(
  state: Any, observed: Any, *, commit: Any = None, opt_state: Any = None
) -> Any:
  """Folds the amaxes a step observed into the delayed-scaling state.

  Each leaf of ``state`` is one tensor's ``[pending, most recent, ...,
  oldest]`` along its last axis (leading axes, as ``nn.scan`` or ``nnx.vmap``
  stack the histories of several layers, are updated entry by entry); the
  matching leaf of ``observed`` is its gradient from ``jax.grad`` (the amax
  in the pending slot). The pending slot becomes the running max
  ``max(pending, observed)``, so over the micro-batches of a gradient
  accumulation it holds the largest amax of any of them (what one large
  batch would have seen), not the last one; non-finite amaxes are left out.
  With ``commit`` the pending amax becomes the most recent entry, the others
  move down one place, the oldest drops and the pending slot is reset to
  zero.

  Pass ``opt_state``, the optimizer state ``tx.update`` just returned: it
  says whether this step ends an ``optax.MultiSteps`` accumulation (commit)
  and whether the loss scale skipped it, in which case ``state`` comes back
  unchanged, as the params do. Without ``opt_state``, ``commit`` (default
  ``True``: a step without accumulation) decides alone. Do not pass the
  observed amaxes through the optimizer: ``MultiSteps`` averages what it
  accumulates.

  Args:
    state: the histories (a linen ``"fp8_history"`` collection, an NNX
      ``State`` of :class:`mpx.nnx.Fp8History`, any pytree of them).
    observed: the gradient of the loss with respect to ``state``.
    commit: a boolean (Python or a scalar array, traceable); ``None`` means
      ``True``, or what ``opt_state`` says.
    opt_state: the optimizer state after this step's update, or ``None``.

  Returns:
    The new state, with ``state``'s structure and dtypes.

  Raises:
    ConfigError: both ``commit`` and ``opt_state`` given.

  Example:
    >>> import jax.numpy as jnp, mpx
    >>> history = jnp.array([0.0, 4.0, 2.0])   # pending, most recent, older
    >>> mpx.update_fp8_state(history, jnp.array([3.0, 0.0, 0.0]), commit=False)
    Array([3., 4., 2.], dtype=float32)
    >>> mpx.update_fp8_state(history, jnp.array([3.0, 0.0, 0.0]))
    Array([0., 3., 4.], dtype=float32)
  """
  if opt_state is None:
    skipped = jnp.asarray(False)
    commit = jnp.asarray(True if commit is None else commit, jnp.bool_)
  elif commit is not None:
    raise errors.ConfigError(
      "update_fp8_state got both commit= and opt_state=; pass opt_state (it decides the "
      "commit and the skip) or commit alone."
    )
  else:
    commit, skipped = _step_outcome(opt_state)
  return jax.tree.map(
    lambda h, o: jnp.where(skipped, h, _update_history(h, o, commit)), state, observed
  )


def _unwrap(x: Any) -> Any:
  # Flax NNX wraps optimizer-state leaves in Variables; read through them.
  return x.get_value() if hasattr(x, "get_value") else x


def _is_multisteps(node: Any) -> bool:
  return hasattr(node, "mini_step") and hasattr(node, "gradient_step")


def _is_loss_scale(node: Any) -> bool:
  # mpx.LossScaleState, recognised by its fields: this core module imports no optimizer code.
  return hasattr(node, "consecutive_skips") and hasattr(node, "loss_scale")


def _find(tree: Any, is_node: Any) -> list[Any]:
  found: list[Any] = []
  jax.tree.map(lambda n: found.append(n) if is_node(n) else None, tree, is_leaf=is_node)
  return found


def _step_outcome(opt_state: Any) -> tuple[jax.Array, jax.Array]:
  """``(commit, skipped)`` for the step whose update returned ``opt_state``.

  ``skipped``: the loss scale skipped this step. Inside ``MultiSteps`` the
  loss scale runs only at the accumulation boundary, and between boundaries
  its state still describes the previous one, so only a boundary can be
  skipped there. ``commit``: an update was applied, at a boundary and not
  skipped.
  """
  multisteps = _find(opt_state, _is_multisteps)
  if len(multisteps) > 1:
    raise errors.StateError(
      f"The optimizer state holds {len(multisteps)} optax.MultiSteps states; fp8 history "
      "commits need one. Pass commit= to update_fp8_state yourself."
    )
  scales = _find(opt_state, _is_loss_scale)
  if len(scales) > 1:
    raise errors.StateError(
      f"The optimizer state holds {len(scales)} loss-scale states; fp8 history updates need "
      "one to tell a skipped step. Pass commit= to update_fp8_state yourself."
    )
  boundary = jnp.asarray(True) if not multisteps else _unwrap(multisteps[0].mini_step) == 0
  if not scales:
    return boundary, jnp.asarray(False)
  skipped = jnp.asarray(_unwrap(scales[0].consecutive_skips)) > 0
  if multisteps and _find(multisteps[0].inner_opt_state, _is_loss_scale):
    skipped = skipped & boundary
  return boundary & ~skipped, skipped


def accumulation_boundary(opt_state: Any) -> jax.Array:
  """Whether the optimizer step that produced ``opt_state`` applied an update.

  With ``optax.MultiSteps`` that is the last micro-batch of an accumulation
  (its ``mini_step`` is back at 0); without it, every step. Never a step the
  loss scale skipped: its non-finite gradients leave the params untouched.

  Args:
    opt_state: the optimizer state returned by ``tx.update``.

  Returns:
    A boolean scalar, for :func:`update_fp8_state`'s ``commit``
    (``update_fp8_state(..., opt_state=opt_state)`` also leaves a skipped
    step's amaxes out of the pending slot).

  Raises:
    StateError: more than one ``MultiSteps`` or loss-scale state.
  """
  return _step_outcome(opt_state)[0]
