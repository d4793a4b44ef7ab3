"""The audit's tables, readable: NNX attribute paths, split-K and merged GEMMs, the temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec

import mpx
from mpx._src.audit import layer_paths, targets

needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)


class _Block(nnx.Module):
  def __init__(self, width, rngs):
    self.fc = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.fc(x))


class _Tower(nnx.Module):
  def __init__(self, width=32, rngs=None):
    self.blocks = nnx.List([_Block(width, rngs), _Block(width, rngs)])
    self.head = nnx.Embed(16, width, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head.attend(x)


def _nnx_step(model, x):
  def loss(m):
    return jnp.sum(jnp.square(m(x)))

  return nnx.grad(loss)(model)


def test_nnx_rows_name_the_attribute_path_of_each_block():
  model = _Tower(rngs=nnx.Rngs(0))
  classes = {path: type(m) for path, m in nnx.iter_graph(model)}
  report = mpx.audit(_nnx_step, model, jnp.ones((8, 32)))

  paths = {(op.module_path, op.is_backward) for op in report.ops}
  assert paths == {
    (path, backward)
    for path in ("blocks/0/fc", "blocks/1/fc", "head.attend")
    for backward in (False, True)
  }
  # The audit leaves the model as it found it.
  assert {path: type(m) for path, m in nnx.iter_graph(model)} == classes
  assert not any(
    "_mpx_layer_path" in vars(m) for _, m in nnx.iter_graph(model) if hasattr(m, "__dict__")
  )


def test_name_stack_elements_split_outside_parentheses():
  name = "jit(f)/transpose(jvp(~blocks/0))/~blocks/0/mlp/Dense_0/dot_general"
  assert layer_paths.elements(name)[:2] == ["jit(f)", "transpose(jvp(~blocks/0))"]
  assert layer_paths.module_path(name) == ("blocks/0/mlp/Dense_0", True)
  assert layer_paths.module_path("jit(f)/jvp(Model)/Dense_0/dot_general") == (
    "Model/Dense_0",
    False,
  )
  assert layer_paths.layer_of("GPT/wte.attend") == "GPT/wte"


class _Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(x)
    return nn.Dense(256, name="out")(x)


def _linen_report(model, x, **kwargs):
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

  def step(params, x):
    def loss(p):
      return jnp.sum(jnp.square(model.apply({"params": p}, x).astype(jnp.float32)))

    return jax.grad(loss)(params)

  return mpx.audit(step, params, x, **kwargs)


@needs_plugin
def test_merged_qkv_and_split_k_gemms_are_labelled():
  model = mpx.linen.apply_policy(_Attention(), "mixed_bfloat16")
  report = _linen_report(model, jax.ShapeDtypeStruct((4, 128, 256), jnp.float32), target="h100")

  merged = [g for g in report.gemms if g.merged]
  assert merged, str(report)
  for g in merged:
    layers = {path.rsplit("/", 1)[1] for path, _ in g.merged}
    assert layers == {"query", "key", "value"}
    assert sum(share for _, share in g.merged) == pytest.approx(1.0)
    assert g.label.startswith("_Attention/attn/{") and "3 merged" in g.notes
  split = [g for g in report.gemms if g.split_k > 1]
  assert split, str(report)
  for g in split:
    # XLA's split-K form: 3-D operands, a float32 result with a leading axis of k.
    assert g.result_dtype == np.dtype(np.float32) and g.result_shape[0] == g.split_k
    assert len(g.lhs_shape) == len(g.rhs_shape) == 3
  table = str(report)
  assert "split-K" in table and "{query,key,value}" in table.replace(
    "{value,key,query}", "{query,key,value}"
  )


@needs_plugin
def test_nnx_kernels_of_the_compiled_program_carry_attribute_paths():
  model = _Tower(rngs=nnx.Rngs(0))
  report = mpx.audit(_nnx_step, model, jax.ShapeDtypeStruct((64, 32), jnp.float32), target="h100")
  assert {g.label for g in report.gemms} >= {"blocks/0/fc", "blocks/1/fc", "head.attend"}


class _Pooled(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.max_pool(nn.Conv(16, (3, 3))(x), (3, 3), (2, 2), padding="SAME")
    return nn.Dense(8)(x.reshape(x.shape[0], -1))


@needs_plugin
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_summary_names_the_largest_temporaries(policy):
  # On two GPUs, XLA computes the float16 max-pool's backward over the whole batch:
  # it all-gathers the activations, which is why the float16 step's temporaries
  # are larger; the summary says so, the bfloat16 one has no such buffer.
  model = mpx.linen.apply_policy(_Pooled(), policy)
  x = jax.ShapeDtypeStruct((16, 32, 32, 8), jnp.float32)
  report = _linen_report(model, x, target="h100x2", in_specs=(None, PartitionSpec("data")))

  biggest = report.temporaries[0]
  assert biggest["bytes"] == max(b["bytes"] for b in report.temporaries)
  assert "largest temporaries: " in report.summary()
  gathered = [b for b in report.temporaries if b["kind"] == "all-gather"]
  if policy == "mixed_float16":
    assert gathered and gathered[0]["type"] == "float16[16,33,33,16]"  # the global batch, padded
    assert gathered[0]["is_backward"] and "all-gather (_Pooled, backward)" in report.summary()
  else:
    assert not gathered
