"""Sphinx configuration for colibri's documentation.

Build from the repository root, with colibri installed (``pip install ".[docs]"``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# `python -m sphinx` puts the current directory first on sys.path; from the repository root
# that is the unbuilt source tree, whose `colibri/` has no compiled extensions and would
# shadow the installed package. autodoc must import the installed colibri.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import colibri  # noqa: E402

project = "colibri"
author = "colibri contributors"
copyright = "colibri contributors"  # noqa: A001
release = colibri.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "colibri_catalogue",  # _ext/: the transformers router table and DIFFERENCES, from the code
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]
templates_path: list[str] = []

# Markdown pages: ::: fences for admonitions, definition lists, $math$
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# The API pages list names with autosummary tables and document them with autodoc on the same
# page: no generated stub files.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # numpydoc's Parameters sections say the types

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

html_theme = "pydata_sphinx_theme"
html_title = f"colibri {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path: list[str] = []
html_show_sourcelink = False
