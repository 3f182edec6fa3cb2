"""The parity job: every Triton op against its golden twin on realistic default cases.

Each op registers its cases in ``triton_impl/parity/<op>.py`` (same stem as the op) as a function
``cases() -> list[Case]``; this module finds those files by itself. A case runs the kernel and the
float64 golden model on the same inputs and returns one :class:`Check` per output.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from triton_impl.tolerances import Comparison, Tolerance, compare


@dataclass(frozen=True)
class Check:
    """One output of one case. ``tol=None`` means bit-exact (bytes, codes, indices)."""

    output: str
    actual: torch.Tensor
    expected: torch.Tensor
    tol: Tolerance | None


@dataclass(frozen=True)
class Case:
    op: str
    name: str
    run: Callable[[torch.device], Sequence[Check]]


@dataclass(frozen=True)
class Row:
    op: str
    case: str
    output: str
    comparison: Comparison
    tol: Tolerance | None
    seconds: float


def exact(actual: torch.Tensor, expected: torch.Tensor) -> Comparison:
    """Bit-exact comparison (for floats: same bits, so -0 != +0 and NaN == same NaN)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Comparison(float("inf"), float("inf"), False, "shape or dtype differs")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.view(int_type), e.view(int_type)
    mismatches = int((a != e).sum())
    return Comparison(float(mismatches), 0.0, mismatches == 0, f"{mismatches} elements differ" if mismatches else "")


def block_table_for(
    seq_lens: Sequence[int],
    page_size: int,
    *,
    gen: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    spare_pages: int = 0,
    extra_columns: int = 0,
    fill: int = 0,
) -> tuple[torch.Tensor, int]:
    """A block table giving request ``b`` its ``cdiv(seq_lens[b], page_size)`` pages in random order.

    Pages are a random permutation of ``[0, num_pages)`` (drawn with ``gen`` on the CPU, or on
    ``device`` without one), ``spare_pages`` of them unused; ``extra_columns`` unused columns and
    every entry past a request's pages hold ``fill`` (serving pads with garbage; tests use an
    out-of-range id). Returns ``(table [B, max_pages + extra_columns] int32, num_pages)``.
    """
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages) + spare_pages
    order = torch.randperm(num_pages, generator=gen) if gen is not None else torch.randperm(num_pages, device=device)
    table = torch.full((len(seq_lens), max([*pages, 0]) + extra_columns), fill, dtype=torch.int32, device=order.device)
    start = 0
    for b, n_pages in enumerate(pages):
        table[b, :n_pages] = order[start : start + n_pages].to(torch.int32)
        start += n_pages
    return table.to(device), num_pages


def registered_cases(ops: Sequence[str] | None = None) -> list[Case]:
    """All cases of every ``triton_impl/parity/<op>.py``, or of the named ops only."""
    found: list[Case] = []
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    unknown = set(ops or ()) - set(names)
    if unknown:
        raise ValueError(f"ops: unknown {sorted(unknown)}; registered: {names}")
    for name in names:
        if ops and name not in ops:
            continue
        module = importlib.import_module(f"{__name__}.{name}")
        found.extend(module.cases())
    return found


def run_cases(cases: Sequence[Case], device: torch.device, progress: bool = True) -> list[Row]:
    rows: list[Row] = []
    for i, case in enumerate(cases):
        if progress:
            done = int(30 * i / max(1, len(cases)))
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {i}/{len(cases)} {case.op}: {case.name:<40.40}")
            sys.stderr.flush()
        start = time.perf_counter()
        try:
            checks = case.run(device)
        except Exception as err:  # a case that raises (e.g. does not compile) fails; the others still run
            message = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:160]
            rows.append(Row(case.op, case.name, "-", Comparison(math.nan, math.nan, False, message), None, 0.0))
            continue
        seconds = time.perf_counter() - start
        for check in checks:
            cmp = (
                exact(check.actual, check.expected)
                if check.tol is None
                else compare(check.actual, check.expected, check.tol)
            )
            rows.append(Row(case.op, case.name, check.output, cmp, check.tol, seconds))
    if progress:
        sys.stderr.write(f"\r[{'#' * 30}] {len(cases)}/{len(cases)} done{' ' * 50}\n")
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = ("op", "case", "output", "max abs err", "max rel err", "tolerance (atol/rtol)", "pass")
    body = []
    for r in rows:
        tol = "exact" if r.tol is None else f"{r.tol.atol:g} / {r.tol.rtol:g}"
        if r.tol is None:
            err_abs = "0" if r.comparison.ok else f"{r.comparison.detail}"
            err_rel = "-"
        else:
            err_abs, err_rel = f"{r.comparison.max_abs:.3e}", f"{r.comparison.max_rel:.3e}"
        body.append((r.op, r.case, r.output, err_abs, err_rel, tol, "PASS" if r.comparison.ok else "FAIL"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(b) for b in body)
    return "\n".join(out)
