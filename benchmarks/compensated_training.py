"""bfloat16 training without float32 masters: nearest, Kahan and stochastic rounding (layout (c)).

Trains a Flax MLP on scikit-learn's digits with adam, the same data order for
every row, and reports the final loss against float32 and ``mixed_bfloat16``:

* float32; ``mixed_bfloat16`` (layout (a), float32 params); bfloat16 params
  with float32 masters (layout (b));
* bfloat16 params without masters: plain nearest rounding, Kahan-compensated
  updates (``mpx.with_kahan_summation``), stochastic rounding
  (``mpx.with_stochastic_rounding``, several keys);
* the compensated rows again with bfloat16 moments (``mpx.with_state_dtype``).

"final loss" is the cross-entropy of the final params on all 1,797 images, in
the row's own precision; "last-20" is the mean training loss of the last 20
steps. Bytes per parameter count params and optimizer state, as in
``benchmarks/memory_table.py``.

Usage: ``python benchmarks/compensated_training.py [--steps 400] [--lr 1e-3 3e-4]
[--out benchmarks/results/compensated_training.json]``
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from harness import results
from sklearn.datasets import load_digits

import mpx

BF16 = "params=bfloat16,compute=bfloat16,output=float32"
SR_KEYS = (0, 1, 2, 3, 4)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


@functools.cache
def _digits():
  x, y = load_digits(return_X_y=True)
  return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y, jnp.int32)


def _bf16_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  return mpx.with_state_dtype(inner, state_dtype=jnp.bfloat16)


def _rows(seed: int) -> dict:
  """name -> (policy, tx factory from the inner optimizer)."""
  key = jax.random.key(100 + seed)
  return {
    "float32": ("float32", lambda i: mpx.mixed_precision(i, "float32")),
    "mixed_bfloat16 (a)": ("mixed_bfloat16", lambda i: mpx.mixed_precision(i, "mixed_bfloat16")),
    "bf16 params + f32 masters (b)": (BF16, lambda i: mpx.mixed_precision(i, BF16)),
    "bf16, nearest": (BF16, lambda i: mpx.mixed_precision(i, BF16, master_dtype=None)),
    "bf16, Kahan": (
      BF16,
      lambda i: mpx.mixed_precision(mpx.with_kahan_summation(i), BF16, master_dtype=None),
    ),
    "bf16, stochastic rounding": (
      BF16,
      lambda i: mpx.mixed_precision(
        mpx.with_stochastic_rounding(i, key=key), BF16, master_dtype=None
      ),
    ),
    "bf16, Kahan, bf16 moments": (
      BF16,
      lambda i: mpx.mixed_precision(
        mpx.with_kahan_summation(_bf16_moments(i)), BF16, master_dtype=None
      ),
    ),
    "bf16, stochastic rounding, bf16 moments": (
      BF16,
      lambda i: mpx.mixed_precision(
        mpx.with_stochastic_rounding(_bf16_moments(i), key=key), BF16, master_dtype=None
      ),
    ),
    "f32 masters (b), bf16 moments": (
      BF16,
      lambda i: mpx.mixed_precision(_bf16_moments(i), BF16),
    ),
  }


def train(policy: str, make_tx, *, lr: float, steps: int, batch: int = 128) -> dict:
  policy_ = mpx.get_policy(policy)
  x, y = _digits()
  model = mpx.linen.apply_policy(MLP(), policy_)
  params = model.init(jax.random.key(0), x[:1])["params"]
  tx = make_tx(optax.adam(lr))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mpx.PrecisionWarning)  # the "nearest" row, on purpose
    opt_state = tx.init(params)
  order = jax.random.permutation(jax.random.key(1), steps * batch) % x.shape[0]

  def loss_fn(p, idx):
    logits = model.apply({"params": p}, x[idx])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean()

  def step(carry, idx):
    params, opt_state = carry
    loss, grads = mpx.value_and_grad(lambda p: loss_fn(p, idx), opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (mpx.apply_updates(params, updates), opt_state), loss

  @jax.jit
  def run(params, opt_state):
    (params, opt_state), losses = jax.lax.scan(
      step, (params, opt_state), order.reshape(steps, batch)
    )
    return params, opt_state, losses, loss_fn(params, jnp.arange(x.shape[0]))

  params, opt_state, losses, final = run(params, opt_state)
  count = sum(p.size for p in jax.tree.leaves(params))
  nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((params, opt_state)))
  losses = np.asarray(losses)
  return {
    "policy": str(policy_),
    "final_loss": float(final),
    "last20_mean": float(losses[-20:].mean()),
    "bytes_per_param": nbytes / count,
    "losses": losses.tolist(),
  }


def rounding_misses(*, lr: float, steps: int, batch: int = 128) -> dict:
  """How often ``optax.apply_updates`` misses the stochastically rounded weight.

  Runs the "bf16, stochastic rounding" row without loss scaling and, next to
  each step, recomputes the rounded targets from the documented random stream
  (``fold_in(fold_in(key, leaf_index), count)``) and the inner adam update.
  """
  from mpx._src.optim import stochastic_rounding  # the rounding itself, to restate the targets

  x, y = _digits()
  model = mpx.linen.apply_policy(MLP(), mpx.get_policy(BF16))
  params = model.init(jax.random.key(0), x[:1])["params"]
  inner = optax.adam(lr)
  tx = mpx.with_stochastic_rounding(inner, key=jax.random.key(100))
  order = jax.random.permutation(jax.random.key(1), steps * batch) % x.shape[0]

  def step(carry, idx):
    params, state = carry

    def loss_fn(p):
      logits = model.apply({"params": p}, x[idx])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean()

    grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss_fn)(params))
    updates, new_state = tx.update(grads, state, params)
    weights = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    inner_updates, _ = inner.update(grads, state.inner_state, weights)

    def target(k, p, u):
      key = jax.random.fold_in(jax.random.wrap_key_data(k), state.count)
      uniform = jax.random.uniform(key, p.shape)
      return stochastic_rounding.round_stochastically(p.astype(jnp.float32) + u, p.dtype, uniform)

    targets = jax.tree.map(target, state.keys, params, inner_updates)
    new_params = optax.apply_updates(params, updates)
    misses = jax.tree.map(lambda a, t: jnp.sum(a != t), new_params, targets)
    missed = sum(jax.tree.leaves(misses))
    return (new_params, new_state), missed

  run = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), order.reshape(steps, batch))[1])
  missed = int(np.asarray(run(params)).sum())
  total = steps * sum(p.size for p in jax.tree.leaves(params))
  return {"lr": lr, "missed": missed, "element_steps": total, "fraction": missed / total}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-4])
  parser.add_argument("--out", default="benchmarks/results/compensated_training.json")
  args = parser.parse_args()
  report = {
    **results.header("compensated_training"),
    "steps": args.steps,
    "stochastic_rounding_keys": len(SR_KEYS),
    "results": [],
  }
  for lr in args.lr:
    for name in _rows(0):
      seeds = SR_KEYS if "stochastic" in name else (0,)
      runs = [train(*_rows(s)[name], lr=lr, steps=args.steps) for s in seeds]
      finals = np.array([r["final_loss"] for r in runs])
      row = {
        "setup": name,
        "lr": lr,
        "policy": runs[0]["policy"],
        "bytes_per_param": runs[0]["bytes_per_param"],
        "final_loss": float(finals.mean()),
        "final_loss_sd": float(finals.std(ddof=1)) if len(runs) > 1 else 0.0,
        "last20_mean": float(np.mean([r["last20_mean"] for r in runs])),
        "runs": len(runs),
      }
      report["results"].append(row)
      print(
        f"| {lr:g} | {name} | {row['bytes_per_param']:.2f} | {row['final_loss']:.4f}"
        + (f" ± {row['final_loss_sd']:.4f}" if len(runs) > 1 else "")
        + f" | {row['last20_mean']:.4f} |",
        flush=True,
      )
  for lr in args.lr:
    miss = rounding_misses(lr=lr, steps=args.steps)
    report.setdefault("rounding_misses", []).append(miss)
    print(
      f"lr {lr:g}: optax.apply_updates missed the stochastically rounded weight in "
      f"{miss['missed']} of {miss['element_steps']} element-steps ({miss['fraction']:.3%})"
    )
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  main()
