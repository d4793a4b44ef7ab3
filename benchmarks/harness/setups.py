"""The benchmark's configurations: one train step per (model, precision configuration).

A :class:`Setup` is everything one configuration needs: params (abstract, or
made on the device), the loss, the optimizer and the train step. Every step
is ``step(carry, batch) -> (carry, loss)``: forward, backward and an
``optax.adamw`` update, with the loss scaling and master weights of its
configuration. The models are written without any precision argument
(``_gpt``, ``_resnet50``); each configuration reaches them its own way:

* ``f32_highest`` / ``f32``: as written, float32, with
  ``jax.default_matmul_precision("highest")`` or JAX's default precision
  (TF32 Tensor Cores for float32 matmuls on Ampere and later GPUs);
* ``bf16_flax``: bfloat16 by hand, ``dtype=jnp.bfloat16`` on every layer,
  float32 params (what Flax's own examples do);
* ``mpx_bf16``, ``mpx_f16``, ``mpx_f16_masters``: ``mpx.linen.apply_policy`` /
  ``mpx.nnx.apply_policy`` and ``mpx.mixed_precision`` under
  ``mixed_bfloat16``, ``mixed_float16`` (dynamic loss scaling) and float16
  params with float32 masters (layout (b), dynamic loss scaling);
* ``mpx_bf16_flax_norms``: ``mpx_bf16`` with ``KeepRules(lean_norms=False)``
  (Flax's normalisation code between casts): what the lean norms change;
* ``mpx_fp8``, ``mpx_fp8_rowwise``: ``mixed_bfloat16`` with float8 GEMMs
  (``mixed_float8``, ``mixed_float8_rowwise``: current scaling, so no model
  state; the delayed recipe's histories are left to ``fp8_recipes.py``);
* ``jmp_f16``: jmp's ``params=float32,compute=float16,output=float32``
  policy applied by hand (params and inputs cast before ``apply``) with
  ``jmp.DynamicLossScale``;
* what mpx offers beyond a policy, for GPT-2 (the model's code changes by one
  line, so these are not the model as written): ``mpx_bf16_flash``,
  ``mpx_bf16`` with the attention told it is causal (``is_causal=True``, no
  mask array: cuDNN's fused attention on a GPU); ``mpx_bf16_half_xent``,
  bfloat16 logits (``output=bfloat16``) into
  ``mpx.losses.softmax_cross_entropy_with_integer_labels`` (no float32
  logits); ``mpx_bf16_flash_xent`` both, and ``mpx_f16_flash_xent`` both in
  float16 with dynamic loss scaling. ResNet-50 has no attention: there the
  ``flash`` part changes nothing and ``half_xent`` is the loss alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax import nnx

import mpx

from . import gpt, resnet50

PyTree = Any

CONFIGS: dict[str, str] = {
  "f32_highest": "float32, jax.default_matmul_precision('highest')",
  "f32": "float32, default matmul precision",
  "bf16_flax": "bfloat16 by hand: Flax dtype=bfloat16 on every layer, float32 params",
  "mpx_bf16": "mpx mixed_bfloat16",
  "mpx_bf16_flax_norms": "mpx mixed_bfloat16, KeepRules(lean_norms=False)",
  "mpx_f16": "mpx mixed_float16, dynamic loss scaling",
  "mpx_f16_masters": "mpx float16 params + float32 masters (layout (b)), dynamic loss scaling",
  "jmp_f16": "jmp policy params=float32,compute=float16,output=float32 + jmp.DynamicLossScale",
  "mpx_fp8": "mpx mixed_float8 (float8 GEMMs, current scaling, per tensor)",
  "mpx_fp8_rowwise": "mpx mixed_float8_rowwise (float8 GEMMs, per-row / per-column scales)",
  "mpx_bf16_flash": "mpx mixed_bfloat16, attention passed is_causal (cuDNN flash attention)",
  "mpx_bf16_half_xent": "mpx mixed_bfloat16 with bfloat16 logits into mpx.losses' cross-entropy",
  "mpx_bf16_flash_xent": "mpx mixed_bfloat16, flash attention and bfloat16 logits into mpx.losses",
  "mpx_f16_flash_xent": "mpx mixed_float16, flash attention, float16 logits into mpx.losses, "
  "dynamic loss scaling",
}
MODELS: dict[str, str] = {
  "gpt2_linen": "GPT-2 small (linen)",
  "gpt2_nnx": "GPT-2 small (NNX)",
  "resnet50": "ResNet-50 (linen, BatchNorm)",
}
#: Configurations whose every matmul is meant to take half-precision operands.
MIXED = (
  "bf16_flax",
  "mpx_bf16",
  "mpx_bf16_flax_norms",
  "mpx_f16",
  "mpx_f16_masters",
  "jmp_f16",
  "mpx_fp8",
  "mpx_fp8_rowwise",
  "mpx_bf16_flash",
  "mpx_bf16_half_xent",
  "mpx_bf16_flash_xent",
  "mpx_f16_flash_xent",
)
_MPX_POLICIES = {
  "mpx_bf16": "mixed_bfloat16",
  "mpx_bf16_flax_norms": "mixed_bfloat16",
  "mpx_f16": "mixed_float16",
  "mpx_f16_masters": "params=float16,compute=float16,output=float32",
  "mpx_fp8": "mixed_float8",
  "mpx_fp8_rowwise": "mixed_float8_rowwise",
  "mpx_bf16_flash": "mixed_bfloat16",
  "mpx_bf16_half_xent": "params=float32,compute=bfloat16,output=bfloat16",
  "mpx_bf16_flash_xent": "params=float32,compute=bfloat16,output=bfloat16",
  "mpx_f16_flash_xent": "params=float32,compute=float16,output=float16",
}
#: Configurations whose GPT-2 tells its attention it is causal instead of passing a mask array.
_IS_CAUSAL = ("mpx_bf16_flash", "mpx_bf16_flash_xent", "mpx_f16_flash_xent")
#: Configurations whose loss takes the half-precision logits (mpx.losses).
_HALF_XENT = ("mpx_bf16_half_xent", "mpx_bf16_flash_xent", "mpx_f16_flash_xent")
_JMP_POLICY = "params=float32,compute=float16,output=float32"
LEARNING_RATE = 1e-4
INITIAL_LOSS_SCALE = 2.0**15


@dataclasses.dataclass(frozen=True)
class Setup:
  """One configuration of one model.

  Attributes:
    model: a key of :data:`MODELS`.
    config: a key of :data:`CONFIGS`.
    init: ``() -> (params, model_state)`` on the default device; call it
      under ``jax.eval_shape`` for shapes only.
    batch: the training batch (host arrays).
    loss_fn: ``(params, model_state, batch) -> (loss, new model_state)``.
    init_opt: ``params -> optimizer state``.
    step: ``(carry, batch) -> (carry, loss)`` with ``carry = (params,
      opt_state, model_state)``.
    policy: the precision policy the audit is told about (``None``: float32).
    precision: the ``jax.default_matmul_precision`` to trace under, or ``None``.
  """

  model: str
  config: str
  init: Callable[[], tuple[PyTree, PyTree]]
  batch: dict[str, np.ndarray]
  loss_fn: Callable[[PyTree, PyTree, dict[str, jax.Array]], tuple[jax.Array, PyTree]]
  init_opt: Callable[[PyTree], PyTree]
  step: Callable[[Any, dict[str, jax.Array]], tuple[Any, jax.Array]]
  policy: str | None
  precision: str | None


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def _half_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return mpx.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ------------------------------------------------------------------ the models


Apply = Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]]


def _gpt2_linen(config: str, cfg: gpt.GPTConfig, rules: mpx.KeepRules | None):
  dtype = jnp.bfloat16 if config == "bf16_flax" else None
  module: Any = gpt.GPT(cfg, dtype=dtype, is_causal=config in _IS_CAUSAL)
  if config in _MPX_POLICIES:
    module = mpx.linen.apply_policy(module, _MPX_POLICIES[config], rules=rules)
  batch = gpt.make_batch(cfg)

  def init():
    return module.init(jax.random.key(0), jnp.asarray(batch["x"][:1]))["params"], {}

  def apply(params, state, x):
    return module.apply({"params": params}, x), state

  return init, apply, batch


def _gpt2_nnx(config: str, cfg: gpt.GPTConfig, rules: mpx.KeepRules | None):
  dtype = jnp.bfloat16 if config == "bf16_flax" else None

  def build():
    model = gpt.NnxGPT(cfg, dtype=dtype, is_causal=config in _IS_CAUSAL, rngs=nnx.Rngs(0))
    if config in _MPX_POLICIES:
      model = mpx.nnx.apply_policy(model, _MPX_POLICIES[config], rules=rules)
    return model

  # The graph definition (with mpx's casting classes) from an abstract model.
  graphdef = nnx.split(nnx.eval_shape(build), nnx.Param, ...)[0]

  def init():
    _, params, rest = nnx.split(build(), nnx.Param, ...)
    return params, rest

  def apply(params, rest, x):
    model = nnx.merge(graphdef, params, rest, copy=True)
    return model(x), nnx.state(model, nnx.Not(nnx.Param))

  return init, apply, gpt.make_batch(cfg)


def _resnet50_model(config: str, cfg: resnet50.ResNetConfig, rules: mpx.KeepRules | None):
  module: Any = resnet50.ResNet50(cfg, dtype=jnp.bfloat16 if config == "bf16_flax" else None)
  if config in _MPX_POLICIES:
    module = mpx.linen.apply_policy(module, _MPX_POLICIES[config], rules=rules)
  batch = resnet50.make_batch(cfg)

  def init():
    variables = module.init(jax.random.key(0), jnp.asarray(batch["x"][:1]), train=False)
    return variables["params"], {"batch_stats": variables["batch_stats"]}

  def apply(params, state, x):
    logits, state = module.apply({"params": params, **state}, x, mutable=["batch_stats"])
    return logits, state

  return init, apply, batch


_MODELS = {"gpt2_linen": _gpt2_linen, "gpt2_nnx": _gpt2_nnx, "resnet50": _resnet50_model}
_SHAPES = {
  "gpt2_linen": gpt.GPTConfig,
  "gpt2_nnx": gpt.GPTConfig,
  "resnet50": resnet50.ResNetConfig,
}


# ---------------------------------------------------------------- the steps


def _optax_step(loss_fn, tx):
  def step(carry, batch):
    params, opt_state, state = carry
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, state), loss

  return step


def _mpx_step(loss_fn, tx):
  def step(carry, batch):
    params, opt_state, state = carry
    (loss, state), grads = mpx.value_and_grad(loss_fn, opt_state, has_aux=True)(
      params, state, batch
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return (mpx.apply_updates(params, updates), opt_state, state), loss

  return step


def _jmp_step(loss_fn, tx):
  # jmp's DynamicLossScale cannot be a `lower` argument (its __post_init__
  # reads its fields), so its two arrays travel in the optimizer state.
  def step(carry, batch):
    params, (opt_state, scale, counter), state = carry
    loss_scale = jmp.DynamicLossScale(scale, counter)

    def scaled(params, state, batch):
      loss, state = loss_fn(params, state, batch)
      return loss_scale.scale(loss), (loss, state)

    grads, (loss, state) = jax.grad(scaled, has_aux=True)(params, state, batch)
    grads = loss_scale.unscale(grads)
    ok = jmp.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(ok, (new_params, new_opt_state), (params, opt_state))
    loss_scale = loss_scale.adjust(ok)
    return (params, (opt_state, loss_scale.loss_scale, loss_scale.counter), state), loss

  def init_opt(params):
    return tx.init(params), jnp.float32(INITIAL_LOSS_SCALE), jnp.int32(0)

  return step, init_opt


def build(
  model: str,
  config: str,
  *,
  smoke: bool,
  loss_scale: Any = "dynamic",
  batch_size: int | None = None,
) -> Setup:
  """Returns the :class:`Setup` of ``model`` under ``config``.

  Args:
    model: a key of :data:`MODELS`.
    config: a key of :data:`CONFIGS`.
    smoke: the small version of the model (``GPTConfig.smoke()``...).
    loss_scale: for the mpx configurations, ``mpx.mixed_precision``'s
      ``loss_scale`` (``None`` times a float16 step without loss scaling).
    batch_size: the batch, if not the model's default (``ResNetConfig``: 64).

  Returns:
    The setup.
  """
  if config not in CONFIGS or model not in MODELS:
    raise ValueError(f"unknown model/config {model}/{config}: pick from {MODELS} and {CONFIGS}")
  rules = mpx.KeepRules(lean_norms=False) if config == "mpx_bf16_flax_norms" else None
  shape = _SHAPES[model].smoke() if smoke else _SHAPES[model]()
  if batch_size is not None:
    shape = dataclasses.replace(shape, batch_size=batch_size)
  init, apply, batch = _MODELS[model](config, shape, rules)
  tx = optax.adamw(LEARNING_RATE, weight_decay=0.01)
  jmp_policy = jmp.get_policy(_JMP_POLICY)

  def loss_fn(params, state, batch):
    x = batch["x"]
    if config == "jmp_f16":
      params, x = jmp_policy.cast_to_compute((params, x))
      logits, state = apply(params, state, x)
      return _xent(jmp_policy.cast_to_output(logits), batch["y"]), state
    logits, state = apply(params, state, x)
    return (_half_xent if config in _HALF_XENT else _xent)(logits, batch["y"]), state

  if config in _MPX_POLICIES:
    mixed = mpx.mixed_precision(tx, _MPX_POLICIES[config], loss_scale=loss_scale)
    step, init_opt = _mpx_step(loss_fn, mixed), mixed.init
  elif config == "jmp_f16":
    step, init_opt = _jmp_step(loss_fn, tx)
  else:
    step, init_opt = _optax_step(loss_fn, tx), tx.init
  policy = {
    "bf16_flax": "mixed_bfloat16",
    "jmp_f16": "mixed_float16",
    **{k: v for k, v in _MPX_POLICIES.items()},
  }.get(config)
  return Setup(
    model=model,
    config=config,
    init=init,
    batch=batch,
    loss_fn=loss_fn,
    init_opt=init_opt,
    step=step,
    policy=policy,
    precision="highest" if config == "f32_highest" else None,
  )


def abstract_carry(setup: Setup) -> tuple[Any, dict[str, jax.ShapeDtypeStruct]]:
  """``(carry, batch)`` as shapes and dtypes: nothing is allocated."""
  params, state = jax.eval_shape(setup.init)
  opt_state = jax.eval_shape(setup.init_opt, params)
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), setup.batch)
  return (params, opt_state, state), batch


def device_carry(setup: Setup) -> tuple[Any, dict[str, jax.Array]]:
  """``(carry, batch)`` made on the default device."""
  params, state = jax.jit(setup.init)()
  opt_state = jax.jit(setup.init_opt)(params)
  return (params, opt_state, state), jax.device_put(setup.batch)


def precision_scope(setup: Setup) -> Any:
  """The ``jax.default_matmul_precision`` context the setup is traced under."""
  return jax.default_matmul_precision(setup.precision) if setup.precision else _null()


@functools.cache
def _null() -> Any:
  import contextlib

  return contextlib.nullcontext()
