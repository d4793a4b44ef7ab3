"""mpx.linen.apply_policy on layers inside Flax's lifted transforms (scan, remat, jit, vmap).

Flax builds the layers inside a lifted transform as copies whose parent is a
``Scope``, not the enclosing module; the policy must still see them where
they sit in the model: keep rules on an enclosing layer reach them, and they
hand their outputs on in the compute dtype, not the model's output dtype.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from marks import all_but
from optax_compat import standard_promotion

import mpx

PRESETS = ("float32", "mixed_bfloat16", "mixed_float16", "mixed_float8", "mixed_float8_delayed")
FEATURES = 8
LAYERS = 2
STACKED = {"params": 0, mpx.linen.FP8_COLLECTION: 0}


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(FEATURES)(nn.LayerNorm()(x))


class ScanBody(nn.Module):
  """One scan iteration: a block, itself rematerialised or jitted when asked."""

  inner: str = "plain"

  @nn.compact
  def __call__(self, x, _):
    block = {"plain": Block, "remat": nn.remat(Block), "jit": nn.jit(Block)}[self.inner]
    return block(name="block")(x), None


class VmapBody(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.jit(Block)(name="block")(x)


def _scan(inner: str, **axes):
  axes = axes or {"variable_axes": STACKED}
  scan = nn.scan(ScanBody, split_rngs={"params": True}, length=LAYERS, **axes)
  return lambda: scan(inner, name="blocks")


def _vmap(body):
  return lambda: nn.vmap(
    body, variable_axes=STACKED, split_rngs={"params": True}, in_axes=1, out_axes=1
  )(name="blocks")


def _wrapped(transform):
  return lambda: transform(Block)(name="blocks")


TRANSFORMS = {
  "scan": _scan("plain"),
  "remat": _wrapped(nn.remat),
  "checkpoint": _wrapped(nn.checkpoint),
  "jit": _wrapped(nn.jit),
  "vmap": _vmap(Block),
  "scan_over_remat": _scan("remat"),
  "scan_over_jit": _scan("jit"),
  "vmap_over_jit": _vmap(VmapBody),
  "scan_broadcast_fp8": _scan(
    "plain", variable_axes={"params": 0}, variable_broadcast=mpx.linen.FP8_COLLECTION
  ),
}


class Stack(nn.Module):
  """The transformed blocks."""

  transform: str

  @nn.compact
  def __call__(self, x):
    blocks = TRANSFORMS[self.transform]()
    return blocks(x, None)[0] if self.transform.startswith("scan") else blocks(x)


class Model(nn.Module):
  """Dense in, the stack of transformed blocks, Dense out."""

  transform: str

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(FEATURES, name="embed")(x)
    x = Stack(self.transform, name="stack")(x)
    return nn.Dense(FEATURES, name="head")(x)


def _outputs(fn, *args):
  """Runs ``fn`` abstractly; returns ``{module path: [dtypes of its outputs]}`` of every call."""
  seen: dict[str, list[np.dtype]] = {}

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and isinstance(out, jax.Array | jax.ShapeDtypeStruct):
      seen.setdefault("/".join(context.module.path), []).append(np.dtype(out.dtype))
    return out

  with nn.intercept_methods(record):
    result = jax.eval_shape(fn, *args)
  return result, seen


def _x():
  return jnp.ones((4, 3, FEATURES), jnp.float32)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_layers_inside_lifted_transforms_hand_on_the_compute_dtype(transform, preset):
  policy = mpx.get_policy(preset)
  model = mpx.linen.apply_policy(Model(transform), policy)
  variables, _ = _outputs(model.init, jax.random.key(0), _x())
  out, seen = _outputs(model.apply, variables, _x())
  assert out.dtype == policy.output_dtype
  inner = {path: dtypes for path, dtypes in seen.items() if path.startswith("stack/blocks")}
  assert any(path.endswith("Dense_0") for path in inner), sorted(seen)
  compute = np.dtype(policy.compute_dtype)
  for path, dtypes in seen.items():
    if path:  # every layer but the model hands on its output in the compute dtype
      assert set(dtypes) == {compute}, (path, dtypes)
  kernels = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
    if "kernel" in jax.tree_util.keystr(path)
  ]
  assert {leaf.dtype for leaf in kernels} == {np.dtype(policy.param_dtype)}


def _block_path(transform: str) -> str:
  return "stack/blocks/block" if transform.startswith(("scan", "vmap_over")) else "stack/blocks"


@pytest.mark.parametrize("how", ["class", "path"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_keep_rules_on_an_enclosing_layer_reach_layers_inside_transforms(transform, how):
  rules = mpx.KeepRules()
  rules = (
    rules.with_class(Stack, "float32") if how == "class" else rules.with_path("^stack$", "float32")
  )
  model = mpx.linen.apply_policy(Model(transform), "float16", rules=rules)
  variables, _ = _outputs(model.init, jax.random.key(0), _x())
  _, seen = _outputs(model.apply, variables, _x())
  block = _block_path(transform)
  # Inside the kept stack everything computes in float32; the stack hands on float16.
  for path in (block, f"{block}/Dense_0", f"{block}/LayerNorm_0"):
    assert set(seen[path]) == {np.dtype(jnp.float32)}, (path, seen)
  assert set(seen["stack"]) == {np.dtype(jnp.float16)}, seen
  params = variables["params"]
  for name in block.split("/"):
    params = params[name]
  assert params["Dense_0"]["kernel"].dtype == jnp.float32
  assert variables["params"]["head"]["kernel"].dtype == jnp.float16


class CopiedLayers(nn.Module):
  """Norms and Dense layers whose copies nn.jit / nn.remat make and free during one call."""

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.jit(nn.LayerNorm)(name=f"norm_{i}")(x)
      x = nn.remat(nn.Dense)(FEATURES, name=f"dense_{i}")(x)
      x = nn.LayerNorm(name=f"plain_norm_{i}")(x)
      x = nn.Dense(FEATURES, name=f"plain_dense_{i}")(x)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("preset", all_but(["float16", "mixed_float16"], "mixed_float16"))
def test_many_inits_with_jitted_and_rematted_layers_give_the_same_param_dtypes(preset):
  policy = mpx.get_policy(preset)
  model = mpx.linen.apply_policy(CopiedLayers(), policy)
  x = jnp.ones((2, FEATURES), jnp.float32)
  expected = {
    name: np.dtype(jnp.float32 if "norm" in name else policy.param_dtype)
    for name in [
      f"{kind}_{i}" for i in range(4) for kind in ("norm", "dense", "plain_norm", "plain_dense")
    ]
  }
  for _ in range(30):
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    got = {name: {leaf.dtype for leaf in jax.tree.leaves(layer)} for name, layer in params.items()}
    assert got == {name: {dtype} for name, dtype in expected.items()}


@pytest.mark.slow
@pytest.mark.parametrize("policy", all_but([None, "mixed_float16"], "mixed_float16"))
@pytest.mark.parametrize(
  "transform", all_but(["remat", "scan", "scan_over_remat"], "scan_over_remat")
)
def test_activations_skip_layers_inside_lifted_transforms(transform, policy):
  model = Model(transform) if policy is None else mpx.linen.apply_policy(Model(transform), policy)
  x = _x()
  params = model.init(jax.random.key(0), x)

  def loss_fn(p, x):
    return model.apply(p, x).astype(jnp.float32).mean()

  stats = mpx.linen.collect_activations(loss_fn, params, x)
  # The layers outside the transform are tapped; those inside are left out, not leaked.
  assert stats.modules == ("embed", "stack", "head", "<root>")
  assert float(stats.loss) == pytest.approx(float(loss_fn(params, x)), rel=1e-6)
  report = mpx.linen.locate_nonfinite(loss_fn, params, x)
  assert report.forward is None and report.backward is None


def test_locate_nonfinite_names_the_transform_around_a_nonfinite_layer():
  model = Model("scan_over_remat")
  x = _x()
  params = model.init(jax.random.key(0), x)
  kernel = params["params"]["stack"]["blocks"]["block"]["Dense_0"]["kernel"]
  params["params"]["stack"]["blocks"]["block"]["Dense_0"]["kernel"] = kernel.at[1, 0, 0].set(
    jnp.inf
  )
  report = mpx.linen.locate_nonfinite(lambda p, x: model.apply(p, x).mean(), params, x)
  assert report.forward == ("stack", "output")  # the first tapped layer after it
  assert report.cause == "genuine"


@pytest.mark.slow
@pytest.mark.parametrize(
  "transform", all_but(["scan", "scan_over_remat", "scan_broadcast_fp8"], "scan_over_remat")
)
def test_delayed_fp8_histories_of_scanned_layers_stacked_or_broadcast(transform):
  policy = mpx.get_policy("mixed_float8_delayed")
  model = mpx.linen.apply_policy(Model(transform), policy)
  x = _x()
  variables = model.init(jax.random.key(0), x)
  params, history = variables["params"], variables[mpx.linen.FP8_COLLECTION]
  block = history["stack"]["blocks"]["block"]["Dense_0"]["Fp8DotGeneral_0"]
  length = policy.fp8.history_length + 1
  shape = (length,) if transform == "scan_broadcast_fp8" else (LAYERS, length)
  for name in ("lhs", "rhs", "grad"):
    assert block[name].shape == shape and block[name].dtype == jnp.float32
  assert history["head"]["Fp8DotGeneral_0"]["lhs"].shape == (length,)

  def loss_fn(params, history):
    out = model.apply({"params": params, mpx.linen.FP8_COLLECTION: history}, x)
    return jnp.mean(jnp.square(out))

  loss, (grads, observed) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(params, history)
  assert jnp.isfinite(loss)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  shapes = jax.tree.map(jnp.shape, observed)
  assert shapes == jax.tree.map(jnp.shape, history)
  for name in ("lhs", "rhs", "grad"):
    # Every scanned layer observed an amax, in its pending slot.
    pending = observed["stack"]["blocks"]["block"]["Dense_0"]["Fp8DotGeneral_0"][name][..., 0]
    assert bool(jnp.all(jnp.isfinite(pending))) and bool(jnp.all(pending > 0)), (name, pending)


@pytest.mark.slow
def test_broadcast_histories_record_the_max_over_scan_iterations():
  """A history shared by the scanned layers observes the largest amax of any iteration."""
  policy = mpx.get_policy("mixed_float8_delayed")
  stacked, broadcast = (
    mpx.linen.apply_policy(Model(t), policy) for t in ("scan", "scan_broadcast_fp8")
  )
  x = _x() * jnp.arange(1.0, 4.0)[None, :, None]
  variables = stacked.init(jax.random.key(0), x)
  params, stacked_history = variables["params"], variables[mpx.linen.FP8_COLLECTION]
  broadcast_history = broadcast.init(jax.random.key(0), x)[mpx.linen.FP8_COLLECTION]

  def observed(model, history):
    def loss_fn(history):
      out = model.apply({"params": params, mpx.linen.FP8_COLLECTION: history}, x)
      return jnp.mean(jnp.square(out))

    return jax.jit(jax.grad(loss_fn))(history)["stack"]["blocks"]["block"]["Dense_0"]

  per_layer = observed(stacked, stacked_history)["Fp8DotGeneral_0"]
  shared = observed(broadcast, broadcast_history)["Fp8DotGeneral_0"]
  for name in ("lhs", "rhs", "grad"):
    amaxes = per_layer[name][:, 0]
    assert bool(jnp.all(amaxes > 0)) and float(amaxes[0]) != float(amaxes[1]), (name, amaxes)
    # Empty histories bootstrap from the current amax, so both models quantise alike.
    assert float(shared[name][0]) == float(jnp.max(amaxes)), (name, shared[name][0], amaxes)


def _llama_setup(preset: str, *, scan: bool = True):
  """The decoder under ``preset``, its variables, optimizer and jittable train step."""
  policy = mpx.get_policy(preset)
  model = mpx.linen.apply_policy(models.LlamaDecoder(scan=scan), policy)
  inputs, targets = models.lm_batch(models.text_tokens(), 0, batch_size=4, seq_len=16)
  variables = model.init(jax.random.key(0), inputs)
  params = variables["params"]
  history = variables.get(mpx.linen.FP8_COLLECTION, {})
  tx = mpx.mixed_precision(standard_promotion(optax.adam(1e-2)), policy)

  def loss_fn(params, history, inputs, targets):
    logits = model.apply({"params": params, mpx.linen.FP8_COLLECTION: history}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def train_step(params, history, opt_state, inputs, targets):
    grad_fn = mpx.value_and_grad(loss_fn, opt_state, argnums=(0, 1))
    loss, (grads, observed) = grad_fn(params, history, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    # The scanned layers' histories are stacked (layers, history + 1), one row per layer.
    history = mpx.fp8.update_fp8_state(history, observed)
    return mpx.apply_updates(params, updates), history, opt_state, loss

  return policy, params, history, tx, train_step, (inputs, targets)


@pytest.mark.slow
@pytest.mark.parametrize("preset", all_but(PRESETS, "mixed_float16"))
def test_llama_decoder_scanned_over_remat_blocks_trains_under_every_preset(preset):
  policy, params, history, tx, train_step, _ = _llama_setup(preset)
  assert (
    params["layers"]["block"]["mlp"]["gate"]["kernel"].shape[0] == models.LlamaDecoder.num_layers
  )
  assert bool(history) == (policy.fp8 is not None and policy.fp8.delayed)
  opt_state = tx.init(params)
  step = jax.jit(train_step)
  losses = []
  for i in range(4):
    inputs, targets = models.lm_batch(models.text_tokens(), i % 2, batch_size=4, seq_len=16)
    params, history, opt_state, loss = step(params, history, opt_state, inputs, targets)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
  for leaf in jax.tree.leaves(params):
    assert leaf.dtype == policy.param_dtype and bool(jnp.isfinite(leaf).all())
  for leaf in jax.tree.leaves(history):
    assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all())
    assert bool(jnp.all(leaf[..., 1] > 0))  # a committed amax in every (per-layer) history


def _signature(op):
  """A matmul as its precision and shapes, whichever layer issued it."""
  dtypes = (op.lhs_dtype, op.rhs_dtype, op.result_dtype)
  return (op.kind, op.is_backward, op.is_fp8, *map(str, dtypes), op.lhs_shape, op.rhs_shape)


@pytest.mark.slow
@pytest.mark.parametrize("preset", all_but(PRESETS, "mixed_bfloat16"))
def test_llama_audit_shares_are_those_of_the_unrolled_model(preset):
  reports = {}
  for scan in (True, False):
    policy, params, history, tx, train_step, batch = _llama_setup(preset, scan=scan)
    opt_state = jax.eval_shape(tx.init, params)
    reports[scan] = mpx.audit(train_step, params, history, opt_state, *batch, policy=policy)
  scanned, unrolled = reports[True], reports[False]
  # Every matmul of the unrolled model runs in the scanned one at the same precision, and back.
  assert {_signature(op) for op in scanned.ops} == {_signature(op) for op in unrolled.ops}
  assert scanned.half_flops_share == unrolled.half_flops_share
  # The audit counts a scanned block's ops once per iteration (the loop's trip count).
  assert any("/layers/" in op.module_path and op.count > 1 for op in scanned.ops)
  shares = (scanned.half_flops_share, scanned.fp8_flops_share)
  assert shares == pytest.approx((unrolled.half_flops_share, unrolled.fp8_flops_share), abs=1e-12)
  if policy.compute_dtype != jnp.float32:
    assert unrolled.half_flops_share == 1.0
  if policy.fp8 is not None:
    assert unrolled.fp8_flops_share > 0.9, unrolled.fp8_flops_share
