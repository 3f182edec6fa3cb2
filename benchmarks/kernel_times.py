"""GPU time of each kernel of one call of ``attnref bench`` cases, from the CUDA profiler, for the GPU machine.

``PYTHONPATH=. python3 benchmarks/kernel_times.py "op:name part" ...`` (a spec as ``benchmarks/profile_ncu.py``
takes it: a part of the bench name, ``op:`` to pick the op; a part matching several cases times them all). Each
case is set up as the bench sets it up (content checks off), run 3 times to compile, then ``CALLS`` times under
``torch.profiler``; a row gives each kernel's mean microseconds per call, their sum, the same sum over replays of
the call captured in a CUDA graph, and the whole call's mean from CUDA events, eager (the sum plus launch gaps and
host time) and in CUDA-graph replay. The next column times
the call as ``triton.testing.do_bench`` does, its 256 MB L2 flush (zeros written) before each call and CUDA events
around the call (median), and says where the time beyond the kernels goes: the GPU's idle gap between the flush and
the call's first kernel, and the gaps between the call's kernels (medians, from the profiler's kernel timestamps);
the last column the same after a flush that reads the 256 MB instead (no dirty lines left to write back), as the
bench times (``triton_impl.bench.cold_ms``).
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from triton_impl.bench import l2_flush
from triton_impl.parity import decode_attention, lse_merge, mla_verify, turboquant, ue8m0_cache
from triton_impl.validation import CONTENT_CHECKS_ENV

CALLS = 20
OPS = (decode_attention, mla_verify, turboquant, ue8m0_cache, lse_merge)
ALL_CASES = {m.__name__.rsplit(".", 1)[-1]: m.bench_cases() for m in OPS}


def matching(spec: str) -> list:
    """The bench cases a spec names: ``"part"`` (a part of the case's name, any op) or ``"op:part"``."""
    op, _, part = spec.rpartition(":")
    return [case for name, cases in ALL_CASES.items() if not op or name == op for case in cases if part in case.name]


def _captured(run):
    """One call of ``run`` captured in a CUDA graph (after a warm-up call on a side stream): the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _mean_us(run) -> float:
    """Mean microseconds per call of ``run`` from CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    for _ in range(CALLS):
        run()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / CALLS


def kernel_times(run, graph: bool = False) -> tuple[dict[str, float], float]:
    """(mean microseconds per call by kernel name, mean microseconds per call from CUDA events): eager calls, or with
    ``graph`` replays of one captured call (the profiler sees the kernels a replay runs as it sees eager ones)."""
    if graph:
        run = _captured(run)
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
    return dict(times), _mean_us(run)


def after_flush(run, dirty: bool = True) -> tuple[float, float, float]:
    """``(call, gap before, gaps between)`` in microseconds (medians over ``CALLS``): the call timed by CUDA events
    after an L2 flush as ``triton.testing.do_bench`` times it, the GPU idle from the flush's end to the call's first
    kernel, and the summed idle between the call's kernels. do_bench's flush writes zeros over 256 MB, which leaves
    the L2 full of dirty lines that the call's own traffic then writes back; ``dirty=False`` flushes by reading the
    256 MB instead (a sum), which evicts the same lines and leaves them clean: the difference is what the
    write-back costs the call."""
    evict = l2_flush(dirty)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as alone:  # the flush's own kernels, to tell them apart
        evict()
        torch.cuda.synchronize()
    flush_names = {e.name for e in alone.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for start, stop in events:
            evict()
            start.record()
            run()
            stop.record()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name in flush_names)
                     for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    flushes = [i for i, kernel in enumerate(kernels) if kernel[2]] + [len(kernels)]
    before, between = [], []
    for here, following in itertools.pairwise(flushes):  # a flush, then the call's kernels
        mine = kernels[here + 1 : following]
        if mine:
            before.append(mine[0][0] - kernels[here][1])
            between.append(sum(b[0] - a[1] for a, b in itertools.pairwise(mine)))
    calls = [start.elapsed_time(stop) * 1000 for start, stop in events]
    return statistics.median(calls), statistics.median(before), statistics.median(between)


def main(specs: list[str]) -> None:
    os.environ[CONTENT_CHECKS_ENV] = "0"
    print("| op | case | kernel: us per call | kernels' sum | in graph replay | eager call | graph replay | after a "
          "flush: call us (gap before, between) | after a reading flush |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in specs:
        for case in matching(spec):
            bench = case.setup(torch.device("cuda"))
            times, eager = kernel_times(bench.run)
            replayed, graph = kernel_times(bench.run, graph=True)
            call, before, between = after_flush(bench.run)
            clean = after_flush(bench.run, dirty=False)
            kernels = ", ".join(f"{k[:40]} {t:.1f}" for k, t in sorted(times.items(), key=lambda kv: -kv[1]))
            print(f"| {case.op} | {case.name} | {kernels} | {sum(times.values()):.1f} | {sum(replayed.values()):.1f} | "
                  f"{eager:.1f} | {graph:.1f} | {call:.1f} ({before:.1f}, {between:.1f}) | {clean[0]:.1f} "
                  f"({clean[1]:.1f}, {clean[2]:.1f}) |", flush=True)  # fmt: skip
            del bench
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
