"""A realistic optax pipeline in float16, checkpointed with orbax and resumed bit for bit.

The optimizer is the kind a real run uses, with mixed precision wrapped around
it as one more optax transformation:

* ``optax.clip_by_global_norm`` then ``optax.adamw`` whose learning rate follows
  ``optax.warmup_cosine_decay_schedule``, under ``optax.inject_hyperparams`` so
  the current learning rate is part of the state and can be logged;
* ``optax.MultiSteps`` accumulating ``--accumulate`` mini-batches per update;
* ``mpx.mixed_precision(..., "mixed_float16")`` outermost, so that (as
  ``mpx.dynamic_loss_scale`` recommends) every mini-batch is unscaled and
  checked before it enters MultiSteps' float32 accumulator, and clipping and
  weight decay see true float32 gradients. The loss scale grows every
  ``--growth-interval`` finite steps so that the checkpoint holds a scale that
  differs from the initial one.

The run trains a linen MLP on scikit-learn's digits for ``--steps`` mini-batches
(batch ``i`` is drawn from a generator seeded with ``i``, so a resumed run sees
the same data). It does so twice: once without interruption, and once stopped
halfway, saved with an orbax ``CheckpointManager``, restored into targets built
with ``jax.eval_shape`` (no concrete state is needed to restore), checked with
``mpx.check_state`` and resumed. It exits with status 1 unless the two runs end
with bitwise identical params and optimizer state, or if the loss does not fall.

Run: ``python examples/optax_pipeline.py`` (``--steps 8 --accumulate 2`` for a
smoke run; ``--ckpt-dir DIR`` keeps the checkpoints, by default a temporary
directory is used).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from sklearn.datasets import load_digits

import mpx


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Dense(256)(x))
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400, help="mini-batches")
  parser.add_argument("--accumulate", type=int, default=4, help="mini-batches per update")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--growth-interval", type=int, default=25)
  parser.add_argument("--log-every", type=int, default=40)
  parser.add_argument("--policy", default="mixed_float16")
  parser.add_argument("--ckpt-dir", help="where to save checkpoints (default: a temporary dir)")
  args = parser.parse_args()

  digits = load_digits()
  x_all = (digits.data / 16.0).astype(np.float32)
  y_all = digits.target.astype(np.int32)

  def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(step).integers(0, len(y_all), args.batch_size)
    return x_all[idx], y_all[idx]

  policy = mpx.get_policy(args.policy)
  model = mpx.linen.apply_policy(Mlp(), policy)
  updates_total = max(1, args.steps // args.accumulate)
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=args.learning_rate,
    warmup_steps=max(1, updates_total // 10),
    decay_steps=updates_total,
    end_value=args.learning_rate / 100,
  )
  inner = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=1e-4),
  )
  tx = mpx.mixed_precision(
    optax.MultiSteps(inner, every_k_schedule=args.accumulate),
    policy,
    loss_scale=functools.partial(mpx.dynamic_loss_scale, growth_interval=args.growth_interval),
  )

  def init() -> tuple[dict, optax.OptState]:
    params = model.init(jax.random.key(0), x_all[:1])["params"]
    return params, tx.init(params)

  @jax.jit
  def train_step(params, opt_state, x, y):
    def loss_fn(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates), opt_state, loss

  def train(params, opt_state, start: int, stop: int, *, log: bool):
    losses = []
    for step in range(start, stop):
      params, opt_state, loss = train_step(params, opt_state, *batch(step))
      losses.append(float(loss))
      if log and ((step + 1) % args.log_every == 0 or step + 1 == stop):
        m = mpx.loss_scale_metrics(opt_state)
        # The schedule's value, not its state (which inject_hyperparams keeps under the same name).
        lr = optax.tree_utils.tree_get(
          opt_state, "learning_rate", filtering=lambda _, value: isinstance(value, jax.Array)
        )
        print(
          f"{step + 1:>6} {losses[-1]:>8.4f} {float(lr):>10.2e} "
          f"{float(m['loss_scale']):>9.0f} {int(m['skipped_steps']):>8}"
        )
    return params, opt_state, losses

  start_time = time.perf_counter()
  print(f"policy: {policy}; {args.steps} mini-batches, {updates_total} updates")
  print(f"{'step':>6} {'loss':>8} {'lr':>10} {'scale':>9} {'skipped':>8}")
  params, opt_state = init()
  params, opt_state, losses = train(params, opt_state, 0, args.steps, log=True)

  halfway = args.steps // 2
  with tempfile.TemporaryDirectory() as tmp:
    directory = pathlib.Path(args.ckpt_dir or tmp).absolute()
    with ocp.CheckpointManager(directory) as manager:
      resumed_params, resumed_state = init()
      resumed_params, resumed_state, _ = train(resumed_params, resumed_state, 0, halfway, log=False)
      manager.save(
        halfway, args=ocp.args.StandardSave({"params": resumed_params, "opt_state": resumed_state})
      )
      manager.wait_until_finished()
      del resumed_params, resumed_state

      # A new process would do this: shapes and dtypes from the code, values from disk.
      abstract_params, abstract_state = jax.eval_shape(init)
      target = {"params": abstract_params, "opt_state": abstract_state}
      restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
    mpx.check_state(restored["opt_state"], restored["params"], policy)
    print(f"checkpoint at step {halfway} saved to {directory} and restored")
    resumed_params, resumed_state, _ = train(
      restored["params"], restored["opt_state"], halfway, args.steps, log=False
    )
  print(f"done in {time.perf_counter() - start_time:.1f} s")

  failures = []
  same = jax.tree.map(
    lambda a, b: a.dtype == b.dtype and bool((np.asarray(a) == np.asarray(b)).all()),
    (params, opt_state),
    (resumed_params, resumed_state),
  )
  if not all(jax.tree.leaves(same)):
    failures.append("the resumed run differs from the uninterrupted one")
  else:
    print("resumed run matches the uninterrupted one bitwise (params and optimizer state)")
  k = max(1, len(losses) // 5)
  if not np.mean(losses[-k:]) < np.mean(losses[:k]):
    failures.append(f"the loss did not fall: {np.mean(losses[:k])} -> {np.mean(losses[-k:])}")
  for failure in failures:
    print(failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
