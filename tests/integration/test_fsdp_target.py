"""A Llama-style decoder trained fully sharded (FSDP) over 2 hosts x 8 H100s, as XLA:GPU compiles it.

The blocks run under ``nn.scan`` over ``nn.remat`` (``tests/models.LlamaDecoder``); every param
large enough is sharded over all 16 GPUs along its largest divisible axis, and the optimizer
state (float32 masters where the policy has them, adamw's moments) follows its param. The step is
compiled for the ``2xh100x8`` target without a GPU (deviceless, no autotuning) and its collectives
are read from the optimised program: the dtypes the weights are gathered in and the gradients
reduce-scattered in are XLA's choice, and these tests pin that it is the compute dtype (float8 for
the weights under ``mixed_float8``), never float32.
"""

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import layouts
import models
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpx
from mpx._src.audit import compiled as compiled_lib
from mpx._src.audit import targets

pytestmark = [
  pytest.mark.slow,  # whole-model compiles for 16 GPUs: CI runs them after the README's tests
  pytest.mark.skipif(
    not targets.plugin_available(), reason="jax's CUDA plugin (the gpu-target extra) is missing"
  ),
]

BATCH, LENGTH = 32, 64


# FSDP over all 16 GPUs; or FSDP across the 2 hosts and tensor parallelism within each.
LAYOUTS = {"fsdp": {"data": 16}, "fsdp_tp": {"data": 2, "model": 8}}


@functools.cache
def _compile(
  policy: str,
  layout: str = "fsdp",
  accumulate_in_float32: bool = False,
  loss_scale: str | None = "dynamic",
):
  axes = LAYOUTS[layout]
  devices = np.array(targets.devices(targets.parse("2xh100x8"))).reshape(tuple(axes.values()))
  mesh = Mesh(devices, tuple(axes))
  model = mpx.linen.apply_policy(
    models.LlamaDecoder(vocab_size=512, features=256, num_heads=4, num_layers=2, mlp_hidden=512),
    policy,
    accumulate_in_float32=accumulate_in_float32,
  )
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTH + 1), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  params = variables.pop("params")
  tx = mpx.mixed_precision(optax.adamw(1e-4), policy, loss_scale=loss_scale)
  with warnings.catch_warnings():
    # float16 without loss scaling: only the baseline the check's collectives are measured on
    warnings.simplefilter("ignore", mpx.PrecisionWarning)
    opt_state = jax.eval_shape(tx.init, params)

  def sharded(x, spec):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  param_specs = layouts.llama_specs(params, axes)
  abstract_params = jax.tree.map(sharded, params, param_specs)
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    opt_state,
    mpx.parallel.state_shardings(opt_state, abstract_params),
  )

  def loss_fn(params, rest, tokens):
    logits = model.apply({"params": params, **rest}, tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def step(params, opt_state, rest, tokens):
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, rest, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return mpx.apply_updates(params, updates), opt_state, loss

  args = (
    abstract_params,
    state,
    jax.tree.map(lambda x: sharded(x, P()), variables),
    sharded(tokens, P("data")),
  )
  with jax.numpy_dtype_promotion("standard"):  # optax's adam as users run it
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  bytes_by = collections.Counter()
  for c in compiled_lib.collectives(compiled.as_text()):
    bytes_by[c["kind"], np.dtype(c["dtype"]).name] += c["bytes"]
  replicated = sum(
    x.size
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(param_specs), strict=True)
    if spec == P()
  )
  return bytes_by, params, replicated


@pytest.mark.parametrize(
  "policy,gathered",
  [
    ("mixed_bfloat16", {"bfloat16"}),
    ("mixed_float16", {"float16"}),
    # E4M3 weights, E5M2 gradients (see below); the head stays bfloat16
    ("mixed_float8", {"float8_e4m3fn", "float8_e5m2", "bfloat16"}),
  ],
)
def test_fsdp_gathers_weights_and_reduce_scatters_gradients_in_the_compute_dtype(policy, gathered):
  bytes_by, params, replicated = _compile(policy)
  param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))  # float32 params
  gathers = {dtype: b for (kind, dtype), b in bytes_by.items() if kind == "all-gather"}
  # The weights are gathered in the compute dtype (float8 under mixed_float8).
  assert sum(gathers.get(d, 0) for d in gathered) >= 0.9 * sum(gathers.values()), bytes_by
  if policy == "mixed_float8":
    assert gathers["float8_e4m3fn"] > gathers.get("bfloat16", 0)  # the fp8 all-gather
  # No float32 weight is gathered: masters and moments stay sharded.
  assert gathers.get("float32", 0) < 0.01 * param_bytes, bytes_by
  # The gradients are reduce-scattered in half precision (mixed_float8 reduce-scattered
  # them in float32 while its weight-gradient products came out in float32).
  half = "float16" if policy == "mixed_float16" else "bfloat16"
  assert bytes_by["reduce-scatter", half] > 0, bytes_by
  assert bytes_by["reduce-scatter", "float32"] < 0.01 * param_bytes, bytes_by
  # What is all-reduced in float32: the gradients of the small replicated leaves (norm
  # scales), the loss, the finite check's scalars.
  assert bytes_by["all-reduce", "float32"] <= 4 * replicated + 64, bytes_by


def test_fp8_moves_fewer_bytes_than_bfloat16_under_fsdp():
  # Weights gathered in float8, gradients reduce-scattered in bfloat16: every collective
  # of the step together moves fewer bytes than bfloat16's.
  bf16, _, _ = _compile("mixed_bfloat16")
  fp8, _, _ = _compile("mixed_float8")
  assert sum(fp8.values()) < sum(bf16.values()), (fp8, bf16)
  # The E5M2 gathered is each block's output gradient, which XLA gathers over the batch
  # for the `down` layer's backward in every policy (2 x 64 x 256 per device): never the
  # head's logits gradient (2 x 64 x 512), which it once gathered in place of the head.
  assert 0 < fp8["all-gather", "float8_e5m2"] < BATCH // 16 * LENGTH * 512, fp8


@pytest.mark.xfail(
  strict=True,
  reason="known issue: in the backward of the MLP's gate and up layers (tensor parallel), "
  "fp8 all-reduces the two layers' input gradients over the model axis apart where bfloat16 "
  "all-reduces their sum (524,288 bytes more per layer here, against 73,728 saved by the "
  "float8 gathers): each backward product is multiplied by its own layer's scales "
  "(mpx/_src/ops/scaled_dot.py's _rescaled) between the product, which XLA all-reduces, and "
  "the sum; without those multiplications the step moves fewer bytes than bfloat16's",
)
def test_fp8_moves_no_more_bytes_than_bfloat16_under_fsdp_with_tensor_parallelism():
  bf16, _, _ = _compile("mixed_bfloat16", "fsdp_tp")
  fp8, _, _ = _compile("mixed_float8", "fsdp_tp")
  assert sum(fp8.values()) <= sum(bf16.values()), (fp8, bf16)


# mixed_float8 under FSDP x TP gathers its weights in bfloat16 (docs/guide/multihost.md).
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fsdp_with_tensor_parallelism_moves_activations_and_gradients_in_half_precision(policy):
  bytes_by, params, _ = _compile(policy, "fsdp_tp")
  param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
  half = "float16" if policy == "mixed_float16" else "bfloat16"
  # No master or moment is gathered: the float32 gathers are the final norm's per-token
  # rsqrt, 8 KiB, for the head's backward. (Under mixed_float16 they once read 155,648
  # bytes: XLA had combined them with float16 activations into one all-gather, all of
  # whose bytes the audit counted in its first operand's dtype.)
  assert bytes_by["all-gather", "float32"] < 0.01 * param_bytes, bytes_by
  # Tensor parallelism reduces each fan-in layer's activations over the model axis, in
  # the compute dtype.
  assert bytes_by["all-reduce", half] > 50 * bytes_by["all-reduce", "float32"], bytes_by
  # The weight gradients left to reduce over the data axis go in half precision.
  assert bytes_by["reduce-scatter", half] > 10 * bytes_by["reduce-scatter", "float32"], bytes_by
  # Float32 crosses devices for the loss only: the float32 logits, split over the
  # vocabulary by the head, are resharded to the batch rows for the cross-entropy.
  logits_bytes = 4 * (BATCH // LAYOUTS["fsdp_tp"]["data"]) * LENGTH * 512
  assert bytes_by["all-to-all", "float32"] <= logits_bytes, bytes_by


def test_float32_accumulation_makes_the_gradient_reduce_scatter_float32():
  # The reduction over the data axis is the last stage of the weight-gradient
  # product's sum over the batch: XLA runs it in the product's output dtype, so the
  # float32-accumulating matmuls (accumulate_in_float32=True) reduce-scatter in
  # float32, and the default ones in the compute dtype.
  half, _, _ = _compile("mixed_bfloat16")
  wide, _, _ = _compile("mixed_bfloat16", accumulate_in_float32=True)
  assert wide["reduce-scatter", "float32"] > 1.5 * half["reduce-scatter", "bfloat16"], wide
  assert wide["reduce-scatter", "bfloat16"] < 0.1 * half["reduce-scatter", "bfloat16"], wide
  # The weights are still gathered in bfloat16.
  assert wide["all-gather", "bfloat16"] == half["all-gather", "bfloat16"], wide


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dynamic_loss_scaling_adds_one_scalar_all_reduce_and_no_other_byte(layout):
  # The finite check reduces each device's shards where they lie and joins them with one
  # int32 all-reduce: every other collective of the float16 step, by kind and dtype, moves
  # the bytes it moves without loss scaling.
  scaled, _, _ = _compile("mixed_float16", layout)
  unscaled, _, _ = _compile("mixed_float16", layout, loss_scale=None)
  added = scaled - unscaled
  assert added == {("all-reduce", "int32"): 4}, (scaled, unscaled)
  assert not unscaled - scaled, (scaled, unscaled)
