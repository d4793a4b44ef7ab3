"""Masters and moments follow their params' NamedSharding (8 forced CPU devices)."""

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
        return mpx.apply_updates(params, updates, state), state

    grads = jax.tree.map(lambda p: jnp.ones_like(p) * jnp.asarray(2.0**-4, p.dtype), params)
    params, state = step(params, state, grads)  # compiles; places every leaf on the mesh
    with jax.transfer_guard("disallow"):  # no host round trip inside the step
        for _ in range(3):
            params, state = step(params, state, grads)
    check(state, params)
    print("OK")
    """
)


def test_masters_and_moments_share_param_sharding():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("OK")
