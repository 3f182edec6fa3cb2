"""GPU time of each kernel of a TurboQuant decode call (query rotation, stage 1, split merge), from the
CUDA profiler, for the bench's decode cases, with the sm_90 Gluon stage 1 and with the portable one.

``PYTHONPATH=. python3 benchmarks/turboquant_kernels.py [name part]`` on a GPU machine. Each case is
set up as ``attnref bench`` sets it up, run 3 times to compile, then 20 times under ``torch.profiler``;
the table gives each kernel's mean microseconds per call, and the whole call's mean from CUDA events.
"""

from __future__ import annotations

import collections
import sys
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

import triton_impl.turboquant as turboquant
from triton_impl.parity.turboquant import bench_cases

CALLS = 20
# Stage 1 variants: the sm90 entry's keys each sets.
VARIANTS = {"Gluon": {"GLUON": 1}, "portable": {"GLUON": 0}}


def kernel_times(run) -> tuple[dict[str, float], float]:
    """(mean microseconds per call by kernel name, mean microseconds per call from CUDA events)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / CALLS
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        run()
    stop.record()
    torch.cuda.synchronize()
    return dict(times), start.elapsed_time(stop) * 1000 / CALLS


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
