"""Sweep the launch-config tables of the memory-bound kernels (TurboQuant decode and store, UE8M0 insert
and gather) over their ``attnref bench`` cases; results go in ``notebooks/results/sweep_memory_bound_h200.md``.

Run from the repository root on the GPU machine:
``PYTHONPATH=. python3 benchmarks/sweep_memory_bound.py [seconds] [turboquant|store|ue8m0|merge] [name part]`` (the last
keeps only the cases whose name contains it; ``SWEEP_TOP=n`` times only each grid's first n configs). Each
line: case, config, median time (``triton.testing.do_bench``, content checks off), GB/s of the case's traffic formula
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
# TurboQuant decode: (BLOCK_N, num_warps, num_stages, PAIR_LUT, SMEM_CODEBOOK, JOIN_UNPACK, GATHER_WORDS,
# PREFETCH, maxnreg); the first is the sm90 entry for 4-bit keys, the second its entry for the other widths.
# Before them (14d089e) the 4-bit stage 1 took 661.7 us at L=8K (Nsight Compute: L1/TEX 80.4% busy, issue slots
# 27.5%). Since then the words load is contiguous per token (LDG.128
# instead of one cache line per lane), the phases are unpacked by joins (no 2-byte STS) and the 3-bit fields are
# read in one contiguous load and split by tl.gather (shuffles). The variants: the loads left to Triton's
# pipeliner (PREFETCH 0; 4-bit 0.5047 ms against 0.4232 on the H200), then the older choices (codebook gather,
# reshape, 3-bit two loads); triton_impl/turboquant.py has their static counts. One softmax stream per warp
# (KEY_SPLIT) and the PRMT register lookup were timed slower and removed after fb849fb.
# A ninth field caps the registers (maxnreg): the sm90 entry's 224 (4-bit) to 240 (k8v4) registers let two 4-warp
# programs share an SM (8 warps), a latency-bound schedule (issue slots 27.5% busy); 168 fits three, 128 four (sm_90
# static counts, Triton 3.6: BN128 prefetch0 at 168 registers spills 32-64 B, 62.6-73.5 warp instructions per key;
# BN64 prefetch0 at 128 spills 8-56 B, 80.7-90.1).
TURBOQUANT_GRID = [(128, 4, 2, 1, 1, 1, 1, 1), (128, 4, 2, 1, 1, 1, 1, 0, 168), (64, 4, 2, 1, 1, 1, 1, 0, 128),
                   (128, 4, 2, 1, 1, 1, 1, 1, 168), (128, 4, 2, 1, 1, 1, 1, 0), (128, 4, 2, 0, 1, 1, 1, 1),
                   (128, 4, 2, 1, 1, 0, 1, 1), (128, 4, 2, 1, 1, 1, 0, 1)]  # fmt: skip
# TurboQuant store: (BLOCK_T, D_CHUNK, num_warps, TF32X3, num_stages, maxnreg (0: none)); STORE_GRID for the
# MSE presets, FP8_STORE_GRID for FP8 keys (no rotation: D_CHUNK, TF32X3 and num_stages unused), each first the
# sm90 entry, then in the order to time them. sm_90 static counts (benchmarks/sass_sm90_turboquant.py, Triton
# 3.6, 4-bit; registers, shared memory, programs per SM by both, warp instructions per row, LDS + STS per row):
# sm90 entry 254, 80 KiB, 2, ~432, 38; bf16x3 (TF32X3 = 2) T64 chunk32 w4 1 stage 117, 8 KiB, 4, ~360, 15;
# bf16x3 T128 chunk32 w8 1 stage 124, 16 KiB, 2 (16 warps), ~332, 13; bf16x3 T64 chunk64 w4 1 stage 167, 16 KiB,
# 3, ~347, 11; 3xTF32 T64 chunk32 w4 1 stage capped at 128 registers (8 B of stack), 8 KiB, 4, ~451, 44; 3xTF32
# T64 chunk64 w4 1 stage 230, 32 KiB, 2, ~380, 33; bf16x3 T64 chunk32 w4 1 stage capped at 96 registers (no
# stack), 8 KiB, 5, ~397, 15. FP8 keys: 106 warp instructions per row at T16 w4, 91 at T32
# w4 and T16 w2, 80 at T64 w4 (228 executed at 9ff0941, Nsight Compute). The sm90 FP8 entry since 580e9fc: T8 w1.
STORE_GRID = [(64, 64, 4, 1, 3, 0), (64, 32, 4, 2, 1, 0), (128, 32, 8, 2, 1, 0), (64, 64, 4, 2, 1, 0),
              (64, 32, 4, 1, 1, 128), (64, 64, 4, 1, 1, 0), (64, 32, 4, 2, 1, 96), (128, 32, 4, 2, 1, 0),
              (128, 64, 4, 2, 1, 0)]  # fmt: skip
FP8_STORE_GRID = [(8, 32, 1, 0, 3, 0), (16, 32, 4, 0, 3, 0), (4, 32, 1, 0, 3, 0), (16, 32, 1, 0, 3, 0),
                  (8, 32, 1, 0, 2, 0), (8, 32, 1, 0, 3, 64), (8, 32, 2, 0, 3, 0), (32, 32, 4, 0, 3, 0),
                  (16, 32, 2, 0, 3, 0), (16, 32, 4, 0, 3, 64)]  # fmt: skip
# UE8M0 insert/gather: (tokens_per_program, gather_workers, num_warps[, decode, fnuz_encode, rope_words[,
# insert_programs, stages, prefetch_table[, gather_tokens[, evict[, insert_max_registers, gather_max_registers[,
# fnuz_gather_warps, fnuz_gather_tokens]]]]]]); the first is the sm90 entry (since 2026-12-02 FNUZ gathers 2 tokens
# a tile on 2 warps, and 1024 gather workers), the second the one before it; the third the entry of 33817e6 (since
# then the FNUZ insert has 58 registers, not 94, and the gather issues its RoPE loads before its stores). The rest,
# ranked by the sm_90 static count (benchmarks/sass_sm90_ue8m0.py: registers, 4-warp blocks per SM, warp
# instructions per token; none of these spills on the common path):
# - gather tiles of 4 tokens (OCP 32 registers, 16 blocks, 217 per token; FNUZ 39, 12, 345), register caps (insert
#   48: OCP 10 blocks, 204; FNUZ spills 6 words, 277; insert 56: FNUZ 9 blocks, 268; gather 40: 12 blocks, OCP 216,
#   FNUZ 338), the FNUZ "branch" decode (no fix-ups in a tile without FNUZ's NaN / +-240 codes: 56, 9, 268 at 4
#   tokens; 80, 6, 244 at 8) and L2 eviction hints (evict: streamed data evict_first, scale bytes evict_last);
# - a capped insert grid looping over tiles with cp.async pipelined loads (insert_programs = 132 SMs x the blocks
#   that fit, one wave; 16384 / 32768: many waves, in case fewer fit): insert OCP T4 s2 55, 9, 233; T4 s3 54, 9,
#   265; T8 s2 72, 7, 220 (FNUZ 80, 6: so 792 programs); with the gather pipelined over more iterations per
#   worker (fewer workers) and its block-table entries an iteration ahead (T4 s2: 40, 12, 251; FNUZ 440);
# - the block-table prefetch alone (T8: OCP 64, 8, 226; T4: 40, 12, 239) and 2-token gather tiles (32, 16, 244).
UE8M0_GRID = [(8, 1024, 4, "branch", "cvt", True, 0, 1, False, 4, False, 0, 40, 2, 2),
              (8, 512, 4, "branch", "cvt", True, 0, 1, False, 4, False, 0, 40),
              (8, 512, 4, "cvt", "cvt", True),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, False, 4),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, False, 0, False, 48, 40),
              (8, 512, 4, "branch", "cvt", True, 0, 1, False, 4),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, False, 0, True),
              (8, 512, 4, "branch", "cvt", True, 0, 1, False, 4, True, 56, 0),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, False, 0, False, 56, 0),
              (8, 512, 4, "branch", "cvt", True),
              (4, 256, 4, "cvt", "cvt", True, 1188, 2, True),
              (8, 128, 4, "cvt", "cvt", True, 792, 2, True),
              (4, 128, 4, "cvt", "cvt", True, 1188, 3, False),
              (8, 512, 4, "cvt", "cvt", True, 16384, 2, True),
              (4, 512, 4, "cvt", "cvt", True, 32768, 3, True),
              (4, 256, 4, "cvt", "cvt", True, 1188, 4, False),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, True),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, True, 4),
              (8, 512, 4, "cvt", "cvt", True, 0, 1, False, 2)]  # fmt: skip


# Split merge (merge_splits): (MAX_BLOCK_S_D, num_warps); the first is the default entry. Warp
# instructions per program at S=16 D=128 / S=8 D=512 (benchmarks/sass_sm90_lse_merge.py, Triton 3.6):
# 453 / 575 with one warp, 838 / 986 with two, 1424 / 1468 with four; (2048, 1) splits D=512 into two
# tiles of 4 (826). The kernel before it: 2488 / 2596 with four warps.
MERGE_GRID = [(4096, 1), (4096, 2), (4096, 4), (2048, 1)]


def set_merge(max_s_d: int, warps: int) -> str:
    lse_merge.SPLIT_MERGE_CONFIGS["sm90"] = {"MAX_BLOCK_S_D": max_s_d, "num_warps": warps}
    return f"S*D<={max_s_d} w{warps}"


def set_turboquant(block_n: int, warps: int, stages: int, pair_lut: int, smem_codebook: int, join_unpack: int = 1,
                   gather_words: int = 1, prefetch: int = 1, maxnreg: int = 0) -> str:  # fmt: skip
    turboquant.DECODE_CONFIGS["sm90"] = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                                         "PAIR_LUT": pair_lut, "SMEM_CODEBOOK": smem_codebook,
                                         "JOIN_UNPACK": join_unpack, "GATHER_WORDS": gather_words,
                                         "PREFETCH": prefetch, **({"maxnreg": maxnreg} if maxnreg else {})}  # fmt: skip
    return (f"BN{block_n} w{warps} s{stages} pair{pair_lut} smem{smem_codebook} join{join_unpack}"
            f" gatherwords{gather_words} prefetch{prefetch}" + (f" maxnreg{maxnreg}" if maxnreg else ""))  # fmt: skip


def set_store(block_t: int, d_chunk: int, warps: int, tf32x3: int, stages: int = 3, maxnreg: int = 0) -> str:
    config = {"BLOCK_T": block_t, "D_CHUNK": d_chunk, "num_warps": warps, "TF32X3": tf32x3, "num_stages": stages,
              **({"maxnreg": maxnreg} if maxnreg else {})}  # fmt: skip
    turboquant.STORE_CONFIGS["sm90"] = turboquant.FP8_KEY_STORE_CONFIGS["sm90"] = config
    rotation = ("", " tf32x3", " bf16x3")[tf32x3]
    return f"T{block_t} chunk{d_chunk} w{warps} s{stages}{rotation}" + f" maxnreg{maxnreg}" * bool(maxnreg)


def set_ue8m0(tokens: int, workers: int, warps: int, decode: str = "int", fnuz_encode: str = "int",
              rope_words: bool = False, insert_programs: int = 0, stages: int = 1, prefetch_table: bool = False,
              gather_tokens: int = 0, evict: bool = False, insert_registers: int = 0,
              gather_registers: int = 0, fnuz_gather_warps: int = 0, fnuz_gather_tokens: int = 0) -> str:  # fmt: skip
    ue8m0.LAUNCH_CONFIGS["sm90"] = ue8m0.LaunchConfig(
        tokens, workers, warps, decode, fnuz_encode, rope_words, insert_programs, stages, prefetch_table, gather_tokens,
        evict, insert_registers, gather_registers, fnuz_gather_warps, fnuz_gather_tokens,
    )
    options = [f"decode={decode}"] * (decode != "int") + [f"fnuz_encode={fnuz_encode}"] * (fnuz_encode != "int")
    options += ["rope_words"] * rope_words + [f"programs{insert_programs}"] * (insert_programs > 0)
    options += [f"stages{stages}"] * (stages > 1) + ["prefetch_table"] * prefetch_table
    options += [f"gatherT{gather_tokens}"] * (gather_tokens > 0) + ["evict"] * evict
    options += [f"insert<={insert_registers}regs"] * (insert_registers > 0)
    options += [f"gather<={gather_registers}regs"] * (gather_registers > 0)
    options += [f"fnuzgather=w{fnuz_gather_warps}T{fnuz_gather_tokens}"] * (fnuz_gather_warps + fnuz_gather_tokens > 0)
    return " ".join([f"T{tokens} workers{workers} w{warps}", *options])


def main(budget_s: float, only: str | None = None, name_contains: str = "") -> None:
    device = torch.device("cuda")
    deadline = time.time() + budget_s
    cases = []
    if only in (None, "turboquant"):
        cases += [(c, set_turboquant, TURBOQUANT_GRID) for c in turboquant_cases() if "decode" in c.name]
    if only in (None, "turboquant", "store"):
        cases += [(c, set_store, FP8_STORE_GRID if "k8v4" in c.name else STORE_GRID)
                  for c in turboquant_cases() if "store" in c.name]  # fmt: skip
    if only in (None, "ue8m0"):
        cases += [(c, set_ue8m0, UE8M0_GRID) for c in ue8m0_cases()]
    if only in (None, "merge"):
        cases += [(c, set_merge, MERGE_GRID) for c in lse_merge_cases() if "merge_splits" in c.name]
    top = int(os.environ.get("SWEEP_TOP", "0")) or None  # only each grid's first configs (they are ranked)
    for case, apply, grid in cases:
        if name_contains not in case.name:
            continue
        bench = case.setup(device)
        for config in grid[:top]:
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
