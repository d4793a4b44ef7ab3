"""The train steps ``loss_scale_overhead.py`` compares, and the model they train.

The step is a float16-compute GPT (``gpt.GPT`` with float16 matmuls and a
float32 residual stream, norms and logits; an untied head) trained with
``optax.adamw``: once without loss scaling (the baseline), once with each
library's dynamic loss scaling (jmp, Flax, mpx), and once with each
hand-written formulation, which isolates one choice (the finite check, the
select, ``lax.cond``, what is donated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import flax.training.dynamic_scale
import jax
import jax.numpy as jnp
import jmp
import optax

import mpx
from mpx._src.scaling import finite_check

from . import gpt

PyTree = Any
Batch = dict[str, jax.Array]
StepFn = Callable[[PyTree, PyTree, Batch], tuple[PyTree, PyTree, jax.Array]]

INITIAL_SCALE = 2.0**15
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4

CONFIG = gpt.GPTConfig(
  vocab_size=512, max_len=128, num_layers=4, d_model=256, num_heads=4, batch_size=8, tied_head=False
)
"""3,454,464 float32 params in 69 leaves: the model docs/benchmarks.md's figures are quoted on."""

TINY_CONFIG = dataclasses.replace(
  CONFIG, vocab_size=32, max_len=8, d_model=16, num_heads=2, batch_size=2
)
"""The same 69 leaves, a few thousand params: the smoke run (``--tiny``) compiles in seconds."""


# ------------------------------------------------------------------ the model


def _model(config: gpt.GPTConfig) -> gpt.GPT:
  return gpt.GPT(config, dtype=jnp.float16, residual_dtype=jnp.float32)


def make_batch(config: gpt.GPTConfig) -> Batch:
  """A deterministic batch, with ``loss_mult`` 1 (the atomicity check poisons it)."""
  batch = {k: jnp.asarray(v) for k, v in gpt.make_batch(config).items()}
  return dict(batch, loss_mult=jnp.float32(1.0))


def init_params(config: gpt.GPTConfig, seed: int = 0) -> PyTree:
  """Float32 parameters of the model."""
  return _model(config).init(jax.random.key(seed), make_batch(config)["x"])["params"]


def make_loss_fn(config: gpt.GPTConfig) -> Callable[[PyTree, Batch], jax.Array]:
  """Mean next-token cross entropy, computed in float32."""
  model = _model(config)

  def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
    logits = cast(jax.Array, model.apply({"params": params}, batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


def make_optimizer() -> optax.GradientTransformation:
  """The inner optimizer every candidate wraps."""
  return optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way of writing the train step.

  Attributes:
    name: short key used in the table and the JSON.
    description: what the formulation does.
    init: ``params -> state``.
    step: ``(params, state, batch) -> (params, state, loss)``.
    inner_state: ``state -> the optimizer state a skipped step must not touch``;
      None for the baseline, which has no skip.
    donate: the argnums donated to the compiled step (0: params, 1: state).
  """

  name: str
  description: str
  init: Callable[[PyTree], PyTree]
  step: StepFn
  inner_state: Callable[[PyTree], PyTree] | None
  donate: tuple[int, ...] = (0, 1)


# ------------------------------------------------------------------ helpers


def loss_with_poison(loss_fn: Callable[[PyTree, Batch], jax.Array]):
  def fn(params: PyTree, batch: Batch) -> jax.Array:
    return loss_fn(params, batch) * batch["loss_mult"]

  return fn


def _next_scale(scale: jax.Array, counter: jax.Array, ok: jax.Array, *, interval: int = 2000):
  """Plain dynamic rule (grow on the N-th finite step, halve on overflow, floor 1)."""
  counter = jnp.where(ok, counter + 1, jnp.zeros_like(counter))
  grow = counter >= interval
  grown = jnp.where(grow, scale * 2.0, scale)
  grown = jnp.where(jnp.isfinite(grown), grown, scale)
  new_scale = jnp.where(ok, grown, jnp.maximum(scale * 0.5, 1.0))
  return new_scale, jnp.where(grow, jnp.zeros_like(counter), counter)


def all_finite_isfinite(tree: PyTree) -> jax.Array:
  """``all(isfinite(g))`` per leaf, and-ed: the textbook check (flax, jmp, mpx)."""
  ok = jnp.array(True)
  for leaf in jax.tree.leaves(tree):
    ok = ok & jnp.all(jnp.isfinite(leaf))
  return ok


def _all_finite_concat(tree: PyTree) -> jax.Array:
  """One ``all(isfinite(.))`` over the concatenated gradients."""
  return jnp.all(jnp.isfinite(jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])))


def _all_finite_abs_sum(grads: PyTree, inv_scale: jax.Array) -> jax.Array:
  """Whether every unscaled gradient element ``g * inv_scale`` is finite.

  ``sum(|g|) * inv_scale`` is finite iff no ``g`` is inf or NaN and no
  ``|g| * inv_scale`` overflows (``|g_i| <= sum |g|``), up to the sum itself
  overflowing, which needs an L1 norm of the true gradient above 3.4e38. It reads
  the *scaled* gradients, so XLA fuses the reduction with nothing else and does
  not materialise the unscaled tree; ``|.|`` fuses into the reduction, where
  ``isfinite`` materialises a pred array reduced by a tree of extra kernels on
  XLA:CPU. Stacking the per-leaf sums yields one scalar instead of a 69-way
  ``and`` that XLA would fuse into every consumer.
  """
  sums = [jnp.sum(jnp.abs(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)]
  return jnp.isfinite(jnp.sum(jnp.stack(sums)) * inv_scale)


def _all_finite_bucketed(
  grads: PyTree, inv_scale: jax.Array, *, max_concat_size: int = 2**16
) -> jax.Array:
  """``_all_finite_abs_sum`` with the small leaves concatenated into one reduction.

  On XLA:CPU every per-leaf reduction costs about three kernels (its producer,
  a partial reduce-window pass, the final reduce, plus a transpose for the
  attention kernels' gradients); concatenating the leaves of at most
  ``max_concat_size`` elements (biases, norm scales, the 256x4x64 attention
  kernels) replaces those kernels by one reduction, while the largest leaves
  keep their own reduction so that little is copied into the concatenation.
  """
  leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(grads)]
  small = [g.ravel() for g in leaves if g.size <= max_concat_size]
  sums = [jnp.sum(jnp.abs(g)) for g in leaves if g.size > max_concat_size]
  if small:
    sums.append(jnp.sum(jnp.abs(jnp.concatenate(small))))
  return jnp.isfinite(jnp.sum(jnp.stack(sums)) * inv_scale)


def _all_finite_per_leaf(grads: PyTree, inv_scale: jax.Array) -> jax.Array:
  """jmp's check on the scaled gradients: ``all(isfinite(g * inv_scale))`` per leaf, stacked."""
  flags = [jnp.all(jnp.isfinite(g.astype(jnp.float32) * inv_scale)) for g in jax.tree.leaves(grads)]
  return jnp.all(jnp.stack(flags))


def _all_finite_rows(width: int, barrier: bool = True) -> Callable[[PyTree, jax.Array], jax.Array]:
  """``isfinite(g * inv_scale)`` reduced in rows of ``width``, then once over all leaves' rows.

  The formulation mpx ships (``mpx/_src/scaling/finite_check.py``, whose row cutting
  it reuses), without its attribution, for any row width; ``barrier=False``
  drops the optimization barrier on the concatenated row flags.
  """

  def check(grads: PyTree, inv_scale: jax.Array) -> jax.Array:
    flags = jnp.concatenate(
      [
        finite_check.row_flags(jnp.isfinite(g.astype(jnp.float32) * inv_scale), width)
        for g in jax.tree.leaves(grads)
      ]
    )
    return jnp.all(jax.lax.optimization_barrier(flags) if barrier else flags)

  return check


def _select(ok: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def skip_updates(ok: jax.Array, updates: PyTree) -> PyTree:
  # p + (-0.0) == p bitwise for every p (also -0.0), p + 0.0 is not (-0.0 -> +0.0).
  return jax.tree.map(lambda u: jnp.where(ok, u, jnp.array(-0.0, u.dtype)), updates)


def _inv(scale: jax.Array) -> jax.Array:
  # 1/scale is exact for a power-of-two scale, so unscaling by it is exact too.
  return (1.0 / scale).astype(jnp.float32)


class ScaledState(NamedTuple):
  """Hand-written loss-scale wrapper state (mpx layout: the scale lives in opt_state)."""

  inner_state: PyTree
  scale: jax.Array
  counter: jax.Array


UpdateBody = Callable[
  [optax.GradientTransformation, PyTree, PyTree, PyTree, jax.Array],
  tuple[PyTree, PyTree, jax.Array],
]


def wrapper(inner: optax.GradientTransformation, body: UpdateBody) -> optax.GradientTransformation:
  """An optax transformation around ``inner`` whose skip logic is ``body``."""

  def init(params: PyTree) -> ScaledState:
    return ScaledState(inner.init(params), jnp.float32(INITIAL_SCALE), jnp.int32(0))

  def update(updates: PyTree, state: optax.OptState, params: PyTree | None = None):
    state = cast(ScaledState, state)
    updates, inner_state, ok = body(inner, updates, state.inner_state, params, state.scale)
    scale, counter = _next_scale(state.scale, state.counter, ok)
    return updates, ScaledState(inner_state, scale, counter)

  return optax.GradientTransformation(init, update)


# ------------------------------------------------- hand-written update bodies


def body_where(check: Callable[[PyTree], jax.Array]) -> UpdateBody:
  """Unscale, ``check`` the unscaled gradients, inner update, where over updates and state."""

  def body(inner, grads, inner_state, params, scale):
    inv = _inv(scale)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)
    ok = check(grads)
    updates, new_state = inner.update(grads, inner_state, params)
    return skip_updates(ok, updates), _select(ok, new_state, inner_state), ok

  return body


def body_where_checked(check: Callable[[PyTree, jax.Array], jax.Array]) -> UpdateBody:
  """As ``body_where``, with a ``check(scaled_grads, 1 / scale)`` on the scaled gradients."""

  def body(inner, grads, inner_state, params, scale):
    inv = _inv(scale)
    ok = check(grads, inv)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)
    updates, new_state = inner.update(grads, inner_state, params)
    return skip_updates(ok, updates), _select(ok, new_state, inner_state), ok

  return body


def body_cond(inner, grads, inner_state, params, scale):
  """``lax.cond`` around the inner update (-0.0 updates and the old state on a skip)."""
  inv = _inv(scale)
  ok = _all_finite_abs_sum(grads, inv)
  grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)

  def skip(grads, inner_state, params):
    del params
    return jax.tree.map(lambda g: jnp.full_like(g, -0.0), grads), inner_state

  updates, new_state = jax.lax.cond(ok, inner.update, skip, grads, inner_state, params)
  return updates, new_state, ok


def make_fused_adamw(
  learning_rate: float,
  *,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float,
  check: Callable[[PyTree, jax.Array], jax.Array] = _all_finite_abs_sum,
) -> UpdateBody:
  """adamw whose update is computed from the *selected* moments (adam-specific).

  The select moves into the moment updates (``mu' = where(ok, b1 mu + (1-b1) g, mu)``)
  and the parameter update reads ``mu'``/``nu'``, the donated outputs, exactly as
  optax's own adamw reads its new moments. Only one kernel then reads the old
  moments, so XLA can write them in place; the generic ``where`` over the
  inner state has two readers of the old moments (the state select and the
  update, which XLA:CPU cannot merge into one multi-output kernel) and XLA
  copies every donated moment first.
  """

  def body(inner, grads, inner_state, params, scale):
    del inner
    adam, *rest = inner_state
    inv = _inv(scale)
    ok = check(grads, inv)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)
    count = jnp.where(ok, optax.safe_increment(adam.count), adam.count)
    mu = jax.tree.map(lambda m, g: jnp.where(ok, (1 - b1) * g + b1 * m, m), adam.mu, grads)
    nu = jax.tree.map(lambda v, g: jnp.where(ok, (1 - b2) * (g * g) + b2 * v, v), adam.nu, grads)
    c1 = 1 - jnp.float32(b1) ** count.astype(jnp.float32)
    c2 = 1 - jnp.float32(b2) ** count.astype(jnp.float32)

    def update(m, v, p):
      u = (m / c1) / (jnp.sqrt(v / c2) + eps) + weight_decay * p
      return jnp.where(ok, -learning_rate * u, jnp.array(-0.0, u.dtype))

    updates = jax.tree.map(update, mu, nu, params)
    return updates, (adam._replace(count=count, mu=mu, nu=nu), *rest), ok

  return body


# ------------------------------------------------------------ candidates


def make_candidates(config: gpt.GPTConfig) -> list[Candidate]:
  """Every formulation measured, baseline first."""
  loss_fn = loss_with_poison(make_loss_fn(config))
  tx = make_optimizer()

  def baseline_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # jmp's DynamicLossScale cannot be an argument of `lower` (its __post_init__
  # traces the fields), so its two array fields travel as the state instead.
  def jmp_init(params):
    return tx.init(params), (jnp.float32(INITIAL_SCALE), jnp.int32(0))

  def jmp_step(params, state, batch):
    opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
    grads = loss_scale.unscale(grads)
    ok = jmp.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(ok, (new_params, new_opt_state), (params, opt_state))
    loss_scale = loss_scale.adjust(ok)
    new_state = (opt_state, (loss_scale.loss_scale, loss_scale.counter))
    return params, new_state, loss_scale.unscale(loss)

  def flax_init(params):
    dyn = flax.training.dynamic_scale.DynamicScale(
      scale=jnp.float32(65536.0), fin_steps=jnp.int32(0)
    )
    return tx.init(params), dyn

  def flax_step(params, state, batch):
    opt_state, dyn = state
    dyn, ok, loss, grads = dyn.value_and_grad(loss_fn)(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = _select(ok, new_params, params)
    opt_state = _select(ok, new_opt_state, opt_state)
    return params, (opt_state, dyn), loss

  def wrapped(body: UpdateBody) -> tuple[Callable, StepFn]:
    wtx = wrapper(tx, body)

    def step(params, state, batch):
      scale = state.scale
      loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(params)
      updates, state = wtx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss / scale

    return wtx.init, step

  mpx_tx = mpx.dynamic_loss_scale(tx)

  def mpx_step(params, opt_state, batch):
    loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, batch)
    updates, opt_state = mpx_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  cands = [
    Candidate("baseline", "no loss scaling", tx.init, baseline_step, None),
    Candidate(
      "jmp",
      "jmp.DynamicLossScale + jmp.select_tree over (params, opt_state)",
      jmp_init,
      jmp_step,
      lambda s: s[0],
    ),
    Candidate(
      "flax",
      "flax DynamicScale.value_and_grad + jnp.where over params and opt_state",
      flax_init,
      flax_step,
      lambda s: s[0],
    ),
    Candidate(
      "jmp_params_donated",
      "jmp as above with only params donated (opt_state not donated)",
      jmp_init,
      jmp_step,
      lambda s: s[0],
      (0,),
    ),
    Candidate(
      "flax_params_donated",
      "flax as above with only params donated (opt_state not donated)",
      flax_init,
      flax_step,
      lambda s: s[0],
      (0,),
    ),
    Candidate(
      "mpx",
      "mpx.dynamic_loss_scale(adamw) + mpx.value_and_grad (the shipped transform)",
      mpx_tx.init,
      mpx_step,
      lambda s: s.inner_state,
    ),
    Candidate(
      "mpx_params_donated",
      "the shipped mpx transform with only params donated (opt_state not donated)",
      mpx_tx.init,
      mpx_step,
      lambda s: s.inner_state,
      (0,),
    ),
  ]
  hand: list[tuple[str, str, UpdateBody, tuple[int, ...]]] = [
    (
      "where_concat",
      "one all(isfinite) over the concatenated unscaled grads; where as where_isfinite",
      body_where(_all_finite_concat),
      (0, 1),
    ),
    (
      "where_bucketed",
      "generic where over updates and inner state; _all_finite_bucketed check",
      body_where_checked(_all_finite_bucketed),
      (0, 1),
    ),
    (
      "where_bucketed_params_donated",
      "where_bucketed with only params donated (opt_state not donated)",
      body_where_checked(_all_finite_bucketed),
      (0,),
    ),
    (
      "where_isfinite_params_donated",
      "generic where; jmp's per-leaf all(isfinite(g / scale)) check; only params donated",
      body_where_checked(_all_finite_per_leaf),
      (0,),
    ),
    *[
      (
        f"where_rows{width}_params_donated",
        f"generic where; isfinite reduced in rows of {width}, then once; only params donated",
        body_where_checked(_all_finite_rows(width)),
        (0,),
      )
      for width in (16, 32, 64)
    ],
    (
      "where_rows32_no_barrier_params_donated",
      "where_rows32 without the optimization barrier on the row flags; only params donated",
      body_where_checked(_all_finite_rows(32, barrier=False)),
      (0,),
    ),
    ("cond_abs_sum", "lax.cond around the inner update; abs-sum check", body_cond, (0, 1)),
    (
      "fused_adamw",
      "adamw-specific: select inside the moment updates, update read from the selected moments",
      make_fused_adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
      (0, 1),
    ),
    (
      "fused_adamw_bucketed",
      "fused_adamw with the small leaves' check concatenated (_all_finite_bucketed)",
      make_fused_adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY, check=_all_finite_bucketed),
      (0, 1),
    ),
  ]
  for name, desc, body, donate in hand:
    init, step = wrapped(body)
    cands.append(Candidate(name, desc, init, step, lambda s: s.inner_state, donate))
  return cands
