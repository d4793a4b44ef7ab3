"""Bytes per parameter of params + adamw state: fp32 training and layouts (a), (b) and (c).

Measured from the real state trees (sum of nbytes over params and opt_state,
divided by the parameter count). Layout (c) keeps bfloat16 params without
float32 masters: Kahan-compensated (``mpx.with_kahan_summation``) or
stochastically rounded (``mpx.with_stochastic_rounding``) updates, with the
adamw moments in float32 or, through ``mpx.with_state_dtype``, in bfloat16.
Prints a table and writes JSON.

  python benchmarks/memory_table.py [--out benchmarks/results/memory_table.json]
"""

import argparse
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import mpx

BF16 = "params=bfloat16,compute=bfloat16,output=float32"


def _masters(policy: str) -> Callable[[optax.GradientTransformation], optax.GradientTransformation]:
  return lambda inner: mpx.mixed_precision(inner, policy)


def _bf16_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  return mpx.with_state_dtype(inner, state_dtype=jnp.bfloat16)


def _kahan(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  return mpx.mixed_precision(mpx.with_kahan_summation(inner), BF16, master_dtype=None)


def _rounding(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  tx = mpx.with_stochastic_rounding(inner, key=jax.random.key(0))
  return mpx.mixed_precision(tx, BF16, master_dtype=None)


# name -> (policy, wraps optax.adamw into the layout's optimizer)
LAYOUTS = {
  "fp32 training": ("float32", _masters("float32")),
  "layout (a): f32 params, f16 compute": ("mixed_float16", _masters("mixed_float16")),
  "layout (b): f16 params + f32 masters": (
    "params=float16,compute=float16,output=float32",
    _masters("params=float16,compute=float16,output=float32"),
  ),
  "layout (b): bf16 params + f32 masters": (BF16, _masters(BF16)),
  "layout (a): f32 params, bf16 moments": (
    "mixed_bfloat16",
    lambda i: mpx.mixed_precision(_bf16_moments(i), "mixed_bfloat16"),
  ),
  "layout (b): bf16 params + f32 masters, bf16 moments": (
    BF16,
    lambda i: mpx.mixed_precision(_bf16_moments(i), BF16),
  ),
  "layout (c): bf16 params + Kahan": (BF16, _kahan),
  "layout (c): bf16 params + stochastic rounding": (BF16, _rounding),
  "layout (c): bf16 params + Kahan, bf16 moments": (BF16, lambda i: _kahan(_bf16_moments(i))),
  "layout (c): bf16 params + stoch. rounding, bf16 moments": (
    BF16,
    lambda i: _rounding(_bf16_moments(i)),
  ),
}


def measure(
  policy: str,
  make_tx: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None,
  sizes=((1024, 1024), (1024,), (1024, 256), (256,)),
) -> dict:
  p = mpx.get_policy(policy)
  params = {f"w{i}": jnp.zeros(s, p.param_dtype) for i, s in enumerate(sizes)}
  make_tx = make_tx or _masters(policy)
  tx = make_tx(optax.adamw(3e-4))
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
  rows = {name: measure(policy, make_tx) for name, (policy, make_tx) in LAYOUTS.items()}
  print(f"{'layout':56s} {'params':>7s} {'opt_state':>9s} {'total':>7s}")
  for name, r in rows.items():
    print(
      f"{name:56s} {r['params_bytes_per_param']:7.3f} {r['opt_state_bytes_per_param']:9.3f} "
      f"{r['total_bytes_per_param']:7.3f}"
    )
  with open(args.out, "w") as f:
    json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
