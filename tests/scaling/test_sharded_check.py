"""The finite check under GSPMD: one scalar collective per step, the sharding of each leaf kept.

A float16 FSDP train step (``jit`` over params split along their rows, the
batch along the same axis) on 4 forced CPU devices, in one subprocess: the
collectives of the compiled program with dynamic loss scaling against the same
step without it (loss scaling must add exactly one all-reduce, of an int32
scalar), and a step whose only non-finite gradient element lies in the last
device's rows of one sharded leaf: skipped on every device, that leaf named,
the params untouched.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
  """
    import collections, json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mpx
    from mpx._src.audit import compiled

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sizes = [64, 128, 128, 32]
    params = {}
    for i in range(3):
        params[f"w{i}"] = jnp.full((sizes[i], sizes[i + 1]), 1 / 16, jnp.float32)
        params[f"b{i}"] = jnp.zeros((sizes[i + 1],), jnp.float32)
    params["odd"] = jnp.ones((6, 5), jnp.float32)  # not split evenly: replicated
    specs = {k: P("data", None) if k.startswith("w") else P() for k in params}
    policy = mpx.get_policy("mixed_float16")

    def loss_fn(p, batch):
        # The poison term's gradient is batch["poison"] itself, in w1's shape and sharding.
        poison = jnp.sum(p["w1"] * batch["poison"])
        p, x = policy.cast_to_compute((p, batch["x"]))
        for i in range(3):
            x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.mean(x.astype(jnp.float32) ** 2) + jnp.sum(p["odd"]) + poison

    def compiled_step(loss_scale):
        tx = mpx.mixed_precision(optax.adam(1e-3), policy, loss_scale=loss_scale)
        placed = jax.device_put(params, {k: NamedSharding(mesh, v) for k, v in specs.items()})
        shardings = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), placed)
        state = jax.jit(tx.init, out_shardings=shardings)(placed)

        def step(p, s, batch):
            loss, grads = mpx.value_and_grad(loss_fn, s)(p, batch)
            updates, s = tx.update(grads, s, p)
            return mpx.apply_updates(p, updates), s, loss

        return jax.jit(step), placed, state

    def batch(poison):
        x = jnp.ones((32, 64), jnp.float32)
        extra = jnp.zeros((128, 128), jnp.float32)
        if poison:  # an inf in w1's gradient, in the last device's rows (96 to 127)
            extra = extra.at[120, 3].set(jnp.inf)
        sharding = NamedSharding(mesh, P("data"))
        return {"x": jax.device_put(x, sharding), "poison": jax.device_put(extra, sharding)}

    report = {}
    for name, loss_scale in (("none", None), ("dynamic", "dynamic")):
        step, placed, state = compiled_step(loss_scale)
        text = step.lower(placed, state, batch(False)).compile().as_text()
        report[name] = [
            [c["kind"], c["dtype"].name, c["bytes"]] for c in compiled.collectives(text)
        ]
    step, placed, state = compiled_step("dynamic")
    new_params, state, loss = step(placed, state, batch(True))
    report["skip"] = {
        "skipped_steps": int(state.skipped_steps),
        "nonfinite_leaf": mpx.nonfinite_gradient_paths(state, params),
        "params_unchanged": all(
            bool(jnp.array_equal(new_params[k], placed[k])) for k in params
        ),
    }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report():
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loss_scaling_adds_one_scalar_all_reduce(report):
  added = list(report["dynamic"])
  for collective in report["none"]:
    added.remove(collective)  # every collective of the step without loss scaling is kept
  assert added == [["all-reduce", "int32", 4]], report


@pytest.mark.slow
def test_an_inf_on_one_shard_skips_the_step_everywhere(report):
  skip = report["skip"]
  assert skip["skipped_steps"] == 1 and skip["params_unchanged"]
  assert skip["nonfinite_leaf"] == ["w1"], skip
