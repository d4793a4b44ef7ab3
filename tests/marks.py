"""Which configurations of a property the README's test command runs, and which CI adds.

The README's test command stays within five minutes on two cores: a property
tested over many configurations keeps its cheapest telling representatives
there, and the others are marked ``slow``, which CI runs after it
(``pytest -m slow``). Every assertion runs in CI either way.
"""

from collections.abc import Iterable
from typing import Any

import pytest


def all_but(values: Iterable[Any], *fast: Any) -> list[Any]:
  """``values`` as pytest parameters, each but those in ``fast`` marked ``slow``.

  Args:
    values: the parameter values of a ``pytest.mark.parametrize``; a tuple is
      the values of several argument names, as in ``parametrize``.
    *fast: the values the README's test command runs.

  Returns:
    The values, the slow ones wrapped in ``pytest.param(..., marks=pytest.mark.slow)``.
  """
  values = list(values)
  missing = [v for v in fast if v not in values]
  if missing:
    raise ValueError(f"all_but: {missing} are not among {values}")
  slow = pytest.mark.slow
  return [
    v if v in fast else pytest.param(*v if isinstance(v, tuple) else (v,), marks=slow)
    for v in values
  ]
