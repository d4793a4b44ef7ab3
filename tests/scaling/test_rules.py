"""The dynamic loss-scale rule and its presets, step for step against each framework.

Every reference below re-states one framework's update in that framework's own
terms (PyTorch's ``_amp_update_scale_``, Keras 3's ``LossScaleOptimizer``,
jmp's ``DynamicLossScale.adjust``, flax's ``DynamicScale.value_and_grad``,
Megatron-LM's ``DynamicGradScaler.update``, DeepSpeed's
``DynamicLossScaler.update_scale``, Paddle's ``update_loss_scaling``), plus the
bounds mpx adds where the original has none (floor: float32's smallest normal
number, 2**-126; ceiling: 2**126, the largest scale whose reciprocal is a normal
float32, where a growth past it is refused, or clamped for flax).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src.scaling import rules

TINY = rules.F32_TINY
CEILING = rules.MAX_SCALE


class _Reference:
  """Common bounds; subclasses implement `step(ok)` and keep `self.scale`."""

  def __init__(self, r: rules.Rule):
    self.r = r
    self.scale = r.initial_scale

  def grow_or_hold(self) -> float:
    new = self.scale * self.r.growth_factor
    return new if new <= self.r.max_scale else self.scale

  def back_off(self) -> float:
    return max(self.scale * self.r.backoff_factor, self.r.min_scale)


class _Torch(_Reference):
  tracker = 0

  def step(self, ok):
    if not ok:
      self.scale, self.tracker = self.back_off(), 0
      return
    successful = self.tracker + 1
    if successful == self.r.growth_interval:
      self.scale, self.tracker = self.grow_or_hold(), 0
    else:
      self.tracker = successful


class _Default(_Reference):
  """The default rule (hysteresis refilled on every finite step), written with `==`."""

  def __init__(self, r):
    super().__init__(r)
    self.growth_tracker, self.hysteresis_tracker = 0, r.hysteresis

  def step(self, ok):
    if ok:
      self.growth_tracker += 1
      if self.growth_tracker == self.r.growth_interval:
        self.scale, self.growth_tracker = self.grow_or_hold(), 0
      self.hysteresis_tracker = self.r.hysteresis
    else:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker == 0:
        self.scale, self.hysteresis_tracker = self.back_off(), self.r.hysteresis


class _Keras(_Reference):
  step_counter = 0

  def step(self, ok):
    if not ok:
      self.step_counter = 0
      self.scale = self.back_off()
    elif self.step_counter == self.r.growth_interval - 1:
      self.step_counter = 0
      self.scale = self.grow_or_hold()
    else:
      self.step_counter += 1


class _Jmp(_Reference):
  counter = 0

  def step(self, ok):
    if ok:
      self.scale = self.grow_or_hold() if self.counter == self.r.growth_interval - 1 else self.scale
    else:
      self.scale = self.back_off()
    self.counter = ((self.counter + 1) % self.r.growth_interval) * int(ok)


class _Flax(_Reference):
  fin_steps = 0

  def step(self, ok):
    grow = self.fin_steps == self.r.growth_interval
    if ok:
      if grow:
        self.scale = min(self.scale * self.r.growth_factor, self.r.max_scale)
    else:
      self.scale = self.back_off()
    self.fin_steps = 0 if (grow or not ok) else self.fin_steps + 1


class _Megatron(_Reference):
  def __init__(self, r):
    super().__init__(r)
    self.growth_tracker, self.hysteresis_tracker = 0, r.hysteresis

  def step(self, ok):
    if not ok:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker <= 0:
        self.scale = self.back_off()
    else:
      self.growth_tracker += 1
      if self.growth_tracker == self.r.growth_interval:
        self.growth_tracker = 0
        self.hysteresis_tracker = self.r.hysteresis
        self.scale = self.grow_or_hold()


class _DeepSpeed(_Reference):
  def __init__(self, r):
    super().__init__(r)
    self.cur_iter, self.last_overflow_iter = 0, -1
    self.delayed_shift = self.cur_hysteresis = r.hysteresis

  def step(self, ok):
    if not ok:
      if self.delayed_shift == 1 or self.cur_hysteresis == 1:
        self.scale = self.back_off()
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    else:
      stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
      if stable_interval > 0 and stable_interval % self.r.growth_interval == 0:
        self.cur_hysteresis = self.delayed_shift
        self.scale = self.grow_or_hold()
    self.cur_iter += 1


class _Paddle(_Reference):
  good_steps = bad_steps = 0

  def step(self, ok):
    if not ok:
      self.good_steps, self.bad_steps = 0, self.bad_steps + 1
      if self.bad_steps == self.r.hysteresis:  # decr_every_n_nan_or_inf
        self.scale, self.bad_steps = self.back_off(), 0
    else:
      self.bad_steps, self.good_steps = 0, self.good_steps + 1
      if self.good_steps == self.r.growth_interval:  # incr_every_n_steps
        new = self.scale * self.r.growth_factor
        self.scale = new if new <= self.r.max_scale else self.scale
        self.good_steps = 0


REFERENCES = {
  "default": _Default,
  "torch": _Torch,
  "keras": _Keras,
  "jmp": _Jmp,
  "flax": _Flax,
  "megatron": _Megatron,
  "deepspeed": _DeepSpeed,
  "paddle": _Paddle,
}


def _reference_trace(rule: rules.Rule, oks: np.ndarray) -> dict[str, np.ndarray]:
  ref = REFERENCES[rule.preset](rule)
  scales, skipped, consecutive, diverged = [], [], [], []
  n_skipped = n_consecutive = 0
  is_diverged = False
  for ok in oks.tolist():
    is_diverged |= (not ok) and ref.scale <= rule.min_scale
    ref.step(ok)
    n_skipped += not ok
    n_consecutive = 0 if ok else n_consecutive + 1
    scales.append(ref.scale)
    skipped.append(n_skipped)
    consecutive.append(n_consecutive)
    diverged.append(is_diverged)
  return {
    "loss_scale": np.array(scales, np.float64),
    "skipped_steps": np.array(skipped),
    "consecutive_skips": np.array(consecutive),
    "diverged": np.array(diverged),
  }


def _mpx_trace(tx: optax.GradientTransformation, oks: np.ndarray) -> dict[str, np.ndarray]:
  params = jnp.zeros(3, jnp.float32)

  @jax.jit
  def run(oks):
    def body(state, ok):
      grads = jnp.where(ok, jnp.float32(1.0), jnp.float32(jnp.inf)) * jnp.ones(3, jnp.float32)
      _, state = tx.update(grads, state, params)
      return state, mpx.loss_scale_metrics(state)

    return jax.lax.scan(body, tx.init(params), oks)[1]

  out = jax.device_get(run(jnp.asarray(oks)))
  return {k: np.asarray(v) for k, v in out.items() if k != "growth_tracker"}


def _pattern(
  seed: int, interval: int, n: int, *, long_clean: int = 0, floor_burst: int = 300
) -> np.ndarray:
  """Overflow at step 0, then clean runs around multiples of the interval and bursts."""
  rng = np.random.default_rng(seed)
  runs = [interval - 1, interval, interval + 1, 2 * interval, 2 * interval + 1, 3 * interval + 2]
  runs += [1, 2, 3]
  bursts = [1, 1, 1, 2, 3, 5]
  out = [False, False, True, False]
  out += [True] * long_clean + [False] * floor_burst  # ceiling, then the floor
  while len(out) < n:
    out += [True] * int(rng.choice(runs)) + [False] * int(rng.choice(bursts))
  return np.array(out[:n], bool)


def _assert_traces_equal(got: dict, want: dict) -> None:
  for key, w in want.items():
    g = got[key]
    bad = np.flatnonzero(g.astype(np.float64) != w.astype(np.float64))
    assert bad.size == 0, f"{key} differs first at step {bad[0]}: got {g[bad[0]]}, want {w[bad[0]]}"


@pytest.mark.parametrize("preset", list(rules.PRESETS))
def test_preset_defaults_match_reference(preset):
  rule = rules.resolve_rule(preset)
  oks = _pattern(
    list(rules.PRESETS).index(preset), rule.growth_interval, 6 * rule.growth_interval + 4000
  )
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset=preset)
  got, want = _mpx_trace(tx, oks), _reference_trace(rule, oks)
  _assert_traces_equal(got, want)
  assert len(set(want["loss_scale"].tolist())) > 5  # the pattern exercised the rule


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(rules.PRESETS))
@pytest.mark.parametrize(
  "overrides",
  [
    {"growth_interval": 4},
    {"growth_interval": 3, "hysteresis": 3, "growth_factor": 4.0, "backoff_factor": 0.25},
    {"growth_interval": 2, "min_scale": 2.0**-3, "max_scale": 2.0**20, "initial_scale": 1.0},
  ],
  ids=["interval4", "factors", "bounds"],
)
def test_preset_with_overrides_hits_floor_and_ceiling(preset, overrides):
  if preset in ("torch", "keras", "jmp", "flax"):  # these frameworks have no hysteresis knob
    overrides = {k: v for k, v in overrides.items() if k != "hysteresis"}
  rule = rules.resolve_rule(preset, **overrides)
  oks = _pattern(7, rule.growth_interval, 3000, long_clean=600, floor_burst=1200)
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset=preset, **overrides)
  got, want = _mpx_trace(tx, oks), _reference_trace(rule, oks)
  _assert_traces_equal(got, want)
  assert want["loss_scale"].max() >= rule.max_scale / rule.growth_factor
  assert want["loss_scale"].min() == rule.min_scale
  assert want["diverged"][-1]


@pytest.mark.parametrize("preset", list(rules.PRESETS))
def test_scale_stays_finite_and_normal(preset):
  n = 10_000
  oks = np.array([False] * 300 + [True] * n, bool)
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset=preset, growth_interval=1)
  scales = _mpx_trace(tx, oks)["loss_scale"].astype(np.float32)
  assert np.all(np.isfinite(scales)) and np.all(scales >= np.finfo(np.float32).tiny)
  assert scales[299] == rules.PRESETS[preset].min_scale  # the floor, never 0
  assert scales[-1] == 2.0**126  # held (or clamped, flax) at the ceiling, never inf
  assert np.all(np.isfinite(1 / scales)) and np.all(1 / scales >= np.finfo(np.float32).tiny)


def test_flax_grows_on_the_n_plus_first_step_and_torch_on_the_nth():
  oks = np.ones(9, bool)
  flax = _mpx_trace(mpx.dynamic_loss_scale(optax.sgd(1.0), preset="flax", growth_interval=4), oks)
  torch = _mpx_trace(mpx.dynamic_loss_scale(optax.sgd(1.0), preset="torch", growth_interval=4), oks)
  np.testing.assert_array_equal(flax["loss_scale"] / 65536, [1, 1, 1, 1, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(torch["loss_scale"] / 65536, [1, 1, 1, 2, 2, 2, 2, 4, 4])


def test_deepspeed_first_growth_after_window_plus_one_then_every_window():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset="deepspeed", growth_interval=3)
  scales = _mpx_trace(tx, np.ones(10, bool))["loss_scale"] / 2**16
  np.testing.assert_array_equal(scales, [1, 1, 1, 2, 2, 2, 4, 4, 4, 8])


def test_megatron_hysteresis_refills_only_on_growth():
  tx = mpx.dynamic_loss_scale(optax.sgd(1.0), preset="megatron", growth_interval=2)
  oks = np.array([False, True, False, False, True, False], bool)
  scales = _mpx_trace(tx, oks)["loss_scale"] / 2**32
  # 1st overflow tolerated; the clean step does not refill; 2nd and later back off.
  np.testing.assert_array_equal(scales, [1, 1, 0.5, 0.25, 0.25, 0.125])


@pytest.mark.parametrize(
  ("preset", "initial", "interval", "hysteresis", "floor"),
  [
    ("default", 2.0**15, 2000, 1, 1.0),
    ("torch", 2.0**16, 2000, 1, 2.0**-126),
    ("keras", 2.0**15, 2000, 1, 2.0**-126),
    ("jmp", 2.0**15, 2000, 1, 1.0),
    ("flax", 65536.0, 2000, 1, 2.0**-126),
    ("megatron", 2.0**32, 1000, 2, 1.0),
    ("deepspeed", 2.0**16, 1000, 2, 1.0),
    ("paddle", 2.0**16, 2000, 1, 1.0),
  ],
)
def test_preset_values(preset, initial, interval, hysteresis, floor):
  r = rules.resolve_rule(preset)
  assert (r.initial_scale, r.growth_interval, r.hysteresis, r.min_scale) == (
    initial,
    interval,
    hysteresis,
    floor,
  )
  assert (r.growth_factor, r.backoff_factor, r.max_scale) == (2.0, 0.5, CEILING)


@pytest.mark.parametrize(
  ("kwargs", "fragment"),
  [
    ({"initial_scale": 0.0}, "initial_scale must be a float32 number in"),
    ({"initial_scale": -2.0}, "initial_scale must be a float32 number in"),
    ({"initial_scale": math.inf}, "initial_scale must be a float32 number in"),
    ({"initial_scale": math.nan}, "initial_scale must be a float32 number in"),
    ({"min_scale": 1e-40}, "min_scale must be a float32 number in"),
    ({"initial_scale": 1e39}, "initial_scale must be a float32 number in"),
    ({"initial_scale": "big"}, "initial_scale must be a positive real number"),
    ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1.0"),
    ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1.0"),
    ({"backoff_factor": 1.0}, "backoff_factor must be a finite number strictly between"),
    ({"backoff_factor": 0.0}, "backoff_factor must be a finite number strictly between"),
    ({"growth_interval": 0}, "growth_interval must be an integer in [1,"),
    ({"growth_interval": 2.5}, "growth_interval must be an integer >= 1"),
    ({"hysteresis": 0}, "hysteresis must be an integer in [1,"),
    ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale (8.0) must not exceed max_scale (4.0)"),
    ({"initial_scale": 0.5}, "initial_scale (0.5) must lie in [min_scale, max_scale]"),
    ({"preset": "apex"}, "Unknown loss-scale preset 'apex'. Valid presets are: default"),
  ],
)
def test_bad_hyperparameters(kwargs, fragment):
  with pytest.raises(mpx.ConfigError) as info:
    mpx.dynamic_loss_scale(optax.sgd(1.0), **kwargs)
  assert fragment in str(info.value)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, 1e-45])
def test_bad_static_scale(scale):
  with pytest.raises(mpx.ConfigError, match="scale must be a float32 number in"):
    mpx.static_loss_scale(optax.sgd(1.0), scale)
