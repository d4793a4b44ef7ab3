"""NNX models built with Flax's lifted transforms: ``nnx.vmap`` layer stacks run by ``nnx.scan``
over ``nnx.remat``, trained under every preset.

The model is a small Llama-style decoder (:class:`models.NnxLlama`); its unrolled twin (a
Python loop over separate blocks) is the reference for the audit's shares.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from marks import all_but
from models import NnxLlama, lm_batch, text_tokens
from optax_compat import standard_promotion

import mpx

PRESETS = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_float8", "mixed_float8_delayed"]
STEPS = 3
LAYERS = 2


def _loss(model, tokens, targets, rngs):
  logits = model(tokens, rngs).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _train_step(policy):
  """``nnx.jit`` train step; with delayed fp8 it also folds the observed amaxes in."""
  delayed = policy.fp8 is not None and policy.fp8.delayed
  wrt = nnx.DiffState(0, nnx.Any(nnx.Param, mpx.nnx.Fp8History)) if delayed else 0

  @nnx.jit
  def step(model, optimizer, tokens, targets, rngs):
    grad_fn = mpx.value_and_grad(_loss, optimizer.opt_state, argnums=wrt)
    loss, grads = grad_fn(model, tokens, targets, rngs)
    if delayed:
      grads, observed = nnx.split_state(grads, nnx.Param, mpx.nnx.Fp8History)
    optimizer.update(model, grads)
    if delayed:
      history = nnx.state(model, mpx.nnx.Fp8History)
      new_history = mpx.fp8.update_fp8_state(history, observed, opt_state=optimizer.opt_state)
      nnx.update(model, new_history)
    return loss

  return step


def _setup(name, *, stacked):
  policy = mpx.get_policy(name)
  model = mpx.nnx.apply_policy(
    NnxLlama(stacked=stacked, num_layers=LAYERS, rngs=nnx.Rngs(0)), policy
  )
  tx = mpx.mixed_precision(standard_promotion(optax.adam(3e-3)), policy)
  return policy, model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@functools.cache
def _batch():
  tokens, targets = lm_batch(text_tokens(), 0, batch_size=4, seq_len=16)
  return jnp.asarray(tokens), jnp.asarray(targets)


def _audit(name, *, stacked):
  policy, model, optimizer = _setup(name, stacked=stacked)
  return mpx.audit(_train_step(policy), model, optimizer, *_batch(), nnx.Rngs(dropout=1))


@pytest.mark.slow
@pytest.mark.parametrize("name", all_but(PRESETS, "mixed_float16"))
def test_stacked_decoder_trains_under_every_preset(name):
  policy, model, optimizer = _setup(name, stacked=True)
  step = _train_step(policy)
  rngs = nnx.Rngs(dropout=1)
  losses = [float(step(model, optimizer, *_batch(), rngs)) for _ in range(STEPS)]
  assert losses[-1] < losses[0], losses

  blocks = model.blocks
  for layer in (blocks.gate, blocks.up, blocks.down, blocks.attn.query, model.head):
    assert layer.kernel.dtype == policy.param_dtype
    assert layer.dtype == policy.compute_dtype
  for norm in (blocks.attn_norm, blocks.mlp_norm, model.norm):
    assert norm.scale.dtype == jnp.float32 and norm.dtype == jnp.float32
  assert blocks.gate.kernel.shape[0] == LAYERS
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    assert bool(jnp.all(jnp.isfinite(leaf)))

  histories = jax.tree.leaves(nnx.state(model, mpx.nnx.Fp8History))
  if policy.fp8 is not None and policy.fp8.delayed:
    length = policy.fp8.history_length + 1
    assert blocks.gate.dot_general.lhs.shape == (LAYERS, length)
    assert model.head.dot_general.lhs.shape == (length,)
    for history in histories:
      assert bool(jnp.all(jnp.isfinite(history)))
      # One committed amax per step, for every layer of the stack.
      assert bool(jnp.all(history[..., 1 : STEPS + 1] > 0)), history
  else:
    assert histories == []

  # The embedding dropout draws from the Rngs passed in; each block's from its own stream.
  assert int(rngs.dropout.count[...]) == STEPS
  np.testing.assert_array_equal(blocks.dropout.rngs.count[...], np.full(LAYERS, STEPS))
  if policy.compute_dtype == jnp.float16:
    metrics = mpx.loss_scale_metrics(optimizer.opt_state)
    assert int(metrics["skipped_steps"]) == 0 and float(metrics["loss_scale"]) > 1


@pytest.mark.slow
@pytest.mark.parametrize("name", all_but(PRESETS, "mixed_bfloat16"))
def test_audit_of_the_stacked_step_matches_the_unrolled_one(name):
  stacked, unrolled = _audit(name, stacked=True), _audit(name, stacked=False)
  assert stacked.half_flops_share == pytest.approx(unrolled.half_flops_share)
  assert stacked.fp8_flops_share == pytest.approx(unrolled.fp8_flops_share)
  policy = mpx.get_policy(name)
  if policy.compute_dtype == jnp.float32:
    assert stacked.half_flops_share == 0
  else:
    assert stacked.half_flops_share > 0.9
  assert (stacked.fp8_flops_share > 0.5) == (policy.fp8 is not None)


class _Stage(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(16, 16, rngs=rngs)
    self.general = nnx.LinearGeneral(16, (2, 8), rngs=rngs)
    self.einsum = nnx.Einsum("bhd,hdk->bk", (2, 8, 16), rngs=rngs)

  def __call__(self, x):
    return self.einsum(self.general(self.linear(x)))


def _stage_stack(policy_inside):
  @nnx.split_rngs(splits=LAYERS + 1)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    stage = _Stage(rngs)
    return stage if policy_inside is None else mpx.nnx.apply_policy(stage, policy_inside)

  return make(nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("where", all_but(["after_vmap", "inside_vmap"], "inside_vmap"))
def test_delayed_fp8_histories_follow_an_nnx_vmap_stack(where):
  name = "mixed_float8_delayed"
  stack = _stage_stack(name if where == "inside_vmap" else None)
  if where == "after_vmap":
    mpx.nnx.apply_policy(stack, name)
  layers = LAYERS + 1
  length = mpx.get_policy(name).fp8.history_length + 1
  histories = nnx.state(stack, mpx.nnx.Fp8History)
  assert len(jax.tree.leaves(histories)) == 9  # lhs, rhs and grad of three layers
  for history in jax.tree.leaves(histories):
    assert history.shape == (layers, length)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def run(x, stage):
    return stage(x)

  def loss(stack, x):
    return jnp.mean(jnp.square(run(x, stack).astype(jnp.float32)))

  x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
  observed = nnx.grad(loss, argnums=nnx.DiffState(0, mpx.nnx.Fp8History))(stack, x)
  nnx.update(stack, mpx.fp8.update_fp8_state(histories, observed))
  # Each layer of the stack records its own input's amax in its own row.
  lhs = np.asarray(stack.linear.dot_general.lhs[...])
  assert lhs[0, 1] == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))
  assert np.all(lhs[:, 1] > 0) and len(set(lhs[:, 1].tolist())) == layers
  for history in jax.tree.leaves(nnx.state(stack, mpx.nnx.Fp8History)):
    assert bool(np.all(history[:, 0] == 0)) and bool(np.all(history[:, 1] > 0))


@pytest.mark.slow
def test_activations_and_locator_tap_outside_the_transforms_and_skip_inside():
  _, model, optimizer = _setup("mixed_float16", stacked=True)
  rngs = nnx.Rngs(dropout=1)
  stats = mpx.nnx.collect_activations(_loss, model, *_batch(), rngs, loss_scale=optimizer.opt_state)
  # The blocks run inside nnx.scan / nnx.remat: not tapped. The layers around them are.
  assert stats.modules == ("embed", "dropout", "norm", "head", "<root>")
  assert not any(path.startswith("blocks") for path in stats.modules)
  assert int(rngs.dropout.count[...]) == 0  # a private copy: the caller's Rngs is untouched
  report = mpx.nnx.locate_nonfinite(_loss, model, *_batch(), rngs, loss_scale=optimizer.opt_state)
  assert report.forward is None and report.cause == "finite"
