"""8-bit moments and remainder masters on 8 forced CPU devices.

Codes and remainders take their param's NamedSharding, scales keep the
param's leading axes where the trailing ones hold whole blocks (replicated
otherwise), the jitted step makes no host round trip, and a sharded run is
bitwise the single-device run except in the float32 masters, where XLA's
sharded and single-device programs round a few sums differently (layout (b)'s
float32 masters differ in the same elements, by one ulp): the remainder
layout's masters are bitwise layout (b)'s on either placement.
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
    specs = {
        "kernel": P("data", None),  # (64, 512): scales (64, 2), sharded like the rows
        "square": P(None, "data"),  # (64, 64): blocks span rows, scales (16,) replicated
        "bias": P(),  # 512 elements, below min_size: float32 moments
    }
    shardings = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    params = {
        "kernel": jnp.linspace(-1, 1, 64 * 512).reshape(64, 512).astype(jnp.bfloat16),
        "square": jnp.linspace(-1, 1, 64 * 64).reshape(64, 64).astype(jnp.bfloat16),
        "bias": jnp.zeros(512, jnp.bfloat16),
    }
    grads = jax.tree.map(
        lambda p: (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) * 0.37).reshape(p.shape) * 1e-2
                   ).astype(jnp.bfloat16),
        params,
    )

    def standard(tx):
        def update(u, s, p=None, **kw):
            with jax.numpy_dtype_promotion("standard"):
                return tx.update(u, s, p, **kw)
        return optax.GradientTransformationExtraArgs(tx.init, update)

    def make(fmt, remainder=True):
        inner = mpx.with_state_dtype(standard(optax.adamw(1e-2)), state_dtype=fmt)
        if not remainder:  # layout (b): float32 masters
            return mpx.mixed_precision(inner, "bfloat16")
        return mpx.mixed_precision(
            mpx.with_master_params(inner, remainder=True), "bfloat16", master_dtype=None
        )

    def check(state, params):
        inner = state.inner_state
        adam = inner.inner_state[0]
        for name, sharding in shardings.items():
            p = params[name]
            assert p.sharding.is_equivalent_to(sharding, p.ndim), (name, p.sharding)
            r = inner.remainders[name]
            assert r.dtype == jnp.int16 and r.sharding.is_equivalent_to(sharding, r.ndim), name
            for moment in (adam.mu[name], adam.nu[name]):
                if name == "bias":
                    assert moment.dtype == jnp.float32
                    continue
                codes, scales = moment
                assert codes.sharding.is_equivalent_to(sharding, codes.ndim), (name, codes.sharding)
                want = NamedSharding(mesh, P("data") if name == "kernel" else P())
                assert scales.sharding.is_equivalent_to(want, scales.ndim), (name, scales.sharding)
        assert adam.mu["kernel"].scales.shape == (64, 2)
        assert adam.mu["square"].scales.shape == (16,)

    def train(fmt, params, grads, sharded, remainder=True):
        tx = make(fmt, remainder)
        state = tx.init(params)  # eager init places remainders, codes and scales
        if sharded and remainder:
            check(state, params)
        in_shardings = jax.tree.map(lambda x: x.sharding, (params, state)) if sharded else None

        @jax.jit
        def step(params, state):
            updates, state = tx.update(grads, state, params)
            return mpx.apply_updates(params, updates), state

        if sharded:  # the step returns every leaf where init put it
            step = jax.jit(step, in_shardings=in_shardings, out_shardings=in_shardings)
        params, state = step(params, state)
        with jax.transfer_guard("disallow"):  # no host round trip inside the step
            for _ in range(5):
                params, state = step(params, state)
        if sharded and remainder:
            check(state, params)
        return jax.device_get((params, state, mpx.get_master_params(state, params)))

    def assert_bitwise(a, b, what):
        assert jax.tree.structure(a) == jax.tree.structure(b), what
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), what

    placed = jax.device_put(params, shardings), jax.device_put(grads, shardings)
    for fmt in ("int8", "float8_e4m3fn"):
        sharded = train(fmt, *placed, True)
        single = train(fmt, params, grads, False)
        # Params, codes, scales and counts: bitwise the single-device run.
        assert_bitwise(sharded[0], single[0], fmt)
        assert_bitwise(
            sharded[1].inner_state.inner_state, single[1].inner_state.inner_state, fmt
        )
        # Masters: bitwise layout (b)'s on the same placement.
        assert_bitwise(sharded[2], train(fmt, *placed, True, remainder=False)[2], fmt)
        assert_bitwise(single[2], train(fmt, params, grads, False, remainder=False)[2], fmt)
        assert (sharded[0]["kernel"] != params["kernel"]).any(), fmt
    print("OK")
    """
)


@pytest.mark.slow
def test_codes_scales_and_remainders_follow_the_params_sharding_bitwise():
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=180
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("OK")
