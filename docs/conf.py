"""Sphinx configuration: MyST pages, API reference from the docstrings (autosummary)."""

import importlib.metadata
import re

project = "jaxamp"
author = "the jaxamp authors"
copyright = "the jaxamp authors"  # pylint: disable=redefined-builtin
release = version = importlib.metadata.version("jax-mixed-precision")

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# API reference: one page per public name, generated into api/_autosummary at build time.
autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True  # AutocastLists' defaults are frozensets of ~250 names
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, so autodoc's members do not repeat them

html_theme = "furo"
html_title = f"jaxamp {release}"
html_static_path = []


def _shorten_signature(app, what, name, obj, options, signature, return_annotation):
  """Abbreviates frozenset defaults in signatures (AutocastLists' op lists: ~250 names)."""
  del app, what, name, obj, options
  if signature and "frozenset({" in signature:
    signature = re.sub(r"frozenset\(\{[^}]*\}\)", "frozenset({...})", signature)
  return signature, return_annotation


def setup(app):
  app.connect("autodoc-process-signature", _shorten_signature)
