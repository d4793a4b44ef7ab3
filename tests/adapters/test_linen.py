"""Tests for mpx.linen.apply_policy on unmodified linen models."""

import dataclasses
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import mpx

HALF = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}


class InlineMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))


class SetupMLP(nn.Module):
  def setup(self):
    self.hidden = nn.Dense(8)
    self.norm = nn.LayerNorm()
    self.out = nn.Dense(4)

  def __call__(self, x):
    h = self.hidden(x)
    return self.out(h + self.norm(h))


class AttributeMLP(nn.Module):
  hidden: nn.Module
  out: nn.Module

  def __call__(self, x):
    return self.out(nn.relu(self.hidden(x)))


class PinnedConfigMLP(nn.Module):
  """Like Flax's ImageNet example: dtype=float32 as a config default."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=self.dtype, param_dtype=jnp.float32)(x)
    return nn.Dense(4, dtype=self.dtype)(nn.relu(x))


MODELS = {
  "inline": InlineMLP,
  "setup": SetupMLP,
  "attribute": lambda: AttributeMLP(nn.Dense(8), nn.Dense(4)),
  "pinned": PinnedConfigMLP,
}


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(32, 16)(ids)
    h = nn.MultiHeadDotProductAttention(num_heads=2)(
      nn.LayerNorm()(x), mask=nn.make_causal_mask(ids)
    )
    x = x + h
    x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
    return nn.Dense(32, name="head")(nn.LayerNorm()(x))


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.Conv(8, (3, 3))(x)
    y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
    y = y + nn.Conv(8, (3, 3))(y)
    return nn.Dense(10)(y.mean(axis=(1, 2)))


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of its sub-jaxprs (jits, custom VJPs), in order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _dots(fn, *args):
  """Operand dtypes of every dot_general/conv in fn's jaxpr, recursively."""
  return [
    tuple(str(v.aval.dtype) for v in eqn.invars)
    for eqn in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)
    if eqn.primitive.name in ("dot_general", "conv_general_dilated")
  ]


def _dtypes(tree):
  return set(jax.tree.leaves(jax.tree.map(lambda a: str(a.dtype), tree)))


@pytest.mark.parametrize("style", MODELS)
@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16", "float32", "bfloat16"])
def test_every_style_computes_in_policy(style, name):
  policy = mpx.get_policy(name)
  model = mpx.linen.apply_policy(MODELS[style](), policy)
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  params_dtypes = {
    path: a.dtype for path, a in jax.tree_util.tree_leaves_with_path(variables["params"])
  }
  for path, dtype in params_dtypes.items():
    want = jnp.float32 if "norm" in jax.tree_util.keystr(path) else policy.param_dtype
    assert dtype == want, path
  out, inter = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
  assert out.dtype == policy.output_dtype
  for path, value in jax.tree_util.tree_leaves_with_path(inter["intermediates"]):
    key = jax.tree_util.keystr(path)
    if key.startswith("['__call__']"):
      continue  # the root's output, checked above
    assert value.dtype == policy.compute_dtype, key
  dots = _dots(lambda v: model.apply(v, x), variables)
  assert dots and all(set(d) == {str(policy.compute_dtype)} for d in dots)


class PinnedMlp(nn.Module):
  """Every layer pinned to one floating dtype, as a user may write it."""

  pinned: Any

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, dtype=self.pinned, param_dtype=self.pinned)(x))
    return nn.Dense(4, dtype=self.pinned)(x)


@pytest.mark.parametrize("pinned", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_layers_pinned_to_any_floating_dtype_follow_the_policy(pinned, name):
  policy = mpx.get_policy(name)
  model = mpx.linen.apply_policy(PinnedMlp(pinned), policy)
  x = jnp.ones((8, 16))
  params = model.init(jax.random.key(0), x)["params"]
  assert _dtypes(params) == {"float32"}
  assert model.apply({"params": params}, x).dtype == jnp.float32

  def loss(p):
    return model.apply({"params": p}, x).sum()

  report = mpx.audit(jax.value_and_grad(loss), params, policy=policy)
  compute = np.dtype(policy.compute_dtype)
  assert len(report.ops) == 5, str(report)  # two forward products, three backward
  assert {(op.lhs_dtype, op.rhs_dtype) for op in report.ops} == {(compute, compute)}, str(report)


def test_user_objects_are_not_mutated():
  hidden = nn.Dense(8)
  raw = AttributeMLP(hidden, nn.Dense(4))
  model = mpx.linen.apply_policy(raw, "mixed_float16")
  model.init(jax.random.key(0), jnp.ones((1, 3)))
  assert hidden.dtype is None and raw.hidden.dtype is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_decoder_train_step_all_half_matmuls(name, accumulate):
  model = mpx.linen.apply_policy(Decoder(), name, accumulate_in_float32=accumulate)
  ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  params = model.init(jax.random.key(0), ids)["params"]
  assert _dtypes(params) == {"float32"}

  def loss(p):
    logits = model.apply({"params": p}, ids)
    assert logits.dtype == jnp.float32
    return logits.sum()

  text = jax.jit(jax.value_and_grad(loss)).lower(params).as_text()
  lines = [ln.split(":")[-1] for ln in text.splitlines() if "dot_general" in ln]
  half = {"mixed_bfloat16": "bf16", "mixed_float16": "f16"}[name]
  assert len(lines) >= 18
  for line in lines:
    operands, _ = line.split("->")
    assert operands.count(f"x{half}>") == 2, line
  if accumulate:  # Dense layers (not the attention einsums) now return float32 products
    assert sum(r.strip().endswith("xf32>") for r in (ln.split("->")[1] for ln in lines)) >= 12


def test_norms_compute_in_float32_and_hand_back_half():
  model = mpx.linen.apply_policy(Decoder(), "mixed_float16")
  ids = jnp.zeros((1, 4), jnp.int32)
  variables = model.init(jax.random.key(0), ids)
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, ids))(variables).jaxpr
  rsqrt = [e for e in _eqns(jaxpr) if e.primitive.name == "rsqrt"]
  assert len(rsqrt) == 3 and all(e.outvars[0].aval.dtype == jnp.float32 for e in rsqrt)
  _, inter = model.apply(variables, ids, capture_intermediates=True, mutable=["intermediates"])
  assert inter["intermediates"]["LayerNorm_0"]["__call__"][0].dtype == jnp.float16


def test_batchnorm_train_mode_keeps_float32_stats():
  model = mpx.linen.apply_policy(ConvNet(), "mixed_float16")
  x = jnp.ones((2, 8, 8, 1))
  variables = model.init(jax.random.key(0), x, train=False)
  assert _dtypes(variables["batch_stats"]) == {"float32"}

  def step(v):
    return model.apply(v, x, train=True, mutable=["batch_stats"])

  out, updates = jax.jit(step)(variables)
  assert out.dtype == jnp.float32
  assert _dtypes(updates["batch_stats"]) == {"float32"}
  convs = _dots(step, variables)
  assert len(convs) == 3 and all(set(d) == {"float16"} for d in convs)


def test_integer_inputs_stay_integer():
  model = mpx.linen.apply_policy(Decoder(), "mixed_bfloat16")
  ids = jnp.zeros((1, 4), jnp.int32)
  variables = model.init(jax.random.key(0), ids)
  jaxpr = jax.make_jaxpr(lambda v, i: model.apply(v, i))(variables, ids)
  converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
  assert all(
    e.invars[0].aval.dtype != jnp.int32 or e.params["new_dtype"] != jnp.bfloat16 for e in converts
  )


def test_rules_by_class_path_and_subtree():
  rules = (
    mpx.KeepRules()
    .with_class(nn.Embed, "float32")
    .with_path(r"^head$", "float32")
    .with_path(r"MultiHeadDotProductAttention_0", "mixed_float16")
  )
  model = mpx.linen.apply_policy(Decoder(), "mixed_bfloat16", rules=rules)
  ids = jnp.zeros((1, 4), jnp.int32)
  variables = model.init(jax.random.key(0), ids)
  _, inter = model.apply(variables, ids, capture_intermediates=True, mutable=["intermediates"])
  inter = inter["intermediates"]
  assert inter["Embed_0"]["__call__"][0].dtype == jnp.bfloat16  # handed back to the parent
  attention = inter["MultiHeadDotProductAttention_0"]
  assert attention["query"]["__call__"][0].dtype == jnp.float16  # subtree policy
  assert attention["__call__"][0].dtype == jnp.bfloat16
  dots = _dots(lambda v: model.apply(v, ids), variables)
  assert ("float32", "float32") in dots  # the pinned head
  assert ("float16", "float16") in dots and ("bfloat16", "bfloat16") in dots


def test_path_rule_matching_nothing_warns():
  model = mpx.linen.apply_policy(
    InlineMLP(), "mixed_bfloat16", rules=mpx.KeepRules(paths={"nope": "float32"})
  )
  with pytest.warns(mpx.PrecisionWarning, match=r"'nope'.*Dense_0, Dense_1"):
    model.init(jax.random.key(0), jnp.ones((1, 3)))


def test_applied_twice():
  model = mpx.linen.apply_policy(InlineMLP(), "mixed_bfloat16")
  assert mpx.linen.apply_policy(model, "mixed_bfloat16") is model
  with pytest.raises(mpx.PolicyError, match="already runs under"):
    mpx.linen.apply_policy(model, "mixed_float16")
  with pytest.raises(mpx.PolicyError, match="path rule"):
    mpx.linen.apply_policy(
      InlineMLP(), "float16", rules=mpx.KeepRules(instances=[(nn.Dense(2), "float32")])
    )


def test_tabulate_and_attribute_forwarding():
  model = mpx.linen.apply_policy(PinnedConfigMLP(), "mixed_bfloat16")
  assert model.dtype == jnp.float32  # forwarded to the user's (unchanged) module
  table = model.tabulate(jax.random.key(0), jnp.ones((1, 3)))
  assert "bfloat16" in table
  assert dataclasses.is_dataclass(model)


class _NormedMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.relu(nn.Dense(32)(x)))
    return nn.Dense(8)(x)


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_half_params_start_at_the_rounding_of_the_float32_init(half):
  # Flax samples initializers in the param dtype, a different random stream; mpx
  # samples in float32 and rounds, as mpx.nnx.apply_policy does by casting.
  x = jnp.ones((2, 16))
  f32 = mpx.linen.apply_policy(_NormedMlp(), "float32").init(jax.random.key(0), x)
  policy = mpx.Policy(half, half, jnp.float32)
  variables = mpx.linen.apply_policy(_NormedMlp(), policy).init(jax.random.key(0), x)
  params, reference = variables["params"], f32["params"]
  for name in ("Dense_0", "Dense_1"):
    for leaf in ("kernel", "bias"):
      assert params[name][leaf].dtype == half
      np.testing.assert_array_equal(
        np.asarray(params[name][leaf]), np.asarray(reference[name][leaf].astype(half))
      )
  chex.assert_trees_all_equal(params["LayerNorm_0"], reference["LayerNorm_0"])  # kept float32
  assert params["LayerNorm_0"]["scale"].dtype == jnp.float32
  _, again = mpx.linen.apply_policy(_NormedMlp(), policy).init_with_output(jax.random.key(0), x)
  chex.assert_trees_all_equal(again["params"], params)
