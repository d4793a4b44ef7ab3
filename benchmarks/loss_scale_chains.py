"""What dynamic loss scaling adds to a train step compiled for an H100, per optimizer chain.

Compiles (never runs) the GPT-2 small (linen) and ResNet-50 train steps of ``harness/`` for
``--target`` with ``mpx.audit(..., target=...)`` (deviceless: XLA's default kernel configs, no
autotuning) under ``mpx.mixed_precision`` with each optimizer chain below, once with dynamic loss
scaling and once without (``loss_scale=None``), and prints the kernels and bytes the loss scaling
adds: per param leaf, and as a share of the bytes the step moves without it.

Chains: ``adamw`` (``optax.adamw(1e-4, weight_decay=0.01)``, the suite's), ``adamw_clip``
(``optax.clip_by_global_norm(1.0)`` before it), ``sgd`` (``optax.sgd(1e-2)``), all under
``mixed_float16``; ``adamw_masters``: ``adamw`` with float16 params and float32 masters
(``params=float16,compute=float16,output=float32``).

Usage::

  JAX_PLATFORMS=cpu python benchmarks/loss_scale_chains.py [--models gpt2_linen resnet50]
      [--chains adamw adamw_clip sgd adamw_masters] [--target h100] [--smoke] [--out FILE]

Writes nothing unless ``--out`` is given (a JSON file with the results header).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from harness import gpt, resnet50, results

import mpx

F16 = "mixed_float16"
MASTERS = "params=float16,compute=float16,output=float32"
CHAINS: dict[str, tuple[str, Any]] = {
  "adamw": (F16, lambda: optax.adamw(1e-4, weight_decay=0.01)),
  "adamw_clip": (
    F16,
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.01)),
  ),
  "sgd": (F16, lambda: optax.sgd(1e-2)),
  "adamw_masters": (MASTERS, lambda: optax.adamw(1e-4, weight_decay=0.01)),
}
MODELS = ("gpt2_linen", "resnet50")


def _model(name: str, policy: str, smoke: bool) -> tuple[Any, Any, Any, dict[str, Any]]:
  """``(init, apply, state, batch)`` of a model under ``policy``."""
  if name == "gpt2_linen":
    cfg = gpt.GPTConfig.smoke() if smoke else gpt.GPTConfig()
    module = mpx.linen.apply_policy(gpt.GPT(cfg), policy)
    batch = gpt.make_batch(cfg)

    def init():
      return module.init(jax.random.key(0), jnp.asarray(batch["x"][:1]))["params"], {}

    def apply(params, state, x):
      return module.apply({"params": params}, x), state

    return init, apply, None, batch
  cfg = resnet50.ResNetConfig.smoke() if smoke else resnet50.ResNetConfig()
  module = mpx.linen.apply_policy(resnet50.ResNet50(cfg), policy)
  batch = resnet50.make_batch(cfg)

  def init():
    variables = module.init(jax.random.key(0), jnp.asarray(batch["x"][:1]), train=False)
    return variables["params"], {"batch_stats": variables["batch_stats"]}

  def apply(params, state, x):
    return module.apply({"params": params, **state}, x, mutable=["batch_stats"])

  return init, apply, None, batch


def _report(model: str, chain: str, loss_scale: str | None, target: str, smoke: bool) -> Any:
  with warnings.catch_warnings():  # float16 without loss scaling warns: the baseline, on purpose
    warnings.filterwarnings("ignore", "mpx.mixed_precision", mpx.PrecisionWarning)
    return _compiled(model, chain, loss_scale, target, smoke)


def _compiled(model: str, chain: str, loss_scale: str | None, target: str, smoke: bool) -> Any:
  policy, make = CHAINS[chain]
  init, apply, _, batch = _model(model, policy, smoke)
  tx = mpx.mixed_precision(make(), policy, loss_scale=loss_scale)

  def loss_fn(params, state, batch):
    logits, state = apply(params, state, batch["x"])
    labels = batch["y"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss.mean(), state

  def step(carry, batch):
    params, opt_state, state = carry
    (loss, state), grads = mpx.value_and_grad(loss_fn, opt_state, has_aux=True)(
      params, state, batch
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return (mpx.apply_updates(params, updates), opt_state, state), loss

  params, state = jax.eval_shape(init)
  carry = (params, jax.eval_shape(tx.init, params), state)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  report = mpx.audit(jax.jit(step, donate_argnums=(0,)), carry, abstract, target=target)
  return report, len(jax.tree.leaves(params))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
  parser.add_argument("--chains", nargs="+", default=list(CHAINS), choices=list(CHAINS))
  parser.add_argument("--target", default="h100")
  parser.add_argument("--smoke", action="store_true", help="the tiny models")
  parser.add_argument("--out", type=pathlib.Path, help="write the rows to this JSON file")
  args = parser.parse_args()
  rows = []
  print(
    f"{'model':11s} {'chain':14s} {'leaves':>6s} {'kernels':>15s} {'added':>6s} {'per leaf':>8s} "
    f"{'bytes added':>11s}  (modelled: {args.target}, deviceless, no autotuning)"
  )
  for model in args.models:
    for chain in args.chains:
      start = time.perf_counter()
      base, leaves = _report(model, chain, None, args.target, args.smoke)
      scaled, _ = _report(model, chain, "dynamic", args.target, args.smoke)
      added = scaled.kernel_count - base.kernel_count
      share = scaled.bytes_moved / base.bytes_moved - 1
      row = {
        "model": model,
        "chain": chain,
        "param_leaves": leaves,
        "kernels_without": base.kernel_count,
        "kernels_with": scaled.kernel_count,
        "kernels_added_per_leaf": added / leaves,
        "bytes_without": base.bytes_moved,
        "bytes_with": scaled.bytes_moved,
        "bytes_added_share": share,
        "seconds": time.perf_counter() - start,
      }
      rows.append(row)
      print(
        f"{model:11s} {chain:14s} {leaves:6d} {base.kernel_count:6d} -> {scaled.kernel_count:5d} "
        f"{added:+6d} {added / leaves:8.3f} {100 * share:+10.3f}%",
        flush=True,
      )
  if args.out:
    header = results.header("loss_scale_chains", env="JAX_PLATFORMS=cpu")
    args.out.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
