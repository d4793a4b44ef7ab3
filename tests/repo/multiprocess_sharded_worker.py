"""One process of the sharded multi-process tests (``tests/repo/test_multiprocess.py``); a script.

``--num-processes 2``: one of two JAX processes on localhost (gloo collectives),
2 CPU devices each, 4 in all. ``--num-processes 1`` is the reference: one
process on 4 devices. Either way it trains ``tests/models.LlamaDecoder``
(blocks under ``nn.scan`` over ``nn.remat``) for ``STEPS`` steps under every
layout of ``LAYOUTS`` and every policy of ``POLICIES``, in one go, so the
processes start (and join) once:

* params sharded by ``tests/layouts.llama_specs``, the optimizer state by
  ``mpx.parallel.state_shardings``, the batch rows over ``"data"`` with
  ``jax.make_array_from_process_local_data`` (each process builds only its
  own rows);
* under ``mixed_float16`` the batch of step ``INF_STEP`` carries an inf loss
  weight in row ``INF_ROW``, which process 1 holds in both layouts;
* SGD with momentum, whose update is linear in the gradient: under adam a
  rounding-level difference in a near-zero gradient element (where the
  processes add in another order than one process does) flips its update
  between -lr and +lr, and the runs could not be compared within roundings.

It writes to ``--out`` a JSON log per step and, for each run, the state after
training (and, under ``mixed_float16``, around the inf step) as this
process holds it: every leaf at its global shape, filled where the process
holds a shard, with a mask of the elements it holds.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import multiprocess_worker  # the shared command line and JAX start (same directory)

STEPS = 4
INF_STEP = 2
BATCH, LENGTH = 8, 16
INF_ROW = BATCH - 1  # a row of the last data shard: process 1's in both layouts
# FSDP over the 4 devices; FSDP across the processes with tensor parallelism inside each.
LAYOUTS = {"fsdp": {"data": 4}, "fsdp_tp": {"data": 2, "model": 2}}
POLICIES = ("mixed_bfloat16", "mixed_float16")
MIN_SIZE = 256  # shard every kernel and the embedding; norm scales and biases stay replicated
MODEL: dict[str, Any] = {
  "vocab_size": 64,
  "features": 32,
  "num_heads": 2,
  "num_layers": 2,
  "mlp_hidden": 64,
}


def main() -> None:
  args = multiprocess_worker.parse_args()
  multiprocess_worker.start_jax(args)
  import jax

  jax.config.update("jax_numpy_dtype_promotion", "strict")
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpx

  sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
  import layouts
  import models

  assert jax.device_count() == 4, jax.devices()

  def make_mesh(axes: dict[str, int]) -> Mesh:
    mesh = Mesh(np.array(jax.devices()).reshape(tuple(axes.values())), tuple(axes))
    if "model" in axes:  # the model axis inside a process, the data axis across them
      for row in mesh.devices:
        assert len({d.process_index for d in row}) == 1, mesh.devices
    return mesh

  def batch_for(step: int, mesh: Mesh, inject_inf: bool) -> tuple[dict[str, Any], bool]:
    """The global batch of ``step``; this process builds and passes only its own rows."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, MODEL["vocab_size"], (BATCH, LENGTH + 1), dtype=np.int32)
    weights = np.ones((BATCH, LENGTH), np.float32)  # per-token loss weights
    if inject_inf and step == INF_STEP:
      weights[INF_ROW, 3] = np.inf
    sharding = NamedSharding(mesh, P("data"))
    rows = set()
    for index in sharding.addressable_devices_indices_map(tokens.shape).values():
      assert index is not None
      rows.update(range(*index[0].indices(BATCH)[:2]))
    lo, hi = min(rows), max(rows) + 1
    assert len(rows) == hi - lo, rows  # contiguous
    batch = {
      "tokens": jax.make_array_from_process_local_data(sharding, tokens[lo:hi], tokens.shape),
      "weights": jax.make_array_from_process_local_data(sharding, weights[lo:hi], weights.shape),
    }
    return batch, bool(np.isfinite(weights[lo:hi]).all())

  def held(tree: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """Each leaf at its global shape, filled from this process's shards, and a mask of them.

    Also returns the leaves whose copies on this process's devices differ.
    """
    arrays, differ = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      key = jax.tree_util.keystr(path)
      value, mask = np.zeros(leaf.shape, leaf.dtype), np.zeros(leaf.shape, bool)
      for shard in leaf.addressable_shards:
        data = np.asarray(shard.data)
        if mask[shard.index].any() and value[shard.index].tobytes() != data.tobytes():
          differ.append(key)
        value[shard.index], mask[shard.index] = data, True
      arrays[key], arrays[f"{key}:held"] = value, mask
    return arrays, differ

  def run(
    layout: str, policy_name: str, host_params: Any, log: list, arrays: dict, differ: list
  ) -> None:
    axes = LAYOUTS[layout]
    mesh = make_mesh(axes)
    replicated = NamedSharding(mesh, P())
    policy = mpx.get_policy(policy_name)
    model = mpx.linen.apply_policy(models.LlamaDecoder(**MODEL), policy)
    tx = mpx.mixed_precision(optax.sgd(0.05, momentum=0.9), policy)
    inject_inf = policy.compute_dtype == jnp.float16  # a run with loss scaling skips it

    specs = layouts.llama_specs(host_params, axes, min_size=MIN_SIZE)
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
      host_params,
      param_shardings,
    )
    state_shardings = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), params)

    def loss_fn(params, batch):
      logits = model.apply({"params": params}, batch["tokens"][:, :-1])
      labels = batch["tokens"][:, 1:]
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.mean(losses * batch["weights"])

    def step(params, opt_state, batch):
      loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return mpx.apply_updates(params, updates), opt_state, loss

    snapshots = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's adam as users run it
      opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
      train_step = jax.jit(step, out_shardings=(param_shardings, state_shardings, replicated))
      for i in range(STEPS):
        batch, finite_here = batch_for(i, mesh, inject_inf)
        if inject_inf and i == INF_STEP:
          snapshots["before_inf"] = held({"params": params, "opt_state": opt_state})
        params, opt_state, loss = train_step(params, opt_state, batch)
        entry = {"step": i, "loss": float(loss.addressable_data(0)), "finite_here": finite_here}
        if isinstance(opt_state, mpx.LossScaleState):
          entry["loss_scale"] = float(opt_state.loss_scale.addressable_data(0))
          entry["skipped_steps"] = int(opt_state.skipped_steps.addressable_data(0))
        log.append(entry)
        if inject_inf and i == INF_STEP:
          snapshots["after_inf"] = held({"params": params, "opt_state": opt_state})
    snapshots["final"] = held({"params": params, "opt_state": opt_state})
    for name, (snapshot, bad) in snapshots.items():
      arrays.update({f"{layout}/{policy_name}/{name}/{k}": v for k, v in snapshot.items()})
      differ.extend(bad)

  args.out.mkdir(parents=True, exist_ok=True)
  tag = f"p{args.process_id}" if args.num_processes > 1 else "ref"
  logs: dict[str, Any] = {"differ": []}
  arrays: dict[str, Any] = {}
  # One init for all runs, on the host (no compilation), the same on every process.
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
  shapes = jax.eval_shape(models.LlamaDecoder(**MODEL).init, jax.random.key(0), tokens)
  assert set(shapes) == {"params"}, set(shapes)
  rng = np.random.default_rng(0)

  def init(path: Any, x: jax.ShapeDtypeStruct) -> np.ndarray:
    name = str(getattr(path[-1], "key", path[-1]))
    if name in ("scale", "bias"):
      return np.full(x.shape, 1.0 if name == "scale" else 0.0, x.dtype)
    return (rng.standard_normal(x.shape) / np.sqrt(x.shape[-2])).astype(x.dtype)  # fan-in

  variables = {"params": jax.tree_util.tree_map_with_path(init, shapes["params"])}
  for layout in LAYOUTS:
    for policy_name in POLICIES:
      logs[f"{layout}/{policy_name}"] = []
      run(
        layout,
        policy_name,
        variables["params"],
        logs[f"{layout}/{policy_name}"],
        arrays,
        logs["differ"],
      )
  np.savez(args.out / f"{tag}-sharded.npz", **arrays)
  (args.out / f"{tag}-sharded-log.json").write_text(json.dumps(logs))
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
