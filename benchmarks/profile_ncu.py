"""Hardware-counter profile of ``attnref bench`` cases under Nsight Compute (``ncu``), for the GPU machine.

Each case named on the command line (a part of its bench name; ``op:part`` to pick the op) is built and run
twice to compile and warm up, then once between ``cudaProfilerStart``/``Stop``, with content checks off as in
the bench. Run under ``ncu --profile-from-start off`` so only that call's kernels are profiled::

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page details \\
        python3 benchmarks/profile_ncu.py "turboquant:4bit_nc decode B=32 Hq=32 Hk=8 D=128 L=8192"

Without ``ncu`` it just runs the cases (a check that the names match).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.kernel_times import matching
from triton_impl.validation import CONTENT_CHECKS_ENV


def find(spec: str):
    hits = matching(spec)
    exact = [case for case in hits if case.name == spec.rpartition(":")[2]]
    hits = exact or hits  # a name that is a prefix of another's ("... tokens", "... tokens consecutive slots")
    if len(hits) != 1:
        raise SystemExit(f"{spec!r} matches {len(hits)} cases: {[c.name for c in hits]}")
    return hits[0]


def main(specs: list[str]) -> None:
    os.environ[CONTENT_CHECKS_ENV] = "0"
    cudart = torch.cuda.cudart()
    for spec in specs:
        case = find(spec)
        bench = case.setup(torch.device("cuda"))
        bench.run()
        bench.run()
        torch.cuda.synchronize()
        print(f"profiling {case.op}: {case.name}", flush=True)
        cudart.cudaProfilerStart()
        bench.run()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        del bench
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
