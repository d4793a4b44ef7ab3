"""One process of the multi-process tests (``tests/repo/test_multiprocess.py``); run as a script.

``--num-processes 2``: one of two JAX processes on localhost (gloo collectives),
with 2 CPU devices each, training data-parallel over the global 4-device mesh.
It trains ``STEPS`` steps, one of which sees an inf in the batch rows of
process 1 only, saves the train state with orbax after ``SAVE_AT`` steps,
restores it into fresh arrays and trains the rest again. ``--num-processes 1``
is the reference: the same training on 4 devices in one process, then the
checkpoint of the 2-process run restored onto 4 devices and onto a 2-device
mesh. Each process writes what the test compares to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
from typing import Any

STEPS = 6
SAVE_AT = 3
INF_STEP = 1  # this step's batch has an inf in global row INF_ROW
BATCH, FEATURES, HIDDEN = 16, 8, 32
INF_ROW = 13  # rows 8..15 belong to devices 2 and 3: process 1's
POLICY = "params=float16,compute=float16,output=float32"


def parse_args(*extra: str) -> argparse.Namespace:
  """The workers' command line: ``--num-processes``, ``--process-id``, ``--port``, ``--out``."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  for name in extra:
    parser.add_argument(name, type=pathlib.Path, required=True)
  return parser.parse_args()


def start_jax(args: argparse.Namespace) -> None:
  """Starts JAX: 2 CPU devices per process and gloo collectives, or 4 devices alone.

  Compiling dominates the tests' time, so every run compared goes without LLVM's
  optimisations (which change no floating-point result, tests/conftest.py) and with
  XLA:CPU's older kernel emitters, which compile these steps in about a third of the
  time (the same losses, to the last bit).
  """
  local_devices = 2 if args.num_processes > 1 else 4
  os.environ["XLA_FLAGS"] = " ".join(
    [
      f"--xla_force_host_platform_device_count={local_devices}",
      "--xla_backend_optimization_level=0",
      "--xla_cpu_use_fusion_emitters=false",
    ]
  )
  import jax

  jax.config.update("jax_platforms", "cpu")
  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      f"localhost:{args.port}", num_processes=args.num_processes, process_id=args.process_id
    )


def main() -> None:
  args = parse_args("--checkpoint")
  start_jax(args)
  import jax

  jax.config.update("jax_numpy_dtype_promotion", "strict")
  import jax.numpy as jnp
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpx

  assert jax.device_count() == 4, jax.devices()
  policy = mpx.get_policy(POLICY)
  tx = mpx.mixed_precision(optax.sgd(0.05, momentum=0.9), policy)

  def batch_for(step: int, mesh: Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    if step == INF_STEP:
      x[INF_ROW, 2] = np.inf
    sharding = NamedSharding(mesh, P("data"))
    # Each process materialises only the rows its own devices hold.
    seen = []

    def rows(a: np.ndarray):
      def fetch(index):
        seen.append(a[index])
        return a[index]

      return jax.make_array_from_callback(a.shape, sharding, fetch)

    batch = {"x": rows(x), "y": rows(y)}
    batch["finite_here"] = bool(all(np.isfinite(s).all() for s in seen))  # type: ignore[assignment]
    return batch

  def init_params() -> Any:
    rng = np.random.default_rng(1234)
    params = {
      "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
      "b1": np.zeros(HIDDEN),
      "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
    }
    return policy.cast_to_param(jax.tree.map(jnp.asarray, params))

  @functools.cache  # one compilation per mesh
  def make_step(mesh: Mesh):
    replicated = NamedSharding(mesh, P())

    def loss_fn(p, batch):
      p, x = policy.cast_to_compute((p, batch["x"]))
      out = (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]).astype(jnp.float32)
      return jnp.mean((out - batch["y"]) ** 2)

    def step(params, opt_state, batch):
      loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return mpx.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, out_shardings=(replicated, replicated, replicated))

  def train(mesh: Mesh, params, opt_state, steps: range, log: list):
    step = make_step(mesh)
    for i in steps:
      batch = batch_for(i, mesh)
      finite_here = batch.pop("finite_here")
      params, opt_state, loss = step(params, opt_state, batch)
      log.append(
        {
          "step": i,
          "loss_scale": float(mpx.get_loss_scale(opt_state)),
          "skipped_steps": int(opt_state.skipped_steps),
          "finite_here": finite_here,
          "loss": float(loss),
        }
      )
    return params, opt_state

  def place(tree, mesh: Mesh):
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)

  def local_copy(tree) -> dict[str, np.ndarray]:
    # Each process reads its own first replica of every replicated leaf.
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v.addressable_data(0)) for k, v in leaves}

  def target(mesh: Mesh, like):
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), like)

  def restore(mesh: Mesh, like):
    with ocp.StandardCheckpointer() as ckpt:
      return ckpt.restore(args.checkpoint.resolve(), target(mesh, like))

  args.out.mkdir(parents=True, exist_ok=True)
  tag = f"p{args.process_id}" if args.num_processes > 1 else "ref"
  results: dict[str, dict[str, Any]] = {}
  logs: dict[str, list] = {}
  mesh = Mesh(np.array(jax.devices()), ("data",))
  params = place(init_params(), mesh)
  opt_state = tx.init(params)
  logs["train"] = []
  params, opt_state = train(mesh, params, opt_state, range(SAVE_AT), logs["train"])
  state = {"params": params, "opt_state": opt_state}
  if args.num_processes > 1:
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(args.checkpoint.resolve(), state)
      ckpt.wait_until_finished()
  params, opt_state = train(mesh, params, opt_state, range(SAVE_AT, STEPS), logs["train"])
  results["final"] = local_copy({"params": params, "opt_state": opt_state})

  # Resume from the checkpoint the 2-process run saved: on its own mesh (here, or the
  # 4 devices of one process), and on a 2-device mesh of one process.
  meshes = {"resumed": mesh}
  if args.num_processes == 1:
    meshes["resumed_2dev"] = Mesh(np.array(jax.devices()[:2]), ("data",))
  for name, m in meshes.items():
    restored = restore(m, state)
    mpx.check_state(restored["opt_state"], restored["params"], policy)
    logs[name] = []
    p, s = train(m, restored["params"], restored["opt_state"], range(SAVE_AT, STEPS), logs[name])
    results[name] = local_copy({"params": p, "opt_state": s})

  for name, arrays in results.items():
    np.savez(args.out / f"{tag}-{name}.npz", **arrays)
  (args.out / f"{tag}-log.json").write_text(json.dumps(logs))
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
