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
NAMESPACES = [
  "mpx",
  "mpx.diagnostics",
  "mpx.fp8",
  "mpx.parallel",
  "mpx.losses",
  "mpx.linen",
  "mpx.nnx",
  "mpx.eqx",
]
# The names that left the top level for a namespace; they resolve with a DeprecationWarning
# for one release.
MOVED = {
  "mpx.diagnostics": [
    "ActivationStats",
    "AuditReport",
    "MagnitudeHistogram",
    "MatmulOp",
    "NonfiniteReport",
    "RangeReport",
    "ScaleRecommendation",
    "magnitude_histogram",
    "nonfinite_gradient_paths",
    "plot_flushed_heatmap",
    "plot_loss_scale",
    "plot_magnitude_histogram",
    "range_report",
    "recommend_scale",
  ],
  "mpx.fp8": [
    "accumulation_boundary",
    "fp8_dot_general",
    "fp8_max_grad",
    "quantize_dequantize",
    "update_fp8_state",
  ],
  "mpx.parallel": ["all_gather_params", "all_reduce_gradients", "state_shardings"],
}
MOVED_NAMES = [(ns, name) for ns, names in MOVED.items() for name in names]


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


def test_the_top_level_stays_narrow():
  # The face names the policy, the optimizer wrappers, the train-step API, the kernels, the
  # audit and the errors; the rest lives in the namespaces.
  assert len(mpx.__all__) <= 48, len(mpx.__all__)
  assert {"diagnostics", "fp8", "linen", "nnx", "parallel"} <= set(mpx.__all__)
  assert sorted(mpx.__all__) == list(mpx.__all__), "keep mpx.__all__ sorted"


def test_no_module_is_over_450_lines():
  long = {
    str(path.relative_to(ROOT)): n
    for path in (ROOT / "mpx").rglob("*.py")
    if (n := len(path.read_text(encoding="utf-8").splitlines())) > 450
  }
  assert not long, f"split these modules by concern: {long}"


@pytest.mark.parametrize(("namespace", "name"), MOVED_NAMES)
def test_a_moved_name_lives_in_its_namespace_only(namespace, name):
  assert name in importlib.import_module(namespace).__all__
  assert name not in mpx.__all__
  assert name not in dir(mpx)


@pytest.mark.parametrize(("namespace", "name"), MOVED_NAMES)
def test_a_moved_name_still_resolves_at_the_top_level_with_a_deprecation_warning(namespace, name):
  new = f"{namespace}.{name}"
  with pytest.warns(DeprecationWarning, match=rf"^mpx\.{name} moved to {re.escape(new)}; "):
    old = getattr(mpx, name)
  assert old is getattr(importlib.import_module(namespace), name)


def test_every_moved_name_is_listed_here():
  # A name that leaves the top level keeps a pointer to its new home (mpx._MOVED), and this
  # test's MOVED checks the pointer: issue 34 found two moved names without one.
  assert sorted(mpx._MOVED.items()) == sorted((n, ns.removeprefix("mpx.")) for ns, n in MOVED_NAMES)


def test_no_page_uses_a_moved_top_level_name():
  pattern = re.compile(rf"\bmpx\.({'|'.join(name for _, name in MOVED_NAMES)})\b")
  pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
  pages += [*(ROOT / "examples").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
  found = [
    f"{page.relative_to(ROOT)}:{number}: {m[0]}"
    for page in pages
    if "_build" not in page.parts
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
    for m in pattern.finditer(line)
  ]
  assert found == [], "write the namespace: mpx.diagnostics.X, mpx.fp8.X, mpx.parallel.X"


def test_every_guide_page_is_linked_from_the_readme():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", readme))
  pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md")}
  assert sorted(pages - linked) == [], "link every docs/guide page from README.md's Documentation"


def test_a_moved_name_warns_at_the_line_that_uses_it():
  with pytest.warns(DeprecationWarning) as record:
    mpx.range_report  # noqa: B018
  assert [pathlib.Path(w.filename).name for w in record] == [pathlib.Path(__file__).name]


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


def _loaded_after(script: str, prefixes: tuple[str, ...] = ("flax",)) -> list[str]:
  """Runs ``script`` in a fresh interpreter; returns the modules it imported under ``prefixes``."""
  script = textwrap.dedent(script) + textwrap.dedent(f"""
    import sys
    prefixes = {prefixes!r}
    print(" ".join(sorted(
      m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in prefixes)
    )))
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


def test_import_mpx_and_its_pure_jax_and_optax_parts_do_not_import_flax_or_equinox():
  loaded = _loaded_after(
    """
    import jax.numpy as jnp, optax
    import mpx
    params = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
    mpx.get_policy("mixed_float16").cast_to_compute(params)
    mpx.Policy, mpx.cast_tree(params, "bf16")
    mpx.KeepRules().with_path("head$", "float32")
    mpx.mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(3)})
    mpx.value_and_grad(lambda p: (p["w"] ** 2).sum(), 1.0)({"w": jnp.ones(3)})
    assert {"linen", "nnx", "eqx"} <= set(dir(mpx)) and {"linen", "nnx", "eqx"} <= set(mpx.__all__)
    """,
    prefixes=("flax", "equinox"),
  )
  assert loaded == []


@pytest.mark.slow
def test_the_diagnostics_and_fp8_namespaces_import_neither_flax_nor_matplotlib():
  loaded = _loaded_after(
    """
    import jax, jax.numpy as jnp
    import mpx, mpx.diagnostics, mpx.fp8, mpx.parallel
    assert mpx.diagnostics is __import__("sys").modules["mpx.diagnostics"]
    mpx.diagnostics.range_report({"w": jnp.ones(3)}, jnp.float16)
    mpx.fp8.quantize_dequantize(jnp.ones(3), jnp.float8_e4m3fn, scale=jnp.float32(1.0))
    import equinox as eqx  # and the Equinox namespace (its diagnostics included)
    model = mpx.eqx.apply_policy(eqx.nn.Linear(2, 2, key=jax.random.key(0)), "mixed_bfloat16")
    jax.eval_shape(model, jnp.ones(2))
    """,
    prefixes=("flax", "matplotlib"),
  )
  assert loaded == []


def test_import_mpx_loads_neither_the_diagnostics_nor_the_fp8_kernels():
  loaded = _loaded_after(
    """
    import mpx
    assert {"diagnostics", "fp8"} <= set(dir(mpx))
    """,
    prefixes=("mpx.diagnostics", "mpx.fp8", "mpx._src.diagnostics", "mpx._src.ops.fp8"),
  )
  assert loaded == []


@pytest.mark.slow
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
  with pytest.raises(AttributeError, match="no attribute 'range_reports'"):
    mpx.range_reports  # noqa: B018
  assert not hasattr(mpx.diagnostics, "fp8_dot_general")
