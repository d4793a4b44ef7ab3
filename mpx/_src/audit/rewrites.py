"""What XLA:GPU's GEMM rewrites did to a product: split-K, and sibling products merged into one GEMM.

Both leave a trace in the consumers of the GEMM kernel's result, which is how
they are read here from ``compiled.as_text()``:

* **split-K**: the contraction is cut into ``k`` slices computed in parallel
  (3-D operands, a float32 result with a leading axis of ``k``), then summed by
  a ``reduce`` over that axis carrying the product's own ``op_name``, fused into
  whatever kernel reads the result;
* **merged products**: XLA's dot merger concatenates the weights (or the
  gradients) of products that share an operand, the query, key and value
  projections of an attention layer typically, into one GEMM, whose result is
  sliced back into the original products, each ``slice`` carrying the
  ``op_name`` of the product it stands for.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mpx._src.audit import compiled as hlo
from mpx._src.audit import layer_paths

# Ops a result passes through unchanged in value on its way to a slice or a reduce.
_THROUGH = frozenset({"bitcast", "reshape", "copy", "convert", "transpose", "get-tuple-element"})
_PARAMETER = re.compile(r"%([^\s=]+) = [^=]*?parameter\((\d+)\)")
_SLICE = re.compile(r"slice=\{([^}]*)\}")


def _users(instrs: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], int]]:
  return [(i, n) for i in instrs for n, o in enumerate(i["operands"]) if o == name]


def _first_op_name(op_name: str) -> str:
  return op_name.split(";", 1)[0]


def _slice_start(instr: dict[str, Any]) -> tuple[int, ...]:
  match = _SLICE.search(instr["attrs"])
  return tuple(int(s) for s in re.findall(r"\[(\d+):", match.group(1))) if match else ()


class _Reader:
  """Follows a GEMM kernel's result through its consumers, one kernel boundary at most."""

  def __init__(self, text: str) -> None:
    self.computations, _ = hlo.parse(text)
    # Parameter numbers are not kept by the parser: read them from the text.
    numbers = dict(_PARAMETER.findall(text))
    self.parameters: dict[tuple[str, int], str] = {}
    for comp, instrs in self.computations.items():
      for instr in instrs:
        if instr["opcode"] == "parameter" and instr["name"] in numbers:
          self.parameters[(comp, int(numbers[instr["name"]]))] = instr["name"]

  def reached(self, comp: str, name: str, op_name: str, hops: int = 2) -> tuple[list, int]:
    """The slices of ``name``'s value in ``comp`` and below, and the split-K factor on the way.

    Returns:
      ``([(slice instruction, its element count)], split)`` where ``split``
      is the size of the axis a ``reduce`` with the product's ``op_name``
      summed (1 if none).
    """
    instrs = self.computations.get(comp, [])
    by_name = {i["name"]: i for i in instrs}
    slices, split, frontier, seen = [], 1, [name], {name}
    while frontier:
      current = frontier.pop()
      for user, index in _users(instrs, current):
        opcode = user["opcode"]
        if opcode == "slice":
          slices.append(user)
        elif opcode == "fusion" and hops:
          callee = (hlo._attr(user["attrs"], "calls") or "").lstrip("%")
          inner = self.parameters.get((callee, index))
          if inner is not None:
            found, inner_split = self.reached(callee, inner, op_name, hops - 1)
            slices += found
            split = max(split, inner_split)
        elif opcode == "reduce" and _first_op_name(user["op_name"]) == op_name:
          dims = [int(d) for d in re.findall(r"\d+", hlo._attr(user["attrs"], "dimensions") or "")]
          shape = hlo.arrays(by_name[current]["type"])[0][1] if current in by_name else ()
          split = max(split, math.prod(shape[d] for d in dims if d < len(shape)))
          frontier.append(user["name"])
        elif opcode in _THROUGH and user["name"] not in seen:
          seen.add(user["name"])
          frontier.append(user["name"])
    return slices, split


def gemm_rewrites(text: str, gemms: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Split-K factors and merged layers of the GEMM kernels of a compiled program.

  Args:
    text: ``compiled.as_text()``.
    gemms: its products, as ``compiled.gemms`` reads them.

  Returns:
    ``{kernel name: {"split_k": k, "merged": ((layer path, share), ...)}}``
    for the kernels that XLA split along K (``k > 1``) or that compute the
    products of several layers (``merged``: each layer's path, from the
    ``op_name`` of the slice standing for its product, with that slice's share
    of the result, in the order of the result), and for no other kernel.
  """
  reader = _Reader(text)
  out: dict[str, dict[str, Any]] = {}
  gemm_kernels = {g["kernel"]: g["op_name"] for g in gemms}
  for instr, comp, _ in hlo.launches(text):
    if instr["name"] not in gemm_kernels:
      continue
    op_name = _first_op_name(gemm_kernels[instr["name"]])
    slices, split = reader.reached(comp, instr["name"], op_name)
    _, backward = layer_paths.module_path(op_name)
    sizes: dict[str, int] = {}
    for s in sorted(slices, key=_slice_start):
      name = _first_op_name(s["op_name"])
      path, is_backward = layer_paths.module_path(name)
      if name.endswith("/dot_general") and is_backward == backward:
        sizes[path] = sizes.get(path, 0) + math.prod(hlo.arrays(s["type"])[0][1])
    entry: dict[str, Any] = {}
    if split > 1:
      entry["split_k"] = split
    if len(sizes) > 1:
      total = sum(sizes.values())
      entry["merged"] = tuple((path, size / total) for path, size in sizes.items())
    if entry:
      out[instr["name"]] = entry
  return out


def merged_label(paths: tuple[str, ...]) -> str:
  """``a/b/{query,key,value}``: the paths with their common leading part written once."""
  parts = [p.split("/") for p in paths]
  common = 0
  while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
    common += 1
  head = "/".join(parts[0][:common])
  tails = ",".join("/".join(p[common:]) for p in parts)
  return f"{head}/{{{tails}}}" if head else f"{{{tails}}}"
