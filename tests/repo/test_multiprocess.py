"""Multi-controller training: 2 JAX processes on localhost, 2 CPU devices each.

``tests/repo/multiprocess_worker.py`` runs in two processes joined by
``jax.distributed.initialize`` (gloo collectives), then once alone on 4 devices
as the reference. The tests pin that

* an inf in process 1's batch rows skips the step in both processes, and both
  back the scale off identically (process 0 never sees the inf);
* after training, every process holds bitwise the same params, masters,
  momentum and loss-scale state, and they match the one-process run on 4
  devices;
* the train state saved with orbax by the two processes restores into both of
  them and into one process (4 devices, and a 2-device mesh), and training
  resumes bitwise on the same mesh, within tolerance on the other.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 150
sys.path.insert(0, str(WORKER.parent))

import multiprocess_worker as worker  # noqa: E402


def _free_port() -> int:
  # Port 0 asks the kernel for a free port; parallel test runs get different ones.
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(argvs: list[list[str]], logs: pathlib.Path) -> None:
  """Runs one worker per argv together; on failure or timeout kills all, raising with stderr."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = []
  for i, argv in enumerate(argvs):
    err = open(logs / f"stderr-{i}.txt", "w")  # noqa: SIM115 (closed below)
    procs.append((subprocess.Popen([sys.executable, str(WORKER), *argv], env=env, stderr=err), err))
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while any(p.poll() is None for p, _ in procs):
      failed = [p for p, _ in procs if p.poll() not in (None, 0)]
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.1)
  finally:
    for p, err in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
      err.close()
  codes = [p.returncode for p, _ in procs]
  if codes != [0] * len(procs):
    stderr = "\n".join(
      f"--- process {i} (exit {c}) ---\n{(logs / f'stderr-{i}.txt').read_text()[-2500:]}"
      for i, c in enumerate(codes)
    )
    why = "timed out" if time.monotonic() > deadline else "failed"
    raise AssertionError(f"multi-process workers {why} after {TIMEOUT_S} s at most:\n{stderr}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess")
  common = ["--out", str(out), "--checkpoint", str(out / "ckpt")]
  port = str(_free_port())
  _launch(
    [["--num-processes", "2", "--process-id", str(i), "--port", port, *common] for i in (0, 1)],
    out,
  )
  _launch([["--num-processes", "1", *common]], out)

  def load(name):
    with np.load(out / f"{name}.npz") as f:
      return dict(f)

  tags = ("p0", "p1", "ref")
  logs = {t: json.loads((out / f"{t}-log.json").read_text()) for t in tags}
  return {"load": load, "logs": logs}


def _bitwise_equal(a: dict, b: dict) -> bool:
  assert a.keys() == b.keys()
  return all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


# The gradients of float16 params are float16, and XLA sums them across devices in
# float16; if gloo and the in-process all-reduce add in different orders (the likely
# cause of the observed differences), a gradient element may differ by a float16 rounding (2**-11 relative), and so may every param,
# master and momentum that follows. Tolerance: 4 such roundings of each leaf's largest
# magnitude (a skipped step done wrong, or a lost update, is off by about 100 times that).
F16_ROUNDING = 2.0**-11


def _assert_close(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for k in a:
    x, y = a[k].astype(np.float64), b[k].astype(np.float64)
    atol = 4 * F16_ROUNDING * float(np.abs(y).max(initial=0.0))
    np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=k)


def test_an_inf_in_one_processs_batch_skips_the_step_in_every_process(runs):
  p0, p1 = runs["logs"]["p0"]["train"], runs["logs"]["p1"]["train"]
  inf = worker.INF_STEP
  assert p0[inf]["finite_here"] and not p1[inf]["finite_here"]  # only process 1 saw it
  for log in (p0, p1):
    assert [e["skipped_steps"] for e in log] == [0] * inf + [1] * (worker.STEPS - inf)
    assert log[inf]["loss_scale"] == log[inf - 1]["loss_scale"] / 2
  assert [e["loss_scale"] for e in p0] == [e["loss_scale"] for e in p1]


def test_every_process_ends_with_bitwise_the_same_state(runs):
  p0, p1 = runs["load"]("p0-final"), runs["load"]("p1-final")
  assert any("master_params" in k for k in p0) and any("trace" in k for k in p0)
  assert _bitwise_equal(p0, p1)


def test_two_processes_train_as_one_process_on_four_devices(runs):
  p0, ref = runs["load"]("p0-final"), runs["load"]("ref-final")
  # Same program, data and device count; only the order of the float16 all-reduce differs.
  _assert_close(p0, ref)
  ref_log, p0_log = runs["logs"]["ref"]["train"], runs["logs"]["p0"]["train"]
  assert [e["loss_scale"] for e in ref_log] == [e["loss_scale"] for e in p0_log]
  assert [e["skipped_steps"] for e in ref_log] == [e["skipped_steps"] for e in p0_log]


@pytest.mark.parametrize("process", ["p0", "p1"])
def test_a_checkpoint_resumes_bitwise_on_the_processes_that_saved_it(runs, process):
  assert _bitwise_equal(runs["load"](f"{process}-resumed"), runs["load"](f"{process}-final"))


def test_a_checkpoint_of_two_processes_resumes_in_one_process(runs):
  final = runs["load"]("p0-final")
  _assert_close(runs["load"]("ref-resumed"), final)  # 4 devices, one process
  _assert_close(runs["load"]("ref-resumed_2dev"), final)  # a 2-device mesh
