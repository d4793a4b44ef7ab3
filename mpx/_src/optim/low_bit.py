"""Optimizer moments in 8 bits: block-wise scaled int8 or float8 codes, computed in float32.

Each moment leaf of at least ``min_size`` elements is stored as a
:class:`QuantizedMoment`: 8-bit codes of the leaf's own shape, and a float32
scale per block of ``block_size`` consecutive elements (row-major order), the
largest magnitude of the block. A value ``x`` of a block with scale ``s`` is
stored as the code of ``y = x / s`` (in ``[-1, 1]``), and read back as
``s * decode(code)``. The codes follow the moment:

* the first moment (adam's ``mu``, momentum traces: every moment but ``nu``)
  is signed and spans several orders of magnitude within a block; adam
  divides it by ``sqrt(nu)`` element by element, so a small ``mu`` beside a
  small ``nu`` matters as much as a large one, and its *relative* error is
  what counts. int8: ``round(127 * sign(y) * sqrt(|y|))``, read back as
  ``sign * (code / 127)**2``: the square-root companding resolves magnitudes
  down to ``1/127**2`` of the block's largest, about 1/16,000, where linear
  int8 stops at 1/254. float8_e4m3fn: ``448 * y`` rounded to E4M3, whose
  exponent already covers 2**-9 to 448;
* the second moment (``nu``) is non-negative and enters the update as
  ``sqrt(nu)``. int8 stores it on the full unsigned range through the square
  root of its square root: uint8 ``round(255 * y**(1/4))``, read back as
  ``(code / 255)**4``, which resolves ``nu`` down to ``255**-4`` of the
  block's largest (``sqrt(nu)`` down to 1/65,000). float8_e4m3fn stores
  ``448 * y`` itself: E4M3's range (2**-9 to 448) already spans ``sqrt(nu)``
  over 2**8.9, and coding ``sqrt(nu)`` instead halves the relative
  precision of ``nu``'s square root; on the demo's transformer that cost
  0.009 nats (a loss gap to float32 adamw of -0.023 against -0.014 with
  ``nu`` coded directly, ``benchmarks/optimizer_memory.py``). A positive
  ``nu`` never rounds to zero (its code is at least the smallest positive
  one): adam would divide a surviving ``mu`` by ``eps`` alone.

Codes keep the param's shape, so a moment of a sharded param is sharded like
it; the scales keep the param's leading axes whenever the trailing ones hold
whole blocks (a ``(1024, 4096)`` kernel has ``(1024, 16)`` scales), and are
one flat vector otherwise (replicated: 4 bytes per 256 params).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpx._src import errors
from mpx._src.dtypes import F32

INT8 = "int8"
FLOAT8 = "float8_e4m3fn"
FORMATS = (INT8, FLOAT8)
"""The ``state_dtype`` names of block-quantised moments."""

SECOND_MOMENTS = frozenset({"nu"})
"""State field names stored with the non-negative code (adam's second moment)."""


class QuantizedMoment(NamedTuple):
  """A moment stored in 8 bits with a float32 scale per block.

  Attributes:
    codes: the codes, with the shape of the moment (and of its param):
      ``int8`` or ``uint8`` for ``state_dtype="int8"``, ``float8_e4m3fn``
      for ``state_dtype="float8_e4m3fn"``.
    scales: float32, the largest magnitude of each block of the moment;
      shape ``moment.shape[:k] + (blocks,)`` (see the module docstring).
  """

  codes: jax.Array
  scales: jax.Array


@dataclasses.dataclass(frozen=True)
class Code:
  """An 8-bit code for values ``y`` in ``[-1, 1]`` (``[0, 1]`` when not signed).

  ``y`` is stored as ``top * |y|**(1/power)`` rounded to ``storage`` (with
  ``y``'s sign if ``signed``) and read back as ``(code / top)**power``.
  """

  storage: np.dtype
  signed: bool
  power: int
  top: float

  def encode(self, y: jax.Array) -> jax.Array:
    """The codes of ``y`` (float32 in ``[-1, 1]``)."""
    a = jnp.abs(y) if self.signed else jnp.maximum(y, 0.0)
    for _ in range(self.power.bit_length() - 1):  # power 1, 2, 4: that many square roots
      a = jnp.sqrt(a)
    t = jnp.minimum(a * self.top, self.top)
    if jnp.issubdtype(self.storage, jnp.integer):
      t = jnp.round(t)
    q = t.astype(self.storage)
    if not self.signed:
      # A positive second moment read back as zero would make adam divide by eps alone.
      smallest = jnp.asarray(1 if jnp.issubdtype(self.storage, jnp.integer) else 2.0**-9)
      q = jnp.where((y > 0) & (q == 0), smallest.astype(self.storage), q)
    if self.signed:
      q = jnp.where(y < 0, -q, q)
    return q

  def decode(self, q: jax.Array) -> jax.Array:
    """The float32 values in ``[-1, 1]`` the codes ``q`` stand for."""
    t = q.astype(F32) / jnp.float32(self.top)
    y = t
    for _ in range(self.power.bit_length() - 1):
      y = y * jnp.abs(y)  # keeps the sign: sign(t) |t|**power for power 2 and 4
    return y


CODES = {
  INT8: (Code(np.dtype(np.int8), True, 2, 127.0), Code(np.dtype(np.uint8), False, 4, 255.0)),
  FLOAT8: (
    Code(np.dtype(jnp.float8_e4m3fn), True, 1, 448.0),
    Code(np.dtype(jnp.float8_e4m3fn), False, 1, 448.0),
  ),
}
"""``state_dtype`` -> (first-moment code, second-moment code)."""


def parse_format(value: Any) -> str | None:
  """The block-quantised format ``value`` names (``"int8"``, ``jnp.int8``...), or ``None``."""
  if isinstance(value, str):
    key = value.strip().lower()
    return key if key in FORMATS else None
  try:
    name = np.dtype(value).name
  except TypeError:
    return None
  return name if name in FORMATS else None


def code_for(path: tuple[Any, ...], state_dtype: str) -> Code:
  """The code of the moment at ``path`` of an optimizer state: ``nu`` gets the second one."""
  names = {getattr(k, "name", getattr(k, "key", None)) for k in path}
  first, second = CODES[state_dtype]
  return second if names & SECOND_MOMENTS else first


def lead_axes(shape: tuple[int, ...], block_size: int) -> int:
  """How many leading axes the scales keep: the most whose trailing axes hold whole blocks."""
  for k in range(len(shape) - 1, -1, -1):
    if math.prod(shape[k:]) % block_size == 0:
      return k
  return 0


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` as ``shape[:k] + (blocks, block_size)``, zero-padded at the end if it must be."""
  k = lead_axes(x.shape, block_size)
  flat = x.reshape(*x.shape[:k], -1)
  pad = -flat.shape[-1] % block_size
  if pad:
    flat = jnp.pad(flat, [(0, 0)] * k + [(0, pad)])
  return flat.reshape(*x.shape[:k], -1, block_size)


def quantize(x: jax.Array, code: Code, block_size: int) -> QuantizedMoment:
  """Stores the float32 moment ``x`` in 8-bit codes with a scale per block.

  Args:
    x: the moment, a float array.
    code: how a value divided by its block's scale becomes a code.
    block_size: elements per block.

  Returns:
    The :class:`QuantizedMoment`; codes of ``x``'s shape.
  """
  blocks = _blocks(x.astype(F32), block_size)
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  safe = jnp.where(scales > 0, scales, 1.0)[..., None]
  codes = code.encode(blocks / safe)
  k = codes.ndim - 2
  codes = codes.reshape(*x.shape[:k], -1)[..., : math.prod(x.shape[k:])]
  return QuantizedMoment(codes.reshape(x.shape), scales)


def dequantize(q: QuantizedMoment, code: Code, block_size: int) -> jax.Array:
  """The float32 moment a :class:`QuantizedMoment` stands for.

  Args:
    q: the stored moment.
    code: the code it was stored with.
    block_size: elements per block.

  Returns:
    A float32 array of the codes' shape.
  """
  blocks = code.decode(_blocks(q.codes, block_size)) * q.scales[..., None]
  k = blocks.ndim - 2
  flat = blocks.reshape(*blocks.shape[:k], -1)[..., : math.prod(q.codes.shape[k:])]
  return flat.reshape(q.codes.shape)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedMoment)


def check_quantized(path: str, leaf: Any, state_dtype: str, min_size: int) -> None:
  """Raises if the moment at ``path`` is not stored as ``state_dtype`` asks."""
  if is_quantized(leaf):
    want = {c.storage for c in CODES[state_dtype]}
    if leaf.codes.dtype in want and leaf.scales.dtype == F32:
      return
    got = f"{leaf.codes.dtype} codes with {leaf.scales.dtype} scales"
  elif leaf.size < min_size and leaf.dtype == F32:
    return
  else:
    got = f"{leaf.dtype}{list(leaf.shape)}"
  raise errors.StateError(
    f"optimizer state leaf {path!r} is {got}, but this run keeps its optimizer moments in "
    f"{state_dtype} (block-quantised; float32 below {min_size} elements): the state was built "
    "by another optimizer, or restored without a target or with one built by another "
    "optimizer. Restore it with jax.eval_shape(tx.init, params) as the target, where tx is "
    "this run's optimizer, or rebuild it with tx.init(params)."
  )
