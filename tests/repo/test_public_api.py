"""The public surface: every exported name is documented in docs/api.rst and has a docstring."""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import mpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_RST = ROOT / "docs" / "api.rst"
NAMESPACES = ["mpx", "mpx.linen", "mpx.nnx"]


def _documented() -> set[str]:
  text = API_RST.read_text(encoding="utf-8")
  current = "mpx"
  names = set()
  for line in text.splitlines():
    if m := re.match(r"\.\. currentmodule:: (\S+)", line):
      current = m.group(1)
    elif m := re.match(r"\.\. auto(?:function|class|exception|data):: (\S+)", line):
      names.add(f"{current}.{m.group(1)}")
  return names


def _public() -> list[tuple[str, str]]:
  return [
    (ns, name)
    for ns in NAMESPACES
    for name in importlib.import_module(ns).__all__
    if not inspect.ismodule(getattr(importlib.import_module(ns), name))
  ]


def test_every_namespace_is_documented():
  text = API_RST.read_text(encoding="utf-8")
  for ns in NAMESPACES[1:]:
    assert f".. automodule:: {ns}" in text, f"document {ns} in docs/api.rst"


def test_version_is_exported():
  assert re.fullmatch(r"\d+\.\d+\.\d+", mpx.__version__)


@pytest.mark.parametrize(("namespace", "name"), _public())
def test_every_public_name_is_documented(namespace, name):
  assert f"{namespace}.{name}" in _documented(), f"add {namespace}.{name} to docs/api.rst"


@pytest.mark.parametrize(("namespace", "name"), _public())
def test_every_public_name_has_a_docstring(namespace, name):
  obj = getattr(importlib.import_module(namespace), name)
  doc = inspect.getdoc(obj) or ""
  assert doc.strip(), f"{namespace}.{name} has no docstring"
  if inspect.isfunction(obj):
    params = [p for p in inspect.signature(obj).parameters if p not in ("self",)]
    if params:
      assert "Args:" in doc, f"{namespace}.{name} docstring lacks an Args: section"
    assert "Returns:" in doc, f"{namespace}.{name} docstring lacks a Returns: section"


def test_each_object_is_exported_once():
  # Pure-JAX names live in mpx, Flax names in mpx.linen / mpx.nnx, never in both.
  exported: dict[int, list[str]] = {}
  for namespace, name in _public():
    obj = getattr(importlib.import_module(namespace), name)
    exported.setdefault(id(obj), []).append(f"{namespace}.{name}")
  assert [names for names in exported.values() if len(names) > 1] == []


def _loaded_after(script: str) -> list[str]:
  """Runs ``script`` in a fresh interpreter; returns the Flax modules it imported."""
  script = textwrap.dedent(script) + textwrap.dedent("""
    import sys
    print(" ".join(sorted(m for m in sys.modules if m == "flax" or m.startswith("flax."))))
  """)
  result = subprocess.run(
    [sys.executable, "-W", "error", "-c", script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr
  return result.stdout.split()


def test_import_mpx_and_its_pure_jax_and_optax_parts_do_not_import_flax():
  loaded = _loaded_after("""
    import jax.numpy as jnp, optax
    import mpx
    params = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
    mpx.get_policy("mixed_float16").cast_to_compute(params)
    mpx.Policy, mpx.cast_tree(params, "bf16")
    mpx.KeepRules().with_path("head$", "float32")
    mpx.mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(3)})
    assert {"linen", "nnx"} <= set(dir(mpx)) and {"linen", "nnx"} <= set(mpx.__all__)
  """)
  assert loaded == []


def test_flax_submodules_load_on_first_use_and_linen_leaves_nnx_out():
  loaded = _loaded_after("""
    import mpx
    import mpx.linen
    from mpx import linen
    assert linen is mpx.linen and callable(linen.apply_policy)
  """)
  assert "flax.linen" in loaded and not [m for m in loaded if m.startswith("flax.nnx")]
  loaded = _loaded_after("""
    import mpx
    assert callable(mpx.nnx.apply_policy)
  """)
  assert "flax.nnx" in loaded


def test_unknown_attribute_raises_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'lenin'"):
    mpx.lenin  # noqa: B018
