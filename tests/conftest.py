"""Test settings: strict dtype promotion, so a silent float32 upcast is an error.

Compiling dominates the suite's time on CPU, so LLVM's backend optimisations
are off (``--xla_backend_optimization_level=0``, as the docs pages and the
demo's ``--quick`` run): the HLO programs, fusions and cost figures are
XLA's own and unchanged, and without fast-math flags LLVM's optimisations
change no floating-point result. XLA:CPU's older elemental emitters
(``--xla_cpu_use_fusion_emitters=false``) compile the same fusions in
about two thirds of the CPU time (tests/adapters/test_linen_transforms.py:
117 CPU-s against 186); the multi-process and cross-mesh tests found their
figures bitwise unchanged.
"""

import os
import pathlib

# The suite runs on the CPU (subprocesses, the examples and docs pages, inherit the setting). The
# GPU-target tests compile for CUDA devices without a GPU through jax's CUDA plugin, which mpx
# loads when they ask for it (mpx._src.audit.toolchain).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
  ]
).strip()

import jax  # after XLA_FLAGS, which the backend reads when it starts
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _strict_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield


# The tests mirror the packages of mpx/_src (tests/scaling, tests/optim, ...); tests/integration
# trains models end to end through several packages; tests/repo tests the repository around the
# library (docs pages, the demo, the examples, the benchmark scripts, multi-process runs).
# ``pytest`` (the README's test command) runs the library's tests in a few minutes; the tests
# marked ``slow`` (all of tests/repo but the public API, whole-model GPU-target compiles) run in CI
# after it, with ``pytest -m slow``.
_REPO = pathlib.Path(__file__).resolve().parent / "repo"
_FAST_IN_REPO = frozenset({"test_public_api.py"})


def pytest_sessionstart(session):
  # The GPU-target tests skip without jax's CUDA plugin (`python -m mpx.gpu_target` installs it);
  # CI sets MPX_REQUIRE_GPU_TARGET so that a missing toolchain fails instead of skipping them.
  del session
  from mpx._src.audit import toolchain

  if os.environ.get("MPX_REQUIRE_GPU_TARGET") and not toolchain.available():
    raise pytest.UsageError(
      "MPX_REQUIRE_GPU_TARGET is set but the GPU-target toolchain is missing: run "
      f"`{toolchain.COMMAND}` first."
    )


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    path = item.path.resolve()
    if _REPO in path.parents and path.name not in _FAST_IN_REPO:
      item.add_marker(pytest.mark.slow)
