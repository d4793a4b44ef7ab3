"""Fully sharded (FSDP-style) and tensor-parallel layouts on a 2-D mesh of 8 forced CPU devices.

``mpx.mixed_precision(optax.adam(...))`` with float16 params and float32
masters: ``init`` runs under ``jit`` with ``out_shardings`` that give every
master and moment its param's sharding; the compiled step moves no float32
array between devices except scalars (the masters and moments are the only
float32 arrays of the param's size, so none is gathered), makes no host
transfer (HLO text, and the steps run under ``jax.transfer_guard("disallow")``),
and trains as one device does.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

LAYOUTS = ("fsdp", "tp", "fsdp_tp")
# One 8-device subprocess serves every test here: CI's slow pass, not the README's command.
pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
  """
    import json, re
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mpx

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 8, jax.devices()


    def standard_promotion(tx):  # optax's adam bias correction needs standard promotion
        def update(u, s, p=None, **kw):
            with jax.numpy_dtype_promotion("standard"):
                return tx.update(u, s, p, **kw)
        return optax.GradientTransformationExtraArgs(tx.init, update)


    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    policy = mpx.get_policy("params=float16,compute=float16,output=float32")
    tx = mpx.mixed_precision(standard_promotion(optax.adam(1e-3)), policy)
    LAYOUTS = {
        "fsdp": {"w1": P("data", None), "w2": P("data", None)},
        "tp": {"w1": P(None, "model"), "w2": P("model", None)},
        "fsdp_tp": {"w1": P("data", "model"), "w2": P("model", "data")},
    }
    key = jax.random.key(0)
    params0 = policy.cast_to_param({
        "w1": jax.random.normal(key, (256, 512)) / 16,
        "w2": jax.random.normal(jax.random.fold_in(key, 1), (512, 256)) / 23,
    })
    batches = [
        {"x": jax.random.normal(jax.random.fold_in(key, 10 + i), (32, 256)),
         "y": jax.random.normal(jax.random.fold_in(key, 20 + i), (32, 256))}
        for i in range(3)
    ]

    def loss_fn(p, b):
        p, x = policy.cast_to_compute((p, b["x"]))
        out = (jnp.tanh(x @ p["w1"]) @ p["w2"]).astype(jnp.float32)
        return jnp.mean((out - b["y"]) ** 2)

    def step(params, opt_state, batch):
        loss, grads = mpx.value_and_grad(loss_fn, opt_state)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return mpx.apply_updates(params, updates), opt_state, loss

    SHAPE = re.compile(r"\\b(pred|s32|u32|f16|bf16|f32)\\[([0-9,]*)\\]")
    COLLECTIVE = re.compile(
        r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\\("
    )

    def collectives(hlo):
        found = []
        for line in hlo.splitlines():
            m = COLLECTIVE.search(line)
            if m:
                shapes = [(dt, dims) for dt, dims in SHAPE.findall(m.group(1))]
                found.append([m.group(2), shapes])
        return found

    def host_ops(hlo):
        ops = re.findall(r" (send|recv|infeed|outfeed|send-done|recv-done)\\(", hlo)
        ops += re.findall(r'custom_call_target="([^"]*(?:callback|host)[^"]*)"', hlo, re.I)
        return ops

    # The reference: the same steps on one device, unsharded.
    ref_params, ref_state = params0, tx.init(params0)
    one = jax.jit(step)
    for b in batches:
        ref_params, ref_state, _ = one(ref_params, ref_state, b)

    report = {}
    for name, specs in LAYOUTS.items():
        psh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
        params = jax.device_put(params0, psh)
        ssh = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params0), params)
        bsh = NamedSharding(mesh, P("data"))
        rep = NamedSharding(mesh, P())
        opt_state = jax.jit(tx.init, out_shardings=ssh)(params)
        sharded = jax.jit(step, in_shardings=(psh, ssh, bsh), out_shardings=(psh, ssh, rep),
                          donate_argnums=(0, 1))
        hlo = sharded.lower(params, opt_state, batches[0]).compile().as_text()
        data = [jax.device_put(b, bsh) for b in batches]
        with jax.transfer_guard("disallow"):
            for b in data:
                params, opt_state, loss = sharded(params, opt_state, b)
        masters = opt_state.inner_state.master_params
        adam = opt_state.inner_state.inner_state[0]
        placed = all(
            tree[k].sharding.is_equivalent_to(psh[k], 2)
            for tree in (params, masters, adam.mu, adam.nu) for k in psh
        )
        got = jax.device_get({"params": params, "masters": masters, "mu": adam.mu})
        want = jax.device_get({
            "params": ref_params,
            "masters": ref_state.inner_state.master_params,
            "mu": ref_state.inner_state.inner_state[0].mu,
        })
        # Float16 forward and backward: the partitioned program rounds partial sums to
        # float16 where one device does not. Adam's first moment is linear in the gradients:
        # within 4 float16 roundings of its largest magnitude. Adam's update divides by the
        # gradient's own size, so a tiny gradient that flips moves a weight by up to 2 lr:
        # every master stays within 2 lr per step, and only a few in 10,000 leave the
        # float16 tolerance (a wrong or missing update moves nearly all of them by ~lr).
        def off(g, w):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            return np.abs(g - w), 4 * 2.0**-11 * np.abs(w).max()
        mu_ok = all(
            bool((d <= tol).all()) for d, tol in (off(got["mu"][k], want["mu"][k]) for k in psh)
        )
        master_max = max(float(off(got["masters"][k], want["masters"][k])[0].max()) for k in psh)
        master_frac = max(
            float((d > tol).mean()) for d, tol in (off(got["masters"][k], want["masters"][k]) for k in psh)
        )
        report[name] = {
            "collectives": collectives(hlo),
            "host_ops": host_ops(hlo),
            "placed": placed,
            "masters_dtype": str(masters["w1"].dtype),
            "mu_within_f16_tolerance": mu_ok,
            "masters_max_diff_in_lr": master_max / 1e-3,
            "masters_fraction_beyond_f16_tolerance": master_frac,
            "skipped_steps": int(opt_state.skipped_steps),
        }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masters_and_moments_are_sharded_like_their_params(report, layout):
  assert report[layout]["placed"]
  assert report[layout]["masters_dtype"] == "float32"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_step_gathers_no_optimizer_state(report, layout):
  found = report[layout]["collectives"]
  assert found  # the layouts do communicate: params gathered, activations reduced
  for kind, shapes in found:
    for dtype, dims in shapes:
      # Masters and moments are the only float32 arrays of a param's size; float32
      # collectives carry scalars only (the loss). The finite check gathers flags (pred).
      assert dtype != "f32" or dims == "", (kind, shapes)
      # The finite check's row flags: at most one per 32 of the 262,144 gradient elements.
      if dtype == "pred":
        assert math.prod(int(d) for d in dims.split(",") if d) <= 262_144 // 32, (kind, shapes)
  if layout.startswith("fsdp"):  # the params themselves are gathered, in float16
    assert any(kind == "all-gather" for kind, _ in found), found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_step_makes_no_host_transfer(report, layout):
  assert report[layout]["host_ops"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_training_matches_one_device(report, layout):
  assert report[layout]["skipped_steps"] == 0
  r = report[layout]
  assert r["mu_within_f16_tolerance"]
  assert r["masters_max_diff_in_lr"] <= 2 * 3  # 3 steps of at most 2 lr
  assert r["masters_fraction_beyond_f16_tolerance"] <= 1e-3
