"""The audit of a step compiled for a GPU it does not run on: kernels, dtypes, memory, collectives.

Compiled, not run: jax's CUDA plugin builds the XLA:GPU program on any
machine (see :mod:`mpx._src.audit.targets`). No autotuning runs without the
GPU, so the kernels are XLA's defaults for the target; on a real GPU the
autotuner may pick other tilings, or cuBLAS instead of Triton, for a GEMM.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src.audit import buffers, fused_attention, layer_paths, rewrites, targets
from mpx._src.audit import compiled as hlo
from mpx._src.audit import ops as audit_ops

_NOTE = "compiled for the target without autotuning: kernel choices are XLA's defaults"


@dataclasses.dataclass(frozen=True)
class TargetGemm:
  """One matrix product or convolution kernel of the program compiled for a GPU.

  Attributes:
    kernel: the name of the kernel's instruction in the compiled HLO.
    backend: ``"triton"`` (a Triton GEMM fusion), ``"cublas"``,
      ``"cublaslt"``, ``"cudnn"`` or ``"xla"`` (XLA's own emitter).
    kind: ``"dot"``, ``"convolution"``, ``"scaled-dot"`` (a block-scaled
      product, ``jax.lax.scaled_dot``: float8 with an MX scale per block of
      32 on Blackwell; before it, Triton multiplies the dequantised blocks in
      bfloat16, and the dtypes say so) or ``"attention"`` (cuDNN's fused
      attention, one pass: the products inside it, with the query and key as
      ``lhs`` and ``rhs``).
    lhs_dtype: the left operand's dtype as the kernel multiplies it, after the
      conversions XLA fused into the kernel.
    rhs_dtype: the right operand's dtype, likewise.
    result_dtype: the product's dtype.
    lhs_shape: the left operand's shape inside the kernel.
    rhs_shape: the right operand's shape inside the kernel.
    result_shape: the product's shape.
    flops: FLOPs per run of the program (``count`` executions).
    count: executions per run (loop trip counts included).
    module_path: the issuing layer, read from the product's ``op_name``.
    op_name: the JAX name stack of the product.
    is_backward: whether the product belongs to the backward pass.
    split_k: how many slices XLA cut the contraction into (split-K: 3-D
      operands, a float32 result summed by a later kernel); 1 if not split.
    merged: the layers whose products XLA merged into this one GEMM (the
      query, key and value projections of an attention layer, say), each
      with its share of the result; empty for a GEMM of one layer.
  """

  kernel: str
  backend: str
  kind: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  result_dtype: np.dtype
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  result_shape: tuple[int, ...]
  flops: int
  count: int
  module_path: str
  op_name: str
  is_backward: bool
  split_k: int = 1
  merged: tuple[tuple[str, float], ...] = ()

  @property
  def label(self) -> str:
    """The layer path, or the merged layers' (``.../{query,key,value}``)."""
    if self.merged:
      return rewrites.merged_label(tuple(path for path, _ in self.merged))
    return self.module_path

  @property
  def notes(self) -> str:
    """What XLA did to the product: ``split-K 4``, ``3 merged``."""
    notes = [f"split-K {self.split_k}"] if self.split_k > 1 else []
    return ", ".join(notes + ([f"{len(self.merged)} merged"] if self.merged else []))

  @property
  def is_fp8(self) -> bool:
    """Whether both operands are float8 as multiplied."""
    return all(dtypes_lib.is_float8(d) for d in self.dtypes)

  @property
  def is_half(self) -> bool:
    """Whether both operands are 16-bit (or narrower) floats as multiplied."""
    return all(dtypes_lib.is_half(d) for d in self.dtypes)

  @property
  def dtypes(self) -> tuple[np.dtype, np.dtype]:
    """``(lhs_dtype, rhs_dtype)``."""
    return (self.lhs_dtype, self.rhs_dtype)


@dataclasses.dataclass(frozen=True)
class Memory:
  """XLA's buffer assignment for the target (``compiled.memory_analysis()``), in bytes.

  Attributes:
    argument_bytes: the arguments.
    output_bytes: the outputs.
    alias_bytes: the outputs that reuse a donated argument's buffer.
    temp_bytes: the temporaries (activations kept for the backward pass,
      workspaces): the part of the peak a precision policy changes most.
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int

  @property
  def peak_bytes(self) -> int:
    """Arguments, outputs not aliased to an argument, and temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class Collective:
  """A collective of the program compiled for several GPUs.

  Attributes:
    kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
      ``"all-to-all"``, ``"collective-permute"``.
    dtype: the dtype it communicates (a collective that XLA combined from
      operands of several dtypes is listed once per dtype).
    bytes: its operands' bytes of that dtype per device, per run (``count``
      executions).
    count: executions per run.
    op_name: the JAX name stack it came from.
  """

  kind: str
  dtype: np.dtype
  bytes: int
  count: int
  op_name: str


@dataclasses.dataclass(frozen=True)
class TargetAttention:
  """Which attention one layer's pass runs in the program compiled for a GPU.

  Attributes:
    module_path: the attention layer, from the name stack.
    is_backward: whether it is the backward pass.
    implementation: ``"cudnn"`` (cuDNN's fused flash attention) or ``"xla"``
      (:func:`mpx.dot_product_attention`'s exact unfused path: the scores are
      written to memory).
    reason: why it is unfused (``None`` when fused): a key of
      ``mpx._src.ops.attention.REASONS``, e.g. ``"mask"`` or ``"no_cudnn"``.
    count: executions per run.
  """

  module_path: str
  is_backward: bool
  implementation: str
  reason: str | None
  count: int


@dataclasses.dataclass(frozen=True)
class TargetReport:
  """The audit of a program compiled for a GPU; ``str(report)`` is a table.

  Attributes:
    target: the target, e.g. ``"h100"`` or ``"2xh100x8"``.
    device_kind: the device the program was compiled for.
    gemms: every matrix product and convolution kernel, in program order.
    memory: XLA's buffer assignment, per GPU.
    kernels: every kernel launch (dicts with ``name``, ``kind``,
      ``op_name``, ``count``, ``bytes``; see ``compiled.kernels``).
    collectives: the collectives (none on one GPU).
    intended: the StableHLO audit of the same lowering (what the program asks
      for before XLA's GPU passes), an :class:`mpx.diagnostics.AuditReport`.
    lost: one line per layer whose products were meant to run in float8 (or
      half precision) and whose compiled kernels multiply something wider.
    attention: which attention each attention layer's pass runs (cuDNN's
      fused kernel, or mpx's unfused path and why); attention written without
      mpx and run unfused is not listed.
    temporaries: the largest buffers the kernels write that are not outputs
      (dicts with ``name``, ``kind``, ``type``, ``bytes``, ``layer``,
      ``is_backward``; see ``mpx._src.audit.buffers``): what
      ``memory.temp_bytes`` is made of.
  """

  target: str
  device_kind: str
  gemms: tuple[TargetGemm, ...]
  memory: Memory
  kernels: tuple[dict[str, Any], ...]
  collectives: tuple[Collective, ...]
  intended: Any
  lost: tuple[str, ...]
  attention: tuple[TargetAttention, ...] = ()
  temporaries: tuple[dict[str, Any], ...] = ()

  @property
  def total_flops(self) -> int:
    """The FLOPs of the products."""
    return sum(g.flops for g in self.gemms)

  def _share(self, keep: Callable[[TargetGemm], bool]) -> float:
    total = self.total_flops
    return sum(g.flops for g in self.gemms if keep(g)) / total if total else math.nan

  @property
  def half_flops_share(self) -> float:
    """The share of FLOPs multiplied with both operands 16-bit or narrower; ``nan`` without products."""
    return self._share(lambda g: g.is_half)

  @property
  def fp8_flops_share(self) -> float:
    """The share of FLOPs multiplied with both operands float8; ``nan`` without products."""
    return self._share(lambda g: g.is_fp8)

  @property
  def kernel_count(self) -> int:
    """Kernel launches per run (loop bodies counted once per iteration)."""
    return sum(k["count"] for k in self.kernels)

  @property
  def bytes_moved(self) -> int:
    """The operand and result bytes of every kernel launch per run (an upper bound on traffic)."""
    return sum(k["bytes"] * k["count"] for k in self.kernels)

  def backends(self) -> dict[tuple[str, str, str], int]:
    """FLOPs per ``(backend, lhs dtype, rhs dtype)``."""
    out: dict[tuple[str, str, str], int] = {}
    for g in self.gemms:
      key = (g.backend, g.lhs_dtype.name, g.rhs_dtype.name)
      out[key] = out.get(key, 0) + g.flops
    return out

  def __str__(self) -> str:
    header = ("#", "backend", "pass", "module", "lhs", "rhs", "result", "MFLOP", "notes")
    rows = [
      (
        str(i),
        g.backend,
        "bwd" if g.is_backward else "fwd",
        g.label or "?",
        audit_ops.operand(g.lhs_dtype, g.lhs_shape),
        audit_ops.operand(g.rhs_dtype, g.rhs_shape),
        audit_ops.operand(g.result_dtype, g.result_shape),
        f"{g.flops / 1e6:.3f}",
        g.notes,
      )
      for i, g in enumerate(self.gemms)
    ]
    return "\n".join([*audit_ops.table(header, rows), self.summary()])

  def summary(self) -> str:
    """Returns the report's totals (the last lines of ``str(report)``)."""
    m = self.memory
    coll = {}
    for c in self.collectives:
      coll[(c.kind, c.dtype.name)] = coll.get((c.kind, c.dtype.name), 0) + c.bytes * c.count
    lines = [
      f"{self.target} ({self.device_kind}), {_NOTE}",
      f"{len(self.gemms)} products, {self.total_flops / 1e6:.3f} MFLOP, "
      f"{100 * self.half_flops_share:.1f}% of FLOPs with half-precision operands "
      f"({100 * self.fp8_flops_share:.1f}% float8)",
      f"{self.kernel_count} kernel launches, {self.bytes_moved / 2**20:.1f} MiB read and written",
      f"memory per GPU: arguments {m.argument_bytes / 2**20:.1f} MiB, outputs "
      f"{m.output_bytes / 2**20:.1f} MiB (aliased {m.alias_bytes / 2**20:.1f} MiB), "
      f"temporaries {m.temp_bytes / 2**20:.1f} MiB",
    ]
    if self.temporaries:
      lines.append(
        "largest temporaries: " + "; ".join(buffers.describe(b) for b in self.temporaries)
      )
    if coll:
      lines.append(
        "collectives: "
        + ", ".join(f"{k} {d} {b / 2**20:.2f} MiB" for (k, d), b in sorted(coll.items()))
      )
    lines += fused_attention.summary_lines(self.attention)
    lines += [f"lost: {line}" for line in self.lost]
    return "\n".join(lines)


def _intent_lost(intended: Any, gemms: list[TargetGemm], target: str) -> tuple[str, ...]:
  """Layers whose products were meant to be float8 (or half) and compiled to something wider.

  Products are matched by layer path and pass: XLA may split (split-K) or
  rewrite a product, so the counts, not the individual ops, are compared,
  and a layer is flagged only when one of its compiled kernels multiplies a
  wider dtype than all its float8 (or half) products asked for.
  """
  groups: dict[tuple[str, bool], list[Any]] = {}
  for op in intended.ops:
    groups.setdefault((op.module_path, op.is_backward), []).append(op)
  lost = []
  for (path, backward), ops in groups.items():
    mine = [g for g in gemms if (g.module_path, g.is_backward) == (path, backward)]
    fp8, half = sum(op.is_fp8 for op in ops), sum(op.is_fp8 or op.is_half for op in ops)
    where = f"{path or '?'} ({'backward' if backward else 'forward'})"
    wider_than_fp8 = sorted(
      {f"{a.name} x {b.name}" for g in mine if not g.is_fp8 for a, b in [g.dtypes]}
    )
    wider_than_half = sorted(
      {f"{a.name} x {b.name}" for g in mine if not g.is_half for a, b in [g.dtypes]}
    )
    if fp8 and sum(g.is_fp8 for g in mine) < fp8 and wider_than_fp8:
      lost.append(
        f"{where}: {fp8} products with float8 operands in the program, "
        f"{sum(g.is_fp8 for g in mine)} float8 kernels on {target}; its kernels multiply "
        f"{', '.join(wider_than_fp8)}"
      )
    elif half and sum(g.is_half for g in mine) < half and wider_than_half:
      lost.append(
        f"{where}: {half} products with half-precision operands in the program, "
        f"{sum(g.is_half for g in mine)} half-precision kernels on {target}; its kernels "
        f"multiply {', '.join(wider_than_half)}"
      )
  # XLA may rewrite a product into kernels that keep no layer path (the decomposed
  # block-scaled dot does): the totals still say whether float8 was lost.
  unplaced = [g for g in gemms if (g.module_path, g.is_backward) not in groups]
  wider = sorted({f"{a.name} x {b.name}" for g in unplaced if not g.is_fp8 for a, b in [g.dtypes]})
  fp8_products = sum(op.is_fp8 for op in intended.ops)
  fp8_kernels = sum(g.is_fp8 for g in gemms)
  if not lost and fp8_kernels < fp8_products and wider:
    lost.append(
      f"kernels with no layer path: {fp8_products} products with float8 operands in the "
      f"program, {fp8_kernels} float8 kernels on {target}; {len(unplaced)} kernels with no "
      f"layer path multiply {', '.join(wider)}"
    )
  return tuple(lost)


def _placed(tree: Any, mesh: Mesh, specs: Any) -> Any:
  """``tree``'s arrays as ``ShapeDtypeStruct``\\ s on ``mesh``, replicated unless ``specs`` says."""

  def place(spec: Any, sub: Any) -> Any:
    sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())

    def leaf(x: Any) -> Any:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
      return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
      )

    return jax.tree.map(leaf, sub)

  if specs is None:
    return place(None, tree)
  return jax.tree.map(
    place, specs, tree, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
  )


def audit_target(
  fn: Callable[..., Any] | jax.stages.Lowered,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  target: str,
  in_specs: Any = None,
  mesh_axes: tuple[str, ...] = ("data",),
  intended_audit: Callable[[Any], Any],
) -> TargetReport:
  """Compiles ``fn(*args, **kwargs)`` for a GPU target and audits the compiled program.

  Args:
    fn: the function, plain or jitted.
    args: its positional arguments (arrays or ``ShapeDtypeStruct``\\ s).
    kwargs: its keyword arguments.
    target: a target name (see ``targets.parse``).
    in_specs: ``PartitionSpec``\\ s for ``args`` (a tree prefix of them);
      ``None`` replicates every argument.
    mesh_axes: the mesh's axis names: one name (all GPUs on one axis) or
      two (hosts, GPUs per host).
    intended_audit: the StableHLO audit of a ``Lowered``.

  Returns:
    A :class:`TargetReport`.
  """
  target_ = targets.parse(target)
  if isinstance(fn, jax.stages.Lowered):
    raise errors.ConfigError(
      "mpx.audit(..., target=...) compiles for the target itself; pass the function (plain "
      "or jitted) and its arguments, not an already lowered program."
    )
  devices = np.array(targets.devices(target_))
  if len(mesh_axes) == 2:
    devices = devices.reshape(target_.hosts, target_.gpus_per_host)
  elif len(mesh_axes) != 1:
    raise errors.ConfigError(
      f"mesh_axes={mesh_axes!r}: give one axis name (all GPUs) or two (hosts, GPUs per host)."
    )
  mesh = Mesh(devices, tuple(mesh_axes))
  args = _placed(args, mesh, in_specs)
  kwargs = _placed(kwargs, mesh, None)
  lower = getattr(fn, "lower", None)  # Already jitted: keep its static and donated arguments.
  with layer_paths.scopes((args, kwargs)):
    lowered: Any = (lower if callable(lower) else jax.jit(fn).lower)(*args, **kwargs)
  compiled = lowered.compile()
  text = compiled.as_text()
  records = hlo.gemms(text, native_block_scaling=target_.block_scaled_mma)
  found = rewrites.gemm_rewrites(text, records)
  gemms = [TargetGemm(**g, **found.get(g["kernel"], {})) for g in records]
  stats = compiled.memory_analysis()
  intended = intended_audit(lowered)
  lost = _intent_lost(intended, gemms, str(target_))
  if lost:
    warnings.warn(
      f"Compiled for {target_}, products lost the precision the program asked for: "
      + "; ".join(lost)
      + ". (A float8 quantise-dequantise before a wider dot_general, as in Flax's "
      "Fp8DotGeneralOp, compiles to bfloat16 GEMMs there; pass float8 operands to "
      "dot_general, as mpx.fp8.fp8_dot_general does; see docs/guide/gpu_target.md.)",
      errors.PrecisionWarning,
      stacklevel=3,
    )
  return TargetReport(
    target=str(target_),
    device_kind=str(devices.flat[0].device_kind),
    gemms=tuple(gemms),
    memory=Memory(
      argument_bytes=int(stats.argument_size_in_bytes),
      output_bytes=int(stats.output_size_in_bytes),
      alias_bytes=int(stats.alias_size_in_bytes),
      temp_bytes=int(stats.temp_size_in_bytes),
    ),
    kernels=tuple(hlo.kernels(text)),
    temporaries=buffers.largest_temporaries(text),
    collectives=tuple(Collective(**c) for c in hlo.collectives(text)),
    intended=intended,
    lost=lost,
    attention=tuple(TargetAttention(**a) for a in fused_attention.calls(hlo.launches(text))),
  )
