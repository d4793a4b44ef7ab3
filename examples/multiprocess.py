"""Mixed-precision data parallelism across processes: JAX's multi-controller runtime.

One Python process per host, each driving its local devices, all joined by
``jax.distributed.initialize`` into one global mesh. Run as a plain script, this
file launches two such processes on this machine (2 CPU devices each, gloo
collectives between them), so the whole multi-host setup runs on a laptop;
on a cluster, start it once per host with ``--process-id`` and
``--coordinator``.

The train step is ``jax.shard_map`` data parallelism: the Flax model under
``mpx.linen.apply_policy``, ``mpx.value_and_grad`` for scaled gradients, and
``mpx.parallel.all_reduce_gradients``, which averages them across every device of every
process in the policy's compute dtype (half the bytes of a float32 all-reduce)
before ``mpx.mixed_precision`` unscales and checks them in float32. At
``--poison-step`` process 1 alone puts an inf into its share of the batch: the
inf reaches every device through the all-reduce, so every process skips that
step (its logged loss is NaN) and halves its loss scale. A policy without
float16 has no loss scaling, hence no check and no skip, so no inf is sent
then. At the end every process checks that all processes hold bitwise the same
params (``multihost_utils.assert_equal``). It exits with status 1 if a process
fails, the poisoned step was not skipped everywhere, or the final loss is not
finite.

Run: ``python examples/multiprocess.py`` (``--smoke`` for a few steps), or on
each of N hosts ``python examples/multiprocess.py --num-processes N
--process-id I --coordinator HOST0:PORT``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

LOCAL_DEVICES = 2  # per process, when this script launches its own processes on CPU


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--process-id", type=int, help="this process; omit to launch all locally")
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument("--coordinator", help="HOST:PORT of process 0 (chosen for local launches)")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--smoke", action="store_true", help="a few steps, for a quick check")
  parser.add_argument(
    "--poison-step", type=int, default=20, help="process 1 sends an inf here (0: never)"
  )
  parser.add_argument("--policy", default="mixed_float16", help="e.g. mixed_bfloat16")
  parser.add_argument("--batch-size", type=int, default=64, help="global batch")
  parser.add_argument("--log-every", type=int, default=20)
  parser.add_argument("--timeout", type=float, default=300, help="seconds, for local launches")
  args = parser.parse_args()
  if args.smoke:
    args.steps, args.poison_step, args.log_every = 6, 2, 2
  return args


def launch_locally(args: argparse.Namespace) -> int:
  """Starts ``--num-processes`` copies of this script on CPU; returns the exit status."""
  with socket.socket() as s:  # a free port, so parallel runs do not collide
    s.bind(("localhost", 0))
    coordinator = f"localhost:{s.getsockname()[1]}"
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
  )
  procs = [  # the flags given last win: each child gets its id and the coordinator
    subprocess.Popen(
      [
        sys.executable,
        __file__,
        *sys.argv[1:],
        "--process-id",
        str(i),
        "--coordinator",
        coordinator,
      ],
      env=env,
    )
    for i in range(args.num_processes)
  ]
  deadline = time.monotonic() + args.timeout
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    if any(p.poll() not in (None, 0) for p in procs):
      break  # one failed: the others would wait for it forever
    time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  codes = [p.returncode for p in procs]
  if codes != [0] * len(procs):
    print(f"processes exited with {codes} (timeout {args.timeout} s)", file=sys.stderr)
    return 1
  return 0


def train(args: argparse.Namespace) -> int:
  """One process of the run: joins the others, trains, checks; returns the exit status."""
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
  jax.distributed.initialize(
    args.coordinator, num_processes=args.num_processes, process_id=args.process_id
  )
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import linen as nn
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from sklearn.datasets import load_digits

  import mpx

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

  me, n_proc = jax.process_index(), jax.process_count()
  log = print if me == 0 else (lambda *a, **k: None)
  mesh = Mesh(np.array(jax.devices()), ("data",))  # every device of every process
  if args.batch_size % jax.device_count():
    log(f"--batch-size must be a multiple of the {jax.device_count()} devices")
    return 1
  policy = mpx.get_policy(args.policy)
  if jnp.float16 not in (policy.compute_dtype, policy.param_dtype) and args.poison_step:
    # loss_scale="dynamic" scales float16 only; bfloat16 and float32 runs neither check nor skip.
    log(f"policy {policy} has no loss scaling, hence no skip: not sending an inf")
    args.poison_step = 0
  model = mpx.linen.apply_policy(Mlp(), policy)
  digits: Any = load_digits()
  x_all = (digits.data / 16.0).astype(np.float32)
  y_all = digits.target.astype(np.int32)

  params = model.init(jax.random.key(0), x_all[:1])["params"]  # the same seed everywhere
  tx = mpx.mixed_precision(optax.adam(1e-3), policy)
  replicated = NamedSharding(mesh, P())
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)

  def local_step(params, opt_state, x, y):
    def loss_fn(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # Varying params: each device takes the gradients of its own shard of the batch...
    local = jax.lax.pcast(params, "data", to="varying")
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(local)
    # ...and one all-reduce averages them over every device, in the compute dtype.
    grads = mpx.parallel.all_reduce_gradients(grads, "data", reduce_dtype=policy.compute_dtype)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam under strict promotion
      updates, opt_state = tx.update(grads, opt_state, params)
    params = mpx.apply_updates(params, updates)
    return params, opt_state, jax.lax.pmean(loss, "data")

  step = jax.jit(
    jax.shard_map(
      local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P())
    ),
    donate_argnums=(0, 1),
  )
  batch_sharding = NamedSharding(mesh, P("data"))
  local_rows = args.batch_size // n_proc
  rng = np.random.default_rng(1)  # the same order everywhere; each process takes its rows
  skipped_at_poison = None
  loss = jnp.nan
  log(f"{n_proc} processes, {jax.device_count()} devices, policy {policy}")
  log(f"{'step':>5} {'loss':>8} {'scale':>8} {'skipped':>7}")
  for i in range(1, args.steps + 1):
    rows = rng.choice(len(y_all), args.batch_size, replace=False)
    mine = rows[me * local_rows : (me + 1) * local_rows]
    x, y = x_all[mine].copy(), y_all[mine]
    if i == args.poison_step and me == 1:
      x[0, 0] = np.inf  # in process 1's rows only
    x = jax.make_array_from_process_local_data(batch_sharding, x)
    y = jax.make_array_from_process_local_data(batch_sharding, y)
    before = int(opt_state.skipped_steps)
    params, opt_state, loss = step(params, opt_state, x, y)
    if i == args.poison_step:
      skipped_at_poison = int(opt_state.skipped_steps) == before + 1
    if i % args.log_every == 0 or i == args.steps:
      metrics = mpx.loss_scale_metrics(opt_state)
      log(
        f"{i:>5} {float(loss):>8.4f} {float(metrics['loss_scale']):>8.0f} "
        f"{int(metrics['skipped_steps']):>7}"
      )

  # Every process must hold bitwise the same params: compare them across processes.
  leaves = [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(params)]
  fingerprint = np.frombuffer(b"".join(leaf.tobytes() for leaf in leaves), np.uint8)
  multihost_utils.assert_equal(fingerprint, "params differ between processes")
  poisoned = 0 < args.poison_step <= args.steps
  everywhere = multihost_utils.process_allgather(np.asarray(bool(skipped_at_poison)))
  skipped_everywhere = bool(np.all(everywhere))
  if poisoned:
    log(
      f"step {args.poison_step} (an inf in process 1's rows) skipped on every process: "
      f"{skipped_everywhere}"
    )
  ok = bool(np.isfinite(float(loss))) and (not poisoned or skipped_everywhere)
  log("params bitwise equal on every process")
  jax.distributed.shutdown()
  return 0 if ok else 1


def main() -> int:
  args = parse_args()
  if args.process_id is None:
    return launch_locally(args)
  if args.coordinator is None:
    print("--process-id needs --coordinator HOST:PORT", file=sys.stderr)
    return 2
  return train(args)


if __name__ == "__main__":
  sys.exit(main())
