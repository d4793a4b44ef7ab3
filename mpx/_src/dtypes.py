"""Dtype names that mpx understands, and how they are parsed.

``half`` always means IEEE float16, the format the paper trains in, on every
platform. jmp maps ``half`` to bfloat16 on TPU; mpx does not, so that one
config string means the same numerics everywhere. Write ``bf16`` for bfloat16.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from mpx._src import errors

DTypeLike = Any

F32 = np.dtype(np.float32)

_ALIASES: dict[str, tuple[str, ...]] = {
  "float32": ("float32", "f32", "full", "single", "fp32"),
  "bfloat16": ("bfloat16", "bf16"),
  "float16": ("float16", "f16", "half", "fp16"),
  "float64": ("float64", "f64", "double", "fp64"),
}
_BY_NAME: dict[str, np.dtype] = {
  alias: np.dtype(getattr(jnp, canonical))
  for canonical, aliases in _ALIASES.items()
  for alias in aliases
}
VALID_NAMES: tuple[str, ...] = tuple(_BY_NAME)
_SUPPORTED: frozenset[np.dtype] = frozenset(_BY_NAME.values())


def parse_dtype(value: DTypeLike) -> np.dtype:
  """Turns a dtype name or dtype-like object into a NumPy dtype.

  Args:
    value: a name such as ``"bf16"``, ``"float32"`` or ``"half"`` (case and
      surrounding whitespace are ignored), or a dtype-like object such as
      ``jnp.bfloat16`` or ``np.dtype("float16")``.

  Returns:
    The ``np.dtype``; one of float32, bfloat16, float16 or float64.

  Raises:
    PolicyError: the name is unknown or the dtype is not a supported floating
      dtype; the message lists the valid names.
  """
  if isinstance(value, str):
    key = value.strip().lower()
    if key in _BY_NAME:
      return _BY_NAME[key]
    raise errors.PolicyError(
      f"Unknown dtype name {value!r}. Valid names are: {', '.join(VALID_NAMES)} "
      "('half' is float16 on every platform; write 'bf16' for bfloat16)."
    )
  dtype = lookup_dtype(value)
  if dtype is None or dtype not in _SUPPORTED:
    raise errors.PolicyError(
      f"{value!r} is not a dtype a precision policy can use. Pass one of "
      "jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64 or a name: "
      f"{', '.join(VALID_NAMES)}."
    )
  return dtype


def lookup_dtype(value: Any) -> np.dtype | None:
  """Returns the dtype ``value`` names or is, of any kind, or ``None`` if it is none.

  The lenient sibling of :func:`parse_dtype`, for tools that accept every
  format JAX knows (the float8 formats among them): a name is one of
  :data:`VALID_NAMES` or the name of a JAX dtype (``"float8_e4m3fn"``), case
  and surrounding whitespace ignored.

  Args:
    value: a name, or a dtype-like object such as ``jnp.float8_e5m2``.

  Returns:
    The ``np.dtype``, or ``None`` when ``value`` is ``None`` or names no dtype.
  """
  if isinstance(value, str):
    key = value.strip().lower()
    if key in _BY_NAME:
      return _BY_NAME[key]
    value = getattr(jnp, key, None)
  try:
    # np.dtype(None) is float64; a missing dtype must not silently mean double.
    return None if value is None else np.dtype(value)
  except (TypeError, ValueError):
    return None


def is_floating(dtype: DTypeLike) -> bool:
  """Returns whether ``dtype`` is a real floating dtype (float8 to float64).

  The one floating-point test of mpx. NumPy's ``issubdtype`` says bfloat16 and
  the float8 formats are not floating (they come from ``ml_dtypes``); JAX's
  knows them.

  Args:
    dtype: any dtype-like object; ``None`` and objects that are not dtypes
      (e.g. a typed PRNG key's dtype) are not floating.

  Returns:
    ``True`` for float8, bfloat16, float16, float32 and float64.
  """
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(dtype, np.floating))
  except TypeError:
    return False


def is_half(dtype: DTypeLike) -> bool:
  """Returns whether ``dtype`` is a 16-bit (or narrower) floating dtype.

  Args:
    dtype: any dtype-like object.

  Returns:
    ``True`` for float16, bfloat16 and the float8 formats.
  """
  return is_floating(dtype) and np.dtype(dtype).itemsize <= 2


def can_hold(wide: DTypeLike, narrow: DTypeLike) -> bool:
  """Returns whether every ``narrow`` value is exactly representable in ``wide``.

  Args:
    wide: a floating dtype, e.g. a master dtype.
    narrow: a floating dtype, e.g. a param dtype.

  Returns:
    ``True`` when ``wide`` has at least ``narrow``'s mantissa bits and exponent
    range (float32 holds float16 and bfloat16; bfloat16 and float16 hold
    neither each other nor float32).
  """
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def is_float8(dtype: DTypeLike) -> bool:
  """Returns whether ``dtype`` is one of the 8-bit floating formats (``float8_e4m3fn``...).

  Args:
    dtype: any dtype-like object.

  Returns:
    ``True`` for the float8 formats.
  """
  return is_floating(dtype) and np.dtype(dtype).itemsize == 1


def at_least_float32(dtype: DTypeLike) -> np.dtype:
  """Returns the dtype a floating ``dtype`` is widened to for arithmetic: float32, or itself if wider.

  The one rule behind every float32 computation on half-precision values:
  unscaling gradients, softmax, moments computed from a narrow store, the
  masters' weights. float64 stays float64.

  Args:
    dtype: a floating dtype.

  Returns:
    ``float32`` for float8, bfloat16, float16 and float32; ``dtype`` itself
    when it is wider.
  """
  dtype = np.dtype(dtype)
  return dtype if dtype.itemsize > 4 else F32
