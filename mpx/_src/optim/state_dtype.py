"""Optimizer moments stored in a narrow dtype (bfloat16, or 8-bit block codes) and computed in float32."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.dtypes import F32
from mpx._src.optim import base, low_bit


def _is_moment(leaf: Any) -> bool:
  # Scalars (injected hyperparameters, loss scales) are not moments and keep their dtype.
  return tree_lib.is_floating_array(leaf) and leaf.ndim > 0


def _is_accumulating(x: Any) -> bool:
  return isinstance(x, optax.MultiStepsState)


def _map_moments(fn: Any, state: optax.OptState, path: tuple[Any, ...] = ()) -> optax.OptState:
  """Applies ``fn(path, moment)`` to every moment of ``state``, leaving other leaves as they are.

  A moment is a floating leaf of rank 1 or more, or a block-quantised
  :class:`~mpx._src.optim.low_bit.QuantizedMoment`. ``optax.MultiSteps``'
  ``acc_grads`` is a running mean of gradients, not a moment: narrowing it
  rounds every micro-batch's contribution, which costs about ``k`` roundings
  per applied step. Only the inner optimizer's state of a ``MultiStepsState``
  is searched.
  """

  def is_leaf(x: Any) -> bool:
    return _is_accumulating(x) or low_bit.is_quantized(x)

  def one(sub: tuple[Any, ...], x: Any) -> Any:
    if _is_accumulating(x):
      where = (*path, *sub, jax.tree_util.GetAttrKey("inner_opt_state"))
      return x._replace(inner_opt_state=_map_moments(fn, x.inner_opt_state, where))
    return fn((*path, *sub), x) if low_bit.is_quantized(x) or _is_moment(x) else x

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=is_leaf)


def find_moments(opt_state: optax.OptState) -> list[tuple[str, Any]]:
  """Returns the optimizer moments of ``opt_state``: its floating leaves of rank 1 or more.

  The masters of ``mpx.with_master_params`` and the buffers of
  ``mpx.with_kahan_summation`` are weights, not moments, and are skipped: of
  such a state only its ``inner_state`` is searched. ``optax.MultiSteps``'
  gradient accumulator is not a moment either: of its state only
  ``inner_opt_state`` is searched.

  Args:
    opt_state: any optimizer state.

  Returns:
    ``(path, leaf)`` pairs in flattening order, paths formatted as by
    ``tree.path_str``; a block-quantised moment is one leaf, its
    ``QuantizedMoment``.
  """

  def is_wrapper(x: Any) -> bool:
    return isinstance(x, base.HalfParamsState) or _is_accumulating(x)

  def is_leaf(x: Any) -> bool:
    return is_wrapper(x) or low_bit.is_quantized(x)

  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_leaf)[0]:
    if is_wrapper(leaf):
      field = "inner_opt_state" if _is_accumulating(leaf) else "inner_state"
      inner = find_moments(getattr(leaf, field))
      prefix = tree_lib.path_str((*path, jax.tree_util.GetAttrKey(field)))
      found += [(f"{prefix}/{p}" if p != "<root>" else prefix, x) for p, x in inner]
    elif low_bit.is_quantized(leaf) or _is_moment(leaf):
      found.append((tree_lib.path_str(path), leaf))
  return found


def check_state_dtype(
  opt_state: optax.OptState,
  state_dtype: dtypes_lib.DTypeLike,
  *,
  min_size: int = 4096,
) -> None:
  """Raises if a moment of ``opt_state`` is not stored in ``state_dtype``.

  Args:
    opt_state: any optimizer state, e.g. one restored from a checkpoint.
    state_dtype: the dtype the run keeps its optimizer moments in: a floating
      dtype, or ``"int8"`` / ``"float8_e4m3fn"`` for block-quantised moments.
    min_size: with block-quantised moments, the size below which a moment
      stays float32 (the ``min_size`` of :func:`with_state_dtype`).

  Raises:
    StateError: naming the first moment of another dtype, and how to restore
      the state with the run's dtypes.
  """
  fmt = low_bit.parse_format(state_dtype)
  if fmt is not None:
    for path, leaf in find_moments(opt_state):
      low_bit.check_quantized(path, leaf, fmt, min_size)
    return
  want = parse_state_dtype(state_dtype)
  for path, leaf in find_moments(opt_state):
    if low_bit.is_quantized(leaf) or leaf.dtype != want:
      got = "block-quantised" if low_bit.is_quantized(leaf) else leaf.dtype
      shape = list((leaf.codes if low_bit.is_quantized(leaf) else leaf).shape)
      raise errors.StateError(
        f"optimizer state leaf {path!r} is {got}{shape}, but this run keeps "
        f"its optimizer moments in {want} (state_dtype={want}): the state was built by another "
        "optimizer, or restored without a target or with one built by another optimizer. "
        "Restore it with jax.eval_shape(tx.init, params) as the target, where tx is this "
        "run's optimizer (orbax then casts the moments), or pass the state_dtype the run uses."
      )


def parse_state_dtype(state_dtype: Any) -> np.dtype:
  """The floating dtype ``state_dtype`` names; the error also lists the 8-bit formats."""
  try:
    return dtypes_lib.parse_dtype(state_dtype)
  except errors.PolicyError as e:
    raise errors.PolicyError(
      f"{e} For block-quantised 8-bit moments, state_dtype also accepts "
      f"{', '.join(repr(f) for f in low_bit.FORMATS)}."
    ) from None


def with_state_dtype(
  inner: optax.GradientTransformation,
  state_dtype: dtypes_lib.DTypeLike | str,
  *,
  block_size: int = 256,
  min_size: int = 4096,
) -> optax.GradientTransformationExtraArgs:
  """Stores the moments of ``inner`` in ``state_dtype`` and computes them in float32.

  A moment is a floating leaf of rank 1 or more of the inner state (adam's
  ``mu`` and ``nu``, a momentum ``trace``, adafactor's factors); scalars such
  as injected hyperparameters and integer counts keep their dtypes, and so
  does ``optax.MultiSteps``' gradient accumulator ``acc_grads``: a running
  mean of ``k`` micro-batches, stored narrow it would be rounded ``k`` times
  per applied step (about ``k`` times the error of one rounding), so
  ``with_state_dtype(optax.MultiSteps(inner, k), ...)`` narrows the moments of
  ``inner`` only, like ``optax.MultiSteps(with_state_dtype(inner, ...), k)``
  (ask for a narrow accumulator with ``MultiSteps``' own
  ``accumulator_dtype``). Each step

  .. math::

     s_{32} = \\mathrm{float32}(s), \\qquad (u, s'_{32}) =
     \\mathrm{inner}(\\mathrm{float32}(g), s_{32}, p), \\qquad s' = \\mathrm{cast}(s'_{32}),

  so every moment is rounded once per step, to nearest, and the arithmetic of
  ``inner`` (bias correction, division, weight decay) is float32: half-precision
  gradients are converted first (adam's ``g**2`` underflows in float16), and
  the updates of half-precision params are float32 then. The state
  keeps the structure of the inner state (``optax.tree_utils.tree_get(state,
  "nu")`` finds the moments), and a checkpoint of either dtype restores into
  the other through orbax's cast to the restore target.

  Precision: a bfloat16 moment holds 8 significant bits, so one step's
  relative error is at most ``2**-9`` and a step that changes a moment by
  less than that is lost. Adam's ``nu`` with ``b2 = 0.999`` changes by at
  most ``1 - b2 = 0.1%`` a step when the gradients shrink, which rounds away:
  stored to nearest, it only grows, so the step sizes follow the largest
  recent gradients rather than their average (AMSGrad-like). ``mu`` with
  ``b1 = 0.9`` moves by up to 10% a step and is unaffected. On digits the
  loss stays within 0.001 of float32 moments
  (``benchmarks/compensated_training.py``). Float16 moments underflow: adam's
  first ``nu = 0.001 g**2`` is zero in float16 for ``|g|`` below about
  ``5e-3``; prefer bfloat16.

  Bytes per parameter with adamw: 4 (two bfloat16 moments) instead of 8.
  **8-bit moments** (``state_dtype="int8"`` or ``"float8_e4m3fn"``): every
  moment of at least ``min_size`` elements is stored block-wise quantised, as
  a :class:`mpx.QuantizedMoment`: 8-bit codes of the moment's shape and a
  float32 scale (the largest magnitude) per block of ``block_size``
  consecutive elements. Each step dequantises to float32, runs ``inner``, and
  quantises the new moments. The codes suit each moment: the first moment
  (``mu``, momentum traces) is signed and adam divides it element by element
  by ``sqrt(nu)``, so its relative error matters at every magnitude; int8
  stores ``round(127 * sign * sqrt(|x| / scale))`` (square-root companding:
  magnitudes down to 1/16,000 of the block's largest, where a linear code
  stops at 1/254), float8 stores ``448 x / scale`` in E4M3. The second
  moment ``nu`` (selected by its field name) is non-negative and enters the
  update as ``sqrt(nu)``: int8 stores the square root of its square root on
  the full unsigned range, uint8 ``round(255 (nu / scale)**(1/4))``; float8
  stores ``448 nu / scale`` in E4M3, whose exponent spans ``sqrt(nu)`` over
  2**8.9 (coding ``sqrt(nu)`` instead measured 0.009 nats worse on the demo);
  a positive ``nu`` never reads back as zero. Smaller moments (norm scales,
  biases) are stored in float32, those of bfloat16 and float16 params too, as
  Dettmers et al. and bitsandbytes keep them. Bytes per parameter with
  adamw: about 2.03 (two codes, a scale per 256 of each). On the demo's transformer
  the loss stays within 0.02 nats of float32 moments
  (``benchmarks/optimizer_memory.py``, ``docs/memory.md``). Codes keep the
  param's shape and sharding; the scales keep the param's leading axes when
  the trailing ones hold whole blocks, and are a flat, replicated vector
  otherwise.

  Put it inside the masters or compensation wrappers
  (``mpx.with_kahan_summation(mpx.with_state_dtype(optax.adamw(3e-4),
  state_dtype="bfloat16"))``), which hand ``inner`` float32 gradients and
  weights.

  Args:
    inner: the optimizer whose moments to store narrower, e.g.
      ``optax.adamw(3e-4)``.
    state_dtype: the storage dtype of the moments, e.g. ``jnp.bfloat16``, or
      ``"int8"`` / ``"float8_e4m3fn"`` for block-quantised 8-bit moments.
    block_size: 8-bit moments: elements per block that shares a scale.
    min_size: 8-bit moments: moments with fewer elements are stored in float32.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with the state of ``inner``,
    its moments cast to ``state_dtype`` (or replaced by
    :class:`mpx.QuantizedMoment` s); ``update`` forwards ``params`` and extra
    arguments to ``inner``.

  Raises:
    PolicyError: ``state_dtype`` is neither a floating dtype mpx supports nor
      an 8-bit format; the message lists both.
    ConfigError: ``block_size`` or ``min_size`` is not a positive integer.
    StateError: at ``update``, a moment of the state is not ``state_dtype``
      (a checkpoint restored with another optimizer's dtypes).

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> tx = mpx.with_state_dtype(optax.adam(1e-3), state_dtype=jnp.bfloat16)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> state[0].mu["w"].dtype, state[0].nu["w"].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype(bfloat16), dtype('int32'))
    >>> tx = mpx.with_state_dtype(optax.adam(1e-3), state_dtype="int8")
    >>> mu = tx.init({"w": jnp.ones((64, 64))})[0].mu["w"]
    >>> mu.codes.dtype, mu.codes.shape, mu.scales.shape
    (dtype('int8'), (64, 64), (16,))

  References:
    Zamirai, Zhang, Aberger, De Sa, *Revisiting BFloat16 Training*, 2020
    (bfloat16 optimizer state with compensated or stochastically rounded
    weight updates). Dettmers, Lewis, Shleifer, Zettlemoyer, *8-bit
    Optimizers via Block-wise Quantization*, ICLR 2022 (block-wise 8-bit
    moments, 32-bit ones for tensors under 4096 elements).
  """
  fmt = low_bit.parse_format(state_dtype)
  if fmt is not None:
    return _with_quantized_moments(inner, fmt, block_size=block_size, min_size=min_size)
  state_dtype = parse_state_dtype(state_dtype)
  compute_dtype = dtypes_lib.at_least_float32(state_dtype)
  inner = optax.with_extra_args_support(inner)

  def cast(state: optax.OptState, dtype: np.dtype) -> optax.OptState:
    return _map_moments(lambda _, x: x.astype(dtype), state)

  def init_fn(params: optax.Params) -> optax.OptState:
    state = cast(inner.init(params), state_dtype)
    return tree_lib.place_state(state, params)

  def update_fn(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState]:
    check_state_dtype(state, state_dtype)
    grads = jax.tree.map(base.widened, updates)
    new_updates, new_state = inner.update(grads, cast(state, compute_dtype), params, **extra_args)
    return new_updates, cast(new_state, state_dtype)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _with_quantized_moments(
  inner: optax.GradientTransformation, fmt: str, *, block_size: int, min_size: int
) -> optax.GradientTransformationExtraArgs:
  """``with_state_dtype`` for 8-bit block-quantised moments (``fmt`` is ``"int8"`` or float8)."""
  for name, value in (("block_size", block_size), ("min_size", min_size)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise errors.ConfigError(
        f"mpx.with_state_dtype(..., state_dtype={fmt!r}, {name}={value!r}): {name} must be a "
        "positive int (the defaults are block_size=256, min_size=4096)."
      )
  inner = optax.with_extra_args_support(inner)

  def quantize(path: tuple[Any, ...], x: Any) -> Any:
    if low_bit.is_quantized(x):
      return x
    if x.size < min_size:  # also the moments of half params, which optax makes in their dtype
      return x.astype(F32)
    return low_bit.quantize(x, low_bit.code_for(path, fmt), block_size)

  def dequantize(path: tuple[Any, ...], x: Any) -> Any:
    if not low_bit.is_quantized(x):
      return x
    return low_bit.dequantize(x, low_bit.code_for(path, fmt), block_size)

  def init_fn(params: optax.Params) -> optax.OptState:
    # Codes on their param's sharding, scales on its leading axes (tree.shardings_like_params).
    return tree_lib.place_state(_map_moments(quantize, inner.init(params)), params)

  def update_fn(
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, optax.OptState]:
    check_state_dtype(state, fmt, min_size=min_size)
    grads = jax.tree.map(base.widened, updates)
    new_updates, new_state = inner.update(
      grads, _map_moments(dequantize, state), params, **extra_args
    )
    return new_updates, _map_moments(quantize, new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
