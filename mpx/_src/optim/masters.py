"""Float32 master weights for half-precision params, as an optax wrapper (paper section 3.1)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib
from mpx._src.optim import base
from mpx._src.optim import remainder as remainder_lib


class MasterParamsState(NamedTuple):
  """State of :func:`with_master_params`.

  Attributes:
    master_params: a tree shaped like the params holding a ``master_dtype``
      copy of every floating param narrower than ``master_dtype``, and
      ``None`` for every other leaf (float32 params, integer params), which
      are not copied. ``None`` is an empty subtree, so orbax and
      ``jax.tree.map`` round trips keep it.
    inner_state: the state of the inner transformation, whose moments have
      the master dtype.
  """

  master_params: optax.Params
  inner_state: optax.OptState

  wide_updates = True
  """Its updates have the masters' dtype (``base.exact_update``): loss scaling must not narrow
  them."""

  def check(self, params: optax.Params, master_dtype: np.dtype | None) -> None:
    """Raises if the masters do not fit ``params`` (see :func:`check_masters`)."""
    check_masters(self.master_params, params, master_dtype)

  def weights(self, params: optax.Params) -> optax.Params:
    """The masters, and every other param converted to at least float32."""
    return base.weights_of(self.master_params, params, compensation=False)


base.HalfParamsState.register(MasterParamsState)


def _check_master_dtype(params: optax.Params, master_dtype: np.dtype) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not tree_lib.is_floating_array(leaf):
      continue
    if not dtypes_lib.can_hold(master_dtype, leaf.dtype):
      raise errors.ConfigError(
        f"params leaf {tree_lib.path_str(path)!r} has dtype {leaf.dtype}, which "
        f"master_dtype={master_dtype} cannot hold exactly: a master must be at least as "
        "wide as its param. Pass master_dtype=jnp.float32 (the default), or "
        f"master_dtype={leaf.dtype} when params wider than float32 are intended."
      )


def _has_master(leaf: Any, master_dtype: np.dtype) -> bool:
  return tree_lib.is_floating_array(leaf) and leaf.dtype != master_dtype


def check_masters(
  master_params: optax.Params, params: optax.Params, master_dtype: np.dtype | None = None
) -> None:
  """Raises if ``master_params`` cannot be the masters of ``params``.

  Every floating param narrower than ``master_dtype`` (every half-precision
  param when ``master_dtype`` is not known) needs a master with the param's
  shape and a wider dtype; other params have none. Runs on shapes and dtypes
  only, so it costs nothing inside ``jit``.

  Args:
    master_params: the ``master_params`` field of a :class:`MasterParamsState`.
    params: the params the state is used with.
    master_dtype: the dtype every master must have, if known.

  Raises:
    StateError: naming the first leaf whose master is missing, superfluous, or
      of the wrong shape or dtype, and how to rebuild a consistent state.
  """
  fix = base.FIX
  mismatch = "The master params in the optimizer state do not have"
  for path, master, param in base.pair_with_params(master_params, params, mismatch):
    where = f"params leaf {tree_lib.path_str(path)!r}"
    if master_dtype is None:
      wants_master = tree_lib.is_floating_array(param) and dtypes_lib.is_half(param.dtype)
    else:
      wants_master = _has_master(param, master_dtype)
    if master is None:
      if wants_master:
        raise errors.StateError(
          f"{where} has dtype {param.dtype} but the optimizer state holds no float32 master "
          f"for it, so its small updates would be rounded away (paper section 3.1). {fix}"
        )
      continue
    if not tree_lib.is_floating_array(param) or not tree_lib.is_floating_array(master):
      raise errors.StateError(
        f"{where} is {getattr(param, 'dtype', type(param).__name__)} and its master is "
        f"{getattr(master, 'dtype', type(master).__name__)}; both must be floating arrays. {fix}"
      )
    wrong_dtype = master.dtype == param.dtype or (
      master_dtype is not None and master.dtype != master_dtype
    )
    if master.shape != param.shape or wrong_dtype:
      raise errors.StateError(
        f"{where} is {param.dtype}{list(param.shape)} but its master is "
        f"{master.dtype}{list(master.shape)}; a master has the param's shape and a wider "
        f"dtype{'' if master_dtype is None else f' ({master_dtype})'}. {fix}"
      )
    if not dtypes_lib.can_hold(master.dtype, param.dtype):
      raise errors.StateError(
        f"{where} is {param.dtype} but its master is {master.dtype}, which cannot hold it "
        f"(were the params restored under a different policy?). {fix}"
      )


def with_master_params(
  inner: optax.GradientTransformation,
  *,
  master_dtype: dtypes_lib.DTypeLike = jnp.float32,
  remainder: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Keeps float32 master copies of half-precision params (paper section 3.1).

  A float16 weight of 1.0 does not move under an update smaller than half its
  ulp (``2**-11``), and a bfloat16 one loses everything below ``2**-8``, so
  plain optax on half params stalls. This wrapper keeps the weights that the
  optimizer updates in ``master_dtype``:

  * ``init(params)`` stores a ``master_dtype`` copy of every floating param
    narrower than ``master_dtype``; params already in ``master_dtype`` and
    integer params get no copy (``None`` in the state), so float32 params cost
    nothing;
  * ``update(grads, state, params)`` casts the gradients to ``master_dtype``,
    runs ``inner`` against the masters (so every moment it creates has
    ``master_dtype``), adds the inner updates to the masters in
    ``master_dtype``, and returns for each copied leaf the ``master_dtype``
    update ``cast(new_master) - param``, computed in ``master_dtype``. Params
    without a master get the inner updates unchanged.

  Each param then becomes ``param + update``, added in ``master_dtype`` and
  rounded to the param's dtype: what ``optax.apply_updates`` computes under
  JAX's default dtype promotion (and so ``nnx.Optimizer.update`` and Flax's
  ``TrainState.apply_gradients``, which call it), and what
  :func:`mpx.apply_updates` computes under any promotion. The two give the
  same params bit for bit, and that sum is ``cast(new_master)``, also for a
  weight that crosses zero or shrinks or grows by any factor in one step (the
  cases a half-precision update misses). The float32 difference of two
  half-precision numbers is exact unless their exponents lie far apart, and a
  new master one float32 addition away from the old one lies on float32's
  grid at the old param, which ``param + u`` reaches. The one corner it does
  not: a param that rounded up to a power of two (its master lies just
  below it) whose master then crosses zero to a value more than ``2**16``
  (bfloat16) or ``2**13`` (float16) times smaller and odd in the master's
  last float32 bit, which lies below the grid at the param; the param then
  takes the nearest value it can reach. Besides, bfloat16 shares float32's
  range: its subnormals are flushed by XLA's float32 arithmetic, and a move
  between values near its max is clamped to stay finite. A miss never
  accumulates: the masters stay exact, and the next update moves the param
  it is given to the cast of the next master. Under strict dtype promotion
  ``optax.apply_updates`` rejects the float32 updates of half params (a
  ``TypePromotionError``); call :func:`mpx.apply_updates`.

  Put loss scaling outside this wrapper (``mpx.mixed_precision`` does), so
  that a skipped step leaves the masters untouched.

  **Remainder masters** (``remainder=True``, bfloat16 params): the state keeps
  no float32 copy but an int16 *remainder* per bfloat16 param
  (:class:`mpx.RemainderMastersState`), and the float32 master is
  ``(param_bits << 16) + remainder`` in 32-bit integer arithmetic, bit for
  bit: 4 bytes per parameter for param and master instead of 6. Each step
  rebuilds the masters, runs ``inner`` on them in float32, adds its updates in
  float32, and sets each param to the bfloat16 number nearest to its new
  master (halfway cases away from zero, the one rounding under which a 16-bit
  remainder can recover every float32 master; ``astype`` rounds them to even,
  so the params differ from layout (b)'s only for a master whose low 16 bits
  are exactly ``0x8000`` and whose lower neighbour is even). The updates are
  float32 too, and the remainder is taken relative to ``param + update`` as
  both apply calls compute it. The master is exact whenever that sum lands on
  the new param, which it does but in the corner above; there the weight
  keeps the float32 value nearest to its master that its param can reach. Float32 params get
  no remainder; float16 params are an error.
  Wrap it with ``mpx.mixed_precision(..., master_dtype=None)``, as the layout
  (c) wrappers, and store the moments in 8 bits for about 6 bytes per
  parameter: ``mpx.with_master_params(mpx.with_state_dtype(optax.adamw(lr),
  state_dtype="int8"), remainder=True)``.

  Args:
    inner: the optimizer to run in ``master_dtype``, e.g. ``optax.adamw(3e-4)``.
    master_dtype: the dtype of masters, gradients and moments; at least as
      wide as every floating param. Float32 with ``remainder=True``.
    remainder: store each bfloat16 param's master as an int16 remainder beside
      the param instead of a float32 copy.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterParamsState` (a :class:`mpx.RemainderMastersState` with
    ``remainder=True``) and whose ``update`` requires ``params`` and forwards
    extra arguments to ``inner``.

  Raises:
    PolicyError: ``master_dtype`` is not a floating dtype mpx supports.
    ConfigError: at ``init``, a floating param is wider than ``master_dtype``
      (with ``remainder=True``: a floating param is float16, or
      ``master_dtype`` is not float32); at ``update``, ``params`` is missing.
    StateError: at ``update``, the state's masters do not fit the params.

  Example:
    >>> import jax.numpy as jnp, optax, mpx
    >>> params = {"w": jnp.ones(2, jnp.float16)}
    >>> tx = mpx.with_master_params(optax.sgd(1.0))
    >>> state = tx.init(params)
    >>> for _ in range(10):
    ...   grads = {"w": jnp.full(2, -1e-4, jnp.float16)}
    ...   updates, state = tx.update(grads, state, params)
    ...   params = mpx.apply_updates(params, updates)
    >>> params["w"]  # plain optax.sgd would leave w at 1.0
    Array([1.001, 1.001], dtype=float16)
    >>> state.master_params["w"].dtype
    dtype('float32')
    >>> tx = mpx.with_master_params(optax.sgd(1.0), remainder=True)
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(10):
    ...   grads = {"w": jnp.full(2, -1e-4, jnp.bfloat16)}
    ...   updates, state = tx.update(grads, state, params)
    ...   params = mpx.apply_updates(params, updates)
    >>> params["w"], state.remainders["w"].dtype
    (Array([1, 1], dtype=bfloat16), dtype('int16'))
    >>> mpx.get_master_params(state, params)["w"]  # the float32 master, 1 + 10 * bf16(1e-4)
    Array([1.0010014, 1.0010014], dtype=float32)
  """
  master_dtype = dtypes_lib.parse_dtype(master_dtype)
  if remainder:
    if master_dtype != dtypes_lib.F32:
      raise errors.ConfigError(
        f"mpx.with_master_params(..., remainder=True, master_dtype={master_dtype}): a "
        "remainder beside a bfloat16 param holds a float32 master exactly, no other dtype. "
        "Leave master_dtype at its default (jnp.float32), or pass remainder=False."
      )
    return remainder_lib.with_remainder_masters(inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> MasterParamsState:
    _check_master_dtype(params, master_dtype)
    masters = jax.tree.map(
      lambda p: p.astype(master_dtype) if _has_master(p, master_dtype) else None, params
    )
    inner_params = jax.tree.map(
      lambda m, p: p if m is None else m, masters, params, is_leaf=base.is_none
    )
    inner_state = tree_lib.place_state(inner.init(inner_params), inner_params)
    return MasterParamsState(masters, inner_state)

  def update_fn(
    updates: optax.Updates,
    state: MasterParamsState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MasterParamsState]:
    if params is None:
      raise errors.ConfigError(
        "mpx.with_master_params needs the current params to return exact updates, but "
        "update was called without them. Call tx.update(grads, opt_state, params)."
      )
    tree_lib.check_state_type(state, MasterParamsState, "mpx.with_master_params")
    tree_lib.check_same_structure(updates, params, names=("gradients", "params"))
    check_masters(state.master_params, params, master_dtype)
    masters = state.master_params
    inner_params = jax.tree.map(
      lambda m, p: p if m is None else m, masters, params, is_leaf=base.is_none
    )
    inner_grads = jax.tree.map(
      lambda g, p: g.astype(p.dtype) if tree_lib.is_floating_array(g) and g.dtype != p.dtype else g,
      updates,
      inner_params,
      is_leaf=base.is_none,
    )
    inner_updates, inner_state = inner.update(
      inner_grads, state.inner_state, inner_params, **extra_args
    )
    new_masters = jax.tree.map(
      lambda m, u: None if m is None else m + u.astype(m.dtype),
      masters,
      inner_updates,
      is_leaf=base.is_none,
    )

    param_updates = jax.tree.map(
      lambda m, p, u: u if m is None else base.exact_update(m.astype(p.dtype), p, m.dtype),
      new_masters,
      params,
      inner_updates,
      is_leaf=base.is_none,
    )
    return param_updates, MasterParamsState(new_masters, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def apply_updates(
  params: optax.Params, updates: optax.Updates, opt_state: optax.OptState | None = None
) -> optax.Params:
  """Applies updates as ``optax.apply_updates`` does, under strict dtype promotion too.

  Each param becomes ``param + update``, added in the dtype JAX's default
  promotion gives the two and rounded to the param's dtype: bitwise what
  ``optax.apply_updates`` returns under default promotion (under strict
  promotion it rejects an update wider than its param). The updates of
  half-precision params with float32 masters (layout (b), paper section 3.1,
  and remainder masters) are float32 for that reason: they land each param
  on the cast of its new master, ``master.astype(param.dtype)``, except
  where no float32 update can (see :func:`with_master_params`). Other
  updates have their param's dtype, and the sum is ``optax.apply_updates``'
  own. It is therefore the one call that fits every policy and promotion
  mode.

  ``params`` may be a whole Equinox model whose updates were computed for
  ``eqx.filter(model, eqx.is_inexact_array)``: a ``None`` update (where the
  model holds a function, an integer array...) leaves its leaf as it is, as
  ``eqx.apply_updates`` does. (``eqx.apply_updates`` returns ``param +
  update`` unrounded: a half-precision param plus its float32 update would
  become float32.)

  Args:
    params: the params the updates were computed for.
    updates: the updates ``tx.update`` returned.
    opt_state: deprecated and not read (earlier versions read the masters
      from it); passing it warns. Drop it: ``mpx.apply_updates(params,
      updates)``.

  Returns:
    The new params, with the structure and dtypes of ``params``.

  Raises:
    TreeStructureError: ``updates`` does not have the structure of ``params``.
  """
  if opt_state is not None:
    warnings.warn(
      "mpx.apply_updates no longer reads the optimizer state: call "
      "mpx.apply_updates(params, updates). The third argument will be removed.",
      DeprecationWarning,
      stacklevel=2,
    )
  if _equinox_model(params, updates):
    own = jax.tree.map(lambda u, p: None if u is None else p, updates, params, is_leaf=base.is_none)
    new = apply_updates(own, updates)
    return jax.tree.map(
      lambda u, n, p: p if u is None else n, updates, new, params, is_leaf=base.is_none
    )
  tree_lib.check_same_structure(updates, params, names=("updates", "params"))
  return jax.tree.map(base.add, params, updates, is_leaf=base.is_none)


def _equinox_model(params: Any, updates: Any) -> bool:
  """Whether ``updates`` has a ``None`` where ``params`` has a leaf: Equinox's filtered updates."""
  try:
    kept = jax.tree.map(
      lambda u, p: u is None and p is not None, updates, params, is_leaf=base.is_none
    )
  except ValueError:
    return False  # Another structure: the check names the difference.
  return any(jax.tree.leaves(kept))
