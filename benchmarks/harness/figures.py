"""Deterministic figures of a train step: what the compiler and the autodiff residuals say.

Nothing here runs the step, so every figure is the same on every run of the
same JAX version and backend (the residual bytes and convert counts are even
backend-independent: they are read before XLA compiles anything).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax

PyTree = Any


def saved_residual_bytes(
  loss_fn: Callable[..., Any], params: PyTree, *args: Any, has_aux: bool = False
) -> int:
  """Bytes the backward pass of ``loss_fn`` keeps from its forward pass.

  The residuals of ``jax.vjp(loss_fn, params)`` with the other arguments held
  fixed: every array the VJP function closes over (activations, the
  half-precision copies of float32 params, masks, statistics; a param that is
  itself needed counts too), each once. Computed with ``jax.eval_shape``:
  nothing is compiled or allocated, and the figure does not depend on the
  backend or on XLA's fusion decisions (XLA may later rematerialise or fuse
  some of them away; this is what autodiff asks it to keep).

  Args:
    loss_fn: ``(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
    params: the differentiated argument (arrays or ``jax.ShapeDtypeStruct``).
    *args: the other arguments (arrays or ``jax.ShapeDtypeStruct``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    The total size in bytes of the residual arrays.
  """

  def vjp_fn(params: PyTree, *args: Any) -> Any:
    return jax.vjp(lambda p: loss_fn(p, *args), params, has_aux=has_aux)[1]

  leaves = jax.tree.leaves(jax.eval_shape(vjp_fn, params, *args))
  return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)


_CONVERT = re.compile(r"= stablehlo\.convert\b")


def count_converts(stablehlo_text: str) -> int:
  """Number of ``stablehlo.convert`` ops (dtype casts) in a lowered program's text.

  Args:
    stablehlo_text: ``lowered.as_text()``.

  Returns:
    The count, nested functions included, each op once.
  """
  return len(_CONVERT.findall(stablehlo_text))


def count_fusions(hlo_text: str) -> int:
  """Fusion instructions (kernels) in an optimized HLO text, nested control flow included.

  Args:
    hlo_text: ``compiled.as_text()``.

  Returns:
    The count.
  """
  return sum(1 for line in hlo_text.splitlines() if " fusion(" in line and "calls=" in line)


def compiler_figures(compiled: Any) -> dict[str, float]:
  """XLA's cost and memory analyses of a compiled program.

  Args:
    compiled: a ``jax.stages.Compiled``.

  Returns:
    ``flops`` and ``bytes_accessed`` (``cost_analysis()``; XLA's own model of
    the program, not a measurement), ``temp_bytes``, ``argument_bytes`` and
    ``output_bytes`` (``memory_analysis()``), and ``fusions``.
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, list | tuple):
    cost = cost[0] if cost else {}
  memory = compiled.memory_analysis()
  return {
    "flops": float(cost.get("flops", math.nan)),
    "bytes_accessed": float(cost.get("bytes accessed", math.nan)),
    "temp_bytes": float(getattr(memory, "temp_size_in_bytes", math.nan)),
    "argument_bytes": float(getattr(memory, "argument_size_in_bytes", math.nan)),
    "output_bytes": float(getattr(memory, "output_size_in_bytes", math.nan)),
    "fusions": float(count_fusions(compiled.as_text() or "")),
  }
