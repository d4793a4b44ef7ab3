"""Which attention a compiled XLA:GPU program runs: cuDNN's fused kernel, or mpx's unfused path.

cuDNN's fused attention is one custom call per pass (``__cudnn$fmhaSoftmax``
forward, ``__cudnn$fmhaSoftmaxBackward``), whose products are not dots of the
program: their FLOPs are read here from the call's shapes and backend config,
so that the audit's GEMM list and the roofline count them. mpx's attention
runs its unfused path under a name scope that says why
(``mpx/_src/ops/attention.py``), which reaches the ``op_name`` of every kernel
it compiles to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from mpx._src.audit import layer_paths
from mpx._src.ops import attention as attention_lib

_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL = re.compile(r'"mask_type":\s*"(PADDING_)?CAUSAL"')
_UNFUSED = re.compile(rf"{attention_lib.UNFUSED_SCOPE}_([a-z_]+)")

Array = tuple[np.dtype, tuple[int, ...]]


def _target(instr: dict[str, Any]) -> str:
  match = _TARGET.search(instr["attrs"])
  return match.group(1) if match else ""


def is_fused(instr: dict[str, Any]) -> bool:
  """Whether a compiled instruction is a pass of cuDNN's fused attention."""
  return instr["opcode"] == "custom-call" and _target(instr).startswith("__cudnn$fmha")


def causal_share(t: int, s: int) -> float:
  """The share of a ``t x s`` score matrix a top-left causal kernel computes (query i: keys 0..i)."""
  full = min(t, s)  # rows 0..full-1 see i + 1 keys, the others all s
  return (full * (full + 1) // 2 + (t - full) * s) / (t * s)


def record(
  instr: dict[str, Any], operands: list[Array], result: Array, count: int
) -> dict[str, Any]:
  """The ``TargetGemm`` fields of one fused-attention call (kind ``"attention"``).

  FLOPs: ``2 B N T S`` per contraction over the query's head dim ``H`` or the
  value's ``Hv``: ``H + Hv`` forward (scores, output), ``3 H + 2 Hv`` backward
  (the scores again, then the gradients of the probabilities, the value, the
  query and the key), times the share of the scores a causal kernel computes
  (it skips the tiles above the diagonal; counted per score, not per tile).
  ``B N T S``, the scores' shape, is in the backend config.

  Args:
    instr: the custom call (``compiled.parse``'s dict).
    operands: ``(dtype, shape)`` of its first three operands: query, key, value.
    result: ``(dtype, shape)`` of its first result.
    count: executions per run.

  Returns:
    The fields of ``TargetGemm``; ``lhs`` is the query, ``rhs`` the key.
  """
  (q_dtype, q), (k_dtype, k), (_, v) = operands[:3]
  attrs = instr["attrs"]
  scores = _SCORES.search(attrs)
  b, n, t, s = (int(d) for d in re.findall(r"\d+", scores.group(1))) if scores else (0, 0, 0, 0)
  backward = "Backward" in _target(instr)
  per_score = 3 * q[-1] + 2 * v[-1] if backward else q[-1] + v[-1]
  share = causal_share(t, s) if _CAUSAL.search(attrs) and t and s else 1.0
  path, transposed = layer_paths.module_path(instr["op_name"], "")
  return dict(
    kernel=instr["name"],
    backend="cudnn",
    kind="attention",
    lhs_dtype=q_dtype,
    rhs_dtype=k_dtype,
    result_dtype=result[0],
    lhs_shape=q,
    rhs_shape=k,
    result_shape=result[1],
    flops=round(2 * b * n * t * s * per_score * share) * count,
    count=count,
    module_path=path,
    op_name=instr["op_name"],
    is_backward=backward or transposed,
  )


def calls(launches: Iterable[tuple[dict[str, Any], str, int]]) -> list[dict[str, Any]]:
  """Which attention each attention layer's pass runs.

  Args:
    launches: ``compiled.launches(text)``.

  Returns:
    One dict per fused-attention call (``implementation`` ``"cudnn"``) and one
    per layer and pass that runs :func:`mpx.dot_product_attention`'s unfused
    path (``"xla"``, with the ``reason`` of its name scope, a key of
    ``mpx._src.ops.attention.REASONS``), with the fields of
    ``TargetAttention``. Attention written without mpx that runs unfused is
    not recognised.
  """
  fused, unfused = [], {}
  for instr, _, count in launches:
    path, transposed = layer_paths.module_path(instr["op_name"], "")
    if is_fused(instr):
      backward = transposed or "Backward" in _target(instr)
      fused.append(
        dict(
          module_path=path,
          is_backward=backward,
          implementation="cudnn",
          reason=None,
          count=count,
        )
      )
    elif match := _UNFUSED.search(instr["op_name"]):
      key = (path, transposed, match.group(1))
      unfused[key] = max(unfused.get(key, 0), count)
  return fused + [
    dict(module_path=p, is_backward=b, implementation="xla", reason=r, count=c)
    for (p, b, r), c in unfused.items()
  ]


def summary_lines(calls: Iterable[Any]) -> list[str]:
  """The audit summary's lines on attention: how many passes run fused, how many unfused and why.

  Args:
    calls: ``TargetAttention`` records.

  Returns:
    One line per implementation and reason.
  """
  groups: dict[str, int] = {}
  for c in calls:
    if c.reason is None:
      line = "fused (cuDNN flash attention)"
    else:
      why = attention_lib.REASONS.get(c.reason, c.reason)
      line = f"unfused (mpx.dot_product_attention's exact path, scores in memory): {why}"
    groups[line] = groups.get(line, 0) + c.count
  return [f"attention: {n} passes {line}" for line, n in sorted(groups.items())]
