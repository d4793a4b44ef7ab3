"""The scale-out plan: Llama 1B and 8B train steps compiled for 8 and 16 H100s, per layout and policy.

For each (model, target, policy, layout), compiles (never runs) one adamw train step of
``llama.Llama`` for the GPU target with jax's CUDA plugin, deviceless: no GPU is used and no
autotuning runs, so every kernel is XLA's default choice. The layouts:

* ``fsdp``: every GPU on one mesh axis ``"data"``; the batch and each matrix's model-width
  axis are split over it (ZeRO-3 / FSDP: weights all-gathered where used, gradients
  reduce-scattered).
* ``fsdp_tp``: tensor parallelism over ``"model"`` (8, the GPUs of one host) and FSDP over
  ``"data"`` (the hosts).
* ``hsdp`` (several hosts only): FSDP within each host over ``"data"``, the hosts replicas of
  each other over ``"replica"`` (hybrid sharding: the batch is split over both axes, and only
  the gradients of each GPU's shard cross hosts, all-reduced).

The params are placed by their logical axes (``nn.with_logical_partitioning`` in ``llama.py``,
mapped with ``nn.logical_to_mesh_sharding`` and ``llama.RULES``) and the optimizer state
(adamw's moments, like the params) by ``mpx.parallel.state_shardings``. Every layout runs the same
global batch, ``--batch-per-gpu`` sequences of ``--seq`` tokens per GPU.

Each row reads from the compiled program: XLA's buffer assignment per GPU
(``compiled.memory_analysis()``) against the GPU's memory; every collective, by kind and dtype,
with the bytes each GPU sends per step (a collective in the ``nn.scan`` loop body counts once
per layer: ``mpx._src.audit.compiled`` multiplies by the loop's known trip count), its group
size and whether its group spans hosts; the matmul FLOPs the program executes (``nn.remat``
recomputes the forward) and the model's FLOPs (6 N per token plus attention, for the MFU).
XLA's ``cost_analysis()`` gives no figures for a deviceless GPU compile, so the FLOPs are
counted from the program's products and from the formula.

The step time is a roofline model, not a measurement (see :data:`TIME_NOTE`). Prints a
Markdown table and writes ``results/scaling/scaling_plan.json`` (``--smoke``: a tiny model on
``h100x8``, ``results/scaling/scaling_plan_smoke.json``; ``--out`` for another path).

Usage::

  JAX_PLATFORMS=cpu python benchmarks/scaling_plan.py [--smoke] [--models llama_1b ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import re
import sys
import time
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import spmd
from harness import deviceless, llama, results
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpx
from mpx._src.audit import compiled as compiled_lib
from mpx._src.audit import device_peaks, targets
from mpx._src.audit import roofline as roofline_lib
from mpx._src.audit import target_report as target_report_lib

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "scaling"
MODELS = {c.name: c for c in (llama.LLAMA_1B, llama.LLAMA_8B, llama.TINY)}
TARGETS = ("h100x8", "2xh100x8")
POLICIES = ("mixed_bfloat16", "mixed_float16", "mixed_float8")
LAYOUTS = ("fsdp", "fsdp_tp", "hsdp")
TP = 8  # tensor parallelism within one host of 8 GPUs

#: Bytes per second each GPU sends (and receives) in a collective: NVLink 4 within a host,
#: one 400 Gb/s InfiniBand NIC per GPU across hosts.
NVLINK_BYTES_PER_S = 450e9
IB_BYTES_PER_S = 50e9

NOTE = (
  "deviceless compile: no GPU was used and no autotuning ran (kernel choices are XLA's "
  "defaults); memory is XLA's buffer assignment for the GPU, not a measured peak"
)
COMM_NOTE = (
  "collective time per GPU = factor x bytes / bandwidth, bytes being what the collective's "
  "operands hold on one GPU: all-gather (g - 1), reduce-scatter and all-to-all (g - 1) / g, "
  "all-reduce 2 (g - 1) / g, collective-permute 1, for a group of g GPUs (a ring); bandwidth "
  f"{NVLINK_BYTES_PER_S / 1e9:g} GB/s per direction (NVLink 4) when the group is within a "
  f"host, {IB_BYTES_PER_S / 1e9:g} GB/s (400 Gb/s InfiniBand per GPU) when it spans hosts"
)
TIME_NOTE = (
  "roofline model, not a measurement: compute = sum over kernels of max(FLOPs / dense peak "
  "for the operand dtype (H100 SXM: bf16/f16 989, fp8 1979 TFLOP/s), bytes / HBM bandwidth); "
  "step time between max(compute, communication) (every collective hidden behind compute) "
  "and compute + communication (none hidden); ignores kernel efficiency, launch overhead, "
  "autotuning and how much overlap XLA's scheduler achieves"
)
MFU_NOTE = (
  "MFU = model FLOPs / (step time x GPUs x 989 TFLOP/s, the bf16 dense peak, also for fp8 "
  "rows); model FLOPs = tokens x (6 N + 12 L T d), N the params without the input "
  "embedding, L layers, T the sequence length, d the width (PaLM's formula, attention not "
  "halved for the causal mask, as the program computes it)"
)


# ------------------------------------------------------------------ the step


def _mesh(target: targets.Target, layout: str) -> Mesh:
  devices = np.array(targets.devices(target))  # host-major
  if layout == "fsdp":
    return Mesh(devices, ("data",))
  if layout == "hsdp":
    if target.hosts == 1:
      raise ValueError(f"hsdp needs several hosts, not {target}")
    return Mesh(devices.reshape(target.hosts, target.gpus_per_host), ("replica", "data"))
  if target.gpus_per_host % TP:
    raise ValueError(f"fsdp_tp needs hosts of {TP} GPUs, not {target}")
  return Mesh(devices.reshape(target.num_devices // TP, TP), ("data", "model"))


def _sharded(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def compile_step(
  config: llama.LlamaConfig,
  policy: str,
  mesh: Mesh,
  *,
  seq: int,
  batch_per_gpu: int,
) -> tuple[Any, Any]:
  """Compiles one adamw train step of ``config`` under ``policy`` on ``mesh``.

  Args:
    config: the model.
    policy: an mpx policy name.
    mesh: the mesh (``"data"``, or ``"data"`` and ``"model"``) of target devices.
    seq: tokens per sequence.
    batch_per_gpu: sequences per GPU; the global batch is this times the GPUs.

  Returns:
    ``(compiled, params)``: the compiled step and the params as ``ShapeDtypeStruct``\\ s with
    their shardings.
  """
  model = mpx.linen.apply_policy(llama.Llama(config), policy)
  tokens = jax.ShapeDtypeStruct((batch_per_gpu * mesh.size, seq + 1), jnp.int32)
  inputs = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), inputs)["params"]
  batch_axes = tuple(a for a in ("replica", "data") if a in mesh.axis_names)
  rules = [
    (name, batch_axes if name == "batch" else axis if axis in mesh.axis_names else None)
    for name, axis in llama.RULES
  ]
  shardings = spmd.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  params = _sharded(nn.meta.unbox(boxed), shardings)
  tx = mpx.mixed_precision(optax.adamw(1e-4), policy)
  opt_state = jax.eval_shape(tx.init, params)
  opt_state = _sharded(opt_state, mpx.parallel.state_shardings(opt_state, params))

  def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates), opt_state, loss

  tokens = jax.ShapeDtypeStruct(
    tokens.shape, tokens.dtype, sharding=NamedSharding(mesh, P(batch_axes))
  )
  with (
    jax.set_mesh(mesh),
    nn.logical_axis_rules(rules),
    jax.numpy_dtype_promotion("standard"),
    warnings.catch_warnings(),
  ):
    warnings.simplefilter("ignore")  # XLA's sharding warnings are in its log, not here
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
  return compiled, params


# ------------------------------------------------------------------ reading the program


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective instruction, from its HLO attributes.

  Args:
    attrs: the instruction's attributes (``replica_groups=...`` in any of HLO's three forms:
      listed, iota, mesh axes; or ``source_target_pairs=...`` for a collective-permute).
    num_devices: the program's devices (no groups listed means one group of all).

  Returns:
    The groups, as lists of device positions in the program's device assignment.
  """
  axes = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
    attrs,
  )
  if axes:  # the mesh form: mesh['axis_0'=8,'axis_1'=2], device_ids=([2,8]T(1,0)) {'axis_0'}
    names = re.findall(r"'([^']+)'=(\d+)", axes.group(1))
    sizes = [int(size) for _, size in names]
    dims = [int(d) for d in axes.group(2).split(",")] if axes.group(2) else [math.prod(sizes)]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if axes.group(3):
      ids = ids.transpose(tuple(int(d) for d in axes.group(3).split(",")))
    ids = ids.reshape(sizes)
    chosen = [i for i, (name, _) in enumerate(names) if f"'{name}'" in axes.group(4)]
    rest = [i for i in range(len(names)) if i not in chosen]
    group = math.prod(sizes[i] for i in chosen)
    return ids.transpose(rest + chosen).reshape(-1, group).tolist()
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if iota:
    shape, dims = (tuple(int(d) for d in g.split(",")) for g in iota.groups()[:2])
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose(tuple(int(d) for d in iota.group(3).split(",")))
    return ids.reshape(shape).tolist()
  listed = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", attrs)
  if listed and listed.group(1):
    return [
      [int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
    ]
  if listed is None and "replica_groups=" in attrs:  # a form this reader does not know
    raise ValueError(f"cannot read the replica groups of {attrs[:300]!r}")
  return [list(range(num_devices))]


_FACTORS = {
  "all-gather": lambda g: g - 1,
  "reduce-scatter": lambda g: (g - 1) / g,
  "all-to-all": lambda g: (g - 1) / g,
  "all-reduce": lambda g: 2 * (g - 1) / g,
  "collective-permute": lambda g: 1.0,
  "ragged-all-to-all": lambda g: (g - 1) / g,
}


def collective_rows(text: str, target: targets.Target) -> list[dict[str, Any]]:
  """The collectives of a compiled step grouped by kind, dtype, group size and reach.

  Args:
    text: ``compiled.as_text()``.
    target: the target it was compiled for.

  Returns:
    One dict per (kind, dtype, group size, across hosts): ``count`` (executions per step),
    ``bytes`` (per GPU per step, loop bodies once per iteration) and ``model_ms`` (see
    :data:`COMM_NOTE`), largest ``model_ms`` first.
  """
  found = [
    (c, replica_groups(instr["attrs"], target.num_devices))
    for instr, parts in compiled_lib.collectives_by_instruction(text)
    for c in parts
  ]
  rows: dict[tuple[str, str, int, bool], dict[str, Any]] = {}
  for c, group in found:
    size = max(len(g) for g in group)
    across = any(len({d // target.gpus_per_host for d in g}) > 1 for g in group)
    if size == 1:  # a no-op group (a device with itself)
      continue
    key = (c["kind"], np.dtype(c["dtype"]).name, size, across)
    row = rows.setdefault(
      key,
      {
        "kind": key[0],
        "dtype": key[1],
        "group_size": size,
        "across_hosts": across,
        "count": 0,
        "bytes": 0,
        "model_ms": 0.0,
      },
    )
    nbytes = c["bytes"] * c["count"]
    row["count"] += c["count"]
    row["bytes"] += nbytes
    bandwidth = IB_BYTES_PER_S if across else NVLINK_BYTES_PER_S
    row["model_ms"] += 1e3 * _FACTORS[c["kind"]](size) * nbytes / bandwidth
  return sorted(rows.values(), key=lambda r: -r["model_ms"])


def compute_roofline(text: str, device_kind: str, policy: str) -> dict[str, Any]:
  """The compute side of the roofline: each kernel at ``max(FLOPs / peak, bytes / bandwidth)``.

  The model of ``mpx._src.audit.roofline`` (its operand classes and the target's HBM bandwidth), with
  the collectives left out (modelled apart, :func:`collective_rows`) and the memory-bound time of
  the attention's kernels (XLA's unfused softmax over the ``T x T`` scores) reported apart.

  Args:
    text: ``compiled.as_text()``.
    device_kind: the target's device kind (its peaks: ``device_peaks``).
    policy: the policy (``f32_highest`` takes the float32 peak for float32 operands).

  Returns:
    ``ms``, ``compute_bound_ms``, ``memory_bound_ms``, ``attention_memory_bound_ms`` and
    ``matmul_flops`` (per GPU per step, by operand class).
  """
  name = device_peaks.device_name(device_kind)
  if name is None:
    raise ValueError(f"no peaks known for {device_kind}")
  peaks, bandwidth = device_peaks.PEAK_TFLOPS[name], roofline_lib.memory_bandwidth("h100")
  flops: dict[str, dict[str, float]] = {}  # kernel -> operand class -> FLOPs per step
  by_class: collections.Counter[str] = collections.Counter()
  for g in compiled_lib.gemms(text):
    gemm = target_report_lib.TargetGemm(**g)
    cls = roofline_lib.operand_class(gemm, float32_peak=policy == "f32_highest")
    per = flops.setdefault(gemm.kernel, {})
    per[cls] = per.get(cls, 0.0) + gemm.flops
    by_class[cls] += gemm.flops
  compute = memory = attention = 0.0
  for k in compiled_lib.kernels(text):
    if k["kind"].removesuffix("-start") in compiled_lib.COLLECTIVES:
      continue
    t_mem = k["bytes"] * k["count"] / bandwidth
    t_flop = sum(f / (peaks[c] * 1e12) for c, f in flops.get(k["name"], {}).items())
    if t_flop > t_mem:
      compute += t_flop
    else:
      memory += t_mem
      attention += t_mem if "/attention/" in k["op_name"] else 0.0
  return {
    "ms": 1e3 * (compute + memory),
    "compute_bound_ms": 1e3 * compute,
    "memory_bound_ms": 1e3 * memory,
    "attention_memory_bound_ms": 1e3 * attention,
    "peaks_tflops": {"device": name, **peaks},
    "memory_bandwidth_bytes_per_s": bandwidth,
    "matmul_flops": dict(by_class),
  }


def model_flops(config: llama.LlamaConfig, tokens: int, seq: int) -> float:
  """Training FLOPs of one step: ``tokens (6 N + 12 L T d)`` (see :data:`MFU_NOTE`)."""
  n = config.param_count - config.vocab_size * config.features  # the embedding lookup is free
  return tokens * (6 * n + 12 * config.num_layers * seq * config.features)


def row(
  model: str, target_name: str, policy: str, layout: str, *, seq: int, batch_per_gpu: int
) -> dict[str, Any]:
  """Compiles one (model, target, policy, layout) and returns its row (JSON-ready)."""
  start = time.perf_counter()
  config = MODELS[model]
  target = targets.parse(target_name)
  mesh = _mesh(target, layout)
  compiled, params = compile_step(config, policy, mesh, seq=seq, batch_per_gpu=batch_per_gpu)
  text = compiled.as_text()
  device_kind = str(mesh.devices.flat[0].device_kind)
  stats = compiled.memory_analysis()
  memory = {
    "argument_bytes": int(stats.argument_size_in_bytes),
    "output_bytes": int(stats.output_size_in_bytes),
    "alias_bytes": int(stats.alias_size_in_bytes),
    "temp_bytes": int(stats.temp_size_in_bytes),
  }
  total = (
    memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]
  )
  capacity = int(re.search(r"device_memory_size:\s*(\d+)", targets.spec_text(target.gpu)).group(1))  # pyright: ignore[reportOptionalMemberAccess]
  memory.update(
    total_bytes=total,
    device_bytes=capacity,
    fits=total <= capacity,
    headroom_bytes=capacity - total,
  )
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  collectives = collective_rows(text, target)
  roof = compute_roofline(text, device_kind, policy)
  comm_ms = sum(c["model_ms"] for c in collectives)
  tokens = batch_per_gpu * target.num_devices * seq
  flops = model_flops(config, tokens, seq)
  peak = device_peaks.PEAK_TFLOPS[roof["peaks_tflops"]["device"]]["half"] * 1e12
  overlapped, serial = max(roof["ms"], comm_ms), roof["ms"] + comm_ms
  return {
    "model": model,
    "target": str(target),
    "policy": policy,
    "layout": layout,
    "mesh": dict(mesh.shape),
    "device_kind": device_kind,
    "num_devices": target.num_devices,
    "hosts": target.hosts,
    "seq": seq,
    "batch_per_gpu": batch_per_gpu,
    "global_batch": batch_per_gpu * target.num_devices,
    "tokens_per_step": tokens,
    "param_count": sum(x.size for x in jax.tree.leaves(params)),
    "param_bytes": param_bytes,
    "memory": memory,
    "collectives": collectives,
    "flops": {
      "model": flops,
      "model_per_gpu": flops / target.num_devices,
      "matmul_executed_per_gpu": sum(roof["matmul_flops"].values()),
      "matmul_executed_by_class": roof.pop("matmul_flops"),
    },
    "time": {
      "compute_ms": roof["ms"],
      "compute_bound_ms": roof["compute_bound_ms"],
      "memory_bound_ms": roof["memory_bound_ms"],
      "attention_memory_bound_ms": roof["attention_memory_bound_ms"],
      "comm_ms": comm_ms,
      "comm_across_hosts_ms": sum(c["model_ms"] for c in collectives if c["across_hosts"]),
      "step_ms_overlapped": overlapped,
      "step_ms_serial": serial,
      "mfu_overlapped": flops / (overlapped * 1e-3 * target.num_devices * peak),
      "mfu_serial": flops / (serial * 1e-3 * target.num_devices * peak),
    },
    "seconds": time.perf_counter() - start,
  }


# ------------------------------------------------------------------ the table


def fused_attention_estimate(r: dict[str, Any]) -> dict[str, float]:
  """The step time and MFU with the attention's memory-bound kernels taken out, overlapped.

  What a fused (flash) attention kernel would leave: its products stay (they are in the
  GEMM time), the ``T x T`` scores are never written to memory. A bound, not a kernel's time.
  """
  t = r["time"]
  ms = max(t["compute_ms"] - t["attention_memory_bound_ms"], t["comm_ms"])
  return {"step_ms": ms, "mfu": t["mfu_overlapped"] * t["step_ms_overlapped"] / ms}


def _gib(x: float) -> str:
  return f"{x / 2**30:,.1f}"


def _dtype(name: str) -> str:
  return deviceless._dtype(name)  # pyright: ignore[reportPrivateUsage]


def comm_cell(r: dict[str, Any]) -> str:
  """``all-gather bf16 x16 IB 12.0 GiB`` per kind, dtype, group size and link, largest first."""
  parts = []
  for c in r["collectives"]:
    if c["bytes"] < 2**20:
      continue
    link = "IB" if c["across_hosts"] else "NVL"
    parts.append(f"{c['kind']} {_dtype(c['dtype'])} /{c['group_size']} {link} {_gib(c['bytes'])}")
  return ", ".join(parts) or "-"


def format_table(rows: list[dict[str, Any]]) -> str:
  """The Markdown table of a run, with its notes."""
  lines = [
    "| model | target | policy | layout | args GiB | temp GiB | total GiB | fits 79.1 GiB "
    "(headroom) | collectives per GPU per step (kind, dtype, /group, link, GiB; >= 1 MiB) "
    "| GEMM ms | other ms (attention) | comm ms (IB) | step ms | MFU | fused attention: ms, MFU |",
    "|---|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(
        f"| {r['model']} | {r['target']} | {r['policy']} | {r['layout']} | error: {r['error']} |"
      )
      continue
    m, t, fused = r["memory"], r["time"], fused_attention_estimate(r)
    fits = (
      f"yes ({_gib(m['headroom_bytes'])})" if m["fits"] else f"NO ({_gib(m['headroom_bytes'])})"
    )
    lines.append(
      f"| {r['model']} | {r['target']} | {r['policy']} | {r['layout']} "
      f"| {_gib(m['argument_bytes'])} | {_gib(m['temp_bytes'])} | {_gib(m['total_bytes'])} "
      f"| {fits} | {comm_cell(r)} | {t['compute_bound_ms']:,.0f} "
      f"| {t['memory_bound_ms']:,.0f} ({t['attention_memory_bound_ms']:,.0f}) "
      f"| {t['comm_ms']:,.0f} ({t['comm_across_hosts_ms']:,.0f}) "
      f"| {t['step_ms_overlapped']:,.0f}-{t['step_ms_serial']:,.0f} "
      f"| {100 * t['mfu_serial']:.0f}-{100 * t['mfu_overlapped']:.0f}% "
      f"| {fused['step_ms']:,.0f}, {100 * fused['mfu']:.0f}% |"
    )
  ok = [r for r in rows if "error" not in r]
  if ok:
    r = ok[0]
    lines += [
      "",
      f"* {r['device_kind']}; {r['seq']}-token sequences, {r['batch_per_gpu']} per GPU in "
      "every layout (the same global batch). " + NOTE + ".",
      "* Memory per GPU: arguments (params, optimizer state, batch), temporaries; total = "
      "arguments + outputs not aliased to a donated argument + temporaries.",
      "* Collectives: bytes per GPU per step; a loop body's collectives count once per layer "
      "(the loop's known trip count). " + COMM_NOTE + ".",
      "* GEMM ms: kernels bound by their FLOPs; other ms: kernels bound by their bytes "
      "(attention: those of the attention, XLA's unfused softmax over the T x T scores).",
      "* Step ms: " + TIME_NOTE + ".",
      "* Fused attention: max(compute - the attention's memory-bound ms, communication), the "
      "step if a flash attention kernel never wrote the scores to memory (a bound).",
      "* MFU: " + MFU_NOTE + ".",
    ]
  return "\n".join(lines)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument(
    "--smoke", "--quick", action="store_true", help="a tiny Llama on h100x8, FSDP, mixed_float8"
  )
  parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
  parser.add_argument("--targets", nargs="+", default=None)
  parser.add_argument("--policies", nargs="+", default=None)
  parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=None)
  parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (4096)")
  parser.add_argument("--batch-per-gpu", type=int, default=None, help="sequences per GPU (2)")
  parser.add_argument("--out", help="JSON path (default results/scaling/scaling_plan[_smoke].json)")
  parser.add_argument(
    "--keep", action="store_true", help="keep the rows of --out that this run does not redo"
  )
  args = parser.parse_args(argv)
  if args.smoke:
    models, target_names = args.models or ["tiny"], args.targets or ["h100x8"]
    policies = args.policies or ["mixed_float8"]
    layouts, seq, batch = args.layouts or ["fsdp"], args.seq or 64, args.batch_per_gpu or 2
  else:
    models, target_names = args.models or ["llama_1b", "llama_8b"], args.targets or list(TARGETS)
    policies, layouts = args.policies or list(POLICIES), args.layouts or list(LAYOUTS)
    seq, batch = args.seq or 4096, args.batch_per_gpu or 2
  if not targets.plugin_available():
    print("jax's CUDA plugin is missing: run python -m mpx.gpu_target", file=sys.stderr)
    return 2
  out = pathlib.Path(args.out or RESULTS / f"scaling_plan{'_smoke' if args.smoke else ''}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  jobs = [
    (m, t, p, lay)
    for m in models
    for t in target_names
    for lay in layouts
    for p in policies
    if lay != "hsdp" or targets.parse(t).hosts > 1  # one host: hsdp is fsdp
  ]
  command = "JAX_PLATFORMS=cpu python benchmarks/scaling_plan.py " + " ".join(
    argv if argv is not None else sys.argv[1:]
  )
  kept, commands = [], [command]
  if args.keep and out.exists():
    redo = set(jobs)
    previous = json.loads(out.read_text())
    kept = [
      r for r in previous["rows"] if (r["model"], r["target"], r["policy"], r["layout"]) not in redo
    ]
    commands = previous.get("commands", [previous.get("command")]) + commands
    models = list(dict.fromkeys([*previous["models"], *models]))
  report: dict[str, Any] = {
    **results.header("scaling_plan", env="JAX_PLATFORMS=cpu"),
    "commands": commands,  # with --keep, the runs whose rows were kept, then this one
    "smoke": args.smoke,
    "note": NOTE,
    "comm_note": COMM_NOTE,
    "time_note": TIME_NOTE,
    "mfu_note": MFU_NOTE,
    "measured_step_times": "none: no GPU was used; the step times are a model",
    "models": {m: vars(MODELS[m]) | {"param_count": MODELS[m].param_count} for m in models},
    "rows": kept,
  }
  start = time.perf_counter()
  for model, target_name, policy, layout in jobs:
    print(f"compiling {model} {target_name} {policy} {layout} ...", flush=True)
    try:
      result = row(model, target_name, policy, layout, seq=seq, batch_per_gpu=batch)
    except Exception as e:  # one failed compile is a row, not the end of the run
      result = {"model": model, "target": target_name, "policy": policy, "layout": layout}
      result["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    print(f"  {result.get('seconds', 0):.0f} s", flush=True)
    report["rows"].append(result)
    report["seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(report, indent=2) + "\n")  # after each row: a long run keeps its rows
  print(format_table(report["rows"]))
  print(f"{len(jobs)} rows in {report['seconds']:.0f} s; JSON: {out}")
  return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
  sys.exit(main())
