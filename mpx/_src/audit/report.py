"""A dtype audit of a lowered JAX program's matmuls, convolutions and reductions (paper section 3.3)."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable
from typing import Any

import jax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import policy as policy_lib
from mpx._src.audit import device_peaks, layer_paths, stablehlo, target_report
from mpx._src.audit import ops as audit_ops
from mpx._src.audit.ops import MatmulOp, ReductionOp


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
        audit_ops.operand(op.lhs_dtype, op.lhs_shape),
        audit_ops.operand(op.rhs_dtype, op.rhs_shape),
        audit_ops.operand(op.result_dtype, op.result_shape),
        f"{op.flops / 1e6:.3f}",
        f"{100 * op.share:.1f}%",
        " ".join(self.flags(op)),
      )
      for i, op in enumerate(self.ops)
    ]
    return "\n".join([*audit_ops.table(header, rows), self.summary()])

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
  CUDA plugin (``python -m mpx.gpu_target`` installs it where plain jax programs
  do not load it, and mpx loads it for the compile); the result is
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
  dropped, so the path names each module once. NNX pushes no names: for the
  NNX models (and ``nnx.Optimizer`` objects) among ``fn``'s arguments the audit
  pushes each module's attribute path while it traces (``blocks/0/attn/query``,
  ``wte.attend`` for a method other than ``__call__``; see
  ``mpx._src.audit.nnx_scopes``: the modules are restored afterwards); for an
  NNX model ``fn`` reaches otherwise (a closure, a graph definition merged
  inside it), the path is rebuilt from the Python call stack kept in the
  location (``NnxDecoder/NnxBlock/NnxMlp/Linear``: class names).

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
    ConfigError: an unknown target, or jax's CUDA plugin missing (the message
      gives the command that installs it).

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
    with layer_paths.scopes((args, kwargs)):
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
