"""Every example runs end to end as a user runs it (a subprocess, few steps)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _run(script: str, *args: str) -> str:
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / script), *args],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def _final_scale(output: str) -> float:
  rows = [line.split() for line in output.splitlines() if line.split()[:1] == ["20"]]
  return float(rows[-1][2])


@pytest.mark.parametrize(
  ("policy", "scale"), [("mixed_bfloat16", 1.0), ("float32", 1.0), ("mixed_float16", 2.0**15)]
)
def test_digits_example_uses_the_documented_default_scale(policy, scale):
  # The README: loss_scale="dynamic" is a no-op unless float16 is in the policy.
  output = _run(
    "float16_dynamic_loss_scale.py", "--policy", policy, "--steps", "20", "--log-every", "20"
  )
  assert _final_scale(output) == scale
  assert "explicit" not in output
