"""The main job: the parity command runs, reports every case, and fails loudly."""

from __future__ import annotations

import pytest
import torch

from triton_impl.cli import main
from triton_impl.parity import Case, Check, format_table, registered_cases, run_cases
from triton_impl.tolerances import tolerance


def test_parity_command_passes_for_an_op(capsys) -> None:
    assert main(["parity", "--op", "lse_merge", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| lse_merge" in out and "FAIL" not in out and "passed, 0 failed" in out


def test_every_op_registers_cases() -> None:
    ops = {case.op for case in registered_cases()}
    assert {"lse_merge", "mla_verify", "decode_attention", "turboquant", "ue8m0_cache", "sparse_indices"} <= ops


def test_a_wrong_or_raising_case_fails_and_the_rest_still_run(device) -> None:
    tol = tolerance("lse_merge", "o", "float32")
    wrong = Case(
        "demo", "off by 1e-3", lambda d: [Check("o", torch.ones(3), torch.ones(3, dtype=torch.float64) + 1e-3, tol)]
    )

    def boom(d):
        raise RuntimeError("does not compile")

    rows = run_cases(
        [
            wrong,
            Case("demo", "raises", boom),
            Case("demo", "exact", lambda d: [Check("i", torch.arange(3), torch.arange(3), None)]),
        ],
        device,
        progress=False,
    )
    assert [r.comparison.ok for r in rows] == [False, False, True]
    assert "RuntimeError: does not compile" in format_table(rows)


def test_unknown_op_is_named() -> None:
    with pytest.raises(ValueError, match="ops: unknown \\['nope'\\]"):
        registered_cases(["nope"])
