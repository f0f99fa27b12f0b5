"""Sphinx configuration: the guide, the semantics and the API reference of optax_accum.

Build it with `python -m sphinx -W -b html docs docs/_build/html` (tests/test_docs.py
runs the same build and fails on any warning).
"""

import optax_accum

project = "optax_accum"
author = "optax_accum authors"
copyright = "2026, optax_accum authors"
release = optax_accum.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_heading_anchors = 3

# Google-style docstrings; "Attributes:" become fields, not separate objects, so a
# NamedTuple state is documented once.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """Skips the generated `Alias for field number N` entries of NamedTuple states."""
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
