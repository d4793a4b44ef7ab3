"""The ``python -m mpx.diagnose`` command: argument checks, the text report, plots and progress."""

import contextlib
import io
import re
import subprocess
import sys
import time

import pytest

from mpx.demo import _diagnose as diagnose

PNGS = ("activation_gradients.png", "flushed_heatmap.png", "loss_scale.png")


@pytest.fixture(scope="module")
def diagnosis():
  """One real run on a tiny model (the slow part: compilation), and what it wrote to stderr."""
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    result = diagnose.diagnose(steps=4, depth=2)
  return result, stderr.getvalue()


@pytest.fixture
def no_work(monkeypatch):
  """Makes any diagnostic work an error: argument checks must come first."""

  def fail(**kwargs):
    raise AssertionError(f"the diagnostics started with {kwargs}")

  monkeypatch.setattr(diagnose, "diagnose", fail)


@pytest.fixture
def cached(monkeypatch, diagnosis):
  monkeypatch.setattr(diagnose, "diagnose", lambda **kwargs: diagnosis[0])


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--dtype", "float17"], "argument --dtype: 'float17' is not a format"),
    (["--dtype", "float32"], "argument --dtype: 'float32' is not a format"),
    (["--steps", "0"], "argument --steps: 0 is too small: pass 1 or more"),
    (["--depth", "-3"], "argument --depth: -3 is too small: pass 1 or more"),
    (["--steps", "ten"], "argument --steps: 'ten' is not an integer"),
    (["--seed", "-1"], "argument --seed: -1 is too small: pass 0 or more"),
    (["--plots", "maybe"], "argument --plots: invalid choice"),
  ],
)
def test_bad_arguments_fail_before_any_work(argv, message, capsys, no_work):
  start = time.perf_counter()
  with pytest.raises(SystemExit) as exit_info:
    diagnose.main(argv)

  assert time.perf_counter() - start < 2.0
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_help_shows_every_default(capsys):
  with pytest.raises(SystemExit) as exit_info:
    diagnose.main(["--help"])

  assert exit_info.value.code == 0
  text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
  for default in ("mpx_diagnostics", "float16", "200", "10", "0", "auto"):
    assert f"(default: {default})" in text


def test_each_stage_and_the_training_steps_are_reported_on_stderr(diagnosis):
  result, stderr = diagnosis

  assert [line[:5] for line in stderr.splitlines() if line.startswith("[")] == [
    "[1/4]",
    "[2/4]",
    "[3/4]",
    "[4/4]",
  ]
  assert "4/4" in stderr.split("[4/4]")[1]  # the bar (tqdm) or the plain line got to the end
  assert len(result.scales) == len(result.skipped) == 4


def test_the_command_prints_the_report_and_writes_the_three_pngs(tmp_path, capsys, cached):
  diagnose.main(["--out", str(tmp_path), "--steps", "4", "--depth", "2"])

  out = capsys.readouterr().out
  for name in PNGS:
    data = (tmp_path / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
  assert "Recommended static scale" in out and "Non-finite locator" in out
  assert re.search(r"Mixed float16 training: [1-4] of 4 steps skipped", out)  # from 2**24
  assert out.index("Non-finite locator") < out.index("wrote histogram")  # text first


def test_without_matplotlib_the_text_report_is_printed_and_the_extra_named(
  tmp_path, capsys, monkeypatch, cached
):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
  diagnose.main(["--out", str(tmp_path / "pngs")])

  captured = capsys.readouterr()
  assert "Recommended static scale" in captured.out and "Non-finite locator" in captured.out
  assert 'pip install "mpx-mixed-precision[plots]"' in captured.err
  assert not (tmp_path / "pngs").exists()


def test_plots_never_draws_nothing_and_says_nothing_about_matplotlib(tmp_path, capsys, cached):
  diagnose.main(["--out", str(tmp_path / "pngs"), "--plots", "never"])

  captured = capsys.readouterr()
  assert "Recommended static scale" in captured.out
  assert "matplotlib" not in captured.err
  assert not (tmp_path / "pngs").exists()


def test_the_module_without_matplotlib_and_plots_always_fails_at_once():
  script = (
    "import runpy, sys; sys.modules['matplotlib'] = None; "
    "sys.argv = ['mpx.diagnose', '--plots', 'always']; "
    "runpy.run_module('mpx.diagnose', run_name='__main__')"
  )
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
  )

  assert result.returncode == 2, result.stderr
  assert "--plots always needs matplotlib" in result.stderr
  assert "mpx-mixed-precision[plots]" in result.stderr
  assert "[1/4]" not in result.stderr  # refused before the work
