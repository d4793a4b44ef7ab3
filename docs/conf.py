"""Sphinx configuration: Markdown pages (MyST) and autodoc from the docstrings, built with -W in CI.

The ```python blocks of the Markdown pages are run by ``tests/repo/test_docs.py``.
"""

import mpx

project = "mpx"
author = "The mpx authors"
copyright = "The mpx authors"
release = version = mpx.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# MyST: anchors for `page.md#section` links down to ### headings.
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
# Types go next to the documented arguments only: a dataclass's fields are documented
# once, as attributes, not again as undocumented constructor parameters.
autodoc_typehints_description_target = "documented"
# `master_dtype=jnp.float32`, not `master_dtype=<class 'jax.numpy.float32'>`.
autodoc_preserve_defaults = True
autodoc_member_order = "bysource"

html_theme = "alabaster"
html_title = f"mpx {release}"
html_theme_options = {
  "description": "Mixed-precision training for JAX, Flax and optax",
  "page_width": "1180px",
  "sidebar_width": "250px",
  "fixed_sidebar": True,
}
nitpicky = False

# Module-level tuples have no docstring of their own: autodoc would show the
# documentation of `tuple`. Say what they hold instead, read from the objects.
_DATA_DOCS = {
  "mpx.linen.DEFAULT_KEEP_CLASSES": "flax.linen",
  "mpx.nnx.DEFAULT_KEEP_CLASSES": "flax.nnx",
}


def _data_doc(app, what, name, obj, options, lines):
  del app, options
  if what == "data" and name in _DATA_DOCS:
    classes = ", ".join(f"``{_DATA_DOCS[name]}.{cls.__name__}``" for cls in obj)
    lines[:] = [
      f"The normalisation layers kept in float32 by default: {classes}.",
      "",
      "``mpx.KeepRules(norms_in_float32=False)`` lets them follow the model's policy; a class",
      "rule (``KeepRules().with_class(cls, policy)``) gives one of them another policy.",
    ]


def setup(app):
  app.connect("autodoc-process-docstring", _data_doc)
