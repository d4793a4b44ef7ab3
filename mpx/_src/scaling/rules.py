"""Loss-scale rules: how the scale moves after each step, and their validation.

A :class:`Rule` is a frozen dataclass of Python values, built once when the
optimizer is built: it is hashable, static under ``jit``, and building one under
a trace (``jax.eval_shape``, ``optax.inject_hyperparams``) reads no traced
value. Dynamic, static and no scaling are all rules, consumed by the one
transformation of ``mpx.dynamic_loss_scale``, whose docstring states the rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from mpx._src import errors

F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32.
# The largest scale whose reciprocal is a normal float32 (2**-126).
MAX_SCALE = 2.0**126
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class Rule:
  """A loss-scale rule: its semantics and its hyperparameters.

  The fields are the names of ``mpx.dynamic_loss_scale``'s pseudo-code.

  Attributes:
    preset: the preset the rule was built from; ``"static"`` and ``"none"`` for
      the rules of ``mpx.static_loss_scale`` and ``mpx.no_loss_scale``.
    initial_scale: the scale of the first step.
    kind: ``"dynamic"`` adjusts the scale; ``"static"`` keeps it, and still
      checks and skips; ``"none"`` is a scale of 1 with no check and no skip.
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
  kind: Literal["dynamic", "static", "none"] = "dynamic"
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  hysteresis: int = 1
  min_scale: float = 1.0
  max_scale: float = MAX_SCALE
  extra_steps_after_overflow: int = 0
  extra_steps_after_growth: int = 0
  refill_hysteresis: Literal["finite", "growth"] = "finite"
  at_max: Literal["hold", "clamp"] = "hold"

  @property
  def initial_trackers(self) -> tuple[int, int]:
    """The ``(growth_tracker, hysteresis_tracker)`` of the first step."""
    if self.kind != "dynamic":
      return 0, 0
    return -self.extra_steps_after_overflow, self.hysteresis

  def adjust(
    self,
    ok: jax.Array,
    scale: jax.Array,
    growth_tracker: jax.Array,
    hysteresis_tracker: jax.Array,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies one step of the rule.

    Args:
      ok: bool scalar, whether every gradient of this step was finite.
      scale: float32 scalar, the scale this step's gradients were computed with.
      growth_tracker: int32 scalar.
      hysteresis_tracker: int32 scalar.

    Returns:
      The next ``(scale, growth_tracker, hysteresis_tracker)``, same dtypes;
      the inputs themselves unless the rule is dynamic.
    """
    if self.kind != "dynamic":
      return scale, growth_tracker, hysteresis_tracker
    f32, i32 = jnp.float32, jnp.int32
    refill = i32(self.hysteresis)

    tracker = growth_tracker + 1
    due = tracker >= self.growth_interval
    grown = scale * f32(self.growth_factor)
    if self.at_max == "clamp":
      grown = jnp.minimum(grown, f32(self.max_scale))
    else:  # inf and NaN fail `<=`, so an overflowing growth is refused too.
      grown = jnp.where(grown <= f32(self.max_scale), grown, scale)
    ok_scale = jnp.where(due, grown, scale)
    ok_tracker = jnp.where(due, i32(-self.extra_steps_after_growth), tracker)
    if self.refill_hysteresis == "finite":
      ok_hysteresis = refill
    else:
      ok_hysteresis = jnp.where(due, refill, hysteresis_tracker)

    left = hysteresis_tracker - 1
    back_off = left <= 0
    backed_off = jnp.maximum(scale * f32(self.backoff_factor), f32(self.min_scale))
    bad_scale = jnp.where(back_off, backed_off, scale)
    if self.refill_hysteresis == "finite":
      bad_hysteresis = jnp.where(back_off, refill, left)
    else:
      bad_hysteresis = jnp.maximum(left, 0)
    bad_tracker = i32(-self.extra_steps_after_overflow)

    return (
      jnp.where(ok, ok_scale, bad_scale),
      jnp.where(ok, ok_tracker, bad_tracker),
      jnp.where(ok, ok_hysteresis, bad_hysteresis),
    )


# torch and Keras have no floor (their scale reaches 0); jmp's factor both grows
# and backs off; Paddle's `decr_every_n_nan_or_inf` is the hysteresis refilled on
# every finite step; flax compares the tracker before incrementing it (one extra
# step per period); DeepSpeed grows when `stable_interval > 0 and
# stable_interval % window == 0`, i.e. after window + 1 clean steps, then every window.
PRESETS: dict[str, Rule] = {
  "default": Rule("default", 2.0**15),
  "torch": Rule("torch", 2.0**16, min_scale=F32_TINY),
  "keras": Rule("keras", 2.0**15, min_scale=F32_TINY),
  "jmp": Rule("jmp", 2.0**15),
  "flax": Rule(
    "flax",
    65536.0,
    min_scale=F32_TINY,
    extra_steps_after_overflow=1,
    extra_steps_after_growth=1,
    at_max="clamp",
  ),
  "megatron": Rule(
    "megatron", 2.0**32, growth_interval=1000, hysteresis=2, refill_hysteresis="growth"
  ),
  "deepspeed": Rule(
    "deepspeed",
    2.0**16,
    growth_interval=1000,
    hysteresis=2,
    refill_hysteresis="growth",
    extra_steps_after_overflow=1,
  ),
  "paddle": Rule("paddle", 2.0**16),
}

NO_SCALING = Rule("none", 1.0, kind="none", min_scale=1.0, max_scale=1.0)

_EXAMPLES = {"growth_factor": "2.0", "backoff_factor": "0.5", "growth_interval": "2000"}


def _python_number(name: str, value: object) -> object:
  """Returns ``value``, or the Python number held by a concrete 0-d array.

  Raises:
    ConfigError: if ``value`` is traced (its value is unknown until run time).
  """
  if isinstance(value, jax.core.Tracer):
    raise errors.ConfigError(
      f"{name} must be known when the optimizer is built, but it is a traced value "
      f"({value!r}), e.g. an array made under jax.jit or jax.eval_shape. Pass a Python "
      f"number such as {name}={_EXAMPLES.get(name, '2.0**15')}; under "
      f"optax.inject_hyperparams, list {name!r} in static_args."
    )
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and value.ndim == 0:
    return value.item()
  return value


def check_scale(name: str, value: object) -> float:
  """Validates one scale-like hyperparameter.

  Args:
    name: the argument name, for the message.
    value: what the caller passed: a Python or NumPy number, or a concrete
      0-d NumPy or JAX array.

  Returns:
    ``value`` as a Python float that is a positive, finite, normal float32.

  Raises:
    ConfigError: if it is traced, not a real number, not positive, not finite,
      or rounds to zero, infinity or a subnormal number in float32.
  """
  value = _python_number(name, value)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
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
  value = _python_number(name, value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise errors.ConfigError(
      f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}."
    )
  if not minimum <= value <= _INT32_MAX - 1:
    raise errors.ConfigError(
      f"{name} must be an integer in [{minimum}, {_INT32_MAX - 1}], got {value!r}."
    )
  return value


def _check_factor(name: str, value: object, *, low: float, high: float) -> float:
  value = _python_number(name, value)
  ok_type = not isinstance(value, bool) and isinstance(value, (int, float))
  x = float(value) if ok_type else math.nan  # pyright: ignore[reportArgumentType]
  if not (ok_type and math.isfinite(x) and low < x < high):
    bounds = f"> {low}" if high == math.inf else f"strictly between {low} and {high}"
    raise errors.ConfigError(f"{name} must be a finite number {bounds}, got {value!r}.")
  return x


def resolve_rule(preset: str = "default", **overrides: object) -> Rule:
  """Builds a validated dynamic rule from a preset and explicit overrides.

  Args:
    preset: one of :data:`PRESETS`' names.
    **overrides: hyperparameters (``initial_scale``, ``growth_factor``,
      ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``min_scale``,
      ``max_scale``), as Python numbers or concrete 0-d arrays; a ``None``
      value keeps the preset's value.

  Returns:
    The rule, every value a checked Python number.

  Raises:
    ConfigError: an unknown preset, or a traced or out-of-range hyperparameter.
  """
  if preset not in PRESETS:
    raise errors.ConfigError(
      f"Unknown loss-scale preset {preset!r}. Valid presets are: {', '.join(PRESETS)}."
    )
  rule = PRESETS[preset]
  given = {k: v for k, v in overrides.items() if v is not None}
  value = {**dataclasses.asdict(rule), **given}
  initial = check_scale("initial_scale", value["initial_scale"])
  low = check_scale("min_scale", value["min_scale"])
  high = check_scale("max_scale", value["max_scale"])
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
    growth_factor=_check_factor("growth_factor", value["growth_factor"], low=1.0, high=math.inf),
    backoff_factor=_check_factor("backoff_factor", value["backoff_factor"], low=0.0, high=1.0),
    growth_interval=_check_int("growth_interval", value["growth_interval"], minimum=1),
    hysteresis=_check_int("hysteresis", value["hysteresis"], minimum=1),
  )


def static_rule(scale: object) -> Rule:
  """Returns the rule of a constant, checked ``scale`` (which is also its floor).

  Raises:
    ConfigError: if ``scale`` is traced or not a positive, normal float32.
  """
  value = check_scale("scale", scale)
  return Rule("static", value, kind="static", min_scale=value, max_scale=value)
