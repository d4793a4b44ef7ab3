"""The layer that issued an op, read from its JAX name stack (and, failing that, its location).

JAX records a name stack on every op
(``jit(step)/transpose(jvp(Decoder))/Block_0/Dense_0/dot_general``). Flax
linen pushes one name per module call; NNX pushes none, so
:mod:`mpx._src.audit.nnx_scopes` pushes one element per module call while
the audit traces: the module's attribute path after :data:`ABSOLUTE`
(``~blocks/0/attn/query``), which replaces whatever path came before it. A
JAX transformation wraps the element it starts at (``transpose(jvp(~blocks/0))``),
so elements are split at the slashes outside parentheses.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

from mpx._src.ops import attention as attention_lib

#: Starts a name-stack element that holds a whole layer path (pushed for NNX modules).
ABSOLUTE = "~"
# JAX's own name-stack scopes; they say how an op was produced, not who issued it.
_INTERNAL_SCOPES = frozenset(
  {
    "body",
    "branch",
    "checkpoint",
    "closed_call",
    "composite",
    "cond",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "jit",
    "pjit",
    "remat",
    "rematted_computation",
    "scan",
    "shard_map",
    "while",
  }
)
# Scopes that name no module: jax's cond branches ('branch_0_fun'), mpx's attention's.
_SCOPES = re.compile(rf"branch_\d+_fun|{attention_lib.SCOPES}")
_WRAPPED = re.compile(r"([A-Za-z_][\w.]*)\((.*)\)")
_LOC_NAME = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"\(')
_FRAME = re.compile(r'"([A-Za-z_<][\w.<>]*)"\(')


def elements(name: str) -> list[str]:
  """A name stack's elements: split at the ``/`` outside parentheses.

  Args:
    name: a name stack, e.g. ``"jit(f)/transpose(jvp(~blocks/0))/~blocks/0/mlp/dot_general"``.

  Returns:
    Its elements, e.g. ``["jit(f)", "transpose(jvp(~blocks/0))", "~blocks/0/mlp", "dot_general"]``.
  """
  out, depth, start = [], 0, 0
  for i, char in enumerate(name):
    if char == "(":
      depth += 1
    elif char == ")":
      depth -= 1
    elif char == "/" and depth == 0:
      out.append(name[start:i])
      start = i + 1
  out.append(name[start:])
  return out


def location_name(location: str) -> str:
  """The name stack an MLIR location starts with (``""`` if none)."""
  match = _LOC_NAME.match(location)
  return match.group(1) if match else ""


def _from_frames(location: str) -> list[str]:
  """Class names from the Python call stack a location keeps, outermost first."""
  named = _LOC_NAME.match(location)
  calls = _FRAME.findall(location[named.end() if named else 0 :])
  frames: list[str] = []
  for qualname in calls:
    parts = qualname.split(".")
    if len(parts) < 2 or not parts[-2][:1].isupper():
      if frames:
        break  # The first plain function outside the modules: the traced code.
      continue  # A helper inside the innermost module, e.g. dot_product_attention.
    label = parts[-2] if parts[-1] == "__call__" else f"{parts[-2]}.{parts[-1]}"
    if not frames or frames[0] != label:
      frames.insert(0, label)
  return frames or calls[:1]  # A plain function: its innermost Python frame.


def module_path(name: str, location: str = "") -> tuple[str, bool]:
  """Returns ``(layer path, is_backward)`` from a name stack and its location.

  Args:
    name: the op's name stack; its last element is the primitive.
    location: the op's MLIR location, whose Python call stack names the
      classes when the name stack names no module; ``""`` for none.

  Returns:
    The ``/``-joined path (linen: the root class, then the module names;
    NNX under the audit: the attribute path) and whether the op belongs to a
    transposed (backward) computation.
  """
  segments: list[str] = []
  transforms: set[str] = set()
  last_wrappers: list[str] = []
  for raw in elements(name)[:-1]:
    seg, wrappers = raw, []
    while match := _WRAPPED.fullmatch(seg):
      wrappers.append(match.group(1))
      seg = match.group(2)
    transforms.update(wrappers)
    if seg.startswith(ABSOLUTE):
      segments = [s for s in seg[len(ABSOLUTE) :].split("/") if s]
      last_wrappers = wrappers
      continue
    if "jit" in wrappers or "pjit" in wrappers or "->" in seg or "," in seg or "." in seg:
      # A function name, an einsum spec, or a library's own scope (Equinox scopes each
      # layer's call `eqx.nn.<class>`; mpx.eqx scopes it by its path), not a module.
      continue
    if seg and seg not in _INTERNAL_SCOPES and not _SCOPES.fullmatch(seg):
      # A rematerialised body replays the name stack it was traced under inside
      # its transpose: 'transpose(jvp(Model))/jvp(Model)/checkpoint/...'. The
      # replay carries the inner wrappers of the scope it repeats; a module
      # nested in a namesake (`Model/Model`) carries none and is kept.
      reentered = wrappers and wrappers == last_wrappers[len(last_wrappers) - len(wrappers) :]
      if not (segments and segments[-1] == seg and reentered):
        segments.extend(s for s in seg.split("/") if s)
      last_wrappers = wrappers
  if not segments:
    # No module names on the name stack (NNX outside the audit, plain functions).
    segments = _from_frames(location)
  return "/".join(segments), "transpose" in transforms


def layer_of(path: str) -> str:
  """The layer a module path names: without a method suffix (``wte.attend`` -> ``wte``)."""
  parts = path.split("/")
  if parts and "." in parts[-1]:
    parts[-1] = parts[-1].split(".", 1)[0]
  return "/".join(parts)


def scopes(trees: Any) -> contextlib.AbstractContextManager[None]:
  """Puts the layer paths of the NNX modules in ``trees`` on the name stack while tracing.

  Args:
    trees: the arguments of the function about to be traced.

  Returns:
    A context manager: :func:`mpx._src.audit.nnx_scopes.layer_scopes`, or a
    no-op when Flax NNX was never imported (so no NNX module can be there).
  """
  if "flax.nnx" not in sys.modules:
    return contextlib.nullcontext()
  from mpx._src.audit import nnx_scopes  # imports Flax: only when NNX is in use

  return nnx_scopes.layer_scopes(trees)
