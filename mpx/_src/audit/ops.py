"""The records of a dtype audit: one matmul or convolution (:class:`MatmulOp`), one reduction."""

from __future__ import annotations

import dataclasses

import numpy as np

from mpx._src import dtypes as dtypes_lib


@dataclasses.dataclass(frozen=True)
class MatmulOp:
  """One matrix product or convolution of the audited program.

  Attributes:
    kind: ``"dot_general"``, ``"dot"`` or ``"convolution"``.
    lhs_dtype: dtype of the left operand (the activations of a forward layer).
    rhs_dtype: dtype of the right operand (the kernel of a forward layer).
    result_dtype: dtype the op returns; float32 with half operands means
      ``preferred_element_type=float32`` was requested.
    accumulation_dtype: the accumulation type when the op pins a dot algorithm,
      else ``None`` (the backend's default: float32 for half operands on GPUs).
    precision: the op's ``precision_config`` per operand, e.g.
      ``("DEFAULT", "DEFAULT")`` (what ``jax.default_matmul_precision`` or a
      ``precision=`` argument asked for when the program was lowered); ``()``
      when the op has none (the default).
    algorithm_precision: the operand precision type of a pinned dot algorithm
      (``"tf32"``, ``"f32"``, ``"bf16"``...), else ``None``.
    upcast: which operands (``"lhs"``, ``"rhs"``) are a half-precision tensor
      converted to a wider float just before the op (through reshapes,
      transposes, broadcasts and chains of converts): half data multiplied as
      float32, typically a float32 cotangent meeting a half activation in the
      backward pass, or float32 params promoting half inputs.
    lhs_shape: shape of the left operand.
    rhs_shape: shape of the right operand.
    result_shape: shape of the result.
    gemm_dims: ``(M, N, K)`` of the equivalent GEMM; for a convolution M is the
      number of output positions, N the output features and K the kernel's
      spatial size times its input features per group.
    flops: ``2 * M * N * K`` (times the batch for a batched dot) per execution,
      times ``count``.
    share: ``flops`` over the FLOPs of every op in the program, in ``[0, 1]``.
    module_path: the issuing module, e.g. ``"Decoder/Block_0/Mlp_0/Dense_0"``;
      ``""`` when the op carries no usable location.
    name: the raw JAX name stack of the op, for when ``module_path`` is not
      enough.
    is_backward: whether the op belongs to a transposed (backward) computation.
    count: how many times one run of the program executes the op: its static
      call sites times the trip counts of the loops around it (see
      :func:`audit`).
    misaligned: the ``gemm_dims`` that are not multiples of 8, as ``("N=10",)``.
    fp8: per operand, the float8 format it is multiplied in, else ``None``:
      its own dtype for a float8 operand (what :func:`mpx.fp8.fp8_dot_general`
      emits), or the format it was dequantised from just before the op
      (``convert`` from float8, times a scale: the quantise-dequantise form of
      Flax's ``Fp8DotGeneralOp``, which XLA:GPU may compile to a bfloat16
      GEMM, see :func:`mpx.audit`'s ``target``).
  """

  kind: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  result_dtype: np.dtype
  accumulation_dtype: np.dtype | None
  precision: tuple[str, ...]
  algorithm_precision: str | None
  upcast: tuple[str, ...]
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  result_shape: tuple[int, ...]
  gemm_dims: tuple[int, int, int]
  flops: int
  share: float
  module_path: str
  name: str
  is_backward: bool
  count: int
  misaligned: tuple[str, ...]
  fp8: tuple[np.dtype | None, ...] = (None, None)

  @property
  def is_fp8(self) -> bool:
    """Whether both operands are float8: float8 arrays themselves, or dequantised float8 tensors."""
    return all(f is not None for f in self.fp8)

  @property
  def is_half(self) -> bool:
    """Whether both operands are 16-bit (or narrower) floats."""
    return dtypes_lib.is_half(self.lhs_dtype) and dtypes_lib.is_half(self.rhs_dtype)

  @property
  def is_float32_or_wider(self) -> bool:
    """Whether either operand is a float of 32 bits or more."""
    return any(
      dtypes_lib.is_floating(d) and d.itemsize >= 4 for d in (self.lhs_dtype, self.rhs_dtype)
    )

  @property
  def float32_at_default_precision(self) -> bool:
    """Whether float32 operands are multiplied at ``DEFAULT`` or ``HIGH`` precision.

    On Ampere and later NVIDIA GPUs cuBLAS then runs TF32 Tensor Cores (a
    10-bit mantissa: not the float32 the program seems to ask for), and on
    TPUs bfloat16 passes; only ``precision=HIGHEST`` (or
    ``jax.default_matmul_precision("highest")``) or a float32 dot algorithm
    multiplies in float32.
    """
    float32 = np.dtype(np.float32)
    if float32 not in (self.lhs_dtype, self.rhs_dtype) or self.is_half:
      return False
    if self.algorithm_precision is not None:
      return self.algorithm_precision == "tf32"
    return all(p in ("DEFAULT", "HIGH") for p in self.precision)

  @property
  def operand_class(self) -> str:
    """The Tensor Core class the op runs on: ``"half"``, ``"tf32"``, ``"float32"``, ``"float64"``, ``"fp8"``.

    ``"tf32"`` is :attr:`float32_at_default_precision`; ``"other"`` for
    integer products.
    """
    dtypes = (self.lhs_dtype, self.rhs_dtype)
    if any(d.itemsize >= 8 and dtypes_lib.is_floating(d) for d in dtypes):
      return "float64"
    if self.is_fp8:
      return "fp8"
    if self.float32_at_default_precision:
      return "tf32"
    if self.is_float32_or_wider:
      return "float32"
    return "half" if self.is_half else "other"


@dataclasses.dataclass(frozen=True)
class ReductionOp:
  """A sum in half precision, or an exp in float16, of the audited program.

  The paper (section 3) keeps reductions out of half precision: a float16
  sum of many terms loses the small ones and overflows above 65504, an exp in
  float16 overflows for inputs above 11 (softmax, cross entropy). bfloat16
  sums are listed too (they lose precision, not range); exps only in float16.
  XLA may accumulate a half sum in float32 anyway (its excess-precision
  default), so this is what the program asks for, not a measurement.

  Attributes:
    kind: ``"sum"`` (a ``reduce`` or ``reduce_window`` with an add) or ``"exp"``.
    dtype: the element type.
    shape: the shape of the reduced (or exponentiated) operand.
    terms: how many elements each output sums (1 for an exp).
    module_path: the issuing module, as for :class:`MatmulOp`.
    name: the raw JAX name stack.
    is_backward: whether the op belongs to the backward pass.
    count: executions per run (call sites times enclosing loop trip counts).
  """

  kind: str
  dtype: np.dtype
  shape: tuple[int, ...]
  terms: int
  module_path: str
  name: str
  is_backward: bool
  count: int

  @property
  def is_float16(self) -> bool:
    """Whether the op runs in float16 (the reductions the paper warns about)."""
    return self.dtype == np.dtype("float16")


def operand(dtype: np.dtype, shape: tuple[int, ...]) -> str:
  """An operand as the audit tables print it: ``bfloat16[8,512]``."""
  return f"{dtype.name}[{','.join(map(str, shape))}]"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
  """The lines of a left-aligned text table: the header, a rule, then one line per row."""
  widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
  lines = [
    "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
    for r in [header, *rows]
  ]
  lines.insert(1, "-" * len(lines[0]))
  return lines
