"""The gradient all-reduce in the compute dtype (``mpx.parallel.all_reduce_gradients``) against float32.

The demo's character-level transformer (``python -m mpx.demo``) trained
data-parallel under ``jax.shard_map`` on 4 forced CPU devices, once with the
gradients averaged in float32 and once in the policy's compute dtype, for
``mixed_float16`` and ``mixed_bfloat16``. Reports, per run:

* from the compiled HLO (and, for bfloat16, the lowered HLO, since XLA:CPU
  carries a bfloat16 all-reduce out in float32): the dtype of the gradient
  all-reduce and the bytes of its operands;
* the accuracy cost: final training and validation loss, skipped steps, and the
  relative L2 distance of the final params from the float32-reduction run.

Usage: ``python benchmarks/half_all_reduce.py [--steps 60] [--quick] [--out FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import sys
import time

DEVICES = 4
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from harness import results  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpx  # noqa: E402
import mpx.demo as demo  # noqa: E402

DEFAULT_OUT = pathlib.Path(__file__).parent / "results" / "half_all_reduce.json"
_SHAPE = re.compile(r"\b(f16|bf16|f32)\[([0-9,]*)\]")
_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
_CONFIGS = {config.name: config for config in demo.CONFIGS}


def all_reduce_operands(hlo: str) -> list[tuple[str, int]]:
  """``(dtype, bytes)`` of every all-reduce operand in an HLO module's text.

  Args:
    hlo: ``lowered.as_text(dialect="hlo")`` or ``compiled.as_text()``.

  Returns:
    One entry per operand (an all-reduce's result shapes are its operands').
  """
  found = []
  for line in hlo.splitlines():
    if "all-reduce(" not in line and "all-reduce-start(" not in line:
      continue
    result = line.split("=", 1)[1].split("all-reduce", 1)[0]
    for dtype, dims in _SHAPE.findall(result):
      size = int(np.prod([int(d) for d in dims.split(",") if d]))
      found.append((dtype, _BYTES[dtype] * size))
  return found


def _gradient_bytes(found: list[tuple[str, int]]) -> dict[str, int]:
  by_dtype: dict[str, int] = {}
  for dtype, size in found:
    if size > 4:  # scalars: the loss
      by_dtype[dtype] = by_dtype.get(dtype, 0) + size
  return by_dtype


def run(config_name: str, reduce_dtype: str, settings: demo.Settings, data, mesh) -> dict:
  """Trains one configuration with one reduction dtype; returns its figures and params."""
  config = _CONFIGS[config_name]
  model = mpx.linen.apply_policy(demo.CharTransformer(settings.model), config.policy)
  tx = demo.make_optimizer(config, settings)
  params = model.init(jax.random.key(settings.seed), data.train[0, :, :-1])["params"]
  replicated = NamedSharding(mesh, P())
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  global_tokens = float(settings.global_batch_tokens)

  def local_step(params, opt_state, windows):
    def objective(p):
      logits = model.apply({"params": p}, windows[:, :-1])
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
      return losses.sum() / global_tokens, losses.mean()

    varying = jax.lax.pcast(params, "data", to="varying")
    (_, loss), grads = mpx.value_and_grad(objective, opt_state, has_aux=True)(varying)
    grads = mpx.parallel.all_reduce_gradients(grads, "data", reduce_dtype=reduce_dtype)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam under strict promotion
      updates, opt_state = tx.update(grads, opt_state, params)
    params = mpx.apply_updates(params, updates)
    return params, opt_state, jax.lax.pmean(loss, "data")

  step = jax.jit(
    jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())),
    donate_argnums=(0, 1),
  )
  batch_sharding = NamedSharding(mesh, P("data"))
  first = jax.device_put(data.train[0], batch_sharding)
  lowered = step.lower(params, opt_state, first)
  compiled = lowered.compile()
  hlo = {
    "lowered": _gradient_bytes(all_reduce_operands(str(lowered.as_text(dialect="hlo")))),
    "compiled": _gradient_bytes(all_reduce_operands(str(compiled.as_text()))),
  }
  losses, start = [], time.perf_counter()
  for i in range(settings.steps):
    params, opt_state, loss = step(params, opt_state, jax.device_put(data.train[i], batch_sharding))
    losses.append(float(loss))
  evaluate = jax.jit(
    lambda p: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p}, data.valid[:, :-1]), data.valid[:, 1:]
    ).mean()
  )
  return {
    "config": config_name,
    "reduce_dtype": reduce_dtype,
    "gradient_all_reduce_bytes": hlo,
    "final_train_loss_last5": float(np.mean(losses[-5:])),
    "valid_loss": float(evaluate(params)),
    "skipped_steps": int(mpx.loss_scale_metrics(opt_state)["skipped_steps"]),
    "seconds": time.perf_counter() - start,
    "params": jax.device_get(params),
  }


def _relative_l2(a, b) -> float:
  num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in zip(a, b, strict=True))
  den = sum(float(np.sum(np.float64(y) ** 2)) for y in b)
  return float(np.sqrt(num / den))


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--quick", action="store_true", help="the demo's --quick model")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args()
  if jax.device_count() != DEVICES:
    sys.exit(f"needs {DEVICES} devices, got {jax.device_count()}; unset XLA_FLAGS")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  base = demo.QUICK_SETTINGS if args.quick else demo.DEFAULT_SETTINGS
  settings = dataclasses.replace(base, steps=args.steps)
  # The local batch is the demo's; the 4 devices together see 4 times as many tokens
  # (the validation windows are the demo's: a longer draw starts with the same ones).
  global_batch = dataclasses.replace(settings, batch_size=settings.batch_size * DEVICES)
  data = demo.make_data(global_batch, demo.load_corpus())
  mesh = Mesh(np.array(jax.devices()), ("data",))
  rows = []
  for config_name, half in (("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")):
    reference = run(config_name, "float32", settings, data, mesh)
    mixed = run(config_name, half, settings, data, mesh)
    mixed["params_relative_l2_vs_float32_reduction"] = _relative_l2(
      jax.tree.leaves(mixed["params"]), jax.tree.leaves(reference["params"])
    )
    for row in (reference, mixed):
      row.pop("params")
      rows.append(row)
      print(json.dumps(row))
  report = {
    **results.header("half_all_reduce"),
    "backend": jax.default_backend(),
    "device_count": DEVICES,
    "model": settings.model.__dict__,
    "local_batch": settings.batch_size,
    "steps": settings.steps,
    "rows": rows,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
