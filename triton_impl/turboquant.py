"""TurboQuant KV cache kernels: the SoA store and the split-KV decode.

Twin of ``golden/turboquant.py``, with the signatures of vLLM's ``turboquant_soa`` modules
(``triton_turboquant_store``, ``triton_turboquant_decode_attention_v2``, ``build_pair_lut``).

Store: a program quantizes ``BLOCK_T`` tokens of one KV head, the keys (norm, rotation, bucketize, optional
norm correction; or FP8) and the values (min-max), and writes the slots' data bytes and fp16 metadata.
Unlike upstream, the rotation runs inside the kernel (fp32 sums). The golden store
(``golden.turboquant.turboquant_store``) is the float64 math; the kernel's codes equal it outside
tie bands derived from an fp32 store's error bound (``triton_impl.parity.turboquant.compare_store``),
which any correct store passes, upstream's included. Inside a band a code may be one step off.

Decode: stage 1 (:func:`_decode_stage1_kernel`) gives each (request, KV head, split) one program
that serves the KV head's whole query group, so each key/value byte is read once for ``H / HKV``
query heads. It writes every split slot of ``[B, H, S, D+1]`` (an empty split as ``(0, -inf)``);
stage 2 is ``triton_impl.lse_merge.merge_splits``. Codes are read as 32-bit words, one per group
of 8 codes (each token's words in one contiguous load), and unpacked with shifts. Key codes become
centroids through an fp16 table: the 16- or 8-entry codebook, or for 4-bit keys the pair LUT
(FLUTE, papers.md#turboquant), where one 4-byte gather per packed byte returns both of its
centroids. Value codes need no table: they enter the MMA as exact fp16 integers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from triton_impl import turboquant_sm90
from triton_impl.block_table import first_bad_key
from triton_impl.decode_attention import stage1_splits
from triton_impl.interpreter import INTERPRET, e4m3_bits_to_f16, f32_to_e4m3_bits
from triton_impl.launch import (
    DescriptorsByAddress,
    Launch,
    Plans,
    current_target,
    launch,
    no_launch,
    register_cap,
    select_config,
    with_overrides,
)
from triton_impl.lse_merge import merge_splits_launch
from triton_impl.turboquant_sm90 import GRID_SLOTS, grid_code, grid_slot, grid_table
from triton_impl.validation import (
    block_table_2d,
    cdiv,
    check_block_table,
    check_flag,
    check_float,
    check_int32_lengths,
    check_int_choice,
    check_lengths,
    check_positive,
    check_tensor,
    content_checks_enabled,
    content_checks_on,
    next_pow2,
    tensor_facts,
)

_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_QUERY_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2 e)
_LN2 = tl.constexpr(0.6931471805599453)  # the stored LSE is natural-log: ln(x) = log2(x) * ln 2
_FP16_MAX = tl.constexpr(65504.0)
_KEY_NORM_EPS = tl.constexpr(1e-8)
_NORM_CORRECTION_EPS = tl.constexpr(1e-16)
_MIN_VALUE_SCALE = tl.constexpr(1e-8)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it has x rounded to an integer in its low mantissa bits
_MAX_HEAD_DIM = 1024
_STORE_OPERAND_BYTES = 128 * 1024  # the store's two fp32 rotation operands, at most

# Launch configs as data, keyed by where the kernel runs. Store: BLOCK_T (token, KV head) rows per
# program share each read of PiT; D_CHUNK columns of the rotation per step (a [BLOCK_T, D_CHUNK]
# fp32 product); the chunking changes the summation order, which the store's error bound allows.
# TF32X3 = 1 computes the rotation as three TF32 tensor-core products (Triton's "tf32x3"), 0 as
# IEEE fp32 FMAs; triton_impl.parity.turboquant.TF32X3_GEMM is the error bound the tests hold the
# former to. Under the interpreter every op costs ~0.1 ms of Python whatever its size, so one
# [D, D] step (the interpreter computes every dot in fp32). The fp32-FMA rotation is FMA- and
# spill-bound on the H200: 23.6-46.9 ms for 1M tokens x 8 KV heads (5.4% of the copy roofline at
# best, notebooks/results/sweep_memory_bound_h200.md). With 3xTF32 on sm_90 the best of 8 configs
# (51b8856) is BLOCK_T 64, D_CHUNK 64, 4 warps: 19.3-20.7 ms for the MSE presets, against 22.7-23.7
# ms for the best fp32-FMA config; FP8 keys (no rotation) are fastest at BLOCK_T 16, 4 warps
# (2.42 ms, 58% of the copy roofline; 3.10 ms at BLOCK_T 64), hence their own table.
# Since then: one division per row, a binary-search bucketize and, for 16-bit keys, two TF32 passes
# on exact TF32 keys instead of 3xTF32 (about 610-670 warp instructions per row by the static
# count, against ~2000 for the fp32-FMA config at BLOCK_T 16). Timed at 23b7894 together with
# byte-by-byte packing and 8 warps, the store got slower (k8v4 2.42 -> 4.79 ms, MSE presets
# 27.9-33.2 ms, `attnref bench`); packing went back to one masked store of each group's bytes and
# the sm90 entry back to 4 warps: 16.9-17.8 ms for the MSE presets (9ff0941, best of 4 configs).
# The bucketize is now one lookup per code in a table built per program (turboquant_sm90.grid_table, 64 slots then,
# 32 now; the binary search stays as the fallback for midpoints no such grid separates): static counts on sm_90
# (Triton 3.6, benchmarks/sass_sm90_turboquant.py), sm90 entry, 361 -> 312 (4-bit), 328 -> 316 (k3v4), 330 -> 320
# (3-bit) warp instructions per row; this portable store was not timed with it (on the H200 the Gluon store serves
# bf16 keys at D = 128: 4-bit 3.61 -> 2.98 ms with the table, the 3-bit keys unchanged, turboquant_sm90's docstring).
# num_stages: the depth of Triton's software pipeline over the rotation's operand loads; each stage holds
# both operands in shared memory (sm_90, T64 chunk64: 80 KiB and 254 registers at 3 stages, 32 KiB and 230
# registers at 1). Optional maxnreg: a cap on registers per thread (none: the compiler's choice).
# TF32X3 = 2: bf16 keys enter bf16 MMAs as loaded, against PiT cut into three bf16 parts (exact products;
# other key dtypes as TF32X3 = 1); no key conversion or scaling in registers, so no layout conversion of the
# key chunk through shared memory (sm_90 4-bit at T64 chunk32 1 stage: 117 registers, 8 KiB, LDS 3.5 and STS
# 11.9 per row, against 163 registers, LDS 19.6 and STS 24.4 for TF32X3 = 1), 4 programs per SM. The sm90 entry
# is that config: 4-bit store, 1M tokens x 8 heads, 17.91 ms (TF32X3 = 1, T64 chunk64 3 stages) -> 9.55 ms on the
# H200; T128 chunk32 w8 10.83 ms (ue8m0/store sweep at 04efc58, sweep_memory_bound_h200.md).
# Decode: BLOCK_N tokens per tile, at least 32 (the value MMA's K; Triton 3.6 miscompiles unpacked
# codes fed to a 16-key dot, see tests/test_turboquant.py). Key tables: the kernel makes them from the
# fp32 codebook on every call. PAIR_LUT picks the 4-bit pair LUT when the caller leaves
# use_pair_lut=None; otherwise SMEM_CODEBOOK 1 gathers from the fp16 codebook held as a register
# tensor (tl.gather, through shared memory), 0 loads the fp32 entries and rounds them. Each entry
# runs a different pair, so the property tests cover all three tables. The sm90 entry's BLOCK_N 128,
# 4 warps, 2 stages is the best 4-bit and k8v4 config of 10 (sweep_memory_bound_h200.md). With the
# tables built in the kernel (14d089e), 4-bit at L=8K / 32K: pair LUT 0.694 / 2.569 ms, fp32 loads
# 1.169 / 4.016 ms (the old fp16 table in global memory: 0.683 / 2.515 ms, 9ff0941). No config
# depends on the batch.
# GLUON 1 (sm90): MSE keys in bf16 at D = 128 go to the Gluon store (triton_impl/turboquant_sm90.py, the rotation on
# warpgroup MMAs), GLUON_PROGRAMS_PER_SM persistent programs per SM. On the H200 (1M tokens x 8 heads), 4-bit: 9.52 ms
# for this table's portable config, Gluon at 1 / 2 programs per SM 6.16 / 3.53 ms; a variant of it at 1 / 2 / 3
# 6.60 / 3.89 / 4.70 ms (over 200 registers: a third program does not fit beside two and runs as a second wave).
# Optional GLUON_MAXNREG caps the Gluon store's registers: at 168 three programs fit a SM (3 x 64.5 KiB of shared
# memory); Triton 3.6 (the H200's) spills 16-168 bytes a thread at cd8b10d, 2-3 local loads and stores a tile in the
# loop, Triton 3.9 72-168 (not timed: the H200 machine has no Triton but 3.6; tests/test_turboquant.py compiles both
# ways and bounds the spills). Uncapped at 2 programs per SM against capped
# at 3, H200 at 4208a61 (1M tokens x 8 KV heads, one call): 4-bit 2.9679 -> 2.7997 ms (42.8 -> 45.4% of the copy
# roofline), k3v4 3.0098 -> 2.7885, 3-bit 2.9625 -> 2.6630 (41.2 / 40.8 -> 44.5 / 45.4%).
# Optional GLUON_WARPS (default 4): warps a Gluon store program, 16 rows each a tile, all reading the program's one
# PiT. Nsight Compute (4-bit, 2026-12-02) had the store at 2.84 warps a scheduler, 12.4% of its samples waiting for
# the tile's key loads: 8 warps at GLUON_MAXNREG 128 fit two programs a SM (16 warps, 2 x 65 KiB of shared memory),
# where Triton 3.6 spills 504 bytes a thread (40 reloads a tile); with GLUON_EARLY_VALUES 0 (each tile's values
# loaded where they are quantized, not at its start) 48 bytes. Both slower on the H200 (1M tokens x 8 KV heads, one
# call against this entry): 4-bit 2.804 -> 3.556 ms (values first) / 3.180 (values late), k3v4 2.778 -> 3.312 / 3.188,
# 3-bit 2.652 -> 3.192 / 3.074.
# HADAMARD 1 (sm90): where PiT is c H_128 (turboquant_sm90.is_hadamard_rotation: serving's rotation), the Gluon store
# is turboquant_sm90.store_hadamard_kernel (the rotation as fp32 butterflies, no PiT in shared memory, 8 rows a warp),
# HADAMARD_PROGRAMS_PER_SM programs of HADAMARD_WARPS (4) warps at HADAMARD_MAXNREG registers. On the H200 (1M tokens
# x 8 KV heads, one call each, stage us, 4-bit / k3v4 / 3-bit): 6 programs at 80 registers 2193 / 2203 / 2029 (the
# MMA store in the same call 2575 / 2606 / 2410), 5 at 96 2230 / 2211 / 2137, 4 at 128 2288 / 2245 / 2137, 8 at 64
# (keys loaded at the tile's start, not a tile ahead) 2421 / 2301 / 2136.
# HADAMARD_MMA_H32 1: H_32 of the Hadamard store by warp MMAs (turboquant_sm90._hadamard_rows_mma; H_4 in registers,
# no shuffles), 1298 -> 1102 instructions a tile at 80 registers (9 local loads a tile), 1070 at 96 (Triton 3.6,
# 4-bit). One call on the H200, stage us, 4-bit / k3v4 / 3-bit: butterflies at 6 programs 2195 / 2218 / 2034; MMAs at
# 6 programs, 80 registers 2293 / 2324 / 2192; at 5 programs, 96 registers 2125 / 2264 / 2054: taken for 4-bit keys
# only (the _k4 keys). Again with the lookups by warp shuffles and the L2 hints (00a5c3a; one call, stage us, k3v4 /
# 3-bit): butterflies at 6 programs 1972 / 1916, MMAs at 6 programs 2085 / 2011, MMAs at 5 programs 1965 / 1926,
# butterflies at 5 programs 1962 / 1962: no change worth its registers.
# GLUON_PREFETCH 1: each Gluon store program prefetches its next tile's key and value rows into L2 (prefetch.global.L2,
# a line at a time) once the tile's codes are bucketized, so they arrive while it packs its codes and quantizes its
# values. One call on the H200 at 1M tokens x 8 KV heads, stage in us, no prefetch against it (twice: 2026-12-03):
# 4-bit 2802 / 2800 -> 2741 / 2747, k3v4 2785 / 2787 -> 2743 / 2745, 3-bit 2650 / 2666 -> 2567 / 2567 (-2 to -4%).
# Issued at the tile's top (the longest lead) 3089 / 3129 / 3016, before the values 3041 / 3072 / 2936, two tiles
# ahead 2977 / 3049 / 2877: all slower than none. The bulk form (cp.async.bulk.prefetch.L2) takes its address in
# uniform registers, and for per-thread rows ptxas wraps it in a loop over the warp's addresses (Nsight: 14% of the
# samples).
# HADAMARD_*_k3 (3-bit keys): 8 programs a SM at 64 registers, 32 warps where 80 registers fit 24. Their butterfly
# loop compiles to the same code at 80, 72, 64 and 56 registers (1279-1282 instructions a tile, no local load or store
# in it; Triton 3.6: ptxas issues the tile's loads closer to their use instead), while 4-bit keys spill below 64 and
# the MMA H_32 spills below 96. One call on the H200 (2026-12-04, 1M tokens x 8 KV heads, stage us after a reading
# flush, two rounds each, random / consecutive slots): k3v4 6 programs at 80 registers 1968.5, 1968.1 / 1770.2,
# 1755.7; 8 at 64 1920.8, 1921.5 / 1751.9, 1760.3; 9 at 56 1935.5, 1918.7 / 1881.0, 1881.9; 3-bit 1919.0, 1919.9 /
# 1784.1, 1783.6 -> 8 at 64 1847.5, 1841.0 / 1783.2, 1789.0 -> 9 at 56 1898.1, 1892.9 / 1845.1, 1836.6 (-2.4% and
# -3.9% at random slots for 8 at 64). In a first call, 7 at 72 took 3-bit keys to 2081 us (+8%), and the MMA H_32
# at 96 registers (5 programs) moved the random slots by -0.2 / +0.7% and the consecutive ones by -2.4 / -3.5%.
# 4-bit keys by butterflies at 64 (8 programs) or 72 registers (7) lost 4-6% at random slots and 8-15% at
# consecutive ones against the MMA H_32 at 96. The next call (each variant twice, random slots): the MMA H_32 for
# 3-bit keys at 72 registers (7 programs; 8 local loads a tile) k3v4 1949.1, 1950.2 -> 2126.2, 2129.2 and 3-bit
# 1849.4, 1845.1 -> 2244.5, 2266.1; at 64 (8 programs; 18 local loads, 10 local stores) 2425.0, 2415.4 and 2330.9,
# 2334.0; 4-bit keys' MMA at 80 registers (6 programs, 5 local loads) 1823.4, 1829.2 -> 1915.9, 1914.0 (+5%).
# HADAMARD_PACKED_EXTREMA 1: each row's value min and max on the bf16 values as loaded, by packed min / max
# (turboquant_sm90._store_values), 1080 -> 1043 instructions a tile for 4-bit keys at 96 registers, 1293 -> 1255 for
# 3-bit keys at 64 (Triton 3.6; k3v4 spills at 64: 21 local loads a tile). One call on the H200 (2026-12-04, stage us
# after a reading flush, random slots, twice): 4-bit 1818.1, 1814.2 -> 1804.3, 1802.8 (-0.7%), k3v4 1923.2, 1925.9 ->
# 1932.6, 1934.9, 3-bit 1848.4, 1847.6 -> 1987.9, 1981.9 (+7.4%, fewer instructions): at first 4-bit keys only. With
# each row's code stores back to back (turboquant_sm90._store_quad_tiles says why) the packed extrema take 3-bit keys
# to 1242 instructions a tile with no spill, and they are faster too. One call (2026-12-04, stage us after a reading
# flush, random slots, twice each): 4-bit 1807.3, 1812.4 -> 1774.2, 1778.7, k3v4 1942.9, 1943.9 -> 1788.5, 1790.4,
# 3-bit 1848.2, 1843.9 -> 1727.4, 1718.0; the stores back to back with fp32 extrema for 3-bit keys: k3v4 1845.7,
# 1832.0, 3-bit 1924.0, 1913.6 (Nsight: 11M more L2 read sectors, read again from DRAM; not understood).
# HADAMARD_JOINT_STORES 1: each row's code stores back to back, and its fields (turboquant_sm90._store_quad_tiles).
# 4-bit keys keep them apart (_k4 0), their codes being whole 16-byte stores already: back to back, the same call
# measured their random-slot store 1807.3, 1812.4 -> 1778.7, 1776.8 us but the consecutive one 1661.6, 1610.8 ->
# 1700.6, 1691.9, and two bench runs at e28c9a3 1.8178 and 1.8185 ms (69.7%, 69.9%) against 1.7993 and 1.8078 with
# them apart (4bd4524, 4a6efbf). Apart, the 4-bit kernel is 4bd4524's, SASS for SASS (Triton 3.6).
# _PLAIN keys: a store without norm correction. There 3-bit keys with 4-bit values spill at 64 registers with the
# stores back to back (Triton 3.6 with the packed extrema: 13 local loads a tile; Triton 3.9: 20-27 either way), so
# 3-bit keys without norm correction keep the stores apart and the fp32 extrema (not timed on the H200).
STORE_CONFIGS: dict[str, dict[str, int]] = {
    "default": {"BLOCK_T": 16, "D_CHUNK": 32, "num_warps": 4, "TF32X3": 0, "num_stages": 3},
    "sm90": {"BLOCK_T": 64, "D_CHUNK": 32, "num_warps": 4, "TF32X3": 2, "num_stages": 1, "GLUON": 1,
             "GLUON_PROGRAMS_PER_SM": 3, "GLUON_MAXNREG": 168, "GLUON_PREFETCH": 1,
             "HADAMARD": 1, "HADAMARD_PROGRAMS_PER_SM": 6, "HADAMARD_MAXNREG": 80, "HADAMARD_PROGRAMS_PER_SM_k4": 5,
             "HADAMARD_MAXNREG_k4": 96, "HADAMARD_MMA_H32_k4": 1, "HADAMARD_PACKED_EXTREMA": 1,
             "HADAMARD_JOINT_STORES": 1, "HADAMARD_JOINT_STORES_k4": 0, "HADAMARD_PROGRAMS_PER_SM_k3": 8,
             "HADAMARD_MAXNREG_k3": 64, "HADAMARD_PACKED_EXTREMA_PLAIN_k3": 0, "HADAMARD_JOINT_STORES_PLAIN_k3": 0},
    "interpreter": {"BLOCK_T": 16, "D_CHUNK": _MAX_HEAD_DIM, "num_warps": 4, "TF32X3": 0, "num_stages": 3},
}
FP8_KEY_STORE_CONFIGS: dict[str, dict[str, int]] = {  # D_CHUNK, TF32X3 and num_stages unused: no rotation
    "default": {"BLOCK_T": 16, "D_CHUNK": 32, "num_warps": 4, "TF32X3": 0, "num_stages": 3},
    "sm90": {"BLOCK_T": 8, "D_CHUNK": 32, "num_warps": 1, "TF32X3": 0, "num_stages": 3},
    "interpreter": {"BLOCK_T": 16, "D_CHUNK": _MAX_HEAD_DIM, "num_warps": 4, "TF32X3": 0, "num_stages": 3},
}
# FP8 keys on sm_90: one warp per 8 tokens (T8 w1) against T16 w4, 1M tokens x 8 heads on the H200
# (sweep_memory_bound_h200.md, b4b01fc): 2.0917 -> 1.9759 ms, 67.4 -> 71.3% of the copy roofline; T8 w2 1.9983,
# T16 w2 2.0989, T16 w4 capped at 64 or 80 registers 2.065.
# JOIN_UNPACK 1 unpacks each code group's 8 phases by joins (held in registers) instead of a
# [BLOCK_N, D/8, 8] reshape; GATHER_WORDS 1 reads a 3-bit field's words in one contiguous load and picks
# each group's words by tl.gather (warp shuffles), 0 by two loads per group (one cache line per lane).
# PREFETCH 1 issues the next tile's loads before this tile's compute; 0 leaves them to Triton's pipeliner.
# Optional maxnreg: a cap on registers per thread (none or 0: the compiler's choice), as for the store. A key
# ending in _k<bits> replaces its base key for that key width (_k4: 4-bit keys, _k3, _k8: FP8 keys).
# The sm90 entry at 168 registers without the manual prefetch (three 4-warp programs per SM instead of two, at 224-240
# registers; Triton 3.6 spills 32-64 B) against the uncapped prefetch entry, H200 at L=8K
# (benchmarks/sweep_memory_bound.py, sweep_memory_bound_h200.md): k8v4 0.4191 -> 0.3633 ms, k3v4 0.4796 -> 0.4374,
# 3-bit 0.5303 -> 0.4386; 4-bit 0.4220 -> 0.4322 (slower: it keeps the prefetch, uncapped).
# sm_90 static counts (Triton 3.6, the bench's launch, BLOCK_N 128, 4 warps,
# benchmarks/sass_sm90_turboquant.py), shared-memory loads and stores per warp per tile and warp
# instructions per key: 4-bit reshape 357 / 64.8 (128 of them 2-byte STS), joins 225 / 61.9; k8v4 reshape
# 68.6, joins 65.8; 3-bit two loads (65 scalar LDG, 104 B of stack) 99.6, GATHER_WORDS 72.2 (8 LDG.128, 8 B
# of stack). PREFETCH 0 (num_stages 2: LDGSTS into shared memory, no words held in registers across
# iterations): 205-208 registers (from 224-240), 4-bit 64.0, k8v4 62.6; on the H200 (B=32 Hq=32 Hk=8 D=128
# L=8K, sweep_memory_bound_h200.md) 4-bit 0.5047 ms against 0.4232 for the sm90 entry. A softmax stream per
# warp (KEY_SPLIT 4 with PREFETCH 0: 4-bit 0.7364 ms, 0.7278 with 3 stages; k8v4 0.6250 against 0.4199) and
# the 4-bit PRMT lookup from a register-held table (0.8166 ms, with KEY_SPLIT 4 and PREFETCH 0; never timed
# alone) were timed slower than the sm90 entry (0.4232 ms) and removed (the code is in fb849fb).
# GLUON 1 (sm90 only): stage 1 runs triton_impl/turboquant_sm90.py, the Gluon kernel, for the layouts it serves
# (turboquant_sm90.supports: D = 128, 3/4-bit or FP8 keys, 3/4-bit values, blocks of a multiple of 16 tokens); every
# other call runs the portable kernel above with this entry's keys. GLUON_MAXNREG caps its registers (96 with
# FP16_OPERANDS: five programs a SM, below). With hi + lo operands 4-bit keys ran capped at 128 (four programs a SM;
# uncapped 128-137, and 8-9% slower), and 3-bit values uncapped at 128 registers, 624 instructions a tile, where the
# cap of 128 gave 670 (Triton 3.6); their first Gluon version (two loads a key, at 4208a61) needed the cap: 0.2594 /
# 0.9331 ms at L=8K / 32K capped, 0.2648 / 0.9711 uncapped at 140 registers; the shuffle and funnel shift of
# turboquant_sm90._value_words then took 0.2576 -> 0.2127 / 0.9303 -> 0.7445 ms (H200, one call).
# GLUON_STAGES (sm90): each tile's bytes go to a ring of that many shared-memory stages by cp.async, STAGES - 1 tiles
# ahead (turboquant_sm90.stages: 4-bit values, any keys; 3-bit values load into registers: staged, 1.6x slower). A/B in
# one call on the H200 (L=8K / 32K): k8v4 0.1755 -> 0.1598 / 0.6563 -> 0.5882 ms, 4-bit 0.2171 -> 0.1933 / 0.7612 ->
# 0.6696 (4-bit uncapped: 0.2039 / 0.7165); the 42 decode property tests passed with it.
# FP16_OPERANDS (sm90): stage 1 rounds the query and p * v_scale once to fp16, one MMA each, not as hi + lo pairs
# (both kernels; upstream's kernel casts its query to fp16 the same way). Compiled for sm_90 (Triton 3.6, three
# stages, uncapped) the Gluon stage 1 takes 94-109 registers instead of 119-138 and 10-13% fewer instructions a tile
# (4-bit keys 483 against 554 at the cap of 128), so GLUON_MAXNREG 96 fits PROGRAMS_PER_SM 5. A/B in one call on the
# H200 (stage 1 alone, us, L=8K / 32K; benchmarks/kernel_times.py): hi + lo at 128 registers and four programs a SM
# -> fp16 operands at four -> fp16 operands at 96 and five: 4-bit 171.3 / 640.6 -> 162.8 / 607.6 -> 163.4 / 593.1,
# k3v4 164.2 / 613.3 -> 157.6 / 588.4 -> 157.5 / 569.7, 3-bit 191.2 / 724.8 -> 182.9 / 691.7 -> 183.5 / 681.6, k8v4
# 146.3 / 560.4 -> 143.0 / 552.1 -> 142.3 / 531.4. Five programs at 96 registers with hi + lo operands (spilling)
# were slower: 4-bit 190.6 / 695.6. The check a call with it takes: parity.turboquant.decode_expected (golden fed the
# kernel's own fp16 query, within weight_rounding_bound).
# ROTATE_TF32X3 (sm90): the query's rotation (_rotate_query_kernel) on tensor cores in 3xTF32, not an fp32 FMA dot,
# whose shared-memory reads were 82% bank conflicts: 12.2-12.9 us a call at B=32 H=32 (predicted: ~3 us). The bench's
# whole call at L=8K, 08cfd74 -> 95ba40f: 4-bit 0.1929 -> 0.1844 ms, 3-bit keys 0.1864 -> 0.1789, 3-bit 0.2126 ->
# 0.2046.
# GLUON_STREAMS (sm90; 3/4-bit or FP8 keys with 4-bit values, groups of at most 8 heads, FP16_OPERANDS; off unless
# GLUON_WARP is): stage 1 as turboquant_sm90.decode_stage1_streams_kernel, each of 4 warps an online softmax of its own
# over every fourth 16-key chunk, copying its chunks by TMA, with no shared memory or barrier between warps in the
# loop. Its partitions make 8 warps a program, launched at 64 registers (setmaxnreg gives the stream warps 104): four
# programs a SM. Stage 1 on the H200 against decode_stage1_kernel in one call (benchmarks/kernel_times.py, ff5c3c7, L=8K
# / 32K): k8v4 140.2 -> 121.0 / 519.1 -> 504.6 us; 4-bit keys 153.6 -> 169.5 / 556.4 -> 558.8 us; k3v4 (2026-12-02: each
# chunk's 48 key bytes in a 64-byte box, its values in one of their own, each thread's 12 key bytes assembled by three
# warp shuffles, _three_bit_words) 157.3 -> 182.8 / 567.1 -> 605.0 us. Nsight Compute on the 4-bit streams (L=8K) says
# why they lose: 40% of the stream warps' samples wait for instructions (no_inst), the four partitions being four
# copies of a 534-instruction loop (FP8 keys: 388, 13%).
# GLUON_WARP (sm90; the same calls as GLUON_STREAMS): stage 1 as turboquant_sm90.decode_stage1_warp_kernel, one warp a
# program running one stream over its whole split (one copy of the loop for every warp of the SM, and no CTA barrier
# another warp can hold up), launched at WARP_MAXNREG registers: at 104 four warps fit each scheduler's 16K registers,
# 16 programs a SM (PROGRAMS_PER_SM), and four rounds of them then (SPLIT_ROUNDS; the caller's 32 splits at B=32 Hk=8,
# 31 for MSE keys: query_slot; two rounds since, below). One call on the H200 against the kernels above (stage 1, us,
# L=8K / 32K, 2026-12-02, two rounds of 19 programs' splits): 4-bit 153.9 -> 130.0 / 557.2 -> 481.8, k3v4 151.5 -> 127.4
# / 545.8 -> 473.4, k8v4 (streams) 122.6 -> 126.4 / 515.7 -> 527.6; at four rounds 127.3 / 453.3, 125.2 / 444.0, 119.4 /
# 458.1 (one round: 141.3 / 527.7, 139.3 / 519.4, 136.7 / 578.1). At 96 registers (20 programs a SM; 24 bytes of stack
# for 4-bit keys), against 104 in one call: 4-bit 131.9 -> 135.0 / 458.1 -> 466.4, k3v4 129.9 -> 130.6 / 448.9 -> 451.0,
# k8v4 120.2 -> 125.7 / 453.3 -> 477.6.
# Bench at 8107e0d against the portable kernel's 9b0ab61 rows (L=8K / 32K): k8v4 0.3632 -> 0.2262 / 1.1904 ->
# 0.7066 ms, 4-bit 0.4226 -> 0.2942 / 1.3685 -> 0.8199 ms.
# SPLIT_ROUNDS (sm90): at most that many rounds of PROGRAMS_PER_SM resident programs (decode_num_splits), whatever
# max_num_kv_splits asks: each program pays a fixed cost (the bad-page scan, the query load, the tables, the partial's
# write and merge), 56-84 us of stage 1 over the 8192 programs of B=32 Hk=8 at 32 splits. On the H200
# (benchmarks/turboquant_kernels.py decode splits, ed2f980, ms as the bench times the call, L=8K / 32K; 32 splits ->
# 2 rounds): k8v4 0.2194 -> 0.1754 / 0.6994 -> 0.6535, 4-bit 0.2872 -> 0.2162 / 0.8145 -> 0.7610 (1 round: 0.1729 /
# 0.6593, 0.2109 / 0.7564). The portable kernel (three programs a SM) was fastest at 8 rounds for 3-bit values (0.4067
# / 1.4641 ms against 1.5164 at L=32K at 2), which ran it until the Gluon kernel served them (0.2594 / 0.9331 ms).
# The one-warp programs ran four rounds of 16 (GLUON_WARP, above; two since, below); 3-bit values too (their words
# loaded into registers a chunk ahead, not copied by TMA; at 128 registers, which keep 16 programs a SM: four warps fill
# a scheduler's 16K registers at 128 as at 104). Stage 1 of 3bit_nc against the 4-warp kernel at five programs a SM and
# two rounds, in one call (2026-12-02, L=8K / 32K): 171.6 -> 166.1 / 630.6 -> 577.3 us, the call 185.4 -> 182.5 /
# 643.9 -> 591.9 (the merge of 31 splits 2.7 -> 5.9 us). WARP_MAXNREG 128 for the other presets, in the same call:
# 4-bit 132.4 -> 130.7 / 457.9 -> 452.3, k3v4 130.3 -> 130.4 / 449.6 -> 449.2, k8v4 119.1 -> 119.2 / 457.4 -> 458.5:
# within 1.3%, 104 kept then. Groups the TMA kernels decline run decode_stage1_kernel at the same split count.
# WARP_STEP, WARP_STAGES (sm90, the one-warp kernel; turboquant.warp_stages): WARP_STEP 16-key chunks an iteration (one
# row max and softmax step over 32 keys) through WARP_STAGES chunk buffers; two chunks need WARP_MAXNREG 128 (104
# spills), which keeps 16 programs a SM. 3-bit values (the _v3 keys) take two chunks at WARP_MAXNREG_v3 168, where their
# words, loaded a step ahead, do not spill (at 128: 88 bytes of stack, 55 local loads and stores in the loop), so 12
# programs a SM (PROGRAMS_PER_SM_v3): 1087 warp instructions for two chunks against 594 for one (Triton 3.6; 1034 by
# stream-K since 2026-12-03, turboquant_sm90.TRIPLE_PAIRS_ASM and 12-bit value fields made at the value product, then
# 1022 and 988 by _three_bit_words' 7 selects and the spread's halvings, then 924 at 168 registers and no stack by
# each lane quad's 6-byte span of value codes, turboquant_sm90._span_operand). With the spans, 128 registers and 16
# programs a SM (8 bytes of stack, none of it in the loop) lost in one call on the H200 (stage 1 L=8K / 32K, us, tilt
# 0 / 15 / 25: 112.3 / 120.7 / 125.4 and 395.3 / 415.3 / 411.4, against 106.6 / 373.9 at 168 and 12); one call
# on the H200 (2026-12-02, stage 1, us, L=8K / 32K), one chunk -> two at 168 registers: 3bit_nc 137.1 -> 128.6 / 492.3
# -> 469.4 (at 144 registers and 14 programs a SM, 8 bytes of stack: 163.9 / 598.8). With the value codes masked and
# biased by one lop3 in every preset (the bias since dropped: turboquant_sm90._code_halves), 4-bit keys take 517 -> 486
# (lop3) -> 437 (two chunks) warp instructions per 16 keys. One call on the H200 (stage 1, us, L=8K / 32K, 2026-12-02,
# four rounds), 877fa50 -> lop3 -> both: 4-bit 131.8 -> 124.3 -> 119.7 / 457.3 -> 426.4 -> 405.9, k3v4 129.7 -> 122.6 ->
# 118.6 / 444.6 -> 420.0 -> 401.5, k8v4 119.3 -> 119.4 -> 118.3 / 461.0 -> 461.3 -> 462.5, 3bit_nc (lop3 only) 165.7 ->
# 159.1 / 571.1 -> 546.0. Six buffers instead of four (and four for FP8 keys): 4-bit 119.3 -> 121.2 / 404.7 -> 409.5,
# 3bit_nc 158.3 -> 158.5 / 545.2 -> 545.6.
# With these shorter programs SPLIT_ROUNDS went 4 -> 2 (16 splits at B=32 Hk=8; the merge reads half the partials).
# One call, the call after a reading flush (us, L=8K / 32K), 4 -> 3 -> 2 rounds: 4-bit 135.5 -> 129.4 -> 121.5 /
# 420.6 -> 406.6 -> 402.1, 3bit_nc 175.2 -> 169.9 -> 161.7 / 561.0 -> 549.1 -> 551.6; in the next call, 2 -> 1 round:
# 4-bit 122.2 -> 121.6 / 403.6 -> 413.6, k3v4 123.0 -> 121.5 / 400.7 -> 410.9, 3bit_nc 161.4 -> 156.4 / 551.1 ->
# 583.9, k8v4 123.7 -> 124.9 / 486.0 -> 506.3 (four rounds in the first call: 128.4 / 473.5).
# STREAM_K (sm90, the one-warp kernel): turboquant_sm90.decode_stage1_stream_k_kernel, PROGRAMS_PER_SM programs a SM in
# one round, each KV head's keys divided evenly among its programs (its section there says how), where the call has
# at least two splits (partial slots); SPLIT_ROUNDS still sets the slots. One call on the H200 against the grid
# (STREAM_K 0), stage 1 in us, B=32 Hq=32 Hk=8, L=8K / 32K (2026-12-02): 4-bit 97.0 -> 99.3 / 347.9 -> 358.0, k3v4
# 106.9 -> 106.6 / 386.0 -> 382.4, 3bit_nc 138.5 -> 141.8 / 506.4 -> 515.7, k8v4 116.7 -> 129.4 / 479.1 -> 507.6; 4-bit
# over 32 requests of 1-32K keys (16.6K on average) 267.9 -> 203.6: the grid gives a 32K request as many splits as a
# 3K one, and its programs' ends straggle. Its loop took 2% more instructions than the grid's (4-bit 823 against 805
# for two chunks, Triton 3.6), 6 of them the chunk ring carried across pieces; with the ring restarted at each piece,
# 805, and in one call 4-bit 100.0 -> 98.8 / 358.0 -> 352.9, k3v4 107.1 -> 108.6 / 382.8 -> 384.1, mixed lengths
# 203.5 -> 201.1. FP8 keys (STREAM_K_k8 0) lose 6-11% by stream-K and keep the grid.
# STREAM_K_TILT (percent a rank): the one-warp programs of a one-round grid end by their rank on their warp scheduler
# (the older warps are issued first; benchmarks/tq_timeline.py), so a place of rank r of PROGRAMS_PER_SM / 4 takes
# 100 + TILT * (ranks - 1 - r) parts of the steps (turboquant_sm90._stream_k_claim). One call on the H200, stage 1 in
# us, tilt 0 / 10 / 20 / 35: 3bit_nc L=8K 128.3 / 128.3 / 125.2 / 122.2, L=32K 466.5 / 457.3 / 448.6 / 440.5; 4-bit
# 98.3 / 100.5 / 99.4 / 106.2 and 352.3 / 349.5 / 344.8 / 366.8: 3-bit values only (_v3 35). With fewer instructions a
# step (2026-12-03) the oldest rank ended last at 35 (ranks 0 / 1 / 2 at 116.1 / 110.0 / 110.2 us, median, L=8K):
# one call, 3bit_nc stage 1, tilt 35 / 25 / 20 / 15: L=8K 119.0 / 116.1 / 115.5 / 116.5, L=32K (25, 20) 408.6 /
# 409.1 against 416.9-418.8 at 35 in the call before; 25 kept. With the spans (one call, tilt 20 / 25 / 30): 107.5 /
# 106.4 / 106.0, 377.2 / 372.6 / 372.2; the next day (tilt 25 / 30 / 35 / 40): 107.7 / 106.9 / 106.0 / 112.6, 377.7 /
# 372.4 / 371.0 / 393.0. 30 kept: ahead of 25 in both calls, and 5 below the cliff that 40 falls off.
# HADAMARD_QUERY (sm90, the one-warp kernels, MSE keys): where the rotation is c H_128 (turboquant_sm90.
# is_hadamard_rotation, serving's), each program rotates its query itself (turboquant_sm90._hadamard_query: fp32
# butterflies over the K order, then c) and the call launches no _rotate_query_kernel (3.7 us and a 2.8-3.2 us gap
# before stage 1, after a reading flush). One call on the H200 (2026-12-04, the call after a reading flush, us, L=8K /
# 32K / 1-32K mixed), the rotation launch -> in stage 1: 4-bit 112.8 -> 108.3 / 367.4 -> 368.3 / 215.1 -> 213.5,
# k3v4 116.7 -> 110.6 / 373.7 -> 364.1; stage 1 itself 1.4 us longer at L=8K (98.5 -> 99.9: each piece's query from
# the query in DRAM, its butterflies and one layout conversion). 3-bit values keep the launch (_v3 0): their stream-K
# places are weighed by rank through counts the rotation launch zeroes, and without them (tilt 0) stage 1 took 396.6
# against 371.5 us at L=32K. Loading the query after the first chunk copies were asked for gained nothing (4-bit
# 108.3 -> 110.2 / 368.3 -> 366.8 us; benchmarks/variants/query_after_copies.patch).
# WARP_SHARED_PAIRS (sm90, the one-warp kernels, MSE keys; turboquant.warp_stages): of each thread's 4 key words (4-bit
# codes) or 24-bit groups (3-bit) a chunk, how many (0-4) look their centroid pairs up in a table in shared
# memory (turboquant_sm90._shared_pair_table: one ld.shared a pair of codes) instead of by prmt from the byte tables in
# registers. The loop is bound by its ALU-pipe instructions (perf_log.md, twenty-eighth session) and the table takes
# them off that pipe: Triton 3.6, ALU instructions a two-chunk step of stream-K (benchmarks/sass_sm90_turboquant.py),
# 4-bit 402 -> 354 (1) -> 306 (2) -> 258 (3) -> 210 (4), k3v4 391 -> 367 -> 343 -> 319 -> 294, 3bit_nc 426 -> 404 ->
# 380 -> 356 -> 332, for 16 LDS a step per word or group (about 3.3 bank conflicts each in the 256-entry 4-bit table,
# at most 2 in the 64-entry 3-bit one). On the H200 (kernel_times.py, stage 1 at L=8K / 32K, two runs each in one
# call, us; perf_log.md, forty-third session) only 3-bit keys with 4-bit values gain, and most with all 4 words:
# k3v4 101.3 / 353.2 -> 95.4 / 334.1 (3) -> 94.5 / 331.0 (4), where 4-bit keys lose (100.2 / 358.6 -> 102.6 /
# 369.3 (3) -> 109.9 / 403.0 (4)) and so do 3-bit values (107.1 / 370.1 -> 108.5 / 386.3 -> 110.2 / 402.7), likely
# from the 256-entry table's bank conflicts (~210 shared-memory wavefronts a step) and from the 3-bit values' 12
# programs a SM (3 warps a scheduler to hide each LDS's latency, against 4 for k3v4), by the SASS counts. So 4 for
# 3-bit keys (_k3), 0 for 3-bit values (_v3, applied after) and 4-bit keys.
DECODE_CONFIGS: dict[str, dict[str, int]] = {
    "default": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PAIR_LUT": 0, "SMEM_CODEBOOK": 0,
                "JOIN_UNPACK": 1, "GATHER_WORDS": 1, "PREFETCH": 1},
    "sm90": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "PAIR_LUT": 1, "SMEM_CODEBOOK": 1, "JOIN_UNPACK": 1,
             "GATHER_WORDS": 1, "PREFETCH": 0, "maxnreg": 168, "PREFETCH_k4": 1, "maxnreg_k4": 0, "GLUON": 1,
             "GLUON_MAXNREG": 96, "SPLIT_ROUNDS": 2, "PROGRAMS_PER_SM": 16, "GLUON_STAGES": 3, "ROTATE_TF32X3": 1,
             "FP16_OPERANDS": 1, "GLUON_WARP": 1, "WARP_MAXNREG": 128, "WARP_STEP": 2,
             "WARP_STAGES": 4, "WARP_STEP_v3": 2, "WARP_STAGES_v3": 4, "WARP_MAXNREG_v3": 168, "PROGRAMS_PER_SM_v3": 12,
             "STREAM_K": 1, "STREAM_K_k8": 0, "STREAM_K_TILT": 0, "STREAM_K_TILT_v3": 30, "HADAMARD_QUERY": 1,
             "HADAMARD_QUERY_v3": 0, "WARP_SHARED_PAIRS": 0, "WARP_SHARED_PAIRS_k3": 4,
             "WARP_SHARED_PAIRS_v3": 0},
    "interpreter": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PAIR_LUT": 1, "SMEM_CODEBOOK": 0,
                    "JOIN_UNPACK": 1, "GATHER_WORDS": 1, "PREFETCH": 1},
}  # fmt: skip


def select_store_config(device: torch.device, key_fp8: bool = False, key_bits: int = 0) -> dict[str, int]:
    """The device's store entry, its ``_k<key_bits>`` keys applied (``launch.with_overrides``)."""
    entry = select_config(FP8_KEY_STORE_CONFIGS if key_fp8 else STORE_CONFIGS, device)
    return with_overrides(entry, f"_k{key_bits}") if key_bits else dict(entry)


def hadamard_store_knobs(entry: dict[str, int], norm_correction: bool = True) -> dict[str, bool]:
    """``turboquant_sm90.store_hadamard_kernel``'s switches in a store entry (its ``_k<key_bits>`` keys applied):
    ``<KNOB>`` from ``HADAMARD_<KNOB>``, or for a store without norm correction from ``HADAMARD_<KNOB>_PLAIN`` where the
    entry has it; off where the entry has neither."""
    def knob(name: str) -> bool:
        plain = f"HADAMARD_{name}_PLAIN"
        return bool(entry[plain] if not norm_correction and plain in entry else entry.get(f"HADAMARD_{name}", 0))
    return {name: knob(name) for name in turboquant_sm90.HADAMARD_KNOBS}


def decode_entry(entry: dict[str, int], key_bits: int, value_bits: int) -> dict[str, int]:
    """A decode config entry for ``key_bits`` (3, 4, or 8 for FP8 keys) and ``value_bits``: its ``_k<bits>`` keys
    applied, then its ``_v<bits>`` keys."""
    return with_overrides(with_overrides(entry, f"_k{key_bits}"), f"_v{value_bits}")


def select_decode_config(device: torch.device, key_bits: int, value_bits: int = 4) -> dict[str, int]:
    """The device's decode entry (:func:`decode_entry`)."""
    return decode_entry(select_config(DECODE_CONFIGS, device), key_bits, value_bits)


def decode_num_splits(max_num_kv_splits: int, batch: int, num_kv_heads: int, device: torch.device, key_bits: int,
                      value_bits: int) -> int:  # fmt: skip
    """The splits a decode call runs: ``max_num_kv_splits``, capped where the device's entry has ``SPLIT_ROUNDS``
    at that many rounds of ``PROGRAMS_PER_SM`` resident programs a SM (``decode_attention.stage1_splits``), a
    program being one (request, KV head, split); and below ``max_num_kv_splits`` where the entry's TMA kernels may
    read MSE keys' rotated query from the last slot (:func:`query_slot`)."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    config = select_decode_config(device, key_bits, value_bits)
    splits = stage1_splits(max_num_kv_splits, batch * num_kv_heads, sm_count, config)
    slot = query_slot(config, max_num_kv_splits, key_bits, value_bits)
    return min(splits, slot) if slot else splits


def warp_stages(config: dict[str, int]) -> dict[str, int]:
    """``STAGES``, ``STEP`` and ``SHARED_PAIRS`` of ``turboquant_sm90.decode_stage1_warp_kernel`` (and of its
    stream-K twin) under a decode entry: ``WARP_STAGES`` chunk buffers (else ``GLUON_STAGES``, at least 2),
    ``WARP_STEP`` chunks an iteration (else 1) and ``WARP_SHARED_PAIRS`` of each thread's 4 key words or groups
    looked up in the shared pair table (else 0)."""
    return {"STAGES": config.get("WARP_STAGES", max(2, config.get("GLUON_STAGES", 0))),
            "STEP": config.get("WARP_STEP", 1), "SHARED_PAIRS": config.get("WARP_SHARED_PAIRS", 0)}


def stream_k_programs(config: dict[str, int], device: torch.device, num_splits: int, num_kv_heads: int) -> int | None:
    """The grid of ``turboquant_sm90.decode_stage1_stream_k_kernel`` where a decode entry runs it (``STREAM_K``, one
    warp a program, at least two splits): ``PROGRAMS_PER_SM`` programs a SM, cut to a multiple of the KV heads; else
    ``None``."""
    if not (config.get("GLUON") and config.get("GLUON_WARP") and config.get("STREAM_K") and num_splits >= 2):
        return None
    places = config["PROGRAMS_PER_SM"] * torch.cuda.get_device_properties(device).multi_processor_count
    return max(places // num_kv_heads, 1) * num_kv_heads


def stream_k_ranks(config: dict[str, int], batch: int, num_heads: int, key_bits: int) -> dict[str, int]:
    """``RANKS`` and ``TILT`` of ``turboquant_sm90.decode_stage1_stream_k_kernel`` under a decode entry: where it
    sets ``STREAM_K_TILT``, ``PROGRAMS_PER_SM / 4`` ranks of programs on each warp scheduler (the entry's programs a
    SM a multiple of 4; MSE keys, whose rotation zeroes a count a rank in the rotated query's slot; ``B * H`` at
    least the ranks); else one."""
    ranks = config.get("PROGRAMS_PER_SM", 0) // 4
    if (not config.get("STREAM_K_TILT") or config.get("PROGRAMS_PER_SM", 0) % 4 or key_bits == 8
            or not 1 < ranks <= batch * num_heads):  # fmt: skip
        return {"RANKS": 1, "TILT": 0}
    return {"RANKS": ranks, "TILT": config["STREAM_K_TILT"]}


def stream_k_bounds(total: int, programs: int, launched: int, ranks: int = 1, tilt: int = 0) -> list[int]:
    """The first step of each of a KV head's ``programs`` working places (of ``launched``), and ``total``: place
    ``q`` of rank ``q * ranks // launched`` weighs ``100 + tilt * (ranks - 1 - rank)``, and takes ``W_q * total //
    W`` on, ``W_q`` the weights of the places before it."""
    weights = [100 + tilt * (ranks - 1 - q * ranks // launched) for q in range(programs)]
    return [w * total // sum(weights) for w in itertools.accumulate(weights, initial=0)]


def stream_k_pieces(seq_lens: list[int], table_keys: int, step_keys: int, programs: int,
                    num_splits: int, ranks: int = 1, tilt: int = 0) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """The stream-K kernel's division of each KV head's keys, in plain Python: for each request, ``[(slot, start,
    end), ..]``, the key range of each piece and the partial slot it writes (the slots after the last are empty).
    Steps of ``step_keys`` keys over the keys each table holds, request after request, among a KV head's
    ``programs`` places, cut to ``T // ceil(most steps / (num_splits - 1))``, each taking its steps of
    :func:`stream_k_bounds`; weighted by rank only where none is cut and the lightest place (``100 / (100 + tilt *
    (ranks - 1))`` of the mean) still takes ``ceil(most steps / (num_splits - 1))``."""
    steps = [-(-min(max(n, 0), table_keys) // step_keys) for n in seq_lens]
    total = sum(steps)
    least = max(-(-max(steps, default=0) // (num_splits - 1)), 1)
    if total * 100 // (least * (100 + tilt * (ranks - 1))) < programs:  # the lightest place would take fewer
        tilt = 0
    bounds = stream_k_bounds(total, max(min(programs, total // least), 1), programs, ranks, tilt)
    pieces = []
    first = 0
    for b, n in enumerate(steps):
        # A piece a program: slot i is the i-th program from the one holding the request's first step.
        cuts = sorted({first, first + n} | {x for x in bounds if first < x < first + n})
        pieces.append([(slot, (lo - first) * step_keys, min((hi - first) * step_keys, seq_lens[b], table_keys))
                       for slot, (lo, hi) in enumerate(itertools.pairwise(cuts))])  # fmt: skip
        assert len(pieces[-1]) <= num_splits
        first += n
    return pieces


def query_slot(config: dict[str, int], max_num_kv_splits: int, key_bits: int, value_bits: int) -> int | None:
    """The partials slot the sm_90 TMA kernels read MSE keys' rotated query from: the last of ``max_num_kv_splits``,
    where ``config`` may select them (``GLUON_WARP`` or ``GLUON_STREAMS``, 3/4-bit keys, 4-bit values), which no
    split then writes (:func:`decode_num_splits` stops below it; one slot, not one a split: the rotation writes
    ``B*H*D`` floats, not ``B*H*S*D``; with one slot, 0: the one split reads it before its partial overwrites it);
    else ``None`` (each program reads its own split's slot)."""
    values = value_bits == 4 or (value_bits == 3 and config.get("GLUON_WARP"))
    tma = (config.get("GLUON_WARP") or config.get("GLUON_STREAMS")) and key_bits in (3, 4) and values
    return max_num_kv_splits - 1 if tma and config.get("GLUON") else None


# ----------------------------------------------------------------------------------------------
# Layout and argument checks shared by both launchers.
# ----------------------------------------------------------------------------------------------


def _soa_layout(head_dim: int, mse_bits: int, value_quant_bits: int, key_fp8: bool) -> dict[str, int]:
    """Byte sizes of one slot (vLLM's ``_get_layout`` plus the SoA constants)."""
    key_data_bytes = head_dim if key_fp8 else head_dim * mse_bits // 8
    value_data_bytes = head_dim * value_quant_bits // 8
    return {
        "key_data_bytes": key_data_bytes,
        "value_data_bytes": value_data_bytes,
        "data_bytes_per_slot": key_data_bytes + value_data_bytes,
        "key_packed_size": head_dim if key_fp8 else key_data_bytes + 2,
        "value_packed_size": value_data_bytes + 4,
        "num_fields": 2 if key_fp8 else 3,
    }


def _check_quant_args(
    head_dim: int, mse_bits: int, key_packed_size: int, value_quant_bits: int, key_fp8: bool
) -> dict[str, int]:
    if head_dim < 16 or head_dim % 16 or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected a multiple of 16 in [16, {_MAX_HEAD_DIM}], got {head_dim}")
    check_flag("key_fp8", key_fp8)
    if key_fp8:
        check_int_choice("mse_bits", mse_bits, (0,), "with key_fp8=True")
    else:
        check_int_choice("mse_bits", mse_bits, (3, 4), "for MSE keys")
    check_int_choice("value_quant_bits", value_quant_bits, (3, 4))
    layout = _soa_layout(head_dim, mse_bits, value_quant_bits, key_fp8)
    if key_packed_size != layout["key_packed_size"]:
        raise ValueError(f"key_packed_size: expected {layout['key_packed_size']} for D={head_dim}, "
                         f"mse_bits={mse_bits}, key_fp8={key_fp8}, got {key_packed_size}")  # fmt: skip
    return layout


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, layout: dict[str, int]) -> None:
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=(torch.uint8,))
    if kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"kv_cache: expected {num_kv_heads} KV heads in dim 2, got shape {list(kv_cache.shape)}")
    padded_slot = kv_cache.shape[3]
    slot_size = layout["key_packed_size"] + layout["value_packed_size"]
    if padded_slot < slot_size or padded_slot % 2:
        raise ValueError(f"kv_cache: last dim must be even and >= the slot size {slot_size}, got {padded_slot}")
    if kv_cache.stride()[1:] != (num_kv_heads * padded_slot, padded_slot, 1) or kv_cache.stride(0) % 2:
        raise ValueError(f"kv_cache: a block must be dense with an even block stride, got strides {kv_cache.stride()}")
    if kv_cache.storage_offset() % 2:  # its 2-byte fields are written and read through a uint16 view
        raise ValueError(f"kv_cache: expected an even byte offset into its storage, got {kv_cache.storage_offset()}")


def _check_codebook(name: str, t: torch.Tensor, size: int, device: torch.device) -> None:
    check_tensor(name, t, shape=(size,), dtypes=(torch.float32,), device=device)
    if content_checks_enabled(device) and not bool((t.abs() <= 1).all()):
        raise ValueError(f"{name}: expected finite entries in [-1, 1] (coordinates of unit vectors)")


def _check_rotation(name: str, t: torch.Tensor, head_dim: int, device: torch.device) -> None:
    check_tensor(name, t, shape=(head_dim, head_dim), dtypes=(torch.float32,), device=device)
    # |entries| <= 1 (true of every orthogonal matrix): the store's error bound assumes it.
    if content_checks_enabled(device) and not bool((t.abs() <= 1).all()):
        raise ValueError(f"{name}: expected finite entries in [-1, 1] (an orthogonal matrix)")


# ----------------------------------------------------------------------------------------------
# Store.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _key_norm(k):
    """``(||k||, 2^-e)`` for each row of an fp32 tile ``[R, D]`` (zeros in padding lanes), in fp32,
    each row scaled by a power of two so that no square overflows or underflows: ``||k|| = 2^e
    sqrt(sum (k 2^-e)^2)`` with ``2^e <= max |k|``. The scaling is exact, so the norm has the error of
    the plain fp32 formula wherever that one is finite. Powers of two are built from their bits
    (``exp2`` is approximate compiled)."""
    amax = tl.max(tl.abs(k), axis=1)
    e = tl.minimum(tl.maximum(((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32), 1) - 127, 126)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    x = k * down[:, None]
    return tl.sqrt(tl.sum(x * x, axis=1)) * ((127 + e) << 23).to(tl.float32, bitcast=True), down


@triton.jit
def _tf32_part(x):
    """``x`` with the 13 low mantissa bits cleared: a TF32 value, ``|x - part| < 2^-10 |x|``."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_part(x):
    """``x`` with the 16 low mantissa bits cleared: a bf16 value."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_bits(x):
    """fp32 -> fp16 (round to nearest even) clamped to +-65504, as the uint16 to store; NaN stays NaN (a NaN key
    or value must not be stored as a finite norm or scale)."""
    x = tl.where(x == x, tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX), x)
    return x.to(tl.float16).to(tl.uint16, bitcast=True)


@triton.jit
def _store_words(words, dst, ok, valid, BITS: tl.constexpr):
    """Write each row of ``words [R, G]`` (group ``g`` of 8 ``BITS``-bit codes, LSB first) as its ``BITS``
    bytes at ``dst [R] + BITS * g``; rows where ``ok`` is false write nothing, and only the first
    ``valid`` codes (a multiple of 8)."""
    G: tl.constexpr = words.shape[1]
    g = tl.arange(0, G)
    i = tl.arange(0, 4)  # at most 4 bytes per group (BITS <= 4)
    packed = (words[:, :, None] >> (8 * i[None, None, :]).to(tl.uint32)) & 0xFF
    mask = ok[:, None, None] & (g < valid // 8)[None, :, None] & (i < BITS)[None, None, :]
    tl.store(dst[:, None, None] + (g * BITS)[None, :, None] + i[None, None, :], packed.to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(codes, dst, ok, valid, BITS: tl.constexpr, COLS: tl.constexpr):
    """Write each row of ``codes [R, COLS]`` as an LSB-first bit stream at its ``dst [R]`` (code
    ``d`` at bits ``[BITS*d, BITS*d + BITS)``); rows where ``ok`` is false write nothing.

    Per group of 8 codes: ``word = sum_p code_p << (BITS*p)`` (disjoint fields: the sum is an OR),
    then its ``BITS`` bytes. Only the first ``valid`` codes (a multiple of 8) are stored.
    """
    R: tl.constexpr = codes.shape[0]
    groups = tl.reshape(codes.to(tl.uint32), [R, COLS // 8, 8])
    words = tl.sum(groups << (tl.arange(0, 8).to(tl.uint32) * BITS)[None, None, :], axis=2)  # 8 * BITS <= 32 bits
    _store_words(words, dst, ok, valid, BITS)


@triton.jit
def _bucketize(y, midpoint_ptr, BITS: tl.constexpr):
    """``#{m : midpoint_m <= y}`` for each element of an fp32 tile, by binary search over the
    ``2^BITS - 1`` midpoints (sorted ascending): ``BITS`` compares, each against a midpoint chosen
    by the bits decided so far through a tree of selects, instead of ``2^BITS - 1`` compares.
    Equal to the count for sorted midpoints; NaN compares false at every step and gets code 0,
    as in the count. The store's fallback when the grid (:func:`_key_codes`) cannot separate the midpoints."""
    if BITS == 3:
        m = midpoint_ptr
        b4 = y >= tl.load(m + 3)
        b2 = y >= tl.where(b4, tl.load(m + 5), tl.load(m + 1))
        b1 = y >= tl.where(b4, tl.where(b2, tl.load(m + 6), tl.load(m + 4)), tl.where(b2, tl.load(m + 2), tl.load(m)))
        return b4.to(tl.int32) * 4 + b2.to(tl.int32) * 2 + b1.to(tl.int32)
    else:
        m = midpoint_ptr
        b8 = y >= tl.load(m + 7)
        b4 = y >= tl.where(b8, tl.load(m + 11), tl.load(m + 3))
        b2 = y >= tl.where(b8, tl.where(b4, tl.load(m + 13), tl.load(m + 9)),
                           tl.where(b4, tl.load(m + 5), tl.load(m + 1)))  # fmt: skip
        t8 = tl.where(b4, tl.where(b2, tl.load(m + 14), tl.load(m + 12)), tl.where(b2, tl.load(m + 10), tl.load(m + 8)))
        t0 = tl.where(b4, tl.where(b2, tl.load(m + 6), tl.load(m + 4)), tl.where(b2, tl.load(m + 2), tl.load(m)))
        b1 = y >= tl.where(b8, t8, t0)
        return b8.to(tl.int32) * 8 + b4.to(tl.int32) * 4 + b2.to(tl.int32) * 2 + b1.to(tl.int32)


@triton.jit
def _key_codes(y, midpoint_ptr, table, scale, offset, GRID: tl.constexpr, BITS: tl.constexpr):
    """``#{m : midpoint_m <= y}`` for a tile ``y``: one lookup per element in the grid's table (``GRID``, where
    it separates the midpoints; ``turboquant_sm90.grid_table`` says why that is exact), else :func:`_bucketize`."""
    if GRID:
        flat = tl.reshape(y, [y.numel])
        codes = tl.reshape(grid_code(flat, tl.gather(table, grid_slot(flat, scale, offset), 0)), y.shape)
    else:
        codes = _bucketize(y, midpoint_ptr, BITS)
    return codes


@triton.jit
def _key_columns(key_rows, ok, down, inv_denom, pit_ptr, stride_pit, data, midpoint_ptr, centroid_ptr, table,
                 grid_scale, grid_offset, HEAD_DIM: tl.constexpr, KEY_BITS: tl.constexpr,
                 NORM_CORRECTION: tl.constexpr, BLOCK_T: tl.constexpr, D_CHUNK: tl.constexpr,
                 ROTATION_PRECISION: tl.constexpr, GRID: tl.constexpr):  # fmt: skip
    """:func:`_store_kernel`'s MSE keys, ``D_CHUNK`` rotated columns at a time: ``y = k_hat @ PiT[:, cols]``,
    its codes (by the grid's table where ``GRID``, else by binary search) packed and stored; returns each row's
    ``sum c[code]^2`` (zeros without ``NORM_CORRECTION``). ``down``: each row's ``2^-e`` (:func:`_key_norm`),
    ``inv_denom``: ``1 / (||k|| + eps)``."""
    # 16-bit keys on tensor cores: k 2^-e (exact) is a TF32 value, so two TF32 products, with
    # PiT = hi + lo split by truncation, give each k_j PiT[j, d] within 2^-20 of itself (3xTF32:
    # 1.25 * 2^-20); y is that sum times 2^e / (n + eps).
    TWO_PASS: tl.constexpr = ROTATION_PRECISION != "ieee" and key_rows.dtype.element_ty != tl.float32
    # bf16 keys on bf16 tensor cores: PiT = p1 + p2 + p3, each part the next 8 significant bits (cut by
    # truncation, exact: 24 bits hold an fp32 significand), so every product k_j p_i is exact and y is
    # (k @ p3 + k @ p2 + k @ p1) / (n + eps), 3D addends as in 3xTF32. The key chunk enters the MMA as
    # loaded (no conversion, no scaling in registers), so unlike the TF32 passes it is not scaled by
    # 2^-e: a tensor core that flushes subnormal inputs would lose the key's elements below 2^-126,
    # which moves y by at most sqrt(D) 2^-126 / n (past the band only for norms below ~2^-100).
    BF16_PARTS: tl.constexpr = ROTATION_PRECISION == "bf16x3" and key_rows.dtype.element_ty == tl.bfloat16
    PART_DTYPE: tl.constexpr = tl.float32 if INTERPRET else tl.bfloat16  # interpreter: bf16 dots are wrong
    FP32_PRECISION: tl.constexpr = "ieee" if ROTATION_PRECISION == "ieee" else "tf32x3"  # fp32 keys
    code_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    chunk = tl.arange(0, D_CHUNK)
    for c0 in range(0, HEAD_DIM, D_CHUNK):
        cols = c0 + chunk
        in_cols = cols < HEAD_DIM
        # y[:, cols] = k_hat @ PiT[:, cols], D_CHUNK rows of PiT at a time: an FMA dot holds its
        # whole K extent in registers, so K is chunked too (the key chunk is re-read from L1).
        y = tl.zeros([BLOCK_T, D_CHUNK], dtype=tl.float32)
        for r0 in range(0, HEAD_DIM, D_CHUNK):
            in_k = (r0 + chunk) < HEAD_DIM
            k_chunk = tl.load(key_rows[:, None] + (r0 + chunk)[None, :], mask=ok[:, None] & in_k[None, :],
                              other=0.0)  # fmt: skip
            pit = tl.load(pit_ptr + (r0 + chunk)[:, None] * stride_pit + cols[None, :],
                          mask=in_k[:, None] & in_cols[None, :], other=0.0)  # fmt: skip
            if BF16_PARTS:
                k_chunk = k_chunk.to(PART_DTYPE)
                p1 = _bf16_part(pit)
                p2 = _bf16_part(pit - p1)
                y = tl.dot(k_chunk, (pit - p1 - p2).to(PART_DTYPE), y)
                y = tl.dot(k_chunk, p2.to(PART_DTYPE), y)
                y = tl.dot(k_chunk, p1.to(PART_DTYPE), y)
            elif TWO_PASS:
                k_chunk = k_chunk.to(tl.float32) * down[:, None]
                pit_hi = _tf32_part(pit)
                y = tl.dot(k_chunk, _tf32_part(pit - pit_hi), y, input_precision="tf32")
                y = tl.dot(k_chunk, pit_hi, y, input_precision="tf32")
            else:
                y = tl.dot(k_chunk.to(tl.float32) * inv_denom[:, None], pit, y, input_precision=FP32_PRECISION)
        if BF16_PARTS:
            y = y * inv_denom[:, None]
        elif TWO_PASS:
            y = y * (inv_denom / down)[:, None]  # 2^e / (n + eps): a power of two times inv_denom, exact
        codes = _key_codes(y, midpoint_ptr, table, grid_scale, grid_offset, GRID, KEY_BITS)
        _store_packed(codes, data + c0 * KEY_BITS // 8, ok, HEAD_DIM - c0, KEY_BITS, D_CHUNK)
        if NORM_CORRECTION:
            c = tl.load(centroid_ptr + codes)
            code_sq += tl.sum(tl.where(in_cols[None, :], c * c, 0.0), axis=1)
    return code_sq


@triton.jit
def _store_kernel(
    key_ptr, value_ptr, cache_ptr, cache_u16_ptr, slot_ptr, pit_ptr, midpoint_ptr, centroid_ptr,
    num_tokens, num_kv_heads, num_slots, stride_block, stride_block_u16, data_bytes_per_slot,
    meta_offset_u16, stride_kt, stride_kh, stride_vt, stride_vh, stride_pit,
    HEAD_DIM: tl.constexpr,
    KEY_BITS: tl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    VALUE_BITS: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    KEY_DATA_BYTES: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNK: tl.constexpr,
    ROTATION_PRECISION: tl.constexpr,  # "ieee" (fp32 FMAs), "tf32x3" (3xTF32; two TF32 passes for 16-bit keys) or
    # "bf16x3" (bf16 keys against PiT cut into three bf16 parts; other keys as "tf32x3")
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block: a constant divisor (a shift for a power of two)
    WIDE_SLOTS: tl.constexpr,  # slot numbers past int32: block and position in int64
):  # fmt: skip
    """Grid ``(cdiv(T, BLOCK_T), HKV)``: a program owns ``BLOCK_T`` tokens of one KV head and
    writes all of their slots' bytes (no division of a row index into token and head).

    The rotation is ``k_hat [BLOCK_T, D] @ PiT`` in ``[D_CHUNK, D_CHUNK]`` blocks (``tl.dot`` with
    ``ROTATION_PRECISION``), so each program reads ``PiT`` once for ``BLOCK_T`` rows;
    each column chunk's codes are bucketized and packed as soon as its sum is complete. Any summation order,
    fused or not, and 2-ulp divisions and square roots stay inside the error bound that
    ``triton_impl.parity.turboquant.compare_store`` holds a store to.
    """
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    in_rows = token < num_tokens
    slot = tl.load(slot_ptr + token, mask=in_rows, other=-1)
    ok = in_rows & (slot >= 0) & (slot < num_slots)  # padding, or a slot outside the cache: nothing to write
    slot = tl.where(ok, slot, 0)
    if not WIDE_SLOTS:
        slot = slot.to(tl.uint32)  # 0 <= slot < num_slots < 2^31: unsigned 32-bit division and products
    block = slot // BLOCK_SIZE
    position = (slot - block * BLOCK_SIZE).to(tl.int32)
    block = block.to(tl.int64)
    data = cache_ptr + block * stride_block + (position * num_kv_heads + head) * data_bytes_per_slot
    meta = cache_u16_ptr + block * stride_block_u16 + meta_offset_u16 + head * NUM_FIELDS * BLOCK_SIZE + position
    token = token.to(tl.int64)
    head = head.to(tl.int64)  # head * stride_kh: a head-major view's stride may be T * D

    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    tile_ok = ok[:, None] & in_dim[None, :]
    key_rows = key_ptr + token * stride_kt + head * stride_kh
    k_in = tl.load(key_rows[:, None] + dims[None, :], mask=tile_ok, other=0.0)
    k = k_in.to(tl.float32)
    if KEY_BITS == 8:
        code = f32_to_e4m3_bits(k, False)
        if k_in.dtype == tl.float16:  # the GPU's fp16 -> fp32 conversion drops a NaN's sign; e4m3 keeps k's sign
            code = code | ((k_in.to(tl.uint16, bitcast=True) >> 8) & 0x80).to(tl.uint8)
        tl.store(data[:, None] + dims[None, :], code, mask=tile_ok)
    else:
        norm, down = _key_norm(k)
        inv_denom = 1.0 / (norm + _KEY_NORM_EPS)  # one division per row; each k_j / (n + eps) is k_j * inv_denom
        # The grid's table, built once per program; where it cannot separate the midpoints, the binary search
        # (a second copy of the column loop, so that neither has a branch inside).
        table, grid_scale, grid_offset, grid_ok = grid_table(midpoint_ptr, tl.arange(0, GRID_SLOTS), KEY_BITS)
        if grid_ok:
            code_sq = _key_columns(key_rows, ok, down, inv_denom, pit_ptr, stride_pit, data, midpoint_ptr,
                                   centroid_ptr, table, grid_scale, grid_offset, HEAD_DIM, KEY_BITS, NORM_CORRECTION,
                                   BLOCK_T, D_CHUNK, ROTATION_PRECISION, True)  # fmt: skip
        else:
            code_sq = _key_columns(key_rows, ok, down, inv_denom, pit_ptr, stride_pit, data, midpoint_ptr,
                                   centroid_ptr, table, grid_scale, grid_offset, HEAD_DIM, KEY_BITS, NORM_CORRECTION,
                                   BLOCK_T, D_CHUNK, ROTATION_PRECISION, False)  # fmt: skip
        stored_norm = norm
        if NORM_CORRECTION:
            stored_norm = norm / tl.sqrt(code_sq + _NORM_CORRECTION_EPS)
        tl.store(meta, _fp16_bits(stored_norm), mask=ok)

    # Values: min-max over the valid lanes, both ends clamped to fp16's range before the scale.
    LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
    v = tl.load(value_ptr + token[:, None] * stride_vt + head * stride_vh + dims[None, :], mask=tile_ok,
                other=0.0).to(tl.float32)  # fmt: skip
    if BLOCK_D == HEAD_DIM:
        v_min = tl.min(v, axis=1)
        v_max = tl.max(v, axis=1)
    else:
        v_min = tl.min(tl.where(in_dim[None, :], v, float("inf")), axis=1)
        v_max = tl.max(tl.where(in_dim[None, :], v, float("-inf")), axis=1)
    v_min = tl.minimum(tl.maximum(v_min, -_FP16_MAX), _FP16_MAX)
    v_max = tl.minimum(tl.maximum(v_max, -_FP16_MAX), _FP16_MAX)
    scale = tl.maximum((v_max - v_min) / LEVELS, _MIN_VALUE_SCALE)
    inv_scale = 1.0 / scale  # one division per row: t = (v - vmin) * inv_scale
    # The level t = (v - vmin) / scale rounded half up. v is clamped to [vmin, vmax] first (only values past
    # +-65504 move, to the level golden clamps them to), so t lies in [0, LEVELS] up to a few ulp; adding
    # 1.5 * 2^23 rounds it to an integer in the low mantissa bits (to nearest even: a tie is inside
    # compare_store's band), so the biased bits are 0x4B400000 + q with no floor, clamp or conversion.
    v = tl.minimum(tl.maximum(v, v_min[:, None]), v_max[:, None])
    biased = ((v - v_min[:, None]) * inv_scale[:, None] + _ROUND_MAGIC).to(tl.uint32, bitcast=True)
    groups = tl.reshape(biased, [BLOCK_T, BLOCK_D // 8, 8])
    words = tl.sum(groups << (tl.arange(0, 8).to(tl.uint32) * VALUE_BITS)[None, None, :], axis=2)
    # sum_p (0x4B400000 + q_p) << (BITS p) = bias + sum_p q_p << (BITS p) (mod 2^32): subtract the bias once
    SPREAD: tl.constexpr = 0x11111111 if VALUE_BITS == 4 else 0x249249  # sum_p 2^(BITS p)
    words -= tl.full([], 0x4B400000 * SPREAD % 2**32, tl.uint32)
    _store_words(words, data + KEY_DATA_BYTES, ok, HEAD_DIM, VALUE_BITS)
    tl.store(meta + (NUM_FIELDS - 2) * BLOCK_SIZE, _fp16_bits(scale), mask=ok)
    tl.store(meta + (NUM_FIELDS - 1) * BLOCK_SIZE, _fp16_bits(v_min), mask=ok)


def triton_turboquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    centroids: torch.Tensor | None = None,
    norm_correction: bool = False,
) -> None:
    """Quantize ``T`` tokens into their SoA cache slots (vLLM's ``triton_turboquant_store``).

    Codes equal ``golden.turboquant.turboquant_store``'s outside the tie bands of
    ``triton_impl.parity.turboquant.compare_store`` (one step off at most inside one); fp16 fields
    within their rounding band, value zeros and FP8 key bytes exact. A negative
    slot is skipped, and so is a slot outside the cache (checked on the device, whatever the
    content checks say). CUDA graphs: the tensors stay fixed across replays; new slots and
    keys are written into them in place. FP8 keys (``key_fp8=True``, ``mse_bits=0``) ignore ``PiT``/``midpoints``.
    A key with a NaN stores a NaN norm; an infinite one the saturated 65504. On sm_90, MSE keys in bf16 at D = 128
    go to a Gluon store (``triton_impl.turboquant_sm90``): for ``PiT = c H_128`` (the Sylvester-Hadamard rotation
    serving uses) ``store_hadamard_kernel``, whose rotation rounds as ``FP32_GEMM`` says, else ``store_kernel``, as
    ``BF16X2_GEMM`` says. Which one is decided once per ``PiT`` tensor (and in-place version): the first call with a
    ``PiT`` reads one flag back from the device (a host sync; none after), and a ``PiT`` first seen inside a CUDA
    graph capture takes ``store_kernel``.

    Args:
        key, value: ``[T, HKV, D]`` float16/bfloat16/float32 (unit last stride).
        kv_cache: uint8 ``[blocks, block_size, HKV, padded_slot]``, written.
        slot_mapping: ``[T]`` int32/int64.
        PiT: ``[D, D]`` float32 (``y = k_hat @ PiT``); midpoints: ``[2^mse_bits - 1]`` float32,
            ascending.
        mse_bits: 3 or 4 (0 for FP8 keys); key_packed_size: as the preset gives it.
        value_quant_bits: 3 or 4.
        centroids: ``[2^mse_bits]`` float32, needed with ``norm_correction``.

    Traffic: reads ``T*HKV*D`` keys and values and ``D*D*4`` bytes of ``PiT`` (from cache after
    the first programs); writes ``T*HKV*slot_size`` bytes.
    """
    check_tensor("key", key, ndim=3, dtypes=_KEY_DTYPES)
    num_tokens, num_kv_heads, head_dim = key.shape
    device = key.device
    check_tensor("value", value, shape=(num_tokens, num_kv_heads, head_dim), dtypes=_KEY_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=_INDEX_DTYPES, device=device)
    layout = _check_quant_args(head_dim, mse_bits, key_packed_size, value_quant_bits, key_fp8)
    _check_cache(kv_cache, num_kv_heads, layout)
    check_tensor("kv_cache", kv_cache, device=device)
    if not key_fp8:
        _check_rotation("PiT", PiT, head_dim, device)
        check_tensor("midpoints", midpoints, shape=(2**mse_bits - 1,), dtypes=(torch.float32,), device=device)
        # the grid's table and the binary search (its fallback) count #{m : midpoint_m <= y} only if sorted
        if content_checks_enabled(device) and not bool((midpoints[1:] >= midpoints[:-1]).all()):
            raise ValueError("midpoints: expected ascending entries (no NaN)")
        if norm_correction:
            if centroids is None:
                raise ValueError("centroids: required with norm_correction=True and MSE keys, got None")
            _check_codebook("centroids", centroids, 2**mse_bits, device)
    num_blocks, block_size = kv_cache.shape[:2]
    if content_checks_enabled(device) and num_tokens:
        _check_slots(slot_mapping, num_blocks * block_size)
    if num_tokens * num_kv_heads == 0:
        return

    key_bits = 8 if key_fp8 else mse_bits
    unused = kv_cache  # FP8 keys never read PiT, midpoints or centroids; any pointer will do
    config = select_store_config(device, key_fp8, key_bits)
    num_slots = num_blocks * block_size
    data_bytes = layout["data_bytes_per_slot"]
    rows = num_tokens * num_kv_heads
    if config.get("GLUON") and turboquant_sm90.store_supports(
        device=device, key_dtype=key.dtype, head_dim=head_dim, key_bits=key_bits, num_rows=rows,
        stride_block=kv_cache.stride(0), slot_bytes=data_bytes,
    ):  # the sm_90 fast path (triton_impl/turboquant_sm90.py): persistent programs
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        if config.get("HADAMARD") and turboquant_sm90.is_hadamard_rotation(PiT):  # PiT = c H: no PiT in shared memory
            kernel, prefix = turboquant_sm90.store_hadamard_kernel, "HADAMARD"
            warp_rows, extra = int(turboquant_sm90.STORE_QUAD_ROWS), ()
            knobs = hadamard_store_knobs(config, norm_correction)
        else:
            kernel, prefix = turboquant_sm90.store_kernel, "GLUON"
            warp_rows, extra = turboquant_sm90.STORE_WARP_ROWS, (PiT.stride(0),)
            knobs = dict(EARLY_VALUES=bool(config.get("GLUON_EARLY_VALUES", 1)),
                         PREFETCH=bool(config.get("GLUON_PREFETCH", 0)))  # fmt: skip
        warps = config.get(f"{prefix}_WARPS", 4)
        launch(kernel, (min(cdiv(rows, warp_rows * warps), config[f"{prefix}_PROGRAMS_PER_SM"] * sm_count),),
            key, value, kv_cache, slot_mapping, PiT, midpoints, centroids if norm_correction else unused,
            rows, num_slots, kv_cache.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *extra,
            NUM_KV_HEADS=num_kv_heads,
            KEY_BITS=key_bits,
            VALUE_BITS=value_quant_bits,
            NORM_CORRECTION=bool(norm_correction),
            SLOT_BYTES=data_bytes,
            BLOCK_SIZE=block_size,
            WIDE_SLOTS=num_slots > 2**31 - 1,
            WARPS=warps,
            **knobs,
            num_warps=warps,
            **register_cap(config.get(f"{prefix}_MAXNREG")),
        )  # fmt: skip
        return
    block_d = next_pow2(head_dim)
    block_t, d_chunk = config["BLOCK_T"], min(config["D_CHUNK"], block_d)
    # The rotation's fp32 operands k_hat [BLOCK_T, D_CHUNK] and PiT [D_CHUNK, D_CHUNK] pass through
    # shared memory: a large chunk is halved (an sm_90 block has 227 KiB).
    while 4 * d_chunk * (block_t + d_chunk) > _STORE_OPERAND_BYTES and d_chunk > 16:
        d_chunk //= 2
    launch(_store_kernel, (cdiv(num_tokens, block_t), num_kv_heads),
        key, value, kv_cache, kv_cache.view(torch.uint16), slot_mapping,
        unused if key_fp8 else PiT, unused if key_fp8 else midpoints,
        centroids if (norm_correction and not key_fp8) else unused,
        num_tokens, num_kv_heads, num_slots, kv_cache.stride(0), kv_cache.stride(0) // 2, data_bytes,
        block_size * num_kv_heads * data_bytes // 2,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), 0 if key_fp8 else PiT.stride(0),
        HEAD_DIM=head_dim,
        KEY_BITS=key_bits,
        VALUE_BITS=value_quant_bits,
        NORM_CORRECTION=bool(norm_correction) and not key_fp8,
        KEY_DATA_BYTES=layout["key_data_bytes"],
        NUM_FIELDS=layout["num_fields"],
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        D_CHUNK=d_chunk,
        ROTATION_PRECISION=("ieee", "tf32x3", "bf16x3")[config["TF32X3"]],
        BLOCK_SIZE=block_size,
        WIDE_SLOTS=num_slots > 2**31 - 1,
        num_warps=config["num_warps"],
        num_stages=config.get("num_stages", 3),
        **register_cap(config.get("maxnreg")),
    )  # fmt: skip


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    slots = slot_mapping.to(torch.int64)
    live = slots[slots >= 0]
    if live.numel() and int(live.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slot {int(live.max())} is outside the cache's {num_slots} slots")
    if live.numel() != live.unique().numel():
        raise ValueError("slot_mapping: a slot appears twice (two tokens would race for it)")


# ----------------------------------------------------------------------------------------------
# Decode.
# ----------------------------------------------------------------------------------------------


def build_pair_lut(centroids: torch.Tensor) -> torch.Tensor:
    """The pair lookup table of a codebook: ``lut[i*N + j] = (c_i, c_j)`` (FLUTE section 3.2).

    A packed 4-bit byte holds two codes ``(lo, hi)``; one 8-byte gather at ``lo*N + hi`` returns
    both centroids. Built fresh on each call (2 KiB for N = 16): a cache keyed by
    ``centroids.data_ptr()`` would return a stale table when the allocator reuses the address or
    the tensor is updated in place.

    Args:
        centroids: ``[N]`` float, on any device.

    Returns:
        ``[N*N, 2]`` float32, contiguous, on the device of ``centroids``.

    Traffic: reads ``N`` floats; writes ``2*N*N``.
    """
    check_tensor("centroids", centroids, ndim=1, kernel_arg=False)  # host code: the table stays on its device
    c = centroids.to(torch.float32)
    pairs = torch.stack(torch.broadcast_tensors(c[:, None], c[None, :]), dim=-1)
    return pairs.reshape(-1, 2).contiguous()


@triton.jit
def _load_code_groups(words_ptr, field, live, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      WORD_ALIGNED: tl.constexpr, GATHER_WORDS: tl.constexpr):  # fmt: skip
    """``[BLOCK_N, BLOCK_D // 8]`` uint32: group ``g`` holds codes ``8g .. 8g+7`` of each token's
    LSB-first bit stream (code ``d`` at bits ``[BITS*d, BITS*d + BITS)``), ``8 * BITS`` bits.

    ``field`` is each token's byte offset from the cache base (4-byte aligned). A group starts at
    byte ``field + BITS*g``; it is read as the aligned 32-bit word holding that byte, and the next
    word only where the group runs past it (``WORD_ALIGNED``: never, each group is one word).
    Groups past ``HEAD_DIM`` and dead tokens read nothing and give 0.

    ``WORD_ALIGNED`` addresses word ``g`` as ``field // 4 + g``, which Triton sees as contiguous
    along ``g``: lanes run along a token's words (16-byte loads where the launch's strides are
    multiples of 16). Addressed as ``(field + 4g) // 4`` the contiguity is lost and each lane of a
    load read another token: 32 cache lines per warp load (sm_90 tile loop at BLOCK_N 128, 4-bit:
    2169 -> 2072 instructions, 33 scalar LDG -> 8 LDG.128 and 1 LDG).
    """
    g = tl.arange(0, BLOCK_D // 8)
    ok = live[:, None] & (g < HEAD_DIM // 8)[None, :]
    if WORD_ALIGNED:  # word g of the field: contiguous along g, so a warp's load is a few whole lines
        return tl.load(words_ptr + (field // 4)[:, None] + g[None, :], mask=ok, other=0)
    if GATHER_WORDS:
        # The field's words in one contiguous load, then each group's one or two words by a gather along them.
        NUM_WORDS: tl.constexpr = (HEAD_DIM * BITS + 31) // 32
        BLOCK_W: tl.constexpr = triton.next_power_of_2(NUM_WORDS + 1)  # + 1: a group's next word may be past the field
        w = tl.arange(0, BLOCK_W)
        words = tl.load(words_ptr + (field // 4)[:, None] + w[None, :], mask=live[:, None] & (w < NUM_WORDS)[None, :],
                        other=0)  # fmt: skip
        first = tl.broadcast_to(((g * BITS) // 4)[None, :], (live.shape[0], BLOCK_D // 8))
        shift = (((g * BITS) % 4) * 8).to(tl.uint32)[None, :]
        lo = tl.gather(words, first, 1)
        hi = tl.gather(words, first + 1, 1)
        groups = (lo >> shift) | tl.where(shift == 0, 0, hi << ((32 - shift) & 31))
        return tl.where(ok, groups, 0)
    byte = field[:, None] + (g * BITS)[None, :]
    shift = ((byte % 4) * 8).to(tl.uint32)
    lo = tl.load(words_ptr + byte // 4, mask=ok, other=0)
    hi = tl.load(words_ptr + byte // 4 + 1, mask=ok & (shift + 8 * BITS > 32), other=0)
    return (lo >> shift) | tl.where(shift == 0, 0, hi << ((32 - shift) & 31))


@triton.jit
def _codes(groups, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Code groups ``[BLOCK_N, BLOCK_D // 8]`` -> codes ``[BLOCK_N, BLOCK_D]`` int32 in dimension order."""
    phase = tl.arange(0, 8).to(tl.uint32)
    codes = (groups[:, :, None] >> (BITS * phase)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [BLOCK_N, BLOCK_D]).to(tl.int32)


@triton.jit
def _phase(groups, j: tl.constexpr, BITS: tl.constexpr):
    return ((groups >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _joined_codes(groups, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """:func:`_codes` by three levels of ``tl.join``: a joined dimension is held in registers, so each
    thread owns its groups' 8 codes, contiguous in dimension order (``d = 8g + 4a + 2b + c`` at join
    indices ``[g, a, b, c]``)."""
    y00 = tl.join(_phase(groups, 0, BITS), _phase(groups, 4, BITS))
    y10 = tl.join(_phase(groups, 2, BITS), _phase(groups, 6, BITS))
    y01 = tl.join(_phase(groups, 1, BITS), _phase(groups, 5, BITS))
    y11 = tl.join(_phase(groups, 3, BITS), _phase(groups, 7, BITS))
    return tl.reshape(tl.join(tl.join(y00, y10), tl.join(y01, y11)), [BLOCK_N, BLOCK_D])


@triton.jit
def _small_int_to_f16(codes):
    """int32 in ``[0, 1024)`` -> fp16, exactly, without a conversion instruction: ``0x6400 | c`` is
    the fp16 ``1024 + c``, and subtracting 1024 in fp16 is exact."""
    return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _pair_centroids(groups, pair_lut, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """4-bit code groups -> fp16 centroids ``[BLOCK_N, BLOCK_D]`` through the byte-indexed pair LUT
    ``[256]`` uint32 (a register tensor): one 4-byte gather per packed byte returns the centroids
    of both of its codes."""
    k = tl.arange(0, 4).to(tl.uint32)
    byte = tl.reshape((groups[:, :, None] >> (8 * k)[None, None, :]) & 0xFF, [BLOCK_N * BLOCK_D // 2])
    pair = tl.reshape(tl.gather(pair_lut, byte.to(tl.int32), 0), [BLOCK_N, BLOCK_D // 8, 4])
    even = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)  # coordinate 2k
    odd = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)  # coordinate 2k + 1
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_D])


@triton.jit
def _load_fp16(ptr, live):
    return tl.load(ptr, mask=live, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _split_f16(x):
    """fp32 ``x = hi + lo`` (to ~2^-22 relative) with ``hi``, ``lo`` fp16: tensor-core operands."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _load_tile(cache_ptr, cache_u16_ptr, block_row, tile_start, end, kv_head,
               block_size, num_blocks, num_kv_heads, stride_btc, stride_block, data_bytes_per_slot, meta_offset,
               HEAD_DIM: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr,
               KEY_DATA_BYTES: tl.constexpr, NUM_FIELDS: tl.constexpr, WORD_ALIGNED_KEYS: tl.constexpr,
               WORD_ALIGNED_VALUES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               GATHER_WORDS: tl.constexpr):  # fmt: skip
    """Everything tile ``[tile_start, tile_start + BLOCK_N)`` reads from memory, still packed:
    ``(live, keys, values, norm, v_scale, v_zero)``. Keys are FP8 bytes ``[BLOCK_N,
    BLOCK_D]`` or code groups, values code groups (:func:`_load_code_groups`). Tokens at or past
    ``end`` read nothing; a table entry outside the cache reads block 0 or the last (the kernel
    found it before its loop)."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    live = tokens < end
    page = tl.load(block_row + (tokens // block_size) * stride_btc, mask=live, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
    position = tokens % block_size
    block_base = page * stride_block
    field = block_base + (position * num_kv_heads + kv_head) * data_bytes_per_slot  # byte offsets
    meta = cache_u16_ptr + (block_base + meta_offset) // 2 + kv_head * NUM_FIELDS * block_size + position
    words_ptr = cache_ptr.to(tl.pointer_type(tl.uint32))
    if KEY_BITS == 8:
        dims = tl.arange(0, BLOCK_D)
        keys = tl.load(cache_ptr + field[:, None] + dims[None, :], mask=live[:, None] & (dims < HEAD_DIM)[None, :],
                       other=0)  # fmt: skip
        norm = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    else:
        keys = _load_code_groups(words_ptr, field, live, KEY_BITS, HEAD_DIM, BLOCK_D, WORD_ALIGNED_KEYS, GATHER_WORDS)
        norm = _load_fp16(meta, live)  # the stored (norm-corrected) key norm
    values = _load_code_groups(words_ptr, field + KEY_DATA_BYTES, live, VALUE_BITS, HEAD_DIM, BLOCK_D,
                               WORD_ALIGNED_VALUES, GATHER_WORDS)  # fmt: skip
    v_scale = _load_fp16(meta + (NUM_FIELDS - 2) * block_size, live)
    v_zero = _load_fp16(meta + (NUM_FIELDS - 1) * block_size, live)
    return live, keys, values, norm, v_scale, v_zero


@triton.jit
def _key_tile(keys, pair_lut, codebook, centroid_ptr, KEY_BITS: tl.constexpr, USE_PAIR_LUT: tl.constexpr,
              SMEM_CODEBOOK: tl.constexpr, JOIN_UNPACK: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):  # fmt: skip
    """A tile's keys ``[BLOCK_N, BLOCK_D]`` fp16: FP8 bytes converted, or codes through a table."""
    if KEY_BITS == 8:
        k = e4m3_bits_to_f16(keys)  # exact: every e4m3 value is an fp16 value
    elif USE_PAIR_LUT:
        k = _pair_centroids(keys, pair_lut, BLOCK_N, BLOCK_D)
    elif SMEM_CODEBOOK:
        if JOIN_UNPACK:
            codes = tl.reshape(_joined_codes(keys, KEY_BITS, BLOCK_N, BLOCK_D), [BLOCK_N * BLOCK_D])
        else:
            codes = tl.reshape(_codes(keys, KEY_BITS, BLOCK_N, BLOCK_D), [BLOCK_N * BLOCK_D])
        k = tl.reshape(tl.gather(codebook, codes, 0), [BLOCK_N, BLOCK_D])
    else:
        k = tl.load(centroid_ptr + _codes(keys, KEY_BITS, BLOCK_N, BLOCK_D)).to(tl.float16)
    return k


@triton.jit
def _rotate_query_kernel(
    q_ptr, pit_ptr, partials_ptr, num_heads, num_splits, first_slot,
    stride_qb, stride_qh, stride_pit_k, stride_pit_n, stride_pb, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):  # fmt: skip
    """Grid ``(B, cdiv(H, BLOCK_M), BLOCK_D // D_CHUNK)``: ``q~ = q @ PiT`` for ``BLOCK_M`` heads and
    ``D_CHUNK`` columns, written into the first ``D`` floats of slots ``first_slot .. first_slot + num_splits - 1``
    of those heads.

    The decode's own partials buffer ``[B, H, S, D+1]`` is the rotated query's home: stage 1's program for split
    ``s`` reads ``q~`` from its slot, then overwrites the slot with its partial; or (the sm_90 TMA kernels) every
    program reads it from one slot past the splits, which no program writes; that slot's LSE column gets 0, where
    the stream-K stage 1 counts the places it hands out (``turboquant_sm90._stream_k_claim``; a split's slot has its
    LSE overwritten by stage 1). Nothing else is allocated and the
    query's rotation follows its contents on every call (a graph replay included). ``PiT`` is read through its
    strides (``Pi`` transposed is ``PiT`` with its strides swapped). ``PRECISION`` is the dot's: ``"ieee"`` (fp32
    products and sums, as an fp32 matmul) or, where tensor cores take TF32 (the sm90 entry's ``ROTATE_TF32X3``),
    ``"tf32x3"``: each operand split into a TF32 part and a TF32 rest, three MMAs, fp32 sums. A bf16 or fp16 query
    is exact in TF32 (7 or 10 stored mantissa bits; TF32 keeps 10), so its rest is 0 and the one rounding left is of
    ``PiT``'s rest, ``2^-11`` of it: each product within ``2^-22`` of itself, where 128 fp32 additions already allow
    about ``128 * 2^-24 = 2^-17`` of ``sum_j |q_j PiT[j, d]|``. On the H200 the ieee dot read its shared-memory
    operands with 82% of the wavefronts bank conflicts (12.9 us a call at B=32 H=32, Nsight Compute); tensor cores
    read them through conflict-free layouts.
    """
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    head_ok = heads < num_heads
    k = tl.arange(0, BLOCK_D)
    cols = tl.program_id(2) * D_CHUNK + tl.arange(0, D_CHUNK)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + k[None, :],
                mask=head_ok[:, None] & (k < HEAD_DIM)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    pit = tl.load(pit_ptr + k[:, None] * stride_pit_k + cols[None, :] * stride_pit_n,
                  mask=(k < HEAD_DIM)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    q_rot = tl.dot(q, pit, input_precision=PRECISION)
    slot = partials_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + cols[None, :]
    ok = head_ok[:, None] & (cols < HEAD_DIM)[None, :]
    for split in range(first_slot, first_slot + num_splits):
        tl.store(slot + split * stride_ps, q_rot, mask=ok)
    if tl.program_id(2) == 0:  # slot first_slot's LSE column: 0 (int32 0 is +0.0), stream-K's rank counts
        tl.store(partials_ptr + b.to(tl.int64) * stride_pb + heads * stride_ph + first_slot * stride_ps + HEAD_DIM,
                 tl.zeros([BLOCK_M], tl.float32), mask=head_ok)  # fmt: skip


@triton.jit
def _decode_stage1_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, centroid_ptr, partials_ptr,
    sm_scale, num_splits, num_kv_heads, block_size, num_blocks, table_keys, stride_block, data_bytes_per_slot,
    meta_offset, stride_qb, stride_qh, stride_bt, stride_btc, stride_pb, stride_ph, stride_ps,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KEY_BITS: tl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    VALUE_BITS: tl.constexpr,
    KEY_DATA_BYTES: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    USE_PAIR_LUT: tl.constexpr,
    SMEM_CODEBOOK: tl.constexpr,  # without the pair LUT: gather from an fp16 register tensor, else fp32 loads
    WORD_ALIGNED_KEYS: tl.constexpr,
    WORD_ALIGNED_VALUES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    JOIN_UNPACK: tl.constexpr,  # code groups -> codes by joins, else by a reshape
    GATHER_WORDS: tl.constexpr,  # 3-bit fields: one contiguous load of the words, groups by tl.gather
    PREFETCH: tl.constexpr,  # 1: the next tile's loads issued before this tile's compute; 0: Triton's pipeliner
    FP16_OPERANDS: tl.constexpr = 0,  # 1: the query and p * v_scale rounded once to fp16 (one MMA each), not hi + lo
):  # fmt: skip
    """Grid ``(B, HKV, S)``: a program owns one split of one request for one KV head.

    It loads the group's ``KV_GROUP`` rotated queries once (``BLOCK_M >= 16`` rows for
    ``tl.dot``) and streams ``BLOCK_N``-token tiles of its split. Per tile, each token's key and
    value fields are read as 32-bit words, one word per group of 8 codes
    (:func:`_load_code_groups`), and unpacked with shifts: key codes -> fp16 centroids -> ``q.c``
    in MMAs -> times the stored norm. The centroid tables come from the fp32 codebook in every
    program: the byte-indexed pair LUT (``USE_PAIR_LUT``) or the fp16 codebook (``SMEM_CODEBOOK``),
    each a register tensor gathered with ``tl.gather`` (through shared memory); or, with neither,
    the fp32 entries loaded per code and rounded.
    Values enter as ``(p * scale) @ codes + p @ zero``: codes are small integers, exact in fp16
    (:func:`_small_int_to_f16`), so the MMA needs no dequantized value and no lookup.

    MSE keys: the rotated query is read from this program's own slot of the partials buffer
    (:func:`_rotate_query_kernel` put it there) before the slot is overwritten; FP8 keys: the query
    itself, in its dtype.

    Numerics: the centroids are rounded to fp16 once (as upstream's kernel does); everything else
    keeps ~22 bits: the query and ``p * scale`` enter the MMAs as fp16 pairs ``hi + lo``, codes and
    e4m3 keys are exact in fp16, sums are fp32. Queries must stay below 65504 (as upstream's fp16
    cast assumes). With ``FP16_OPERANDS`` (a config key, on in the sm90 entry) the query and ``p * scale``
    are rounded once to fp16 instead, one MMA each (upstream's query cast; the check such a call takes is
    ``triton_impl.parity.turboquant.decode_expected``). Online softmax in base 2; writes
    ``(o, lse)``, or ``(0, -inf)`` for an empty split.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    cache_u16_ptr = cache_ptr.to(tl.pointer_type(tl.uint16))  # the fp16 metadata fields
    seq_len = tl.maximum(tl.load(seq_lens_ptr + b).to(tl.int32), 0)
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # Memory safety without host checks: a request whose keys need a table column past the table
    # (``table_keys = columns * block_size``) or a block outside the cache is poisoned (out = lse =
    # NaN), and no such address is read. Every split of the request sees the first condition; the
    # second is found before the key loop (triton_impl.block_table), which clamps each entry.
    too_long = seq_len > table_keys
    end = tl.minimum(end, table_keys).to(tl.int32)
    block_row = block_table_ptr + b.to(tl.int64) * stride_bt
    poisoned = too_long | (first_bad_key(block_row, stride_btc, start, end, num_blocks, block_size) < end)

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * KV_GROUP + rows
    head_ok = rows < KV_GROUP
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    partial = partials_ptr + b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
    if KEY_BITS == 8:
        q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    else:  # the rotated query, in this program's slot (the same pointer as the stores below: no aliasing to assume)
        q_rows = partial[:, None]
    q = tl.load(q_rows + dims[None, :], mask=head_ok[:, None] & in_dim[None, :], other=0.0).to(tl.float32)
    q_hi, q_lo = _split_f16(q)
    # Every thread's load of the slot is performed before any thread's store to it at the end:
    # a barrier orders them (the loop's shared-memory tiles put more barriers between, but an
    # empty split has no loop).
    tl.debug_barrier()
    score_scale = sm_scale * _LOG2E  # scores in base 2
    pair_lut = 0  # the key tables a lookup below does not use
    codebook = 0
    if USE_PAIR_LUT:  # entry b (a packed byte: lo = b & 15, hi = b >> 4) is fp16(c_lo) | fp16(c_hi) << 16
        byte = tl.arange(0, 256)
        lo = tl.load(centroid_ptr + (byte & 15)).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = tl.load(centroid_ptr + (byte >> 4)).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        pair_lut = lo | (hi << 16)
    elif SMEM_CODEBOOK and KEY_BITS != 8:  # the fp16 codebook as a register tensor
        codebook = tl.load(centroid_ptr + tl.arange(0, 1 << KEY_BITS)).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # PREFETCH: each iteration issues the next tile's loads before it computes on this one, so
    # their latency (table entry, then the fields it points to) hides under the compute. Without
    # it the tile is loaded where it is used, and Triton's pipeliner may stage the loads itself
    # (num_stages; sm_90: LDGSTS into shared memory).
    if PREFETCH:
        live, keys, values, norm, v_scale, v_zero = _load_tile(
            cache_ptr, cache_u16_ptr, block_row, start, end, kv_head, block_size, num_blocks, num_kv_heads,
            stride_btc, stride_block, data_bytes_per_slot, meta_offset, HEAD_DIM, KEY_BITS, VALUE_BITS,
            KEY_DATA_BYTES, NUM_FIELDS, WORD_ALIGNED_KEYS, WORD_ALIGNED_VALUES, BLOCK_N, BLOCK_D,
            GATHER_WORDS)  # fmt: skip
    for tile_start in range(start, end, BLOCK_N):
        tile = _load_tile(
            cache_ptr, cache_u16_ptr, block_row, tile_start + PREFETCH * BLOCK_N, end, kv_head, block_size,
            num_blocks, num_kv_heads, stride_btc, stride_block, data_bytes_per_slot, meta_offset, HEAD_DIM,
            KEY_BITS, VALUE_BITS, KEY_DATA_BYTES, NUM_FIELDS, WORD_ALIGNED_KEYS, WORD_ALIGNED_VALUES, BLOCK_N,
            BLOCK_D, GATHER_WORDS)  # fmt: skip
        if not PREFETCH:
            live, keys, values, norm, v_scale, v_zero = tile

        k = _key_tile(keys, pair_lut, codebook, centroid_ptr, KEY_BITS, USE_PAIR_LUT, SMEM_CODEBOOK, JOIN_UNPACK,
                      BLOCK_N, BLOCK_D)  # fmt: skip
        k = tl.trans(k)
        if FP16_OPERANDS:
            qk = tl.dot(q_hi, k) * norm[None, :]
        else:
            qk = tl.dot(q_lo, k, tl.dot(q_hi, k)) * norm[None, :]
        s = tl.where(live[None, :], qk * score_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: a tile has at least one live token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        if JOIN_UNPACK:
            v_codes = _small_int_to_f16(_joined_codes(values, VALUE_BITS, BLOCK_N, BLOCK_D))
        else:
            v_codes = _small_int_to_f16(_codes(values, VALUE_BITS, BLOCK_N, BLOCK_D))
        w_hi, w_lo = _split_f16(p * v_scale[None, :])
        if FP16_OPERANDS:
            pv = tl.dot(w_hi, v_codes)
        else:
            pv = tl.dot(w_lo, v_codes, tl.dot(w_hi, v_codes))
        pv += tl.sum(p * v_zero[None, :], axis=1)[:, None]
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if PREFETCH:
            live, keys, values, norm, v_scale, v_zero = tile

    has_keys = end > start
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    out = tl.where(has_keys, acc / l_safe[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))
    out = tl.where(poisoned, float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)
    tl.store(partial[:, None] + dims[None, :], out, mask=head_ok[:, None] & in_dim[None, :])
    tl.store(partial + HEAD_DIM, lse, mask=head_ok)


def _leading_view(
    given: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A given buffer's leading ``shape`` view, checked."""
    check_tensor(name, given, ndim=len(shape), dtypes=(dtype,), device=device)
    if any(have < need for have, need in zip(given.shape, shape)):
        raise ValueError(f"{name}: expected every dim >= {list(shape)}, got shape {list(given.shape)}")
    return given[tuple(slice(0, n) for n in shape)]


class _DecodePlan(NamedTuple):
    """A checked call layout of :func:`triton_turboquant_decode_attention_v2` and what it launches.

    The launches take the caller's whole buffers: a buffer's leading part, which the kernels
    write, starts at the buffer's address and has its strides."""

    rotate: Callable[..., None]  # (stream, query, PiT or Pi, mid_o); no_launch for FP8 keys
    stage1: Callable[..., None]  # (stream, query, kv_cache, block_table, seq_lens, centroids, mid_o)
    merge: Callable[..., None]  # (stream, mid_o, output, lse)
    # sm_90's one-warp stage 1 rotating the query itself, where the rotation is c H_128 (HADAMARD_QUERY; else None):
    # (stream, query, kv_cache, block_table, seq_lens, centroids, mid_o, PiT or Pi), and no rotate launch
    hadamard_stage1: Callable[..., None] | None
    launches: bool  # False: no (request, head), nothing to compute
    rotation_from_pit: bool  # MSE keys: rotate by PiT (else by Pi, transposed through its strides)
    contiguous_lens: bool  # seq_lens is read with unit stride: else a contiguous copy per call
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # mid_o, output, lse (buffers not given)
    out_dtype: torch.dtype
    device: torch.device
    output_is_view: bool  # return output_buf[:B, :H, :D], not output_buf itself
    batch: int
    block_size: int
    num_blocks: int
    on_cuda: bool  # where the content checks would read (see content_checks_on)


# Plans by call key (``triton_impl.validation`` says what a key holds).
_PLANS = Plans()
_KEYED_SCALES = (float, int)  # a scale of another type (a tensor, ...) is checked and planned on every call


def triton_turboquant_decode_attention_v2(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    Pi: torch.Tensor | None,
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    value_packed_size: int,
    max_seq_len: int = 0,
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    lse_buf: torch.Tensor | None = None,
    buf_holder: Any = None,
    max_num_kv_splits: int = 32,
    use_pair_lut: bool | None = None,
) -> torch.Tensor:
    """One-token decode attention over a TurboQuant SoA cache (vLLM's v2 launcher).

    ``q~ = q @ PiT`` (``PiT = Pi.T`` when not given) in fp32, by a first kernel (see below); MSE keys score
    ``scale * n_j <q~, c[idx_j]>``, FP8 keys ``scale * <q, k_j>``; softmax over ``j <
    seq_lens[b]``; values ``q_j * scale_j + zero_j``. Golden:
    ``golden.turboquant.turboquant_decode_attention``. An empty request gives ``out = 0``,
    ``lse = -inf``. ``max_seq_len`` (ignored) and ``norm_correction`` (folded into the stored
    norm by the store) are accepted for signature compatibility. The centroids are read rounded
    to fp16, as upstream's kernel reads them (``triton_impl.parity.turboquant.centroid_rounding_bound``
    bounds what that moves against the exact codebook).

    Split-KV with ``S`` splits: ``max_num_kv_splits``, or fewer where the device's config caps them at
    ``SPLIT_ROUNDS`` rounds of resident programs (``decode_attention.stage1_splits``; ``S`` depends on
    ``B``, ``HKV`` and the GPU only, so a CUDA graph replays the same grid). Split ``s``
    of request ``b`` covers ``[s*c, min((s+1)*c, L_b))``, ``c = cdiv(L_b, S)``; slots of ``mid_o_buf``
    past ``S`` are not written. Where the sm_90 entry runs stream-K (3/4-bit keys, ``S >= 2``), the slots hold
    pieces instead: each KV head's keys over all requests divided evenly among one round of programs, a (request,
    KV head)'s pieces in its first slots and LSE -inf in the rest (:func:`stream_k_pieces`). Buffers are used
    when given (their leading ``[B, H, S, D+1]`` / ``[B, H, D]`` / ``[B, H]`` part); missing ones
    are allocated and parked on ``buf_holder`` as ``_tq_mid_o_buf`` / ``_tq_output_buf`` /
    ``_tq_lse_buf``.

    On sm_90 (H100, H200) stage 1 of 3/4-bit and FP8 keys with 3/4-bit values at D = 128 runs as a Gluon
    kernel (``triton_impl.turboquant_sm90``) that writes the same partials with the same numerics;
    the portable Triton kernel serves every other architecture and layout, and the interpreter.

    Host path: the metadata checks and launch arguments are planned once per call layout (every
    tensor's dtype, shape, strides, device and 16-byte alignment, the cache's 4-byte alignment,
    every other argument and the type of each int; ``triton_impl.validation``); a call with a
    planned layout passes its tensors straight to the launches: the rotation (MSE keys), stage 1
    and the split merge. Everything derived from contents is computed by the kernels on every
    call: the rotated query (written into ``mid_o_buf``'s split slots, which stage 1 then
    overwrites) and the fp16 centroids (the pair LUT too, built in registers). Content checks,
    when on, run on every call.

    On sm_90, where ``PiT`` (or ``Pi``) is ``c H_128`` (the Sylvester-Hadamard rotation serving uses) and the entry
    sets ``HADAMARD_QUERY``, the one-warp stage 1 rotates the query itself (fp32 butterflies, then ``c``) and the
    rotation launch is skipped. Which way is decided as for the store (``turboquant_sm90.is_hadamard_rotation``): once
    per rotation tensor and in-place version, one flag read back then (a host sync on the first call with it, none
    after: pass the same tensor object each call, since a view made per call is a new tensor each time), and a
    rotation first seen inside a CUDA graph capture takes the rotation launch.

    CUDA graphs: capture with the buffers given (then nothing is allocated) and replay with new
    ``query`` / ``seq_lens`` / ``block_table`` / ``kv_cache`` / ``centroids`` / ``PiT`` contents
    written in place; the tensors (their addresses and shapes), ``scale``, the preset's sizes,
    ``key_fp8``, ``max_num_kv_splits`` and ``use_pair_lut`` stay fixed across replays. A capture that rotated the
    query in stage 1 reads ``c`` from ``PiT[0, 0]`` on every replay, and ``PiT`` must stay a positive multiple of
    ``H_128`` there; any other capture takes any new rotation.

    Args:
        query: ``[B, H, D]`` float16/bfloat16.
        kv_cache: uint8 ``[blocks, block_size, HKV, padded_slot]`` starting 4-byte aligned (codes
            are read as 32-bit words); ``H % HKV == 0``.
        block_table: ``[>= B, max_blocks]`` (or ``[>= B, max_blocks, 1]``) int32/int64, any
            strides; an entry covering a request's keys outside the cache (or a request longer
            than the table) makes that request's output and LSE NaN and is never dereferenced.
        seq_lens: ``[>= B]`` int32/int64.
        Pi / PiT: ``[D, D]`` float32 (one of them, MSE keys); centroids: ``[2^mse_bits]`` float32.
        mse_bits: 3 or 4 (0 for FP8 keys); key_packed_size, value_packed_size: the preset's.
        mid_o_buf: fp32 ``[>=B, >=H, >=S, >=D+1]``; output_buf: query dtype ``[>=B, >=H, >=D]``;
        lse_buf: fp32 ``[>=B, >=H]``.
        use_pair_lut: None (the launch config's choice for 4-bit keys), or force the pair LUT on/off
            in the portable kernel (4-bit keys only); the sm_90 fast path always gathers from it. Both
            tables hold the same fp16 centroids.

    Returns:
        ``[B, H, D]`` in the query dtype (a view of ``output_buf`` when given); the natural-log
        LSE ``[B, H]`` fp32 goes to ``lse_buf``.

    Traffic: reads ``sum_b L_b * HKV * (data_bytes_per_slot + 2 * fields)`` cache bytes, the
    query and the block table; writes ``B*H*S*(D+1)`` fp32 partials, then ``B*H*D`` outputs and
    ``B*H`` LSEs (stage 2 reads the partials back). MSE keys: the rotation writes ``B*H*S*D`` fp32
    (the rotated query in every split slot; on sm_90's TMA paths ``B*H*D``, in one slot past the
    splits) that stage 1 reads back, and reads ``PiT`` once per head block.
    """
    device_index, stream = current_target()
    try:
        key = (device_index, tensor_facts(query), tensor_facts(kv_cache), kv_cache.data_ptr() % 4,
               tensor_facts(block_table), tensor_facts(seq_lens), tensor_facts(Pi), tensor_facts(centroids),
               tensor_facts(PiT), tensor_facts(mid_o_buf), tensor_facts(output_buf), tensor_facts(lse_buf),
               scale, type(scale), mse_bits, type(mse_bits), key_packed_size, type(key_packed_size),
               value_quant_bits, type(value_quant_bits), value_packed_size, type(value_packed_size), key_fp8,
               max_num_kv_splits, type(max_num_kv_splits), use_pair_lut)  # fmt: skip
        plan = _PLANS.get(key) if type(scale) in _KEYED_SCALES else None
    except (AttributeError, TypeError, ValueError):  # a non-tensor or unhashable argument: the checks name it
        key, plan = None, None
    if plan is None:
        plan = _plan_decode(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, key_packed_size,
                            value_quant_bits, value_packed_size, key_fp8, PiT, mid_o_buf, output_buf, lse_buf,
                            max_num_kv_splits, use_pair_lut)  # fmt: skip
        if key is not None and type(scale) in _KEYED_SCALES:
            _PLANS.add(key, plan)
    if plan.batch and content_checks_on(plan.on_cuda):
        lens = seq_lens[: plan.batch]
        check_int32_lengths("seq_lens", lens)
        if int(lens.min()) < 0:
            raise ValueError(f"seq_lens: expected >= 0, got {int(lens.min())}")
        table_2d = block_table_2d("block_table", block_table, min_rows=0, device=query.device, dtypes=_INDEX_DTYPES)
        check_block_table("block_table", table_2d, lens, plan.block_size, plan.num_blocks)

    if mid_o_buf is None:
        mid_o_buf = torch.empty(plan.shapes[0], dtype=torch.float32, device=plan.device)
        if buf_holder is not None:
            buf_holder._tq_mid_o_buf = mid_o_buf
    if output_buf is None:
        output_buf = torch.empty(plan.shapes[1], dtype=plan.out_dtype, device=plan.device)
        if buf_holder is not None:
            buf_holder._tq_output_buf = output_buf
    if lse_buf is None:
        lse_buf = torch.empty(plan.shapes[2], dtype=torch.float32, device=plan.device)
        if buf_holder is not None:
            buf_holder._tq_lse_buf = lse_buf
    if plan.launches:
        rotation = PiT if plan.rotation_from_pit else Pi
        lens = seq_lens if plan.contiguous_lens else seq_lens.contiguous()
        if plan.hadamard_stage1 is not None and turboquant_sm90.is_hadamard_rotation(rotation):
            plan.hadamard_stage1(stream, query, kv_cache, block_table, lens, centroids, mid_o_buf, rotation)
        else:
            plan.rotate(stream, query, rotation, mid_o_buf)
            plan.stage1(stream, query, kv_cache, block_table, lens, centroids, mid_o_buf)
        plan.merge(stream, mid_o_buf, output_buf, lse_buf)
    if plan.output_is_view:
        shape = plan.shapes[1]
        return output_buf[: shape[0], : shape[1], : shape[2]]
    return output_buf


class _DescribedLaunch(NamedTuple):
    """A stage 1 whose kernel reads the cache through tensor descriptors: called as the plan's ``stage1`` (``stream,
    query, kv_cache, block_table, seq_lens, centroids, mid_o``) or ``hadamard_stage1`` (the same and the rotation),
    it looks the cache's descriptors up by its address and passes them after those tensors and the rotation (the
    kernel's ``pit_ptr``, read with ``HADAMARD_QUERY`` only: else the query stands in)."""

    launch: Launch
    descriptors: DescriptorsByAddress
    geometry: tuple

    def __call__(self, stream: int | None, *tensors: Any) -> None:
        rotation = tensors[6] if len(tensors) > 6 else tensors[0]
        self.launch(stream, *tensors[:6], rotation, *self.descriptors(tensors[1], self.geometry))


def _plan_decode(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, key_packed_size,
                 value_quant_bits, value_packed_size, key_fp8, PiT, mid_o_buf, output_buf, lse_buf,
                 max_num_kv_splits, use_pair_lut) -> _DecodePlan:  # fmt: skip
    """The argument checks of :func:`triton_turboquant_decode_attention_v2` (all but the content
    checks) and its launches."""
    check_tensor("query", query, ndim=3, dtypes=_QUERY_DTYPES)
    batch, num_heads, head_dim = query.shape
    device = query.device
    layout = _check_quant_args(head_dim, mse_bits, key_packed_size, value_quant_bits, key_fp8)
    if value_packed_size != layout["value_packed_size"]:
        raise ValueError(f"value_packed_size: expected {layout['value_packed_size']}, got {value_packed_size}")
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=(torch.uint8,), device=device)
    num_blocks, block_size, num_kv_heads = kv_cache.shape[:3]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query: {num_heads} heads is not a multiple of kv_cache's {num_kv_heads} KV heads")
    _check_cache(kv_cache, num_kv_heads, layout)
    table_2d = block_table_2d("block_table", block_table, min_rows=batch, device=device, dtypes=_INDEX_DTYPES)
    check_lengths("seq_lens", seq_lens, batch, device, _INDEX_DTYPES)
    check_positive("max_num_kv_splits", max_num_kv_splits)
    if use_pair_lut is not None:
        check_flag("use_pair_lut", use_pair_lut)
    if use_pair_lut and (key_fp8 or mse_bits != 4):
        raise ValueError(f"use_pair_lut: the pair LUT serves 4-bit keys, got mse_bits={mse_bits}, key_fp8={key_fp8}")
    rotation = PiT if PiT is not None else Pi
    if not key_fp8:
        if rotation is None:
            raise ValueError("Pi, PiT: MSE keys need the rotation, got None for both")
        check_tensor("PiT" if PiT is not None else "Pi", rotation, shape=(head_dim, head_dim), dtypes=(torch.float32,),
                     device=device, unit_last_stride=False)  # fmt: skip
        check_tensor("centroids", centroids, shape=(2**mse_bits,), dtypes=(torch.float32,), device=device)
    check_float("scale", scale)  # the launches pass float(scale)

    shapes = ((batch, num_heads, max_num_kv_splits, head_dim + 1), (batch, num_heads, head_dim), (batch, num_heads))
    # The leading parts the kernels write (checked), or buffers of the shapes this call will allocate.
    mid_o, output, lse = (
        torch.empty(shape, dtype=dtype, device=device) if given is None else _leading_view(given, name, shape, dtype,
                                                                                            device)
        for given, name, shape, dtype in ((mid_o_buf, "mid_o_buf", shapes[0], torch.float32),
                                          (output_buf, "output_buf", shapes[1], query.dtype),
                                          (lse_buf, "lse_buf", shapes[2], torch.float32))
    )  # fmt: skip
    make_plan = partial(_DecodePlan, rotation_from_pit=PiT is not None, contiguous_lens=True, shapes=shapes,
                        out_dtype=query.dtype, device=device,
                        output_is_view=output_buf is not None and tuple(output_buf.shape) != shapes[1], batch=batch,
                        block_size=block_size, num_blocks=num_blocks, on_cuda=device.type == "cuda")  # fmt: skip
    if batch * num_heads == 0:
        return make_plan(no_launch, no_launch, no_launch, None, False)
    if num_blocks == 0:  # the kernel reads block 0 in place of a bad entry
        raise ValueError(f"kv_cache: expected at least one block, got shape {list(kv_cache.shape)}")
    if kv_cache.data_ptr() % 4:
        raise ValueError("kv_cache: expected a 4-byte aligned start (the decode reads codes as 32-bit words)")

    key_bits = 8 if key_fp8 else mse_bits
    config = select_decode_config(device, key_bits, value_quant_bits)
    group = num_heads // num_kv_heads
    table_keys = table_2d.shape[1] * block_size
    meta_offset = block_size * num_kv_heads * layout["data_bytes_per_slot"]
    gluon, tma = _sm90_stage1(config, query, kv_cache, layout, key_bits, value_quant_bits)
    num_splits = decode_num_splits(max_num_kv_splits, batch, num_kv_heads, device, key_bits, value_quant_bits)
    # The TMA kernels read MSE keys' rotated query from one slot past the splits (query_slot).
    q_slot = query_slot(config, max_num_kv_splits, key_bits, value_quant_bits) if tma else None
    mid_o = mid_o[:, :, :num_splits]  # the slots the kernels write
    # The grid (B, HKV, S) and the constexprs both Gluon kernels take.
    grid = (batch, num_kv_heads, num_splits)
    shape = dict(KV_GROUP=group, KEY_BITS=key_bits, KEY_DATA_BYTES=layout["key_data_bytes"],
                 VALUE_BITS=value_quant_bits, SLOT_BYTES=layout["data_bytes_per_slot"], NUM_KV_HEADS=num_kv_heads,
                 BLOCK_SIZE=block_size, FP16_OPERANDS=config.get("FP16_OPERANDS", 0))  # fmt: skip
    hadamard_stage1 = None
    if tma:  # the sm_90 fast paths whose chunks are copied by TMA (one-warp programs, or per-warp streams of a
        # program): the cache's descriptors looked up by its address at each call
        geometry = turboquant_sm90.tma_geometry(
            num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
            slot_bytes=layout["data_bytes_per_slot"], key_bytes=layout["key_data_bytes"],
            stride_block=kv_cache.stride(0), meta_offset=meta_offset, num_fields=layout["num_fields"])  # fmt: skip
        args = (float(scale), num_splits, num_blocks, table_keys, q_slot or 0, kv_cache.stride(0), *query.stride()[:2],
                *table_2d.stride(), *mid_o.stride()[:3])  # fmt: skip
        if config.get("GLUON_WARP"):
            kernel = turboquant_sm90.decode_stage1_warp_kernel
            options = turboquant_sm90.launch_options(group, config["WARP_MAXNREG"], warps=1)
            options |= warp_stages(config) | {"HADAMARD_QUERY": 0}  # (every constexpr given: Launch's fast path)
            programs = stream_k_programs(config, device, num_splits, num_kv_heads)
            rotating = dict(options, HADAMARD_QUERY=1)
            if programs:  # one round of programs, the keys divided by their places' weights
                kernel, grid, args = turboquant_sm90.decode_stage1_stream_k_kernel, (programs,), (*args, batch)
                options |= stream_k_ranks(config, batch, num_heads, key_bits)
                rotating |= {"RANKS": 1, "TILT": 0}  # (the ranks' counts are zeroed by the rotation launch)
            if _rotates_in_stage1(config, key_bits):
                hadamard_stage1 = Launch(kernel, grid, args, dict(shape, **rotating))
        else:
            kernel = turboquant_sm90.decode_stage1_streams_kernel
            options = turboquant_sm90.launch_options(group, turboquant_sm90.STREAMS_LAUNCH_REGS)
            options["STAGES"] = max(2, config.get("GLUON_STAGES", 0))
        described = DescriptorsByAddress(turboquant_sm90.descriptors)
        stage1 = _DescribedLaunch(Launch(kernel, grid, args, dict(shape, **options)), described, geometry)
        if hadamard_stage1 is not None:
            hadamard_stage1 = _DescribedLaunch(hadamard_stage1, described, geometry)
    elif gluon:  # the sm_90 fast path (triton_impl/turboquant_sm90.py): the same partials, operands built in place
        stage1 = Launch(turboquant_sm90.decode_stage1_kernel, grid, (
            float(scale), num_splits, num_blocks, table_keys, kv_cache.stride(0), *query.stride()[:2],
            *table_2d.stride(), *mid_o.stride()[:3],
        ), dict(shape, STAGES=turboquant_sm90.stages(config.get("GLUON_STAGES", 0), key_bits, value_quant_bits),
                **turboquant_sm90.launch_options(group, config.get("GLUON_MAXNREG"))))  # fmt: skip
    else:
        stage1 = _portable_stage1(config, query, kv_cache, table_2d, mid_o, scale, num_splits, num_kv_heads, block_size,
                                  num_blocks, table_keys, meta_offset, layout, group, head_dim, key_bits,
                                  value_quant_bits, key_fp8, use_pair_lut)  # fmt: skip
    rotate = no_launch
    if not key_fp8:
        pit_strides = rotation.stride() if PiT is not None else rotation.stride()[::-1]
        rotate = rotate_query_launch(query, pit_strides, mid_o, "tf32x3" if config.get("ROTATE_TF32X3") else "ieee",
                                     q_slot)  # fmt: skip
    return make_plan(rotate, stage1, merge_splits_launch(batch, mid_o, output, lse), hadamard_stage1, True,
                     contiguous_lens=seq_lens.shape[0] <= 1 or seq_lens.stride(0) == 1)  # fmt: skip


def _sm90_stage1(config: dict[str, int], query: torch.Tensor, kv_cache: torch.Tensor, layout: dict[str, int],
                 key_bits: int, value_bits: int) -> tuple[bool, bool]:  # fmt: skip
    """Whether a decode's stage 1 runs as a Gluon kernel (``turboquant_sm90.supports``) and whether as one whose
    chunks TMA copies (the one-warp or per-warp-stream kernels, ``turboquant_sm90.streams_supports``)."""
    group = query.shape[1] // kv_cache.shape[2]
    gluon = bool(config.get("GLUON")) and turboquant_sm90.supports(
        device=kv_cache.device, head_dim=query.shape[2], key_bits=key_bits, value_bits=value_bits, group=group,
        block_size=kv_cache.shape[1], stride_block=kv_cache.stride(0), slot_bytes=layout["data_bytes_per_slot"],
        key_bytes=layout["key_data_bytes"],
    )
    tma = gluon and bool(config.get("GLUON_WARP") or config.get("GLUON_STREAMS")) and turboquant_sm90.streams_supports(
        key_bits=key_bits, value_bits=value_bits, group=group, fp16_operands=config.get("FP16_OPERANDS", 0),
        cache_address=kv_cache.data_ptr(), one_warp=bool(config.get("GLUON_WARP")),
    )
    return gluon, tma


def gluon_stage1(query: torch.Tensor, kv_cache: torch.Tensor, key_bits: int, value_quant_bits: int) -> bool:
    """Whether a decode call on these tensors (``key_bits`` 8: FP8 keys) runs its stage 1 as one of sm_90's Gluon
    kernels, under the decode config the cache's device selects: they feed the value codes to the MMA as fp16
    subnormals (``turboquant_sm90._code_halves``), whose rounding ``parity.turboquant.SUBNORMAL_CODES`` bounds."""
    config = select_decode_config(kv_cache.device, key_bits, value_quant_bits)
    layout = _soa_layout(query.shape[2], 0 if key_bits == 8 else key_bits, value_quant_bits, key_bits == 8)
    return _sm90_stage1(config, query, kv_cache, layout, key_bits, value_quant_bits)[0]


def _rotates_in_stage1(config: dict[str, int], key_bits: int) -> bool:
    """Whether a decode entry whose stage 1 runs on the TMA kernels rotates a Hadamard query in it: the one-warp
    kernels under ``HADAMARD_QUERY``, MSE keys."""
    return bool(config.get("GLUON_WARP") and config.get("HADAMARD_QUERY")) and key_bits != 8


def hadamard_query_in_stage1(query: torch.Tensor, kv_cache: torch.Tensor, rotation: torch.Tensor, mse_bits: int,
                             value_quant_bits: int) -> bool:  # fmt: skip
    """Whether a decode call of MSE keys on these tensors rotates its query inside stage 1 instead of by a launch of
    its own: sm_90's one-warp kernels under an entry with ``HADAMARD_QUERY``, for a rotation (``PiT`` or ``Pi``) that
    is ``c H_128`` (``turboquant_sm90.is_hadamard_rotation``). Its rounding is then
    ``parity.turboquant.hadamard_query``'s."""
    config = select_decode_config(kv_cache.device, mse_bits, value_quant_bits)
    if not _rotates_in_stage1(config, mse_bits):
        return False
    layout = _soa_layout(query.shape[2], mse_bits, value_quant_bits, False)
    return _sm90_stage1(config, query, kv_cache, layout, mse_bits, value_quant_bits)[1] and (
        turboquant_sm90.is_hadamard_rotation(rotation))


def rotate_query_launch(query: torch.Tensor, pit_strides: tuple[int, int], mid_o: torch.Tensor,
                        precision: str, slot: int | None = None) -> Launch:  # fmt: skip
    """The decode's first launch (:func:`_rotate_query_kernel`): ``q~ = q @ PiT`` into every split slot of ``mid_o``
    (``[B, H, S, D+1]``, its ``S`` the call's splits), or into slot ``slot`` alone, ``PiT`` read through
    ``pit_strides`` (``Pi``'s swapped); launched as ``launch(stream, query, rotation, mid_o)``."""
    batch, num_heads, head_dim = query.shape
    block_m, block_d = 16, max(32, next_pow2(head_dim))
    d_chunk = min(block_d, 32)  # [BLOCK_D, 32] fp32 of PiT per program: ~32 registers a thread
    return Launch(_rotate_query_kernel, (batch, cdiv(num_heads, block_m), block_d // d_chunk), (
        num_heads, mid_o.shape[2] if slot is None else 1, slot or 0, *query.stride()[:2], *pit_strides,
        *mid_o.stride()[:3],
    ), dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d, D_CHUNK=d_chunk, num_warps=4,
            PRECISION=precision))  # fmt: skip


def _portable_stage1(config, query, kv_cache, table_2d, mid_o, scale, num_splits, num_kv_heads, block_size, num_blocks,
                     table_keys, meta_offset, layout, group, head_dim, key_bits, value_quant_bits, key_fp8,
                     use_pair_lut) -> Launch:  # fmt: skip
    """Stage 1 as the portable Triton kernel: every architecture, the interpreter, every layout."""
    if use_pair_lut is None:
        use_pair_lut = key_bits == 4 and bool(config["PAIR_LUT"])
    # A field whose every 8-code group is one aligned word: 4-bit codes at 4-byte aligned offsets.
    aligned = kv_cache.stride(0) % 4 == 0 and layout["data_bytes_per_slot"] % 4 == 0
    return Launch(_decode_stage1_kernel, (query.shape[0], num_kv_heads, num_splits), (
        float(scale), num_splits, num_kv_heads, block_size, num_blocks, table_keys, kv_cache.stride(0),
        layout["data_bytes_per_slot"], meta_offset,
        *query.stride()[:2],  # read by FP8 keys only; MSE keys read the rotated query from mid_o
        table_2d.stride(0), table_2d.stride(1),
        *mid_o.stride()[:3],
    ), dict(
        KV_GROUP=group,
        HEAD_DIM=head_dim,
        KEY_BITS=key_bits,
        VALUE_BITS=value_quant_bits,
        KEY_DATA_BYTES=layout["key_data_bytes"],
        NUM_FIELDS=layout["num_fields"],
        USE_PAIR_LUT=bool(use_pair_lut),
        SMEM_CODEBOOK=bool(config["SMEM_CODEBOOK"]),
        JOIN_UNPACK=bool(config["JOIN_UNPACK"]),
        GATHER_WORDS=bool(config["GATHER_WORDS"]),
        PREFETCH=config["PREFETCH"],
        FP16_OPERANDS=config.get("FP16_OPERANDS", 0),
        WORD_ALIGNED_KEYS=aligned and key_bits == 4,
        WORD_ALIGNED_VALUES=aligned and value_quant_bits == 4 and layout["key_data_bytes"] % 4 == 0,
        BLOCK_M=max(16, next_pow2(group)),
        BLOCK_N=config["BLOCK_N"],
        BLOCK_D=max(32, next_pow2(head_dim)),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **register_cap(config.get("maxnreg")),
    ))  # fmt: skip
