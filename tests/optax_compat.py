"""optax under the test suite's strict dtype promotion.

optax's adam bias correction (and ``MultiSteps``, ``ema``) raise a Python float
to an int32 count, which strict promotion rejects. Tests wrap such optax pieces
with :func:`standard_promotion`; mpx's own code always runs strict.
"""

import jax
import optax


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Returns ``tx`` with its ``update`` run under standard dtype promotion."""

  def update(updates, state, params=None, **extra_args):
    with jax.numpy_dtype_promotion("standard"):
      return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update)
