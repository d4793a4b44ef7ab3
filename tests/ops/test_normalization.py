"""Tests for the lean float32 normalisation kernels and the Flax layers they compute.

The reference is Flax's own layer computing in float32 between casts (what
``KeepRules(lean_norms=False)`` runs): forward outputs and gradients with
respect to the input, scale and bias must agree to the rounding of the half
output, and BatchNorm's running statistics must be updated identically.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpx
from mpx._src.ops import normalization

HALF = (jnp.float16, jnp.bfloat16)
# Half outputs too, so that the norm's own output dtype is seen.
POLICY = {d: f"params=float32,compute={d.dtype.name},output={d.dtype.name}" for d in HALF}
LEAN, FLAX = mpx.KeepRules(), mpx.KeepRules(lean_norms=False)


def _eqn_names(fn, *args) -> list[str]:
  names = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      names.append(eqn.primitive.name)
      for sub in jex.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


def _input(shape, dtype, seed=0):
  x = jax.random.normal(jax.random.key(seed), shape) * 3.0 + 1.5
  return x.astype(dtype)


def _random_params(params, seed=1):
  """Non-trivial scales and biases (Flax initialises them to 1 and 0)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [1.0 + 0.5 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
  )


def _close(got, want, dtype, *, ulps=1.0):
  """``got`` within ``ulps`` units of the half dtype's last place of ``want``, relative to max|want|."""
  got, want = np.float32(got), np.float32(want)
  tol = ulps * float(jnp.finfo(dtype).eps) * max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=float(jnp.finfo(dtype).eps), atol=tol)


# ------------------------------------------------------------------ linen layers


class _Wrap(nn.Module):
  """A parent computing in the policy's half dtype around one norm layer."""

  make: functools.partial

  @nn.compact
  def __call__(self, x, **kwargs):
    return self.make()(x, **kwargs)


LINEN_NORMS = {
  "layer": functools.partial(nn.LayerNorm),
  "layer_no_bias": functools.partial(nn.LayerNorm, use_bias=False),
  "layer_no_scale_bias": functools.partial(nn.LayerNorm, use_bias=False, use_scale=False),
  "layer_axes_12": functools.partial(nn.LayerNorm, reduction_axes=(1, 2), feature_axes=-1),
  "layer_exact_variance": functools.partial(nn.LayerNorm, use_fast_variance=False),
  "rms": functools.partial(nn.RMSNorm),
  "rms_no_scale": functools.partial(nn.RMSNorm, use_scale=False),
  "batch_train": functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9),
  "batch_train_no_bias": functools.partial(nn.BatchNorm, use_running_average=False, use_bias=False),
  "batch_eval": functools.partial(nn.BatchNorm, use_running_average=True),
  "group": functools.partial(nn.GroupNorm, num_groups=4),
  "group_size_8_exact_variance": functools.partial(
    nn.GroupNorm, num_groups=None, group_size=8, use_fast_variance=False
  ),
}


def _linen_run(make, dtype, rules, x):
  model = mpx.linen.apply_policy(_Wrap(make), POLICY[dtype], rules=rules)
  variables = model.init(jax.random.key(0), x)
  params = _random_params(variables.get("params", {}))
  stats = {k: v for k, v in variables.items() if k != "params"}
  if "batch_stats" in stats:  # non-trivial running statistics for eval mode
    stats = {"batch_stats": _random_params(stats["batch_stats"], seed=2)}
    stats = jax.tree.map(jnp.abs, stats)
  cotangent = _input(x.shape, dtype, seed=3)

  def loss(x, params):
    y, new_stats = model.apply({"params": params, **stats}, x, mutable=list(stats))
    return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32)), (y, new_stats)

  (_, (y, new_stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  return y, grads, new_stats, loss, params


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(LINEN_NORMS))
def test_linen_norms_match_flax(name, dtype):
  x = _input((4, 6, 32), dtype)
  lean = _linen_run(LINEN_NORMS[name], dtype, LEAN, x)
  flax = _linen_run(LINEN_NORMS[name], dtype, FLAX, x)

  assert "custom_vjp_call" in _eqn_names(lean[3], x, lean[4])
  assert "custom_vjp_call" not in _eqn_names(flax[3], x, flax[4])
  y, (dx, dparams), stats = lean[:3]
  assert y.dtype == dx.dtype == dtype
  _close(y, flax[0], dtype)
  _close(dx, flax[1][0], dtype, ulps=2.0)
  for got, want in zip(jax.tree.leaves(dparams), jax.tree.leaves(flax[1][1]), strict=True):
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
  assert jax.tree.structure(stats) == jax.tree.structure(flax[2])
  for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(flax[2]), strict=True):
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_linen_batchnorm_train_updates_running_statistics():
  x = _input((8, 4, 4, 16), jnp.bfloat16)
  make = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
  _, _, stats, _, _ = _linen_run(make, jnp.bfloat16, LEAN, x)
  before = jnp.abs(_random_params({"mean": jnp.zeros(16), "var": jnp.ones(16)}, seed=2)["mean"])
  x32 = np.float32(x)
  want = 0.9 * np.float32(before) + 0.1 * x32.mean(axis=(0, 1, 2))
  np.testing.assert_allclose(stats["batch_stats"]["BatchNorm_0"]["mean"], want, rtol=1e-5)


def test_linen_call_with_a_mask_runs_flax_code():
  x = _input((2, 8), jnp.bfloat16)
  mask = jnp.arange(8) < 6
  model = mpx.linen.apply_policy(_Wrap(functools.partial(nn.LayerNorm)), "mixed_bfloat16")
  variables = model.init(jax.random.key(0), x)

  names = _eqn_names(lambda v: model.apply(v, x, mask=mask), variables)
  assert "custom_vjp_call" not in names and "rsqrt" in names


def test_linen_norm_subclass_runs_flax_code():
  class MyNorm(nn.LayerNorm):
    pass

  x = _input((2, 8), jnp.bfloat16)
  model = mpx.linen.apply_policy(_Wrap(functools.partial(MyNorm)), "mixed_bfloat16")
  variables = model.init(jax.random.key(0), x)

  assert "custom_vjp_call" not in _eqn_names(lambda v: model.apply(v, x), variables)


def test_linen_float32_model_runs_flax_code():
  x = _input((2, 8), jnp.float32)
  model = mpx.linen.apply_policy(_Wrap(functools.partial(nn.LayerNorm)), "float32")
  variables = model.init(jax.random.key(0), x)

  assert "custom_vjp_call" not in _eqn_names(lambda v: model.apply(v, x), variables)


# -------------------------------------------------------------------- NNX layers


class _NnxWrap(nnx.Module):
  def __init__(self, norm):
    self.norm = norm

  def __call__(self, x, **kwargs):
    return self.norm(x, **kwargs)


NNX_NORMS = {
  "layer": lambda: nnx.LayerNorm(32, rngs=nnx.Rngs(0)),
  "layer_no_scale_bias": lambda: nnx.LayerNorm(
    32, use_scale=False, use_bias=False, rngs=nnx.Rngs(0)
  ),
  "rms": lambda: nnx.RMSNorm(32, rngs=nnx.Rngs(0)),
  "batch_train": lambda: nnx.BatchNorm(32, momentum=0.9, rngs=nnx.Rngs(0)),
  "batch_eval": lambda: nnx.BatchNorm(32, use_running_average=True, rngs=nnx.Rngs(0)),
  "group": lambda: nnx.GroupNorm(32, num_groups=4, rngs=nnx.Rngs(0)),
}


def _nnx_run(make, dtype, rules, x, **call):
  model = mpx.nnx.apply_policy(_NnxWrap(make()), POLICY[dtype], rules=rules)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = _random_params(params)
  rest = jax.tree.map(jnp.abs, _random_params(rest, seed=2))
  cotangent = _input(x.shape, dtype, seed=3)

  def loss(x, params, rest=rest):
    module = nnx.merge(graphdef, params, rest, copy=True)
    y = module(x, **call)
    loss = jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))
    return loss, (y, nnx.state(module, nnx.BatchStat))

  (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  return y, grads, stats, loss, params, model


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(NNX_NORMS))
def test_nnx_norms_match_flax(name, dtype):
  x = _input((4, 6, 32), dtype)
  lean = _nnx_run(NNX_NORMS[name], dtype, LEAN, x)
  flax = _nnx_run(NNX_NORMS[name], dtype, FLAX, x)

  assert lean[5].norm.mpx_lean_norm == name.split("_")[0]
  assert flax[5].norm.mpx_lean_norm is None
  assert "custom_vjp_call" in _eqn_names(lean[3], x, lean[4])
  y, (dx, dparams), stats = lean[:3]
  assert y.dtype == dx.dtype == dtype
  _close(y, flax[0], dtype)
  _close(dx, flax[1][0], dtype, ulps=2.0)
  for got, want in zip(jax.tree.leaves(dparams), jax.tree.leaves(flax[1][1]), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
  for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(flax[2]), strict=True):
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_nnx_call_argument_wins_over_the_attribute():
  x = _input((4, 32), jnp.bfloat16)
  make = NNX_NORMS["batch_train"]  # use_running_average=False on the layer
  lean = _nnx_run(make, jnp.bfloat16, LEAN, x, use_running_average=True)
  flax = _nnx_run(make, jnp.bfloat16, FLAX, x, use_running_average=True)

  _close(lean[0], flax[0], jnp.bfloat16)
  for got, want in zip(jax.tree.leaves(lean[2]), jax.tree.leaves(flax[2]), strict=True):
    np.testing.assert_array_equal(got, want)  # eval mode: statistics untouched


# --------------------------------------------------------- the saved residuals


def _residuals(fn, *args):
  leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))
  return {(tuple(leaf.shape), np.dtype(leaf.dtype).name) for leaf in leaves}


@pytest.mark.parametrize("name", ["layer", "rms", "batch_train", "batch_eval"])
def test_backward_keeps_the_half_input_and_per_row_float32_statistics(name):
  x = _input((4, 6, 32), jnp.bfloat16)

  def residuals(rules):
    model = mpx.linen.apply_policy(_Wrap(LINEN_NORMS[name]), POLICY[jnp.bfloat16], rules=rules)
    variables = model.init(jax.random.key(0), x)

    def loss(x, params):
      y, _ = model.apply({**variables, "params": params}, x, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y))  # keeps y in bfloat16, nothing else

    return _residuals(loss, x, variables["params"])

  lean, flax = residuals(LEAN), residuals(FLAX)
  full = {dtype for shape, dtype in lean if np.prod(shape) >= x.size}
  assert full == {"bfloat16"}, lean
  assert ((4, 6, 32), "float32") in flax  # the Flax code's float32 copies


# --------------------------------------------------------------- the kernels


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  ("subtract_mean", "fast_variance", "reduction_axes", "feature_axes"),
  [(True, True, -1, -1), (False, True, -1, -1), (True, False, (0, 1), 2), (True, True, (1,), 1)],
)
def test_normalize_vjp_matches_autodiff_of_its_forward(
  dtype, subtract_mean, fast_variance, reduction_axes, feature_axes
):
  """The closed-form backward, statistics outputs included, against autodiff of the same math."""
  x = _input((3, 5, 8), dtype)
  cfg = normalization._Config(
    reduction_axes=normalization.canonical_axes(3, reduction_axes),
    feature_axes=normalization.canonical_axes(3, feature_axes),
    epsilon=1e-5,
    subtract_mean=subtract_mean,
    fast_variance=fast_variance,
    dtype=np.dtype(dtype),
  )
  shape = tuple(x.shape[a] for a in cfg.feature_axes)
  scale, bias = 1.0 + _input(shape, jnp.float32, 1) / 4, _input(shape, jnp.float32, 2)

  def lean(x, scale, bias):
    return normalization.normalize(
      x,
      scale,
      bias,
      reduction_axes=reduction_axes,
      feature_axes=feature_axes,
      epsilon=1e-5,
      subtract_mean=subtract_mean,
      fast_variance=fast_variance,
    )

  def reference(x, scale, bias):
    return normalization._normalize_primal(x, scale, bias, cfg)[0]

  got, lean_vjp = jax.vjp(lean, x, scale, bias)
  want, reference_vjp = jax.vjp(reference, x, scale, bias)
  cotangents = tuple(_input(w.shape, w.dtype, seed=10 + i) for i, w in enumerate(want))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  for g, w in zip(lean_vjp(cotangents), reference_vjp(cotangents), strict=True):
    assert g.dtype == w.dtype
    tol = 1e-5 if g.dtype == jnp.float32 else float(jnp.finfo(g.dtype).eps)
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_normalize_with_statistics_vjp_matches_autodiff(dtype):
  x = _input((4, 3, 8), dtype)
  mean, var = _input((8,), jnp.float32, 1), jnp.abs(_input((8,), jnp.float32, 2)) + 0.1
  scale, bias = _input((8,), jnp.float32, 3), _input((8,), jnp.float32, 4)
  cfg = normalization._Config((0, 1), (2,), 1e-5, True, False, np.dtype(dtype))

  def lean(*args):
    return normalization.normalize_with_statistics(
      *args, reduction_axes=(0, 1), feature_axes=2, epsilon=1e-5
    )

  def reference(*args):
    return normalization._given_primal(*args, cfg)[0]

  args = (x, mean, var, scale, bias)
  got, lean_vjp = jax.vjp(lean, *args)
  want, reference_vjp = jax.vjp(reference, *args)
  np.testing.assert_array_equal(got, want)
  cotangent = _input(x.shape, dtype, seed=5)
  for g, w in zip(lean_vjp(cotangent), reference_vjp(cotangent), strict=True):
    tol = 1e-5 if g.dtype == jnp.float32 else float(jnp.finfo(g.dtype).eps)
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol, atol=tol * 10)


def test_normalize_under_jit_and_remat():
  x = _input((4, 16), jnp.float16)
  scale = jnp.ones(16)

  def loss(x, scale):
    y = normalization.normalize(x, scale, None, reduction_axes=-1, feature_axes=-1, epsilon=1e-6)
    return jnp.sum(jnp.sin(y[0].astype(jnp.float32)))

  plain = jax.grad(loss, argnums=(0, 1))(x, scale)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, scale)
  for a, b in zip(plain, remat, strict=True):  # jit may fuse differently: a few ulps
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------ against float64 autodiff


def _plain_norm(x, scale, bias, cfg, view):
  """Flax's arithmetic in whatever dtype ``x`` has, under plain autodiff: the reference."""
  shape = x.shape
  x = x.reshape(view)
  axes = cfg.reduction_axes
  mean = jnp.mean(x, axes, keepdims=True) if cfg.subtract_mean else 0.0
  var = jnp.mean(jnp.square(x - mean), axes, keepdims=True)
  fshape = [x.shape[a] if a in cfg.feature_axes else 1 for a in range(x.ndim)]
  y = (x - mean) * jax.lax.rsqrt(var + cfg.epsilon)
  if scale is not None:
    y = y * scale.reshape(fshape)
  if bias is not None:
    y = y + bias.reshape(fshape)
  return y.reshape(shape), jnp.squeeze(mean + jnp.zeros_like(var), axes), jnp.squeeze(var, axes)


# (name, input shape, view the statistics are taken in, reduction axes, feature axes, mean?)
KERNELS = {
  "batch": ((8, 5, 5, 16), (8, 5, 5, 16), (0, 1, 2), (3,), True),
  "layer": ((4, 6, 32), (4, 6, 32), (2,), (2,), True),
  "rms": ((4, 6, 32), (4, 6, 32), (2,), (2,), False),
  "group": ((4, 3, 3, 32), (4, 3, 3, 4, 8), (1, 2, 4), (3, 4), True),
}


EPS32 = float(jnp.finfo(jnp.float32).eps)


@pytest.mark.parametrize("statistics_cotangents", [False, True], ids=["y", "y_mean_var"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_backward_matches_float64_autodiff(name, statistics_cotangents):
  """The float32 closed-form backward against autodiff of the same layer in float64.

  Each gradient lies within a few float32 roundings of the float64 one, relative to
  the terms it is computed from: ``rstd * |g * scale| * (2 + |x_hat|)`` for the input,
  the sum of the absolute terms (times its depth) for the params.
  """
  shape, view, axes, features, subtract_mean = KERNELS[name]
  x = _input(shape, jnp.float32)
  fshape = (shape[-1],)
  scale, bias = 1.0 + _input(fshape, jnp.float32, 1) / 4, _input(fshape, jnp.float32, 2)
  bias = bias if subtract_mean else None  # RMSNorm has none
  cfg = normalization._Config(axes, features, 1e-5, subtract_mean, False, np.dtype(jnp.float32))

  def lean(x, scale, bias):
    y, mean, var = normalization.normalize(
      x.reshape(view),
      scale,
      bias,
      reduction_axes=axes,
      feature_axes=features,
      epsilon=1e-5,
      subtract_mean=subtract_mean,
      fast_variance=False,
    )
    return y.reshape(shape), mean, var

  got, lean_vjp = jax.vjp(lean, x, scale, bias)
  cotangents = [_input(g.shape, jnp.float32, seed=10 + i) for i, g in enumerate(got)]
  if not statistics_cotangents:  # BatchNorm's running averages: stop_gradient
    cotangents[1:] = [jnp.zeros_like(c) for c in cotangents[1:]]
  grads = lean_vjp(tuple(cotangents))
  with jax.enable_x64(True):
    x64, s64, b64, *ct64 = jax.tree.map(
      lambda a: np.asarray(a, np.float64), (x, scale, bias, *cotangents)
    )
    want, ref_vjp = jax.vjp(lambda *a: _plain_norm(*a, cfg, view), x64, s64, b64)
    wants = jax.tree.map(np.asarray, ref_vjp(tuple(ct64)))
    y64 = np.asarray(want[0])

  np.testing.assert_allclose(got[0], y64, rtol=0, atol=8 * EPS32 * np.abs(y64).max())
  xv = x64.reshape(view)
  centred = xv - (xv.mean(axes, keepdims=True) if subtract_mean else 0.0)
  rstd = 1 / np.sqrt(np.mean(centred**2, axes, keepdims=True) + 1e-5)
  xhat = np.abs(centred * rstd)
  g = np.abs(ct64[0].reshape(view))
  gamma = np.abs(s64.reshape([view[a] if a in features else 1 for a in range(len(view))]))
  bounds = {"x": (rstd * g * gamma * (2 + xhat)).max()}
  if statistics_cotangents:
    bounds["x"] += np.abs(ct64[1]).max() + 2 * np.abs(ct64[2]).max() * np.abs(x64).max()
  params = tuple(a for a in range(len(view)) if a not in features)
  depth = np.log2(np.prod([view[a] for a in params])) + 1
  bounds["scale"] = depth * (g * xhat).sum(params).max()
  bounds["bias"] = depth * g.sum(params).max()
  for arg, grad, ref in zip(("x", "scale", "bias"), grads, wants, strict=True):
    if ref is None:
      assert grad is None
      continue
    assert grad.dtype == jnp.float32 and grad.shape == ref.shape, arg
    tol = 4 * EPS32 * bounds[arg]
    np.testing.assert_allclose(np.float64(grad), ref, rtol=0, atol=tol, err_msg=arg)
