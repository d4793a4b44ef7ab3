"""Layout (c) on 8 forced CPU devices: buffers and moments follow their params' NamedSharding.

Kahan buffers and (bfloat16) moments are placed on each param's sharding, the
step makes no host round trip, and the random numbers of stochastic rounding do
not depend on the sharding: a sharded run is bitwise the unsharded one.
"""

import os
import subprocess
import sys
import textwrap

import pytest

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
        "kernel": jnp.linspace(-1, 1, 64).reshape(16, 4).astype(jnp.bfloat16),
        "bias": jnp.zeros(4, jnp.bfloat16),
        "scale": jnp.ones(8, jnp.float32),
    }
    grads = {
        "kernel": jnp.linspace(-1e-3, 1e-3, 64).reshape(16, 4).astype(jnp.bfloat16),
        "bias": jnp.full(4, 3e-4, jnp.bfloat16),
        "scale": jnp.full(8, 1e-3, jnp.float32),
    }

    def make(kind):
        inner = mpx.with_state_dtype(optax.sgd(1.0, momentum=0.9), state_dtype=jnp.bfloat16)
        if kind == "kahan":
            wrapped = mpx.with_kahan_summation(inner)
        else:
            wrapped = mpx.with_stochastic_rounding(inner, key=jax.random.key(0))
        return mpx.mixed_precision(wrapped, "bfloat16", master_dtype=None)

    def check(kind, state, params):
        inner = state.inner_state
        momentum = inner.inner_state[0].trace
        for name, sharding in shardings.items():
            assert params[name].sharding.is_equivalent_to(sharding, params[name].ndim), (name, params[name].sharding)
            assert momentum[name].sharding.is_equivalent_to(sharding, momentum[name].ndim), (name, momentum[name].sharding)
            assert momentum[name].dtype == jnp.bfloat16
            if kind == "kahan" and inner.compensation[name] is not None:
                c = inner.compensation[name]
                assert c.sharding.is_equivalent_to(sharding, c.ndim), (name, c.sharding)
        buffers = inner.compensation if kind == "kahan" else inner.keys
        assert buffers["scale"] is None and buffers["kernel"] is not None

    def train(kind, params, grads, sharded):
        tx = make(kind)
        state = tx.init(params)  # eager init places buffers and moments
        if sharded:
            check(kind, state, params)

        @jax.jit
        def step(params, state):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        params, state = step(params, state)  # compiles; places every leaf
        with jax.transfer_guard("disallow"):  # no host round trip inside the step
            for _ in range(5):
                params, state = step(params, state)
        if sharded:
            check(kind, state, params)
        return jax.device_get((params, state))

    for kind in ("kahan", "rounding"):
        sharded = train(kind, jax.device_put(params, shardings), jax.device_put(grads, shardings), True)
        single = train(kind, params, grads, False)
        assert jax.tree.structure(sharded) == jax.tree.structure(single)
        for x, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), kind  # bitwise
        moved = sharded[0]["kernel"] != params["kernel"]
        assert moved.any(), kind
    print("OK")
    """
)


@pytest.mark.slow
def test_buffers_and_moments_share_param_sharding_and_rounding_ignores_it():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=180
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("OK")
