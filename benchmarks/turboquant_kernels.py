"""GPU time of each kernel of a TurboQuant decode call (query rotation, stage 1, split merge), from the
CUDA profiler, for the bench's decode cases, with the sm_90 Gluon stage 1 and with the portable one.

``PYTHONPATH=. python3 benchmarks/turboquant_kernels.py [name part]`` on a GPU machine. Each case is
set up as ``attnref bench`` sets it up, run 3 times to compile, then 20 times under ``torch.profiler``;
the table gives each kernel's mean microseconds per call, and the whole call's mean from CUDA events.
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

import triton_impl.turboquant as turboquant
from benchmarks.kernel_times import kernel_times
from triton_impl.parity.turboquant import bench_cases

# Stage 1 variants: the sm90 entry's keys each sets.
VARIANTS = {"Gluon": {"GLUON": 1}, "portable": {"GLUON": 0}}


def main(name_part: str = "") -> None:
    device = torch.device("cuda")
    print("| case | stage 1 | rotation | stage 1 | merge | whole call (events) | max abs difference to portable |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in bench_cases():
        if "decode" not in case.name or name_part not in case.name:
            continue
        bench = case.setup(device)
        rows, outputs = [], {}
        for name, keys in VARIANTS.items():
            with mock.patch.dict(turboquant.DECODE_CONFIGS, {"sm90": turboquant.DECODE_CONFIGS["sm90"] | keys}):
                turboquant._PLANS.clear()
                times, whole = kernel_times(bench.run)
                outputs[name] = bench.run().float().clone()
            rotate, stage1, merge = (sum(t for n, t in times.items() if part in n) for part in ("rotate", "stage1",
                                                                                                  "merge"))  # fmt: skip
            rows.append((name, rotate, stage1, merge, whole))
        turboquant._PLANS.clear()
        for name, rotate, stage1, merge, whole in rows:
            diff = (outputs[name] - outputs["portable"]).abs().max().item()
            print(f"| {case.name} | {name} | {rotate:.1f} | {stage1:.1f} | {merge:.1f} | {whole:.1f} | {diff:.2e} |",
                  flush=True)  # fmt: skip
        del bench
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main(*sys.argv[1:2])
