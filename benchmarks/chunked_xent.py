"""A language model's head and loss, unfused against chunked over the vocabulary, compiled for an H100.

Compiles (never runs) one gradient step of the head and its cross-entropy, the
gradients of the features and the kernel, for ``--target`` with
``mpx.audit(..., target=...)`` (deviceless, XLA's default kernel configs, no
autotuning: a roofline model, not a measurement), two ways:

* ``unfused``: the head's bfloat16 logits ``jnp.dot(features, kernel)``, then
  ``mpx.losses.softmax_cross_entropy_with_integer_labels`` on them;
* ``chunked``: ``mpx.losses.head_softmax_cross_entropy_with_integer_labels``,
  ``chunk_size`` classes at a time.

It prints, per head, the temporaries, the bytes the kernels read and write, the
kernel launches and the roofline time, and writes them as JSON. Needs
``python -m mpx.gpu_target``.

The chunked loop's slice kernels (a chunk's columns of the kernel copied out,
its columns of the kernel's gradient written in place) are charged by the
audit at the size of the whole ``[d, vocab]`` buffer, as every kernel is
charged its operands; the
columns "GB in place" and "roofline ms in place" charge them the chunk they
copy, read and written (what a memcpy moves).

Usage::

  JAX_PLATFORMS=cpu python benchmarks/chunked_xent.py [--target h100] [--smoke] [--out FILE]

writes ``benchmarks/results/chunked_xent.json`` (``chunked_xent_smoke.json`` with
``--smoke``) unless ``--out`` says where.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from harness import results

import mpx
from mpx._src.audit import roofline

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# name: (tokens, d, vocab)
HEADS = {
  "gpt2": (8 * 1024, 768, 50257),
  "vocab_128k": (8 * 1024, 4096, 131072),
}
SMOKE_HEADS = {"smoke": (256, 64, 1000)}
CHUNK_SIZE = 8192


def _loss(name: str, chunk_size: int) -> Any:
  def unfused(features, kernel, labels):
    logits = jnp.dot(features, kernel)
    return mpx.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def chunked(features, kernel, labels):
    return mpx.losses.head_softmax_cross_entropy_with_integer_labels(
      features, kernel, labels, chunk_size=chunk_size
    ).mean()

  return {"unfused": unfused, "chunked": chunked}[name]


def _in_place(report: Any, slice_bytes: int) -> Any:
  """The report with its slice-copy kernels charged the chunk they copy, not the whole buffer."""
  kernels, copies = [], 0
  for k in report.kernels:
    if k["op_name"].endswith(("/dynamic_slice", "/dynamic_update_slice")):
      k, copies = {**k, "bytes": 2 * slice_bytes}, copies + 1
    kernels.append(k)
  return dataclasses.replace(report, kernels=tuple(kernels)), copies


def row(head: str, shape: tuple[int, int, int], loss: str, target: str, chunk_size: int) -> dict:
  tokens, d, vocab = shape
  args = (
    jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16),
    jax.ShapeDtypeStruct((tokens,), jnp.int32),
  )
  step = jax.jit(jax.grad(_loss(loss, chunk_size), argnums=(0, 1)))
  report = mpx.audit(step, *args, target=target)
  roof = roofline.roofline(report)
  in_place, copies = _in_place(report, d * min(chunk_size, vocab) * 2)
  roof_in_place = roofline.roofline(in_place)
  return {
    "head": head,
    "tokens": tokens,
    "d": d,
    "vocab": vocab,
    "loss": loss,
    "chunk_size": chunk_size if loss == "chunked" else None,
    "temp_mib": report.memory.temp_bytes / 2**20,
    "logits_mib": tokens * vocab * 2 / 2**20,
    "gb_moved": report.bytes_moved / 1e9,
    "kernels": report.kernel_count,
    "gemm_tflop": report.total_flops / 1e12,
    "roofline_ms": None if roof is None else roof["ms"],
    "slice_copy_kernels": copies,
    "gb_moved_in_place": in_place.bytes_moved / 1e9,
    "roofline_ms_in_place": None if roof_in_place is None else roof_in_place["ms"],
  }


def format_table(rows: list[dict]) -> str:
  lines = [
    "| head (tokens x d x vocab) | loss | temp MiB | kernels | GEMM TFLOP | GB moved "
    "| GB in place | roofline ms | roofline ms in place |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    loss = r["loss"] if r["chunk_size"] is None else f"chunked ({r['chunk_size']})"
    roof = [
      "n/a" if ms is None else f"{ms:.2f}" for ms in (r["roofline_ms"], r["roofline_ms_in_place"])
    ]
    lines.append(
      f"| {r['head']} ({r['tokens']} x {r['d']} x {r['vocab']}) | {loss} | {r['temp_mib']:,.0f} "
      f"| {r['kernels']} | {r['gemm_tflop']:.2f} | {r['gb_moved']:.2f} "
      f"| {r['gb_moved_in_place']:.2f} | {roof[0]} | {roof[1]} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
  parser.add_argument("--smoke", action="store_true", help="a tiny head")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args(argv)
  heads = SMOKE_HEADS if args.smoke else HEADS
  rows = [
    row(head, shape, loss, args.target, args.chunk_size)
    for head, shape in heads.items()
    for loss in ("unfused", "chunked")
  ]
  report = {
    **results.header("chunked_xent", argv, env="JAX_PLATFORMS=cpu"),
    "target": args.target,
    "note": f"{args.target}: modelled, no autotuning (roofline without launches); bfloat16 "
    "features and kernel, the gradient of the mean loss with respect to both",
    "rows": rows,
  }
  print(format_table(rows))
  print(f"\n{report['note']}")
  out = args.out or RESULTS / ("chunked_xent_smoke.json" if args.smoke else "chunked_xent.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1) + "\n")
  print(f"JSON: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
