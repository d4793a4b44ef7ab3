"""Equinox models under a policy, audited and trained end to end (the Equinox twin of test_policy_models).

A ViT-style model (stacked blocks under a ``jax.lax.scan``, Equinox's
attention) and a ResNet-style CNN (``BatchNorm`` with an ``eqx.nn.State``),
both without any dtype (``tests/eqx_models.py``), through the whole mpx
train step: ``mpx.eqx.apply_policy``, ``mpx.mixed_precision`` on
``eqx.filter(model, eqx.is_inexact_array)``, ``mpx.value_and_grad`` and
``eqx.apply_updates``:

* the audit of a full step shows every product with half-precision (or
  float8) operands, norm statistics in float32 and a float32 loss;
* ``mixed_bfloat16``, ``mixed_float16`` with dynamic loss scaling and
  ``mixed_float8`` track the float32 run within the tolerance the Flax models
  are held to (``test_policy_models.py``);
* a step with a non-finite gradient leaves the model, the optimizer's own
  state and the ``eqx.nn.State`` bitwise unchanged.

optax's adam bias correction raises ``decay ** count``, which strict
promotion rejects, so only the optimizer update runs under standard
promotion (as in ``test_policy_models.py``).
"""

from __future__ import annotations

import functools

import equinox as eqx
import eqx_models
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

import mpx

BATCH = 64
# The tolerance of test_policy_models.py: |mean mixed loss - mean float32 loss| over the last
# WINDOW steps at most ABS_TOL + REL_TOL * the float32 mean; both runs must learn (end below
# LEARNED times the first loss).
ABS_TOL, REL_TOL, LEARNED, WINDOW = 0.02, 0.05, 0.6, 30
# The ViT is still falling steeply at 100 steps (float32 and float8 runs differ there by 0.1 on
# a loss near 1, either way), so it trains until its curve flattens.
STEPS = {"vit": 150, "resnet": 100}


def _batches(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  images, labels = models.digits()
  index = np.random.default_rng(seed).integers(0, len(labels), size=(steps, BATCH))
  return [{"x": images[i], "y": labels[i]} for i in index]


def _setup(kind: str, policy: str, lr: float = 3e-3, **sizes: int):
  """``(model, state, tx, step)``: a step ``(model, state, opt_state, batch)``."""
  if kind == "vit":
    model, state = eqx_models.ViT(key=jax.random.key(0), **sizes), None
  else:
    model, state = eqx.nn.make_with_state(eqx_models.ResNet)(key=jax.random.key(0), **sizes)
  model = mpx.eqx.apply_policy(model, policy)
  tx = mpx.mixed_precision(optax.adamw(lr), policy)
  return model, state, tx, _step(tx)


def _step(tx: optax.GradientTransformation):
  def step(model, state, opt_state, batch):
    if state is None:
      loss, grads = mpx.value_and_grad(eqx_models.vit_loss, opt_state)(model, batch)
    else:
      grad_fn = mpx.value_and_grad(eqx_models.resnet_loss, opt_state, has_aux=True)
      (loss, new_state), grads = grad_fn(model, state, batch)
    with jax.numpy_dtype_promotion("standard"):  # optax: float ** int32 count.
      updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)
    if state is not None:
      state = mpx.eqx.select_state(new_state, state, opt_state)
    return model, state, opt_state, loss

  return step


def _primitive_input_dtypes(jaxpr, name):
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      found.append(np.dtype(eqn.invars[0].aval.dtype))
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found.extend(_primitive_input_dtypes(inner, name))
  return found


AUDITS = [
  ("resnet", "mixed_float16"),
  pytest.param("vit", "mixed_bfloat16", marks=pytest.mark.slow),
  pytest.param("vit", "mixed_float16", marks=pytest.mark.slow),
  pytest.param("resnet", "mixed_bfloat16", marks=pytest.mark.slow),
  pytest.param("vit", "mixed_float8", marks=pytest.mark.slow),
  pytest.param("resnet", "mixed_float8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "policy"), AUDITS)
def test_train_step_runs_every_product_in_half_precision_and_norms_in_float32(kind, policy):
  model, state, tx, step = _setup(kind, policy, depth=1)
  params = eqx.filter(model, eqx.is_inexact_array)
  opt_state = tx.init(params)
  batch = _batches(1)[0]
  dynamic, static = eqx.partition((model, state, opt_state), eqx.is_array)

  def flat_step(dynamic, batch):
    model, state, opt_state, loss = step(*eqx.combine(dynamic, static), batch)
    return eqx.filter((model, state, opt_state), eqx.is_array), loss

  report = mpx.audit(flat_step, dynamic, batch, policy=policy)
  assert report.ops and report.backward_ops
  compute = np.dtype(mpx.get_policy(policy).compute_dtype)
  if mpx.get_policy(policy).fp8 is None:
    assert report.half_flops_share == 1.0 and not report.float32_ops, str(report)
    assert {op.lhs_dtype for op in report.ops} == {compute}
    if kind == "resnet":  # every product named by its layer's path
      assert {op.module_path for op in report.ops} == {
        "stem",
        "blocks/0/conv1",
        "blocks/0/conv2",
        "head",
      }
  elif kind == "vit":
    # Every layer's products in float8; the attention's two products of activations in bfloat16.
    assert report.half_flops_share == 1.0 and report.fp8_flops_share > 0.7, str(report)
    assert {op.module_path for op in report.ops if not op.is_fp8} == {"blocks/attention"}
  else:
    # The 16-channel convolutions in mpx's float8 form (a float32 convolution of dequantised
    # float8 operands, which XLA:GPU makes a cuDNN float8 convolution, and float8 weight
    # gradients); the one-channel stem, which float8 does not cover, in bfloat16.
    wide = {op.module_path for op in report.float32_ops}
    assert wide == {"blocks/0/conv1", "blocks/0/conv2"}, str(report)
    assert {op.module_path for op in report.ops if op.lhs_dtype == compute} == {"stem"}
    assert {op.module_path for op in report.ops if op.is_fp8} >= {*wide, "head"}
  # Norm statistics in float32: every rsqrt (LayerNorm) and sqrt (Equinox's BatchNorm) of the
  # step takes float32 inputs.
  closed = jax.make_jaxpr(flat_step)(dynamic, batch)
  roots = _primitive_input_dtypes(closed.jaxpr, "rsqrt" if kind == "vit" else "sqrt")
  assert roots and set(roots) == {np.dtype("float32")}
  # Params, the BatchNorm statistics and the loss are float32.
  floats = [x for x in jax.tree.leaves((params, state)) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert {np.dtype(x.dtype) for x in floats} == {np.dtype("float32")}
  assert closed.out_avals[-1].dtype == jnp.float32  # the loss


@functools.cache
def _losses(kind: str, policy: str) -> np.ndarray:
  model, state, tx, step = _setup(kind, policy)
  step = eqx.filter_jit(step)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  losses = []
  for batch in _batches(STEPS[kind]):
    model, state, opt_state, loss = step(model, state, opt_state, batch)
    losses.append(loss)
  if mpx.get_policy(policy).compute_dtype == np.dtype("float16"):
    assert int(mpx.loss_scale_metrics(opt_state)["skipped_steps"]) <= 2  # the scale settles
  return np.asarray(jax.device_get(losses))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vit", "resnet"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float8"])
def test_mixed_precision_training_tracks_float32(kind, policy):
  reference, mixed = _losses(kind, "float32"), _losses(kind, policy)
  assert np.isfinite(reference).all() and np.isfinite(mixed).all()
  final_ref, final_mixed = reference[-WINDOW:].mean(), mixed[-WINDOW:].mean()
  assert final_ref < LEARNED * reference[0] and final_mixed < LEARNED * mixed[0]
  assert abs(final_mixed - final_ref) <= ABS_TOL + REL_TOL * final_ref, (final_ref, final_mixed)


def _inner_state(opt_state):
  """The optimizer's own state: everything but the loss-scale state (which records the skip)."""
  return [
    leaf
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, mpx.LossScaleState))
    if not isinstance(node, mpx.LossScaleState)
    for leaf in jax.tree.leaves(node)
  ]


@pytest.mark.parametrize("kind", ["resnet", pytest.param("vit", marks=pytest.mark.slow)])
def test_a_non_finite_step_leaves_model_optimizer_and_state_bitwise_unchanged(kind):
  model, state, tx, step = _setup(kind, "mixed_float16", depth=1)
  step = eqx.filter_jit(step)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  first, second = _batches(2)
  model, state, opt_state, _ = step(model, state, opt_state, first)
  poisoned = {"x": second["x"].copy(), "y": second["y"]}
  poisoned["x"][0, 0, 0, 0] = np.inf
  new_model, new_state, new_opt_state, _ = step(model, state, opt_state, poisoned)
  metrics = mpx.loss_scale_metrics(new_opt_state)
  assert bool(metrics["last_step_skipped"]) and int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == float(mpx.get_loss_scale(opt_state)) / 2
  for before, after in (
    (eqx.filter(model, eqx.is_array), eqx.filter(new_model, eqx.is_array)),
    (_inner_state(opt_state), _inner_state(new_opt_state)),
    (state, new_state),
  ):
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
