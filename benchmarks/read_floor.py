"""How fast a plain read of exactly a bench case's bytes runs, beside the case itself, for the GPU machine.

``PYTHONPATH=. python3 benchmarks/read_floor.py "op:name part" ...`` (specs as ``benchmarks/kernel_times.py`` takes
them). The bench's roofline divides a case's bytes by the copy bandwidth of 1 GiB each way; a call that reads a few
hundred MB pays its launch and the memory system's ramp out of the same time, and a read alone may run faster than a
copy, so what share of that roofline a kernel can reach depends on the case. On the H200 a plain read reached
97.8-102.6% at 214-412 MB and 104-108% from 570 MB (``notebooks/results/perf_log.md``, forty-eighth session). For each
case this times, in one run and as the bench times (``triton_impl.bench.cold_ms``: the median over calls each after a
reading L2 flush):

- the read floor: a kernel that reads a flat buffer of the case's roofline bytes once, 16-byte loads, and writes one
  word a program (the fastest of a few tile shapes, named in the row);
- the case's own call, content checks off.

A row: the bytes, the copy roofline (bytes / this run's copy bandwidth), the read floor (its share of the copy
roofline), the call (its share), and the call over the read floor.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from benchmarks.kernel_times import matching
from triton_impl.bench import cold_ms, measure_ceilings
from triton_impl.validation import CONTENT_CHECKS_ENV

SHAPES = list(itertools.product((1024, 2048, 4096), (1, 4), (4, 8)))  # (BLOCK words, STEPS, num_warps)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Program ``p`` reads words ``[p * BLOCK * STEPS, (p + 1) * BLOCK * STEPS)`` and stores their sum."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for step in tl.static_range(STEPS):
        at = start + step * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + at, mask=at < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_floor_ms(num_bytes: float) -> tuple[float, str]:
    """The fastest cold read of ``num_bytes`` (rounded up to whole 4-byte words) over :data:`SHAPES`, and its shape."""
    n_words = -(-int(num_bytes) // 4)
    src = torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda")
    best = (float("inf"), "")
    for block, steps, warps in SHAPES:
        programs = triton.cdiv(n_words, block * steps)
        out = torch.empty(programs, dtype=torch.int32, device="cuda")
        run = functools.partial(_read_kernel[(programs,)], src, out, n_words, BLOCK=block, STEPS=steps,
                                num_warps=warps)  # fmt: skip
        run()
        assert out.sum(dtype=torch.int64).item() % 2**32 == src.sum(dtype=torch.int64).item() % 2**32
        best = min(best, (cold_ms(run), f"{block}x{steps} words, {warps} warps"))
    return best


def main(specs: list[str]) -> None:
    os.environ[CONTENT_CHECKS_ENV] = "0"
    copy_gbps = measure_ceilings()["copy_gbps"]
    print(f"copy {copy_gbps:.0f} GB/s (1 GiB each way)")
    print("| op | case | MB read | copy roofline us | read floor us (% of roofline; shape) | call us (% of roofline) | "
          "call / read floor |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in specs:
        for case in matching(spec):
            bench = case.setup(torch.device("cuda"))
            num_bytes, call_us = bench.bytes, cold_ms(bench.run) * 1e3
            del bench
            torch.cuda.empty_cache()
            roofline_us = num_bytes / copy_gbps / 1e3
            floor_ms, shape = read_floor_ms(num_bytes)
            floor_us = floor_ms * 1e3
            print(f"| {case.op} | {case.name} | {num_bytes / 1e6:.1f} | {roofline_us:.1f} | {floor_us:.1f} "
                  f"({100 * roofline_us / floor_us:.1f}%; {shape}) | {call_us:.1f} "
                  f"({100 * roofline_us / call_us:.1f}%) | {call_us / floor_us:.2f} |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
