"""Progress of the command-line tools: tqdm when it is installed, plain lines on stderr otherwise.

tqdm comes with the ``demo`` extra and may be absent; the fallback prints a
line about every tenth of a run, so CI logs stay short.
"""

from __future__ import annotations

import sys
from typing import Any


class Progress:
  """Reports training progress for one run.

  Uses ``tqdm`` (the ``demo`` extra) when it can be imported; otherwise prints
  a line to stderr about every tenth of the run, so CI logs stay short.

  Args:
    total: number of steps in the run.
    name: the run's name, shown on every line.
  """

  def __init__(self, total: int, name: str) -> None:
    self._total = total
    self._name = name
    self._done = 0
    self._every = max(1, total // 10)
    self._bar: Any = None
    try:
      from tqdm import tqdm  # pyright: ignore[reportMissingImports]
    except ImportError:
      return
    self._bar = tqdm(total=total, desc=f"{name:<24}", unit="step", leave=True, dynamic_ncols=True)

  def update(self, loss: float, scale: float) -> None:
    """Records one finished step.

    Args:
      loss: the step's training loss.
      scale: the loss scale the step used.
    """
    self._done += 1
    if self._bar is not None:
      self._bar.set_postfix(loss=f"{loss:.3f}", scale=f"{scale:g}", refresh=False)
      self._bar.update(1)
    elif self._done % self._every == 0 or self._done == self._total:
      print(
        f"{self._name}: step {self._done}/{self._total}, loss {loss:.3f}, scale {scale:g}",
        file=sys.stderr,
        flush=True,
      )

  def close(self, note: str | None = None) -> None:
    """Ends the bar, with an optional closing remark.

    Args:
      note: printed after the bar, e.g. why the run stopped early.
    """
    if self._bar is not None:
      self._bar.close()
    if note:
      print(f"{self._name}: {note}", file=sys.stderr, flush=True)


def stage(message: str) -> None:
  """Announces a step of a command's work on stderr, so a long compilation is not silent.

  Args:
    message: what starts now, e.g. ``"[1/4] gradients of a float32 step"``.
  """
  print(message, file=sys.stderr, flush=True)
