"""Dynamic loss-scale rules: the presets, their validation and the jnp update.

Paper section 3.2 (loss scaling): gradients of a float16 network are computed
for ``loss * scale`` so that small values do not flush to zero, and divided by
``scale`` again before the weight update. A *dynamic* scale is lowered when the
gradients overflow and raised again after a run of finite steps.

Every framework states that rule slightly differently. A :class:`Rule` fixes
one rule's semantics and default values; :func:`resolve_rule` turns a preset
name plus explicit overrides into a validated rule, and :func:`adjust` is the
pure ``jnp`` state update applied once per optimizer step. The rule itself,
as pseudo-code (``ok`` = every gradient element is finite)::

  if ok:
    growth_tracker += 1
    if growth_tracker == growth_interval:
      scale = grow(scale)                 # see below for the bound
      growth_tracker = -extra_steps_after_growth
      if refill_hysteresis == "growth": hysteresis_tracker = hysteresis
    if refill_hysteresis == "finite": hysteresis_tracker = hysteresis
  else:                                   # the step is skipped
    growth_tracker = -extra_steps_after_overflow
    hysteresis_tracker -= 1
    if hysteresis_tracker <= 0:
      scale = max(scale * backoff_factor, min_scale)
      if refill_hysteresis == "finite": hysteresis_tracker = hysteresis
      else: hysteresis_tracker = 0        # backs off on every overflow until a growth

``grow(scale)`` is ``scale * growth_factor`` when that is finite and at most
``max_scale``, else ``scale`` unchanged (``"hold"``), except for the flax preset,
which clamps to ``max_scale`` as ``flax.training.dynamic_scale`` does
(``"clamp"``). Every scale is validated to lie in ``[2**-126, 2**126]``, so
the scale and its reciprocal are always finite, normal float32 numbers whatever
the preset: torch's and Keras' scale cannot reach 0 (their floor becomes
float32's smallest normal number, 2**-126) and cannot grow to inf (the default
ceiling is 2**126, where flax's is float32's max: the two agree below 2**126).
Gradients are unscaled by multiplying with ``1 / scale``, which is exact for a
power-of-two scale only while that reciprocal is normal: jmp's scale could reach
2**127, whose reciprocal is subnormal and flushes to zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors

_F32 = np.finfo(np.float32)
F32_TINY = float(_F32.tiny)  # 2**-126, the smallest normal float32.
# The largest scale whose reciprocal is a normal float32 (2**-126).
MAX_SCALE = 2.0**126
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class Rule:
  """A dynamic loss-scale rule: its semantics and its hyperparameters.

  Attributes:
    preset: the preset name this rule was built from.
    initial_scale: the scale of the first step.
    growth_factor: multiplier applied after ``growth_interval`` finite steps.
    backoff_factor: multiplier applied on an overflow (after hysteresis).
    growth_interval: finite steps between growths.
    hysteresis: overflows tolerated before the scale backs off.
    min_scale: the floor (a normal float32).
    max_scale: the ceiling (a normal float32).
    extra_steps_after_overflow: finite steps waited beyond ``growth_interval``
      before the first growth after an overflow (and after initialisation).
    extra_steps_after_growth: finite steps waited beyond ``growth_interval``
      between two growths.
    refill_hysteresis: ``"finite"`` refills the hysteresis counter on every
      finite step (and after each backoff); ``"growth"`` only when the scale
      grows (Megatron-LM, DeepSpeed).
    at_max: ``"hold"`` keeps the scale when growing would pass ``max_scale``;
      ``"clamp"`` sets it to ``max_scale``.
  """

  preset: str
  initial_scale: float
  growth_factor: float
  backoff_factor: float
  growth_interval: int
  hysteresis: int
  min_scale: float
  max_scale: float
  extra_steps_after_overflow: int = 0
  extra_steps_after_growth: int = 0
  refill_hysteresis: Literal["finite", "growth"] = "finite"
  at_max: Literal["hold", "clamp"] = "hold"


def _preset(name: str, initial_scale: float, growth_interval: int = 2000, **kw) -> Rule:
  base = {"growth_factor": 2.0, "backoff_factor": 0.5, "hysteresis": 1, "min_scale": 1.0}
  base.update(kw)
  base.setdefault("max_scale", MAX_SCALE)
  return Rule(preset=name, initial_scale=initial_scale, growth_interval=growth_interval, **base)


# torch and Keras have no floor (their scale reaches 0); jmp's factor both grows
# and backs off; Paddle's `decr_every_n_nan_or_inf` is the hysteresis refilled on
# every finite step; flax compares the tracker before incrementing it (one extra
# step per period); DeepSpeed grows when `stable_interval > 0 and
# stable_interval % window == 0`, i.e. after window + 1 clean steps, then every window.
PRESETS: dict[str, Rule] = {
  "default": _preset("default", 2.0**15),
  "torch": _preset("torch", 2.0**16, min_scale=F32_TINY),
  "keras": _preset("keras", 2.0**15, min_scale=F32_TINY),
  "jmp": _preset("jmp", 2.0**15),
  "flax": _preset(
    "flax",
    65536.0,
    min_scale=F32_TINY,
    extra_steps_after_overflow=1,
    extra_steps_after_growth=1,
    at_max="clamp",
  ),
  "megatron": _preset("megatron", 2.0**32, 1000, hysteresis=2, refill_hysteresis="growth"),
  "deepspeed": _preset(
    "deepspeed",
    2.0**16,
    1000,
    hysteresis=2,
    refill_hysteresis="growth",
    extra_steps_after_overflow=1,
  ),
  "paddle": _preset("paddle", 2.0**16),
}


def check_scale(name: str, value: object) -> float:
  """Validates one scale-like hyperparameter.

  Args:
    name: the argument name, for the message.
    value: what the caller passed.

  Returns:
    ``value`` as a Python float that is a positive, finite, normal float32.

  Raises:
    ConfigError: if it is not a real number, not positive, not finite, or
      rounds to zero, infinity or a subnormal number in float32.
  """
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise errors.ConfigError(
      f"{name} must be a positive real number, got {value!r} of type "
      f"{type(value).__name__}. Pass a Python float such as {name}=2.0**15."
    )
  x = float(value)
  if not (F32_TINY <= x <= MAX_SCALE and F32_TINY <= float(np.float32(x)) <= MAX_SCALE):
    raise errors.ConfigError(
      f"{name} must be a float32 number in [2**-126, 2**126] (positive, and normal together "
      f"with its reciprocal, so that unscaling gradients by it is exact), got {value!r}. "
      "Use a power of two such as 2.0**15."
    )
  return x


def _check_int(name: str, value: object, *, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise errors.ConfigError(
      f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}."
    )
  if not minimum <= int(value) <= _INT32_MAX - 1:
    raise errors.ConfigError(
      f"{name} must be an integer in [{minimum}, {_INT32_MAX - 1}], got {value!r}."
    )
  return int(value)


def _check_factor(name: str, value: object, *, low: float, high: float) -> float:
  ok_type = not isinstance(value, bool) and isinstance(value, (int, float, np.number))
  x = float(value) if ok_type else math.nan  # pyright: ignore[reportArgumentType]
  if not (ok_type and math.isfinite(x) and low < x < high):
    bounds = f"> {low}" if high == math.inf else f"strictly between {low} and {high}"
    raise errors.ConfigError(f"{name} must be a finite number {bounds}, got {value!r}.")
  return x


def resolve_rule(preset: str = "default", **overrides: object) -> Rule:
  """Builds a validated rule from a preset and explicit overrides.

  Args:
    preset: one of ``default``, ``torch``, ``keras``, ``jmp``, ``flax``,
      ``megatron``, ``deepspeed``, ``paddle``.
    **overrides: hyperparameters (``initial_scale``, ``growth_factor``,
      ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``min_scale``,
      ``max_scale``); a ``None`` value keeps the preset's value.

  Returns:
    The rule, with every value checked.

  Raises:
    ConfigError: an unknown preset or an out-of-range hyperparameter.
  """
  if preset not in PRESETS:
    raise errors.ConfigError(
      f"Unknown loss-scale preset {preset!r}. Valid presets are: {', '.join(PRESETS)}."
    )
  given = {k: v for k, v in overrides.items() if v is not None}
  rule = dataclasses.replace(PRESETS[preset], **given)  # pyright: ignore[reportArgumentType]
  initial = check_scale("initial_scale", rule.initial_scale)
  low = check_scale("min_scale", rule.min_scale)
  high = check_scale("max_scale", rule.max_scale)
  if low > high:
    raise errors.ConfigError(
      f"min_scale ({low!r}) must not exceed max_scale ({high!r}); swap them or widen the range."
    )
  if not low <= initial <= high:
    raise errors.ConfigError(
      f"initial_scale ({initial!r}) must lie in [min_scale, max_scale] = [{low!r}, {high!r}]."
    )
  return dataclasses.replace(
    rule,
    initial_scale=initial,
    min_scale=low,
    max_scale=high,
    growth_factor=_check_factor("growth_factor", rule.growth_factor, low=1.0, high=math.inf),
    backoff_factor=_check_factor("backoff_factor", rule.backoff_factor, low=0.0, high=1.0),
    growth_interval=_check_int("growth_interval", rule.growth_interval, minimum=1),
    hysteresis=_check_int("hysteresis", rule.hysteresis, minimum=1),
  )


def initial_trackers(rule: Rule) -> tuple[jax.Array, jax.Array]:
  """Returns the ``(growth_tracker, hysteresis_tracker)`` of the first step."""
  return (
    jnp.asarray(-rule.extra_steps_after_overflow, jnp.int32),
    jnp.asarray(rule.hysteresis, jnp.int32),
  )


def adjust(
  rule: Rule,
  ok: jax.Array,
  scale: jax.Array,
  growth_tracker: jax.Array,
  hysteresis_tracker: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Applies one step of ``rule`` (see the module docstring).

  Args:
    rule: a rule from :func:`resolve_rule`.
    ok: bool scalar, whether every gradient of this step was finite.
    scale: float32 scalar, the scale this step's gradients were computed with.
    growth_tracker: int32 scalar.
    hysteresis_tracker: int32 scalar.

  Returns:
    The next ``(scale, growth_tracker, hysteresis_tracker)``, same dtypes.
  """
  f32, i32 = jnp.float32, jnp.int32
  refill = jnp.asarray(rule.hysteresis, i32)

  tracker = growth_tracker + 1
  due = tracker >= rule.growth_interval
  grown = scale * f32(rule.growth_factor)
  if rule.at_max == "clamp":
    grown = jnp.minimum(grown, f32(rule.max_scale))
  else:  # inf and NaN fail `<=`, so an overflowing growth is refused too.
    grown = jnp.where(grown <= f32(rule.max_scale), grown, scale)
  ok_scale = jnp.where(due, grown, scale)
  ok_tracker = jnp.where(due, i32(-rule.extra_steps_after_growth), tracker)
  ok_hysteresis = (
    refill if rule.refill_hysteresis == "finite" else jnp.where(due, refill, hysteresis_tracker)
  )

  left = hysteresis_tracker - 1
  back_off = left <= 0
  bad_scale = jnp.where(
    back_off, jnp.maximum(scale * f32(rule.backoff_factor), f32(rule.min_scale)), scale
  )
  if rule.refill_hysteresis == "finite":
    bad_hysteresis = jnp.where(back_off, refill, left)
  else:
    bad_hysteresis = jnp.maximum(left, 0)
  bad_tracker = i32(-rule.extra_steps_after_overflow)

  return (
    jnp.where(ok, ok_scale, bad_scale),
    jnp.where(ok, ok_tracker, bad_tracker),
    jnp.where(ok, ok_hysteresis, bad_hysteresis),
  )
