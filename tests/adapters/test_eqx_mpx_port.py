"""The test suite of MPX (Gräfe & Trimpe, ``mixed-precision-for-jax`` 0.1.7), ported to mpx's API.

MPX is the Equinox mixed-precision library that also imports as ``mpx``. Each
test here is one of its tests (``tests/test_cast.py``, ``test_dtypes.py``,
``test_grad_tools.py``, ``test_loss_scaling.py``), named after it, written
against this library: the same models and data, the same property, checked
through mpx's API. Where mpx means something different on purpose, the test
checks mpx's behaviour and its comment says what differs and why. The case
list with results is in ``docs/migration/mpx_equinox.md``.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax_compat import standard_promotion

import mpx
import mpx._src.tree

F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype(jnp.bfloat16)


def _dtypes(tree):
  return jax.tree.map(lambda x: np.dtype(x.dtype), tree)


# ----------------------------------------------------------------------------- test_cast.py


class EqxModuleBase(eqx.Module):
  a: jax.Array
  b: jax.Array

  def __init__(self):
    self.a = jnp.ones(10, jnp.float32)
    self.b = jnp.ones(10, jnp.float32)


class LeafClass:
  """Not a pytree: its arrays are not leaves, so no cast reaches them."""

  def __init__(self):
    self.a = jnp.ones(10, jnp.float32)
    self.b = jnp.ones(10, jnp.float32)


class EqxModule1(eqx.Module):
  a: list
  b: jax.Array
  c: LeafClass

  def __init__(self):
    self.a = [EqxModuleBase() for _ in range(10)]
    self.b = jnp.ones(10, jnp.float32)
    self.c = LeafClass()


TREE = {
  "a": jnp.array([1.0, 2.0, 3.0], jnp.float32),
  "b": {
    "c": jnp.array([1.0, 2.0, 3.0], jnp.float16),
    "d": jnp.array([1.0, 2.0, 3.0], jnp.bfloat16),
  },
}


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_cast_eqx_module(dtype):
  result = mpx.cast_tree(EqxModule1(), dtype)
  assert {np.dtype(x.dtype) for base in result.a for x in (base.a, base.b)} == {dtype}
  assert result.b.dtype == dtype
  assert (result.c.a.dtype, result.c.b.dtype) == (F32, F32)


def test_cast_tree():
  assert mpx.cast_tree(TREE["b"]["c"], jnp.float32).dtype == F32
  assert set(jax.tree.leaves(_dtypes(mpx.cast_tree(TREE, jnp.float32)))) == {F32}


# MPX's cast_to_float32 / float16 / bfloat16 / full_precision are mpx.cast_tree with a dtype
# name (or a policy's cast_to_param / cast_to_compute / cast_to_output).
@pytest.mark.parametrize(
  ("name", "dtype"),
  [("float32", F32), ("float16", F16), ("bfloat16", BF16), ("full", F32)],
  ids=[
    "test_cast_to_float32",
    "test_cast_to_float16",
    "test_cast_to_bfloat16",
    "test_cast_to_full_precision",
  ],
)
def test_cast_to_dtype(name, dtype):
  assert mpx.cast_tree(TREE["b"]["c"] if dtype == F32 else TREE["a"], name).dtype == dtype
  assert set(jax.tree.leaves(_dtypes(mpx.cast_tree(TREE, name)))) == {dtype}


def test_cast_to_half_precision():
  # Intended difference: no process-wide half-precision setting. The policy names its compute
  # dtype, so one program cannot change meaning with a global set elsewhere (or between traces).
  for policy, half in (("mixed_float16", F16), ("mixed_bfloat16", BF16)):
    compute = mpx.get_policy(policy).cast_to_compute(TREE)
    assert set(jax.tree.leaves(_dtypes(compute))) == {half}


class _Pair(eqx.Module):
  """Wraps MPX's ``force_full_precision`` test function as a layer of a float16 model."""

  seen: list = eqx.field(static=True)

  def __call__(self, x, y):
    self.seen.append((x.dtype, y.dtype))
    return x + y, x * y


def test_force_full_precision_decorator():
  # mpx pins a layer, not a function: a keep rule runs the layer in float32 inside a float16
  # model, casting its inputs to float32 and its outputs back to the model's float16.
  layer = _Pair([])

  class Model(eqx.Module):
    pair: _Pair

    def __call__(self, x, y):
      return self.pair(x, y)

  rules = mpx.KeepRules().with_class(_Pair, "float32")
  model = mpx.eqx.apply_policy(Model(layer), "params=float16,compute=float16,output=float16", rules)
  x, y = jnp.array([1.0, 2.0], jnp.float16), jnp.array([3.0, 4.0], jnp.float16)
  sum_, product = model(x, y)
  assert layer.seen == [(F32, F32)]
  assert (sum_.dtype, product.dtype) == (F16, F16)
  np.testing.assert_array_equal(product, jnp.array([3.0, 8.0], jnp.float16))


def test_mixed_tree_handling():
  tree = {"array": TREE["a"], "scalar": 42, "nested": {"array": TREE["b"]["c"], "none": None}}
  result = mpx.cast_tree(tree, "float32")
  assert result["scalar"] == 42 and result["nested"]["none"] is None
  assert (result["array"].dtype, result["nested"]["array"].dtype) == (F32, F32)


def test_empty_structures():
  assert mpx.cast_tree({}, "float32") == {} and mpx.cast_tree([], "float32") == []


def test_non_float_arrays():
  ints, bools = jnp.array([1, 2, 3], jnp.int32), jnp.array([True, False])
  tree = {
    "f32": TREE["a"],
    "int32": ints,
    "bool": bools,
    "nested": {"f16": TREE["b"]["c"], "int32": ints},
  }
  result = _dtypes(mpx.cast_tree(tree, "float32"))
  assert result == {
    "f32": F32,
    "int32": np.dtype("int32"),
    "bool": np.dtype(bool),
    "nested": {"f16": F32, "int32": np.dtype("int32")},
  }


# MPX's cast_function(f, dtype, return_dtype) casts a function's arguments and results; in
# mpx that is a policy: cast_to_compute on the way in, cast_to_output on the way out.
def _cast_function(f, compute, output=None):
  policy = mpx.Policy(compute, compute, output or compute)

  def wrapped(*args, **kwargs):
    args, kwargs = policy.cast_to_compute((args, kwargs))
    return policy.cast_to_output(f(*args, **kwargs))

  return wrapped


X32, X16 = jnp.array([1.0, 2.0, 3.0], jnp.float32), jnp.array([1.0, 2.0, 3.0], jnp.float16)


def test_basic_function_casting():
  assert _cast_function(jnp.add, jnp.float32)(X32, X32).dtype == F32
  assert _cast_function(jnp.add, jnp.float16)(X16, X16).dtype == F16


def test_tuple_return_values():
  ops = _cast_function(lambda x, y: (x + y, x * y), jnp.float16)
  assert [r.dtype for r in ops(X32, X32)] == [F16, F16]


def test_different_input_output_dtypes():
  assert _cast_function(lambda x: x, jnp.float32, jnp.float16)(X16).dtype == F16


def test_args_and_kwargs():
  op = _cast_function(lambda x, y, scale=1.0: x + y * scale, jnp.float16)
  # A Python float stays weakly typed: it takes the dtype of the arrays it meets.
  assert op(X16, X16, scale=2.0).dtype == F16


def test_non_array_inputs_outputs():
  result = _cast_function(lambda x, y: (x + y, "string result", 42), jnp.float32)(X32, X32)
  assert result[0].dtype == F32 and result[1:] == ("string result", 42)


def test_nested_structures():
  result = _cast_function(lambda x, y: {"sum": x + y, "product": x * y}, jnp.float16)(X32, X32)
  assert _dtypes(result) == {"sum": F16, "product": F16}


# ----------------------------------------------------------------------------- test_dtypes.py


def test_default_half_precision():
  # Intended difference: no default half dtype; the presets name theirs.
  assert mpx.get_policy("mixed_float16").compute_dtype == F16


def test_set_half_precision_datatype():
  # Intended difference: nothing to set (and reset); another policy is another value.
  assert mpx.get_policy("mixed_bfloat16").compute_dtype == BF16
  assert mpx.get_policy("mixed_float16").compute_dtype == F16


# ------------------------------------------------------------------------ test_grad_tools.py


class SimpleModel(eqx.Module):
  weight: jax.Array
  bias: jax.Array
  none_leaf: None

  def __init__(self):
    self.weight = jnp.array([1.0, 2.0], jnp.float32)
    self.bias = jnp.array([0.5], jnp.float32)
    self.none_leaf = None  # A non-array leaf (which broke MPX once).

  def __call__(self, x):
    return jnp.dot(x, self.weight) + self.bias


X, Y = jnp.array([1.0, 2.0]), jnp.array([2.0])


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def loss_fn_with_aux(model, x, y):
  pred = model(x)
  return jnp.mean((pred - y) ** 2), {"pred": pred}


def bad_loss_fn(model, x, y):
  return jnp.inf * jnp.mean((model(x) - y) ** 2)


def _setup(policy="mixed_float16", inner=None):
  # MPX's DynamicLossScaling(2**10, min 2**-14, factor 2, period 2000) is this loss scale.
  scale = functools.partial(
    mpx.dynamic_loss_scale, initial_scale=2.0**10, min_scale=2.0**-14, growth_interval=2000
  )
  loss_scale = None if policy == "float32" else scale
  tx = mpx.mixed_precision(inner or optax.sgd(0.1), policy, loss_scale=loss_scale)
  model = mpx.eqx.apply_policy(SimpleModel(), policy)
  return model, tx, tx.init(eqx.filter(model, eqx.is_inexact_array))


def test_select_tree():
  # MPX's select_tree(pred, a, b) picks a tree by a finite-gradients flag; mpx's optimizer
  # makes that choice itself, and mpx.eqx.select_state makes it for the model's state.
  tree_a = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}
  tree_b = {"a": jnp.array([5.0, 6.0]), "b": jnp.array([7.0, 8.0])}
  tx = mpx.dynamic_loss_scale(optax.sgd(0.1))
  state, update = tx.init(tree_a), jax.jit(tx.update)
  _, finite = update(tree_a, state, tree_a)
  _, skipped = update({"a": jnp.array([jnp.inf, 0.0]), "b": tree_a["b"]}, state, tree_a)
  for state, want in ((finite, tree_a), (skipped, tree_b)):
    got = mpx.eqx.select_state(tree_a, tree_b, state)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_calculate_scaled_grad():
  # mpx.value_and_grad returns the loss unscaled and the gradients of the scaled loss, in the
  # params' dtype: float16 under a float16 policy, as MPX's half-precision cast model gives them.
  # Intended difference: under "mixed_float16" the params stay float32 (masters in the model),
  # so their gradients are float32.
  model, _, opt_state = _setup("params=float16,compute=float16,output=float32")  # loss in float32
  value, grad = mpx.value_and_grad(loss_fn, opt_state)(model, X, Y)
  assert isinstance(value, jax.Array) and isinstance(grad.mpx_layer, SimpleModel)
  assert (grad.weight.dtype, grad.bias.dtype) == (F16, F16)
  (value, aux), grad = mpx.value_and_grad(loss_fn_with_aux, opt_state, has_aux=True)(model, X, Y)
  assert "pred" in aux and grad.weight.dtype == F16
  model, _, opt_state = _setup("float32")  # MPX's use_mixed_precision=False
  _, grad = mpx.value_and_grad(loss_fn, opt_state)(model, X, Y)
  assert (grad.weight.dtype, grad.bias.dtype) == (F32, F32)


def _update(model, tx, opt_state, loss, **kwargs):
  (value, *aux), grads = mpx.value_and_grad(
    lambda *a: (loss(*a), None) if loss is not loss_fn_with_aux else loss(*a),
    opt_state,
    has_aux=True,
  )(model, X, Y)
  updates, new_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
  finite = not bool(mpx.loss_scale_metrics(new_state)["last_step_skipped"])
  return value, aux[0], grads, updates, new_state, finite


def test_filter_grad():
  # MPX's filter_grad returns (new scaling, finite flag, unscaled grads); mpx's optimizer update
  # unscales, checks and adjusts, and mpx.unscale reads the true gradients outside it.
  model, tx, opt_state = _setup()
  _, _, grads, _, _, finite = _update(model, tx, opt_state, loss_fn)
  true = mpx.unscale(grads, opt_state)
  assert finite and (true.weight.dtype, true.bias.dtype) == (F32, F32)
  np.testing.assert_allclose(true.weight, 2 * (jnp.dot(X, SimpleModel().weight) + 0.5 - 2.0) * X)
  *_, finite = _update(model, tx, opt_state, bad_loss_fn)
  assert not finite
  _, aux, grads, _, _, finite = _update(model, tx, opt_state, loss_fn_with_aux)
  assert finite and "pred" in aux and grads.weight.dtype == F32


def test_filter_value_and_grad():
  model, tx, opt_state = _setup()
  value, _, grads, _, _, finite = _update(model, tx, opt_state, loss_fn)
  assert value.dtype == F32 and finite and isinstance(grads.mpx_layer, SimpleModel)
  value, aux, grads, _, _, finite = _update(model, tx, opt_state, loss_fn_with_aux)
  assert "pred" in aux and finite and grads.bias.dtype == F32


def test_optimizer_update():
  # MPX's optimizer_update(model, optimizer, state, grads, finite) is tx.update with mpx's
  # loss-scaling transformation and eqx.apply_updates: a non-finite step changes nothing.
  model, tx, opt_state = _setup(inner=standard_promotion(optax.adam(0.1)))
  *_, updates, new_state, _ = _update(model, tx, opt_state, loss_fn)
  new_model = eqx.apply_updates(model, updates)
  assert isinstance(new_model.mpx_layer, SimpleModel) and new_model.weight.dtype == F32
  assert not bool(jnp.all(new_model.weight == model.weight))
  *_, updates, new_state, finite = _update(model, tx, opt_state, bad_loss_fn)
  skipped = eqx.apply_updates(model, updates)
  assert not finite
  np.testing.assert_array_equal(skipped.weight, model.weight)
  np.testing.assert_array_equal(skipped.bias, model.bias)
  # Adam's moments and count, bitwise as they were.
  adam = lambda s: [x for _, x in mpx._src.tree.find_nodes(s, optax.ScaleByAdamState)]  # noqa: E731
  jax.tree.map(np.testing.assert_array_equal, adam(new_state), adam(opt_state))


@pytest.mark.parametrize("loss", [loss_fn, bad_loss_fn, loss_fn_with_aux])
def test_filter_grad_no_mixed_precision(loss):
  # MPX sets an infinite scale and use_mixed_precision=False to show that no scaling happens;
  # in mpx that is the float32 policy, whose loss scale is 1 and which neither checks nor skips.
  model, tx, opt_state = _setup("float32")
  assert float(mpx.get_loss_scale(opt_state)) == 1.0
  _, _, grads, _, _, finite = _update(model, tx, opt_state, loss)
  assert finite and grads.weight.dtype == F32
  if loss is not bad_loss_fn:
    assert bool(mpx.all_finite(grads))


def test_filter_value_and_grad_no_mixed_precision():
  model, tx, opt_state = _setup("float32")
  value, aux, grads, *_ = _update(model, tx, opt_state, loss_fn_with_aux)
  assert value.dtype == F32 and "pred" in aux and bool(mpx.all_finite(grads))


# ---------------------------------------------------------------------- test_loss_scaling.py

FINITE = {"a": jnp.array([1.0, 2.0, 3.0]), "b": {"c": jnp.array([4.0, 5.0])}}
INFINITE = {"a": jnp.array([1.0, jnp.inf, 3.0]), "b": {"c": jnp.array([4.0, jnp.nan])}}


def test_all_finite():
  assert bool(mpx.all_finite(FINITE)) and not bool(mpx.all_finite(INFINITE))
  assert bool(mpx.all_finite({}))


def test_scale_unscale():
  scaled = mpx.scale(FINITE, jnp.float32(2.0**14))
  assert scaled["a"].dtype == F32
  np.testing.assert_array_equal(scaled["a"], FINITE["a"] * 2**14)
  unscaled = mpx.unscale(scaled, jnp.float32(2.0**14))
  np.testing.assert_array_equal(unscaled["a"], FINITE["a"])


def _scale_run(flags, **kwargs):
  tx = mpx.dynamic_loss_scale(optax.sgd(0.1), growth_interval=2000, **kwargs)
  params = {"w": jnp.ones(2)}
  update = jax.jit(tx.update)

  def run(state, finite, n):
    grads = {"w": jnp.ones(2) if finite else jnp.array([jnp.inf, 1.0])}
    return jax.lax.fori_loop(0, n, lambda _, s: update(grads, s, params)[1], state)

  state = tx.init(params)
  for finite, n in flags:
    state = jax.jit(run, static_argnums=(1, 2))(state, finite, n)
  return mpx.loss_scale_metrics(state)


def test_adjust_finite_grads():
  metrics = _scale_run([(True, 2000)], initial_scale=2.0**14)
  assert float(metrics["loss_scale"]) == 2.0**15 and int(metrics["growth_tracker"]) == 0
  # Intended difference: MPX clips the scale to float16's max (65504, not a power of two, so
  # unscaling is no longer exact). mpx scales the loss in float32 and keeps scales powers of
  # two; a cap is max_scale, at which the scale holds.
  metrics = _scale_run([(True, 4000)], initial_scale=2.0**14, max_scale=2.0**15)
  assert float(metrics["loss_scale"]) == 2.0**15 and int(metrics["growth_tracker"]) == 0


def test_adjust_infinite_grads():
  metrics = _scale_run([(False, 1)], initial_scale=2.0**14)
  assert float(metrics["loss_scale"]) == 2.0**13 and int(metrics["growth_tracker"]) == 0


def test_scaling_clipping():
  # Intended difference: a scale outside [min_scale, max_scale] is a configuration error up
  # front, where MPX clips it after the first step.
  with pytest.raises(mpx.ConfigError, match="must lie in"):
    mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**16, max_scale=2.0**15)
  with pytest.raises(mpx.ConfigError, match="must lie in"):
    mpx.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**-15, min_scale=2.0**-14)
  metrics = _scale_run([(False, 3)], initial_scale=2.0**-13, min_scale=2.0**-14)
  assert float(metrics["loss_scale"]) == 2.0**-14


def test_scaled_decorator():
  # MPX's scaled(func, scaling)(...) is mpx.scale of the function's result.
  result = mpx.scale((lambda x: x)(FINITE), jnp.float32(2.0**14))
  np.testing.assert_array_equal(result["a"], FINITE["a"] * 2**14)
