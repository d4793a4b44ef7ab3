"""The float8 scaling recipe of a policy (:class:`Fp8Recipe`) and its string form.

Core module beside :mod:`mpx._src.policy`, which parses ``fp8=...`` policy
strings with it; the float8 kernels live in :mod:`mpx._src.ops.fp8`.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

from mpx._src import errors

_SCALINGS = ("current", "delayed", "rowwise", "mxfp8", "blockwise")
_KEEP_BACKWARD = ("none", "weight_grad", "all")
_REDUCTIONS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How the float8 matmuls of a policy choose their per-tensor scales.

  * ``"current"`` scaling: each tensor's scale comes from its own amax,
    measured just before it is quantised. No state; one extra reduction over
    every operand (and over every gradient in the backward pass).
  * ``"delayed"`` scaling (the recipe of NVIDIA Transformer Engine's
    ``DelayedScaling``): the scale comes from the amaxes recorded in earlier
    steps, ``max`` over the last ``history_length`` or the ``most_recent``
    non-zero one; the current amax is only recorded, so quantising does not
    wait for it (XLA quantises in the pass that produces or reads the
    tensor). The history is state (see :func:`update_fp8_state`); while it
    is empty (the first optimizer step) the scale is 1, as in Transformer
    Engine and Flax: for that step large values saturate and small gradients
    flush to zero in E5M2.
  * ``"rowwise"`` scaling (torchao's rowwise recipe): current scaling with
    one scale per row instead of per tensor. Each operand of each product
    gets a scale per index of the axes the product keeps (per row of the
    activations, per column of a ``(in, out)`` kernel), from the amax over
    the axes it contracts, so one outlier row no longer coarsens the rest.
    The scales are constant along the contraction, so they still apply to
    the float32 result of a plain float8 GEMM. Each backward product
    contracts an axis along which a saved operand's scales vary; those
    powers of two are folded into the gradient (exact in float32), which is
    quantised per row for that product, and the saved float8 operands are
    used as they are. Gradients are E4M3 as well (as in torchao's rowwise
    recipe and
    DeepSeek-V3): per row, their range is that of the row. No state.
  * ``"mxfp8"`` (OCP Microscaling, native on Blackwell GPUs): one
    power-of-two E8M0 scale per block of 32 elements along each product's
    contraction, E4M3 values for every operand and the gradient, through
    ``jax.lax.scaled_dot`` (see :mod:`mpx._src.ops.mx`). No state;
    ``axis_name`` does not apply (a block never spans devices).
  * ``"blockwise"`` (DeepSeek-V3's recipe): one float32 power-of-two scale
    per 1 x 128 block along each product's contraction for activations and
    gradients, per 128 x 128 tile for the rhs operand (the weight, which a
    tile's scale covers along both axes, so it is quantised once), E4M3
    everywhere, through ``jax.lax.scaled_dot`` like MXFP8. No state. On
    Hopper, XLA 0.10 and 0.11 run it as a bfloat16 GEMM of the dequantised
    operands (no float8 kernel applies per-128 float32 scales there): a
    recipe for its numerics, not its speed, until XLA has one.

  The scale ``s`` is the power of two that brings the amax to at most
  ``fp8_max / 2**margin``; values beyond the format's max after scaling are
  clamped to it (saturation), NaN stays NaN.

  Attributes:
    scaling: ``"current"``, ``"delayed"``, ``"rowwise"``, ``"mxfp8"`` or ``"blockwise"``.
    history_length: amaxes kept per tensor (delayed scaling).
    reduction: ``"max"`` or ``"most_recent"``: how the history gives the
      amax that sets the scale (delayed scaling; zero entries, steps that saw
      an empty or all-zero tensor, are ignored).
    margin: extra headroom, in powers of two, below the format's max.
    axis_name: a named axis (``pmap``, ``shard_map``) over which the amaxes
      are reduced with ``jax.lax.pmax``, so that devices sharing a tensor
      share its scale; under ``jit`` with shardings the amax of a sharded
      tensor is already global and this stays ``None``.
    attention: also run the two matmuls of attention layers (scores and
      weighted values) in float8, with current scaling whatever ``scaling``
      says (their operands are activations, fresh each call). Needs
      ``KeepRules.softmax_in_float32`` (mpx's attention function); the
      softmax between them stays float32.
    keep_backward: ``"none"`` (both backward products in float8),
      ``"weight_grad"`` (the weight gradient in the compute dtype, the input
      gradient in float8) or ``"all"`` (both in the compute dtype): a kept
      product multiplies the saved float8 operands, dequantised, by the
      unquantised gradient. Per layer, with a keep rule:
      ``KeepRules().with_path("^head$", "p=f32,c=bf16,o=f32,fp8=current:keep_backward=all")``.
      Not for the block-scaled recipes (MXFP8, blockwise).

  Raises:
    PolicyError: an unknown scaling, reduction or ``keep_backward``, a
      history length below 1, or a negative margin.

  Example:
    >>> import mpx
    >>> print(mpx.Fp8Recipe("delayed", history_length=1024, reduction="most_recent"))
    delayed:history=1024:reduction=most_recent
  """

  scaling: str = "current"
  history_length: int = 16
  reduction: str = "max"
  margin: int = 0
  axis_name: str | None = None
  attention: bool = False
  keep_backward: str = "none"

  def __post_init__(self) -> None:
    for name in ("history_length", "margin"):
      object.__setattr__(self, name, _whole_number(name, getattr(self, name)))
    if self.axis_name is not None and not (
      isinstance(self.axis_name, str) and re.fullmatch(_AXIS_NAME, self.axis_name)
    ):
      raise errors.PolicyError(
        f"The fp8 axis name must be a non-empty string of letters, digits, '_', '-' or '.' "
        f"(it is written into policy strings, between ':' and ','), got {self.axis_name!r}."
      )
    if self.scaling not in _SCALINGS:
      raise errors.PolicyError(
        f"Unknown fp8 scaling {self.scaling!r}; write 'current' (each tensor's own amax, no "
        "state), 'delayed' (an amax history kept as state), 'rowwise' (one scale per row, "
        "no state), 'mxfp8' (a scale per block of 32, no state) or 'blockwise' (a scale per "
        "1 x 128 block, per 128 x 128 weight tile, no state)."
      )
    if self.reduction not in _REDUCTIONS:
      raise errors.PolicyError(
        f"Unknown amax history reduction {self.reduction!r}; write 'max' or 'most_recent'."
      )
    if self.history_length < 1:
      raise errors.PolicyError(
        f"history_length must be at least 1, got {self.history_length}; 1 keeps the most "
        "recent amax only."
      )
    if self.margin < 0:
      raise errors.PolicyError(f"margin must be a non-negative power of two, got {self.margin}.")
    if self.keep_backward not in _KEEP_BACKWARD:
      raise errors.PolicyError(
        f"Unknown keep_backward {self.keep_backward!r}; write 'none' (backward products in "
        "float8), 'weight_grad' (the weight gradient in the compute dtype) or 'all'."
      )
    if self.keep_backward != "none" and self.block_scaled:
      raise errors.PolicyError(
        f"keep_backward applies to the per-tensor and rowwise recipes, not to {self.scaling!r} "
        "(its saved operands are blocked for the float8 backward products); use "
        "keep_backward='none'."
      )

  @property
  def delayed(self) -> bool:
    """Whether the recipe keeps an amax history (state)."""
    return self.scaling == "delayed"

  @property
  def block_scaled(self) -> bool:
    """Whether the recipe scales blocks along the contraction (MXFP8, blockwise)."""
    return self.scaling in ("mxfp8", "blockwise")

  @property
  def rowwise(self) -> bool:
    """Whether each operand has one scale per row (per index of the axes its product keeps)."""
    return self.scaling == "rowwise"

  def __str__(self) -> str:
    # Only what differs from the defaults, so that a preset prints as written; every
    # such field, whatever the scaling, so that parse_recipe(str(r)) == r.
    parts = [self.scaling]
    defaults = Fp8Recipe(self.scaling)
    if self.history_length != defaults.history_length:
      parts.append(f"history={self.history_length}")
    if self.reduction != defaults.reduction:
      parts.append(f"reduction={self.reduction}")
    parts += [f"margin={self.margin}"] if self.margin else []
    parts += [f"axis={self.axis_name}"] if self.axis_name else []
    parts += ["attention"] if self.attention else []
    parts += [f"keep_backward={self.keep_backward}"] if self.keep_backward != "none" else []
    return ":".join(parts)

  def for_attention(self) -> Fp8Recipe:
    """The recipe of attention matmuls: rowwise and block-scaled stay, delayed becomes current (same margin and axis)."""
    scaling = "current" if self.delayed else self.scaling
    return dataclasses.replace(self, scaling=scaling, attention=False)


_RECIPE_KEYS = {"history": "history_length", "margin": "margin"}
_WORD_KEYS = {"reduction": "reduction", "keep_backward": "keep_backward"}
_AXIS_NAME = r"[A-Za-z0-9_.\-]+"
_RECIPE_FORM = (
  "'delayed:history=<n>:reduction=<max|most_recent>:margin=<n>:axis=<name>:attention:"
  "keep_backward=<none|weight_grad|all>' (every part optional), or 'current', 'rowwise', "
  "'mxfp8' or 'blockwise' (with margin, axis, attention, keep_backward)"
)


def _whole_number(name: str, value: Any) -> int:
  """``value`` as a Python int; a bool, a fraction or a non-number is a :class:`PolicyError`."""
  if not isinstance(value, bool):
    try:
      return operator.index(value)
    except TypeError:
      pass
  raise errors.PolicyError(f"{name} must be a whole number, got {value!r}.")


def parse_recipe(spec: str) -> Fp8Recipe:
  """Parses a recipe as written in a policy string, the inverse of ``str(recipe)``.

  Args:
    spec: ``"current"``, ``"delayed"`` or e.g.
      ``"delayed:history=1024:reduction=most_recent:margin=1:axis=data"``.

  Returns:
    The :class:`Fp8Recipe`.

  Raises:
    PolicyError: an unknown part.
  """
  # Everything but the axis name ignores case, like the rest of a policy string; JAX's
  # axis names are case-sensitive.
  scaling, *parts = (part.strip() for part in spec.strip().split(":"))
  fields: dict[str, Any] = {"scaling": scaling.lower()}
  for part in parts:
    key, sep, value = (s.strip() for s in part.partition("="))
    key = key.lower()
    if key == "attention" and not sep:
      fields["attention"] = True
    elif not sep or key not in (*_RECIPE_KEYS, *_WORD_KEYS, "axis"):
      raise errors.PolicyError(
        f"Cannot parse {part!r} in the fp8 recipe {spec!r}: write {_RECIPE_FORM}."
      )
    elif key == "axis":
      if not re.fullmatch(_AXIS_NAME, value):
        raise errors.PolicyError(
          f"Cannot parse {part!r} in the fp8 recipe {spec!r}: the axis name must be letters, "
          "digits, '_', '-' or '.', e.g. 'axis=data'."
        )
      fields["axis_name"] = value
    elif key in _WORD_KEYS:
      fields[_WORD_KEYS[key]] = value.lower()
    elif re.fullmatch(r"[+-]?\d+", value):
      fields[_RECIPE_KEYS[key]] = int(value)
    else:
      raise errors.PolicyError(
        f"Cannot parse {part!r} in the fp8 recipe {spec!r}: {key} takes a whole number, e.g. "
        f"'{key}={Fp8Recipe.history_length if key == 'history' else 1}'."
      )
  return Fp8Recipe(**fields)
