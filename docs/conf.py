"""Sphinx configuration of decentpy's documentation (``make docs`` -> docs/_build/html).

At build time it generates, into docs/_generated/ (not in git), the benchmark tables from the
CSVs under docs/data/ (and bench/out/ when a local run left some), by tools/docs_tables.py; and it
redraws the topology pictures under docs/images/topologies/ (in git, so that the Markdown shows
them where it is read) whose schedule changed, by tools/docs_topologies.py.
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)

import decentpy  # noqa: E402  (the built package: autodoc and the pictures need decentpy._C)
from tools import docs_tables, docs_topologies  # noqa: E402

docs_tables.generate(os.path.join(DOCS, "_generated"))
docs_topologies.generate(os.path.join(DOCS, "images", "topologies"))

project = "decentpy"
author = "The decentpy maintainers"
copyright = "2026, The decentpy maintainers (BSD-3-Clause)"
release = decentpy.version.base_version
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autoclass_content = "both"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"decentpy {release}"
html_static_path = []


def _drop_sourceless_modules(app):  # noqa: ANN001, ANN201 - a Sphinx event handler
    """viewcode lists in _modules/index.html every module it looked at, also those without a source
    page (the compiled decentpy._C): a broken link. Drop them before its pages are collected."""
    modules = getattr(app.env, "_viewcode_modules", None) or {}
    for name in [n for n, entry in modules.items() if not entry]:
        del modules[name]
    return []


def setup(app):  # noqa: ANN001, ANN201
    app.connect("html-collect-pages", _drop_sourceless_modules, priority=400)  # (before viewcode's, at 500)
