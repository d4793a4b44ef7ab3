"""The fp8 planner on models built to make each decision, compiled for an H100 without a GPU.

A wide layer where float8 pays, a tiny one where the quantisation costs more
than it saves, and, on a calibration batch with one huge row, a layer whose
ordinary rows flush to zero under a per-tensor scale (rowwise keeps them:
marked ``slow``, the numerics' own tests are fast). The decisions are read
from the compiled programs (modelled, no autotuning); ``plan.verify()``
checks the planned model's kernels.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.audit import targets

pytestmark = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)
WIDTH, TOKENS = 2048, 16384


class _Wide(nn.Module):
  # Without the norm the layers' own choices hold when compiled together. With it (the
  # calibration test's model), the mix compiled slower than all-float8 (0.634 against
  # 0.628 ms, modelled), so the plan falls back to one candidate for every layer.
  norm: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH, name="wide")(x)
    h = nn.relu(nn.LayerNorm(name="norm")(h) if self.norm else h)
    return nn.Dense(16, name="tiny")(h)


def _outlier_batch():
  # One huge row: a per-tensor scale flushes the other rows to zero; per row, each
  # keeps its own (the norm after the layer keeps the huge row's gradient ordinary).
  x = np.random.default_rng(0).standard_normal((32, WIDTH)).astype(np.float32) * 0.01
  x[0] *= 1e6
  return (x,)


@pytest.mark.slow
def test_linen_plan_keeps_the_tiny_layer_out_of_float8_and_verifies():
  x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
  plan = mpx.linen.plan(_Wide(), x, candidates=("mixed_bfloat16", "mixed_float8"))

  wide, tiny = plan.rows
  assert (wide.path, tiny.path) == ("wide", "tiny")
  assert (wide.shapes, tiny.shapes) == (f"{TOKENS}x{WIDTH}x{WIDTH}", f"{TOKENS}x16x{WIDTH}")
  assert wide.predicted_ms["mixed_float8"] < wide.predicted_ms["mixed_bfloat16"]
  assert wide.choice == "mixed_float8" and wide.reason.endswith("faster than mixed_bfloat16")
  # The tiny layer: the quantisation kernels cost more than float8 saves.
  assert tiny.predicted_ms["mixed_float8"] > tiny.predicted_ms["mixed_bfloat16"]
  assert tiny.choice == "mixed_bfloat16" and tiny.reason.startswith("does not pay")
  assert wide.sqnr_db is None and not plan.note
  assert plan.predicted_ms < plan.step_ms["mixed_bfloat16"] and plan.speedup > 1.0
  assert "wide" in str(plan) and "modelled, no autotuning" in str(plan)
  report = plan.verify()
  assert {g.module_path: g.is_fp8 for g in report.gemms if not g.is_backward} == {
    "_Wide/wide": True,
    "_Wide/tiny": False,
  }
  # to_code() recreates the rules and the policy.
  scope = {"model": _Wide()}
  exec(plan.to_code(), scope)
  assert scope["rules"] == plan.rules and scope["model"].policy == plan.policy


@pytest.mark.slow
def test_linen_plan_picks_rowwise_where_tensorwise_flushes():
  x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
  plan = mpx.linen.plan(_Wide(norm=True), x, calibration=_outlier_batch())

  wide, tiny = plan.rows
  # The wide layer: float8 pays in both recipes, but its operands flush per tensor.
  assert (
    max(wide.predicted_ms[c] for c in ("mixed_float8", "mixed_float8_rowwise"))
    < (wide.predicted_ms["mixed_bfloat16"])
  )
  assert wide.flushed["mixed_float8"] > 0.01 and wide.flushed["mixed_float8_rowwise"] <= 0.01
  assert wide.sqnr_db["mixed_float8"] < 20.0 <= 25.0 <= wide.sqnr_db["mixed_float8_rowwise"]
  assert wide.choice == "mixed_float8_rowwise"
  assert "mixed_float8: SQNR" in wide.reason and "flushed" in wide.reason
  # On its own the tiny layer stays in bfloat16, but the two choices compiled together are
  # not 0.1% faster than rowwise everywhere (the module comment of _Wide): the plan falls
  # back to that one candidate and its note says so.
  assert tiny.reason.startswith("does not pay")
  assert tiny.choice == "mixed_float8_rowwise" and "not 0.1% less" in plan.note
  assert plan.speedup > 1.0
  report = plan.verify()
  assert {g.module_path for g in report.gemms if g.is_fp8} == {"_Wide/wide", "_Wide/tiny"}


class _NnxWide(nnx.Module):
  def __init__(self, rngs):
    self.wide = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.tiny = nnx.Linear(WIDTH, 16, rngs=rngs)

  def __call__(self, x):
    return self.tiny(nnx.relu(self.wide(x)))


@pytest.mark.slow
def test_nnx_plan_names_attribute_paths_and_verifies():
  model = _NnxWide(nnx.Rngs(0))
  kernel = model.wide.kernel[...]
  x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
  plan = mpx.nnx.plan(model, x, candidates=("mixed_bfloat16", "mixed_float8"))

  assert plan.choices == {"wide": "mixed_float8", "tiny": "mixed_bfloat16"}
  assert plan.policy == mpx.get_policy("mixed_float8")
  assert [p for p, _ in plan.rules.paths] == ["^tiny$"]
  assert plan.rows[0].sqnr_db is None  # no calibration batch
  # The user's model is left as it was: float32, no policy.
  assert model.wide.kernel[...] is kernel and not hasattr(model, "mpx_policy")
  report = plan.verify()
  assert {g.module_path for g in report.gemms if g.is_fp8} == {"wide"}


def test_plan_needs_a_baseline_and_a_candidate():
  with pytest.raises(mpx.ConfigError, match="at least two"):
    mpx.linen.plan(_Wide(), jnp.ones((4, WIDTH)), candidates=("mixed_bfloat16",))
