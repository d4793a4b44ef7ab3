"""Migrating from jmp: the same float16 training loop with jmp and with mpx, compared step by step.

jmp (DeepMind's mixed-precision library, ``pip install jmp``) leaves the loop to
you: cast with a ``jmp.Policy``, scale the loss, unscale the gradients, check
them, adjust the ``jmp.DynamicLossScale``, and select between the new and the
old params and optimizer state. mpx keeps the policy (it parses jmp's policy
strings and accepts a ``jmp.Policy``) and moves the rest into the optimizer:

==========================================  ==========================================
jmp                                         mpx
==========================================  ==========================================
``jmp.get_policy("p=f32,c=f16,o=f32")``     ``mpx.get_policy(...)`` (same grammar)
``jmp.DynamicLossScale(2.**15)``, threaded  ``mpx.mixed_precision(tx, policy,
through the loop by hand                    loss_scale="jmp")``: the scale lives in
                                            ``opt_state``
``jax.grad(lambda p: ls.scale(loss(p)))``   ``mpx.value_and_grad(loss, opt_state)``
``ls.unscale(grads)``, ``jmp.all_finite``,  ``tx.update(grads, opt_state, params)``
``ls.adjust(finite)``
``jmp.select_tree(finite, new, old)``       nothing: a skipped step returns updates
                                            of -0.0 and leaves the state untouched
==========================================  ==========================================

Both loops train the same MLP on scikit-learn's digits, written in plain JAX
with the policy's casts as jmp users write them, from a deliberately large
initial scale (``--initial-scale``, default 2**20) so that the first steps
overflow in float16 and are skipped, and a short growth period
(``--period``) so that the scale also grows. The ``jmp`` preset of
``mpx.dynamic_loss_scale`` follows ``jmp.DynamicLossScale`` rule for rule, so
the two loops run side by side and the script checks that every step has the
same loss, the same scale and the same skip decision, and leaves the same
params. "The same" is bitwise for the first three; for the params, XLA may
compile the two programs' Adam arithmetic differently (an FMA in one, not in
the other) and move a param by a float32 ulp, which a float16 run would then
amplify, so each mpx step starts from jmp's params and the check allows 1e-6
(the script prints how many steps were bitwise equal: all of them on the
machines we tried). It exits with status 1 if anything differs, or if the loss
did not fall.

Requires jmp (``pip install jmp``; it is one of mpx's test dependencies).

Run: ``python examples/from_jmp.py`` (``--steps 12 --period 4`` for a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from sklearn.datasets import load_digits

import mpx

# XLA may compile the two programs' Adam arithmetic differently (an FMA here, not there), which
# would move a param by a float32 ulp or so; each mpx step starts from jmp's params, so such
# differences stay at that size.
PARAM_TOLERANCE = 1e-6


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def make_loss(policy):
  """The loss as a jmp user writes it: compute in the compute dtype, loss in float32."""

  def loss_fn(params, x, y):
    logits = mlp(policy.cast_to_compute(params), policy.cast_to_compute(x))
    logits = policy.cast_to_output(logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss_fn


def jmp_loop(params, args):
  """jmp's recipe: returns the initial state and a step ``(state, x, y) -> (state, record)``."""
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  loss_fn = make_loss(policy)
  tx = optax.adam(args.learning_rate)
  loss_scale = jmp.DynamicLossScale(jnp.float32(args.initial_scale), period=args.period)

  @jax.jit
  def train_step(state, x, y):
    params, opt_state, loss_scale = state

    def scaled_loss_fn(p):
      loss = loss_fn(p, x, y)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled_loss_fn, has_aux=True)(params)
    grads = loss_scale.unscale(policy.cast_to_param(grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
    return (params, opt_state, loss_scale), (loss, loss_scale.loss_scale, ~finite)

  return (params, tx.init(params), loss_scale), train_step


def mpx_loop(params, args):
  """The same with mpx: returns the initial state and a step ``(state, x, y) -> (state, record)``."""
  policy = mpx.get_policy("params=float32,compute=float16,output=float32")
  loss_fn = make_loss(policy)
  loss_scale = functools.partial(
    mpx.dynamic_loss_scale,
    preset="jmp",  # plain loss_scale="jmp" when jmp's defaults (2**15, period 2000) suit
    initial_scale=args.initial_scale,
    growth_interval=args.period,
  )
  tx = mpx.mixed_precision(optax.adam(args.learning_rate), policy, loss_scale=loss_scale)

  @jax.jit
  def train_step(state, x, y):
    params, opt_state = state
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = mpx.apply_updates(params, updates)
    m = mpx.loss_scale_metrics(opt_state)
    return (params, opt_state), (loss, m["loss_scale"], m["last_step_skipped"])

  return (params, tx.init(params)), train_step


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--initial-scale", type=float, default=2.0**20)
  parser.add_argument("--period", type=int, default=50, help="finite steps between growths")
  parser.add_argument("--log-every", type=int, default=25)
  args = parser.parse_args()

  digits = load_digits()
  x_all, y_all = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
  rng = np.random.default_rng(0)
  params = init_mlp(jax.random.key(0), (64, 128, 128, 10))
  jmp_state, jmp_step = jmp_loop(params, args)
  mpx_state, mpx_step = mpx_loop(params, args)

  print("scale: after the step; param diff: largest |jmp - mpx| after the step")
  print(f"{'step':>5} {'jmp loss':>9} {'mpx loss':>9} {'jmp scale':>10} {'mpx scale':>10} skipped")
  failures, losses, skips, bitwise, worst = [], [], 0, 0, 0.0
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(y_all), args.batch_size)
    jmp_state, a = jmp_step(jmp_state, x_all[idx], y_all[idx])
    mpx_state, b = mpx_step(mpx_state, x_all[idx], y_all[idx])
    a, b = [(float(loss), float(scale), bool(skip)) for loss, scale, skip in (a, b)]
    diffs = jax.tree.map(lambda p, q: float(abs(p - q).max()), jmp_state[0], mpx_state[0])
    diff = max(jax.tree.leaves(diffs))
    if a != b:
      failures.append(f"step {step}: jmp (loss, scale, skipped) {a}, mpx {b}")
    if diff > PARAM_TOLERANCE:
      failures.append(f"step {step}: params differ by {diff:.3g}")
    if a != b or a[2] or step % args.log_every == 0 or step == args.steps:
      skipped = "yes" if a[2] else ("no" if a[2] == b[2] else "?")
      print(f"{step:>5} {a[0]:>9.4f} {b[0]:>9.4f} {a[1]:>10.0f} {b[1]:>10.0f} {skipped:>7}")
    losses.append(b[0])
    skips += a[2]
    bitwise += diff == 0
    worst = max(worst, diff)
    # Start the next mpx step from jmp's params, so that rounding differences cannot compound.
    mpx_state = (jmp_state[0], mpx_state[1])
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
