"""The six training configurations the demo compares, and what each one shows.

All six train the same model on the same batches with the same optimizer and
schedule; they differ only in the arguments of ``mpx.get_policy`` and
``mpx.mixed_precision``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import mpx

F16_PARAMS = "params=float16,compute=float16,output=float32"
"""Layout (b): float16 params and compute, float32 logits (hence a float32 loss)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One configuration: a policy and the optimizer wrapper's options.

  Attributes:
    name: the name ``--configs`` accepts.
    policy: the spec passed to ``mpx.get_policy``.
    loss_scaling: ``"dynamic"`` or ``None``: ``mixed_precision``'s ``loss_scale``
      (dynamic float16 runs grow their scale every
      :attr:`~mpx.demo._settings.Settings.growth_interval` steps).
    masters: whether half-precision params get float32 masters (``master_dtype``).
    layout: a few words on where params and optimizer state live.
    shows: one line on what the run demonstrates.
    compensation: ``"kahan"`` or ``"stochastic"`` to wrap the optimizer in
      ``mpx.with_kahan_summation`` / ``mpx.with_stochastic_rounding``
      (bfloat16 params without masters, layout (c)); ``None`` otherwise.
  """

  name: str
  policy: str
  loss_scaling: str | None
  masters: bool
  layout: str
  shows: str
  compensation: str | None = None

  @property
  def compute_dtype(self) -> str:
    """Name of the policy's compute dtype."""
    return np.dtype(mpx.get_policy(self.policy).compute_dtype).name

  @property
  def float16(self) -> bool:
    """Whether the run computes in float16 (and so can lose gradients to underflow)."""
    return self.compute_dtype == "float16"

  @property
  def half_params(self) -> bool:
    """Whether the policy stores params in float16 (layout (b))."""
    return np.dtype(mpx.get_policy(self.policy).param_dtype) == np.float16

  @property
  def scaled(self) -> bool:
    """Whether the loss is scaled: ``loss_scale="dynamic"`` is a no-op without float16."""
    return self.loss_scaling is not None and self.float16


CONFIGS = (
  RunConfig(
    "float32",
    "float32",
    "dynamic",
    True,
    "f32 params",
    "the reference every other run is compared with",
  ),
  RunConfig(
    "mixed_bfloat16",
    "mixed_bfloat16",
    "dynamic",
    True,
    "f32 params, bf16 compute",
    "bfloat16 has float32's exponent range: no loss scaling needed (the default turns it off)",
  ),
  RunConfig(
    "mixed_float16",
    "mixed_float16",
    "dynamic",
    True,
    "f32 params, f16 compute",
    "the recommended float16 path, layout (a): dynamic loss scaling keeps gradients in range",
  ),
  RunConfig(
    "float16_masters",
    F16_PARAMS,
    "dynamic",
    True,
    "f16 params + f32 masters",
    "layout (b): half the param bytes in the forward pass, float32 masters in the optimizer",
  ),
  RunConfig(
    "float16_masters_unscaled",
    F16_PARAMS,
    None,
    True,
    "f16 params + f32 masters",
    "layout (b) without loss scaling: isolates what loss scaling does",
  ),
  RunConfig(
    "float16_bare",
    F16_PARAMS,
    None,
    False,
    "f16 params, f16 opt state",
    "the paper's failure: float16 everywhere, no masters, no loss scaling",
  ),
)
"""The configurations a default run compares, in the order the table lists them."""

BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"
"""Layout (c): bfloat16 params and compute without float32 masters."""

EXTRA_CONFIGS = tuple(
  RunConfig(
    f"bfloat16_{name}",
    BF16_PARAMS,
    None,
    False,
    f"bf16 params, {layout}",
    shows,
    compensation,
  )
  for name, compensation, layout, shows in (
    ("nearest", None, "no masters", "bfloat16 weights without masters: small updates round away"),
    ("kahan", "kahan", "Kahan buffer", "layout (c): a bfloat16 compensation buffer, no masters"),
    (
      "stochastic",
      "stochastic",
      "stochastic rounding",
      "layout (c): unbiased stochastic rounding, no masters",
    ),
  )
)
"""Opt-in configurations (``--configs``): bfloat16 params without float32 masters."""

FP8_CONFIGS = tuple(
  RunConfig(
    f"float8_{scaling}",
    policy,
    "dynamic",
    True,
    "f32 params, fp8 matmuls",
    f"mixed_bfloat16 with the dense matmuls in float8 ({formats}), {scaling} scaling; the "
    "logits projection stays bfloat16",
  )
  for scaling, policy, formats in (
    ("current", "mixed_float8", "E4M3 forward, E5M2 gradients"),
    ("delayed", "mixed_float8_delayed", "E4M3 forward, E5M2 gradients"),
    ("rowwise", "mixed_float8_rowwise", "E4M3, a scale per row"),
    ("mxfp8", "mixed_mxfp8", "E4M3, a scale per block of 32"),
    (
      "blockwise",
      "mixed_float8_blockwise",
      "E4M3, a scale per 1x128 block, per 128x128 weight tile",
    ),
  )
)
"""Opt-in configurations (``--configs``): ``mixed_bfloat16`` with float8 matmuls, one per recipe."""

BY_NAME = {config.name: config for config in (*CONFIGS, *EXTRA_CONFIGS, *FP8_CONFIGS)}
