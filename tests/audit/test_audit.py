"""Tests for mpx.audit: the StableHLO matmul/convolution dtype report."""

from __future__ import annotations

import ast
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import mpx

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _matmul(x, w):
  return x @ w


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_records_dtypes_shapes_and_flops(dtype, jit):
  fn = jax.jit(_matmul) if jit else _matmul
  report = mpx.audit(fn, jnp.ones((16, 32), dtype), jnp.ones((32, 24), dtype))

  (op,) = report.ops
  assert op.kind == "dot_general"
  assert op.lhs_dtype == op.rhs_dtype == op.result_dtype == np.dtype(dtype)
  assert (op.lhs_shape, op.rhs_shape, op.result_shape) == ((16, 32), (32, 24), (16, 24))
  assert op.gemm_dims == (16, 24, 32)
  assert op.flops == report.total_flops == report.program_flops == 2 * 16 * 24 * 32
  assert op.share == 1.0
  assert op.misaligned == ()
  assert not op.is_backward
  assert op.count == 1
  half = dtype != jnp.float32
  assert op.is_half == half
  assert report.half_flops_share == (1.0 if half else 0.0)
  assert len(report.float32_ops) == (0 if half else 1)


def test_batched_einsum_counts_batch_in_flops():
  q, k = jnp.ones((3, 8, 24), jnp.bfloat16), jnp.ones((3, 16, 24), jnp.bfloat16)
  (op,) = mpx.audit(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), q, k).ops

  assert op.gemm_dims == (8, 16, 24)
  assert op.flops == 2 * 3 * 8 * 16 * 24


def test_grouped_convolution_flops_and_dims():
  def conv(x, kernel):
    return jax.lax.conv_general_dilated(
      x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
    )

  x, kernel = jnp.ones((2, 8, 8, 16), jnp.float16), jnp.ones((3, 3, 8, 32), jnp.float16)
  (op,) = mpx.audit(conv, x, kernel).ops

  assert op.kind == "convolution"
  assert op.result_shape == (2, 8, 8, 32)
  # Each output element: a 3x3 window over the 8 input features of its group.
  assert op.flops == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 8)
  assert op.gemm_dims == (2 * 8 * 8, 32, 3 * 3 * 8)
  assert op.is_half


def test_misaligned_dims_are_flagged():
  report = mpx.audit(_matmul, jnp.ones((10, 32), jnp.bfloat16), jnp.ones((32, 24), jnp.bfloat16))

  assert report.misaligned_ops[0].misaligned == ("M=10",)
  assert "align:M=10" in str(report)


class _Mlp(nn.Module):
  dtype: jnp.dtype | None = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, dtype=self.dtype, name="up")(x))
    return nn.Dense(8, dtype=self.dtype, name="down")(x)


def _mlp_grad(model, x):
  params = model.init(jax.random.key(0), x)["params"]

  def loss(params):
    return jnp.square(model.apply({"params": params}, x).astype(jnp.float32)).sum()

  return jax.grad(loss), params


def test_linen_module_paths_and_backward_ops():
  grad, params = _mlp_grad(_Mlp(), jnp.ones((16, 24), jnp.bfloat16))
  report = mpx.audit(grad, params, policy="mixed_bfloat16")

  forward = report.filter(backward=False)
  assert [op.module_path for op in forward.ops] == ["_Mlp/up", "_Mlp/down"]
  # up: a weight gradient; down: a weight and an input gradient.
  assert sorted(op.module_path for op in report.backward_ops) == [
    "_Mlp/down",
    "_Mlp/down",
    "_Mlp/up",
  ]
  assert len(report.filter(r"/up$").ops) == 2
  assert len(report.exclude("down").ops) == 2
  assert report.half_flops_share == 1.0
  assert not report.float32_ops


def test_layer_left_at_dtype_none_runs_float32_products_and_is_flagged():
  # The trap: float32 params promote bfloat16 inputs, the GEMMs run in float32.
  # Strict promotion (our tests' setting) would refuse; users' default allows it.
  with jax.numpy_dtype_promotion("standard"):
    grad, params = _mlp_grad(_Mlp(dtype=None), jnp.ones((16, 24), jnp.bfloat16))
    flagged = mpx.audit(grad, params, policy="mixed_bfloat16")
    unflagged = mpx.audit(grad, params)

  assert flagged.half_flops_share == 0.0
  assert len(flagged.float32_ops) == len(flagged.ops) == 5
  assert all("f32" in flagged.flags(op) for op in flagged.ops)
  assert " f32" in str(flagged)
  assert len(unflagged.float32_ops) == 5
  assert not any("f32" in unflagged.flags(op) for op in unflagged.ops)


def test_preferred_element_type_float32_does_not_survive_the_backward_pass():
  def loss(x, w):
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return jnp.sum(y * y)

  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
  report = mpx.audit(jax.grad(loss, argnums=(0, 1)), x, w, policy="mixed_bfloat16")

  (forward,) = report.filter(backward=False).ops
  assert (forward.lhs_dtype, forward.rhs_dtype, forward.result_dtype) == (
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float32),
  )
  backward = report.filter(backward=True)
  assert len(backward.ops) == 2
  assert backward.float32_ops == backward.ops  # The float32 cotangent meets the half operand.


def test_scan_body_counted_per_iteration_and_checkpoint_recomputation_is_backward():
  def f(ws, x):
    @jax.checkpoint
    def layer(h, w):
      return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, ws)[0].sum()

  report = mpx.audit(jax.grad(f), jnp.ones((5, 16, 16)), jnp.ones((8, 16)))

  # One forward product, and in the backward body: its recomputation plus the
  # two gradient products; each runs once per iteration of the 5.
  assert len(report.filter(backward=False).ops) == 1
  assert len(report.backward_ops) == 3
  assert all(op.count == 5 for op in report.ops)
  assert report.total_flops == 5 * 4 * 2 * 8 * 16 * 16
  assert all(op.module_path.endswith("layer") for op in report.ops)


def test_loop_of_unknown_length_counts_its_body_once():
  def f(x, w):
    return jax.lax.while_loop(lambda h: h.sum() < 100.0, lambda h: h @ w, x)

  (op,) = mpx.audit(f, jnp.ones((8, 16)), jnp.ones((16, 16))).ops

  assert op.count == 1


def test_called_function_counted_once_per_call_site():
  inner = jax.jit(_matmul)

  def f(x, w):
    return inner(x, w) + inner(jnp.sin(x), w)

  (op,) = mpx.audit(f, jnp.ones((8, 16)), jnp.ones((16, 8))).ops

  assert op.count == 2
  assert op.flops == 2 * (2 * 8 * 8 * 16)


def test_nnx_module_path_comes_from_the_call_stack():
  class Tower(nnx.Module):
    def __init__(self, rngs):
      self.proj = nnx.Linear(16, 8, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
      return self.proj(x)

  graphdef, state = nnx.split(Tower(nnx.Rngs(0)))
  report = mpx.audit(lambda s, x: nnx.merge(graphdef, s)(x), state, jnp.ones((8, 16), jnp.float16))

  (op,) = report.ops
  assert op.module_path == "Tower/Linear"
  assert op.is_half


def test_accepts_jitted_with_static_args_lowered_and_shape_structs():
  @functools.partial(jax.jit, static_argnums=2)
  def f(x, w, transpose):
    return x @ (w.T if transpose else w)

  spec_x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
  spec_w = jax.ShapeDtypeStruct((24, 16), jnp.bfloat16)
  from_jitted = mpx.audit(f, spec_x, spec_w, True)
  from_lowered = mpx.audit(f.lower(spec_x, spec_w, True))

  assert from_jitted.ops == from_lowered.ops
  assert from_jitted.ops[0].gemm_dims == (8, 24, 16)


def test_accepts_an_nnx_jit_train_step():
  model = nnx.Linear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    def loss(model):
      return jnp.square(model(x).astype(jnp.float32)).mean()

    grads = nnx.grad(loss)(model)
    optimizer.update(model, grads)

  report = mpx.audit(step, model, optimizer, jnp.ones((8, 16), jnp.bfloat16))

  assert [op.is_backward for op in report.ops] == [False, True]
  assert report.half_flops_share == 1.0
  assert {op.module_path for op in report.ops} == {"Linear"}


def test_kwargs_go_to_fn_and_policy_does_not():
  def f(x, *, w):
    return x @ w

  report = mpx.audit(f, jnp.ones((8, 8)), w=jnp.ones((8, 16)), policy="mixed_float16")

  assert report.ops[0].result_shape == (8, 16)
  assert report.policy == mpx.get_policy("mixed_float16")


def test_report_without_matmuls_has_nan_half_share():
  report = mpx.audit(jnp.sin, jnp.ones(4))

  assert report.ops == ()
  assert math.isnan(report.half_flops_share)
  assert "0 ops" in str(report)


def test_unknown_policy_raises_policy_error():
  with pytest.raises(mpx.PolicyError, match="mixed_bf16"):
    mpx.audit(_matmul, jnp.ones((8, 8)), jnp.ones((8, 8)), policy="mixed_bf16")


def test_str_is_a_table_with_a_summary():
  report = mpx.audit(
    _matmul,
    jnp.ones((16, 32), jnp.bfloat16),
    jnp.ones((32, 8)).astype(jnp.bfloat16),
    policy="mixed_bfloat16",
  )
  lines = str(report).splitlines()

  assert lines[0].split() == [
      "#", "kind", "pass", "module", "lhs", "rhs", "result", "MFLOP", "share", "flags"
  ]  # fmt: skip
  assert "bfloat16[16,32]" in lines[2] and "100.0%" in lines[2]
  assert lines[-2].startswith("policy params=float32,compute=bfloat16,output=float32; 1 ops")
  assert lines[-1].startswith("reductions: 0 float16 sums, 0 float16 exps, 0 bfloat16 sums; ")
  assert "estimated matmul time on H100 SXM" in lines[-1]


def test_audit_module_imports_neither_flax_nor_optax():
  source = pathlib.Path(mpx.audit.__code__.co_filename).read_text()
  imported = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      imported.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      imported.add(node.module.split(".")[0])

  assert imported <= {"__future__", "collections", "dataclasses", "jax", "math", "mpx", "numpy",
                      "re", "typing"}  # fmt: skip


# ---------------------------------------------------------------------------
# Flags for slow or imprecise baselines.
# ---------------------------------------------------------------------------


def test_float32_at_default_precision_is_flagged_tf32():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 8))

  default = mpx.audit(_matmul, x, w)
  with jax.default_matmul_precision("highest"):
    highest = mpx.audit(_matmul, x, w)
  explicit = mpx.audit(lambda x, w: jnp.matmul(x, w, precision="highest"), x, w)
  half = mpx.audit(_matmul, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))

  (op,) = default.ops
  assert op.precision in ((), ("DEFAULT", "DEFAULT"))
  assert op.float32_at_default_precision and op.operand_class == "tf32"
  assert default.tf32_ops == default.ops and "tf32" in default.flags(op)
  assert default.default_matmul_precision is None
  assert highest.ops[0].precision == ("HIGHEST", "HIGHEST")
  assert highest.default_matmul_precision == "highest"
  for report in (highest, explicit):
    assert not report.tf32_ops and report.ops[0].operand_class == "float32"
    assert "tf32" not in report.flags(report.ops[0])
  assert not half.tf32_ops and half.ops[0].operand_class == "half"
  assert "0 at default precision" in half.summary() and "1 at default" in default.summary()


def test_half_operands_upcast_for_a_float32_cotangent_are_flagged():
  def loss(x, w):
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return jnp.sum(y * y)

  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
  report = mpx.audit(jax.grad(loss, argnums=(0, 1)), x, w, policy="mixed_bfloat16")

  assert report.filter(backward=False).ops[0].upcast == ()
  backward = report.filter(backward=True).ops
  assert len(backward) == 2 and all(op.upcast for op in backward)
  assert report.upcast_ops == backward
  assert all(any(f.startswith("upcast:") for f in report.flags(op)) for op in backward)
  clean = mpx.audit(jax.grad(lambda x, w: jnp.sum(x @ w).astype(jnp.float32)), x, w)
  assert not clean.upcast_ops


def test_float32_params_promoting_half_inputs_are_flagged_upcast():
  with jax.numpy_dtype_promotion("standard"):
    grad, params = _mlp_grad(_Mlp(dtype=None), jnp.ones((16, 24), jnp.bfloat16))
    report = mpx.audit(grad, params)

  first = report.filter("up$", backward=False).ops[0]
  assert first.upcast == ("lhs",)  # the bfloat16 input, converted to meet the float32 kernel


def test_float16_softmax_exp_is_listed():
  x = jnp.ones((8, 16), jnp.float16)
  report = mpx.audit(jax.nn.softmax, x)

  # jnp sums upcast float16 to float32 themselves; the exp does not. The max is exact.
  assert [(r.kind, r.dtype.name, r.terms) for r in report.reductions] == [("exp", "float16", 1)]
  assert report.float16_reductions == report.reductions
  assert "0 float16 sums, 1 float16 exps" in report.summary()
  assert not mpx.audit(mpx.softmax, x).reductions  # exp in float32
  assert not mpx.audit(jax.nn.softmax, x.astype(jnp.bfloat16)).reductions  # float32's range


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_bias_gradient_is_a_listed_backward_sum(dtype):
  def loss(b, x):
    return jnp.sum(jnp.sin(x + b).astype(jnp.float32))

  report = mpx.audit(jax.grad(loss), jnp.ones(16, dtype), jnp.ones((8, 16), dtype))

  (sum_op,) = report.reductions  # the transpose of the broadcast: a sum over the 8 rows
  assert (sum_op.kind, sum_op.dtype, sum_op.terms) == ("sum", np.dtype(dtype), 8)
  assert sum_op.is_backward and sum_op.shape == (8, 16)
  assert len(report.float16_reductions) == (dtype == jnp.float16)


def test_float16_average_pool_is_a_listed_window_sum():
  def sum_pool(x):
    zero = jnp.zeros((), x.dtype)
    return jax.lax.reduce_window(x, zero, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

  pool = mpx.audit(sum_pool, jnp.ones((1, 8, 8, 4), jnp.float16))

  (sum_op,) = pool.reductions
  assert (sum_op.kind, sum_op.terms) == ("sum", 4)


def test_matmul_time_estimate_per_operand_class():
  x, w = jnp.ones((64, 128)), jnp.ones((128, 32))

  def f(x, w):
    highest = jnp.matmul(x, w, precision="highest")
    return highest + (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32) + x @ w

  report = mpx.audit(f, x, w)
  flops = 2 * 64 * 128 * 32
  seconds = report.estimate_matmul_seconds("H100 SXM")

  assert seconds["float32"] == pytest.approx(flops / 66.9e12)
  assert seconds["half"] == pytest.approx(flops / 989e12)
  assert seconds["tf32"] == pytest.approx(flops / 494.7e12)
  assert seconds["total"] == pytest.approx(sum(seconds[k] for k in ("float32", "half", "tf32")))
  assert report.estimate_matmul_seconds("NVIDIA H100 80GB HBM3") == seconds
  assert report.estimate_matmul_seconds("A100")["half"] == pytest.approx(flops / 312e12)
  with pytest.raises(mpx.ConfigError, match="H100 SXM"):
    report.estimate_matmul_seconds("TPU v5e")


def test_upcast_through_an_identity_convert_flags_both_operands():
  # `w.astype(float32)` meeting a promoted bfloat16 `x`: JAX converts w to float32,
  # then emits an identity convert (f32 -> f32) for the dot; both sides are half data.
  def f(x, w):
    return x @ w.astype(jnp.float32)

  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  with jax.numpy_dtype_promotion("standard"):
    (op,) = mpx.audit(f, x, w).ops
    (fp8_op,) = mpx.audit(f, x, w.astype(jnp.float8_e4m3fn)).ops

  assert op.upcast == ("lhs", "rhs")
  assert (op.lhs_dtype, op.rhs_dtype) == (np.dtype(jnp.float32),) * 2
  # The float8 kernel is recognised through the same identity convert.
  assert fp8_op.fp8 == (None, np.dtype(jnp.float8_e4m3fn))


def test_stablehlo_module_defines_each_name_once():
  # A second `_LAYOUT_OPS = ...` once silently replaced the first, dropping an entry.
  tree = ast.parse(
    pathlib.Path(mpx.__file__).with_name("_src").joinpath("audit", "stablehlo.py").read_text()
  )
  names = [
    target.id
    for node in tree.body
    if isinstance(node, ast.Assign)
    for target in node.targets
    if isinstance(target, ast.Name)
  ]
  assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_rematted_module_backward_ops_name_the_module_path_once():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.tanh(nn.Dense(8, name="proj")(x))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.remat(Block)(name="block")(Block(name="plain")(x))

  model, x = Model(), jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x)
  report = mpx.audit(jax.grad(lambda p: model.apply(p, x).sum()), params)

  paths = {op.module_path for op in report.ops}
  assert paths == {"Model/plain/proj", "Model/block/proj"}
  # The recomputed forward product and the two gradient products of the rematted block.
  assert len(report.filter("block", backward=True).ops) == 3


def test_module_nested_in_a_namesake_keeps_both_names():
  class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="Model")(x)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Inner(name="Model")(x)

  model, x = Model(), jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x)
  report = mpx.audit(jax.grad(lambda p: model.apply(p, x).sum()), params)

  assert {op.module_path for op in report.ops} == {"Model/Model/Model"}
