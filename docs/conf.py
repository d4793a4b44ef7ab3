"""Sphinx configuration: autodoc from the docstrings, built with -W in CI."""

import mpx

project = "mpx"
author = "The mpx authors"
release = mpx.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
exclude_patterns = ["_build", "*.md"]
html_theme = "alabaster"
nitpicky = False
