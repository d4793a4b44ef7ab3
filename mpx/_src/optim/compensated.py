"""Half-precision params without float32 masters (layout (c)): what the two wrappers share.

Two optax wrappers keep the small updates of bfloat16 (or float16) params
that plain rounding loses, without a float32 copy of the weights (Zamirai et
al., *Revisiting BFloat16 Training*, 2020):

* ``mpx.with_kahan_summation`` (``kahan.py``) carries each weight's rounding
  error in a buffer of the param dtype and adds it back on the next step
  (Kahan 1965);
* ``mpx.with_stochastic_rounding`` (``stochastic_rounding.py``) rounds each new
  weight up or down at random, with probabilities that make the rounding
  unbiased (Gupta et al. 2015).

Both compensate exactly the half-precision params, run the inner optimizer on
float32 gradients and float32 weights (so its moments are float32 unless
``mpx.with_state_dtype`` stores them narrower), and return updates in the
param dtype that ``optax.apply_updates`` turns into the new params. Their
states hold a tree shaped like the params with a buffer (or key) at every half
param and ``None`` elsewhere; this module checks such trees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib

F32 = np.dtype(np.float32)
FIX = (
  "Restore the optimizer state together with the params it was saved with, using "
  "jax.eval_shape(tx.init, params) as the restore target, or rebuild it with tx.init(params)."
)


def is_none(x: Any) -> bool:
  return x is None


def is_compensated(leaf: Any) -> bool:
  """Whether a param gets compensated updates: half-precision floating params only."""
  return tree_lib.is_floating_array(leaf) and dtypes_lib.is_half(leaf.dtype)


def no_masters(tree: Any) -> Any:
  """``None`` at every leaf of a params-shaped tree: the ``master_params`` of layout (c)."""
  return jax.tree.map(lambda _: None, tree, is_leaf=is_none)


def check_buffers(
  tree: Any,
  params: optax.Params,
  *,
  what: str,
  fits: Callable[[Any, Any], bool],
  want: Callable[[Any], str],
) -> None:
  """Raises if ``tree`` does not hold a fitting buffer for exactly the half params.

  Runs on shapes and dtypes only, so it costs nothing inside ``jit``.

  Args:
    tree: the params-shaped tree of a compensated state (buffers or keys).
    params: the params the state is used with.
    what: how one buffer is called in the message, e.g. ``"compensation"``.
    fits: whether a buffer fits its param, ``fits(buffer, param)``.
    want: what a buffer must be, for the message, ``want(param)``.

  Raises:
    StateError: naming the first leaf whose buffer is missing, superfluous or
      does not fit, and how to rebuild the state.
  """
  try:
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]
    param_leaves = jax.tree.structure(tree, is_leaf=is_none).flatten_up_to(params)
  except (ValueError, TypeError) as e:
    raise errors.StateError(
      f"The {what} tree in the optimizer state does not have the tree structure of the "
      f"params ({e}). {FIX}"
    ) from None
  for (path, leaf), param in zip(pairs, param_leaves, strict=True):
    where = f"params leaf {tree_lib.path_str(path)!r}"
    if leaf is None:
      if is_compensated(param):
        raise errors.StateError(
          f"{where} has dtype {param.dtype} but the optimizer state holds no {what} for it, "
          "so its small updates would be rounded away (were the params restored under "
          f"another policy?). {FIX}"
        )
      continue
    if not is_compensated(param):
      kind = getattr(param, "dtype", type(param).__name__)
      raise errors.StateError(
        f"{where} is {kind} but the optimizer state holds a {what} for it; only "
        f"half-precision params have one (were the params restored under another policy?). "
        f"{FIX}"
      )
    if not (tree_lib.is_array(leaf) and fits(leaf, param)):
      got = f"{leaf.dtype}{list(leaf.shape)}" if tree_lib.is_array(leaf) else type(leaf).__name__
      raise errors.StateError(
        f"{where} is {param.dtype}{list(param.shape)} but its {what} is {got}; it must be "
        f"{want(param)}. {FIX}"
      )


def require_params(params: optax.Params | None, name: str) -> optax.Params:
  """Returns ``params``, or raises the error of an ``update`` called without them."""
  if params is None:
    raise errors.ConfigError(
      f"mpx.{name} needs the current params to compensate their updates, but update was "
      "called without them. Call tx.update(grads, opt_state, params)."
    )
  return params


def float32_weights(params: optax.Params, buffers: Any) -> optax.Params:
  """The params, float32 where ``buffers`` has a buffer: the weights the inner optimizer sees."""
  return jax.tree.map(
    lambda b, p: p if b is None else p.astype(F32), buffers, params, is_leaf=is_none
  )


def inner_step(
  inner: optax.GradientTransformationExtraArgs,
  grads: optax.Updates,
  inner_state: optax.OptState,
  weights: optax.Params,
  extra_args: dict[str, Any],
) -> tuple[optax.Updates, optax.OptState]:
  """Runs ``inner`` on gradients cast to the dtypes of its float32 ``weights``."""
  grads = jax.tree.map(
    lambda g, w: g.astype(w.dtype) if tree_lib.is_floating_array(g) and g.dtype != w.dtype else g,
    grads,
    weights,
  )
  return inner.update(grads, inner_state, weights, **extra_args)
