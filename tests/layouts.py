"""Parallel layouts of ``tests/models.LlamaDecoder``'s params: FSDP, tensor parallel, both.

A documented recipe, not mpx API: the params' ``PartitionSpec``s follow from
their paths (``docs/guide/multihost.md`` shows the same rule), and
``mpx.parallel.state_shardings`` places the optimizer state like them.

* Tensor parallelism over ``"model"`` (Megatron-style): the layers that fan
  out (``qkv``, ``gate``, ``up``, the ``head``, the embedding's features) split
  their output features; the layers that fan in (``out``, ``down``) split their
  input features, so each block needs one reduction of its activations.
* FSDP over ``"data"``: each large param is split along its largest axis that
  the data axis divides and tensor parallelism left free.
* Under ``nn.scan`` the stacked layer axis is never split: each iteration
  slices one layer.
* Params under ``min_size`` elements (norm scales, biases) are replicated.
"""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

FAN_OUT = ("qkv", "gate", "up", "head")
FAN_IN = ("out", "down")


def llama_specs(params: Any, axes: dict[str, int], *, min_size: int = 4096) -> Any:
  """``PartitionSpec``s for a ``LlamaDecoder``'s params on a mesh of ``axes`` (name: size).

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct``), scanned or unrolled.
    axes: the mesh axes, ``{"data": n}`` (FSDP), ``{"model": m}`` (tensor
      parallel) or both.
    min_size: params with fewer elements are replicated.

  Returns:
    A tree of ``PartitionSpec`` with the structure of ``params``.
  """
  data, model = axes.get("data", 1), axes.get("model", 1)

  def spec(path: Any, x: Any) -> P:
    if x.size < min_size:
      return P()
    names = [str(getattr(k, "key", k)) for k in path]
    split: list[str | None] = [None] * x.ndim
    tp_dim = None
    if names[-1] == "embedding" or (names[-1] == "kernel" and names[-2] in FAN_OUT):
      tp_dim = x.ndim - 1
    elif names[-1] == "kernel" and names[-2] in FAN_IN:
      tp_dim = x.ndim - 2
    if model > 1 and tp_dim is not None and x.shape[tp_dim] % model == 0:
      split[tp_dim] = "model"
    scanned = 1 if "layers" in names else 0  # nn.scan's stacked layer axis stays whole
    free = [d for d in range(scanned, x.ndim) if split[d] is None and x.shape[d] % data == 0]
    if data > 1 and free:
      split[max(free, key=lambda d: x.shape[d])] = "data"
    return P(*split)

  return jax.tree_util.tree_map_with_path(spec, params)
