"""mpx.eqx.apply_policy: Equinox models under a policy, and the Equinox path of mpx.value_and_grad.

What the NNX adapter's tests check for NNX, for Equinox: storage and compute
dtypes (read from the traced program), the normalisation layers kept in
float32, keep rules by class, path and instance, the errors, and that the
result stays an ordinary Equinox module (``filter_jit``, ``filter_vmap``,
``tree_at``, serialisation, ``eqx.nn.State`` and ``Sequential``).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax_compat import standard_promotion

import mpx
from mpx._src import tree

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")


class Block(eqx.Module):
  norm: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  scale: jax.Array  # a hand-written param of a user module

  def __init__(self, key):
    self.norm = eqx.nn.LayerNorm(16)
    self.mlp = eqx.nn.MLP(16, 16, 32, 1, key=key)
    self.scale = jnp.ones(16)

  def __call__(self, x):
    return x + self.scale * self.mlp(self.norm(x))


class Model(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear
  steps: jax.Array  # an integer array: not a param

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(32, 16, key=keys[0])
    self.blocks = [Block(keys[1]), Block(keys[2])]
    self.head = eqx.nn.Linear(16, 8, key=keys[3])
    self.steps = jnp.zeros((), jnp.int32)

  def __call__(self, token):
    x = self.embed(token)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


TOKENS = jnp.arange(6) % 32


def _model(policy="mixed_bfloat16", **kwargs):
  return mpx.eqx.apply_policy(Model(jax.random.key(0)), policy, **kwargs)


def _eqns(jaxpr, name):
  """Every ``name`` equation of a jaxpr, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      found.append(eqn)
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found.extend(_eqns(inner, name))
  return found


def _input_dtypes(fn, *args, name="dot_general"):
  jaxpr = eqx.filter_make_jaxpr(lambda *a: fn(*a))(*args)[0].jaxpr
  return [tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2]) for eqn in _eqns(jaxpr, name)]


def _stored(model):
  return {np.dtype(x.dtype) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))}


@pytest.mark.parametrize(
  ("policy", "param", "compute"),
  [
    ("mixed_bfloat16", F32, BF16),
    ("float16", F16, F16),
    pytest.param("mixed_float16", F32, F16, marks=pytest.mark.slow),
  ],
)
def test_params_compute_and_output_follow_the_policy_and_norms_stay_float32(policy, param, compute):
  model = _model(policy)
  norms = [b.norm for b in model.blocks]
  others = [
    model.embed,
    model.head,
    *(b.mlp for b in model.blocks),
    *(b.scale for b in model.blocks),
  ]
  assert _stored(others) == {param}
  assert _stored(norms) == {F32}
  assert model.steps.dtype == jnp.int32

  out = jax.eval_shape(jax.vmap(model), TOKENS)
  assert out.dtype == mpx.get_policy(policy).output_dtype
  assert set(_input_dtypes(jax.vmap(model), TOKENS)) == {(compute, compute)}
  # The norms compute in float32 (mpx's lean kernel or Equinox's, on a float32 input).
  assert set(_input_dtypes(jax.vmap(model), TOKENS, name="rsqrt")) == {(F32,)}


def test_float32_policy_computes_exactly_as_the_model():
  model = Model(jax.random.key(0))
  run = eqx.filter_jit(lambda m: jax.vmap(m)(TOKENS))
  np.testing.assert_array_equal(run(mpx.eqx.apply_policy(model, "float32")), run(model))


def test_keep_rules_by_class_path_and_instance():
  model = Model(jax.random.key(0))
  rules = (
    mpx.KeepRules()
    .with_class(eqx.nn.Embedding, "float32")
    .with_path("^blocks/1/mlp$", "float32")
    .with_instance(model.head, "float32")
  )
  pinned = mpx.eqx.apply_policy(model, "bfloat16", rules=rules)
  assert _stored([pinned.embed, pinned.blocks[1].mlp, pinned.head]) == {F32}
  assert _stored([pinned.blocks[0].mlp, pinned.blocks[1].scale]) == {BF16}
  dots = _input_dtypes(jax.vmap(pinned), TOKENS)
  # Four dots: blocks/0/mlp in bfloat16; blocks/1/mlp and the head in float32.
  assert dots == [(BF16, BF16), (BF16, BF16), (F32, F32), (F32, F32), (F32, F32)]
  assert jax.eval_shape(jax.vmap(pinned), TOKENS).dtype == BF16


def test_a_path_rule_that_matches_nothing_warns_with_the_model_paths():
  with pytest.warns(mpx.PrecisionWarning, match=r"'blocks/9' .* blocks/0/mlp/layers/1"):
    _model(rules=mpx.KeepRules().with_path("blocks/9", "float32"))


def test_errors_name_the_problem():
  with pytest.raises(mpx.PolicyError, match=r"needs an equinox\.Module"):
    mpx.eqx.apply_policy({"w": jnp.ones(2)}, "mixed_bfloat16")
  model = _model()
  assert mpx.eqx.apply_policy(model, "mixed_bfloat16") is model
  with pytest.raises(mpx.PolicyError, match="already runs under"):
    mpx.eqx.apply_policy(model, "mixed_float16")
  with pytest.raises(mpx.PolicyError, match="blocks/0/norm already runs under"):
    inner = mpx.eqx.apply_policy(eqx.nn.LayerNorm(16), "float32")
    mpx.eqx.apply_policy(
      eqx.tree_at(lambda m: m.blocks[0].norm, Model(jax.random.key(0)), inner), "float32"
    )


def test_the_result_is_an_ordinary_equinox_module(tmp_path):
  model = Model(jax.random.key(0))
  policied = mpx.eqx.apply_policy(model, "mixed_bfloat16")
  # Attributes read through the wrappers, and tree_at reaches through them.
  assert policied.head.weight is policied.head.mpx_layer.weight
  assert isinstance(policied.head, mpx.eqx.PolicyLayer)
  # mpx's messages and gradient-leaf names use the model's own paths, not the wrappers' fields.
  paths = [tree.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(policied)[0]]
  assert "head/weight" in paths and "blocks/0/mlp/layers/1/bias" in paths
  assert not [p for p in paths if "mpx_" in p]
  zeroed = eqx.tree_at(lambda m: m.head.weight, policied, jnp.zeros((8, 16)))
  assert float(jnp.abs(zeroed.head.mpx_layer.weight).sum()) == 0.0
  # The leaves are the model's own, in its order: a float32 checkpoint loads into it.
  eqx.tree_serialise_leaves(tmp_path / "model.eqx", model)
  loaded = eqx.tree_deserialise_leaves(tmp_path / "model.eqx", zeroed)
  chex_equal = jax.tree.map(
    lambda a, b: bool((a == b).all()),
    eqx.filter(loaded, eqx.is_array),
    eqx.filter(policied, eqx.is_array),
  )
  assert all(jax.tree.leaves(chex_equal))
  # filter_jit and filter_vmap over an ensemble of models made by filter_vmap.
  make = lambda k: eqx.nn.MLP(4, 2, 8, 1, key=k)  # noqa: E731
  ensemble = mpx.eqx.apply_policy(
    eqx.filter_vmap(make)(jax.random.split(jax.random.key(1), 3)), "mixed_bfloat16"
  )
  run = eqx.filter_vmap(lambda m: jax.vmap(m)(jnp.ones((5, 4))))
  outs = eqx.filter_jit(run)(ensemble)
  assert outs.shape == (3, 5, 2) and outs.dtype == F32
  assert set(_input_dtypes(run, ensemble)) == {(BF16, BF16)}


def test_batchnorm_keeps_its_state_float32_inside_sequential():
  def make():
    return eqx.nn.Sequential(
      [
        eqx.nn.Linear(4, 16, key=jax.random.key(0)),
        eqx.nn.BatchNorm(16, axis_name="batch", mode="batch"),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(16, 2, key=jax.random.key(1)),
      ]
    )

  model, state = eqx.nn.make_with_state(make)()
  policied = mpx.eqx.apply_policy(model, "mixed_float16")
  x = jax.random.normal(jax.random.key(2), (8, 4))

  @eqx.filter_jit
  def forward(model, x, state):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

  out, new_state = forward(policied, x, state)
  assert out.dtype == F32
  assert {x.dtype for x in jax.tree.leaves(new_state)} == {F32, np.dtype("int32")}  # a counter
  # The statistics are the batch's, computed in float32 from the float16 activations (mode
  # "batch" keeps momentum averages, from 0 for the mean and 1 for the variance).
  mean, var = [s for s in jax.tree.leaves(new_state) if s.ndim == 1]
  hidden = jax.jit(jax.vmap(lambda v: policied.layers[0](v.astype(F16))))(x).astype(F32)
  weight = 1 - policied.layers[1].momentum
  np.testing.assert_allclose(mean, weight * hidden.mean(0), rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(var, 1 - weight + weight * hidden.var(0), rtol=1e-5, atol=1e-8)


def test_lean_layer_norm_matches_equinox_and_saves_the_half_input():
  norm = eqx.nn.LayerNorm(16)
  norm = eqx.tree_at(
    lambda n: (n.weight, n.bias), norm, (jnp.linspace(0.5, 2, 16), jnp.linspace(-1, 1, 16))
  )
  x = jax.random.normal(jax.random.key(0), (4, 16)).astype(BF16) * 3
  parent = eqx.nn.Sequential([eqx.nn.Identity(), norm])
  lean = mpx.eqx.apply_policy(parent, "bfloat16").layers[1]
  assert lean.mpx_lean_norm == "layer"

  def loss(layer, x):
    return jnp.sum(jax.vmap(layer)(x).astype(F32) ** 2)

  @jax.jit
  def run(x):
    reference = jax.vmap(norm)(x.astype(F32)).astype(BF16)
    expected = jax.grad(
      lambda x: jnp.sum(jax.vmap(norm)(x.astype(F32)).astype(BF16).astype(F32) ** 2)
    )(x)
    return jax.vmap(lean)(x), reference, jax.grad(loss, argnums=1)(lean, x), expected

  got, reference, grad, expected = run(x)
  assert got.dtype == BF16
  np.testing.assert_allclose(got.astype(F32), reference.astype(F32), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(grad.astype(F32), expected.astype(F32), rtol=3e-2, atol=3e-2)
  # The backward pass keeps the bfloat16 input, not a float32 copy of it.
  residuals = jax.eval_shape(lambda x: jax.linearize(jax.vmap(lean), x)[1], x)
  saved = [a for a in jax.tree.leaves(residuals) if getattr(a, "shape", ()) == x.shape]
  assert saved and {a.dtype for a in saved} == {BF16}


def _loss(model, tokens, targets):
  return jnp.mean((jax.vmap(model)(tokens) - targets) ** 2), tokens


def test_value_and_grad_differentiates_the_inexact_arrays_with_the_loss_scale():
  model = _model("mixed_float16")
  targets = jnp.ones((6, 8))
  tx = mpx.mixed_precision(optax.sgd(0.1), "mixed_float16")
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  scale = mpx.get_loss_scale(opt_state)

  @eqx.filter_jit
  def both(model):
    got = mpx.value_and_grad(_loss, opt_state, has_aux=True)(model, TOKENS, targets)
    want = eqx.filter_value_and_grad(
      lambda m, t, y: (_loss(m, t, y)[0].astype(F32) * scale, None), has_aux=True
    )(model, TOKENS, targets)
    return got, want

  ((loss, aux), grads), ((want_loss, _), want) = both(model)
  assert loss.dtype == F32 and float(loss) * float(scale) == pytest.approx(float(want_loss))
  np.testing.assert_array_equal(aux, TOKENS)
  assert jax.tree.structure(grads) == jax.tree.structure(want)  # None at the integer array
  assert grads.steps is None
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)


def test_value_and_grad_takes_argnums_and_leaves_the_callers_state_usable():
  layer, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="b", mode="batch")
  w = jnp.ones(3)

  def loss(layer, w, state, x):
    y, state = jax.vmap(layer, axis_name="b", in_axes=(0, None), out_axes=(0, None))(x * w, state)
    return jnp.sum(y**2), state

  x = jax.random.normal(jax.random.key(0), (5, 3))
  grad_fn = eqx.filter_jit(mpx.value_and_grad(loss, 1.0, argnums=(0, 1), has_aux=True))
  (_, new_state), (g_layer, g_w) = grad_fn(layer, w, state, x)
  assert g_layer.weight.shape == (3,) and g_w.shape == (3,)
  # The caller's state was not spent by the loss function: it can be selected after a skip.
  assert jax.tree.leaves(state) and jax.tree.leaves(new_state)


def test_select_state_keeps_the_old_state_bitwise_when_the_step_is_skipped():
  tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  state = {"mean": jnp.array([1.0, 2.0])}
  new = {"mean": jnp.array([3.0, jnp.nan])}
  update = jax.jit(tx.update)
  _, finite = update({"w": jnp.ones(2)}, opt_state, params)
  _, skipped = update({"w": jnp.array([jnp.inf, 1.0])}, opt_state, params)
  np.testing.assert_array_equal(mpx.eqx.select_state(new, state, finite)["mean"], new["mean"])
  np.testing.assert_array_equal(mpx.eqx.select_state(new, state, skipped)["mean"], state["mean"])


def _layouts():
  kahan = mpx.with_kahan_summation(optax.sgd(0.1))
  rounding = mpx.with_stochastic_rounding(optax.sgd(0.1), key=jax.random.key(0))
  int8 = standard_promotion(mpx.with_state_dtype(optax.adam(1e-3), state_dtype="int8", min_size=64))
  return {
    "masters": ("float16", mpx.mixed_precision(optax.sgd(0.1), "float16")),
    "kahan": ("bfloat16", mpx.mixed_precision(kahan, "bfloat16", master_dtype=None)),
    "stochastic_rounding": (
      "bfloat16",
      mpx.mixed_precision(rounding, "bfloat16", master_dtype=None),
    ),
    "int8_moments": ("mixed_bfloat16", mpx.mixed_precision(int8, "mixed_bfloat16")),
  }


@pytest.mark.parametrize(
  "name",
  [
    "masters",
    pytest.param("kahan", marks=pytest.mark.slow),
    pytest.param("stochastic_rounding", marks=pytest.mark.slow),
    pytest.param("int8_moments", marks=pytest.mark.slow),
  ],
)
def test_every_optimizer_layout_updates_an_equinox_model_with_mpx_apply_updates(name):
  x = jnp.ones((4, 64))
  policy, tx = _layouts()[name]
  model = mpx.eqx.apply_policy(eqx.nn.MLP(64, 64, 64, 1, key=jax.random.key(0)), policy)
  params = eqx.filter(model, eqx.is_inexact_array)
  opt_state = tx.init(params)

  @eqx.filter_jit
  def step(model, opt_state):
    loss, grads = mpx.value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2), opt_state)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = tx.update(grads, opt_state, params)
    # The whole model: its activation functions get no update and stay as they are.
    return mpx.apply_updates(model, updates), opt_state, loss

  new, opt_state, loss = step(model, opt_state)
  assert bool(jnp.isfinite(loss)), name
  assert new.layers[0].mpx_layer.weight.dtype == model.layers[0].mpx_layer.weight.dtype, name
  assert new.activation is model.activation
  moved = jax.tree.leaves(
    jax.tree.map(lambda a, b: bool((a != b).any()), eqx.filter(new, eqx.is_inexact_array), params)
  )
  assert any(moved), name
  if name == "masters":  # layout (b): each float16 param is the cast of its float32 master
    masters = mpx.get_master_params(opt_state, eqx.filter(new, eqx.is_inexact_array))
    for p, m in zip(
      jax.tree.leaves(eqx.filter(new, eqx.is_inexact_array)),
      jax.tree.leaves(masters),
      strict=True,
    ):
      np.testing.assert_array_equal(p, m.astype(p.dtype))
