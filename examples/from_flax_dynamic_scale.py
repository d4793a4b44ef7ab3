"""Migrating from Flax's DynamicScale: the same float16 loop with Flax and with mpx, step by step.

Flax's own recipe for float16 (its ImageNet example) sets ``dtype=float16`` on
the model, keeps a ``flax.training.dynamic_scale.DynamicScale`` in the
``TrainState``, differentiates through ``dynamic_scale.value_and_grad`` and,
after ``apply_gradients``, puts the old params and optimizer state back with
``jnp.where(is_fin, new, old)`` when the gradients were not finite. With mpx:

==================================================  =============================================
Flax                                                mpx
==================================================  =============================================
``Model(dtype=jnp.float16)``                        ``mpx.linen.apply_policy(Model(),
                                                    "mixed_float16")``
``TrainState`` field ``dynamic_scale``              nothing: the scale lives in ``opt_state``
``DynamicScale(growth_interval=N)``                 ``mpx.mixed_precision(tx, policy,
                                                    loss_scale="flax")`` (presets take
                                                    ``growth_interval=N`` through
                                                    ``mpx.dynamic_loss_scale``)
``dynamic_scale.value_and_grad(loss_fn)(params)``   ``mpx.value_and_grad(loss_fn,
                                                    state.opt_state)(params)``
``jnp.where(is_fin, new, old)`` on params and       nothing: a skipped step returns updates of
opt_state                                           -0.0 and leaves the state untouched
``is_fin``, ``dynamic_scale.scale``                 ``mpx.loss_scale_metrics(state.opt_state)``
==================================================  =============================================

Both loops train the same linen MLP on scikit-learn's digits, from a large
initial scale (``--initial-scale``, default 2**24) so that the first steps
overflow in float16, with a short ``--growth-interval`` so that the scale also
grows. The ``flax`` preset of ``mpx.dynamic_loss_scale`` reproduces
``DynamicScale`` rule for rule (it grows on the (N+1)-th finite step and clamps
at float32's max), so the two loops run side by side and the script checks
that every step has the same loss, the same scale and the same skip decision,
and leaves the same params. "The same" is bitwise for the first three; for the
params, XLA compiles the two programs' Adam arithmetic differently (an FMA in
one, not in the other) and moves some params by a float32 ulp (about 3e-8
here), which a float16 run would then amplify, so each mpx step starts from
Flax's params and the check allows 1e-6. It exits with status 1 if anything
differs, or if the loss did not fall.

Run: ``python examples/from_flax_dynamic_scale.py`` (``--steps 12
--growth-interval 3`` for a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
from sklearn.datasets import load_digits

import mpx

# XLA may fuse the two programs' Adam arithmetic differently (an FMA here, not there), which
# moves a param by a float32 ulp or so: about 1e-8 here, never near this.
PARAM_TOLERANCE = 1e-6


class Mlp(nn.Module):
  dtype: jnp.dtype | None = None  # Flax's knob; mpx sets it from the policy

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Dense(128, dtype=self.dtype)(x))
    x = nn.relu(nn.Dense(128, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype)(x)


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class FlaxTrainState(train_state.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


def flax_loop(x, args):
  """Flax's recipe: returns the initial state and a step ``(state, x, y) -> (state, record)``."""
  model = Mlp(dtype=jnp.float16)
  state = FlaxTrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x)["params"],
    tx=optax.adam(args.learning_rate),
    dynamic_scale=dynamic_scale_lib.DynamicScale(
      growth_interval=args.growth_interval, scale=args.initial_scale
    ),
  )

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return cross_entropy(logits.astype(jnp.float32), y)

    grad_fn = state.dynamic_scale.value_and_grad(loss_fn)
    dynamic_scale, is_fin, loss, grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)
    select = functools.partial(jnp.where, is_fin)
    new_state = new_state.replace(
      opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
      params=jax.tree.map(select, new_state.params, state.params),
      dynamic_scale=dynamic_scale,
    )
    return new_state, (loss, dynamic_scale.scale, ~is_fin)

  return state, train_step


def mpx_loop(x, args):
  """The same with mpx: returns the initial state and a step ``(state, x, y) -> (state, record)``."""
  policy = mpx.get_policy("mixed_float16")
  model = mpx.linen.apply_policy(Mlp(), policy)
  loss_scale = functools.partial(
    mpx.dynamic_loss_scale,
    preset="flax",  # plain loss_scale="flax" for DynamicScale's defaults
    initial_scale=args.initial_scale,
    growth_interval=args.growth_interval,
  )
  tx = mpx.mixed_precision(optax.adam(args.learning_rate), policy, loss_scale=loss_scale)
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"], tx=tx
  )

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      return cross_entropy(state.apply_fn({"params": params}, x), y)  # float32 logits

    loss, grads = mpx.value_and_grad(loss_fn, state.opt_state)(state.params)
    state = state.apply_gradients(grads=grads)
    m = mpx.loss_scale_metrics(state.opt_state)
    return state, (loss, m["loss_scale"], m["last_step_skipped"])

  return state, train_step


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--initial-scale", type=float, default=2.0**24)
  parser.add_argument("--growth-interval", type=int, default=50)
  parser.add_argument("--log-every", type=int, default=25)
  args = parser.parse_args()

  digits = load_digits()
  x_all, y_all = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
  rng = np.random.default_rng(0)
  flax_state, flax_step = flax_loop(x_all[:1], args)
  mpx_state, mpx_step = mpx_loop(x_all[:1], args)

  print("scale: after the step; param diff: largest |flax - mpx| after the step")
  print(
    f"{'step':>5} {'flax loss':>9} {'mpx loss':>9} {'flax scale':>11} {'mpx scale':>11} skipped"
  )
  failures, losses, skips, bitwise, worst = [], [], 0, 0, 0.0
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_all), args.batch_size)
    flax_state, a = flax_step(flax_state, x_all[idx], y_all[idx])
    mpx_state, b = mpx_step(mpx_state, x_all[idx], y_all[idx])
    a, b = [(float(loss), float(scale), bool(skip)) for loss, scale, skip in (a, b)]
    diffs = jax.tree.map(lambda p, q: float(abs(p - q).max()), flax_state.params, mpx_state.params)
    diff = max(jax.tree.leaves(diffs))
    if a != b:
      failures.append(f"step {step}: flax (loss, scale, skipped) {a}, mpx {b}")
    if diff > PARAM_TOLERANCE:
      failures.append(f"step {step}: params differ by {diff:.3g}")
    if a != b or a[2] or step % args.log_every == 0 or step == args.steps:
      skipped = "yes" if a[2] else ("no" if a[2] == b[2] else "?")
      print(f"{step:>5} {a[0]:>9.4f} {b[0]:>9.4f} {a[1]:>11.0f} {b[1]:>11.0f} {skipped:>7}")
    losses.append(b[0])
    skips += a[2]
    bitwise += diff == 0
    worst = max(worst, diff)
    # Start the next mpx step from Flax's params, so that rounding differences cannot compound.
    mpx_state = mpx_state.replace(params=flax_state.params)
  print(
    f"{skips} skipped steps in both; the same loss, scale and skip decision at every step; "
    f"params bitwise equal after {bitwise} of {args.steps} steps, at most {worst:.3g} apart"
  )
  k = max(1, len(losses) // 5)
  if not np.mean(losses[-k:]) < np.mean(losses[:k]):
    failures.append(f"the loss did not fall: {np.mean(losses[:k])} -> {np.mean(losses[-k:])}")
  for failure in failures:
    print(failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
