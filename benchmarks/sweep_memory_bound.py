"""Sweep the launch-config tables of the memory-bound kernels (TurboQuant decode and store, UE8M0 insert
and gather) over their ``attnref bench`` cases; results go in ``notebooks/results/sweep_memory_bound_h200.md``.

Run from the repository root on the GPU machine:
``PYTHONPATH=. python3 benchmarks/sweep_memory_bound.py [seconds] [turboquant|store|ue8m0|merge] [name part]`` (the last
keeps only the cases whose name contains it). Each line: case, config,
median time (``triton.testing.do_bench``, content checks off), GB/s of the case's traffic formula
and its % of 4221 GB/s (the device copy ``attnref bench`` measured). A case is built once and timed
under every config; the config tables are patched in place, as a sweep of data should. Each config's
output is checked first (the case's own check, as ``attnref bench`` does); a wrong one is not timed.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton.testing

import triton_impl.lse_merge as lse_merge
import triton_impl.turboquant as turboquant
import triton_impl.ue8m0_cache as ue8m0
from triton_impl.cases import compare_check
from triton_impl.launch import forget_plans
from triton_impl.parity.lse_merge import bench_cases as lse_merge_cases
from triton_impl.parity.turboquant import bench_cases as turboquant_cases
from triton_impl.parity.ue8m0_cache import bench_cases as ue8m0_cases

os.environ["ATTNREF_CHECK_CONTENTS"] = "0"
COPY_GBPS = 4221.0
# TurboQuant decode: (BLOCK_N, num_warps, num_stages, PAIR_LUT, SMEM_CODEBOOK, JOIN_UNPACK, PRMT_CODEBOOK,
# GATHER_WORDS, KEY_SPLIT, PREFETCH); the first is the current sm90 entry. Before it (14d089e) the 4-bit stage 1
# took 661.7 us at L=8K (Nsight Compute: L1/TEX 80.4% busy, issue 27.5%). Since then the words load is contiguous
# per token (LDG.128 instead of one cache line per lane), the phases are unpacked by joins (no 2-byte STS) and the
# 3-bit fields are read in one contiguous load and split by tl.gather (shuffles). The variants, in the order the
# sm_90 static counts rank them for the L1 pipe (triton_impl/turboquant.py has the numbers): one softmax stream
# per warp with the loads left to Triton's pipeliner (KEY_SPLIT 4, PREFETCH 0), the same with the PRMT register
# lookup for 4-bit keys and with 3 stages, the pipeliner alone, PRMT alone, KEY_SPLIT with the manual prefetch
# (spills), 2-warp 64-key tiles, then the older choices (codebook gather, reshape, 3-bit two loads).
TURBOQUANT_GRID = [(128, 4, 2, 1, 1, 1, 0, 1, 1, 1), (128, 4, 2, 1, 1, 1, 0, 1, 4, 0), (128, 4, 2, 0, 1, 1, 1, 1, 4, 0),
                   (128, 4, 3, 1, 1, 1, 0, 1, 4, 0), (128, 4, 2, 1, 1, 1, 0, 1, 1, 0), (128, 4, 2, 0, 1, 1, 1, 1, 1, 1),
                   (128, 4, 2, 1, 1, 1, 0, 1, 4, 1), (64, 2, 2, 1, 1, 1, 0, 1, 2, 0), (128, 4, 2, 0, 1, 1, 0, 1, 1, 1),
                   (128, 4, 2, 1, 1, 0, 0, 1, 1, 1), (128, 4, 2, 1, 1, 1, 0, 0, 1, 1)]  # fmt: skip
# TurboQuant store: (BLOCK_T, D_CHUNK, num_warps, TF32X3), for both key kinds' tables; the sm90 entries
# are (64, 64, 4, 1) for MSE keys and (16, 32, 4, 0) for FP8 keys. Then the variants the sm_90 static
# count ranks next: T128 w8 (fewest instructions per row, one program per SM) and D_CHUNK 128.
STORE_GRID = [(64, 64, 4, 1), (128, 64, 8, 1), (64, 128, 4, 1), (64, 64, 8, 1), (16, 32, 4, 0)]
# UE8M0 insert/gather: (tokens_per_program, gather_workers, num_warps[, decode, fnuz_encode, rope_words]);
# the first is the sm90 entry. The per-value variants and tokens-per-program choices timed before are in
# sweep_memory_bound_h200.md; after the insert's finite fast path (6561f01, sm_90 static count per token: insert
# OCP 424 -> 230, FNUZ 462 -> 266 warp instructions) the open question is the tile: 8 tokens on 4 warps
# counts 201 / 270, 2 tokens more programs in flight.
UE8M0_GRID = [(4, 512, 4, "cvt", "cvt", True), (8, 512, 4, "cvt", "cvt", True), (2, 512, 4, "cvt", "cvt", True),
              (8, 512, 8, "cvt", "cvt", True)]  # fmt: skip


# Split merge (merge_splits): (MAX_BLOCK_S_D, num_warps); the first is the default entry. Warp
# instructions per program at S=16 D=128 / S=8 D=512 (benchmarks/sass_sm90_lse_merge.py, Triton 3.6):
# 453 / 575 with one warp, 838 / 986 with two, 1424 / 1468 with four; (2048, 1) splits D=512 into two
# tiles of 4 (826). The kernel before it: 2488 / 2596 with four warps.
MERGE_GRID = [(4096, 1), (4096, 2), (4096, 4), (2048, 1)]


def set_merge(max_s_d: int, warps: int) -> str:
    lse_merge.SPLIT_MERGE_CONFIGS["sm90"] = {"MAX_BLOCK_S_D": max_s_d, "num_warps": warps}
    return f"S*D<={max_s_d} w{warps}"


def set_turboquant(block_n: int, warps: int, stages: int, pair_lut: int, smem_codebook: int, join_unpack: int = 1,
                   prmt_codebook: int = 0, gather_words: int = 1, key_split: int = 1,
                   prefetch: int = 1) -> str:  # fmt: skip
    turboquant.DECODE_CONFIGS["sm90"] = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                                         "PAIR_LUT": pair_lut, "SMEM_CODEBOOK": smem_codebook,
                                         "JOIN_UNPACK": join_unpack, "PRMT_CODEBOOK": prmt_codebook,
                                         "GATHER_WORDS": gather_words, "KEY_SPLIT": key_split,
                                         "PREFETCH": prefetch}  # fmt: skip
    return (f"BN{block_n} w{warps} s{stages} pair{pair_lut} smem{smem_codebook} join{join_unpack} prmt{prmt_codebook}"
            f" gatherwords{gather_words} split{key_split} prefetch{prefetch}")  # fmt: skip


def set_store(block_t: int, d_chunk: int, warps: int, tf32x3: int) -> str:
    config = {"BLOCK_T": block_t, "D_CHUNK": d_chunk, "num_warps": warps, "TF32X3": tf32x3}
    turboquant.STORE_CONFIGS["sm90"] = turboquant.FP8_KEY_STORE_CONFIGS["sm90"] = config
    return f"T{block_t} chunk{d_chunk} w{warps}" + " tf32x3" * tf32x3


def set_ue8m0(tokens: int, workers: int, warps: int, decode: str = "int", fnuz_encode: str = "int",
              rope_words: bool = False) -> str:  # fmt: skip
    ue8m0.LAUNCH_CONFIGS["sm90"] = ue8m0.LaunchConfig(tokens, workers, warps, decode, fnuz_encode, rope_words)
    options = [f"decode={decode}"] * (decode != "int") + [f"fnuz_encode={fnuz_encode}"] * (fnuz_encode != "int")
    return " ".join([f"T{tokens} workers{workers} w{warps}", *options, *["rope_words"] * rope_words])


def main(budget_s: float, only: str | None = None, name_contains: str = "") -> None:
    device = torch.device("cuda")
    deadline = time.time() + budget_s
    cases = []
    if only in (None, "turboquant"):
        cases += [(c, set_turboquant, TURBOQUANT_GRID) for c in turboquant_cases() if "decode" in c.name]
    if only in (None, "turboquant", "store"):
        cases += [(c, set_store, STORE_GRID) for c in turboquant_cases() if "store" in c.name]
    if only in (None, "ue8m0"):
        cases += [(c, set_ue8m0, UE8M0_GRID) for c in ue8m0_cases()]
    if only in (None, "merge"):
        cases += [(c, set_merge, MERGE_GRID) for c in lse_merge_cases() if "merge_splits" in c.name]
    for case, apply, grid in cases:
        if name_contains not in case.name:
            continue
        bench = case.setup(device)
        for config in grid:
            if time.time() > deadline:
                return
            label = apply(*config)
            forget_plans()  # plans made before the table edit hold the old config
            try:
                bench.run()
                wrong = [check.output for check in bench.check() if not compare_check(check).ok]
                ms = triton.testing.do_bench(bench.run, warmup=25, rep=100, return_mode="median")
            except Exception as err:  # a config that does not compile is a result too
                print(f"{case.name} | {label} | {type(err).__name__}", flush=True)
                continue
            if wrong:  # a config whose output fails the case's check is not a result
                print(f"{case.name} | {label} | WRONG: {', '.join(wrong)}", flush=True)
                continue
            gbps = bench.bytes / ms / 1e6
            print(f"{case.name} | {label} | {ms:.4f} ms | {gbps:.0f} GB/s | {100 * gbps / COPY_GBPS:.1f}%", flush=True)
        del bench
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 240.0, sys.argv[2] if len(sys.argv) > 2 else None,
         sys.argv[3] if len(sys.argv) > 3 else "")
