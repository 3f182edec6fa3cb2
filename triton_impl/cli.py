"""Command line: ``attnref parity`` (the main job), ``attnref bench`` (GPU), ``attnref bench-merge``,
``attnref tolerances``.

``python -m triton_impl ...`` is the same command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    import triton_impl  # noqa: F401  (selects the interpreter on a machine without CUDA)
    from triton_impl import interpreter

    parser = argparse.ArgumentParser(prog="attnref", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parity = sub.add_parser("parity", help="run every Triton op against its golden twin and print a table")
    parity.add_argument("--op", action="append", help="only this op (repeatable)")
    parity.add_argument("--no-progress", action="store_true")
    bench = sub.add_parser("bench", help="on a GPU: check, then time every op against the measured roofline")
    bench.add_argument("--op", action="append", help="only this op (repeatable)")
    bench.add_argument("--out", type=Path, default=Path("notebooks/results"), help="where the table, JSON and plot go")
    bench.add_argument("--no-baselines", action="store_true", help="skip the eager / torch.compile golden baselines")
    bench.add_argument("--case", action="append", help="only cases whose name contains this (repeatable)")
    merge = sub.add_parser("bench-merge", help="merge a bench run's rows (RUN/bench_h200.json) into a table")
    merge.add_argument("run", type=Path, help="the folder of the run's bench_h200.json (e.g. a GPU job's output)")
    merge.add_argument("--into", type=Path, default=Path("notebooks/results"), help="the table to update")
    sub.add_parser("tolerances", help="print the tolerance table as markdown")
    args = parser.parse_args(argv)

    if args.command == "bench":
        from triton_impl.bench import main as bench_main
        from triton_impl.parity import registered_bench_cases

        cases = [c for c in registered_bench_cases(args.op) if not args.case or any(f in c.name for f in args.case)]
        return bench_main(cases, args.out, baselines=not args.no_baselines)

    if args.command == "bench-merge":
        from triton_impl.bench import merge_report

        try:
            table, replaced, appended = merge_report(args.run, args.into)
        except (OSError, ValueError) as err:
            print(f"attnref bench-merge: {err}", file=sys.stderr)
            return 2
        print(f"{table}: {replaced} rows replaced, {appended} appended; the notes above the table name the commits")
        return 0

    if args.command == "tolerances":
        from triton_impl.tolerances import markdown_table

        sys.stdout.write(markdown_table())
        return 0

    from triton_impl.parity import format_table, registered_cases, run_cases

    device = _device()
    mode = "Triton interpreter (CPU)" if bool(interpreter.INTERPRET) else f"compiled on {torch.cuda.get_device_name()}"
    print(f"parity: {mode}; torch {torch.__version__}")
    rows = run_cases(registered_cases(args.op), device, progress=not args.no_progress)
    print(format_table(rows))
    failed = sum(not r.comparison.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
