"""``mpx.parallel.all_reduce_gradients``: data-parallel gradient reduction in the compute dtype.

In-process tests use ``jax.vmap`` with a named axis (the same collectives,
traced on one device). The HLO, bytes and global-skip tests run a real
``shard_map`` train step on 4 forced CPU devices in one subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpx

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _reduce(grads, reduce_dtype):
  return jax.vmap(
    lambda g: mpx.parallel.all_reduce_gradients(g, "batch", reduce_dtype=reduce_dtype),
    axis_name="batch",
  )(grads)


@pytest.mark.parametrize("reduce_dtype", [None, F32, BF16, F16], ids=str)
@pytest.mark.parametrize("leaf_dtype", [F32, F16], ids=str)
def test_matches_a_float32_numpy_mean(leaf_dtype, reduce_dtype):
  rng = np.random.default_rng(0)
  n = 4
  # Scaled gradients: spread over many binades, and large enough that a float16
  # sum without the division by n would overflow (4 * 30000 > 65504).
  local = rng.standard_normal((n, 64)) * np.exp2(rng.integers(-12, 14, (n, 64)))
  local[:, 0] = 30000.0
  grads = {"w": jnp.asarray(local, leaf_dtype), "b": jnp.asarray(local[:, :3], leaf_dtype)}
  out = jax.jit(_reduce, static_argnums=1)(grads, reduce_dtype)

  wire = np.dtype(reduce_dtype or leaf_dtype)
  for name, g in grads.items():
    assert out[name].dtype == leaf_dtype  # back in the leaf's dtype
    want = np.asarray(g, np.float64).mean(axis=0)
    got = np.asarray(out[name], np.float64)
    np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # same everywhere
    # Each share rounds once to the wire dtype, each of the n - 1 additions once more,
    # the result once to the leaf dtype: a few ulps of the wire dtype.
    eps = float(jnp.finfo(wire).eps) + float(jnp.finfo(leaf_dtype).eps)
    bound = (n + 1) * eps * np.abs(np.asarray(g, np.float64)).mean(axis=0)
    assert np.all(np.isfinite(got[0]))
    assert np.all(np.abs(got[0] - want) <= bound), (name, np.max(np.abs(got[0] - want) / bound))


def test_without_a_reduce_dtype_it_is_the_exact_mean_for_a_power_of_two():
  grads = {"w": jnp.arange(8.0, dtype=F32).reshape(4, 2)}
  out = _reduce(grads, None)
  np.testing.assert_array_equal(out["w"], np.broadcast_to([3.0, 4.0], (4, 2)))


def test_an_inf_on_one_member_reaches_every_member():
  grads = {"w": jnp.ones((4, 3), F32).at[2, 1].set(jnp.inf)}
  out = _reduce(grads, F16)
  assert not np.isfinite(np.asarray(out["w"][:, 1])).any()
  np.testing.assert_array_equal(out["w"][:, 0], np.ones(4))


def test_none_leaves_are_kept():
  out = _reduce({"w": jnp.ones((2, 3)), "frozen": None}, BF16)
  assert out["frozen"] is None and out["w"].shape == (2, 3)


def test_non_floating_leaves_are_an_error_naming_the_leaf():
  with pytest.raises(mpx.LeafTypeError, match="'step' has dtype int32"):
    _reduce({"w": jnp.ones((2, 3)), "step": jnp.zeros(2, jnp.int32)}, BF16)


def test_an_unknown_axis_is_an_error_naming_it():
  with pytest.raises(mpx.ConfigError, match="axis_name='model' is not a mapped axis"):
    jax.vmap(lambda g: mpx.parallel.all_reduce_gradients(g, "model"), axis_name="batch")(
      jnp.ones((2, 3))
    )
  with pytest.raises(mpx.ConfigError, match=r"inside jax\.shard_map"):
    mpx.parallel.all_reduce_gradients(jnp.ones(3), "data")


def test_a_bad_reduce_dtype_is_an_error():
  with pytest.raises(mpx.PolicyError, match="Unknown dtype name 'f8'"):
    _reduce({"w": jnp.ones((2, 3))}, "f8")
  with pytest.raises(mpx.PolicyError, match="not a dtype a precision policy can use"):
    _reduce({"w": jnp.ones((2, 3))}, jnp.int8)


_SCRIPT = textwrap.dedent(
  """
    import json, re
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import mpx

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    n = jax.device_count()
    assert n == 4, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    policy = mpx.get_policy("mixed_float16")  # float32 params, float16 compute
    tx = mpx.mixed_precision(optax.sgd(0.1), policy, loss_scale="dynamic")
    key = jax.random.key(0)
    params = {
        "w1": jax.random.normal(key, (32, 64)) * 0.1,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(jax.random.fold_in(key, 1), (64, 8)) * 0.1,
    }
    batch = {
        "x": jax.random.normal(jax.random.fold_in(key, 2), (8 * n, 32)),
        "y": jax.random.normal(jax.random.fold_in(key, 3), (8 * n, 8)),
    }
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

    def make_step(reduce_dtype):
        def local_step(params, opt_state, batch):
            def loss_fn(p):
                p, x = policy.cast_to_compute((p, batch["x"]))
                out = (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]).astype(jnp.float32)
                return jnp.mean((out - batch["y"]) ** 2)

            # Varying params: each device takes its own gradients, reduced once below.
            local = jax.lax.pcast(params, "data", to="varying")
            loss, grads = mpx.value_and_grad(loss_fn, opt_state)(local)
            if reduce_dtype == "pmean":
                grads = jax.lax.pmean(grads, "data")
            else:
                grads = mpx.parallel.all_reduce_gradients(grads, "data", reduce_dtype=reduce_dtype)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = mpx.apply_updates(params, updates)
            # Every device's own copy, stacked, to show they agree.
            mine = jax.tree.map(lambda x: x[None], (params, opt_state.loss_scale, opt_state.skipped_steps))
            return params, opt_state, mine

        return jax.jit(jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P("data"))))

    SHAPE = re.compile(r"\\b(f16|bf16|f32|f64)\\[([0-9,]*)\\]")
    BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}

    def all_reduces(hlo):
        # (dtype, bytes) of every all-reduce operand; the result shapes are the operands'.
        found = []
        for line in hlo.splitlines():
            if "all-reduce(" not in line and "all-reduce-start(" not in line:
                continue
            result = line.split("=", 1)[1].split("all-reduce", 1)[0]
            for dt, dims in SHAPE.findall(result):
                found.append((dt, BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))))
        return found

    state = tx.init(params)
    report = {}
    for name in ("pmean", "float32", "bfloat16", "float16"):
        step = make_step(name)
        lowered = step.lower(params, state, batch)
        report[name] = {
            "lowered": all_reduces(lowered.as_text(dialect="hlo")),
            "compiled": all_reduces(lowered.compile().as_text()),
        }

    # Several finite steps, then an inf in device 2's rows of the batch only.
    step = make_step("float16")
    p, s = params, state
    for _ in range(3):
        p, s, mine = step(p, s, batch)
    before = jax.device_get((p, s))
    bad = dict(batch, x=batch["x"].at[2 * 8 + 3, 5].set(jnp.inf))
    p2, s2, mine = step(p, s, bad)
    mine = jax.device_get(mine)
    after = jax.device_get((p2, s2))
    report["skip"] = {
        "skipped_per_device": mine[2].tolist(),
        "scale_per_device": mine[1].tolist(),
        "scale_before": float(before[1].loss_scale),
        "rows_equal": all(
            all(np.asarray(x[i]).tobytes() == np.asarray(x[0]).tobytes() for i in range(n))
            for x in jax.tree.leaves(mine[0])
        ),
        "params_untouched": all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0]))
        ),
    }

    # The reduction itself on 4 real devices, against a float64 NumPy mean.
    rng = np.random.default_rng(0)
    local = rng.standard_normal((n, 16, 8)) * np.exp2(rng.integers(-12, 14, (n, 16, 8)))
    local[:, 0, 0] = 30000.0  # 4 * 30000 overflows float16 unless divided first
    sharded = jax.device_put(jnp.asarray(local, jnp.float32), NamedSharding(mesh, P("data")))
    report["numerics"] = {}
    for dt in ("float16", "bfloat16"):
        reduce = jax.jit(jax.shard_map(
            lambda g: mpx.parallel.all_reduce_gradients(g[0], "data", reduce_dtype=dt),
            mesh=mesh, in_specs=P("data"), out_specs=P()))
        got = np.asarray(reduce(sharded), np.float64)
        want = local.mean(axis=0)
        eps = float(jnp.finfo(dt).eps) + float(jnp.finfo(jnp.float32).eps)
        bound = (n + 1) * eps * np.abs(local).mean(axis=0)
        report["numerics"][dt] = {
            "finite": bool(np.isfinite(got).all()),
            "worst_over_bound": float((np.abs(got - want) / bound).max()),
        }

    # FSDP under shard_map: mpx.parallel.all_gather_params gathers in the compute dtype and
    # reduce-scatters the gradients in reduce_dtype; against jax.grad of the whole batch.
    fsdp_specs = {"w1": P("data", None), "b1": P(), "w2": P(None, "data")}
    fsdp_params = dict(params, b1=jnp.full(64, 0.1))
    sharded_params = jax.device_put(
        fsdp_params, {k: NamedSharding(mesh, v) for k, v in fsdp_specs.items()})

    def mlp_loss(p, x, y):
        out = (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    reference = jax.grad(mlp_loss)(fsdp_params, batch["x"], batch["y"])
    COLLECTIVE = re.compile(r"= (\\w+)\\[[^\\]]*\\][^ ]* (all-gather|reduce-scatter|all-reduce)\\(")
    report["fsdp"] = {}
    for dt, rdt, vma in [("float32", None, True), ("bfloat16", None, True),
                         ("bfloat16", "float32", True), ("float16", None, True),
                         ("float16", None, False)]:
        def fsdp_grads(p, x, y, dt=dt, rdt=rdt):
            def loss(p):
                full = mpx.parallel.all_gather_params(p, fsdp_specs, "data", dtype=dt, reduce_dtype=rdt)
                return mlp_loss(full, x.astype(dt), y)
            return jax.grad(loss)(p)
        fn = jax.jit(jax.shard_map(fsdp_grads, mesh=mesh, in_specs=(fsdp_specs, P("data"), P("data")),
                                   out_specs=fsdp_specs, check_vma=vma))
        got = fn(sharded_params, batch["x"], batch["y"])
        lowered = fn.lower(sharded_params, batch["x"], batch["y"]).as_text(dialect="hlo")
        report["fsdp"][f"{dt}-{rdt}-{vma}"] = {
            "collectives": sorted(set(COLLECTIVE.findall(lowered))),
            "dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(got)}),
            "shardings_kept": all(
                got[k].sharding.is_equivalent_to(NamedSharding(mesh, fsdp_specs[k]), got[k].ndim)
                for k in got
            ),
            "relative_error": {
                k: float(jnp.abs(got[k] - reference[k]).max() / jnp.abs(reference[k]).max())
                for k in got
            },
        }

    # A whole FSDP step under float16 loss scaling: the skip is decided by one pmin of an
    # int32 scalar, and an inf in one device's rows skips the step on every device.
    import functools
    fsdp_tx = mpx.mixed_precision(
        optax.sgd(0.1), policy,
        loss_scale=functools.partial(mpx.dynamic_loss_scale, axis_name="data"))
    fsdp_state = fsdp_tx.init(sharded_params)
    state_specs = jax.tree.map(
        lambda s: s.spec, mpx.parallel.state_shardings(fsdp_state, sharded_params))

    def fsdp_step(p, s, x, y):
        def loss(p):
            full = mpx.parallel.all_gather_params(p, fsdp_specs, "data", dtype=policy.compute_dtype)
            return mlp_loss(full, policy.cast_to_compute(x), y)
        _, grads = mpx.value_and_grad(loss, s)(p)
        updates, s = fsdp_tx.update(grads, s, p)
        return mpx.apply_updates(p, updates), s, s.skipped_steps[None]

    step_fn = jax.jit(jax.shard_map(
        fsdp_step, mesh=mesh, in_specs=(fsdp_specs, state_specs, P("data"), P("data")),
        out_specs=(fsdp_specs, state_specs, P("data"))))
    hlo = step_fn.lower(sharded_params, fsdp_state, batch["x"], batch["y"]).as_text(dialect="hlo")
    bad_x = batch["x"].at[2 * 8 + 3, 5].set(jnp.inf)
    new_p, new_s, skipped = step_fn(sharded_params, fsdp_state, bad_x, batch["y"])
    report["fsdp_step"] = {
        "scalar_all_reduces": [
            line.split("=", 1)[1].split("all-reduce", 1)[0].strip().split("{")[0]
            for line in hlo.splitlines() if " all-reduce(" in line and "[]" in line.split("=", 1)[1].split("all-reduce", 1)[0]
        ],
        "skipped_per_device": jax.device_get(skipped).tolist(),
        "params_untouched": all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(sharded_params))),
    }

    # Replicated params without pcast: JAX has already summed the gradients.
    def already_summed(params, batch):
        grads = jax.grad(lambda p: jnp.sum(batch["x"] @ p["w1"]))(params)
        return mpx.parallel.all_reduce_gradients(grads, "data", reduce_dtype="float16")
    try:
        jax.jit(jax.shard_map(already_summed, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(params, batch)
        report["invariant_error"] = None
    except mpx.ConfigError as e:
        report["invariant_error"] = str(e)
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=180
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _gradient_reductions(found):
  # The gradients are the non-scalar all-reduces (the loss-scale check adds none here:
  # the reduced gradients are already the same everywhere).
  return [(dt, size) for dt, size in found if size > 4]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_program_reduces_the_gradients_in_the_half_dtype(report, dtype):
  short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
  lowered = _gradient_reductions(report[dtype]["lowered"])
  assert lowered and {dt for dt, _ in lowered} == {short}, lowered


@pytest.mark.slow
def test_the_compiled_float16_step_communicates_half_the_bytes_of_float32(report):
  half = _gradient_reductions(report["float16"]["compiled"])
  full = _gradient_reductions(report["float32"]["compiled"])
  assert {dt for dt, _ in half} == {"f16"} and {dt for dt, _ in full} == {"f32"}, (half, full)
  # The same gradients, half the bytes; pmean and a float32 reduce_dtype send the same.
  assert sum(s for _, s in half) * 2 == sum(s for _, s in full)
  assert sorted(report["pmean"]["compiled"]) == sorted(report["float32"]["compiled"])


def test_gradients_shard_map_already_summed_are_an_error_naming_the_fix(report):
  message = report["invariant_error"]
  assert message is not None
  assert "'b1' does not vary along 'data'" in message
  assert "jax.lax.pcast(params, 'data', to='varying')" in message


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_on_four_devices_it_matches_a_numpy_mean(report, dtype):
  numerics = report["numerics"][dtype]
  assert numerics["finite"]  # the division before the sum keeps float16 in range
  assert numerics["worst_over_bound"] <= 1.0


def test_an_inf_in_one_devices_batch_skips_the_step_on_every_device(report):
  skip = report["skip"]
  assert skip["skipped_per_device"] == [1, 1, 1, 1]
  assert skip["scale_per_device"] == [skip["scale_before"] / 2] * 4
  assert skip["rows_equal"] and skip["params_untouched"]


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@pytest.mark.parametrize(
  "case",
  [
    "float32-None-True",
    "bfloat16-None-True",
    "bfloat16-float32-True",
    "float16-None-True",
    "float16-None-False",
  ],
)
def test_all_gather_params_gathers_in_dtype_and_reduce_scatters_in_reduce_dtype(report, case):
  dtype, reduce_dtype, _ = case.split("-")
  reduce_dtype = dtype if reduce_dtype == "None" else reduce_dtype
  found = report["fsdp"][case]
  kinds = {
    kind: {dt for dt, k in found["collectives"] if k == kind} for _, kind in found["collectives"]
  }
  # The sharded weights are gathered in the compute dtype; their gradients come back
  # reduce-scattered, and the replicated bias's all-reduced, in reduce_dtype.
  assert kinds["all-gather"] == {_SHORT[dtype]}, found
  assert kinds["reduce-scatter"] == {_SHORT[reduce_dtype]}, found
  assert _SHORT[reduce_dtype] in kinds["all-reduce"], found
  # The mean over the devices of the whole batch's gradients, in the params' dtype and
  # on their shards: within a few roundings of the compute dtype.
  assert found["dtypes"] == ["float32"] and found["shardings_kept"]
  tolerance = 1e-5 if dtype == "float32" else 4 * float(jnp.finfo(dtype).eps)
  assert max(found["relative_error"].values()) <= tolerance, found


def test_an_fsdp_step_decides_the_skip_with_one_scalar_all_reduce(report):
  step = report["fsdp_step"]
  # The finite check of the sharded gradients: one pmin of the int32 leaf code.
  assert step["scalar_all_reduces"] == ["s32[]"], step
  assert step["skipped_per_device"] == [1, 1, 1, 1] and step["params_untouched"], step


def test_all_gather_params_errors_name_the_problem():
  from jax.sharding import PartitionSpec as P

  params = {"w": jnp.ones((2, 4, 4))}

  def call(specs):
    return jax.vmap(
      lambda p: mpx.parallel.all_gather_params(p, specs, "data", dtype="bfloat16"), axis_name="data"
    )(params)

  with pytest.raises(mpx.ConfigError, match=r"'w' is split over \('data', 'model'\)"):
    call({"w": P(("data", "model"), None)})
  with pytest.raises(mpx.TreeStructureError, match="structure of params"):
    call({"v": P("data")})
  with pytest.raises(mpx.ConfigError, match="not a mapped axis"):
    mpx.parallel.all_gather_params(params, {"w": P("data")}, "data", dtype="bfloat16")


# ---------------------------------------------------------------------------
# mpx.parallel.state_shardings: the optimizer state placed like the params.
# ---------------------------------------------------------------------------


def _sharded_params(dtype=jnp.bfloat16):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  specs = {"w1": P("data", "model"), "w2": P(None, "data"), "b": P()}
  shapes = {"w1": (64, 128), "w2": (128, 64), "b": (64,)}
  return {
    k: jax.device_put(jnp.ones(shapes[k], dtype), NamedSharding(mesh, specs[k])) for k in specs
  }


def _specs(tree):
  # Trailing Nones do not change a placement; strip them to compare specs.
  def norm(s):
    parts = list(s.spec)
    while parts and parts[-1] is None:
      parts.pop()
    return jax.sharding.PartitionSpec(*parts)  # a pytree leaf, unlike a tuple

  return jax.tree.map(norm, tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


@pytest.mark.parametrize(
  "name",
  [
    "mixed_precision_adam",
    "masters_of_some_params",
    "kahan_adamw",
    "int8_moments",
    "chain_over_a_tuple",
  ],
)
def test_state_shardings_agree_with_the_eager_init_placement(name):
  import optax
  from jax.sharding import PartitionSpec as P

  params = _sharded_params()
  policy = "params=bfloat16,compute=bfloat16,output=float32"
  if name == "mixed_precision_adam":
    tx = mpx.mixed_precision(optax.adam(1e-3), policy)
  elif name == "masters_of_some_params":  # a float32 param (a norm scale) has no master: None
    params["b"] = params["b"].astype(jnp.float32)
    tx = mpx.mixed_precision(optax.adam(1e-3), policy)
  elif name == "kahan_adamw":
    tx = mpx.with_kahan_summation(optax.adamw(1e-3))
  elif name == "int8_moments":
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    tx = mpx.with_state_dtype(optax.adam(1e-3), "int8", min_size=1024)
  else:  # optax.chain's state is a tuple, like these params: it must not pass for them
    params = (params["w1"], params["w2"])
    tx = optax.chain(optax.scale_by_adam(), optax.scale(-1e-3))
  state = tx.init(params)
  shardings = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), params)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)
  specs = _specs(shardings)
  if name == "chain_over_a_tuple":  # optax's own init: no placement of its own to compare
    assert specs[0].mu == specs[0].nu == (P("data", "model"), P(None, "data"))
    assert specs[0].count == P()
    return
  # mpx's eager init places its state on the params (tree.place_state): the same specs.
  assert specs == _specs(jax.tree.map(lambda a: a.sharding, state))
  for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(state), strict=True):
    if leaf.ndim == 0:  # counts, the loss scale: replicated
      assert spec == P()
  assert P("data", "model") in jax.tree.leaves(specs)
  if name == "masters_of_some_params":
    assert specs.inner_state.master_params == {
      "w1": P("data", "model"),
      "w2": P(None, "data"),
      "b": None,
    }


def test_state_shardings_shard_quantised_codes_like_the_param_and_flat_scales_not():
  import optax

  params = jax.tree.map(lambda p: p.astype(jnp.float32), _sharded_params())
  tx = mpx.with_state_dtype(optax.adam(1e-3), "int8", min_size=1024)
  shardings = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), params)
  mu = shardings[0].mu["w1"]
  assert isinstance(mu, mpx.QuantizedMoment)
  codes, scales = _specs(tuple(mu))  # the shardings, as normalised specs
  assert codes == jax.sharding.PartitionSpec("data", "model")
  # One scale per block of the flattened moment: no axis of the param's size to share.
  assert scales == jax.sharding.PartitionSpec()


def test_state_shardings_need_named_shardings_and_name_the_leaf():
  import optax

  params = {"layer": {"kernel": jnp.ones((4, 4))}}
  tx = optax.adam(1e-3)
  with pytest.raises(mpx.ConfigError, match=r"'layer/kernel'.*NamedSharding"):
    mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), params)
