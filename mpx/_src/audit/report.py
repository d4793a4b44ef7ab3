"""A dtype audit of a lowered JAX program's matmuls, convolutions and reductions (paper section 3.3)."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import policy as policy_lib
from mpx._src.audit import device_peaks, stablehlo, target_report


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
    fp8: per operand, the float8 format it was dequantised from just before
      the op (``convert`` from float8, times a scale: the form XLA:GPU
      rewrites into a float8 GEMM, see :func:`mpx.fp8_dot_general`), else
      ``None``.
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
    """Whether both operands are float8: dequantised float8 tensors, or float8 arrays themselves."""
    return all(
      f is not None or (dtypes_lib.is_floating(d) and d.itemsize == 1)
      for f, d in zip(self.fp8, (self.lhs_dtype, self.rhs_dtype), strict=True)
    )

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


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """Every matmul and convolution of a program; ``str(report)`` is a table.

  Attributes:
    ops: the records, in program order.
    policy: the policy the program was meant to follow, if one was given.
    program_flops: the FLOPs of the whole program (``share`` is relative to it,
      also in a filtered report).
    reductions: the half-precision sums and float16 exps, in program order.
    default_matmul_precision: ``jax.default_matmul_precision`` when the audit
      ran (``None``: JAX's default); the ops' own ``precision`` fields say
      what was in effect when the program was lowered.
  """

  ops: tuple[MatmulOp, ...]
  policy: policy_lib.Policy | None = None
  program_flops: int = 0
  reductions: tuple[ReductionOp, ...] = ()
  default_matmul_precision: str | None = None

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
  def fp8_flops_share(self) -> float:
    """The share of this report's FLOPs whose operands are both float8 (:attr:`MatmulOp.is_fp8`).

    ``nan`` for a report without ops.
    """
    total = self.total_flops
    if not total:
      return math.nan
    return sum(op.flops for op in self.ops if op.is_fp8) / total

  @property
  def fp8_ops(self) -> tuple[MatmulOp, ...]:
    """The ops whose operands are both float8."""
    return tuple(op for op in self.ops if op.is_fp8)

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

  @property
  def tf32_ops(self) -> tuple[MatmulOp, ...]:
    """The ops with float32 operands at default precision (TF32 on GPUs)."""
    return tuple(op for op in self.ops if op.float32_at_default_precision)

  @property
  def upcast_ops(self) -> tuple[MatmulOp, ...]:
    """The ops with a half-precision operand converted to a wider float just before them."""
    return tuple(op for op in self.ops if op.upcast)

  @property
  def float16_reductions(self) -> tuple[ReductionOp, ...]:
    """The sums and exps done in float16."""
    return tuple(r for r in self.reductions if r.is_float16)

  def estimate_matmul_seconds(self, device: str = "H100 SXM") -> dict[str, float]:
    """Estimates the time of this report's matmuls per operand class, from FLOPs and peaks.

    An estimate, not a measurement: FLOPs divided by the device's dense peak
    for each :attr:`MatmulOp.operand_class` (``mpx._src.audit.device_peaks``), a
    lower bound that real kernels do not reach; it shows how much of the
    step's matmul time a class (TF32 or true float32 in a "half-precision"
    model) costs.

    Args:
      device: a device of the peak table (``"H100 SXM"``, ``"H100 PCIe"``,
        ``"H200"``, ``"A100"``, ``"L40S"``, ``"L4"``) or a
        ``jax.Device.device_kind`` naming one.

    Returns:
      ``{operand class: seconds}`` for the classes present, with ``"total"``.

    Raises:
      ConfigError: the device is not in the table, or has no peak for a
        class present (e.g. float64 on an L4).
    """
    peaks = device_peaks.peak_tflops(device)
    flops: dict[str, int] = {}
    for op in self.ops:
      flops[op.operand_class] = flops.get(op.operand_class, 0) + op.flops
    missing = sorted(set(flops) - set(peaks))
    if missing:
      raise errors.ConfigError(
        f"The peak table has no {missing} throughput for {device!r}; estimate on another "
        f"device ({', '.join(device_peaks.PEAK_TFLOPS)})."
      )
    seconds = {cls: n / (peaks[cls] * 1e12) for cls, n in flops.items()}
    return {**seconds, "total": sum(seconds.values())}

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
    """Returns the warnings for one op.

    * ``"f32"``: float32 operands under a policy with a half compute dtype;
    * ``"tf32"``: float32 operands at default precision
      (:attr:`MatmulOp.float32_at_default_precision`);
    * ``"upcast:lhs"`` (``rhs``, ``lhs,rhs``): half operands converted to
      float32 for the op (:attr:`MatmulOp.upcast`);
    * ``"align:N=10"``: GEMM dimensions that are not multiples of 8;
    * ``"fp8:e4m3fn,e5m2"``: operands dequantised from float8 (the formats,
      lhs then rhs; see :attr:`MatmulOp.fp8`).

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
    if op.float32_at_default_precision:
      flags.append("tf32")
    if op.upcast:
      flags.append("upcast:" + ",".join(op.upcast))
    if op.misaligned:
      flags.append("align:" + ",".join(op.misaligned))
    if any(f is not None for f in op.fp8):
      names = (f.name.removeprefix("float8_") if f is not None else "-" for f in op.fp8)
      flags.append("fp8:" + ",".join(names))
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
    lines.append(self.summary())
    return "\n".join(lines)

  def summary(self, device: str | None = "H100 SXM") -> str:
    """Returns the report's totals (the last lines of ``str(report)``).

    Args:
      device: the device of the matmul time estimate (see
        :meth:`estimate_matmul_seconds`); ``None`` leaves it out.

    Returns:
      Two lines: the matmul totals and flags, then the half-precision
      reductions and the time estimate.
    """
    policy = f"policy {self.policy}; " if self.policy is not None else ""
    sums = [r for r in self.float16_reductions if r.kind == "sum"]
    lines = [
      f"{policy}{len(self.ops)} ops, {self.total_flops / 1e6:.3f} MFLOP, "
      f"{100 * self.half_flops_share:.1f}% of FLOPs with half-precision operands"
      + (f" ({100 * self.fp8_flops_share:.1f}% float8)" if self.fp8_ops else "")
      + ", "
      f"{len(self.float32_ops)} with float32 operands ({len(self.tf32_ops)} at default "
      f"precision: TF32 on GPUs), {len(self.upcast_ops)} with upcast half operands, "
      f"{len(self.misaligned_ops)} misaligned",
      f"reductions: {len(sums)} float16 sums, "
      f"{len(self.float16_reductions) - len(sums)} float16 exps, "
      f"{sum(r.kind == 'sum' for r in self.reductions) - len(sums)} bfloat16 sums",
    ]
    if device is not None and self.ops:
      try:
        seconds = self.estimate_matmul_seconds(device)
      except errors.ConfigError:
        pass
      else:
        parts = ", ".join(f"{cls} {1e3 * t:.3g} ms" for cls, t in seconds.items())
        lines[-1] += f"; estimated matmul time on {device} (FLOPs / peak, an estimate): {parts}"
    return "\n".join(lines)


def _fmt(dtype: np.dtype, shape: tuple[int, ...]) -> str:
  return f"{dtype.name}[{','.join(map(str, shape))}]"


@typing.overload
def audit(
  fn: Callable[..., Any] | jax.stages.Lowered,
  *args: Any,
  policy: Any = None,
  target: None = None,
  **kwargs: Any,
) -> AuditReport: ...


@typing.overload
def audit(
  fn: Callable[..., Any] | jax.stages.Lowered,
  *args: Any,
  policy: Any = None,
  target: str,
  in_specs: Any = None,
  mesh_axes: tuple[str, ...] = ("data",),
  **kwargs: Any,
) -> target_report.TargetReport: ...


def audit(
  fn: Callable[..., Any] | jax.stages.Lowered,
  *args: Any,
  policy: Any = None,
  target: str | None = None,
  in_specs: Any = None,
  mesh_axes: tuple[str, ...] = ("data",),
  **kwargs: Any,
) -> AuditReport | target_report.TargetReport:
  """Lists every matmul and convolution that ``fn(*args, **kwargs)`` runs, with dtypes and flags.

  The function is lowered, not compiled or run: ``jax.jit(fn).lower(*args,
  **kwargs)`` (or ``fn.lower(...)`` when ``fn`` is already jitted, so its
  static arguments are honoured; a ``jax.stages.Lowered`` is audited as is).
  Arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s. Audit a whole train
  step, not just the forward pass: the backward products are where a
  ``preferred_element_type=float32`` quietly turns into float32 x float32
  GEMMs (paper section 3.3 wants half products accumulated in float32).

  ``policy``, ``target``, ``in_specs`` and ``mesh_axes`` are keyword-only and
  are not passed to ``fn``; to audit a function that itself takes one of
  them, bind it with ``functools.partial``.

  With ``target="h100"`` (``"h200"``, ``"a100"``, ``"b200"``, ``"l4"``;
  ``"h100x8"`` for 8 GPUs, ``"2xh100x8"`` for 2 hosts of 8) the step is
  compiled, not run, for that GPU on this machine, which needs no GPU but jax's
  CUDA plugin (``pip install "mpx-mixed-precision[gpu-target]"``) and
  ``JAX_PLATFORMS=cpu`` on a machine without an NVIDIA driver; the result is
  a ``TargetReport`` of the optimised GPU program: each GEMM and convolution
  kernel with its backend and the dtypes it multiplies, ``half_flops_share``
  and ``fp8_flops_share`` of that program, ``memory`` (XLA's buffer
  assignment), kernel launches, bytes moved and collectives. Products the
  program asked for in float8 (or half precision) whose kernels multiply a
  wider dtype are listed in ``lost`` and warned about
  (:class:`mpx.PrecisionWarning`). No autotuning runs: kernel choices are
  XLA's defaults (see ``docs/guide/gpu_target.md``).

  The report answers the question the paper leaves to the user: did every
  product run with half-precision operands, or did a layer left at
  ``dtype=None`` promote its inputs back to float32 and run a float32 GEMM? It
  also flags what makes a baseline slower or less precise than it looks (see
  :meth:`AuditReport.flags`): float32 operands at default precision, which
  GPUs multiply as TF32 (``jax.default_matmul_precision("highest")`` or
  ``precision=HIGHEST`` asks for true float32); half operands converted to
  float32 just before a product (a float32 cotangent meeting a half
  activation in the backward pass); GEMM dimensions that are not multiples
  of 8, which Tensor Cores need; and, in :attr:`AuditReport.reductions`,
  sums done in float16 or bfloat16 and exps done in float16 (softmax, cross
  entropy). :meth:`AuditReport.estimate_matmul_seconds` turns the FLOPs per
  operand class into a time on a device from its peak throughput, an
  estimate. No accelerator is needed: only the StableHLO text is read.

  Where the module path comes from: JAX records a name stack on every op
  (``jit(step)/transpose(jvp(Decoder))/Block_0/Dense_0/dot_general``). Flax
  linen pushes one name per module call, so the audit strips the
  transformation wrappers (``jvp(...)``, ``transpose(...)``; a ``transpose``
  marks a backward op), function names (``jit(...)``), einsum specs, JAX's own
  scopes (``while``, ``body``, ``checkpoint``...) and the primitive, leaving
  ``Decoder/Block_0/Dense_0``: the root module's class name, then the path of
  the params. The body of a ``jax.checkpoint`` (``nn.remat``) replays the
  name stack it was traced under when it is recomputed in the backward pass
  (``transpose(jvp(Model))/jvp(Model)/checkpoint/...``); the repeated scope is
  dropped, so the path names each module once. NNX pushes no names; there the path is rebuilt from the Python
  call stack kept in the location (``NnxDecoder/NnxBlock/NnxMlp/Linear``:
  class names, a method other than ``__call__`` appended as ``.method``).

  What is counted: ops in called functions count once per static call site.
  Ops in ``while`` bodies count once per iteration when the loop has a
  constant trip count, as ``lax.scan`` and ``fori_loop`` with static bounds
  (so ``nn.scan`` and ``nnx.scan``) lower to: a scanned layer stack reports
  the FLOP shares of the same layers unrolled. A loop whose length is known
  only at run time counts its body once. Ops that
  ``jax.checkpoint`` recomputes in the backward pass appear as backward ops.

  Args:
    fn: the function to audit, plain or jitted.
    *args: positional arguments for ``fn``.
    policy: the precision policy ``fn`` is meant to follow (anything
      :func:`mpx.get_policy` accepts). Under a half compute dtype, ops with
      float32 operands are flagged ``f32`` in the table.
    target: a GPU to compile for (see above); ``None`` (the default) audits
      the StableHLO program, on any backend.
    in_specs: with a multi-GPU ``target``, ``jax.sharding.PartitionSpec``\\ s
      for ``args`` (a tree prefix of them, over the mesh axes
      ``mesh_axes``); ``None`` replicates every argument.
    mesh_axes: with a ``target``, the target mesh's axis names: one (all
      GPUs) or two (hosts, GPUs per host).
    **kwargs: keyword arguments for ``fn``.

  Returns:
    An :class:`AuditReport`; with a ``target``, a ``TargetReport``.

  Raises:
    ConfigError: an unknown target, jax's CUDA plugin missing, or jax unable
      to build a CUDA topology (set ``JAX_PLATFORMS=cpu``).

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
  if target is not None:
    return target_report.audit_target(
      fn,
      args,
      kwargs,
      target=target,
      in_specs=in_specs,
      mesh_axes=mesh_axes,
      intended_audit=lambda lowered: audit(lowered, policy=policy),
    )
  lowered: Any
  if isinstance(fn, jax.stages.Lowered):
    lowered = fn
  else:
    lower = getattr(fn, "lower", None)  # Already jitted: keep its static arguments.
    lowered = (lower if callable(lower) else jax.jit(fn).lower)(*args, **kwargs)
  module = lowered.compiler_ir("stablehlo")
  ops = [MatmulOp(share=0.0, **f) for f in stablehlo.matmul_ops(module)]
  total = sum(op.flops for op in ops)
  ops = [dataclasses.replace(op, share=op.flops / total if total else 0.0) for op in ops]
  return AuditReport(
    ops=tuple(ops),
    policy=None if policy is None else policy_lib.get_policy(policy),
    program_flops=total,
    reductions=tuple(ReductionOp(**f) for f in stablehlo.half_reductions(module)),
    default_matmul_precision=getattr(jax.config, "jax_default_matmul_precision", None),
  )
