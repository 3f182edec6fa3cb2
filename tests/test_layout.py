"""The package's shape: one op, one stem, in golden/, triton_impl/, tests/, notebooks/, papers.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triton_impl.tolerances import TOLERANCES, markdown_table

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted(p.stem for p in (ROOT / "golden").glob("*.py") if not p.stem.startswith("_"))


def test_there_are_ops() -> None:
    assert "lse_merge" in OPS


@pytest.mark.parametrize("op", OPS)
def test_op_has_all_four_places(op: str) -> None:
    assert (ROOT / "triton_impl" / f"{op}.py").is_file(), f"golden/{op}.py has no triton_impl/{op}.py"
    assert list((ROOT / "tests").glob(f"test_{op}*.py")), f"golden/{op}.py has no tests/test_{op}*.py"
    assert (ROOT / "notebooks" / f"{op}.py").is_file(), f"golden/{op}.py has no notebooks/{op}.py"
    assert (ROOT / "triton_impl" / "parity" / f"{op}.py").is_file(), f"{op} registers no parity cases"
    anchors = re.findall(r"^## (\S+)", (ROOT / "papers.md").read_text(), flags=re.M)
    assert op.replace("_", "-") in anchors, f"papers.md has no '## {op.replace('_', '-')}' section"


@pytest.mark.parametrize("op", OPS)
def test_golden_never_calls_triton(op: str) -> None:
    source = (ROOT / "golden" / f"{op}.py").read_text()
    assert not re.search(r"^\s*(import triton|from triton)", source, flags=re.M)


def test_every_tolerance_has_a_reason_and_a_known_op() -> None:
    for (op, _output, _dtype), tol in TOLERANCES.items():
        assert op in OPS, f"tolerance entry for unknown op {op!r}"
        assert len(tol.reason) > 20, f"{op}: give the reason for the tolerance"


def test_tolerance_doc_is_current() -> None:
    doc = (ROOT / "tests" / "TOLERANCES.md").read_text()
    assert doc == markdown_table(), "regenerate: python -m triton_impl tolerances > tests/TOLERANCES.md"
