"""Bytes per parameter of params + adamw state for fp32 training and layouts (a), (b).

Measured from the real state trees (sum of nbytes over params and opt_state,
divided by the parameter count). Prints a table and writes JSON.

  python benchmarks/memory_table.py [--out benchmarks/results/memory_table.json]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import optax

import mpx

LAYOUTS = {
  "fp32 training": "float32",
  "layout (a): f32 params, f16 compute": "mixed_float16",
  "layout (b): f16 params + f32 masters": "params=float16,compute=float16,output=float32",
  "layout (b): bf16 params + f32 masters": "params=bfloat16,compute=bfloat16,output=float32",
}


def measure(policy: str, sizes=((1024, 1024), (1024,), (1024, 256), (256,))) -> dict:
  p = mpx.get_policy(policy)
  params = {f"w{i}": jnp.zeros(s, p.param_dtype) for i, s in enumerate(sizes)}
  tx = mpx.mixed_precision(optax.adamw(3e-4), p)
  state = jax.eval_shape(tx.init, params)
  count = sum(x.size for x in jax.tree.leaves(params))

  def nbytes(t):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))

  return {
    "policy": str(p),
    "params_bytes_per_param": nbytes(params) / count,
    "opt_state_bytes_per_param": nbytes(state) / count,
    "total_bytes_per_param": (nbytes(params) + nbytes(state)) / count,
    "param_count": count,
  }


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="benchmarks/results/memory_table.json")
  args = parser.parse_args()
  rows = {name: measure(policy) for name, policy in LAYOUTS.items()}
  print(f"{'layout':40s} {'params':>7s} {'opt_state':>9s} {'total':>7s}")
  for name, r in rows.items():
    print(
      f"{name:40s} {r['params_bytes_per_param']:7.3f} {r['opt_state_bytes_per_param']:9.3f} "
      f"{r['total_bytes_per_param']:7.3f}"
    )
  with open(args.out, "w") as f:
    json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
