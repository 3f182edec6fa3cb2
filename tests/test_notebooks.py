"""Every notebook executes top to bottom on this machine (CPU: the Triton interpreter)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jupytext = pytest.importorskip("jupytext", reason="install the 'notebooks' extra")
    nbclient = pytest.importorskip("nbclient", reason="install the 'notebooks' extra")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits this process's environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = jupytext.read(path)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
