"""Reads a ``notebooks/*.py`` jupytext percent file for myst-nb (``nb_custom_formats`` in
``docs/conf.py``).

myst-nb starts a kernel in the source file's folder, where this checkout's packages need not be
importable (the notebooks find their data files through ``triton_impl``'s location). So the
reader puts one cell first that puts the checkout first on ``sys.path`` and moves to it, as
``tests/test_notebooks.py`` runs them; its ``remove-cell`` tag keeps it off the page. Everything
else is the notebook as written.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent.parent

SETUP = f"""import os
import sys

os.chdir({str(ROOT)!r})
sys.path.insert(0, {str(ROOT)!r})"""


def read_percent(text: str) -> nbformat.NotebookNode:
    notebook = jupytext.reads(text, fmt="py:percent")
    setup = nbformat.v4.new_code_cell(SETUP, metadata={"tags": ["remove-cell"]})
    notebook.cells.insert(0, setup)
    return notebook
