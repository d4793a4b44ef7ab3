"""Giving an NNX module a ``__call__`` of mpx's: a swap to a cached same-named subclass.

NNX has no method interceptor. To run code around a module's calls (the
policy's boundary casts, the diagnostics' taps), its class is swapped for a
subclass with the same name, module and qualified name whose ``__call__``
wraps the original one. A mixin base would change the instance layout and
forbid the swap, so the subclass adds no base; it is made once per class and
kept. The subclass is part of an NNX graph definition, so ``nnx.split`` /
``nnx.merge`` and the NNX transforms carry it along.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``(module, call, args, kwargs) -> result``, where ``call`` is the original bound ``__call__``.
Wrapper = Callable[[Any, Callable[..., Any], tuple, dict], Any]


class CallSwap:
  """One kind of swapped class: its ``__call__`` wrapper and the subclasses made so far.

  Args:
    name: what the wrapper does (``"casting"``, ``"tapped"``); the subclasses
      carry the attribute ``_mpx_<name> = True``.
    wrapper: runs each call of a swapped module.
    rebuild: a module-level function ``(cls, *args) -> instance`` that calls
      :meth:`new`; with it the instances pickle (pickle finds a class by its
      name, which leads to the original class, so the subclass is rebuilt from
      it on loading). ``None``: instances pickle as the original class's.
  """

  def __init__(
    self, name: str, wrapper: Wrapper, *, rebuild: Callable[..., Any] | None = None
  ) -> None:
    self._marker = f"_mpx_{name}"
    self._wrapper = wrapper
    self._rebuild = rebuild
    self._classes: dict[type, type] = {}

  def is_swapped(self, cls: type) -> bool:
    """Whether ``cls`` is (or derives from) one of this kind's subclasses."""
    return getattr(cls, self._marker, False)

  def original(self, cls: type) -> type:
    """The class a swapped class was made from (``cls`` itself if not swapped)."""
    return cls.__mro__[1] if self.is_swapped(cls) else cls

  def subclass(self, cls: type) -> type:
    """Returns the cached same-named subclass of ``cls`` whose ``__call__`` is wrapped."""
    if self.is_swapped(cls):
      return cls
    if cls not in self._classes:
      self._classes[cls] = self._make(cls)
    return self._classes[cls]

  def swap(self, module: Any) -> None:
    """Swaps ``module``'s class for its wrapped subclass, in place."""
    object.__setattr__(module, "__class__", self.subclass(type(module)))

  def new(self, cls: type, *args: Any) -> Any:
    """An uninitialised instance of ``cls``'s subclass (for unpickling, see ``rebuild``)."""
    subclass = self.subclass(cls)
    return subclass.__new__(subclass, *args)

  def _make(self, cls: type) -> type:
    wrapper, rebuild = self._wrapper, self._rebuild

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
      return wrapper(self, super(subclass, self).__call__, args, kwargs)  # type: ignore[misc]

    namespace: dict[str, Any] = {
      "__module__": cls.__module__,
      "__qualname__": cls.__qualname__,
      "__call__": call,
      self._marker: True,
    }
    if rebuild is not None:

      def reduce_ex(self: Any, protocol: Any) -> Any:
        _, (_, *new_args), *rest = super(subclass, self).__reduce_ex__(protocol)
        return (rebuild, (cls, *new_args), *rest)

      namespace["__reduce_ex__"] = reduce_ex
    subclass = type(cls.__name__, (cls,), namespace)
    return subclass
