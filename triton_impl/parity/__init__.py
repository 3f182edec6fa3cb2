"""The parity job: every Triton op against its golden twin on realistic default cases.

Each op registers its cases in ``triton_impl/parity/<op>.py`` (same stem as the op) as a function
``cases() -> list[Case]``, and may register benchmark cases beside them as ``bench_cases() ->
list[BenchCase]`` (``triton_impl/bench.py`` times them); this module finds those files by itself.
A case runs the kernel and the float64 golden model on the same inputs and returns one
:class:`Check` per output.

Layers: ``triton_impl/cases.py`` (checks, paged-cache builders) is below both this package and
``triton_impl/bench.py``; this package is above the bench runner (its op modules build
``BenchCase``), and the bench runner imports nothing from here.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from triton_impl.bench import BenchCase
from triton_impl.cases import Check, compare_check
from triton_impl.cases import block_table_for as block_table_for  # re-export for the op modules' callers
from triton_impl.tolerances import Comparison, Tolerance


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
    bound_max: float | None = None  # the largest element of the check's derived bound, where it has one


def _op_modules(ops: Sequence[str] | None) -> list[ModuleType]:
    """Every ``triton_impl/parity/<op>.py`` in name order, or the named ones; an unknown name raises."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    unknown = set(ops or ()) - set(names)
    if unknown:
        raise ValueError(f"ops: unknown {sorted(unknown)}; registered: {names}")
    return [importlib.import_module(f"{__name__}.{name}") for name in names if not ops or name in ops]


def registered_cases(ops: Sequence[str] | None = None) -> list[Case]:
    """All parity cases of every ``triton_impl/parity/<op>.py``, or of the named ops only."""
    return [case for module in _op_modules(ops) for case in module.cases()]


def registered_bench_cases(ops: Sequence[str] | None = None) -> list[BenchCase]:
    """All benchmark cases of the op modules that define ``bench_cases``, or of the named ops only."""
    return [case for module in _op_modules(ops) if hasattr(module, "bench_cases") for case in module.bench_cases()]


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
            bound_max = None if check.bound is None else float(check.bound.max()) if check.bound.numel() else 0.0
            rows.append(Row(case.op, case.name, check.output, compare_check(check), check.tol, seconds, bound_max))
    if progress:
        sys.stderr.write(f"\r[{'#' * 30}] {len(cases)}/{len(cases)} done{' ' * 50}\n")
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = ("op", "case", "output", "max abs err", "max rel err", "tolerance (atol/rtol)", "pass")
    body = []
    for r in rows:
        tol = "exact" if r.tol is None else f"{r.tol.atol:g} / {r.tol.rtol:g}"
        if r.bound_max is not None:
            tol += f" + bound (max {r.bound_max:.2g})"
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
