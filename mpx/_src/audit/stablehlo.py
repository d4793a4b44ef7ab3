"""Reading matmuls, convolutions and half-precision reductions out of a StableHLO module, for the audit.

Generic MLIR calls only (operation names, operand types, attributes as text,
locations), so no jaxlib dialect internals are imported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src.audit import layer_paths

_PRODUCT_OPS = {
  "stablehlo.dot_general": "dot_general",
  "stablehlo.dot": "dot",
  "stablehlo.convolution": "convolution",
}
_MLIR_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")
_ALIGNMENT = 8


def _element_dtype(element: str) -> np.dtype:
  if element in _MLIR_DTYPES:
    return np.dtype(jnp.dtype(_MLIR_DTYPES[element]))
  if match := re.fullmatch(r"(u?)i(\d+)", element):
    unsigned, bits = match.groups()
    return np.dtype(bool) if bits == "1" else np.dtype(f"{unsigned and 'u'}int{bits}")
  # The float8 formats: 'f8E4M3FN' is ml_dtypes' 'float8_e4m3fn'.
  return np.dtype(jnp.dtype(re.sub(r"^f8", "float8_", element).lower()))


def _tensor(type_str: str) -> tuple[np.dtype, tuple[int, ...]]:
  match = _TENSOR.fullmatch(type_str)
  if match is None:
    raise errors.MpxError(
      f"mpx.audit cannot read the StableHLO operand type {type_str!r} (only statically "
      "shaped tensors are supported); lower the function with concrete shapes."
    )
  dims, element = match.groups()
  return _element_dtype(element), tuple(int(d) for d in dims.split("x") if d)


def _dims(text: str, key: str) -> list[int]:
  match = re.search(key + r" = \[([\d, ]*)\]", text)
  return [int(d) for d in match.group(1).split(",") if d.strip()] if match else []


def _gemm_dot(attrs: dict[str, str], lhs: tuple[int, ...], rhs: tuple[int, ...]):
  numbers = attrs.get("dot_dimension_numbers", "")
  lhs_batch, rhs_batch = (
    _dims(numbers, "lhs_batching_dimensions"),
    _dims(numbers, "rhs_batching_dimensions"),
  )
  lhs_contract = _dims(numbers, "lhs_contracting_dimensions")
  rhs_contract = _dims(numbers, "rhs_contracting_dimensions")
  if not numbers:  # stablehlo.dot: a plain matrix-vector or matrix-matrix product.
    lhs_contract, rhs_contract = [len(lhs) - 1], [0]
  batch = math.prod(lhs[d] for d in lhs_batch)
  k = math.prod(lhs[d] for d in lhs_contract)
  m = math.prod(s for d, s in enumerate(lhs) if d not in lhs_batch + lhs_contract)
  n = math.prod(s for d, s in enumerate(rhs) if d not in rhs_batch + rhs_contract)
  dims = {"M": m, "N": n, "K": k}
  misaligned = tuple(f"{key}={v}" for key, v in dims.items() if v % _ALIGNMENT)
  return (m, n, k), 2 * batch * m * n * k, misaligned


def _gemm_conv(attrs: dict[str, str], rhs: tuple[int, ...], result: tuple[int, ...]):
  # '#stablehlo.conv<[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]>': the kernel layout is the middle.
  match = re.search(r"\]x\[([^\]]*)\]", attrs.get("dimension_numbers", ""))
  if match is None:
    raise errors.MpxError(
      f"mpx.audit cannot read the convolution dimension numbers in {attrs!r}; please report "
      "this with your jax version."
    )
  layout = [s.strip() for s in match.group(1).split(",")]
  in_features = rhs[layout.index("i")]
  out_features = rhs[layout.index("o")]
  spatial = math.prod(rhs[d] for d, s in enumerate(layout) if s not in ("i", "o"))
  k = spatial * in_features
  n = out_features
  m = math.prod(result) // max(n, 1)
  misaligned = tuple(f"{key}={v}" for key, v in {"M": m, "N": n, "K": k}.items() if v % _ALIGNMENT)
  return (m, n, k), 2 * math.prod(result) * k, misaligned


_INTEGER = re.compile(r"dense<(-?\d+)>")


def _constant(value: Any) -> int | None:
  owner = value.owner
  if getattr(owner, "name", None) != "stablehlo.constant":
    return None
  match = _INTEGER.match(_attributes(owner)["value"])
  return int(match.group(1)) if match else None


def _trip_count(loop: Any) -> int:
  """How many times a ``stablehlo.while`` runs its body, read from ``counter < limit`` (else 1).

  ``lax.scan`` and ``fori_loop`` (so ``nn.scan`` and ``nnx.scan``) lower to a
  counter started at a constant and compared with a constant limit; a loop
  whose length is only known at run time is counted once.
  """
  cond = loop.regions[0].blocks[0]
  for op in cond.operations:
    if op.name != "stablehlo.compare" or "LT" not in _attributes(op)["comparison_direction"]:
      continue
    counter, limit = op.operands[0], _constant(op.operands[1])
    for i, argument in enumerate(cond.arguments):
      start = _constant(loop.operands[i]) if argument == counter else None
      if start is not None and limit is not None:
        return max(limit - start, 0)
  return 1


def _walk(op: Any, repeats: int = 1) -> Iterator[tuple[Any, int]]:
  """Every op nested in ``op``, with how many times it runs per run of ``op``."""
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        child = child.operation
        yield child, repeats
        inner = repeats * _trip_count(child) if child.name == "stablehlo.while" else repeats
        yield from _walk(child, inner)


_CALLS = {"func.call": "callee", "stablehlo.composite": "decomposition"}


def _attributes(op: Any) -> dict[str, str]:
  return {op.attributes[i].name: str(op.attributes[i].attr) for i in range(len(op.attributes))}


def _collect(module: Any, names: frozenset[str]) -> list[dict[str, Any]]:
  """Returns the raw records of the ops called ``names`` in a module, name stacks made absolute."""
  functions: dict[str, list[Any]] = {}
  for func in module.body.operations:
    func = func.operation
    if func.name == "func.func":
      functions[_attributes(func)["sym_name"].strip('"')] = list(_walk(func))
  # Private functions carry name stacks relative to their call site. A composite
  # (jax.lax.scaled_dot's "xla.scaled_dot") calls its decomposition likewise.
  callers: dict[str, list[tuple[str, str, int]]] = {name: [] for name in functions}
  composites: dict[str, list[tuple[str, str, int]]] = {}
  for caller, ops in functions.items():
    for op, repeats in ops:
      if op.name in _CALLS:
        callee = _attributes(op)[_CALLS[op.name]].strip('"').lstrip("@")
        site = (caller, layer_paths.location_name(str(op.location)), repeats)
        callers.setdefault(callee, []).append(site)
        if op.name == "stablehlo.composite":
          composites.setdefault(callee, []).append(site)
  prefix: dict[str, str] = {}
  count: dict[str, int] = {}

  def resolve(func: str, seen: frozenset[str] = frozenset()) -> None:
    if func in prefix:
      return
    sites = [site for site in callers.get(func, []) if site[0] not in seen]
    if not sites:
      prefix[func], count[func] = "", 1
      return
    for caller, _, _ in sites:
      resolve(caller, seen | {func})
    caller, call_name, _ = sites[0]
    prefix[func] = "/".join(p for p in (prefix[caller], call_name) if p)
    count[func] = sum(count[c] * repeats for c, _, repeats in sites)

  records = []
  for func, ops in functions.items():
    resolve(func)
    # A function called from several places counts once, under its first caller's
    # name; a composite's decomposition (one per shape, shared by every layer of that
    # shape) counts once per call site, under each site's name.
    sites = [(prefix[func], count[func])]
    if func in composites:
      for caller, _, _ in composites[func]:
        resolve(caller)
      sites = [
        ("/".join(p for p in (prefix[caller], call_name) if p), count[caller] * repeats)
        for caller, call_name, repeats in composites[func]
      ]
    for op, repeats in ops:
      if op.name not in names:
        continue
      location = str(op.location)
      for site_prefix, site_count in sites:
        name = "/".join(p for p in (site_prefix, layer_paths.location_name(location)) if p)
        records.append(
          {"op": op, "name": name, "location": location, "count": site_count * repeats}
        )
  return records


# Ops that move or replicate elements without computing: an upcast stays an upcast through them.
# (jax's `copy` primitive lowers to no op at all, so there is no copy to look through.)
_LAYOUT_OPS = frozenset({"stablehlo.transpose", "stablehlo.reshape", "stablehlo.broadcast_in_dim"})


def _float_convert_source(op: Any) -> np.dtype | None:
  """The source dtype of a float-to-float ``convert``, else ``None``."""
  if getattr(op, "name", None) != "stablehlo.convert":
    return None
  source, _ = _tensor(str(op.operands[0].type))
  target, _ = _tensor(str(op.results[0].type))
  return source if dtypes_lib.is_floating(source) and dtypes_lib.is_floating(target) else None


def _upcast_from_half(value: Any) -> bool:
  """Whether ``value`` is a half-precision tensor converted to a wider float.

  Looks back through layout ops and through every float ``convert`` of the
  chain: JAX emits identity converts (``f32 -> f32``) and convert chains
  (``bf16 -> f32 -> f32`` for ``w.astype(float32)`` meeting a promoted operand),
  so the convert from half is not always the op's direct producer.
  """
  target, _ = _tensor(str(value.type))
  if not dtypes_lib.is_floating(target) or target.itemsize <= 2:
    return False
  owner, from_half = value.owner, False
  while True:
    name = getattr(owner, "name", None)
    if name in _LAYOUT_OPS:
      owner = owner.operands[0].owner
      continue
    source = _float_convert_source(owner)
    if source is None:
      return from_half  # a block argument, or computed by another op
    from_half = from_half or dtypes_lib.is_half(source)
    owner = owner.operands[0].owner


def _float8_format(value: Any) -> np.dtype | None:
  """The float8 format a product operand is multiplied in: its own, or the one it was dequantised from."""
  own, _ = _tensor(str(value.type))
  return own if dtypes_lib.is_float8(own) else _dequantized_from(value)


def _dequantized_from(value: Any, depth: int = 0) -> np.dtype | None:
  """The float8 format ``value`` was dequantised from, or ``None``.

  Recognises the quantise-dequantise form (Flax's ``Fp8DotGeneralOp``):
  ``convert(float8 -> wider)``, optionally multiplied or divided by a
  scale, optionally reshaped or transposed (an einsum's layout ops).
  """
  owner = value.owner
  name = getattr(owner, "name", None)
  if name == "stablehlo.convert":
    source, _ = _tensor(str(owner.operands[0].type))
    if depth < 4 and str(owner.operands[0].type) == str(value.type):
      return _dequantized_from(owner.operands[0], depth + 1)  # an identity convert
    return source if dtypes_lib.is_float8(source) else None
  if depth < 4 and name in ("stablehlo.multiply", "stablehlo.divide"):
    return _dequantized_from(owner.operands[0], depth + 1) or (
      _dequantized_from(owner.operands[1], depth + 1) if name == "stablehlo.multiply" else None
    )
  if depth < 4 and name in _LAYOUT_OPS:
    return _dequantized_from(owner.operands[0], depth + 1)
  return None


def _record(raw: dict[str, Any]) -> dict[str, Any]:
  op = raw["op"]
  kind = _PRODUCT_OPS[op.name]
  attrs = _attributes(op)
  lhs_dtype, lhs_shape = _tensor(str(op.operands[0].type))
  rhs_dtype, rhs_shape = _tensor(str(op.operands[1].type))
  result_dtype, result_shape = _tensor(str(op.results[0].type))
  if kind == "convolution":
    gemm, flops, misaligned = _gemm_conv(attrs, rhs_shape, result_shape)
  else:
    gemm, flops, misaligned = _gemm_dot(attrs, lhs_shape, rhs_shape)
  accumulation = re.search(r"accumulation_type = (\w+)", attrs.get("algorithm", ""))
  operand_precision = re.search(r"lhs_precision_type = (\w+)", attrs.get("algorithm", ""))
  path, is_backward = layer_paths.module_path(raw["name"], raw["location"])
  return dict(
    kind=kind,
    lhs_dtype=lhs_dtype,
    rhs_dtype=rhs_dtype,
    result_dtype=result_dtype,
    accumulation_dtype=_element_dtype(accumulation.group(1)) if accumulation else None,
    precision=tuple(re.findall(r"precision (\w+)", attrs.get("precision_config", ""))),
    algorithm_precision=operand_precision.group(1) if operand_precision else None,
    upcast=tuple(
      side
      for side, value in zip(("lhs", "rhs"), op.operands, strict=False)
      if _upcast_from_half(value)
    ),
    lhs_shape=lhs_shape,
    rhs_shape=rhs_shape,
    result_shape=result_shape,
    gemm_dims=gemm,
    flops=flops * raw["count"],
    module_path=path,
    name=raw["name"],
    is_backward=is_backward,
    count=raw["count"],
    misaligned=misaligned,
    fp8=tuple(_float8_format(value) for value in op.operands[:2]),
  )


def matmul_ops(module: Any) -> list[dict[str, Any]]:
  """Returns the fields of every dot/convolution in ``module``, in program order.

  Args:
    module: the ``compiler_ir("stablehlo")`` of a lowered JAX program.

  Returns:
    One dict per op with the fields of ``mpx.diagnostics.MatmulOp`` except ``share``.
  """
  return [_record(raw) for raw in _collect(module, frozenset(_PRODUCT_OPS))]


_SUMS = frozenset({"stablehlo.reduce", "stablehlo.reduce_window"})


def _reduction(raw: dict[str, Any]) -> dict[str, Any] | None:
  """The fields of a half-precision sum or exp, or ``None`` for any other reduce or exp."""
  op = raw["op"]
  dtype, shape = _tensor(str(op.operands[0].type))
  if op.name == "stablehlo.exponential":
    if dtype != np.dtype(jnp.float16):
      return None  # bfloat16 has float32's range: its exp does not overflow
    kind, terms = "exp", 1
  else:
    body = [child.name for child in op.regions[0].blocks[0].operations]
    if not dtypes_lib.is_half(dtype) or "stablehlo.add" not in body:
      return None  # max/min/and reductions are exact in any dtype
    attrs = _attributes(op)
    if op.name == "stablehlo.reduce":
      terms = math.prod(shape[d] for d in _dims_array(attrs.get("dimensions", "")))
    else:
      terms = math.prod(_dims_array(attrs.get("window_dimensions", "")))
    if terms <= 1:
      return None  # a reshape in disguise: nothing is added
    kind = "sum"
  path, is_backward = layer_paths.module_path(raw["name"], raw["location"])
  return dict(
    kind=kind,
    dtype=dtype,
    shape=shape,
    terms=terms,
    module_path=path,
    name=raw["name"],
    is_backward=is_backward,
    count=raw["count"],
  )


def _dims_array(text: str) -> list[int]:
  """``array<i64: 1, 2>`` (or ``dense<[1, 2]>``) -> ``[1, 2]``."""
  match = re.search(r"(?:array<i64:|\[)\s*([\d,\s]*)", text)
  return [int(d) for d in match.group(1).split(",") if d.strip()] if match else []


def half_reductions(module: Any) -> list[dict[str, Any]]:
  """Returns every sum in float16 or bfloat16 and every exp in float16 of ``module``.

  Args:
    module: the ``compiler_ir("stablehlo")`` of a lowered JAX program.

  Returns:
    One dict per op with the fields of ``audit.ReductionOp``, in program order.
  """
  raws = _collect(module, _SUMS | {"stablehlo.exponential"})
  return [r for r in map(_reduction, raws) if r is not None]
