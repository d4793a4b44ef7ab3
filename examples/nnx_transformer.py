"""A character-level NNX transformer decoder in bfloat16, with an audit of its train step.

A small GPT-style decoder (token and position embeddings, pre-norm blocks of
Flax's ``nnx.MultiHeadAttention`` with a causal mask and an MLP) learns to
predict the next byte of the Python documentation that ships with Python
(``pydoc_data.topics``), trained with ``nnx.Optimizer`` and ``nnx.jit`` under
``--policy`` (default ``mixed_bfloat16``: float32 params, bfloat16 compute,
float32 logits). The model is written without dtype arguments:

* ``mpx.nnx.apply_policy`` sets every layer to the policy, keeps the
  LayerNorms in float32, and gives the attention layers mpx's
  ``dot_product_attention`` (bfloat16 products around a float32 softmax);
* ``mpx.mixed_precision`` wraps ``optax.adamw``; under bfloat16 its default
  ``loss_scale="dynamic"`` is a no-op, under ``--policy mixed_float16`` it
  scales dynamically, with the same train step;
* ``mpx.value_and_grad`` differentiates the (scaled) loss.

At the end ``mpx.audit`` lists every matmul of the train step (forward and
backward) with its operand dtypes, and the model writes a short greedy sample.
The script exits with status 1 if the loss does not fall, or if under a half
policy less than 95% of the matmul FLOPs run with half-precision operands.

Run: ``python examples/nnx_transformer.py`` (``--steps 5 --sample-chars 8``
for a smoke run, ``--policy mixed_float16`` for float16 with loss scaling).
"""

from __future__ import annotations

import argparse
import sys
import time
from pydoc_data import topics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mpx


class Block(nnx.Module):
  """A pre-norm transformer block: causal self-attention, then an MLP."""

  def __init__(self, features: int, num_heads: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(features, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads, features, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(features, rngs=rngs)
    self.mlp_in = nnx.Linear(features, 4 * features, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * features, features, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Decoder(nnx.Module):
  """Embeddings, ``num_layers`` blocks, a final norm and a linear head over bytes."""

  def __init__(self, *, seq_len: int, features: int, num_heads: int, num_layers: int, rngs):
    self.token_embed = nnx.Embed(256, features, rngs=rngs)
    self.position_embed = nnx.Embed(seq_len, features, rngs=rngs)
    self.blocks = nnx.List([Block(features, num_heads, rngs=rngs) for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(features, rngs=rngs)
    self.head = nnx.Linear(features, 256, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    positions = jnp.arange(tokens.shape[-1])
    x = self.token_embed(tokens) + self.position_embed(positions)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def load_text() -> np.ndarray:
  """The bytes of Python's bundled documentation topics, about 460 kB."""
  text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--features", type=int, default=128)
  parser.add_argument("--num-heads", type=int, default=4)
  parser.add_argument("--num-layers", type=int, default=2)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--sample-chars", type=int, default=120)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", default="mixed_bfloat16", help="e.g. float32, mixed_float16")
  args = parser.parse_args()

  data = load_text()
  policy = mpx.get_policy(args.policy)
  model = Decoder(
    seq_len=args.seq_len,
    features=args.features,
    num_heads=args.num_heads,
    num_layers=args.num_layers,
    rngs=nnx.Rngs(args.seed),
  )
  model = mpx.nnx.apply_policy(model, policy)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.learning_rate, min(100, args.steps // 4 + 1), args.steps
  )
  tx = mpx.mixed_precision(optax.adamw(schedule, weight_decay=0.01), policy)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  print(f"policy: {policy}; {len(data)} bytes of text")

  @nnx.jit
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])  # float32: the policy's output dtype
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = mpx.value_and_grad(loss_fn, optimizer.opt_state)(model)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(args.seed)

  def batch() -> np.ndarray:
    starts = rng.integers(0, len(data) - args.seq_len - 1, args.batch_size)
    return np.stack([data[s : s + args.seq_len + 1] for s in starts])

  losses, start = [], time.perf_counter()
  print(f"{'step':>6} {'loss':>8} {'scale':>8} {'skipped':>8}")
  for step in range(1, args.steps + 1):
    losses.append(float(train_step(model, optimizer, batch())))
    if step % args.log_every == 0 or step == args.steps:
      m = jax.device_get(mpx.loss_scale_metrics(optimizer.opt_state))
      scale, skipped = float(m["loss_scale"]), int(m["skipped_steps"])
      print(f"{step:>6} {losses[-1]:>8.4f} {scale:>8.0f} {skipped:>8}")
  print(f"done in {time.perf_counter() - start:.1f} s")

  # Lowered, not run: the StableHLO of the very step that trained the model.
  report = mpx.audit(train_step, model, optimizer, batch(), policy=policy)
  print(report.filter(backward=False))  # the backward pass has twice as many rows
  print(
    f"train step: {len(report.ops)} matmuls, {report.half_flops_share:.1%} of their FLOPs "
    f"with half-precision operands, {len(report.float32_ops)} with float32 operands"
  )

  @nnx.jit
  def next_byte(model, window, length):
    return model(window)[0, length - 1].argmax()

  prompt = b"def "
  window = np.zeros((1, args.seq_len), np.int32)
  window[0, : len(prompt)] = list(prompt)
  sample = bytearray(prompt)
  for _ in range(args.sample_chars):
    length = min(len(sample), args.seq_len)
    window[0, :length] = list(sample[-length:])
    sample.append(int(next_byte(model, window, length)))
  print("sample:", sample.decode("utf-8", errors="replace"))

  failures = []
  k = max(1, len(losses) // 5)
  if not np.mean(losses[-k:]) < np.mean(losses[:k]):
    failures.append(f"the loss did not fall: {np.mean(losses[:k])} -> {np.mean(losses[-k:])}")
  if jnp.dtype(policy.compute_dtype).itemsize == 2 and not report.half_flops_share >= 0.95:
    failures.append(f"only {report.half_flops_share:.1%} of matmul FLOPs in half precision")
  for failure in failures:
    print(failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
