"""Sweep stage-1 launch configs of ``mla_verify`` on a GPU; results go in ``notebooks/results/sweep_verify_h200.md``.

Run from the repository root on the GPU machine:
``PYTHONPATH=. python3 benchmarks/sweep_verify.py [seconds] [headline|splits]`` (``headline``: only the verify
target's shape in ``notebooks/results/perf_log.md``, B=32, qlen 4, H=128, L=32K, over the 64-row grid; ``splits``:
the sm90 entries' two tiles, 32 and 64 rows, at every bench shape and at split counts from the caller's
``verify_num_kv_splits`` up by powers of two, to see where the caller's count leaves SMs idle).
Each line: shape (B, qlen, H, L), split count, config, time (CUDA-graph replay), TFLOP/s and % of a
roofline of max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s), an earlier H200 measurement of a bf16 8192^3 matmul
on random data and of a device-to-device copy. ``attnref bench`` measures its own ceilings in every run (679-695
TFLOP/s, 4221-4247 GB/s), so these percentages are lower than the bench table's.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from functools import partial

import torch
import triton
import triton.testing

import triton_impl  # noqa: F401
from triton_impl.mla_verify import (
    VERIFY_CONFIGS,
    VERIFY_DEFAULT_CONFIG,
    decode_attention_fwd_verify,
    verify_num_kv_splits,
    verify_row_blocks,
)

os.environ["ATTNREF_CHECK_CONTENTS"] = "0"
LV, ROPE, PAGE = 512, 64, 64
SHAPES = [(8, 4, 16, 4096), (32, 4, 16, 4096), (8, 4, 128, 4096), (64, 1, 128, 2048), (64, 2, 16, 4096)]
# (BLOCK_H, BLOCK_N, num_warps, num_stages, SPLIT_LATENT)
GRID = [(16, 32, 4, 2, False), (32, 32, 4, 2, False), (32, 32, 4, 2, True), (32, 64, 4, 2, True),
        (64, 32, 8, 2, True), (64, 64, 8, 2, True), (64, 64, 8, 3, True)]  # fmt: skip
HEADLINE_SHAPES = [(32, 4, 128, 32768)]
SPLIT_SHAPES = [*SHAPES, (16, 8, 128, 4096), (1, 4, 128, 32768), (32, 4, 128, 32768)]
HEADLINE_GRID = [(64, 32, 8, 2, True), (64, 32, 8, 3, True), (64, 16, 8, 2, True), (64, 16, 8, 3, True),
                 (64, 32, 4, 2, True), (64, 64, 8, 2, True)]  # fmt: skip


def problem(batch: int, qlen: int, heads: int, length: int, device: torch.device):
    pages = batch * triton.cdiv(length, PAGE)
    cache = torch.randn(pages, PAGE, 1, LV + ROPE, device=device).to(torch.bfloat16)
    table = torch.randperm(pages, device=device).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    q = torch.randn(batch * qlen, heads, LV + ROPE, device=device).to(torch.bfloat16)
    o = torch.empty(batch * qlen, heads, LV, device=device, dtype=torch.bfloat16)
    lse = torch.empty(batch * qlen, heads, device=device)
    flops = 2 * batch * qlen * heads * length * (LV + ROPE + LV)
    nbytes = batch * length * (LV + ROPE) * 2 + batch * qlen * heads * ((LV + ROPE) * 2 + LV * 2 + 4)
    return (q, cache, table, seq_lens, o, lse), flops, nbytes


def main(budget_s: float, shapes=SHAPES, grid=GRID) -> None:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    start = time.time()
    for (batch, qlen, heads, length), (bh, bn, warps, stages, split_latent) in itertools.product(shapes, grid):
        if time.time() - start > budget_s:
            break
        (q, cache, table, seq_lens, o, lse), flops, nbytes = problem(batch, qlen, heads, length, device)
        splits = verify_num_kv_splits(length, batch, qlen, heads, sms, block_h=bh)
        logits = torch.empty(batch * qlen, heads, splits, LV + 1, device=device)
        cfg = {**VERIFY_DEFAULT_CONFIG, "BLOCK_H": bh, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
               "SPLIT_LATENT": split_latent}  # fmt: skip

        def run() -> None:
            decode_attention_fwd_verify(q, cache, cache[..., :LV], o, lse, table, seq_lens, None, qlen,  # noqa: B023
                                        logits, splits, 192**-0.5, PAGE, config=cfg)  # noqa: B023  # fmt: skip

        try:
            run()
            ms = triton.testing.do_bench_cudagraph(run, rep=20)
        except Exception as err:  # a config that does not compile (shared memory) is a result too
            shape = (batch, qlen, heads, length)
            print(f"{shape} BH{bh} BN{bn} w{warps} s{stages} sl{int(split_latent)}: {type(err).__name__}")
            continue
        roofline = max(flops / 790e12, nbytes / 4.3e12) * 1e3
        config = f"S={splits:3d} BH{bh} BN{bn} w{warps} s{stages} sl{int(split_latent)}"
        print(f"{(batch, qlen, heads, length)} {config} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TF/s "
              f"roofline {100 * roofline / ms:5.1f}%", flush=True)  # fmt: skip


def sweep_splits(budget_s: float) -> None:
    """Both sm90 tiles at the caller's split count and at 2, 4, ... times it (at most 64 splits)."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    start = time.time()
    for batch, qlen, heads, length in SPLIT_SHAPES:
        (q, cache, table, seq_lens, o, lse), flops, nbytes = problem(batch, qlen, heads, length, device)
        caller = verify_num_kv_splits(length, batch, qlen, heads, sms)
        roofline = max(flops / 790e12, nbytes / 4.3e12) * 1e3
        for size, splits in itertools.product(("small", "large"), (caller << i for i in range(7))):
            if splits > max(caller, 64) or time.time() - start > budget_s:
                continue
            cfg = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS["sm90"][size]}
            logits = torch.empty(batch * qlen, heads, splits, LV + 1, device=device)
            run = partial(decode_attention_fwd_verify, q, cache, cache[..., :LV], o, lse, table, seq_lens, None, qlen,
                          logits, splits, 192**-0.5, PAGE, config=cfg)  # fmt: skip
            run()
            torch.cuda.synchronize()  # do_bench_cudagraph's first call runs on a new stream
            ms = triton.testing.do_bench_cudagraph(run, rep=30)
            programs = batch * verify_row_blocks(qlen, heads, cfg["BLOCK_H"]) * splits
            print(f"{(batch, qlen, heads, length)} {size:5s} BH{cfg['BLOCK_H']} S={splits:3d} (caller {caller:2d}, "
                  f"{programs:5d} programs) {ms * 1e3:8.1f} us roofline {100 * roofline / ms:5.1f}%", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[2:] == ["splits"]:
        sweep_splits(float(sys.argv[1]))
        sys.exit()
    headline = sys.argv[2:] == ["headline"]
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 400.0, *((HEADLINE_SHAPES, HEADLINE_GRID) if headline else ()))
