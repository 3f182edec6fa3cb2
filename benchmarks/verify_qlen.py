"""MLA verify at 16 heads over the draft length, for the GPU machine: where one request's rows stop fitting one tile.

``PYTHONPATH=. python3 benchmarks/verify_qlen.py [B] [L] [max qlen]`` (default 32 requests of 32768 keys, qlen 1-8).
Each qlen is an ``attnref bench`` case (``triton_impl.parity.mla_verify.bench_case``: checked against the float64
golden model, timed as the bench times, FlashInfer beside it where it imports). A row gives the (token, head) rows a
request has (the 64-row stage 1 holds 64 of them a tile), the time, the bench's roofline (the larger of the copy and
the matmul time, from ceilings measured in this run) and the copy time alone, since at 16 heads the bound turns from
memory to compute between qlen 5 (80 rows: 151 FLOP a cache byte) and 6 (181; the H200's ridge is ~165).
"""

from __future__ import annotations

import sys

from triton_impl import bench
from triton_impl.parity.mla_verify import bench_case


def main(batch: int = 32, length: int = 32768, max_qlen: int = 8, heads: int = 16) -> None:
    ceilings = bench.measure_ceilings()
    cases = [bench_case(batch, heads, qlen, length) for qlen in range(1, max_qlen + 1)]
    results = bench.run_bench(cases, ceilings, baselines=False)
    print(f"copy {ceilings['copy_gbps']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    print("| qlen | rows a request | ms | bound | roofline ms | % of roofline | copy ms | % of copy | "
          "FlashInfer ms (ours/peer speed) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for qlen, r in enumerate(results, start=1):
        if not r.correct:
            print(f"| {qlen} | {qlen * heads} | WRONG: {r.detail} | | | | | | |")
            continue
        copy_ms = r.gbps * r.ms / ceilings["copy_gbps"]  # bytes / copy bandwidth
        peer = bench._peer_cell(r, "FlashInfer")
        print(f"| {qlen} | {qlen * heads} | {r.ms:.4f} | {r.bound} | {r.roofline_ms:.4f} | {r.pct_roofline:.1f}% | "
              f"{copy_ms:.4f} | {100 * copy_ms / r.ms:.1f}% | {peer} |")  # fmt: skip


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
