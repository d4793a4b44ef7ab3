"""Trains a small Flax CNN on scikit-learn's digits in float16 with dynamic loss scaling.

The model is plain Flax with no dtype arguments. Under the policy
``--policy`` (default ``mixed_float16``: params float32, compute float16, output
float32), ``mpx.linen.apply_policy`` makes every convolution and matmul run in
the compute dtype and returns float32 logits, so the loss is computed in
float32. The train step differs from a float32 one by three lines:
``mpx.linen.apply_policy`` (the model), ``mpx.mixed_precision`` (unscale,
check, skip, adjust; float32 masters when params are half) and
``mpx.value_and_grad`` (scaled gradients, true loss).

The optimizer uses mpx's documented default, ``loss_scale="dynamic"``: dynamic
scaling under float16 and a no-op scale of 1 under ``mixed_bfloat16`` or
``float32``. To watch the scaler work, ``--initial-scale 16777216`` starts
from a deliberately huge scale (2**24), so the first steps overflow and are
skipped while the scale backs off, and ``--growth-interval 100`` grows it again
every 100 finite steps; either flag builds ``mpx.dynamic_loss_scale``
explicitly, which scales under every policy, and the run says so. It exits
with status 1 if training diverged (gradients overflowed at the floor scale) or
the final loss is not finite.

Run: ``python examples/float16_dynamic_loss_scale.py --steps 600``
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

import mpx


class Cnn(nn.Module):
  """Two convolutions and a classifier head, written with no dtype arguments."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
    x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


def load_data(seed: int) -> tuple[np.ndarray, ...]:
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  x, y = x[order], y[order]
  n_train = int(0.8 * len(y))
  return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--growth-interval", type=int, default=None)
  parser.add_argument("--initial-scale", type=float, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", default="mixed_float16", help="e.g. float32, mixed_bfloat16")
  args = parser.parse_args()

  x_train, y_train, x_test, y_test = load_data(args.seed)
  policy = mpx.get_policy(args.policy)
  model = mpx.linen.apply_policy(Cnn(), policy)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  loss_scale = "dynamic"  # the documented default: a no-op unless float16 is in the policy
  if args.initial_scale is not None or args.growth_interval is not None:
    loss_scale = functools.partial(
      mpx.dynamic_loss_scale,
      initial_scale=args.initial_scale,
      growth_interval=args.growth_interval,
    )
    print("loss scale: explicit mpx.dynamic_loss_scale (scales under every policy)")
  tx = mpx.mixed_precision(optax.adamw(3e-3, weight_decay=1e-4), policy, loss_scale=loss_scale)
  opt_state = tx.init(params)
  print(f"policy: {policy}")

  @jax.jit
  def train_step(params, opt_state, x, y):
    def loss_fn(p):
      logits = model.apply({"params": p}, x)  # output dtype of the policy: float32
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, x, y):
    return (model.apply({"params": params}, x).argmax(-1) == y).mean()

  rng = np.random.default_rng(args.seed)
  start, loss = time.perf_counter(), jnp.nan
  print(f"{'step':>6} {'loss':>8} {'scale':>10} {'skipped':>8} {'test acc':>9}")
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_train), args.batch_size)
    params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
    if step % args.log_every == 0 or step == args.steps:
      m = jax.device_get(mpx.loss_scale_metrics(opt_state))
      acc = float(accuracy(params, x_test, y_test))
      print(
        f"{step:>6} {float(loss):>8.4f} {float(m['loss_scale']):>10.0f} "
        f"{int(m['skipped_steps']):>8} {acc:>9.3f}"
      )
      try:
        mpx.check_loss_scale(opt_state)
      except mpx.LossScaleDivergedError as error:
        print(f"diverged: {error}", file=sys.stderr)
        return 1
  print(f"done in {time.perf_counter() - start:.1f} s")
  if not np.isfinite(float(loss)):
    print(f"final loss is not finite: {float(loss)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
