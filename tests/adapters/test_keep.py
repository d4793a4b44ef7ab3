"""Tests for mpx.KeepRules and how the Flax adapters resolve them into layer policies."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.adapters import layer_policy

F32 = mpx.get_policy("float32")
MODEL = mpx.get_policy("mixed_bfloat16")


def _layers(rules, tree=None, *, norm_classes=mpx.linen.DEFAULT_KEEP_CLASSES):
  """A resolver over ``tree``: ``{module: (path, parent or None)}``."""
  tree = tree or {}
  return layer_policy.LayerPolicies(
    MODEL,
    rules,
    norm_classes=norm_classes,
    parent_of=lambda m: tree.get(m, ("", None))[1],
    path_of=lambda m: tree.get(m, ("", None))[0],
  )


def test_default_rules_pin_each_apis_own_norms_to_float32():
  rules = mpx.KeepRules()
  for norm in (nn.LayerNorm(), nn.BatchNorm(), nn.RMSNorm(), nn.GroupNorm()):
    assert _layers(rules).policy_at(norm) == F32
  assert _layers(rules).policy_at(nn.Dense(2)) == MODEL
  rngs = nnx.Rngs(0)
  nnx_norm = nnx.LayerNorm(4, rngs=rngs)
  assert _layers(rules, norm_classes=mpx.nnx.DEFAULT_KEEP_CLASSES).policy_at(nnx_norm) == F32
  assert _layers(rules).policy_at(nnx_norm) == MODEL  # linen's adapter pins linen's norms
  assert _layers(mpx.KeepRules(norms_in_float32=False)).policy_at(nn.LayerNorm()) == MODEL


def test_an_explicit_class_rule_wins_over_the_norm_default():
  rules = mpx.KeepRules().with_class(nn.LayerNorm, "mixed_float16")
  assert _layers(rules).policy_at(nn.LayerNorm()).compute_dtype == jnp.float16
  assert _layers(rules).policy_at(nn.BatchNorm()) == F32
  again = rules.with_class(nn.LayerNorm, "float32")
  assert len(again.classes) == 1 and _layers(again).policy_at(nn.LayerNorm()) == F32


def test_precedence_instance_over_path_over_class():
  layer = nn.Dense(2)
  rules = mpx.KeepRules().with_class(nn.Dense, "bfloat16").with_path("head", "float16")
  assert str(_layers(rules, {layer: ("Dense_0", None)}).policy_at(layer)) == (
    "params=bfloat16,compute=bfloat16,output=bfloat16"
  )
  assert str(_layers(rules, {layer: ("head", None)}).policy_at(layer)) == (
    "params=float16,compute=float16,output=float16"
  )
  rules = rules.with_path("^he", "float32")  # the later path rule wins
  assert _layers(rules, {layer: ("head", None)}).policy_at(layer) == F32
  rules = rules.with_instance(layer, "mixed_float16")
  assert _layers(rules, {layer: ("head", None)}).policy_at(layer) == mpx.get_policy("mixed_float16")


def test_subtree_inherits_and_boundaries_cast_where_compute_changes():
  root, block, dense, norm = nn.Dense(1), nn.Dense(2), nn.Dense(3), nn.LayerNorm()
  tree = {
    root: ("", None),
    block: ("block", root),
    dense: ("block/dense", block),
    norm: ("block/norm", block),
  }
  layers = _layers(mpx.KeepRules(paths={"^block$": "mixed_float16"}), tree)
  f16, bf16, f32 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
  assert layers.policy_at(dense).compute_dtype == jnp.float16  # inherited from block
  assert layers.boundary(root) == (bf16, f32)  # the root casts to the output dtype
  assert layers.boundary(block) == (f16, bf16)
  assert layers.boundary(dense) is None
  assert layers.boundary(norm) == (f32, f16)


def test_bad_rules_raise():
  with pytest.raises(mpx.PolicyError, match="regular expression"):
    mpx.KeepRules(paths={"(": "float32"})
  with pytest.raises(mpx.PolicyError, match="layer class"):
    mpx.KeepRules(classes={"Dense": "float32"})
  with pytest.raises(mpx.PolicyError):
    mpx.KeepRules(paths={"x": "float12"})


def test_unmatched_path_rule_warns_with_the_paths_seen():
  root, a, b = nn.Dense(1), nn.Dense(2), nn.Dense(3)
  tree = {root: ("", None), a: ("Dense_1", root), b: ("Dense_0", root)}
  layers = _layers(mpx.KeepRules(paths={"nothere": "float32", "Dense_0": "float32"}), tree)
  for module in tree:
    layers.policy_at(module)
  with pytest.warns(mpx.PrecisionWarning, match=r"'nothere'.*: Dense_0, Dense_1\.$") as record:
    layers.warn_unmatched_paths(stacklevel=1)
  assert len(record) == 1


def test_join_path():
  assert layer_policy.join_path(("blocks", 0, "mlp")) == "blocks/0/mlp"
  assert layer_policy.join_path(()) == ""
