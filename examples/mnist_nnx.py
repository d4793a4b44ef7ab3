"""An MNIST-style Flax NNX CNN in mixed precision: three lines changed from float32.

An MNIST-style CNN in Flax NNX (Conv, BatchNorm, Dropout, Linear), trained on
scikit-learn's 8x8 digits with ``nnx.Optimizer`` and ``nnx.jit``, under the
policy ``--policy`` (default ``mixed_float16``: float32 params, float16
compute, float32 logits, dynamic loss scaling). It is
``examples/float32/mnist_nnx.py`` with three lines changed, plus ``import mpx``
and the ``--policy`` flag (``tests/repo/test_examples.py`` computes the diff):

1. ``mpx.nnx.apply_policy(CNN(...), policy)``: every Conv and Linear computes
   in the compute dtype; BatchNorm stays float32, statistics included.
2. ``mpx.mixed_precision(optax.adamw(...), policy)``: the optimizer unscales
   the gradients, skips a step whose gradients overflowed, and adjusts the
   loss scale, which lives in ``optimizer.opt_state``.
3. ``mpx.value_and_grad(loss_fn, optimizer.opt_state)(model)``: gradients of the
   scaled loss, the true loss; like ``nnx.value_and_grad`` it writes the
   BatchNorm statistics and the dropout RNG counts back into the model.

``--policy float32`` makes every mpx call a no-op: the run is bit for bit the
float32 program's (the test compares the final params and statistics). Under
every policy the script checks what the float32 program checks and exits with
status 1 if the loss does not fall, if the test accuracy stays near chance, or
if the BatchNorm statistics or the dropout RNG counts did not advance.

Run: ``python examples/mnist_nnx.py`` (``--steps 10`` for a smoke run,
``--policy mixed_bfloat16`` for bfloat16).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mpx


class CNN(nnx.Module):
  """Two convolutions with batch norm, then a two-layer classifier with dropout."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(0.1, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(0.5, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))), (2, 2), strides=(2, 2))
    x = self.dropout1(x)
    x = nnx.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))), (2, 2), strides=(2, 2))
    x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
    return self.linear2(self.dropout2(x))


def load_data(seed: int) -> tuple[np.ndarray, ...]:
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_train = int(0.8 * len(y))
  train, test = order[:n_train], order[n_train:]
  return x[train], y[train], x[test], y[test]


def save_state(path: str, model: nnx.Module) -> None:
  """Writes the params, BatchNorm statistics and RNG counts, for comparing runs."""
  state = nnx.state(model, nnx.Not(nnx.RngKey))
  arrays = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}
  np.savez(path, **arrays)


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
  model = mpx.nnx.apply_policy(CNN(rngs=nnx.Rngs(args.seed)), args.policy)
  tx = mpx.mixed_precision(optax.adamw(args.learning_rate), args.policy)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = mpx.value_and_grad(loss_fn, optimizer.opt_state)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def accuracy(model, x, y):
    return (model(x).argmax(-1) == y).mean()

  def evaluate() -> float:
    model.eval()  # running statistics, no dropout
    acc = float(accuracy(model, x_test, y_test))
    model.train()
    return acc

  rng = np.random.default_rng(args.seed)
  losses, acc, start = [], 0.0, time.perf_counter()
  print(f"{'step':>6} {'loss':>8} {'test acc':>9}")
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_train), args.batch_size)
    losses.append(float(train_step(model, optimizer, x_train[idx], y_train[idx])))
    if step % args.log_every == 0 or step == args.steps:
      acc = evaluate()
      print(f"{step:>6} {losses[-1]:>8.4f} {acc:>9.3f}")
  print(f"done in {time.perf_counter() - start:.1f} s")

  means = [np.asarray(bn.mean[...]) for bn in (model.batch_norm1, model.batch_norm2)]
  variances = [np.asarray(bn.var[...]) for bn in (model.batch_norm1, model.batch_norm2)]
  counts = [int(d.rngs.count[...]) for d in (model.dropout1, model.dropout2)]
  print("batch norm running means (mean):", [float(m.mean()) for m in means])
  print("dropout rng counts:", counts)
  if args.state_out:
    save_state(args.state_out, model)
  failures = []
  k = max(1, len(losses) // 5)
  if not np.mean(losses[-k:]) < np.mean(losses[:k]):
    failures.append(f"the loss did not fall: {np.mean(losses[:k])} -> {np.mean(losses[-k:])}")
  if args.steps >= 200 and acc < 0.9:
    failures.append(f"test accuracy {acc:.3f} < 0.9")
  if counts != [args.steps] * 2:  # each dropout layer draws one key per step
    failures.append(f"dropout rng counts {counts}, expected {[args.steps] * 2}")
  if any((m == 0).all() for m in means) or any((v == 1).all() for v in variances):
    failures.append("batch norm statistics did not move")
  for failure in failures:
    print(failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
