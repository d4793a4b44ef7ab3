"""The public surface: every exported name is documented in docs/api.rst and has a docstring."""

import importlib
import inspect
import pathlib
import re

import pytest

import mpx

API_RST = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.rst"
NAMESPACES = ["mpx"] + [f"mpx.{sub}" for sub in ("linen", "nnx") if hasattr(mpx, sub)]


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
