"""Sharded training on 8 forced CPU devices.

Masters and moments follow their params' NamedSharding, the step makes no host
round trip, and the finite decision of loss scaling is global under ``jit``: an
inf in one device's shard skips the step on every device.
"""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mpx

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(jax.devices(), ("data",))
    shardings = {
        "kernel": NamedSharding(mesh, P("data", None)),
        "bias": NamedSharding(mesh, P()),
        "scale": NamedSharding(mesh, P("data")),
    }
    params = {
        "kernel": jnp.ones((16, 4), jnp.float16),
        "bias": jnp.zeros(4, jnp.float16),
        "scale": jnp.ones(8, jnp.float32),
    }
    params = jax.device_put(params, shardings)
    tx = mpx.mixed_precision(optax.sgd(0.1, momentum=0.9), "float16")

    def check(state, params):
        masters = state.inner_state.master_params
        momentum = state.inner_state.inner_state[0].trace
        for name, sharding in shardings.items():
            assert params[name].sharding.is_equivalent_to(sharding, params[name].ndim), (name, params[name].sharding)
            assert momentum[name].sharding.is_equivalent_to(sharding, momentum[name].ndim), (name, momentum[name].sharding)
            if masters[name] is not None:
                assert masters[name].sharding.is_equivalent_to(sharding, masters[name].ndim), (name, masters[name].sharding)
        assert masters["scale"] is None and masters["kernel"].dtype == jnp.float32

    # Eager init places masters and moments on their params' shardings; under
    # jax.jit(tx.init) shardings are unknown while tracing: pass out_shardings.
    state = tx.init(params)
    check(state, params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return mpx.apply_updates(params, updates), state

    grads = jax.tree.map(lambda p: jnp.ones_like(p) * jnp.asarray(2.0**-4, p.dtype), params)
    params, state = step(params, state, grads)  # compiles; places every leaf on the mesh
    with jax.transfer_guard("disallow"):  # no host round trip inside the step
        for _ in range(3):
            params, state = step(params, state, grads)
    check(state, params)

    # One inf in the rows of the kernel that live on device 3 only.
    bad = dict(grads, kernel=grads["kernel"].at[6, 1].set(jnp.inf))
    assert bad["kernel"].sharding.is_equivalent_to(shardings["kernel"], 2)
    new_params, new_state = step(params, state, bad)
    assert int(new_state.skipped_steps) == int(state.skipped_steps) + 1
    assert float(new_state.loss_scale) == float(state.loss_scale) / 2
    before = jax.device_get((params, state.inner_state))
    after = jax.device_get((new_params, new_state.inner_state))
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()  # every shard untouched
    print("OK")
    """
)


def test_masters_and_moments_share_param_sharding():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("OK")
