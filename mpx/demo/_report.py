"""The demo's table, its explanations and its JSON record, built from the runs' results."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import textwrap
from typing import Any

import numpy as np

from mpx.demo import _float16
from mpx.demo._settings import Settings
from mpx.demo._train import RunResult

FAIL_MARGIN = 0.1
"""A run *fails* when its validation loss exceeds float32's by more than this (nats per character)."""
MATCH_MARGIN = 0.05
"""A run *matches* float32 when its validation loss is within this of float32's."""


@dataclasses.dataclass(frozen=True)
class GradientSample:
  """Activation gradients of a float32 model, measured once per demo run.

  Attributes:
    values: the flat float32 gradient values.
    source: which run's final params they were measured at.
  """

  values: np.ndarray
  source: str


def _finite_or_none(x: float | None) -> float | None:
  return None if x is None or not math.isfinite(x) else float(x)


def _train_loss(result: RunResult, window: int) -> float:
  return float(np.mean(result.train_losses[-window:]))


def summarize(
  results: list[RunResult], sample: GradientSample, settings: Settings
) -> list[dict[str, Any]]:
  """One row of figures per run: the table's columns and more.

  Args:
    results: the runs, in table order.
    sample: the activation gradients the flushed fractions are measured on.
    settings: the shared settings.

  Returns:
    A list of dicts with JSON-ready values (``None`` for a non-finite loss).
  """
  reference = next((r for r in results if r.config.name == "float32"), None)
  ref_val = reference.eval_losses[-1] if reference is not None else None
  window = min(settings.eval_every, settings.steps)
  rows = []
  for r in results:
    val = r.eval_losses[-1]
    scale = r.final_metrics["loss_scale"]
    diff = _finite_or_none(val - ref_val) if ref_val is not None else None
    if r is reference:
      diff = 0.0
    rows.append(
      {
        "name": r.config.name,
        "policy": r.config.policy,
        "compute_dtype": r.config.compute_dtype,
        "layout": r.config.layout,
        "loss_scaling": "dynamic" if r.config.scaled else "none",
        "float32_masters": r.config.masters and r.config.half_params,
        "compensation": r.config.compensation,
        "shows": r.config.shows,
        "steps_run": len(r.train_losses),
        "train_loss": _finite_or_none(_train_loss(r, window)),
        "train_loss_window": window,
        "val_loss": _finite_or_none(val),
        "val_loss_minus_float32": diff,
        "skipped_steps": int(r.final_metrics["skipped_steps"]),
        "final_loss_scale": scale,
        "diverged": bool(r.final_metrics["diverged"]),
        "flushed_fraction_scale_1": _float16.flushed_fraction(sample.values, 1.0),
        "flushed_fraction_final_scale": _float16.flushed_fraction(sample.values, scale),
        "overflow_fraction_final_scale": _float16.overflow_fraction(sample.values, scale),
        "zero_weight_grad_fraction_first_step": float(r.zero_grads[0]),
        "zero_weight_grad_fraction_mean": float(np.mean(r.zero_grads)),
        "zero_weight_grad_fraction_first_window": float(np.mean(r.zero_grads[:window])),
        "zero_weight_grad_fraction_last_window": float(np.mean(r.zero_grads[-window:])),
        "zero_second_moment_fraction_first_step": r.zero_second_moments,
        "step_ms_median": float(np.median(r.step_seconds) * 1e3) if r.step_seconds.size else None,
        "first_step_s": r.compile_seconds,
        "param_count": r.param_count,
        "bytes_per_param": r.bytes_per_param,
        "param_bytes_per_param": r.param_bytes / r.param_count,
        "opt_state_bytes_per_param": r.opt_state_bytes / r.param_count,
        "opt_state_bytes_by_dtype": r.opt_state_dtypes,
        "warning": r.warning,
        "first_nonfinite_step": r.first_nonfinite_step,
        "stopped_at_step": r.stopped_at,
        "curves": {
          "eval_steps": r.eval_steps,
          "val_loss": [_finite_or_none(v) for v in r.eval_losses],
          "train_loss": [_finite_or_none(v) for v in r.train_losses.tolist()],
          "loss_scale": r.loss_scales.tolist(),
          "skipped_at": [int(i) + 1 for i in np.flatnonzero(r.skipped)],
        },
      }
    )
  return rows


def _number(x: float | None, digits: int = 3, signed: bool = False) -> str:
  if x is None:
    return "nan"
  return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _percent(x: float) -> str:
  return f"{100 * x:.1f}%"


def _scale(x: float) -> str:
  return f"2^{int(math.log2(x))}" if x > 0 and math.log2(x).is_integer() else f"{x:g}"


COLUMNS = (
  "config",
  "layout",
  "loss scaling",
  "train",
  "val",
  "val - f32",
  "skipped",
  "final scale",
  "flushed @1",
  "flushed @final",
  "ms/step",
  "bytes/param",
)


def table(rows: list[dict[str, Any]]) -> str:
  """Formats the rows as an aligned Markdown table.

  Args:
    rows: the output of :func:`summarize`.

  Returns:
    The table, one line per run after the header.
  """
  cells = [
    [
      r["name"],
      r["layout"],
      r["loss_scaling"],
      _number(r["train_loss"]),
      _number(r["val_loss"]),
      _number(r["val_loss_minus_float32"], signed=True)
      if r["val_loss"] is None or r["val_loss_minus_float32"] is not None
      else "n/a",
      str(r["skipped_steps"]),
      _scale(r["final_loss_scale"]),
      _percent(r["flushed_fraction_scale_1"]),
      _percent(r["flushed_fraction_final_scale"]),
      f"{r['step_ms_median']:.1f}" if r["step_ms_median"] is not None else "n/a",
      f"{r['bytes_per_param']:.2f}",
    ]
    for r in rows
  ]
  widths = [max(len(c[i]) for c in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]
  numeric = [False, False, False] + [True] * (len(COLUMNS) - 3)

  layout = list(zip(widths, numeric, strict=True))

  def line(values: list[str]) -> str:
    padded = [v.rjust(w) if n else v.ljust(w) for v, (w, n) in zip(values, layout, strict=True)]
    return "| " + " | ".join(padded) + " |"

  rule = "|" + "|".join("-" * (w + 1) + (":" if n else "-") for w, n in layout) + "|"
  return "\n".join([line(list(COLUMNS)), rule, *(line(c) for c in cells)])


def _verdict(row: dict[str, Any]) -> str:
  diff = row["val_loss_minus_float32"]
  if row["val_loss"] is None:
    return "fails"
  if diff is None:
    return "unknown"
  if diff > FAIL_MARGIN:
    return "fails"
  return "matches" if abs(diff) <= MATCH_MARGIN else "close"


def _zeros(row: dict[str, Any], reference: dict[str, Any] | None, key: str) -> str:
  """The share ``row[key]``, beside the float32 run's when there is one."""
  own = _percent(row[key])
  return f"{own} (float32 run: {_percent(reference[key])})" if reference else own


def _legend(window: int, unigram: float, sample: GradientSample) -> list[str]:
  """What the columns mean, and the unigram baseline."""
  return [
    f"train: mean training loss of the last {window} steps; val: validation loss after the last "
    "step; val - f32: its difference to the float32 run's; skipped: steps skipped for non-finite "
    "gradients; ms/step: median wall time of a step after the first (on a shared CPU, noise).",
    f"flushed: share of the nonzero activation gradients d(loss)/d(block output) of the float32 "
    f"model at {sample.source}'s final params ({sample.values.size:,} values, one training-size "
    "validation batch, via zero perturbations) that round to 0 in float16 once multiplied by the "
    "loss scale, at scale 1 and at each run's final scale (bfloat16 and float32 runs never round "
    "to float16: for them it is hypothetical).",
    f"A unigram model (character frequencies, no context) scores {unigram:.3f} on the validation text.",
  ]


def _headline(row: dict[str, Any]) -> str:
  """``name: VERDICT (val ..., ... vs float32)``."""
  diff = row["val_loss_minus_float32"]
  if row["val_loss"] is None:
    versus = "not finite"
  elif diff is None:
    versus = f"val {_number(row['val_loss'])}, no float32 run to compare with"
  else:
    versus = f"val {_number(row['val_loss'])}, {_number(diff, signed=True)} vs float32"
  return f"{row['name']}: {_verdict(row).upper()} ({versus})"


def _scaled(row: dict[str, Any], head: str, layout_a: float | None) -> str:
  """A dynamically scaled run: its skips, and what its final scale flushes."""
  memory = ""
  if row["float32_masters"] and layout_a is not None:
    memory = (
      f" Its params and optimizer state take {row['bytes_per_param']:.2f} bytes per param "
      f"({row['param_bytes_per_param']:.2f} of float16 params, the float32 masters and adam's "
      f"moments in the rest), against {layout_a:.2f} with float32 params: the price of "
      "float16 params, which the forward and backward passes read at half the bytes."
    )
  return (
    f"{head}, {row['skipped_steps']} skipped steps: at its final scale "
    f"{_scale(row['final_loss_scale'])}, {_percent(row['flushed_fraction_final_scale'])} of the "
    f"gradients flush, against {_percent(row['flushed_fraction_scale_1'])} at scale 1.{memory}"
  )


def _bfloat16_params(row: dict[str, Any], head: str) -> str:
  """A run with bfloat16 params and no float32 masters: how its updates are rounded."""
  how = {
    None: "every update is rounded to the nearest bfloat16 weight, so updates below half an "
    "ulp of a weight are lost",
    "kahan": "a bfloat16 Kahan buffer carries each step's rounding error into the next",
    "stochastic": "each weight is rounded up or down at random, unbiased in expectation",
  }[row["compensation"]]
  return (
    f"{head} with bfloat16 params and no float32 masters: {how}; params and optimizer state "
    f"take {row['bytes_per_param']:.2f} bytes per param."
  )


def _nonfinite(row: dict[str, Any], head: str, reference: dict[str, Any] | None) -> str:
  """An unscaled float16 run whose loss went non-finite: when, and why."""
  nonfinite = (
    f"its loss is not finite from step {row['first_nonfinite_step']}"
    if row["first_nonfinite_step"]
    else "its final validation loss is not finite"
  )
  if row["stopped_at_step"]:
    nonfinite += (
      f"; its params were not finite after step {row['stopped_at_step']}, where it stopped"
    )
  why = (
    f"{_flushed_at_1(row)}, and at step 1 "
    f"{_zeros(row, reference, 'zero_weight_grad_fraction_first_step')} of its "
    "weight-gradient values were exactly 0."
  )
  half_state = "float16" in row["opt_state_bytes_by_dtype"]
  if half_state and row["zero_second_moment_fraction_first_step"] is not None:
    why += (
      " But the NaN comes from the optimizer: without float32 masters, adamw keeps its "
      "moments in float16 like the params, and after step 1 "
      f"{_zeros(row, reference, 'zero_second_moment_fraction_first_step')} of its second-moment "
      "values (0.001 g^2) were 0, while adam's eps (1e-8) rounds to "
      f"{float(np.float16(1e-8)):g} in float16: each of those weights got the update "
      "x/0 = inf or 0/0 = NaN."
    )
  return f"{head}: {nonfinite}. {why}"


def _unscaled_float16(
  row: dict[str, Any], head: str, reference: dict[str, Any] | None, *, unigram: float
) -> str:
  """An unscaled float16 run with a finite loss: its zero gradients, and whether it failed."""
  window = row["train_loss_window"]
  why = (
    f"{_flushed_at_1(row)}; over the run, "
    f"{_zeros(row, reference, 'zero_weight_grad_fraction_mean')} of its "
    "weight-gradient values were exactly 0."
  )
  curve = [v for v in row["curves"]["val_loss"] if v is not None]
  if curve and curve[-1] > min(curve) + MATCH_MARGIN:
    why += (
      f" Its validation loss bottomed out at {min(curve):.3f} and rose again to "
      f"{curve[-1]:.3f} while the share of zero weight-gradient values went from "
      f"{_percent(row['zero_weight_grad_fraction_first_window'])} (first {window} steps) to "
      f"{_percent(row['zero_weight_grad_fraction_last_window'])} (last {window})."
    )
  verdict = _verdict(row)
  if verdict == "fails":
    worse = "worse" if (row["val_loss"] or 0.0) > unigram else "better"
    return f"{head}, {worse} than the unigram model. {why}"
  if verdict == "unknown":
    return f"{head}. {why}"
  return (
    f"{head}: float16 without loss scaling did NOT fail on this run (failure margin "
    f"{FAIL_MARGIN}). {why}"
  )


def _flushed_at_1(row: dict[str, Any]) -> str:
  return (
    f"At scale 1, {_percent(row['flushed_fraction_scale_1'])} of the activation gradients flush "
    "to zero in float16"
  )


def explain(rows: list[dict[str, Any]], *, unigram: float, sample: GradientSample) -> list[str]:
  """Says what the table shows, run by run, with the figures behind each claim.

  Args:
    rows: the output of :func:`summarize`.
    unigram: the validation loss of a unigram model (the no-context baseline).
    sample: the activation gradients behind the flushed fractions.

  Returns:
    Lines of text, one point each.
  """
  reference = next((r for r in rows if r["name"] == "float32"), None)
  layout_a = next((r["bytes_per_param"] for r in rows if r["name"] == "mixed_float16"), None)
  window = rows[0]["train_loss_window"] if rows else 0
  lines = _legend(window, unigram, sample)
  for r in rows:
    if r["warning"]:
      lines.append(
        f"{r['name']}: caught the expected mpx.PrecisionWarning: {one_line(r['warning'])}"
      )
  for r in rows:
    if r["name"] == "float32":
      continue
    head = _headline(r)
    if r["loss_scaling"] == "dynamic":
      lines.append(_scaled(r, head, layout_a))
    elif r["compute_dtype"] != "float16" and r["policy"].startswith("params=bfloat16"):
      lines.append(_bfloat16_params(r, head))
    elif r["compute_dtype"] != "float16":
      lines.append(f"{head} without loss scaling: bfloat16 has float32's exponent range.")
    elif r["val_loss"] is None:
      lines.append(_nonfinite(r, head, reference))
    else:
      lines.append(_unscaled_float16(r, head, reference, unigram=unigram))
  return lines


def one_line(message: str, width: int = 170) -> str:
  """Shortens a message to one line.

  Args:
    message: the text.
    width: the longest line returned.

  Returns:
    The message with whitespace collapsed, cut at a word boundary with `` ...``.
  """
  return textwrap.shorten(message, width=width, placeholder=" ...")


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  """Writes ``payload`` as strict JSON (no NaN: non-finite losses are ``null``).

  Args:
    path: the file to write.
    payload: JSON-ready data.

  Returns:
    ``None``.
  """
  path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
