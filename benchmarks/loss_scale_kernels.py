"""Which kernels dynamic loss scaling adds to the GPT-2 (124M) train step compiled for an H100.

Compiles (never runs) the ``gpt2_linen`` step of ``setups.py`` for ``--target`` with
``mpx.audit(..., target=...)`` (deviceless; XLA's default kernel configs, no autotuning)
under ``mpx_bf16``, ``mpx_f16`` without loss scaling and ``mpx_f16`` with dynamic loss
scaling, and prints the kernels, bytes and memory of each, then the kernels the loss scaling
adds, grouped by op name with the layer path removed. Needs ``python -m mpx.gpu_target``.

Usage::

  JAX_PLATFORMS=cpu python benchmarks/loss_scale_kernels.py [--target h100] [--smoke]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from harness import setups

import mpx


def _audit(config: str, target: str, smoke: bool, loss_scale: str | None = "dynamic") -> tuple:
  setup = setups.build("gpt2_linen", config, smoke=smoke, loss_scale=loss_scale)
  carry, batch = setups.abstract_carry(setup)
  report = mpx.audit(jax.jit(setup.step, donate_argnums=(0,)), carry, batch, target=target)
  leaves = len(jax.tree.leaves(carry[0]))
  print(
    f"{config:8s} loss_scale={loss_scale}: {report.kernel_count} kernels, "
    f"{report.bytes_moved / 2**20:.0f} MiB moved, temp {report.memory.temp_bytes / 2**20:.0f} MiB, "
    f"{len(report.gemms)} GEMMs, half share {report.half_flops_share:.3f}, {leaves} param leaves"
  )
  return report, leaves


def _key(kernel: dict) -> tuple[str, str]:
  # The layer-independent part of the op name: the block index removed.
  return kernel["kind"], re.sub(r"\b(Block|h)_\d+\b", "*", kernel["op_name"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--smoke", action="store_true", help="tiny model")
  args = parser.parse_args()
  bf16, leaves = _audit("mpx_bf16", args.target, args.smoke)
  f16_none, _ = _audit("mpx_f16", args.target, args.smoke, loss_scale=None)
  f16, _ = _audit("mpx_f16", args.target, args.smoke)
  for label, base in (("mpx_f16 without loss scaling", f16_none), ("mpx_bf16", bf16)):
    extra, base_count = collections.Counter(), collections.Counter()
    for k in f16.kernels:
      extra[_key(k)] += k["count"]
    for k in base.kernels:
      base_count[_key(k)] += k["count"]
    added = f16.kernel_count - base.kernel_count
    print(
      f"\nmpx_f16 with dynamic loss scaling vs {label}: {added:+d} kernels "
      f"({added / leaves:+.2f} per param leaf), "
      f"{100 * (f16.bytes_moved / base.bytes_moved - 1):+.2f}% bytes moved"
    )
    diff = sorted(
      (
        (extra[k] - base_count[k], k)
        for k in set(extra) | set(base_count)
        if extra[k] != base_count[k]
      ),
      reverse=True,
    )
    for n, (kind, name) in diff[:40]:
      print(f"  {n:+5d}  {kind:8s} {name}")


if __name__ == "__main__":
  main()
