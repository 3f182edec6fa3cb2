"""Sphinx configuration of the site: the notebooks executed, the tables, an API page per op.

Build from the repository root (the README's "The site" section):

    sphinx-build -W --keep-going -b html docs docs/_build/html

Before Sphinx looks for sources this file writes two ignored folders inside ``docs/``: a copy of
every ``notebooks/*.py`` in ``docs/notebooks/`` (Sphinx reads sources only from ``docs/``) and an
API page per op in ``docs/api/`` (``golden/*.py`` names the ops). A file is rewritten only when
its text changed, so an unchanged notebook keeps its place in Sphinx's incremental build.

Notebooks are jupytext percent files read by ``docs/_ext/notebook_reader.py`` (which prepends a
hidden cell that moves to the repository root, where the notebooks expect to run) and executed by
myst-nb through jupyter-cache: a notebook runs again only when its code changed. A cell that
raises fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # autodoc imports golden/ and triton_impl/ from this checkout
sys.path.insert(0, str(HERE / "_ext"))

# The notebook kernels inherit this process's environment: the inline backend keeps figures as
# outputs (a test run's MPLBACKEND=Agg would drop them), and the checkout comes first on the path.
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

OPS = sorted(p.stem for p in (ROOT / "golden").glob("*.py") if not p.stem.startswith("_"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _sync(folder: Path, pages: dict[str, str]) -> None:
    """Make ``folder`` hold exactly ``pages`` (file name -> text)."""
    folder.mkdir(exist_ok=True)
    for stale in set(p.name for p in folder.iterdir() if p.is_file()) - pages.keys():
        (folder / stale).unlink()
    for name, text in pages.items():
        _write_if_changed(folder / name, text)


def _api_page(op: str) -> str:
    fast_path = ""
    if (ROOT / "triton_impl" / f"{op}_sm90.py").is_file():  # an architecture's fast path beside the portable kernel
        fast_path = f"""
## Fast path on sm_90 (Gluon): `triton_impl.{op}_sm90`

```{{eval-rst}}
.. automodule:: triton_impl.{op}_sm90
   :members:
```
"""
    return f"""# `{op}`

The kernel, `triton_impl/{op}.py`, and its definition, `golden/{op}.py`: the public functions
and classes of each module, from their docstrings.

## Kernel: `triton_impl.{op}`

```{{eval-rst}}
.. automodule:: triton_impl.{op}
   :members:
```
{fast_path}
## Golden model: `golden.{op}`

```{{eval-rst}}
.. automodule:: golden.{op}
   :members:
```
"""


_sync(HERE / "notebooks", {p.name: p.read_text() for p in NOTEBOOKS})
_sync(HERE / "api", {f"{op}.md": _api_page(op) for op in OPS})

project = "attention-kernels-reference"
author = "attention-kernels-reference contributors"
copyright = "the attention-kernels-reference contributors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
exclude_patterns = ["_build", "_ext", "_static", "conf.py", "**/.ipynb_checkpoints"]
root_doc = "index"

# -- Notebooks (myst-nb) --------------------------------------------------------------------------
nb_custom_formats = {".py": "notebook_reader.read_percent"}
nb_execution_mode = "cache"
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache")
nb_execution_timeout = 600  # per cell; the slowest cell runs well under a minute on 2 CPU cores
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]

# -- API pages (autodoc + napoleon: the docstrings use Google-style Args sections) ---------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_param = False  # "prefix_lse, suffix_lse: ..." documents two parameters once, as written

# -- HTML ----------------------------------------------------------------------------------------
html_theme = "furo"
html_title = "attention-kernels-reference"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"  # a page without one makes the browser fetch /favicon.ico
html_show_sourcelink = False

# MathJax served from the site itself when the ``docs`` extra brought its files
# (sphinx-mathjax-offline, MathJax 3): the pages then render math without reaching a CDN.
_mathjax = importlib.util.find_spec("sphinx-mathjax-offline")
if _mathjax is not None and _mathjax.origin is not None:
    _static = Path(_mathjax.origin).parent / "static"
    if (_static / "mathjax" / "tex-chtml.js").is_file():
        html_static_path.append(str(_static))
        mathjax_path = "mathjax/tex-chtml.js"
