"""``python -m mpx.demo``: the ``--quick`` run's JSON and PNGs, and the float16 flush rule.

The subprocess runs as CI runs it, with warnings as errors and strict dtype
promotion (the demo must catch the expected ``mpx.PrecisionWarning`` itself).
Only what holds in any run is asserted (no timings), and what the quick run is
for: float16 without loss scaling visibly worse than float32 while the loss-scaled
float16 runs match it, and a loss scale that moves.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mpx.demo
from mpx.demo import flushed_fraction, log2_histogram, overflow_fraction

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = [config.name for config in mpx.demo.CONFIGS]
PNGS = ("val_loss.png", "loss_scale.png", "activation_gradients.png")


def _reject_nan(constant: str) -> float:
  raise ValueError(f"the JSON holds {constant}; non-finite values must be written as null")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, pathlib.Path, str]:
  out = tmp_path_factory.mktemp("demo_out")
  env = {**os.environ, "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
  proc = subprocess.run(
    [sys.executable, "-W", "error", "-m", "mpx.demo", "--quick", "--out", str(out)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  text = (out / "results.json").read_text(encoding="utf-8")
  return json.loads(text, parse_constant=_reject_nan), out, proc.stdout


def test_quick_run_lists_every_configuration_in_order(quick):
  report, _, stdout = quick
  assert report["quick"] is True
  assert [run["name"] for run in report["runs"]] == NAMES
  for name in NAMES:
    assert f"| {name} " in stdout  # the printed table has a row per run
  assert report["settings"]["global_batch_tokens"] == 2**21  # --quick: 4x the default's 2**19
  local = report["settings"]["local_tokens"]
  assert report["settings"]["mirrored_devices"] * local == 2**21
  assert report["gradient_sample"]["values"] > 0
  assert report["notes"] and all(isinstance(n, str) for n in report["notes"])


def test_quick_run_schema(quick):
  report, _, _ = quick
  for key in ("command", "date", "versions", "device", "settings", "runs", "pngs", "wall_seconds"):
    assert key in report
  for run in report["runs"]:
    assert run["loss_scaling"] in ("dynamic", "none")
    assert isinstance(run["skipped_steps"], int)
    assert run["final_loss_scale"] > 0 and math.isfinite(run["final_loss_scale"])
    for key in ("flushed_fraction_scale_1", "flushed_fraction_final_scale"):
      assert 0.0 <= run[key] <= 1.0
    assert run["bytes_per_param"] == pytest.approx(
      run["param_bytes_per_param"] + run["opt_state_bytes_per_param"]
    )
    curves = run["curves"]
    assert curves["eval_steps"][0] == 0
    assert len(curves["val_loss"]) == len(curves["eval_steps"])
    assert len(curves["train_loss"]) == len(curves["loss_scale"]) == run["steps_run"]
    assert len(curves["skipped_at"]) == run["skipped_steps"]


def test_quick_run_values_that_hold_in_any_run(quick):
  report, _, _ = quick
  runs = {run["name"]: run for run in report["runs"]}
  f32 = runs["float32"]
  assert f32["train_loss"] is not None and math.isfinite(f32["train_loss"])
  assert f32["val_loss"] is not None and f32["val_loss"] < f32["curves"]["val_loss"][0]
  assert f32["val_loss_minus_float32"] == 0.0
  for run in runs.values():
    if run["loss_scaling"] == "none":
      assert run["skipped_steps"] == 0
      assert run["final_loss_scale"] == 1.0
    else:  # a scaled run reports a power-of-two scale, under which fewer gradients flush
      assert math.log2(run["final_loss_scale"]).is_integer()
      assert run["flushed_fraction_final_scale"] <= run["flushed_fraction_scale_1"]
  assert {n for n, r in runs.items() if r["loss_scaling"] == "dynamic"} == {
    "mixed_float16",
    "float16_masters",
  }
  # Layout (b) keeps float16 params plus float32 masters: more bytes than layout (a).
  assert runs["float16_masters"]["bytes_per_param"] > runs["mixed_float16"]["bytes_per_param"]
  assert runs["float32"]["bytes_per_param"] == pytest.approx(12.0, abs=0.01)  # params + 2 moments
  assert runs["float16_bare"]["warning"] and "master" in runs["float16_bare"]["warning"]
  assert "loss_scale=None" in runs["float16_masters_unscaled"]["warning"]
  unscaled = {"float16_bare", "float16_masters_unscaled"}
  assert all(run["warning"] is None for name, run in runs.items() if name not in unscaled)


def test_quick_run_shows_float16_failing_without_loss_scaling(quick):
  report, _, stdout = quick
  runs = {run["name"]: run for run in report["runs"]}
  unscaled = runs["float16_masters_unscaled"]
  assert unscaled["val_loss_minus_float32"] > report["fail_margin"] > 0
  assert "float16_masters_unscaled: FAILS" in stdout
  assert runs["float16_bare"]["val_loss"] is None  # not finite
  for name in ("mixed_float16", "float16_masters"):
    assert abs(runs[name]["val_loss_minus_float32"]) < report["match_margin"]
    assert f"{name}: MATCHES" in stdout


def test_quick_run_loss_scale_moves(quick):
  report, _, _ = quick
  growth_interval = max(1, report["settings"]["steps"] // 15)
  for run in report["runs"]:
    scales = run["curves"]["loss_scale"]
    if run["loss_scaling"] == "none":
      assert set(scales) == {1.0}
      continue
    # From mpx's default 2**15, doubled after every growth_interval finite steps, halved on an
    # overflow: the trajectory the plot draws, not a flat line.
    assert scales[0] == 2.0**15
    assert len(set(scales)) > 3 and max(scales) >= 2.0**18
    held = 1  # steps in a row at the current scale
    for i, (before, after) in enumerate(itertools.pairwise(scales), start=1):
      assert after in (before, 2 * before, before / 2), (run["name"], i, before, after)
      assert (after == before / 2) == (i in run["curves"]["skipped_at"])
      if after == 2 * before:
        assert held >= growth_interval, (run["name"], i)
      held = held + 1 if after == before else 1


def test_quick_run_draws_the_pngs(quick):
  report, out, _ = quick
  assert sorted(report["pngs"]) == sorted(PNGS)
  for name in PNGS:
    data = (out / name).read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


# ---------------------------------------------------------------------------
# The float16 rounding rule, against NumPy's float16 conversion.
# ---------------------------------------------------------------------------


def _numpy_flushed(values: np.ndarray, scale: float) -> float:
  scaled = np.asarray(values, np.float32).astype(np.float64) * scale
  nonzero = scaled != 0
  with np.errstate(over="ignore"):
    halves = scaled.astype(np.float16)
  return float((nonzero & (halves == 0)).sum() / max(1, nonzero.sum()))


def _numpy_overflowed(values: np.ndarray, scale: float) -> float:
  scaled = np.asarray(values, np.float32).astype(np.float64) * scale
  nonzero = scaled != 0
  with np.errstate(over="ignore"):
    inf = np.isinf(scaled.astype(np.float16))
  return float(inf.sum() / max(1, nonzero.sum()))


TINY = np.float32(2.0**-24)  # float16's smallest subnormal


def test_the_public_scenario_is_what_the_command_runs():
  """benchmarks/ reuse the demo's scenario through mpx.demo's public names."""
  from mpx.demo import _cli

  assert _cli._settings_from(_cli._parser().parse_args([])) == mpx.demo.DEFAULT_SETTINGS
  assert _cli._settings_from(_cli._parser().parse_args(["--quick"])) == mpx.demo.QUICK_SETTINGS
  assert all(hasattr(mpx.demo, name) for name in mpx.demo.__all__)


@pytest.mark.parametrize(
  ("value", "flushes"),
  [
    (2.0**-24, False),  # the smallest subnormal is kept
    (2.0**-25, True),  # the tie between 0 and 2**-24 goes to the even 0
    (np.nextafter(np.float32(2.0**-25), np.float32(1)), False),  # just above the tie: 2**-24
    (np.nextafter(np.float32(2.0**-25), np.float32(0)), True),
    (1.5 * 2.0**-24, False),  # rounds to 2 * 2**-24
    (2.0**-26, True),
    (-(2.0**-25), True),
    (-(2.0**-24), False),
    (1e-45, True),  # a float32 subnormal
  ],
)
def test_flushed_fraction_at_the_edges(value, flushes):
  values = np.array([value], np.float32)
  assert flushed_fraction(values) == float(flushes) == _numpy_flushed(values, 1.0)


def test_float16_subnormals_never_flush():
  subnormals = np.arange(1, 1024, dtype=np.float32) * TINY  # every float16 subnormal, exactly
  assert flushed_fraction(subnormals) == 0.0 == _numpy_flushed(subnormals, 1.0)
  assert flushed_fraction(subnormals / 2) == pytest.approx(1 / 1023)  # only 2**-25 itself


def test_zeros_are_not_counted():
  assert flushed_fraction(np.zeros(5, np.float32)) == 0.0
  assert flushed_fraction(np.array([0.0, 0.0, 2.0**-30, 1.0], np.float32)) == 0.5


@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 8.0, 2.0**15, 3.0, 2.0**40])
def test_flushed_and_overflowed_fractions_match_numpy(scale):
  rng = np.random.default_rng(0)
  exponents = rng.uniform(-45, 20, size=20_000)
  values = (rng.choice([-1.0, 1.0], size=exponents.size) * 2.0**exponents).astype(np.float32)
  edges = np.array([2.0**-25, 2.0**-24, 65504.0, 65519.0, 65520.0, 0.0], np.float32) / scale
  values = np.concatenate([values, edges.astype(np.float32)])
  assert flushed_fraction(values, scale) == _numpy_flushed(values, scale)
  assert overflow_fraction(values, scale) == _numpy_overflowed(values, scale)


def test_log2_histogram_bins_by_binary_exponent():
  values = np.array([0.0, 2.0**-24, 0.75 * 2.0**-24, 1.0, 1.99, 2.0**30, 2.0**-50], np.float32)
  hist = log2_histogram(values, low=-40, high=18)
  counts = dict(zip(hist["exponents"], hist["counts"], strict=True))
  assert counts[-24] == 1 and counts[-25] == 1 and counts[0] == 2
  assert (hist["zeros"], hist["below"], hist["above"]) == (1, 1, 1)
  assert sum(hist["counts"]) + hist["zeros"] + hist["below"] + hist["above"] == hist["total"] == 7
