"""MLA verify at 128 heads over the batch around two whole rounds of programs, for the GPU machine: what a round's idle
tail costs.

``PYTHONPATH=. python3 benchmarks/mla_rounds.py [qlen] [L] [B ...]`` (default qlen 4, 32768 keys, B = 30 31 32 33 34).
At qlen 4 a request has 512 (token, head) rows, 8 programs of the 64-row stage 1 (one split each at these lengths):
B=32 is 256 programs, two rounds on the H200's 132 SMs of which the second is 124 programs, B=33 two full rounds.
Each B is an ``attnref bench`` case (``triton_impl.parity.mla_verify.bench_case``: checked against the float64 golden
model, timed as the bench times, FlashInfer beside it where it imports). Two models of the time:

- the round's tail binds (each program's time is set by its own SM): the time is the same at B=31, 32, 33;
- a shared resource binds (L2 or DRAM bandwidth over all SMs): the time grows with B, ``time(33) / time(32) = 33 /
  32``.

Per B a row gives the split count the launch picks (``verify_num_kv_splits``: at B=30 and 34 more than one, which
shortens the last round at the cost of partials and a merge), the programs, the time, the time per request (``ms /
B``), and FlashInfer's time and ratio.
"""

from __future__ import annotations

import sys

import torch

from triton_impl import bench
from triton_impl.mla_verify import verify_num_kv_splits, verify_row_blocks
from triton_impl.parity.mla_verify import bench_case


def main(qlen: int = 4, length: int = 32768, *batches: int) -> None:
    batches = batches or (30, 31, 32, 33, 34)
    ceilings = bench.measure_ceilings()
    cases = [bench_case(batch, 128, qlen, length) for batch in batches]
    results = bench.run_bench(cases, ceilings, baselines=False)
    print(f"copy {ceilings['copy_gbps']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| B | splits | programs | ms | ms / B | % of roofline | FlashInfer ms (ours/peer speed) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch, r in zip(batches, results):
        splits = verify_num_kv_splits(length, batch, qlen, 128, sms, block_h=64)
        programs = batch * splits * verify_row_blocks(qlen, 128, 64)
        if not r.correct:
            print(f"| {batch} | {splits} | {programs} | WRONG: {r.detail} | | | |")
            continue
        print(f"| {batch} | {splits} | {programs} | {r.ms:.4f} | {r.ms / batch:.5f} | {r.pct_roofline:.1f}% | "
              f"{bench._peer_cell(r, 'FlashInfer')} |")  # fmt: skip


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
