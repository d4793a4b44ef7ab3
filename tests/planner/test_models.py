"""The fp8 planner on whole models: GPT-2 (linen and NNX) and ResNet-50 at their smoke sizes.

Whole-model compiles for an H100 (several per plan): marked ``slow``. The plans must verify and
never be slower, in the model, than the baseline; the NNX rows name attribute paths.
"""

import pathlib
import sys

import jax
import pytest
from flax import nnx

import mpx
from mpx._src.audit import targets

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import gpt, resnet50

pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(
    not targets.plugin_available(),
    reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
  ),
]


def _shape(batch):
  return jax.ShapeDtypeStruct(batch["x"].shape, batch["x"].dtype)


def _check(plan):
  assert plan.rows
  assert plan.predicted_ms <= plan.step_ms[plan.candidates[0]]  # never slower than bf16
  plan.verify()


def test_gpt2_linen_plan_with_calibration():
  cfg = gpt.GPTConfig.smoke()
  batch = gpt.make_batch(cfg)
  plan = mpx.linen.plan(gpt.GPT(cfg), _shape(batch), calibration=(batch["x"][:2],))
  _check(plan)
  paths = {row.path for row in plan.rows}
  assert "Block_0/MultiHeadDotProductAttention_0/query" in paths and "Block_1/Dense_1" in paths
  assert all(row.sqnr_db and row.flushed is not None for row in plan.rows)


def test_gpt2_nnx_plan_names_attribute_paths_and_calibrates_the_model_as_it_is():
  cfg = gpt.GPTConfig.smoke()
  batch = gpt.make_batch(cfg)
  model = gpt.NnxGPT(cfg, rngs=nnx.Rngs(0))
  plan = mpx.nnx.plan(model, _shape(batch), calibration=(batch["x"][:2],))
  _check(plan)
  assert {"blocks/0/attn/query", "blocks/1/fc", "blocks/1/proj"} <= {r.path for r in plan.rows}
  assert all(row.sqnr_db and row.flushed is not None for row in plan.rows)


def test_resnet50_plan_covers_the_convolutions():
  cfg = resnet50.ResNetConfig.smoke()
  batch = resnet50.make_batch(cfg)
  plan = mpx.linen.plan(resnet50.ResNet50(cfg), _shape(batch))
  _check(plan)
  paths = {row.path for row in plan.rows}
  assert {"Bottleneck_1/Conv_1", "Bottleneck_1/proj", "head"} <= paths
  # 3 input channels, and the first stage's 8: feature counts that are not multiples of 16
  # run in bfloat16 under every recipe, so no candidate changes them.
  assert "stem" not in paths and "Bottleneck_0/Conv_1" not in paths
