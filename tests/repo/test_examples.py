"""Every example runs end to end as a user runs it (a subprocess, few steps).

Besides exit status 0 (each example checks what it demonstrates), this file checks:

* the MNIST examples are three lines away from their float32 twins in
  ``examples/float32/`` (a difflib diff of the code, module docstrings aside);
* ``--policy float32`` reproduces the float32 twin bit for bit (final params and
  statistics), and under ``mixed_float16`` the BatchNorm statistics stay float32
  and advance as in float32, and NNX's dropout RNG counts advance exactly as in
  float32.

Time: the examples are subprocesses, each mostly importing JAX and compiling. The
runs the selected tests need start up front, two at a time, and share a JAX
compilation cache (kept in pytest's cache directory, so a second session is faster).
"""

import ast
import concurrent.futures
import difflib
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MNIST = ["mnist_linen.py", "mnist_nnx.py"]
SMOKE_STEPS = 6

# Every run the tests use: key -> script and arguments. {out} is a per-session directory.
RUNS = {
  **{
    f"digits-{policy}": (
      "float16_dynamic_loss_scale.py",
      ["--policy", policy, "--steps", "20", "--log-every", "20"],
    )
    for policy in ("mixed_bfloat16", "float32", "mixed_float16")
  },
  **{
    f"{script}-{policy}": (
      script if policy != "twin" else f"float32/{script}",
      ["--steps", str(SMOKE_STEPS), "--state-out", f"{{out}}/{script}-{policy}.npz"]
      + ([] if policy == "twin" else ["--policy", policy]),
    )
    for script in MNIST
    for policy in ("twin", "float32", "mixed_float16")
  },
  "nnx_transformer": (
    "nnx_transformer.py",
    ["--steps", "5", "--log-every", "5", "--sample-chars", "4"],
  ),
  "optax_pipeline": (
    "optax_pipeline.py",
    ["--steps", "8", "--accumulate", "2", "--log-every", "4"],
  ),
  "from_jmp": ("from_jmp.py", ["--steps", "12", "--period", "4", "--log-every", "4"]),
  "multiprocess": ("multiprocess.py", ["--smoke"]),
  "equinox_vit": ("equinox_vit.py", ["--steps", "6", "--log-every", "3"]),
  "from_flax_dynamic_scale": (
    "from_flax_dynamic_scale.py",
    ["--steps", "12", "--growth-interval", "3", "--log-every", "4"],
  ),
}

# Which runs each test reads, from its name and parameters.
NEEDS = {
  "test_digits_example_uses_the_documented_default_scale": lambda p: [f"digits-{p['policy']}"],
  "test_mnist_float32_policy_is_the_float32_program": lambda p: [
    f"{p['script']}-twin",
    f"{p['script']}-float32",
  ],
  "test_mnist_float16_statistics_and_rng_advance_as_in_float32": lambda p: [
    f"{p['script']}-twin",
    f"{p['script']}-mixed_float16",
  ],
  "test_nnx_transformer": lambda p: ["nnx_transformer"],
  "test_equinox_vit": lambda p: ["equinox_vit"],
  "test_optax_pipeline_resumes_bitwise": lambda p: ["optax_pipeline"],
  "test_from_jmp": lambda p: ["from_jmp"],
  "test_from_flax_dynamic_scale": lambda p: ["from_flax_dynamic_scale"],
  "test_multiprocess": lambda p: ["multiprocess"],
}


class _Runner:
  """Runs examples as subprocesses, two at a time, each at most once per session."""

  def __init__(self, out: pathlib.Path, jax_cache: pathlib.Path):
    self.out = out
    # The checkout's mpx, not whichever one the environment has installed.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    self.env = {
      **os.environ,
      "PYTHONPATH": pythonpath,
      "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    self.futures: dict[str, concurrent.futures.Future] = {}

  def start(self, key: str) -> concurrent.futures.Future:
    if key not in self.futures:
      script, args = RUNS[key]
      command = [sys.executable, str(EXAMPLES / script)]
      command += [arg.format(out=self.out) for arg in args]
      self.futures[key] = self.pool.submit(
        subprocess.run,
        command,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=self.env,
      )
    return self.futures[key]

  def output(self, key: str) -> str:
    result = self.start(key).result()
    assert result.returncode == 0, f"{key}:\n{result.stdout}{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
  if request.config.pluginmanager.has_plugin("cacheprovider"):
    jax_cache = request.config.cache.mkdir("mpx-examples-jax-cache")
  else:
    jax_cache = tmp_path_factory.mktemp("jax-cache")
  runner = _Runner(tmp_path_factory.mktemp("examples"), jax_cache)
  for item in request.session.items:  # start what the selected tests of this file need
    if getattr(item, "module", None) is sys.modules[__name__] and item.originalname in NEEDS:
      params = item.callspec.params if hasattr(item, "callspec") else {}
      for key in NEEDS[item.originalname](params):
        runner.start(key)
  yield runner
  runner.pool.shutdown(cancel_futures=True)


def _final_scale(output: str) -> float:
  rows = [line.split() for line in output.splitlines() if line.split()[:1] == ["20"]]
  return float(rows[-1][2])


@pytest.mark.parametrize(
  ("policy", "scale"), [("mixed_bfloat16", 1.0), ("float32", 1.0), ("mixed_float16", 2.0**15)]
)
def test_digits_example_uses_the_documented_default_scale(policy, scale, runner):
  # The README: loss_scale="dynamic" is a no-op unless float16 is in the policy.
  output = runner.output(f"digits-{policy}")
  assert _final_scale(output) == scale
  assert "explicit" not in output


def _code_lines(path: pathlib.Path) -> list[str]:
  """The file's lines without its module docstring (the two files describe themselves)."""
  source = path.read_text()
  docstring = ast.parse(source).body[0]
  assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
  return source.splitlines()[docstring.end_lineno :]


@pytest.mark.parametrize("script", MNIST)
def test_mnist_is_three_lines_from_its_float32_twin(script):
  float32, mixed = _code_lines(EXAMPLES / "float32" / script), _code_lines(EXAMPLES / script)
  replaced, inserted = [], []
  matcher = difflib.SequenceMatcher(a=float32, b=mixed, autojunk=False)
  for tag, i1, i2, j1, j2 in matcher.get_opcodes():
    assert tag != "delete", f"lines removed from the float32 program: {float32[i1:i2]}"
    if tag == "replace":
      assert i2 - i1 == j2 - j1, f"{float32[i1:i2]} -> {mixed[j1:j2]}"
      replaced += zip(float32[i1:i2], mixed[j1:j2], strict=True)
    elif tag == "insert":
      inserted += mixed[j1:j2]
  diff = "\n".join(difflib.unified_diff(float32, mixed, lineterm="", n=0))
  assert len(replaced) <= 3, diff
  assert all("mpx." in new for _, new in replaced), diff
  # Besides the three lines, only the import and the flag that chooses the policy.
  flag = '  parser.add_argument("--policy", default="mixed_float16", help="e.g. float32, mixed_bfloat16")'
  assert sorted(line for line in inserted if line) == sorted(["import mpx", flag]), diff


def _mnist(runner: _Runner, script: str, policy: str) -> tuple[str, dict[str, np.ndarray]]:
  """The output and final state of an MNIST run (``policy="twin"``: the float32 twin)."""
  output = runner.output(f"{script}-{policy}")
  with np.load(runner.out / f"{script}-{policy}.npz") as state:
    return output, dict(state)


def _table(output: str) -> list[str]:
  return [line for line in output.splitlines() if not line.startswith("done in")]


@pytest.mark.parametrize("script", MNIST)
def test_mnist_float32_policy_is_the_float32_program(script, runner):
  want_output, want = _mnist(runner, script, "twin")
  output, got = _mnist(runner, script, "float32")
  assert _table(output) == _table(want_output)
  assert sorted(got) == sorted(want)
  for key in want:
    assert got[key].dtype == want[key].dtype, key
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("script", MNIST)
def test_mnist_float16_statistics_and_rng_advance_as_in_float32(script, runner):
  _, want = _mnist(runner, script, "twin")
  _, got = _mnist(runner, script, "mixed_float16")
  assert sorted(got) == sorted(want)
  stats = [k for k in want if k.split("/")[-1] in ("mean", "var")]
  assert len(stats) == 4, sorted(want)  # two BatchNorms, mean and var each
  for key in stats:
    initial = 0.0 if key.endswith("mean") else 1.0
    assert got[key].dtype == np.float32, key
    assert (want[key] != initial).any(), key  # the statistics moved...
    # ...and the same way: float16 convolutions against float32 ones, a few steps.
    np.testing.assert_allclose(got[key], want[key], rtol=0.05, atol=5e-3, err_msg=key)
  counts = [k for k in want if k.endswith("rngs/count")]
  assert len(counts) == (2 if script == "mnist_nnx.py" else 0)  # linen folds in the step
  for key in counts:
    assert int(want[key]) == SMOKE_STEPS  # one key per dropout layer per step
    assert int(got[key]) == int(want[key]), key


def _skipped_steps(output: str) -> int:
  match = re.search(r"^(\d+) skipped steps in both", output, re.MULTILINE)
  assert match, output
  return int(match.group(1))


def test_nnx_transformer(runner):
  output = runner.output("nnx_transformer")
  assert "100.0% of their FLOPs with half-precision operands, 0 with float32" in output


def test_equinox_vit(runner):
  output = runner.output("equinox_vit")
  assert "audit: 100.0% of matmul FLOPs in half precision" in output
  assert "'blocks/attention/query_proj'" in output and "'head'" in output


def test_optax_pipeline_resumes_bitwise(runner):
  output = runner.output("optax_pipeline")
  assert "resumed run matches the uninterrupted one bitwise" in output


def test_from_jmp(runner):
  pytest.importorskip("jmp")
  output = runner.output("from_jmp")
  assert "the same loss, scale and skip decision at every step" in output
  assert _skipped_steps(output) > 0


def test_from_flax_dynamic_scale(runner):
  output = runner.output("from_flax_dynamic_scale")
  assert "the same loss, scale and skip decision at every step" in output
  assert _skipped_steps(output) > 0


def test_multiprocess(runner):
  # Two local processes (gloo): process 1's inf skips the step on both, params stay equal.
  output = runner.output("multiprocess")
  assert "2 processes, 4 devices" in output
  assert "skipped on every process: True" in output
  assert "params bitwise equal on every process" in output
