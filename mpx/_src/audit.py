"""A matmul and convolution dtype audit of a lowered JAX program (paper section 3.3)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import policy as policy_lib
from mpx._src import stablehlo


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
    count: how many static call sites execute the op (see the module notes).
    misaligned: the ``gemm_dims`` that are not multiples of 8, as ``("N=10",)``.
  """

  kind: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  result_dtype: np.dtype
  accumulation_dtype: np.dtype | None
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


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """Every matmul and convolution of a program; ``str(report)`` is a table.

  Attributes:
    ops: the records, in program order.
    policy: the policy the program was meant to follow, if one was given.
    program_flops: the FLOPs of the whole program (``share`` is relative to it,
      also in a filtered report).
  """

  ops: tuple[MatmulOp, ...]
  policy: policy_lib.Policy | None = None
  program_flops: int = 0

  @property
  def total_flops(self) -> int:
    """The FLOPs of the ops in this report."""
    return sum(op.flops for op in self.ops)

  @property
  def half_flops_share(self) -> float:
    """The share of this report's FLOPs whose operands are both half precision.

    ``nan`` for a report without ops, so that asserting ``== 1.0`` on a program
    that has no matmul at all fails instead of passing vacuously.
    """
    total = self.total_flops
    if not total:
      return math.nan
    return sum(op.flops for op in self.ops if op.is_half) / total

  @property
  def float32_ops(self) -> tuple[MatmulOp, ...]:
    """The ops with a float32 (or wider) operand."""
    return tuple(op for op in self.ops if op.is_float32_or_wider)

  @property
  def misaligned_ops(self) -> tuple[MatmulOp, ...]:
    """The ops with a GEMM dimension that is not a multiple of 8."""
    return tuple(op for op in self.ops if op.misaligned)

  @property
  def backward_ops(self) -> tuple[MatmulOp, ...]:
    """The ops of the backward pass."""
    return tuple(op for op in self.ops if op.is_backward)

  def filter(self, pattern: str | None = None, *, backward: bool | None = None) -> AuditReport:
    """Returns the report restricted to some ops.

    Args:
      pattern: a regular expression searched (``re.search``) in each op's
        ``module_path``; ``None`` keeps every path.
      backward: ``True`` keeps backward ops only, ``False`` forward ops only.

    Returns:
      A new report with the same ``policy`` and ``program_flops``.
    """
    ops = tuple(
      op
      for op in self.ops
      if (pattern is None or re.search(pattern, op.module_path))
      and (backward is None or op.is_backward == backward)
    )
    return dataclasses.replace(self, ops=ops)

  def exclude(self, pattern: str) -> AuditReport:
    """Returns the report without the ops whose ``module_path`` matches ``pattern``.

    Args:
      pattern: a regular expression searched in each op's ``module_path``, e.g.
        the keep-listed layers whose products are meant to stay float32.

    Returns:
      A new report with the same ``policy`` and ``program_flops``.
    """
    return dataclasses.replace(
      self, ops=tuple(op for op in self.ops if not re.search(pattern, op.module_path))
    )

  def flags(self, op: MatmulOp) -> tuple[str, ...]:
    """Returns the warnings for one op: ``"f32"`` under a half policy, ``"align"``.

    Args:
      op: one of ``self.ops``.

    Returns:
      The flags, possibly empty.
    """
    flags = []
    if (
      self.policy is not None
      and dtypes_lib.is_half(self.policy.compute_dtype)
      and op.is_float32_or_wider
    ):
      flags.append("f32")
    if op.misaligned:
      flags.append("align:" + ",".join(op.misaligned))
    return tuple(flags)

  def __str__(self) -> str:
    header = ("#", "kind", "pass", "module", "lhs", "rhs", "result", "MFLOP", "share", "flags")
    rows = [
      (
        str(i),
        op.kind,
        "bwd" if op.is_backward else "fwd",
        op.module_path or "?",
        _fmt(op.lhs_dtype, op.lhs_shape),
        _fmt(op.rhs_dtype, op.rhs_shape),
        _fmt(op.result_dtype, op.result_shape),
        f"{op.flops / 1e6:.3f}",
        f"{100 * op.share:.1f}%",
        " ".join(self.flags(op)),
      )
      for i, op in enumerate(self.ops)
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [
      "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
      for r in [header, *rows]
    ]
    lines.insert(1, "-" * len(lines[0]))
    policy = f"policy {self.policy}; " if self.policy is not None else ""
    lines.append(
      f"{policy}{len(self.ops)} ops, {self.total_flops / 1e6:.3f} MFLOP, "
      f"{100 * self.half_flops_share:.1f}% of FLOPs with half-precision operands, "
      f"{len(self.float32_ops)} with float32 operands, {len(self.misaligned_ops)} misaligned"
    )
    return "\n".join(lines)


def _fmt(dtype: np.dtype, shape: tuple[int, ...]) -> str:
  return f"{dtype.name}[{','.join(map(str, shape))}]"


def audit(
  fn: Callable[..., Any] | jax.stages.Lowered, *args: Any, policy: Any = None, **kwargs: Any
) -> AuditReport:
  """Lists every matmul and convolution that ``fn(*args, **kwargs)`` runs, with dtypes.

  The function is lowered, not compiled or run: ``jax.jit(fn).lower(*args,
  **kwargs)`` (or ``fn.lower(...)`` when ``fn`` is already jitted, so its
  static arguments are honoured; a ``jax.stages.Lowered`` is audited as is).
  Arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s. Audit a whole train
  step, not just the forward pass: the backward products are where a
  ``preferred_element_type=float32`` quietly turns into float32 x float32
  GEMMs (paper section 3.3 wants half products accumulated in float32).

  ``policy`` is keyword-only and is not passed to ``fn``; to audit a function
  that itself takes a ``policy`` keyword, bind it with ``functools.partial``.

  The report answers the question the paper leaves to the user: did every
  product run with half-precision operands, or did a layer left at
  ``dtype=None`` promote its inputs back to float32 and run a float32 GEMM? It
  also flags GEMM dimensions that are not multiples of 8, which Tensor Cores
  need. No accelerator is needed: only the StableHLO text is read.

  Where the module path comes from: JAX records a name stack on every op
  (``jit(step)/transpose(jvp(Decoder))/Block_0/Dense_0/dot_general``). Flax
  linen pushes one name per module call, so the audit strips the
  transformation wrappers (``jvp(...)``, ``transpose(...)``; a ``transpose``
  marks a backward op), function names (``jit(...)``), einsum specs, JAX's own
  scopes (``while``, ``body``, ``checkpoint``...) and the primitive, leaving
  ``Decoder/Block_0/Dense_0``: the root module's class name, then the path of
  the params. NNX pushes no names; there the path is rebuilt from the Python
  call stack kept in the location (``NnxDecoder/NnxBlock/NnxMlp/Linear``:
  class names, a method other than ``__call__`` appended as ``.method``).

  What is counted: ops in called functions count once per static call site.
  Ops in ``while`` bodies (``lax.scan``, ``fori_loop``) count once, not once
  per iteration, since the trip count is not part of the program text, so the
  FLOP shares of scanned layers are understated by their trip count. Ops that
  ``jax.checkpoint`` recomputes in the backward pass appear as backward ops.

  Args:
    fn: the function to audit, plain or jitted.
    *args: positional arguments for ``fn``.
    policy: the precision policy ``fn`` is meant to follow (anything
      :func:`mpx.get_policy` accepts). Under a half compute dtype, ops with
      float32 operands are flagged ``f32`` in the table.
    **kwargs: keyword arguments for ``fn``.

  Returns:
    An :class:`AuditReport`.

  Example:
    >>> import jax.numpy as jnp
    >>> import mpx
    >>> def f(x, w):
    ...   return jnp.tanh(x @ w.astype(x.dtype))
    >>> x = jnp.ones((16, 32), jnp.bfloat16)
    >>> report = mpx.audit(f, x, jnp.ones((32, 10)), policy="mixed_bfloat16")
    >>> op = report.ops[0]
    >>> op.lhs_dtype.name, op.gemm_dims, op.flops, op.misaligned
    ('bfloat16', (16, 10, 32), 10240, ('N=10',))
    >>> report.half_flops_share
    1.0
  """
  lowered: Any
  if isinstance(fn, jax.stages.Lowered):
    lowered = fn
  else:
    lower = getattr(fn, "lower", None)  # Already jitted: keep its static arguments.
    lowered = (lower if callable(lower) else jax.jit(fn).lower)(*args, **kwargs)
  ops = [MatmulOp(share=0.0, **f) for f in stablehlo.matmul_ops(lowered.compiler_ir("stablehlo"))]
  total = sum(op.flops for op in ops)
  ops = [dataclasses.replace(op, share=op.flops / total if total else 0.0) for op in ops]
  return AuditReport(
    ops=tuple(ops),
    policy=None if policy is None else policy_lib.get_policy(policy),
    program_flops=total,
  )
