"""GPU time of each kernel of a TurboQuant decode call (query rotation, stage 1, split merge), from the
CUDA profiler, for the bench's decode cases, under variants of the sm90 decode config: by default the sm_90
Gluon stage 1 and the portable one; with ``splits``, split caps (``SPLIT_ROUNDS`` rounds of
``PROGRAMS_PER_SM`` resident programs a SM, ``decode_attention.stage1_splits``) against the caller's 32; with
``lengths``, the bench's shape at every request length from 1K to 32K keys (the tree's config), and the line
through 2K-32K: stage 1's time per 1K keys and its time at L=0, the part of a call that does not grow with L.

``PYTHONPATH=. python3 benchmarks/turboquant_kernels.py [name part] [splits | lengths]`` on a GPU machine (with
``lengths`` the name part is a preset, e.g. ``3bit_nc``). Each case is set up as ``attnref bench`` sets it up, run 3
times to compile, then 20 times under ``torch.profiler``; the table gives each kernel's mean microseconds per call,
the whole call's mean from CUDA events, and the call as the bench times it (``triton_impl.bench.bench_ms``).
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

import triton_impl.turboquant as turboquant
from benchmarks.kernel_times import kernel_times
from triton_impl.bench import bench_ms, per_length_line
from triton_impl.parity.turboquant import bench_cases, decode_bench_case

# Variants: the sm90 entry's keys each sets; the last is the reference the outputs are compared with.
STAGE1 = {"Gluon": {"GLUON": 1}, "portable": {"GLUON": 0}}
SPLITS = {f"{rounds} rounds": {"SPLIT_ROUNDS": rounds, "PROGRAMS_PER_SM": 4} for rounds in (1, 2, 4, 8)} | {
    "32 splits": {"SPLIT_ROUNDS": 0}}


LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def _by_kernel(times: dict[str, float]) -> tuple[float, float, float]:
    """``(rotation, stage 1, merge)`` microseconds from :func:`kernel_times`'s per-kernel times."""
    return tuple(sum(t for name, t in times.items() if part in name) for part in ("rotate", "stage1", "merge"))


def over_lengths(preset: str) -> None:
    """Stage 1 (and the other two kernels) of ``preset``'s bench decode at each of :data:`LENGTHS`, then the least
    squares line through the lengths from 2K: microseconds per 1K keys and at L=0."""
    print(f"| {preset} | L | rotation | stage 1 | merge | whole call (events) |")
    print("| --- | --- | --- | --- | --- | --- |")
    stage1 = {}
    for length in LENGTHS:
        bench = decode_bench_case(preset, length).setup(torch.device("cuda"))
        times, whole = kernel_times(bench.run)
        rotate, stage1[length], merge = _by_kernel(times)
        print(f"| | {length} | {rotate:.1f} | {stage1[length]:.1f} | {merge:.1f} | {whole:.1f} |", flush=True)
        del bench
        torch.cuda.empty_cache()
    slope, intercept = per_length_line(stage1)
    print(f"stage 1 of {preset}: {slope:.2f} us per 1K keys + {intercept:.1f} us (2K-32K)")


def main(name_part: str = "", mode: str = "") -> None:
    if mode == "lengths":
        over_lengths(f"turboquant_{name_part}")
        return
    device = torch.device("cuda")
    variants = SPLITS if mode == "splits" else STAGE1
    reference = list(variants)[-1]
    print(f"| case | variant | rotation | stage 1 | merge | whole call (events) | bench ms | max abs difference to "
          f"{reference} |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in bench_cases():
        if "decode" not in case.name or name_part not in case.name:
            continue
        bench = case.setup(device)
        rows, outputs = [], {}
        for name, keys in variants.items():
            with mock.patch.dict(turboquant.DECODE_CONFIGS, {"sm90": turboquant.DECODE_CONFIGS["sm90"] | keys}):
                turboquant._PLANS.clear()
                times, whole = kernel_times(bench.run)
                ms = bench_ms(bench.run)
                outputs[name] = bench.run().float().clone()
            rotate, stage1, merge = _by_kernel(times)
            rows.append((name, rotate, stage1, merge, whole, ms))
        turboquant._PLANS.clear()
        for name, rotate, stage1, merge, whole, ms in rows:
            diff = (outputs[name] - outputs[reference]).abs().max().item()
            print(f"| {case.name} | {name} | {rotate:.1f} | {stage1:.1f} | {merge:.1f} | {whole:.1f} | {ms:.4f} | "
                  f"{diff:.2e} |", flush=True)  # fmt: skip
        del bench
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:3])
