"""Sharded training: where the optimizer state lives, and collectives in the policy's dtypes.

Under ``jax.jit`` with sharded params, XLA inserts every collective and mpx
needs one helper, :func:`state_shardings`, to place the optimizer state
like the params. Under ``jax.shard_map`` the collectives are written out:
:func:`all_reduce_gradients` averages data-parallel gradients in a narrow
dtype, and :func:`all_gather_params` gathers fully sharded (FSDP) params in
the compute dtype and reduce-scatters their gradients in a chosen one.
``docs/guide/multihost.md`` shows each in a train step. Importing this
module does not import Flax.
"""

from mpx._src.parallel import all_gather_params as all_gather_params
from mpx._src.parallel import all_reduce_gradients as all_reduce_gradients
from mpx._src.parallel import state_shardings as state_shardings

__all__ = (
  "all_gather_params",
  "all_reduce_gradients",
  "state_shardings",
)
