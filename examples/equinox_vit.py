"""Trains an Equinox vision transformer on scikit-learn's digits in float16: MPX's example, on mpx.

MPX (the Equinox library ``mixed-precision-for-jax``) ships a ViT trained on
CIFAR-100 under float16 loss scaling; this is that example on mpx's API, on
data that ships with scikit-learn. The ViT is plain Equinox, with no dtype: a
linear patch embedding, pre-norm blocks (Equinox's ``MultiheadAttention``,
``LayerNorm`` and ``MLP``) built as one stack by ``eqx.filter_vmap`` and run
by a ``jax.lax.scan``, and a linear head; it takes one image and is batched
with ``jax.vmap``, as Equinox models are. The step differs from a float32 one
by three lines: ``mpx.eqx.apply_policy`` (the model), ``mpx.mixed_precision``
(unscale, check, skip, adjust) and ``mpx.value_and_grad`` (scaled gradients,
true loss). It logs the loss, the scale and the skipped steps, ends with
``mpx.audit`` of the train step (the share of matmul FLOPs with half-precision
operands, by layer path), and exits with status 1 if training diverged, the
final loss is not finite, or a product of the step is not in half precision.

Run: ``python examples/equinox_vit.py --steps 300`` (``--policy float32`` for the
float32 run, ``--policy mixed_float8`` for float8 layers).
"""

from __future__ import annotations

import argparse
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import mpx


class Block(eqx.Module):
  """A pre-norm transformer block for one image's patches."""

  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, width: int, heads: int, *, key: jax.Array) -> None:
    k1, k2 = jax.random.split(key)
    self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
    self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
    self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h)
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class ViT(eqx.Module):
  """A ViT for one 8x8 image: 16 patches of 2x2 pixels."""

  patch_embedding: eqx.nn.Linear
  positions: jax.Array
  blocks: Block
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, *, width: int, depth: int, heads: int, key: jax.Array) -> None:
    keys = jax.random.split(key, 4)
    self.patch_embedding = eqx.nn.Linear(4, width, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (16, width))
    make_block = lambda k: Block(width, heads, key=k)  # noqa: E731
    self.blocks = eqx.filter_vmap(make_block)(jax.random.split(keys[2], depth))
    self.norm = eqx.nn.LayerNorm(width)
    self.head = eqx.nn.Linear(width, 10, key=keys[3])

  def __call__(self, image: jax.Array) -> jax.Array:
    patches = image.reshape(4, 2, 4, 2).transpose(0, 2, 1, 3).reshape(16, 4)
    x = jax.vmap(self.patch_embedding)(patches) + self.positions
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)
    x, _ = jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, dynamic)
    return self.head(jnp.mean(jax.vmap(self.norm)(x), axis=0))


def load_data(seed: int) -> tuple[np.ndarray, ...]:
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_train = int(0.8 * len(y))
  return x[order][:n_train], y[order][:n_train], x[order][n_train:], y[order][n_train:]


def loss_fn(model: ViT, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = jax.vmap(model)(x)  # the policy's output dtype: float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", default="mixed_float16", help="e.g. float32, mixed_bfloat16")
  args = parser.parse_args()

  x_train, y_train, x_test, y_test = load_data(args.seed)
  model = ViT(width=args.width, depth=args.depth, heads=2, key=jax.random.key(args.seed))
  model = mpx.eqx.apply_policy(model, args.policy)
  tx = mpx.mixed_precision(optax.adamw(3e-3, weight_decay=1e-4), args.policy)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  print(f"policy: {mpx.get_policy(args.policy)}")

  def train_step(model, opt_state, x, y):
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32 count
      updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss

  step = eqx.filter_jit(train_step)
  accuracy = eqx.filter_jit(lambda m, x, y: (jax.vmap(m)(x).argmax(-1) == y).mean())
  rng = np.random.default_rng(args.seed)
  start, loss = time.perf_counter(), jnp.nan
  print(f"{'step':>6} {'loss':>8} {'scale':>10} {'skipped':>8} {'test acc':>9}")
  for i in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_train), args.batch_size)
    model, opt_state, loss = step(model, opt_state, x_train[idx], y_train[idx])
    if i % args.log_every == 0 or i == args.steps:
      m = jax.device_get(mpx.loss_scale_metrics(opt_state))
      acc = float(accuracy(model, x_test, y_test))
      print(
        f"{i:>6} {float(loss):>8.4f} {float(m['loss_scale']):>10.0f} "
        f"{int(m['skipped_steps']):>8} {acc:>9.3f}"
      )
      try:
        mpx.check_loss_scale(opt_state)
      except mpx.LossScaleDivergedError as error:
        print(f"diverged: {error}", file=sys.stderr)
        return 1
  print(f"done in {time.perf_counter() - start:.1f} s")

  # The audit of one train step: every matmul's operand dtypes, by Equinox path.
  dynamic, static = eqx.partition((model, opt_state), eqx.is_array)
  batch = (x_train[: args.batch_size], y_train[: args.batch_size])

  def flat_step(dynamic, x, y):
    model, opt_state, loss = train_step(*eqx.combine(dynamic, static), x, y)
    return eqx.filter((model, opt_state), eqx.is_array), loss

  report = mpx.audit(flat_step, dynamic, *batch, policy=args.policy)
  paths = sorted({op.module_path for op in report.ops})
  print(f"audit: {report.half_flops_share:.1%} of matmul FLOPs in half precision; layers {paths}")
  if not np.isfinite(float(loss)):
    print(f"final loss is not finite: {float(loss)}", file=sys.stderr)
    return 1
  compute = mpx.get_policy(args.policy).compute_dtype
  if compute != np.dtype("float32") and report.half_flops_share < 1.0:
    print(f"products outside half precision:\n{report}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
