"""Test settings: strict dtype promotion, so a silent float32 upcast is an error."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _strict_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield
