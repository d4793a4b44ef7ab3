"""One compilation per train step: ``init`` builds the state a jitted ``update`` returns.

``jit`` keys its executables on each argument's dtype, weak type, shape, sharding
and committedness, so a state leaf that ``update`` returns differently from how
``init`` made it compiles the step a second time. Each layout runs a jitted step
three times, in linen (``model.apply`` and ``TrainState``) and NNX
(``nnx.Optimizer`` and ``nnx.jit``), and asserts one executable.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state
from marks import all_but
from optax_compat import standard_promotion

import mpx

F32 = jnp.float32


def _adam() -> optax.GradientTransformation:
  return standard_promotion(optax.adam(1e-3))


# name -> (policy, function of the policy returning the optimizer)
LAYOUTS = {
  "float32": ("float32", lambda p: mpx.mixed_precision(_adam(), p)),
  "float16_masters": (
    "params=float16,compute=float16,output=float32",
    lambda p: mpx.mixed_precision(_adam(), p),
  ),
  "bfloat16_kahan": (
    "params=bfloat16,compute=bfloat16,output=float32",
    lambda p: mpx.mixed_precision(mpx.with_kahan_summation(_adam()), p, master_dtype=None),
  ),
  "bfloat16_stochastic_rounding": (
    "params=bfloat16,compute=bfloat16,output=float32",
    lambda p: mpx.mixed_precision(
      mpx.with_stochastic_rounding(_adam(), key=jax.random.key(3)), p, master_dtype=None
    ),
  ),
  "state_dtype": (
    "mixed_float16",
    lambda p: mpx.mixed_precision(mpx.with_state_dtype(_adam(), state_dtype=jnp.bfloat16), p),
  ),
  "multisteps": (
    "mixed_float16",
    lambda p: mpx.mixed_precision(standard_promotion(optax.MultiSteps(optax.adam(1e-3), 2)), p),
  ),
  "fp8_delayed": ("mixed_float8_delayed", lambda p: mpx.mixed_precision(_adam(), p)),
}


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(4)(x)


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(nnx.relu(self.hidden(x))))


def _x():
  return jax.random.normal(jax.random.key(1), (8, 8))


def _loss(out):
  return jnp.mean(out.astype(F32) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize(
  ("layout", "api"),
  all_but(
    [(layout, "apply") for layout in LAYOUTS]
    + [("float16_masters", "train_state"), ("fp8_delayed", "train_state")],
    ("float32", "apply"),
    ("float16_masters", "train_state"),
    ("fp8_delayed", "train_state"),
  ),
)
def test_linen_step_compiles_once(layout, api):
  policy, make_tx = LAYOUTS[layout]
  model = mpx.linen.apply_policy(LinenMLP(), policy)
  tx = make_tx(policy)
  x = _x()
  variables = model.init(jax.random.key(0), x)
  params = variables["params"]
  # Delayed fp8 keeps amax histories beside the params ({} for the other layouts).
  history = dict(variables.get(mpx.linen.FP8_COLLECTION, {}))

  def grads_of(params, history, opt_state):
    def loss_fn(p, h):
      return _loss(model.apply({"params": p, mpx.linen.FP8_COLLECTION: h}, x))

    _, (grads, observed) = mpx.value_and_grad(loss_fn, opt_state, argnums=(0, 1))(params, history)
    return grads, mpx.fp8.update_fp8_state(history, observed)

  if api == "apply":
    carry = (params, history, tx.init(params))

    @jax.jit
    def step(params, history, opt_state):
      grads, history = grads_of(params, history, opt_state)
      updates, opt_state = tx.update(grads, opt_state, params)
      return mpx.apply_updates(params, updates), history, opt_state

  else:
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # Flax starts `step` as the Python int 0, which compiles any step twice, optax alone too.
    carry = (state.replace(step=jnp.zeros((), jnp.int32)), history)

    @jax.jit
    def step(state, history):
      grads, history = grads_of(state.params, history, state.opt_state)
      with jax.numpy_dtype_promotion("standard"):  # optax: half params + float32 updates
        return state.apply_gradients(grads=grads), history

  for _ in range(3):
    carry = step(*carry)
  assert step._cache_size() == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nnx_step_compiles_once(layout):
  policy, make_tx = LAYOUTS[layout]
  model = mpx.nnx.apply_policy(NnxMLP(nnx.Rngs(0)), policy)
  optimizer = nnx.Optimizer(model, make_tx(policy), wrt=nnx.Param)
  x = _x()
  wrt = nnx.DiffState(0, nnx.Any(nnx.Param, mpx.nnx.Fp8History))

  @nnx.jit
  def step(model, optimizer):
    grads = mpx.value_and_grad(lambda m: _loss(m(x)), optimizer.opt_state, argnums=wrt)(model)[1]
    param_grads, observed = nnx.split_state(grads, nnx.Param, mpx.nnx.Fp8History)
    with jax.numpy_dtype_promotion("standard"):  # optax: half params + float32 updates
      optimizer.update(model, param_grads)
    history = nnx.state(model, mpx.nnx.Fp8History)
    nnx.update(model, mpx.fp8.update_fp8_state(history, observed))

  for _ in range(3):
    step(model, optimizer)
  assert step.jitted_fn._cache_size() == 1


def _avals(tree):
  return jax.tree.map(lambda x: (x.dtype, x.weak_type, x.shape), tree)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_returns_the_state_init_built(layout):
  policy, make_tx = LAYOUTS[layout]
  policy = mpx.get_policy(policy)
  tx = make_tx(policy)
  params = policy.cast_to_param({"w": jnp.ones((3, 2)), "b": jnp.zeros(2), "s": jnp.ones(())})
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  state = tx.init(params)
  _, new_state = jax.jit(tx.update)(grads, state, params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert _avals(new_state) == _avals(state)
  committed = {x.committed for x in jax.tree.leaves(state)}
  assert committed == {False}, "an eager init from uncommitted params commits nothing"


def test_committed_params_give_a_committed_state():
  device = jax.devices()[0]
  params = jax.device_put({"w": jnp.ones((3, 2), jnp.float16), "b": jnp.zeros(2)}, device)
  tx = mpx.mixed_precision(_adam(), "params=float16,compute=float16")
  state = tx.init(params)
  assert all(x.committed for x in jax.tree.leaves(state))

  @jax.jit
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    return mpx.apply_updates(params, updates), state

  carry = (params, state)
  for _ in range(3):
    carry = step(*carry)
  assert step._cache_size() == 1
