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

``tests/repo/multiprocess_sharded_worker.py`` trains a scanned Llama decoder
sharded FSDP (4 devices) and FSDP x TP (data across the processes, model within
each), under ``mixed_bfloat16`` and ``mixed_float16``, in one launch of the two
processes beside the one-process reference. The ``test_sharded_`` tests pin that
the processes' copies of every leaf agree bitwise, that an inf in process 1's
rows skips the step in both (params and momentum bitwise unchanged), and that
FSDP x TP trains bitwise as one process does, FSDP within 16 roundings.
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
SHARDED_WORKER = WORKER.with_name("multiprocess_sharded_worker.py")
TIMEOUT_S = 150
sys.path.insert(0, str(WORKER.parent))

import multiprocess_sharded_worker as sharded_worker  # noqa: E402
import multiprocess_worker as worker  # noqa: E402


def _free_port() -> int:
  # Port 0 asks the kernel for a free port; parallel test runs get different ones.
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(
  argvs: list[list[str]],
  logs: pathlib.Path,
  script: pathlib.Path = WORKER,
  timeout_s: int = TIMEOUT_S,
) -> None:
  """Runs ``script`` once per argv, all together; on failure or timeout kills all, raising."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = []
  for i, argv in enumerate(argvs):
    err = open(logs / f"stderr-{i}.txt", "w")  # noqa: SIM115 (closed below)
    procs.append((subprocess.Popen([sys.executable, str(script), *argv], env=env, stderr=err), err))
  deadline = time.monotonic() + timeout_s
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
    raise AssertionError(f"multi-process workers {why} after {timeout_s} s at most:\n{stderr}")


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


def _assert_close(a: dict, b: dict, rel: float = 4 * F16_ROUNDING) -> None:
  """Each leaf within ``rel`` times its largest magnitude in ``b``."""
  assert a.keys() == b.keys()
  for k in a:
    x, y = a[k].astype(np.float64), b[k].astype(np.float64)
    atol = rel * float(np.abs(y).max(initial=0.0))
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


# FSDP and FSDP x TP of a Llama decoder: tests/repo/multiprocess_sharded_worker.py trains
# every layout x policy in one launch of two processes, beside the one-process reference.
SHARDED_RUNS = [(lo, po) for lo in sharded_worker.LAYOUTS for po in sharded_worker.POLICIES]

# FSDP x TP sums across the processes over its data axis: 2 devices, one per process, and
# a sum of two terms does not depend on the order; it trained bitwise as one process does.
# FSDP over 4 devices sums 4 terms, which gloo adds in another order than the in-process
# collectives (the likely cause: FSDP x TP, same model, data and steps, agrees bitwise).
# Under mixed_float16 the compiled step all-reduces float16 values over the 4 devices (4
# all-reduces; the losses differ from the first step on, so some are in the forward), and
# the leaves differ by float16 roundings (2**-11) of their largest value (up to 6 seen,
# after 4 steps). Under mixed_bfloat16 XLA:CPU moves and sums everything in float32, and
# only the momentum of the replicated norm scales differs, by float32 roundings (2**-24;
# up to 2.2 seen). Tolerance: 16 roundings. A step lost or taken twice
# changes the momentum by about one gradient, the size of the momentum itself.
SHARDED_ROUNDING = {"mixed_float16": 2.0**-11, "mixed_bfloat16": 2.0**-24}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess_sharded")
  port = str(_free_port())
  two = [["--num-processes", "2", "--process-id", str(i), "--port", port] for i in (0, 1)]
  # The reference runs beside the two processes: three keep both cores busy while the
  # two wait on each other's collectives.
  argvs = [[*argv, "--out", str(out)] for argv in [*two, ["--num-processes", "1"]]]
  _launch(argvs, out, script=SHARDED_WORKER, timeout_s=300)
  runs = {}
  for tag in ("p0", "p1", "ref"):
    with np.load(out / f"{tag}-sharded.npz") as f:
      arrays = dict(f)
    runs[tag] = {"arrays": arrays, "log": json.loads((out / f"{tag}-sharded-log.json").read_text())}
  return runs


def _snapshot(sharded: dict, tag: str, run: str, name: str) -> dict:
  """``{leaf: (values, held)}``: the state ``name`` of ``run`` as process ``tag`` holds it."""
  arrays, prefix = sharded[tag]["arrays"], f"{run}/{name}/"
  return {
    k.removeprefix(prefix): (v, arrays[f"{k}:held"])
    for k, v in arrays.items()
    if k.startswith(prefix) and not k.endswith(":held")
  }


def _snapshot_names(policy: str) -> list[str]:
  return ["before_inf", "after_inf", "final"] if policy == "mixed_float16" else ["final"]


@pytest.mark.parametrize("layout,policy", SHARDED_RUNS)
def test_sharded_processes_hold_bitwise_the_same_state(sharded, layout, policy):
  run = f"{layout}/{policy}"
  assert sharded["p0"]["log"]["differ"] == sharded["p1"]["log"]["differ"] == []
  assert sharded["p0"]["log"][run] == [
    {**e, "finite_here": e0["finite_here"]}
    for e, e0 in zip(sharded["p1"]["log"][run], sharded["p0"]["log"][run], strict=True)
  ]
  for name in _snapshot_names(policy):
    p0, p1 = (_snapshot(sharded, t, run, name) for t in ("p0", "p1"))
    assert p0.keys() == p1.keys() and any("trace" in k for k in p0)
    for k, (v0, held0) in p0.items():
      v1, held1 = p1[k]
      assert (held0 | held1).all(), k  # together they hold all of it
      both = held0 & held1
      assert v0[both].tobytes() == v1[both].tobytes(), k  # and their copies agree
      if k.startswith("['params']"):
        # llama_specs shards every kernel over the processes; small leaves are replicated.
        held = 0.5 if v0.size >= sharded_worker.MIN_SIZE else 1.0
        assert held0.mean() == held1.mean() == held, k


@pytest.mark.parametrize("layout,policy", SHARDED_RUNS)
def test_sharded_processes_train_as_one_process_on_four_devices(sharded, layout, policy):
  run = f"{layout}/{policy}"
  log, ref_log = sharded["p0"]["log"][run], sharded["ref"]["log"][run]
  for field in ("loss_scale", "skipped_steps"):
    assert [e[field] for e in log] == [e[field] for e in ref_log], field
  rel = 16 * SHARDED_ROUNDING[policy]
  loss, ref_loss = [e["loss"] for e in log], [e["loss"] for e in ref_log]
  for name in _snapshot_names(policy):
    p0, p1 = (_snapshot(sharded, t, run, name) for t in ("p0", "p1"))
    merged = {k: np.where(held, v, p1[k][0]) for k, (v, held) in p0.items()}
    ref = {k: v for k, (v, _) in _snapshot(sharded, "ref", run, name).items()}
    if layout == "fsdp_tp":
      assert loss == ref_loss
      assert _bitwise_equal(merged, ref)
    else:
      np.testing.assert_allclose(loss, ref_loss, rtol=rel)
      _assert_close(merged, ref, rel=rel)


@pytest.mark.parametrize("layout", sharded_worker.LAYOUTS)
def test_sharded_an_inf_in_one_processs_rows_skips_the_step_in_every_process(sharded, layout):
  run, inf = f"{layout}/mixed_float16", sharded_worker.INF_STEP
  p0, p1 = sharded["p0"]["log"][run], sharded["p1"]["log"][run]
  assert p0[inf]["finite_here"] and not p1[inf]["finite_here"]  # only process 1 saw it
  for log in (p0, p1):
    assert [e["skipped_steps"] for e in log] == [0] * inf + [1] * (sharded_worker.STEPS - inf)
    assert log[inf]["loss_scale"] == log[inf - 1]["loss_scale"] / 2
  for tag in ("p0", "p1"):
    before, after, final = (
      _snapshot(sharded, tag, run, name) for name in ("before_inf", "after_inf", "final")
    )
    # Params, momentum and step count: bitwise what they were before the skipped step...
    kept = [k for k in before if k.startswith(("['params']", "['opt_state'].inner_state"))]
    assert any("trace" in k for k in kept) and any("kernel" in k for k in kept)
    for k in kept:
      assert before[k][0].tobytes() == after[k][0].tobytes(), k
    # ...and the next step, finite, moves them again.
    assert all(after[k][0].tobytes() != final[k][0].tobytes() for k in kept if "kernel" in k)
