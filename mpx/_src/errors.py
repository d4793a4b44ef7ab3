"""The exceptions and warnings mpx raises.

Every error says what was passed, what was expected and what to write instead;
errors about a tree name the leaf path (``params/Dense_0/kernel``). Each class
also derives from the built-in exception a caller would naturally catch
(``ValueError``, ``TypeError``...), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class MpxError(Exception):
  """Base class of every exception raised by mpx."""


class PolicyError(MpxError, ValueError):
  """A precision policy or dtype name could not be understood."""


class ConfigError(MpxError, ValueError):
  """A hyperparameter is out of its valid range (e.g. a non-positive scale)."""


class TreeStructureError(MpxError, ValueError):
  """Two trees that must match (e.g. gradients and params) do not."""


class LeafTypeError(MpxError, TypeError):
  """A tree leaf has a type or dtype the operation cannot handle."""


class StateError(MpxError, ValueError):
  """An optimizer or model state does not fit the policy it is used with."""


class LossScaleDivergedError(MpxError, FloatingPointError):
  """Gradients overflow even though the loss scale is already at its floor."""


class PlanError(MpxError, RuntimeError):
  """A planned model's compiled program does not run a layer in the format its plan chose."""


class PrecisionWarning(UserWarning):
  """A configuration that is known to lose precision (paper section 3.1)."""
