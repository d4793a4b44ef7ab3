"""Tests for mpx.nnx.apply_policy on NNX graphs."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from marks import all_but
from optax_compat import standard_promotion

import mpx


class Decoder(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)
    self.head = nnx.Linear(16, 32, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.attn(self.norm(x), mask=nnx.make_causal_mask(ids))
    x = x + self.down(nnx.gelu(self.up(self.norm(x))))
    return self.head(x)


def _dot_operands(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  found = []

  def walk(j):
    for e in j.eqns:
      if e.primitive.name in ("dot_general", "conv_general_dilated"):
        found.append(tuple(str(v.aval.dtype) for v in e.invars))
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16", "bfloat16", "float32"])
def test_decoder_params_matmuls_and_output(name):
  policy = mpx.get_policy(name)
  model = mpx.nnx.apply_policy(Decoder(nnx.Rngs(0)), policy)
  assert model.up.kernel.dtype == policy.param_dtype
  assert model.norm.scale.dtype == jnp.float32 and model.norm.dtype == jnp.float32
  ids = jnp.arange(8, dtype=jnp.int32).reshape(1, 8)
  out = model(ids)
  assert out.dtype == policy.output_dtype
  assert model.norm(jnp.ones((1, 16), policy.compute_dtype)).dtype == policy.compute_dtype
  dots = _dot_operands(lambda m: m(ids), model)
  assert len(dots) == 9 and all(set(d) == {str(policy.compute_dtype)} for d in dots)


@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_train_step_with_optimizer_jit_and_split_merge(name):
  model = mpx.nnx.apply_policy(Decoder(nnx.Rngs(0)), name)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32

  def loss_fn(m):
    logits = m(ids[:, :-1])
    assert logits.dtype == jnp.float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

  @nnx.jit
  def step(m, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss

  first = step(model, optimizer)
  for _ in range(5):
    last = step(model, optimizer)
  assert last < first
  assert model.up.kernel.dtype == jnp.float32

  graphdef, state = nnx.split(model)
  clone = nnx.merge(graphdef, state)
  assert clone(ids).dtype == jnp.float32
  assert set(_dot_operands(lambda m: m(ids), clone)) == {
    (str(mpx.get_policy(name).compute_dtype),) * 2
  }

  @jax.jit
  def grads_of(state):
    return jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s)))(state)

  text = jax.jit(grads_of).lower(state).as_text()
  half = {"mixed_bfloat16": "bf16", "mixed_float16": "f16"}[name]
  lines = [ln.split(":")[-1].split("->")[0] for ln in text.splitlines() if "dot_general" in ln]
  assert lines and all(ln.count(f"x{half}>") == 2 for ln in lines)


class _PinnedMlp(nnx.Module):
  """Every layer pinned to one floating dtype, as a user may write it."""

  def __init__(self, pinned, rngs: nnx.Rngs):
    self.up = nnx.Linear(16, 8, dtype=pinned, param_dtype=pinned, rngs=rngs)
    self.down = nnx.Linear(8, 4, dtype=pinned, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


@pytest.mark.parametrize("pinned", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_layers_pinned_to_any_floating_dtype_follow_the_policy(pinned, name):
  policy = mpx.get_policy(name)
  model = mpx.nnx.apply_policy(_PinnedMlp(pinned, nnx.Rngs(0)), policy)
  assert {np.dtype(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
    np.dtype(jnp.float32)
  }
  x = jnp.ones((8, 16))
  assert model(x).dtype == jnp.float32
  graphdef, state = nnx.split(model)

  def loss(s):
    return nnx.merge(graphdef, s)(x).sum()

  report = mpx.audit(jax.value_and_grad(loss), state, policy=policy)
  compute = np.dtype(policy.compute_dtype)
  assert len(report.ops) == 5, str(report)  # two forward products, three backward
  assert {(op.lhs_dtype, op.rhs_dtype) for op in report.ops} == {(compute, compute)}, str(report)


def test_batchnorm_train_mode_stats_float32():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
      y = self.bn(self.conv(x))
      return y + self.conv(x)  # the float32 norm output was handed back in half

  model = mpx.nnx.apply_policy(Net(nnx.Rngs(0)), "mixed_float16", accumulate_in_float32=True)
  model.train()
  out = nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, 6, 6, 1)))
  assert out.dtype == jnp.float32
  assert model.bn.mean.dtype == jnp.float32 and float(model.bn.mean[...].sum()) != 0.0
  assert model.conv.kernel.dtype == jnp.float32


def test_rules_by_instance_path_and_subtree():
  model = Decoder(nnx.Rngs(0))
  rules = mpx.KeepRules().with_instance(model.head, "float32").with_path("^attn$", "mixed_float16")
  mpx.nnx.apply_policy(model, "bfloat16", rules=rules)
  assert model.head.kernel.dtype == jnp.float32 and model.up.kernel.dtype == jnp.bfloat16
  assert model.attn.query.kernel.dtype == jnp.float32  # subtree: params=float32
  assert model.attn.query.dtype == jnp.float16
  ids = jnp.zeros((1, 4), jnp.int32)
  dots = _dot_operands(lambda m: m(ids), model)
  assert ("float32", "float32") in dots and ("float16", "float16") in dots
  assert ("bfloat16", "bfloat16") in dots
  assert model(ids).dtype == jnp.bfloat16


def test_bad_input():
  model = mpx.nnx.apply_policy(Decoder(nnx.Rngs(0)), "mixed_bfloat16")
  assert mpx.nnx.apply_policy(model, "mixed_bfloat16") is model
  with pytest.raises(mpx.PolicyError, match="already runs under"):
    mpx.nnx.apply_policy(model, "float16")
  with pytest.warns(mpx.PrecisionWarning, match=r"'nothing'.*attn/query"):
    mpx.nnx.apply_policy(
      Decoder(nnx.Rngs(0)), "float32", rules=mpx.KeepRules(paths={"nothing": "float32"})
    )


class _Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(16, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.l2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.norm(jax.nn.relu(self.l1(x))))


@pytest.mark.parametrize(
  ("spec", "param_dtype"),
  [("mixed_float16", jnp.float32), ("params=float16,compute=float16,output=float32", jnp.float16)],
)
def test_nnx_optimizer_with_mixed_precision_reads_the_scale_from_its_state(spec, param_dtype):
  # The API sketch's NNX loop: mpx.mixed_precision inside nnx.Optimizer, scale read from its state.
  policy = mpx.get_policy(spec)
  model = mpx.nnx.apply_policy(_Mlp(nnx.Rngs(0)), policy)
  # optax.adamw's bias correction is not strict-promotion clean (an optax matter, not mpx's).
  tx = mpx.mixed_precision(standard_promotion(optax.adamw(1e-2)), policy)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (32, 16))
  y = jnp.arange(32) % 10

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = mpx.value_and_grad(loss_fn, optimizer.opt_state)(model)
    with jax.numpy_dtype_promotion("standard"):  # optax: half params + float32 updates
      optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, x, y)) for _ in range(30)]
  assert losses[-1] < 0.2 * losses[0]
  assert model.l1.kernel.dtype == param_dtype and model.norm.scale.dtype == jnp.float32
  metrics = mpx.loss_scale_metrics(optimizer.opt_state)
  assert float(metrics["loss_scale"]) == float(mpx.get_loss_scale(optimizer.opt_state)) > 1.0
  assert int(metrics["skipped_steps"]) + int(metrics["growth_tracker"]) == 30


class _DropoutNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(8, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)

  def __call__(self, x, rngs: nnx.Rngs):
    return self.dropout(self.linear(x), rngs=rngs)


def _dropout_masks(policy, steps):
  """Trains ``steps`` steps with dropout; returns the Rngs count and each step's mask."""
  model = _DropoutNet(nnx.Rngs(0))
  if policy is not None:
    mpx.nnx.apply_policy(model, policy)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  rngs = nnx.Rngs(dropout=1)
  x = jax.random.normal(jax.random.key(2), (4, 8))

  def loss_fn(m, rngs):
    y = m(x, rngs)
    return jnp.mean(jnp.square(y.astype(jnp.float32))), y != 0

  @nnx.jit
  def step(m, opt, rngs):
    (_, mask), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m, rngs)
    opt.update(m, grads)
    return mask

  masks = [step(model, optimizer, rngs) for _ in range(steps)]
  return int(rngs.dropout.count[...]), masks


@pytest.mark.parametrize("name", ["float32", "mixed_bfloat16"])
def test_rngs_passed_to_the_model_advance_as_without_a_policy(name):
  # The root's input cast must hand the model the caller's Rngs, not a pytree copy of it.
  count, masks = _dropout_masks(name, steps=3)
  reference_count, reference_masks = _dropout_masks(None, steps=3)
  assert count == reference_count == 3
  assert not jnp.array_equal(masks[0], masks[1]) and not jnp.array_equal(masks[1], masks[2])
  for mask, reference in zip(masks, reference_masks, strict=True):
    assert jnp.array_equal(mask, reference)


def test_applying_other_rules_or_settings_again_raises_and_leaves_params_alone():
  model = mpx.nnx.apply_policy(Decoder(nnx.Rngs(0)), "bfloat16")
  kernel = np.asarray(model.head.kernel[...])
  with pytest.raises(mpx.PolicyError, match="with other keep rules"):
    mpx.nnx.apply_policy(model, "bfloat16", rules=mpx.KeepRules().with_path("^head$", "float32"))
  with pytest.raises(mpx.PolicyError, match="accumulate_in_float32=True"):
    mpx.nnx.apply_policy(model, "bfloat16", accumulate_in_float32=True)
  assert model.head.kernel.dtype == jnp.bfloat16 and model.head.dtype == jnp.bfloat16
  np.testing.assert_array_equal(model.head.kernel[...], kernel)


def test_applying_the_same_settings_again_returns_the_model_unchanged():
  rngs = nnx.Rngs(0)
  model = Decoder(rngs)
  rules = mpx.KeepRules().with_instance(model.head, "float32")
  mpx.nnx.apply_policy(model, "bfloat16", rules=rules)
  before = jax.tree.map(np.asarray, nnx.state(model))
  graphdef = nnx.graphdef(model)
  assert mpx.nnx.apply_policy(model, "bfloat16", rules=rules) is model
  assert nnx.graphdef(model) == graphdef
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)
  assert model.head.kernel.dtype == jnp.float32 and model.up.kernel.dtype == jnp.bfloat16


@pytest.mark.parametrize(
  ("model", "match"),
  [
    (nn.Dense(4), r"linen module Dense.*mpx\.linen\.apply_policy"),
    (mpx.linen.apply_policy(nn.Dense(4), "mixed_bfloat16"), r"linen module.*mpx\.linen\."),
    ({"kernel": jnp.ones((2, 2))}, r"got dict\..*cast_to_param"),
    (None, r"got NoneType"),
  ],
  ids=["linen", "linen-policy-model", "dict", "none"],
)
def test_anything_but_an_nnx_module_raises_a_policy_error(model, match):
  with pytest.raises(mpx.PolicyError, match=match):
    mpx.nnx.apply_policy(model, "mixed_bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize(
  "copy_fn", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy], ids=["pickle", "deepcopy"]
)
@pytest.mark.parametrize(
  "name", all_but(["mixed_float16", "mixed_float8_delayed"], "mixed_float8_delayed")
)
def test_a_policy_applied_model_pickles_and_copies_to_an_equal_working_model(copy_fn, name):
  model = mpx.nnx.apply_policy(Decoder(nnx.Rngs(0)), name)
  copied = copy_fn(model)
  assert copied is not model
  assert nnx.graphdef(copied) == nnx.graphdef(model)
  assert type(copied.norm) is type(model.norm) and type(copied) is type(model)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(copied), nnx.state(model))
  ids = jnp.arange(8, dtype=jnp.int32).reshape(1, 8)
  out = copied(ids)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, model(ids))
  compute = str(mpx.get_policy(name).compute_dtype)
  dots = _dot_operands(lambda m: m(ids), copied)
  assert dots and all(compute in d or "float8" in d[0] for d in dots)
  assert copied.norm(jnp.ones((1, 16), jnp.float32)).dtype == mpx.get_policy(name).compute_dtype
  # The copy keeps its policy record: another policy on top is refused.
  with pytest.raises(mpx.PolicyError, match="already runs under"):
    mpx.nnx.apply_policy(copied, "float16")
