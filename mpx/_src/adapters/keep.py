"""Keep rules: which layers of a Flax model run under a policy of their own.

Plain data, with no Flax import, so that ``mpx.KeepRules`` comes with
``import mpx``. The linen and NNX adapters interpret the rules through
``mpx._src.adapters.layer_policy``, each with its own normalisation classes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from mpx._src import errors
from mpx._src import policy as policy_lib

PolicyLike = Any


def _pairs(rules: Mapping[Any, PolicyLike] | Iterable[tuple[Any, PolicyLike]]) -> tuple:
  items = rules.items() if isinstance(rules, Mapping) else rules
  return tuple((key, policy_lib.get_policy(value)) for key, value in items)


@dataclasses.dataclass(frozen=True)
class KeepRules:
  """Which layers of a Flax or Equinox model run under a policy of their own instead of the model's.

  The paper (section 3) keeps three things out of half precision: the master
  weights, the reductions (normalisation statistics, softmax) and the
  accumulation of products. :func:`mpx.linen.apply_policy`,
  :func:`mpx.nnx.apply_policy` and :func:`mpx.eqx.apply_policy` give every
  layer the model's policy except where these rules give it another one:

  * **normalisation layers**: with ``norms_in_float32`` (the default), the
    ``BatchNorm``, ``LayerNorm``, ``RMSNorm`` and ``GroupNorm`` of the API
    in use (:data:`mpx.linen.DEFAULT_KEEP_CLASSES`,
    :data:`mpx.nnx.DEFAULT_KEEP_CLASSES`, :data:`mpx.eqx.DEFAULT_KEEP_CLASSES`)
    keep float32 params, statistics and compute;
  * by **class**: a layer matches by ``isinstance``; a class rule also wins
    over the normalisation default, so ``with_class(nn.LayerNorm,
    "mixed_bfloat16")`` lets layer norms follow a bfloat16 policy;
  * by **path**: a regular expression searched (``re.search``) in the layer's
    ``/``-joined module path: linen's module names (``"Decoder_0/head"``), or
    the attribute path of NNX and Equinox (``"blocks/0/mlp"``); anchor it with ``^...$`` to
    name one exact path. A path rule that matches no layer raises a
    :class:`mpx.PrecisionWarning` that lists the model's paths;
  * by **instance** (NNX, Equinox): one module object, matched by identity. Linen
    clones its modules on every ``init`` / ``apply``, so a linen module's
    identity does not survive; pin it by path instead.

  A rule covers the matched layer and everything below it, so one rule gives a
  whole subtree its own policy (an embedding in float32, say). Among rules of
  one kind the last matching one wins; an instance rule beats a path rule,
  which beats a class rule, which beats the normalisation default.

  Where a layer's compute dtype differs from its parent's, its floating inputs
  are cast to its compute dtype and its floating outputs back to the parent's
  compute dtype, so a float32 norm hands half-precision activations to the
  next matmul instead of making it run in float32 (with ``lean_norms``, the
  Flax normalisation layers do the same inside one kernel whose backward pass
  saves the half-precision input only).

  Attributes:
    classes: ``(layer class, policy)`` pairs; a layer matches by ``isinstance``.
    paths: ``(regular expression, policy)`` pairs, matched against module
      paths.
    instances: ``(module object, policy)`` pairs, matched by identity (NNX).
    norms_in_float32: pin the Flax normalisation layers to float32 (see
      above).
    softmax_in_float32: give Flax attention layers left at Flax's default
      attention function :func:`mpx.dot_product_attention` instead, whose
      softmax runs in float32 between half-precision matmuls.
    lean_norms: compute a ``LayerNorm``, ``RMSNorm``, ``BatchNorm`` or ``GroupNorm`` that
      runs in float32 inside a half-precision parent with mpx's kernels
      instead of Flax's code: the same float32 arithmetic on the layer's own
      params and statistics, but the backward pass keeps only the
      half-precision input and the float32 per-row statistics, where Flax's
      code under autodiff keeps three to four float32 copies of the
      activations. Exact Flax classes only (a subclass may change the
      computation), and only calls without a ``mask`` or a device
      ``axis_name``; other layers and calls run Flax's code between casts.

  The three rule fields accept a mapping or an iterable of pairs; each policy
  is parsed with :func:`mpx.get_policy` and the pairs are stored as tuples.

  Raises:
    PolicyError: a class rule names something that is not a class, a path rule
      is not a valid regular expression, or a policy cannot be parsed.

  Example:
    >>> import flax.linen as nn, mpx
    >>> rules = mpx.KeepRules().with_class(nn.Embed, "float32").with_path("head$", "float32")
    >>> [pattern for pattern, _ in rules.paths]
    ['head$']
  """

  classes: Any = ()
  paths: Any = ()
  instances: Any = ()
  norms_in_float32: bool = True
  softmax_in_float32: bool = True
  lean_norms: bool = True

  def __post_init__(self) -> None:
    object.__setattr__(self, "classes", _pairs(self.classes))
    object.__setattr__(self, "paths", _pairs(self.paths))
    object.__setattr__(self, "instances", _pairs(self.instances))
    for cls, _ in self.classes:
      if not isinstance(cls, type):
        raise errors.PolicyError(
          f"A class rule needs a layer class, got {cls!r}; write e.g. "
          "KeepRules().with_class(nn.Embed, 'float32')."
        )
    for pattern, _ in self.paths:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise errors.PolicyError(
          f"The path rule {pattern!r} is not a valid regular expression ({e}). Write a "
          r"pattern over '/'-joined module paths such as r'^Decoder_0/head$'."
        ) from None

  def with_class(self, cls: type, policy: PolicyLike) -> KeepRules:
    """Returns these rules with ``cls`` pinned to ``policy``.

    Args:
      cls: a layer class, e.g. ``nn.Embed``; an earlier rule for the same class
        is replaced.
      policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.

    Returns:
      New rules; ``self`` is unchanged.
    """
    kept = tuple((c, p) for c, p in self.classes if c is not cls)
    return dataclasses.replace(self, classes=(*kept, (cls, policy)))

  def with_path(self, pattern: str, policy: PolicyLike) -> KeepRules:
    """Returns these rules with the layers whose path matches ``pattern`` pinned to ``policy``.

    Args:
      pattern: a regular expression searched in ``/``-joined module paths; it
        wins over the path rules added before it.
      policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.

    Returns:
      New rules; ``self`` is unchanged.
    """
    return dataclasses.replace(self, paths=(*self.paths, (pattern, policy)))

  def with_instance(self, module: Any, policy: PolicyLike) -> KeepRules:
    """Returns these rules with one NNX module object pinned to ``policy``.

    Args:
      module: the module object (NNX; linen modules are pinned by path).
      policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.

    Returns:
      New rules; ``self`` is unchanged.
    """
    return dataclasses.replace(self, instances=(*self.instances, (module, policy)))
