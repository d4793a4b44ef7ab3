"""Precision policies: which dtype params are stored in, computed in, returned in.

A :class:`Policy` is a frozen, hashable dataclass, so it can be closed over or
passed as a static argument to ``jax.jit``; it is never a pytree leaf.
:func:`get_policy` parses the compact strings that jmp introduced, plus named
presets, so existing jmp configs keep working.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from mpx._src import casting, errors
from mpx._src import dtypes as dtypes_lib
from mpx._src import recipe as recipe_lib

_KEYS = {
  "params": "param_dtype",
  "p": "param_dtype",
  "compute": "compute_dtype",
  "c": "compute_dtype",
  "output": "output_dtype",
  "o": "output_dtype",
}

PRESETS: dict[str, str] = {
  "float32": "params=float32,compute=float32,output=float32",
  "mixed_bfloat16": "params=float32,compute=bfloat16,output=float32",
  "mixed_float16": "params=float32,compute=float16,output=float32",
  "bfloat16": "params=bfloat16,compute=bfloat16,output=bfloat16",
  "float16": "params=float16,compute=float16,output=float16",
  "mixed_float8": "params=float32,compute=bfloat16,output=float32,fp8=current",
  "mixed_float8_delayed": "params=float32,compute=bfloat16,output=float32,fp8=delayed",
  "mixed_float8_rowwise": "params=float32,compute=bfloat16,output=float32,fp8=rowwise",
  "mixed_mxfp8": "params=float32,compute=bfloat16,output=float32,fp8=mxfp8",
  "mixed_float8_blockwise": "params=float32,compute=bfloat16,output=float32,fp8=blockwise",
}
_DTYPE_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


def _name(dtype: np.dtype) -> str:
  return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Policy:
  """The three dtypes of mixed-precision training (paper section 3).

  Attributes:
    param_dtype: the dtype params are stored in (float32 for the paper's master
      weights; a half dtype only together with float32 masters in the
      optimizer, see ``mpx.with_master_params``).
    compute_dtype: the dtype of the forward and backward arithmetic.
    output_dtype: the dtype a model's outputs are returned in, so that losses
      and their reductions run in that precision (usually float32).
    fp8: ``None``, or the :class:`mpx.Fp8Recipe` with which the Flax
      adapters run the layers' dense and einsum matmuls with float8 operands
      (E4M3 forward, E5M2 gradients, float32 accumulation; Micikevicius et
      al., *FP8 Formats for Deep Learning*, 2022); everything else computes
      in ``compute_dtype``, which must then be bfloat16 or float32. A string
      is parsed as in a policy string (``"current"``, ``"delayed"``).

  Example:
    >>> import mpx
    >>> policy = mpx.get_policy("mixed_float16")
    >>> print(policy)
    params=float32,compute=float16,output=float32
    >>> mpx.get_policy(str(policy)) == policy
    True
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  fp8: recipe_lib.Fp8Recipe | None = None

  def __post_init__(self) -> None:
    for name in _DTYPE_FIELDS:
      object.__setattr__(self, name, dtypes_lib.parse_dtype(getattr(self, name)))
    if isinstance(self.fp8, str):
      object.__setattr__(self, "fp8", recipe_lib.parse_recipe(self.fp8))
    if self.fp8 is not None:
      if not isinstance(self.fp8, recipe_lib.Fp8Recipe):
        raise errors.PolicyError(
          f"fp8 must be None, an mpx.Fp8Recipe or a recipe string such as 'delayed', got "
          f"{self.fp8!r}."
        )
      if np.dtype(self.compute_dtype).name not in ("bfloat16", "float32"):
        raise errors.PolicyError(
          f"An fp8 policy computes everything but its float8 matmuls in compute_dtype, which "
          f"must be bfloat16 or float32 (float8 scales span a range float16 cannot hold); got "
          f"{np.dtype(self.compute_dtype).name}. Write e.g. 'mixed_float8' "
          "(params=float32,compute=bfloat16,output=float32,fp8=current)."
        )

  def cast_to_param(self, tree: casting.T) -> casting.T:
    """Casts the floating leaves of ``tree`` to ``param_dtype``.

    Args:
      tree: any pytree (see :func:`mpx.cast_tree` for which leaves change).

    Returns:
      The cast tree.
    """
    return casting.cast_tree(tree, self.param_dtype)

  def cast_to_compute(self, tree: casting.T) -> casting.T:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``.

    Args:
      tree: any pytree, e.g. params and inputs before the forward pass.

    Returns:
      The cast tree.
    """
    return casting.cast_tree(tree, self.compute_dtype)

  def cast_to_output(self, tree: casting.T) -> casting.T:
    """Casts the floating leaves of ``tree`` to ``output_dtype``.

    Args:
      tree: any pytree, e.g. a model's outputs before the loss.

    Returns:
      The cast tree.
    """
    return casting.cast_tree(tree, self.output_dtype)

  def with_output_dtype(self, dtype: dtypes_lib.DTypeLike) -> Policy:
    """Returns a copy of this policy with ``output_dtype`` replaced (as jmp's).

    Any field can be replaced with ``dataclasses.replace(policy,
    compute_dtype="bf16")``; the names are parsed as in the constructor.

    Args:
      dtype: the new output dtype (a dtype or a name).

    Returns:
      A new :class:`Policy`.
    """
    return dataclasses.replace(self, output_dtype=dtype)

  def __str__(self) -> str:
    return (
      f"params={_name(self.param_dtype)},compute={_name(self.compute_dtype)},"
      f"output={_name(self.output_dtype)}" + ("" if self.fp8 is None else f",fp8={self.fp8}")
    )


def _suggestion(word: str, choices: Iterable[str]) -> str:
  close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
  return f" Did you mean {close[0]!r}?" if close else ""


def _parse_string(spec: str) -> Policy:
  text = spec.strip()
  if text.lower() in PRESETS:
    text = PRESETS[text.lower()]
  # Keys, dtype names and presets ignore case; the fp8 recipe lowers all but its axis name.
  text = ",".join(
    part if part.strip().lower().startswith("fp8") else part.lower()
    for part in re.split(r"\s*,\s*", text)
  )
  if not text:
    raise errors.PolicyError(
      "An empty string is not a precision policy. Write a preset such as "
      f"'mixed_bfloat16' (presets: {', '.join(PRESETS)}) or 'params=f32,compute=bf16'."
    )
  if "=" not in text:
    if text not in dtypes_lib.VALID_NAMES:
      raise errors.PolicyError(
        f"Unknown precision policy {spec!r}.{_suggestion(text, (*PRESETS, *dtypes_lib.VALID_NAMES))}"
        f" Write a preset ({', '.join(PRESETS)}), a dtype name meaning all three dtypes "
        f"({', '.join(dtypes_lib.VALID_NAMES)}), or "
        "'params=<dtype>,compute=<dtype>,output=<dtype>' with the short keys p, c, o allowed."
      )
    dtype = dtypes_lib.parse_dtype(text)
    return Policy(dtype, dtype, dtype)
  # jmp's grammar: params default to float32, compute to params, output to
  # compute; a key given twice takes its last value.
  found: dict[str, np.dtype] = {}
  recipe = None
  for part in re.split(r"\s*,\s*", text):
    key, sep, value = (s.strip() for s in part.partition("="))
    if sep and key.lower() == "fp8":
      try:
        recipe = recipe_lib.parse_recipe(value)
      except errors.PolicyError as e:
        raise errors.PolicyError(f"In the policy {spec!r}: {e}") from e
      continue
    if not sep or key not in _KEYS:
      raise errors.PolicyError(
        f"Cannot parse {part!r} in the policy {spec!r}: each part must be "
        "'<key>=<dtype>' with key one of params|p, compute|c, output|o (and fp8=<recipe>), "
        f"e.g. 'params=float32,compute=bfloat16,output=float32'.{_suggestion(key, _KEYS)}"
      )
    try:
      found[_KEYS[key]] = dtypes_lib.parse_dtype(value)
    except errors.PolicyError as e:
      # 'p=f32;c=bf16' fails on the value 'f32;c=bf16': name the policy and the likely fix.
      hint = " Separate the parts with commas." if re.search(r"[^a-z0-9_]", value) else ""
      hint += _suggestion(value, dtypes_lib.VALID_NAMES)
      raise errors.PolicyError(f"In the policy {spec!r}: {e}{hint}") from e
  found.setdefault("param_dtype", np.dtype(np.float32))
  found.setdefault("compute_dtype", found["param_dtype"])
  found.setdefault("output_dtype", found["compute_dtype"])
  return Policy(**found, fp8=recipe)


def get_policy(spec: str | Policy | Any) -> Policy:
  """Returns the :class:`Policy` described by ``spec``.

  Accepted forms:

  * a preset: ``"float32"``, ``"mixed_bfloat16"`` (params f32, compute bf16,
    output f32), ``"mixed_float16"`` (params f32, compute f16, output f32),
    ``"bfloat16"`` and ``"float16"`` (all three half: inference, or training
    with float32 masters in the optimizer);
  * jmp's grammar, in full: ``"params=float32,compute=bfloat16,output=float32"``,
    with the short keys ``p``, ``c``, ``o`` in any order and subset; params
    default to float32, compute to params and output to compute
    (``"c=bf16"`` is ``params=float32,compute=bfloat16,output=bfloat16``), and
    a key given twice takes its last value, as in ``jmp.get_policy``;
  * a bare dtype name, for all three dtypes: ``"bf16"``;
  * float8 matmuls: ``"mixed_float8"`` (``mixed_bfloat16`` with the dense and
    einsum matmuls in float8, current scaling), ``"mixed_float8_delayed"``
    (delayed scaling), ``"mixed_float8_rowwise"`` (a scale per row),
    ``"mixed_mxfp8"`` (a scale per block of 32, for Blackwell GPUs) and
    ``"mixed_float8_blockwise"`` (a scale per 1 x 128 block, per 128 x 128
    weight tile), or
    an ``fp8=<recipe>`` part in jmp's grammar:
    ``"p=f32,c=bf16,o=f32,fp8=delayed:history=1024:reduction=max:margin=0"``
    (see :class:`mpx.Fp8Recipe`);
  * a :class:`Policy` (returned unchanged) or any object with ``param_dtype``,
    ``compute_dtype`` and ``output_dtype`` attributes, such as a ``jmp.Policy``.

  Dtype names are ``float32|f32|fp32|full|single``, ``bfloat16|bf16``,
  ``float16|f16|fp16|half`` and ``float64|f64|fp64|double``; case and
  whitespace are ignored, except in the fp8 recipe's axis name (JAX's axis
  names are case-sensitive). Every string ``jmp.get_policy`` accepts gives the
  same policy here, with one deliberate difference: ``half`` is IEEE float16
  on every platform (jmp picks bfloat16 on TPU), so that one config string
  means the same numerics everywhere.

  Note that ``params=float16`` without float32 master weights is the failure
  mode of paper section 3.1: updates smaller than half an ulp of a weight are
  rounded away. It is allowed (it is what ``mpx.with_master_params`` expects)
  but should be trained only with masters.

  Args:
    spec: the policy description.

  Returns:
    The parsed policy.

  Raises:
    PolicyError: the string cannot be parsed; the message lists the valid keys,
      names and presets, and suggests the closest one (``"mixed_fp16"``: did
      you mean ``'mixed_float16'``?).

  Example:
    >>> import mpx
    >>> print(mpx.get_policy("p=f32,c=bf16"))
    params=float32,compute=bfloat16,output=bfloat16
    >>> print(mpx.get_policy("compute=half"))
    params=float32,compute=float16,output=float16
  """
  if isinstance(spec, Policy):
    return spec
  if isinstance(spec, str):
    return _parse_string(spec)
  if all(hasattr(spec, name) for name in _DTYPE_FIELDS):
    return Policy(
      spec.param_dtype, spec.compute_dtype, spec.output_dtype, getattr(spec, "fp8", None)
    )
  raise errors.PolicyError(
    f"Cannot make a precision policy from {spec!r} of type {type(spec).__name__}. Pass "
    f"a string such as 'mixed_bfloat16' (presets: {', '.join(PRESETS)}), an mpx.Policy, "
    "or an object with param_dtype, compute_dtype and output_dtype attributes."
  )
