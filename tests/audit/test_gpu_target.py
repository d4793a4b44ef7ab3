"""mpx.audit(..., target=...): the program compiled for a GPU this machine does not have.

The compiling tests need jax's CUDA plugin (``python -m mpx.gpu_target``)
(no GPU, no NVIDIA driver and no environment variable are needed); without the
plugin they are skipped. They assert on XLA:GPU's optimised program, so a
change in what reaches the Tensor Cores fails them.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpx._src import errors
from mpx._src.audit import report as report_lib
from mpx._src.audit import targets
from mpx._src.ops import quantize as quantize_lib

needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(),
  reason="needs the GPU-target toolchain: python -m mpx.gpu_target",
)


class _Model(nn.Module):
  """A convolution, a dense layer and an einsum, in ``dtype``; ``dot_general`` for the dense layers."""

  dtype: jnp.dtype = jnp.bfloat16
  dot_general: object = None

  @nn.compact
  def __call__(self, x):
    kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
    x = nn.Conv(32, (3, 3), dtype=self.dtype, name="conv")(x)
    x = x.reshape(x.shape[0], -1, 32)
    x = nn.Dense(64, dtype=self.dtype, name="up", **kw)(x)
    x = nn.Einsum((64, 64), "btf,fg->btg", dtype=self.dtype, name="mix")(nn.relu(x))
    return nn.Dense(32, dtype=self.dtype, name="down", **kw)(x)


def _step(model):
  x = jax.ShapeDtypeStruct((8, 8, 8, 16), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def step(variables, x):
    def loss(v):
      return jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))

    return jax.grad(loss)(variables)

  return step, variables, x


def _audit(model, target="h100", **kwargs):
  step, variables, x = _step(model)
  return report_lib.audit(step, variables, x, target=target, **kwargs)


def test_target_names_parse_to_gpus_hosts_and_gpus_per_host():
  assert targets.parse("h100") == targets.Target("h100", 1, 1)
  assert targets.parse("H100x8").topology == "1x1x8"
  assert targets.parse("2xh100x8") == targets.Target("h100", 2, 8)
  assert str(targets.parse("2x h100x8")) == "2xh100x8"
  with pytest.raises(errors.ConfigError, match="h100, h200, a100, b200, l4"):
    targets.parse("v100")


@needs_plugin
def test_bfloat16_model_compiles_to_half_gemms_with_the_stablehlo_flops():
  report = _audit(_Model(jnp.bfloat16))
  assert report.device_kind == "NVIDIA H100 80GB HBM3"
  # conv, dense, einsum, dense: forward and weight gradient each, input gradients but the conv's.
  assert len(report.gemms) == len(report.intended.ops) == 11
  assert {g.backend for g in report.gemms} <= {"triton", "cublas", "cublaslt", "cudnn"}
  assert all(g.lhs_dtype == g.rhs_dtype == jnp.bfloat16 for g in report.gemms)
  assert "cudnn" in {g.backend for g in report.gemms if g.kind == "convolution"}
  assert report.half_flops_share == 1.0
  assert report.fp8_flops_share == 0.0
  assert report.total_flops == report.intended.total_flops
  assert {g.module_path for g in report.gemms} == {
    "_Model/conv",
    "_Model/up",
    "_Model/mix",
    "_Model/down",
  }
  assert report.lost == ()
  assert "h100" in str(report) and "without autotuning" in str(report)


@needs_plugin
def test_float32_model_compiles_to_float32_gemms():
  report = _audit(_Model(jnp.float32))
  assert report.gemms
  assert all(g.lhs_dtype == g.rhs_dtype == jnp.float32 for g in report.gemms)
  assert report.half_flops_share == 0.0


@needs_plugin
def test_memory_and_kernels_agree_with_an_independent_reading_of_the_same_program():
  step, variables, x = _step(_Model(jnp.bfloat16))
  report = report_lib.audit(step, variables, x, target="h100")
  # The same lowering, compiled and read here without the audit's reader.
  devices = targets.devices(targets.parse("h100"))
  sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec())

  def place(t):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), t)

  compiled = jax.jit(step).lower(place(variables), place(x)).compile()
  stats, text = compiled.memory_analysis(), compiled.as_text()
  assert report.memory.temp_bytes == stats.temp_size_in_bytes > 0
  assert report.memory.argument_bytes == stats.argument_size_in_bytes
  assert report.memory.output_bytes == stats.output_size_in_bytes
  assert report.memory.alias_bytes == stats.alias_size_in_bytes
  entry = text[text.index("\nENTRY ") :].splitlines()
  launches = [line for line in entry if re.search(r"[)\]}] (fusion|custom-call|copy)\(", line)]
  assert report.kernel_count == len(launches)
  # Each Triton GEMM fusion's dot, with its operand dtypes, as the text declares them.
  dots = re.findall(r"dot\((%[\w.]+), (%[\w.]+)\)", text)
  assert len(dots) == sum(g.kind == "dot" for g in report.gemms)


def _quantize_dequantize_dot(lhs, rhs, dimension_numbers, precision=None, **unused):
  """The quantise-dequantise fp8 dot (Flax's ``Fp8DotGeneralOp`` form): float8 values, wider operands."""
  e4m3 = jnp.float8_e4m3fn
  lhs, rhs = (
    quantize_lib.quantize_dequantize(lhs, e4m3),
    quantize_lib.quantize_dequantize(rhs, e4m3),
  )
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)


@needs_plugin
def test_fp8_quantize_dequantize_is_flagged_as_lost_after_compilation():
  with pytest.warns(errors.PrecisionWarning, match="_Model/up .forward.: 1 products with float8"):
    report = _audit(_Model(jnp.bfloat16, dot_general=_quantize_dequantize_dot))
  # The StableHLO asks for float8 forward products (of the dense layers, not the conv and einsum).
  assert report.intended.fp8_flops_share > 0.1
  assert report.fp8_flops_share == 0.0  # XLA:GPU multiplies bfloat16
  assert {line.split(":")[0] for line in report.lost} == {
    "_Model/up (forward)",
    "_Model/down (forward)",
  }


@needs_plugin
def test_direct_float8_operands_compile_to_a_float8_kernel():
  def f(a, b):
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    return jax.lax.dot(a8, b8, preferred_element_type=jnp.bfloat16)

  a = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    report = report_lib.audit(f, a, b, target="h100")
  assert report.fp8_flops_share == 1.0
  assert {g.lhs_dtype for g in report.gemms} == {np.dtype(jnp.float8_e4m3fn)}


@needs_plugin
@pytest.mark.parametrize("gpu", targets.GPUS)
def test_every_target_compiles(gpu):
  def f(x, w):
    return x @ w

  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  report = report_lib.audit(f, x, w, target=gpu)
  assert report.half_flops_share == 1.0
  assert report.memory.output_bytes == 64 * 64 * 2


@needs_plugin
def test_data_parallel_target_all_reduces_the_gradients():
  step, variables, x = _step(_Model(jnp.bfloat16))
  report = report_lib.audit(
    step, variables, x, target="h100x8", in_specs=(None, PartitionSpec("data"))
  )
  kinds = {c.kind for c in report.collectives}
  assert "all-reduce" in kinds
  assert all(c.bytes > 0 for c in report.collectives)
  params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(variables))
  assert report.memory.argument_bytes == params + x.size * 4 // 8  # the batch is split 8 ways
