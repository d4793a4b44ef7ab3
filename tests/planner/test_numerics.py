"""The planner's numerics: flushed fractions and row SQNRs against NumPy, the captured products against autodiff."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpx
from mpx._src.planner import cost, numerics

_lost = jax.jit(numerics._lost, static_argnums=(1, 2, 3))  # on a matrix, groups along axis 1


def _reference_lost(x, dtype, grouping):
  """NumPy: the power-of-two scale of each group's amax, ml_dtypes' rounding, the values lost."""
  rows, k = x.shape
  size = {"tensor": rows * k, "row": k}.get(grouping, grouping)
  groups = x.reshape(-1, size) if grouping != "row" else x
  if grouping not in ("tensor", "row"):
    groups = np.pad(x, ((0, 0), (0, -k % size))).reshape(-1, size)
  fmax = float(ml_dtypes.finfo(dtype).max)
  amax = np.abs(groups).max(axis=1, keepdims=True)
  exponent = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / fmax))
  scale = np.where(amax > 0, 2.0**exponent, 1.0)
  q = (groups / scale).astype(dtype).astype(np.float64)
  return int(np.sum((groups != 0) & (q == 0))), int(np.sum(groups != 0))


@pytest.mark.parametrize("grouping", ["tensor", "row", 32])
@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_flushed_values_match_numpy(grouping, dtype):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 96)) * np.exp(rng.uniform(-12, 12, (16, 96)))
  x[3] *= 1e6  # a huge row
  x[5, :40] = 0.0
  lost, nonzero = _lost(jnp.asarray(x, jnp.float32), dtype, 1, grouping)
  expected = _reference_lost(x.astype(np.float32).astype(np.float64), dtype, grouping)
  assert (int(lost), int(nonzero)) == expected
  assert expected[0] > 0 or grouping != "tensor"


def test_a_huge_row_flushes_the_others_per_tensor_not_per_row():
  x = np.full((8, 64), 2.0**-12, np.float32)
  x[0, 0] = 448.0
  tensor, nonzero = _lost(jnp.asarray(x), ml_dtypes.float8_e4m3fn, 1, "tensor")
  row, _ = _lost(jnp.asarray(x), ml_dtypes.float8_e4m3fn, 1, "row")
  assert int(nonzero) == 8 * 64
  assert int(tensor) == 8 * 64 - 1  # 2**-12 is below E4M3's smallest subnormal, 2**-9
  assert int(row) == 63  # only the huge row's own small values


def test_row_sqnr_is_the_median_of_the_rows():
  rng = np.random.default_rng(1)
  ref = rng.standard_normal((7, 33)).astype(np.float32)
  noise = rng.standard_normal((7, 33)).astype(np.float32) * np.logspace(-4, 0, 7)[:, None]
  got = ref + noise.astype(np.float32)
  per_row = 10 * np.log10(
    np.sum(ref.astype(np.float64) ** 2, 1) / np.sum((got - ref).astype(np.float64) ** 2, 1)
  )
  value = float(numerics._row_sqnr(jnp.asarray(ref), jnp.asarray(got)))
  assert value == pytest.approx(np.median(per_row), rel=1e-4)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))


def test_capture_records_operands_and_the_gradient_at_each_product():
  model = _Mlp()
  x = jax.random.normal(jax.random.key(1), (4, 12))
  params = model.init(jax.random.key(0), x)["params"]

  def loss(p, x):
    return 0.5 * jnp.sum(jnp.square(model.apply({"params": p}, x)))

  captured = numerics.capture(loss, (params, x), ["_Mlp/hidden", "_Mlp/out"])
  assert [c.layer for c in captured] == ["_Mlp/hidden", "_Mlp/out"]
  hidden, out = captured
  pre = x @ params["hidden"]["kernel"] + params["hidden"]["bias"]
  y = jax.nn.relu(pre) @ params["out"]["kernel"] + params["out"]["bias"]
  np.testing.assert_array_equal(hidden.lhs, x)
  np.testing.assert_array_equal(hidden.rhs, params["hidden"]["kernel"])
  np.testing.assert_allclose(out.lhs, jax.nn.relu(pre), rtol=1e-6)
  np.testing.assert_allclose(out.grad, y, rtol=1e-5)  # d(|y|^2 / 2) / dy
  expected = jnp.where(pre > 0, y @ params["out"]["kernel"].T, 0.0)
  np.testing.assert_allclose(hidden.grad, expected, rtol=1e-5, atol=1e-6)


def test_tensorwise_scaling_fails_where_rowwise_passes():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((64, 128)).astype(np.float32) * 0.01
  x[0] *= 1e6  # one huge row sets the per-tensor scale
  w = rng.standard_normal((128, 64)).astype(np.float32) * 0.1
  g = rng.standard_normal((64, 64)).astype(np.float32)
  g[0] *= 1e-6  # a norm after the layer: the huge row's gradient is small
  product = numerics.Captured(
    layer="dense",
    primitive="dot_general",
    params={"dimension_numbers": (((1,), (0,)), ((), ()))},
    lhs=jnp.asarray(x),
    rhs=jnp.asarray(w),
    grad=jnp.asarray(g),
  )
  policies = {
    n: mpx.get_policy(n) for n in ("mixed_bfloat16", "mixed_float8", "mixed_float8_rowwise")
  }
  found = numerics.layer_errors([product], policies)["dense"]
  assert found["mixed_float8"][1] > 0.5  # most of the ordinary rows flush to zero
  assert found["mixed_float8"][0] < numerics.threshold_db(policies["mixed_float8"])
  assert found["mixed_float8_rowwise"][1] == 0.0
  assert found["mixed_float8_rowwise"][0] >= numerics.threshold_db(policies["mixed_float8_rowwise"])
  assert (
    found["mixed_bfloat16"][0] > 40.0 and numerics.threshold_db(policies["mixed_bfloat16"]) is None
  )


def test_layers_add_up_to_each_program_with_the_baselines_rest():
  def layer(seconds, gemm):
    return cost.LayerCost(seconds, gemm, 1.0, 0, 1, ())

  costs = {
    "base": cost.ProgramCost(10.0, 4.0, {"a": layer(4.0, 3.0), "b": layer(2.0, 1.0)}),
    # the candidate fused 1 s of the rest into its layers' other kernels (3 : 1)
    "fp8": cost.ProgramCost(8.0, 3.0, {"a": layer(3.5, 0.5), "b": layer(1.5, 0.5)}),
  }
  seconds = cost.corrected(costs, "base")
  assert seconds["base"] == {"a": 4.0, "b": 2.0}
  assert seconds["fp8"] == pytest.approx({"a": 3.5 - 0.75, "b": 1.5 - 0.25})
  for name in costs:
    assert cost.step_seconds(costs, seconds, lambda _, n=name: n, "base") == pytest.approx(
      costs[name].seconds
    )
  assert cost.owner("M/attn/query/dot", ["M/attn", "M/attn/query"]) == "M/attn/query"
  assert cost.owner("M/attention", ["M/attn"]) is None
