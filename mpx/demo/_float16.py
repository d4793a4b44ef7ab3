"""What float16 keeps and loses of a set of float32 values.

IEEE float16 has 5 exponent and 10 fraction bits: normal magnitudes span
``[2**-14, 65504]``, subnormals ``[2**-24, 2**-14)`` with an absolute spacing
of ``2**-24``. Rounding to nearest (ties to even) sends a magnitude of at most
``2**-25`` to zero (``2**-25`` itself is a tie with ``2**-24``, whose last bit
is odd) and a magnitude of at least ``65520`` to infinity. The paper's section
3.2 (figure 3) reads "below ``2**-24``" as lost; these helpers use the exact
rule. Computations run on the host in float64, where ``value * scale`` is
exact for float32 values and scales.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SMALLEST_SUBNORMAL_LOG2 = -24
"""``log2`` of float16's smallest positive value, ``2**-24``."""
SMALLEST_NORMAL_LOG2 = -14
"""``log2`` of float16's smallest normal value, ``2**-14``."""
LARGEST = 65504.0
"""float16's largest finite value."""
_FLUSH_AT_OR_BELOW = 2.0**-25  # rounds to 0 (ties to even)
_OVERFLOW_AT_OR_ABOVE = 65520.0  # rounds to inf (ties to even)


def _scaled_magnitudes(values: Any, scale: float) -> np.ndarray:
  return np.abs(np.asarray(values, dtype=np.float64).ravel()) * float(scale)


def flushed_fraction(values: Any, scale: float = 1.0) -> float:
  """Fraction of the nonzero values that round to zero in float16 once multiplied by ``scale``.

  A value ``x`` flushes when ``|x * scale| <= 2**-25``: the nearest float16
  is then ``0`` (at exactly ``2**-25`` by the ties-to-even rule). Values that
  are zero to begin with are not counted, neither above nor below the line.

  Args:
    values: float32 (or wider) values, any shape, e.g. activation gradients.
    scale: the loss scale the values are multiplied by before the cast.

  Returns:
    The fraction, in ``[0, 1]``; ``0.0`` when no value is nonzero.

  Example:
    >>> import numpy as np
    >>> from mpx.demo import flushed_fraction
    >>> flushed_fraction(np.array([2.0**-24, 2.0**-25, 0.0, 1e-3], np.float32))
    0.3333333333333333
    >>> flushed_fraction(np.array([2.0**-25], np.float32), scale=2.0)
    0.0
  """
  magnitudes = _scaled_magnitudes(values, scale)
  nonzero = magnitudes > 0
  count = int(nonzero.sum())
  if count == 0:
    return 0.0
  return float((nonzero & (magnitudes <= _FLUSH_AT_OR_BELOW)).sum() / count)


def overflow_fraction(values: Any, scale: float = 1.0) -> float:
  """Fraction of the nonzero values that round to infinity in float16 once multiplied by ``scale``.

  Args:
    values: float32 (or wider) values, any shape.
    scale: the loss scale the values are multiplied by before the cast.

  Returns:
    The fraction of nonzero values with ``|x * scale| >= 65520``; ``0.0`` when
    no value is nonzero.
  """
  magnitudes = _scaled_magnitudes(values, scale)
  count = int((magnitudes > 0).sum())
  return float((magnitudes >= _OVERFLOW_AT_OR_ABOVE).sum() / count) if count else 0.0


def log2_histogram(
  values: Any, *, low: int = -40, high: int = 18, scale: float = 1.0
) -> dict[str, Any]:
  """Counts values by binary exponent, as in the paper's figure 3.

  Bin ``e`` holds the nonzero values with ``2**e <= |x * scale| < 2**(e + 1)``;
  magnitudes outside ``[2**low, 2**high)`` are counted in ``below`` and
  ``above``.

  Args:
    values: the values, any shape.
    low: the smallest exponent with a bin of its own.
    high: one past the largest exponent with a bin of its own.
    scale: the factor applied before binning.

  Returns:
    A dict with ``exponents`` (list of ints), ``counts`` (per exponent),
    ``zeros``, ``below``, ``above`` and ``total`` (all ints).
  """
  magnitudes = _scaled_magnitudes(values, scale)
  nonzero = magnitudes[magnitudes > 0]
  exponents = np.floor(np.log2(nonzero)).astype(np.int64)
  in_range = (exponents >= low) & (exponents < high)
  counts = np.bincount(exponents[in_range] - low, minlength=high - low)
  return {
    "exponents": list(range(low, high)),
    "counts": [int(c) for c in counts],
    "zeros": int(magnitudes.size - nonzero.size),
    "below": int((exponents < low).sum()),
    "above": int((exponents >= high).sum()),
    "total": int(magnitudes.size),
  }
