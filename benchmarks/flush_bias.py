"""How much the benchmark's L2 flush adds to short memory-bound timings, on a GPU.

Run from the repository root: ``PYTHONPATH=. python3 benchmarks/flush_bias.py``. ``attnref bench`` times
with ``triton.testing.do_bench``, which flushes L2 before every call by zeroing a 256 MB buffer: the L2 then
holds up to its capacity (50 MB on the H200) of dirty lines, and the timed kernel pays for writing them
back to DRAM while it streams its own bytes. For each case below the script prints three medians:

- ``do_bench``: the bench's method (zeroing flush, events around each call);
- ``read flush``: the same events after a flush that only reads a 256 MB buffer (clean lines, nothing to
  write back);
- ``graph``: back-to-back CUDA-graph replay, no flush (``do_bench_cudagraph``).

and the GB/s each gives over the case's bytes. The difference between the first two is the flush's
write-back inside the timed kernel; it matters for kernels of ~0.1 ms (50 MB at ~4 TB/s is ~12 us).
"""

from __future__ import annotations

import os

import torch
import triton.testing

from triton_impl.parity import registered_bench_cases

os.environ["ATTNREF_CHECK_CONTENTS"] = "0"
CASES = ("GQA 32/8 D128 B=128 H=32 L=1024", "GQA 32/8 D128 B=32 H=32 L=8192", "MLA 576/512 B=32 H=16 L=32768",
         "merge_splits R=4096", "insert 1M tokens block 64 OCP", "turboquant_k8v4 store")  # fmt: skip


def read_flush_ms(fn, reps: int = 100) -> float:
    """Median ms of ``fn`` between two events, each call after summing a 256 MB buffer (an L2 of clean lines)."""
    flush = torch.ones(64 * 2**20, dtype=torch.float32, device="cuda")
    for _ in range(10):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]


def main() -> None:
    device = torch.device("cuda")
    print("case | do_bench ms (GB/s) | read flush ms (GB/s) | graph ms (GB/s)")
    for case in registered_bench_cases():
        if not any(name in case.name for name in CASES):
            continue
        bench = case.setup(device)
        bench.run()
        torch.cuda.synchronize()
        times = (triton.testing.do_bench(bench.run, warmup=25, rep=100, return_mode="median"),
                 read_flush_ms(bench.run), triton.testing.do_bench_cudagraph(bench.run, rep=100))  # fmt: skip
        print(f"{case.name} | " + " | ".join(f"{ms:.4f} ({bench.bytes / ms / 1e6:.0f})" for ms in times), flush=True)
        del bench
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
