"""The largest temporary buffers of a compiled program: what a step's temporary memory is made of.

``compiled.memory_analysis()`` gives the temporaries as one number. The
buffers behind it are the results of the program's kernels that are neither
arguments nor outputs; the largest of them say where a large figure comes
from (a float16 step that all-gathers its activations for a pooling's
backward pass, say, where the bfloat16 step does not).
"""

from __future__ import annotations

import math
from typing import Any

from mpx._src.audit import compiled as hlo
from mpx._src.audit import layer_paths
from mpx._src.audit import ops as audit_ops

# Ops whose result is (a view of) another instruction's buffer.
_VIEWS = frozenset({"tuple", "get-tuple-element", "bitcast"})


def _outputs(text: str) -> set[str]:
  """The instructions of the entry computation whose buffers are the program's outputs."""
  computations, entry = hlo.parse(text)
  instrs = computations.get(entry, [])
  if not instrs:
    return set()
  by_name = {i["name"]: i for i in instrs}
  out, frontier = set(), [instrs[-1]["name"]]  # the ROOT comes last
  while frontier:
    name = frontier.pop()
    if name in out or name not in by_name:
      continue
    out.add(name)
    if by_name[name]["opcode"] in _VIEWS:
      frontier += by_name[name]["operands"]
  return out


def largest_temporaries(text: str, n: int = 3) -> tuple[dict[str, Any], ...]:
  """The ``n`` largest buffers the kernels of a compiled program write that are not its outputs.

  Args:
    text: ``compiled.as_text()``.
    n: how many.

  Returns:
    Dicts with ``name`` (the instruction), ``kind`` (as in
    ``compiled.kernels``: ``loop``, ``triton``, ``all-gather``...), ``type`` (dtype
    and shape, e.g. ``float16[512,56,56,64]``), ``bytes``, ``layer`` (the layer path
    from its ``op_name``, ``""`` if none) and ``is_backward``, largest first.
  """
  outputs = _outputs(text)
  kinds = {k["name"]: k["kind"] for k in hlo.kernels(text)}
  found = []
  for instr, _, _ in hlo.launches(text):
    if instr["name"] in outputs or instr["opcode"] in _VIEWS:
      continue
    layer, backward = layer_paths.module_path(instr["op_name"].split(";", 1)[0])
    for dtype, shape in hlo.arrays(instr["type"]):  # each result of a multi-output kernel
      size = math.ceil(math.prod(shape) * dtype.itemsize)
      if size:
        found.append(
          dict(
            name=instr["name"],
            kind=kinds.get(instr["name"], instr["opcode"]).removesuffix("-start"),
            type=audit_ops.operand(dtype, shape),
            bytes=size,
            layer=layer,
            is_backward=backward,
          )
        )
  return tuple(sorted(found, key=lambda b: -b["bytes"])[:n])


def describe(buffer: dict[str, Any]) -> str:
  """``392.0 MiB float16[512,112,112,64] all-gather (ResNet50, backward)``: one buffer for a summary."""
  where = ", ".join(p for p in (buffer["layer"], "backward" if buffer["is_backward"] else "") if p)
  return f"{buffer['bytes'] / 2**20:.1f} MiB {buffer['type']} {buffer['kind']}" + (
    f" ({where})" if where else ""
  )
