"""Test settings: strict dtype promotion, so a silent float32 upcast is an error.

Compiling dominates the suite's time on CPU, so LLVM's backend optimisations
are off (``--xla_backend_optimization_level=0``, as the docs pages and the
demo's ``--quick`` run): the HLO programs, fusions and cost figures are
XLA's own and unchanged, and without fast-math flags LLVM's optimisations
change no floating-point result.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()

import jax  # after XLA_FLAGS, which the backend reads when it starts
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _strict_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield


# Tests of the repository around the library (docs pages, the demo, the examples, the
# benchmark scripts, multi-process runs) are marked ``repo``: ``pytest -m "not repo"`` is
# the fast unit loop, ``pytest`` (what CI runs) is everything.
_REPO_MODULES = frozenset(
  {"test_docs.py", "test_demo.py", "test_examples.py", "test_benchmarks.py", "test_multiprocess.py"}
)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.path.name in _REPO_MODULES:
      item.add_marker(pytest.mark.repo)
