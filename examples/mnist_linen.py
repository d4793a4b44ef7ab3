"""An MNIST-style Flax linen CNN in mixed precision: three lines changed from float32.

An MNIST-style CNN in Flax linen (Conv, BatchNorm, Dropout, Dense), trained on
scikit-learn's 8x8 digits with Flax's ``TrainState`` (extended with the
BatchNorm statistics, as Flax's ImageNet example does), under the policy
``--policy`` (default ``mixed_float16``: float32 params, float16 compute,
float32 logits, dynamic loss scaling). It is ``examples/float32/mnist_linen.py``
with three lines changed, plus ``import mpx`` and the ``--policy`` flag
(``tests/repo/test_examples.py`` computes the diff):

1. ``mpx.linen.apply_policy(CNN(), policy)``: every Conv and Dense computes in
   the compute dtype; BatchNorm stays float32, statistics included.
2. ``mpx.mixed_precision(optax.adamw(...), policy)``: the optimizer unscales
   the gradients, skips a step whose gradients overflowed, and adjusts the
   loss scale, which lives in ``state.opt_state``. ``TrainState.apply_gradients``
   is unchanged.
3. ``mpx.value_and_grad(loss_fn, state.opt_state, has_aux=True)``: gradients
   of the scaled loss, the true loss and the new BatchNorm statistics.

``--policy float32`` makes every mpx call a no-op: the run is bit for bit the
float32 program's (the test compares the final params and statistics). Under
every policy the script checks what the float32 program checks and exits with
status 1 if the loss does not fall, if the test accuracy stays near chance, or
if the BatchNorm statistics did not advance.

Run: ``python examples/mnist_linen.py`` (``--steps 10`` for a smoke run,
``--policy mixed_bfloat16`` for bfloat16).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits

import mpx


class CNN(nn.Module):
  """Two convolutions with batch norm, then a two-layer classifier with dropout."""

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(32, (3, 3))(x)))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(64, (3, 3))(x)))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any
  dropout_key: jax.Array


def load_data(seed: int) -> tuple[np.ndarray, ...]:
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_train = int(0.8 * len(y))
  train, test = order[:n_train], order[n_train:]
  return x[train], y[train], x[test], y[test]


def save_state(path: str, state: TrainState) -> None:
  """Writes the params and BatchNorm statistics, for comparing runs."""
  tree = {"params": state.params, "batch_stats": state.batch_stats}
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  np.savez(path, **{"/".join(k.key for k in keys): np.asarray(v) for keys, v in flat})


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--log-every", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", default="mixed_float16", help="e.g. float32, mixed_bfloat16")
  parser.add_argument("--state-out", help="write the final model state to this .npz file")
  args = parser.parse_args()

  x_train, y_train, x_test, y_test = load_data(args.seed)
  model = mpx.linen.apply_policy(CNN(), args.policy)
  tx = mpx.mixed_precision(optax.adamw(args.learning_rate), args.policy)
  params_key, dropout_key = jax.random.split(jax.random.key(args.seed))
  variables = model.init(params_key, x_train[:1], train=False)
  state = TrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=tx,
    batch_stats=variables["batch_stats"],
    dropout_key=dropout_key,
  )

  @jax.jit
  def train_step(state, x, y):
    dropout_key = jax.random.fold_in(state.dropout_key, state.step)

    def loss_fn(params):
      logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        x,
        train=True,
        rngs={"dropout": dropout_key},
        mutable=["batch_stats"],
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, updates["batch_stats"]

    grad_fn = mpx.value_and_grad(loss_fn, state.opt_state, has_aux=True)
    (loss, batch_stats), grads = grad_fn(state.params)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss

  @jax.jit
  def accuracy(state, x, y):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return (state.apply_fn(variables, x, train=False).argmax(-1) == y).mean()

  rng = np.random.default_rng(args.seed)
  losses, acc, start = [], 0.0, time.perf_counter()
  print(f"{'step':>6} {'loss':>8} {'test acc':>9}")
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_train), args.batch_size)
    state, loss = train_step(state, x_train[idx], y_train[idx])
    losses.append(float(loss))
    if step % args.log_every == 0 or step == args.steps:
      acc = float(accuracy(state, x_test, y_test))
      print(f"{step:>6} {losses[-1]:>8.4f} {acc:>9.3f}")
  print(f"done in {time.perf_counter() - start:.1f} s")

  norms = [state.batch_stats[name] for name in ("BatchNorm_0", "BatchNorm_1")]
  print("batch norm running means (mean):", [float(bn["mean"].mean()) for bn in norms])
  if args.state_out:
    save_state(args.state_out, state)
  failures = []
  k = max(1, len(losses) // 5)
  if not np.mean(losses[-k:]) < np.mean(losses[:k]):
    failures.append(f"the loss did not fall: {np.mean(losses[:k])} -> {np.mean(losses[-k:])}")
  if args.steps >= 200 and acc < 0.9:
    failures.append(f"test accuracy {acc:.3f} < 0.9")
  if any((bn["mean"] == 0).all() or (bn["var"] == 1).all() for bn in norms):
    failures.append("batch norm statistics did not move")
  for failure in failures:
    print(failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
