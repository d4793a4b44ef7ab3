"""Reading kernels, GEMMs and collectives out of a compiled (optimised) XLA:GPU HLO module.

Reads the text of ``jax.stages.Compiled.as_text()``: after XLA's GPU passes,
each instruction of the entry computation (and of the loop bodies it runs)
is one kernel launch, or a copy, or a collective, and the products are inside
the fused computations those kernels call, with the dtypes they multiply in.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpx._src.audit import fused_attention, layer_paths

_HLO_DTYPES = {
  "pred": "bool",
  "s4": "int4",
  "s8": "int8",
  "s16": "int16",
  "s32": "int32",
  "s64": "int64",
  "u4": "uint4",
  "u8": "uint8",
  "u16": "uint16",
  "u32": "uint32",
  "u64": "uint64",
  "f16": "float16",
  "bf16": "bfloat16",
  "f32": "float32",
  "f64": "float64",
  "c64": "complex64",
  "c128": "complex128",
}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = ")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# Instructions that launch no kernel of their own.
_NO_KERNEL = frozenset(
  {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "add-dependency",
  }
)
COLLECTIVES = frozenset(
  {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
  }
)


def hlo_dtype(name: str) -> np.dtype:
  """The numpy dtype of an HLO element type (``bf16``, ``f8e4m3fn``...)."""
  if name.startswith("f8"):  # 'f8e4m3fn' is ml_dtypes' 'float8_e4m3fn'
    return np.dtype(jnp.dtype("float8_" + name[2:]))
  return np.dtype(jnp.dtype(_HLO_DTYPES[name]))


def arrays(type_str: str) -> list[tuple[np.dtype, tuple[int, ...]]]:
  """The ``(dtype, shape)`` of every array in an HLO type (an array or a tuple of them)."""
  out = []
  for element, dims in _ARRAY.findall(type_str):
    if element in _HLO_DTYPES or element.startswith("f8"):
      out.append((hlo_dtype(element), tuple(int(d) for d in dims.split(",") if d)))
  return out


def nbytes(type_str: str) -> int:
  """The bytes of the arrays of an HLO type."""
  return sum(math.ceil(math.prod(shape) * dtype.itemsize) for dtype, shape in arrays(type_str))


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _instruction(line: str) -> dict[str, Any] | None:
  match = _INSTRUCTION.match(line)
  if match is None:
    return None
  rest = line[match.end() :]
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  type_str, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  opcode = rest[:paren]
  close = _balanced(rest, paren)
  op_name = _OP_NAME.search(rest[close:])
  return {
    "name": match.group(1),
    "type": type_str,
    "opcode": opcode,
    "operands": re.findall(r"%([^\s,)]+)", rest[paren:close]),
    "attrs": rest[close:],
    "op_name": op_name.group(1) if op_name else "",
  }


@functools.lru_cache(maxsize=2)  # every reading of one program parses it once
def parse(text: str) -> tuple[dict[str, list[dict[str, Any]]], str]:
  """Splits an HLO module's text into computations.

  Args:
    text: ``compiled.as_text()``.

  Returns:
    ``({computation name: its instructions}, the entry computation's name)``;
    shared between calls with the same text, so not to be modified.
  """
  computations: dict[str, list[dict[str, Any]]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header and line.rstrip().endswith("{"):
        current = header.group(2)
        computations[current] = []
        entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif (instr := _instruction(line)) is not None:
      computations[current].append(instr)
  return computations, entry


def _attr(attrs: str, key: str) -> str | None:
  match = re.search(rf"\b{key}=(%[^\s,]+|\{{[^}}]*\}}|[^\s,]+)", attrs)
  return match.group(1) if match else None


def _trip_count(attrs: str) -> int:
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  return int(match.group(1)) if match else 1


def _called(instr: dict[str, Any]) -> list[str]:
  """The computations a control-flow instruction runs (bodies and branches, not fused code)."""
  attrs, opcode = instr["attrs"], instr["opcode"]
  keys = {"while": ("body", "condition"), "call": ("to_apply",)}.get(opcode, ())
  names = [v for key in keys if (v := _attr(attrs, key))]
  if opcode == "conditional":
    names += re.findall(r"%([^\s,}]+)", _attr(attrs, "branch_computations") or "")
    names += [v for key in ("true_computation", "false_computation") if (v := _attr(attrs, key))]
  return [n.lstrip("%") for n in names]


def launches(text: str) -> list[tuple[dict[str, Any], str, int]]:
  """Every kernel-launching instruction of the program, with its computation and run count.

  Args:
    text: ``compiled.as_text()``.

  Returns:
    ``(instruction, computation name, executions per run)`` for the
    instructions of the entry computation and of the loops and branches it
    runs, except those that launch nothing (parameters, tuples, bitcasts,
    control flow, the ``-done`` half of an asynchronous pair). A loop's body
    counts once per iteration when XLA knows its trip count.
  """
  computations, entry = parse(text)
  out: list[tuple[dict[str, Any], str, int]] = []

  def walk(name: str, count: int, seen: frozenset[str]) -> None:
    for instr in computations.get(name, []):
      opcode = instr["opcode"]
      inner = count * _trip_count(instr["attrs"]) if opcode == "while" else count
      for callee in _called(instr):
        if callee not in seen:
          walk(
            callee,
            inner if callee != _attr(instr["attrs"], "condition") else count,
            seen | {callee},
          )
      if opcode not in _NO_KERNEL and not opcode.endswith("-done"):
        out.append((instr, name, count))

  walk(entry, 1, frozenset({entry}))
  return out


def _backend(instr: dict[str, Any]) -> str:
  if instr["opcode"] == "custom-call":
    target = _attr(instr["attrs"], "custom_call_target") or ""
    target = target.strip('"')
    if target.startswith("__cublas$lt"):
      return "cublaslt"
    if target.startswith("__cublas"):
      return "cublas"
    return "cudnn" if target.startswith("__cudnn") else target
  kind = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', instr["attrs"])
  if kind is None:
    return "xla"
  kind = kind.group(1)
  if "triton" in kind:
    return "triton"
  if "cudnn" in kind:
    return "cudnn"
  return "cublas" if "cublas" in kind else kind


def _json_dims(attrs: str, key: str) -> list[int]:
  match = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
  return [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []


def _text_dims(attrs: str, key: str) -> list[int]:
  value = _attr(attrs, key)
  return [int(d) for d in re.findall(r"\d+", value)] if value else []


def _dot_flops(attrs: str, lhs: tuple[int, ...], rhs: tuple[int, ...], custom: bool) -> int:
  # 2 * batch * M * N * K, and batch * M * K is the size of lhs.
  dims = _json_dims if custom else _text_dims
  suffix = "imensions" if custom else "ims"
  rhs_used = dims(attrs, f"rhs_batch_d{suffix}") + dims(attrs, f"rhs_contracting_d{suffix}")
  n = math.prod(s for d, s in enumerate(rhs) if d not in rhs_used)
  return 2 * math.prod(lhs) * n


def _conv_flops(instr: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
  """``2 * forward output size * kernel size / output features``, from the forward ``dim_labels``.

  ``shapes`` are the instruction's ``[lhs, rhs, result]``. A cuDNN backward
  convolution keeps the forward convolution's labels: its kernel and
  forward output are other operands than a forward one's.
  """
  labels = _attr(instr["attrs"], "dim_labels") or ""
  kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
  target = _attr(instr["attrs"], "custom_call_target") or ""
  lhs, rhs, result = shapes
  if "BackwardFilter" in target:
    kernel, output = result, rhs
  elif "BackwardInput" in target:
    kernel, output = rhs, lhs
  else:
    kernel, output = rhs, result
  if "o" not in kernel_labels or len(kernel_labels) != len(kernel):
    return 0
  per_output = math.prod(s for d, s in enumerate(kernel) if kernel_labels[d] != "o")
  return 2 * math.prod(output) * per_output


def _operand(
  instrs: dict[str, dict[str, Any]], instr: dict[str, Any], i: int
) -> tuple[np.dtype, tuple[int, ...]]:
  found = arrays(instrs[instr["operands"][i]]["type"])
  return found[0]


def _record(
  product: dict[str, Any],
  instrs: dict[str, dict[str, Any]],
  kernel: dict[str, Any],
  count: int,
  backend: str,
  native_block_scaling: bool,
) -> dict[str, Any]:
  (lhs_dtype, lhs), (rhs_dtype, rhs) = _operand(instrs, product, 0), _operand(instrs, product, 1)
  block_scaled = product["opcode"] == "scaled-dot"
  if block_scaled and not native_block_scaling:
    # Without block-scaled MMAs (before Blackwell), the Triton kernel dequantises
    # the blocks to bfloat16 in registers and multiplies bfloat16 (checked in the
    # PTX of an H100 compile: wgmma ... f32.bf16.bf16).
    lhs_dtype = rhs_dtype = np.dtype(jnp.bfloat16)
  result_dtype, result = arrays(product["type"])[0]
  custom = product["opcode"] == "custom-call"
  is_conv = product["opcode"] == "convolution" or "conv" in (
    _attr(product["attrs"], "custom_call_target") or ""
  )
  if is_conv:
    flops = _conv_flops(product, [lhs, rhs, result])
  else:
    flops = _dot_flops(product["attrs"], lhs, rhs, custom)
  path, is_backward = layer_paths.module_path(product["op_name"] or kernel["op_name"], "")
  return dict(
    kernel=kernel["name"],
    backend=backend,
    kind="convolution" if is_conv else "scaled-dot" if block_scaled else "dot",
    lhs_dtype=lhs_dtype,
    rhs_dtype=rhs_dtype,
    result_dtype=result_dtype,
    lhs_shape=lhs,
    rhs_shape=rhs,
    result_shape=result,
    flops=flops * count,
    count=count,
    module_path=path,
    op_name=product["op_name"] or kernel["op_name"],
    is_backward=is_backward,
  )


def _products(
  computations: dict[str, list[dict[str, Any]]], name: str
) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
  """The dots and convolutions of a fused computation and the fusions nested in it."""
  instrs = computations.get(name, [])
  by_name = {i["name"]: i for i in instrs}
  out = []
  for instr in instrs:
    if instr["opcode"] in ("dot", "convolution", "scaled-dot"):
      out.append((instr, by_name))
    elif instr["opcode"] == "fusion" and (callee := _attr(instr["attrs"], "calls")):
      out += _products(computations, callee.lstrip("%"))
  return out


def gemms(text: str, *, native_block_scaling: bool = False) -> list[dict[str, Any]]:
  """Every matrix product or convolution kernel of a compiled program.

  Args:
    text: ``compiled.as_text()``.
    native_block_scaling: whether the GPU multiplies MX block-scaled float8
      (Blackwell); before it, a ``scaled-dot`` kernel multiplies bfloat16.

  Returns:
    One dict per product with the fields of ``TargetGemm``: the kernel's
    name and backend, the operand dtypes of the product as the kernel
    multiplies them (inside a fusion: after the conversions fused into it),
    FLOPs per run, the layer path from the product's ``op_name``.
  """
  computations, _ = parse(text)
  records = []
  for instr, comp, count in launches(text):
    backend = _backend(instr)
    if fused_attention.is_fused(instr):
      by_name = {i["name"]: i for i in computations[comp]}
      operands = [_operand(by_name, instr, i) for i in range(3)]
      records.append(fused_attention.record(instr, operands, arrays(instr["type"])[0], count))
    elif instr["opcode"] == "custom-call" and backend in ("cublas", "cublaslt", "cudnn"):
      by_name = {i["name"]: i for i in computations[comp]}
      records.append(_record(instr, by_name, instr, count, backend, native_block_scaling))
    elif instr["opcode"] in ("dot", "convolution"):
      by_name = {i["name"]: i for i in computations[comp]}
      records.append(_record(instr, by_name, instr, count, "xla", native_block_scaling))
    elif instr["opcode"] == "fusion" and (callee := _attr(instr["attrs"], "calls")):
      for product, by_name in _products(computations, callee.lstrip("%")):
        records.append(_record(product, by_name, instr, count, backend, native_block_scaling))
  return records


def kernels(text: str) -> list[dict[str, Any]]:
  """Every kernel launch of a compiled program, with what it reads and writes.

  Args:
    text: ``compiled.as_text()``.

  Returns:
    One dict per launching instruction: ``name``, ``kind`` (the fusion kind
    or backend, e.g. ``"loop"``, ``"input"``, ``"triton"``, or the opcode),
    ``op_name``, ``count`` (executions per run) and ``bytes``: the bytes of
    its operands and results, per execution (an upper bound on the memory
    traffic: a fused operand read twice counts once, a broadcast operand
    counts at its own size).
  """
  computations, _ = parse(text)
  out = []
  for instr, comp, count in launches(text):
    by_name = {i["name"]: i for i in computations[comp]}
    operand_bytes = sum(nbytes(by_name[o]["type"]) for o in instr["operands"] if o in by_name)
    kind = instr["opcode"]
    if kind == "fusion":
      fusion_kind = (_attr(instr["attrs"], "kind") or "").removeprefix("k").lower()
      kind = _backend(instr) if fusion_kind == "custom" else fusion_kind
    elif kind == "custom-call":
      kind = _backend(instr)
    out.append(
      dict(
        name=instr["name"],
        kind=kind,
        op_name=instr["op_name"],
        count=count,
        bytes=operand_bytes + nbytes(instr["type"]),
      )
    )
  return out


def collectives_by_instruction(text: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
  """Each collective instruction of a compiled program, with :func:`collectives`' dicts for it.

  XLA's combiners join collectives into one instruction of several operands, of several dtypes
  at times: such an instruction has one dict per dtype, with its operands of that dtype's bytes.

  Args:
    text: ``compiled.as_text()``.

  Returns:
    ``(instruction, dicts)`` per collective instruction, in program order.
  """
  computations, _ = parse(text)
  out = []
  for instr, comp, count in launches(text):
    kind = instr["opcode"].removesuffix("-start")
    if kind not in COLLECTIVES:
      continue
    by_name = {i["name"]: i for i in computations[comp]}
    types = [by_name[o]["type"] for o in instr["operands"] if o in by_name]
    found = arrays(" ".join(types))
    by_dtype = {dtype: 0 for dtype, _ in found or arrays(instr["type"])[:1]}
    for dtype, shape in found:
      by_dtype[dtype] += math.ceil(math.prod(shape) * dtype.itemsize)
    parts = [
      dict(kind=kind, dtype=dtype, bytes=b, count=count, op_name=instr["op_name"])
      for dtype, b in by_dtype.items()
    ]
    out.append((instr, parts))
  return out


def collectives(text: str) -> list[dict[str, Any]]:
  """Every collective of a compiled program, with its dtype and the bytes each device sends.

  Args:
    text: ``compiled.as_text()``.

  Returns:
    One dict per collective and dtype it carries (see
    :func:`collectives_by_instruction`): ``kind`` (``"all-reduce"``...),
    ``dtype``, ``bytes`` (of its operands of that dtype, per device and
    execution), ``count``, ``op_name``.
  """
  return [part for _, parts in collectives_by_instruction(text) for part in parts]
