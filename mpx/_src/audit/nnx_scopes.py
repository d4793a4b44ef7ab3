"""NNX attribute paths on the name stack while the audit traces a step.

NNX pushes no names on JAX's name stack, so the ops of two blocks of the same
class cannot be told apart by name. While :func:`layer_scopes` is open, every
NNX module reachable from the traced arguments runs its methods under a
:func:`jax.named_scope` holding its attribute path (``~blocks/0/attn/query``,
``~wte.attend`` for a method other than ``__call__``), which
:func:`mpx._src.audit.layer_paths.module_path` reads. NNX has no method
interceptor: each module's class is swapped for a cached same-named subclass
whose methods open the scope, and the path is a static attribute of the
module, so both survive the pytree flattening of ``jax.jit`` and
``nnx.split`` / ``nnx.merge`` inside the step. Both are undone when the block
closes; the user's modules are left as they were.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from mpx._src.audit import layer_paths

_PATH = "_mpx_layer_path"
_CLASSES: dict[type, type] = {}


def _scoped(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
  @functools.wraps(function)
  def method(self: Any, *args: Any, **kwargs: Any) -> Any:
    path = vars(self).get(_PATH)
    if not path:  # the root, or a module the audit did not reach
      return function(self, *args, **kwargs)
    label = path if name == "__call__" else f"{path}.{name}"
    with jax.named_scope(layer_paths.ABSOLUTE + label):
      return function(self, *args, **kwargs)

  return method


def _subclass(cls: type) -> type:
  """``cls``'s same-named subclass whose ``__call__`` and public methods open the path scope."""
  if cls not in _CLASSES:
    base = set(nnx.Module.__mro__)
    names = {
      name
      for klass in cls.__mro__
      if klass not in base and issubclass(klass, nnx.Module)
      for name, value in vars(klass).items()
      if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_"))
    }
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    for name in names:
      function = getattr(cls, name)
      if inspect.isfunction(function):
        namespace[name] = _scoped(name, function)
    _CLASSES[cls] = type(cls.__name__, (cls,), namespace)
  return _CLASSES[cls]


@contextlib.contextmanager
def layer_scopes(trees: Any) -> Iterator[None]:
  """Gives the NNX modules in ``trees`` their attribute path on the name stack until the block ends.

  Args:
    trees: the traced function's arguments; each NNX object found in them
      (a model, an ``nnx.Optimizer``) is a root, and its modules' paths are
      their graph paths from it.

  Yields:
    Nothing; the modules are restored (class and attributes) on exit.
  """
  marked: list[tuple[nnx.Module, type]] = []
  try:
    roots = jax.tree.leaves(trees, is_leaf=lambda x: isinstance(x, nnx.Pytree))
    for root in roots:
      if not isinstance(root, nnx.Pytree):
        continue
      for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module) and _PATH not in vars(node):
          marked.append((node, type(node)))
          object.__setattr__(node, "__class__", _subclass(type(node)))
          object.__setattr__(node, _PATH, "/".join(str(p) for p in path))
    yield
  finally:
    for node, cls in marked:
      object.__setattr__(node, "__class__", cls)
      vars(node).pop(_PATH, None)
