"""DeepSeek-V4 UE8M0 FP8 paged K cache: insert (quantize) and gather (dequantize), vLLM's signatures.

Twin of ``golden/ue8m0_cache.py``; the module docstring there draws the byte
layout. Both kernels produce the golden model's bytes and bf16 bits exactly; every step that
could round differently between compiled and interpreted Triton is done exactly in both modes:

- the scale exponent ``ceil(log2(amax / fp8_max))`` comes from the bf16 bits of ``amax``
  (``amax = m * 2^E`` and ``fp8_max = M * 2^F`` give ``e = E - F + (m > M)``), not from ``log2``;
- ``x * 2^-e`` multiplies by a power of two built from bits (exact);
- fp32 -> e4m3 goes through ``f32_to_e4m3_bits`` (round to nearest even: the hardware conversion
  for compiled OCP, integer arithmetic under the interpreter and for FNUZ);
- e4m3 -> fp32 is decoded from the byte here (:func:`triton_impl.interpreter.e4m3_bits_to_f32`), so FNUZ caches work on
  every GPU, not only where Triton has ``float8e4b8``;
- bf16 is moved as int16 bits (RoPE is copied bit for bit) and the gathered NoPE value is
  rounded by ``cast_for_store`` (round-to-nearest-even in both modes).

Faster variants of the per-value work, chosen by ``LaunchConfig`` fields (off in the default
entry, all three in the sm90 one; ``benchmarks/sweep_memory_bound.py`` times them against the
defaults). Each gives the same bytes and bf16 bits (NaN as NaN), and the tests run each one:

- ``decode="cvt"``: the gather decodes e4m3 with the hardware OCP conversion plus integer fix-ups
  for FNUZ (:func:`triton_impl.interpreter.e4m3_bits_to_f32_cvt`); ``decode="table"``: one load
  per value from a 256-entry fp32 table of torch's decode, kept per device and format.
- ``fnuz_encode="cvt"``: the FNUZ insert encodes ``2y`` with the hardware OCP conversion, with
  the fix-up for FNUZ's +0 (and, in a tile with a non-finite group, for NaN:
  :func:`triton_impl.interpreter.f32_to_e4m3fnuz_bits_cvt`).
- ``rope_words=True``: the RoPE part is copied as 32 words per token (both kernels), where k,
  ``out`` and the cache keep it 4-byte aligned; bytes elsewhere.

SASS for sm_90 (Triton 3.6, compiled on a CPU by ``benchmarks/sass_sm90_ue8m0.py`` as the bench
launched them before the sm90 entry took 8-token tiles: 4 tokens per program, 4 warps, 16 values per
thread; at 8 tokens the insert counts 201 / 270 per token, OCP / FNUZ): instructions one thread issues
per program (insert) or per gather loop iteration on the common path (live tokens, finite groups),
and per value; no variant spills:

================  ==============================  ================================================
kernel            sm90 entry (cvt, rope_words)    all-integer variant (int, bytes)
================  ==============================  ================================================
insert OCP        230 (14.4), 41 registers        358 (22.4)
insert FNUZ       266 (16.6), 52 registers        880 (55.0)
gather OCP        223 (13.9), 40 registers        637 (39.8)
gather FNUZ       360 (22.5), 45 registers        598 (37.4)
================  ==============================  ================================================

The insert's common path is the saturating hardware conversion alone: a tile whose groups are all
finite needs no clamp and no NaN fix-up, so those run only in a branch taken for a tile with an
inf or NaN group (424 -> 230 OCP, 462 -> 266 FNUZ against the previous per-value fix-ups).

At 8 tokens (the sm90 entry now; registers -> 4-warp blocks per SM): insert OCP 56 -> 9, 201 warp
instructions per token; FNUZ 58 -> 8, 266 (94 registers and 5 blocks before its non-finite branch fixed
up bytes instead of fp32); gather OCP 48 -> 10, 211; FNUZ 48 -> 10, 336. Every global access is as wide
as the record allows: k and the fp8 bytes as 16-byte accesses (each token's 576 data bytes start on a
32-byte sector, 576 = 18 * 32), RoPE as 8-byte accesses (two words per thread), the scale bytes one per
lane (8 per token, in a sector of their own per randomly placed slot).

Loop options (``insert_programs``, ``stages``, ``prefetch_table``; timed in ``UE8M0_GRID``): pipelined
loads cost instructions (insert OCP 4-token tiles, 2 stages: 55 registers, 233 per token; 8 tokens, 2
stages: 72, 220) and the FNUZ gather most (336 -> 436-547 per token).

Fewer instructions is a proxy, not a timing: the table's loads are gathers from a 1 KB table
(up to 8 cache lines per warp-wide load), a cost the instruction count does not see.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_impl.interpreter import (
    cast_for_store,
    e4m3_bits_to_f32,
    e4m3_bits_to_f32_cvt,
    f32_to_e4m3_bits,
    f32_to_e4m3fn_bits_not_nan,
)
from triton_impl.launch import launch, register_cap, select_config
from triton_impl.validation import (
    cdiv,
    check_flag,
    check_int32_lengths,
    check_positive,
    check_tensor,
    content_checks_enabled,
    is_int,
)

_INDEX_DTYPES = (torch.int32, torch.int64)

# The record layout (stated independently of golden/ue8m0_cache.py, which draws it: a kernel that
# shared the golden's constants would hide a wrong constant from the kernel-vs-golden tests).
HEAD_DIM = 512  # bf16 values per token: 448 NoPE + 64 RoPE
RECORD_BYTES = 584  # 576 bytes of token data + 8 scale bytes
_AMAX_FLOOR = 1e-4
_NOPE: tl.constexpr = tl.constexpr(448)  # 448 fp8 bytes, then the RoPE bytes
_GROUP: tl.constexpr = tl.constexpr(64)  # NoPE values per UE8M0 scale
_GROUPS: tl.constexpr = tl.constexpr(7)  # 7 NoPE groups; a token's 8th tile row is its RoPE part
_DATA: tl.constexpr = tl.constexpr(576)  # bytes of token data: 448 fp8 + 64 bf16
_SCALES: tl.constexpr = tl.constexpr(8)  # scale bytes per token: 7 codes and a zero byte


def _fp8_max(use_fnuz: bool) -> float:
    """The e4m3 clamp bound: 448 for OCP ``e4m3fn``; 224 for ``e4m3fnuz``, as vLLM uses."""
    return 224.0 if use_fnuz else 448.0


@dataclass(frozen=True)
class LaunchConfig:
    tokens_per_program: int  # tokens in one tile of ``8 * tokens`` rows (power of two)
    gather_workers: int  # programs per request along grid axis 1; fixed, so CUDA graphs can replay it
    num_warps: int
    # Variants of the per-value work; each gives the same bytes and bf16 bits (tests/test_ue8m0_cache.py
    # runs every one through the exhaustive tests, on the CPU and on the H200). The sm90 entry takes
    # all three; the defaults stay the portable integer code.
    # gather's e4m3 -> fp32: "int" (integer decode, ~12 ops per value), "cvt" (the hardware OCP
    # conversion with integer fix-ups for NaN codes and FNUZ), "branch" ("cvt", but FNUZ skips the
    # fix-ups in a tile without FNUZ's NaN or +-240 codes) or "table" (one load per value from
    # a 256-entry fp32 table, made once per device and format and kept).
    decode: str = "int"
    # FNUZ insert's fp32 -> e4m3fnuz: "int" (integer encoder, ~35 ops per value) or "cvt" (the
    # hardware OCP conversion of 2x with fix-ups for FNUZ's +0 and NaN).
    fnuz_encode: str = "int"
    # RoPE part moved as 32-bit words (one 128-byte copy per token) instead of two byte loads or
    # stores per value, where every record's RoPE bytes are 4-byte aligned (cache address and block
    # stride multiples of 4; k, out rows too); otherwise bytes, as with False.
    rope_words: bool = False
    # Programs of the insert: 0 is one per tile; P > 0 caps the grid at P programs that each loop
    # over every P-th tile (so a pipelined loop has tiles to prefetch).
    insert_programs: int = 0
    # num_stages of both kernels' tile loops: 1 issues a tile's loads at the top of its iteration;
    # S > 1 lets Triton's pipeliner load the next S - 1 tiles into shared memory (cp.async) first.
    stages: int = 1
    # Gather: each iteration loads the next tile's block-table entries before its own arithmetic, so a
    # tile's data loads wait for one memory latency instead of two (table entry, then data).
    prefetch_table: bool = False
    # Tokens per gather tile when not tokens_per_program (0): the two kernels' best tiles may differ.
    gather_tokens: int = 0
    # L2 eviction hints: data read or written once (k, the records' 576 data bytes, the gather's cache
    # reads) evict_first; the insert's scale bytes evict_last, so that the 8 MB of scale sectors per 1M
    # tokens, each written 8 bytes at a time by 4 randomly placed slots, stay in L2 until whole.
    evict: bool = False
    # ptxas register caps (maxnreg; 0: none) of the insert (the FNUZ insert's own where fnuz_insert_max_registers is
    # set) and the gather. sm_90 at 8 tokens, no spill: insert OCP 56 -> 48 registers (10 blocks of 4 warps per SM,
    # from 9), FNUZ 58 -> 56 (9 from 8; 48 spills); gather 48 -> 40 (12 blocks, from 10; OCP 211 -> 216 warp
    # instructions per token). The insert's caps, one call on the H200 (2026-12-04, benchmarks/kernel_times.py, us
    # after a reading flush, two rounds, random / consecutive slots): none OCP 515.7, 515.6 / 433.0, 431.6, FNUZ 539.7,
    # 540.5 / 480.4, 480.0; 48 OCP 503.5, 504.0 / 405.9, 406.0, FNUZ 540.9, 541.5 / 488.3, 489.1; 56 OCP 509.7, 509.5
    # / 416.4, 415.9, FNUZ 525.3, 526.3 / 467.2, 467.4: OCP takes 48, FNUZ 56.
    insert_max_registers: int = 0
    fnuz_insert_max_registers: int = 0
    gather_max_registers: int = 0
    # The FNUZ gather's warps a program and tokens a tile (0: num_warps, and as the OCP gather). Its "branch" decode
    # takes a tile-wide max, a barrier every warp of the program waits at: on the H200 (Nsight Compute, 4 warps, 4
    # tokens) 19% of its warps' samples waited there and 45% on the tile's loads. The gather sweep at 478f09f (1M
    # tokens, 64 x 16K, 40 registers, do_bench): FNUZ 4 warps 4 tokens 0.4771 ms (83.8% of copy BW), 2 warps 2
    # tokens 0.4663 (85.7%), 2 warps 4 tokens 0.8042, 1 warp 1 token 0.5062; OCP at 2 warps 2 tokens 0.4633 against
    # 0.4519 at 4 and 4, so the OCP gather keeps its tile. Then 1024 gather workers a request, not 512 (two sweeps
    # at d81922f: FNUZ 0.4669 / 0.4663 -> 0.4594 / 0.4587 ms, 85.6 -> 87.0%; OCP 0.4518 / 0.4526 -> 0.4523 / 0.4523).
    fnuz_gather_warps: int = 0
    fnuz_gather_tokens: int = 0

    def insert_registers(self, use_fnuz: bool) -> int:
        """The insert's register cap for its format (0: none)."""
        return (use_fnuz and self.fnuz_insert_max_registers) or self.insert_max_registers


# Launch configs as data, keyed by GPU architecture ("sm90", ...). Both kernels move 584 + 1024
# bytes per token. "default" is upstream's launch (one token per program and 4 warps; 128 gather
# workers per request). "sm90" is the best of 16 configs in benchmarks/sweep_memory_bound.py
# (sweep_memory_bound_h200.md, 1M tokens, block 64, 51b8856): 4-token tiles and 512 workers, then
# the three variants together took insert OCP 0.859 -> 0.685 ms (46.8 -> 58.6% of the copy
# bandwidth), FNUZ 1.406 -> 0.773 ms, gather OCP 1.120 -> 0.537 ms (35.7 -> 74.4%), FNUZ gather
# 1.063 -> 0.552 ms; each variant alone gains less (the table's other rows). After the insert's finite
# fast path (6561f01), 8-token tiles on 4 warps (of 4 tile configs, ue8m0 sweep at 0520727): insert OCP
# 0.567 -> 0.522 ms (70.9 -> 76.9%), FNUZ 0.585 -> 0.614, gather OCP 0.536 -> 0.499 (74.5 -> 80.1%), FNUZ
# 0.615 -> 0.584; the FNUZ gather's two-store NaN fill (64.9%, from 71.9%) went back to a select for FNUZ
# (0.556 ms, 71.5%, in the bench at 62cb554). At 04efc58 (FNUZ insert 94 -> 58 registers, the gather's loads
# before its stores), of the 5 best-ranked configs: the FNUZ "branch" decode with 4-token gather tiles, gather OCP
# 0.4650 -> 0.4533 ms (85.9 -> 88.1%), FNUZ 0.5205 -> 0.5121 (76.7 -> 78.0%), inserts unchanged (OCP 76.9%, FNUZ
# 73.8%); register caps (insert 48, gather 40) gave insert OCP 78.8% but a slower gather (the gather's cap came later,
# with its tiles; the insert's per format on 2026-12-04: LaunchConfig.insert_max_registers). The interpreter runs
# programs one after another in Python at ~20 ms each, so it gets 16-token tiles and 2 workers (results do not
# depend on the config; a test checks it).
LAUNCH_CONFIGS: dict[str, LaunchConfig] = {
    "default": LaunchConfig(tokens_per_program=1, gather_workers=128, num_warps=4),
    "sm90": LaunchConfig(
        tokens_per_program=8, gather_workers=1024, num_warps=4, decode="branch", fnuz_encode="cvt", rope_words=True,
        gather_tokens=4, insert_max_registers=48, fnuz_insert_max_registers=56, gather_max_registers=40,
        fnuz_gather_warps=2, fnuz_gather_tokens=2,
    ),
    "interpreter": LaunchConfig(tokens_per_program=16, gather_workers=2, num_warps=1),
}


def select_launch_config(device: torch.device) -> LaunchConfig:
    return select_config(LAUNCH_CONFIGS, device)


@functools.cache
def _exponent_constants(use_fnuz: bool) -> tuple[int, int, int]:
    """(bf16 exponent field of fp8_max, its mantissa field, the UE8M0 exponent of the 1e-4 floor).

    448 -> (135, 0x60) and -22; 224 -> (134, 0x60) and -21.
    """
    bits = int(torch.tensor(_fp8_max(use_fnuz), dtype=torch.bfloat16).view(torch.int16)) & 0x7FFF
    mantissa, exponent = math.frexp(_AMAX_FLOOR / _fp8_max(use_fnuz))  # ceil(log2(1e-4 / fp8_max))
    return bits >> 7, bits & 0x7F, exponent - (mantissa == 0.5)


def _option(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"LaunchConfig.{name}: expected one of {list(allowed)}, got {value!r}")
    return value


def _words_aligned(tensor: torch.Tensor, *byte_strides: int) -> bool:
    """Whether ``tensor``'s address and the given strides (in bytes) are multiples of 4."""
    return tensor.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in byte_strides)


# (device, use_fnuz) -> the 256 fp32 values of the e4m3 bytes, for the "table" decode. Kept for the
# life of the process, so a CUDA graph that captured a gather replays a live address; the first
# gather on a device makes it (so not inside a graph capture).
_DECODE_TABLES: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _decode_table(device: torch.device, use_fnuz: bool) -> torch.Tensor:
    """Each e4m3 byte's value as torch decodes it (``uint8 -> float8_e4m3fn(uz) -> float32``, the
    golden model's decode), on ``device``: exact by construction. The NaN codes hold the quiet NaN
    ``0x7FC00000``, as :func:`e4m3_bits_to_f32` gives them."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, use_fnuz)
    table = _DECODE_TABLES.get(key)
    if table is None:
        fp8 = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).to(torch.float32)
        table = torch.where(table.isnan(), torch.nan, table).to(device)  # NaN as 0x7FC00000 (torch: 0x7F800001 FNUZ)
        _DECODE_TABLES[key] = table
    return table


def _block_view(k_cache: torch.Tensor, block_size: int, device: torch.device) -> torch.Tensor:
    """``k_cache`` (on ``device``) as ``[num_blocks, block bytes]``; each block's bytes must be contiguous."""
    check_tensor("k_cache", k_cache, dtypes=(torch.uint8,), device=device, unit_last_stride=False)
    if k_cache.dim() < 2:
        raise ValueError(f"k_cache: expected [num_blocks, ...] uint8 of rank >= 2, got shape {list(k_cache.shape)}")
    try:
        blocks = k_cache.view(k_cache.shape[0], -1)
    except RuntimeError:
        blocks = None
    if blocks is None or (blocks.shape[1] > 1 and blocks.stride(1) != 1):
        raise ValueError(
            f"k_cache: the bytes of a block must be contiguous (only stride(0) may be padded), "
            f"got shape {list(k_cache.shape)} strides {k_cache.stride()}"
        )
    if blocks.shape[1] < block_size * RECORD_BYTES:
        raise ValueError(
            f"k_cache: a block of block_size={block_size} tokens needs {block_size * RECORD_BYTES} bytes, "
            f"got {blocks.shape[1]}"
        )
    return blocks


# ----------------------------------------------------------------------------------------------
# Insert: quantize bf16 K to UE8M0 FP8 records and write them at their slots.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _slot_record(slot, num_slots, cache_ptr, block_stride, BLOCK_SIZE: tl.constexpr):
    """``(live, data_ptr, scale_ptr)`` of slots (int32 or int64): ``live`` where ``0 <= slot <
    num_slots`` (padding, or a slot outside the cache, is not written); the pointers are slot 0's
    where not live. ``num_slots`` is an int32, so a live slot fits in 32 bits: block and position
    come from unsigned 32-bit arithmetic, and only ``block * block_stride`` is 64-bit (it passes
    2^31 from ~57K blocks of 37440 bytes)."""
    live = (slot >= 0) & (slot < num_slots)
    s = tl.where(live, slot, 0).to(tl.uint32)
    pos = s % BLOCK_SIZE
    block_ptr = cache_ptr + (s // BLOCK_SIZE).to(tl.int64) * block_stride
    return live, block_ptr + pos * _DATA, block_ptr + BLOCK_SIZE * _DATA + pos * _SCALES


@triton.jit
def _insert_tile(tile, k_ptr, k_row_stride, slot_mapping_ptr, num_tokens, num_slots, cache_ptr, block_stride,
                 BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, FNUZ: tl.constexpr, FP8_MAX: tl.constexpr,
                 MAX_EXP_FIELD: tl.constexpr, MAX_MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                 FNUZ_CVT: tl.constexpr, ROPE_WORDS: tl.constexpr, STREAM: tl.constexpr,
                 KEEP: tl.constexpr):  # fmt: skip
    """Tokens ``[tile * TOKENS, (tile + 1) * TOKENS)`` of :func:`_quantize_and_insert_k_kernel`."""
    row = tl.arange(0, 8 * TOKENS)
    dim = tl.arange(0, _GROUP)
    token = tile * TOKENS + row // 8
    group = row % 8
    in_range = token < num_tokens
    slot = tl.load(slot_mapping_ptr + token, mask=in_range, other=-1)
    live, data_ptr, scale_ptr = _slot_record(slot, num_slots, cache_ptr, block_stride, BLOCK_SIZE)

    # k's rows [0, num_tokens) are read whether or not their token is written, so this load does not
    # wait for the slot load (a skipped token's row is read and dropped).
    values_ptr = k_ptr + token.to(tl.int64)[:, None] * k_row_stride + group[:, None] * _GROUP + dim[None, :]
    if ROPE_WORDS:  # group 7 (RoPE) is copied as words below
        bits = tl.load(values_ptr, mask=in_range[:, None] & (group[:, None] < _GROUPS), other=0, eviction_policy=STREAM)
    else:
        bits = tl.load(values_ptr, mask=in_range[:, None], other=0, eviction_policy=STREAM)
    x_bits = bits.to(tl.int32) << 16  # the fp32 bits of the bf16 value (the sign extension shifted out)
    amax_bits = tl.max(x_bits & 0x7FFFFFFF, axis=1) >> 16
    finite = (amax_bits >> 7) != 0xFF
    # amax = m * 2^E, fp8_max = M * 2^F with m, M in [1, 2): ceil(log2(amax / fp8_max)) = E - F + (m > M).
    # Zero and subnormal amax give a very small e that the 1e-4 floor's exponent replaces.
    exponent = (amax_bits >> 7) - MAX_EXP_FIELD + ((amax_bits & 0x7F) > MAX_MANTISSA).to(tl.int32)
    exponent = tl.where(finite, tl.maximum(exponent, MIN_EXPONENT), 0)
    code = tl.where(finite, exponent + 127, 255)
    tl.store(scale_ptr + group, tl.where(group < _GROUPS, code, 0).to(tl.uint8), mask=live, eviction_policy=KEEP)

    x = x_bits.to(tl.float32, bitcast=True)
    is_nope = live[:, None] & (group[:, None] < _GROUPS)
    nope_ptr = data_ptr[:, None] + group[:, None] * _GROUP + dim[None, :]
    if FNUZ and not FNUZ_CVT:
        y = x * ((127 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^-e, exact for e in [-126, 127]
        # A no-op for finite groups (the scale rounds up); clamps inf of a non-finite group. NaN passes.
        y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
        tl.store(nope_ptr, f32_to_e4m3_bits(y, True), mask=is_nope, eviction_policy=STREAM)
    elif tl.min(finite.to(tl.int32)) == 1:
        # Every group of the tile finite: |x * 2^-e| <= fp8_max and no NaN, so the saturating OCP
        # conversion alone is exact (no clamp, no NaN fix-up). FNUZ converts 2 * x * 2^-e (the scale
        # doubled: exact, e >= -22) and writes +0 where that rounds to +-0 (|2y| <= 2^-10; FNUZ has no -0),
        # as f32_to_e4m3fnuz_bits_cvt does. Each branch stores its own bytes (a tile that the two
        # branches joined would be unpacked to bytes first).
        y = x * ((127 + FNUZ - exponent) << 23).to(tl.float32, bitcast=True)[:, None]
        if FNUZ:
            y = tl.where(tl.abs(y) > 0.0009765625, y, 0.0)
        tl.store(nope_ptr, f32_to_e4m3fn_bits_not_nan(y), mask=is_nope, eviction_policy=STREAM)
    else:
        # A group with inf or NaN somewhere in the tile (rare): the exact encoder with its fix-ups,
        # on the values scaled by 2^-e (2^0 in a non-finite group) and clamped to +-fp8_max.
        if FNUZ and FNUZ_CVT:
            # The FNUZ code of clamp(y, +-224) is the OCP code of clamp(2y, +-448) (as in the finite
            # branch), with two fix-ups on the byte: OCP's -0 (0x80: what rounds to zero) is +0, and
            # the NaN codes S.1111.111 (2y is NaN: its scaled magnitude is at most 448 = 0x7E) are
            # FNUZ's NaN 0x80. On the bytes instead of fp32 as in f32_to_e4m3fnuz_bits_cvt: 94 -> 56
            # registers for the whole kernel at 8 tokens (ptxas sized it for this rare branch).
            y = x * ((128 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]
            y = tl.where(y > 2 * FP8_MAX, 2 * FP8_MAX, tl.where(y < -2 * FP8_MAX, -2 * FP8_MAX, y))
            fp8 = f32_to_e4m3fn_bits_not_nan(y)  # NaN: an OCP NaN code under the interpreter and compiled
            fp8 = tl.where((fp8 & 0x7F) == 0x7F, 0x80, tl.where(fp8 == 0x80, 0, fp8)).to(tl.uint8)
            tl.store(nope_ptr, fp8, mask=is_nope, eviction_policy=STREAM)
        else:
            y = x * ((127 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]
            y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
            tl.store(nope_ptr, f32_to_e4m3_bits(y, False), mask=is_nope, eviction_policy=STREAM)

    if ROPE_WORDS:
        t = tile * TOKENS + tl.arange(0, TOKENS)
        word = tl.arange(0, _GROUP // 2)
        t_in_range = t < num_tokens
        t_slot = tl.load(slot_mapping_ptr + t, mask=t_in_range, other=-1)
        t_live, t_data_ptr, _ = _slot_record(t_slot, num_slots, cache_ptr, block_stride, BLOCK_SIZE)
        src = (k_ptr + t.to(tl.int64) * k_row_stride + _NOPE).to(tl.pointer_type(tl.int32))
        dst = (t_data_ptr + _NOPE).to(tl.pointer_type(tl.int32))
        words = tl.load(src[:, None] + word[None, :], mask=t_in_range[:, None], other=0, eviction_policy=STREAM)
        tl.store(dst[:, None] + word[None, :], words, mask=t_live[:, None], eviction_policy=STREAM)
    else:
        is_rope = live[:, None] & (group[:, None] == _GROUPS)
        rope_ptr = data_ptr[:, None] + _NOPE + 2 * dim[None, :]
        tl.store(rope_ptr, (bits & 0xFF).to(tl.uint8), mask=is_rope, eviction_policy=STREAM)
        tl.store(rope_ptr + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=is_rope, eviction_policy=STREAM)


@triton.jit
def _quantize_and_insert_k_kernel(
    k_ptr, k_row_stride,
    slot_mapping_ptr, num_tokens, num_slots,
    cache_ptr, block_stride,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    FNUZ: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAX_EXP_FIELD: tl.constexpr,
    MAX_MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    FNUZ_CVT: tl.constexpr,
    ROPE_WORDS: tl.constexpr,
    LOOP: tl.constexpr,
    STAGES: tl.constexpr,
    STREAM: tl.constexpr,
    KEEP: tl.constexpr,
):  # fmt: skip
    """Grid ``(P,)``: program ``p`` owns tiles ``p, p + P, ...`` of ``TOKENS`` consecutive tokens
    (``P = cdiv(N, TOKENS)`` unless the launch config caps it).

    Its tile has ``8 * TOKENS`` rows of 64 values, row ``8t + g`` being group ``g`` of token ``t``:
    groups 0..6 are NoPE, group 7 is the RoPE part, so one load brings each token's 512 bf16
    values in (as int16 bits) and rows of a token with a negative slot are masked off. Per row it
    takes ``amax`` as the largest magnitude bit pattern (non-negative floats order like their
    bits, and inf/NaN patterns sort above every finite one, so no float max and its NaN rules are
    involved), derives the UE8M0 exponent from those bits, scales by the exact ``2^-e`` and
    encodes e4m3: when every group of the tile is finite with the OCP conversion alone (FNUZ: of
    ``2y``, and +0 for what rounds to zero), else with the exact encoder and its clamp and NaN
    fix-ups. It writes the fp8 bytes (groups 0..6), one scale byte per row (the pad byte for
    group 7) and the RoPE bits as bytes (so any block stride works, odd too). k is read before
    the slots are known (a skipped token's row is read and dropped), so the two loads overlap.

    ``FNUZ_CVT``: FNUZ bytes through the hardware OCP conversion of ``2y`` (as
    ``f32_to_e4m3fnuz_bits_cvt``; the non-finite branch fixes up bytes instead of fp32 values).
    ``STREAM`` / ``KEEP``: the eviction policy of k and the data bytes / of the scale bytes.
    ``ROPE_WORDS`` (the host checked that k's rows and every record's RoPE part are 4-byte
    aligned): group 7 is not loaded in the tile; each token's 64 RoPE values are copied as 32
    words by a ``[TOKENS, 32]`` tile instead.

    ``LOOP``: the grid is capped (``P`` programs) and each program loops over its tiles, with
    ``num_stages=STAGES`` (``STAGES > 1``: Triton's pipeliner loads the next ``STAGES - 1`` tiles into
    shared memory by cp.async before a tile's arithmetic). Without it, one tile per program, no loop
    (the loop costs registers: 56 -> 68 for OCP at 8 tokens).
    """
    if LOOP:
        for tile in tl.range(tl.program_id(0), tl.cdiv(num_tokens, TOKENS), tl.num_programs(0), num_stages=STAGES):
            _insert_tile(tile, k_ptr, k_row_stride, slot_mapping_ptr, num_tokens, num_slots, cache_ptr,
                         block_stride, BLOCK_SIZE, TOKENS, FNUZ, FP8_MAX, MAX_EXP_FIELD, MAX_MANTISSA, MIN_EXPONENT,
                         FNUZ_CVT, ROPE_WORDS, STREAM, KEEP)  # fmt: skip
    else:
        _insert_tile(tl.program_id(0), k_ptr, k_row_stride, slot_mapping_ptr, num_tokens, num_slots, cache_ptr,
                     block_stride, BLOCK_SIZE, TOKENS, FNUZ, FP8_MAX, MAX_EXP_FIELD, MAX_MANTISSA, MIN_EXPONENT,
                     FNUZ_CVT, ROPE_WORDS, STREAM, KEEP)  # fmt: skip


def quantize_and_insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = 64,
    is_ue8m0: bool = True,
    use_fnuz: bool = False,
) -> None:
    """Quantize ``k[:N]`` to UE8M0 FP8 records and write them into the paged cache (vLLM's signature).

    Per group of 64 NoPE values: ``e = ceil(log2(max(amax, 1e-4) / fp8_max))``, e4m3 bytes of
    ``x * 2^-e`` (round to nearest even), code ``e + 127``; RoPE copied bit for bit; layout and
    edge cases as in ``golden.ue8m0_cache`` (twin: ``insert_k_cache``). ``N = slot_mapping.shape[0]``
    (``k`` may have DP-padding rows past it); a negative slot is skipped (upstream skips only -1),
    and so is a slot outside the cache (checked on the device, whatever the content checks say).
    Paper: papers.md#ue8m0-cache.

    Args:
        k: ``[N', 512]`` bf16, ``N' >= N``, unit last stride (any row stride).
        k_cache: uint8 ``[num_blocks, ...]`` (``[nb, bs, 584]`` or ``[nb, block_bytes]``); each
            block's bytes contiguous, only ``stride(0)`` is used; written in place.
        slot_mapping: ``[N]`` int64 (or int32); distinct non-negative slots ``< num_blocks * bs``.
        block_size: tokens per block.
        is_ue8m0: must be True (the only scale format of this cache).
        use_fnuz: write e4m3fnuz bytes with ``fp8_max = 224`` (vLLM's FNUZ bound); works on every
            GPU, the encoder being software.

    Traffic: reads ``1024*N + 8*N`` bytes; writes ``584*N``.
    """
    check_flag("is_ue8m0", is_ue8m0)
    check_flag("use_fnuz", use_fnuz)
    if not is_ue8m0:
        raise ValueError("is_ue8m0: only UE8M0 (power-of-two) scales are supported, got False")
    check_positive("block_size", block_size)
    check_tensor("k", k, ndim=2, dtypes=(torch.bfloat16,))
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected [N, {HEAD_DIM}] (448 NoPE + 64 RoPE), got {list(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_INDEX_DTYPES, device=k.device)
    num_tokens = slot_mapping.shape[0]
    if num_tokens > k.shape[0]:
        raise ValueError(f"slot_mapping: {num_tokens} slots but k has only {k.shape[0]} rows")
    blocks = _block_view(k_cache, block_size, k.device)
    if content_checks_enabled(k.device) and num_tokens:
        slots = slot_mapping[slot_mapping >= 0].to(torch.int64)
        capacity = blocks.shape[0] * block_size
        if slots.numel() and int(slots.max()) >= capacity:
            raise ValueError(f"slot_mapping: slot {int(slots.max())} is past the cache's {capacity} slots")
        if slots.numel() != torch.unique(slots).numel():
            raise ValueError("slot_mapping: non-negative slots must be distinct (two tokens would race for one record)")
    if num_tokens == 0:
        return
    max_exp_field, max_mantissa, min_exponent = _exponent_constants(use_fnuz)
    config = select_launch_config(k.device)
    rope_words = config.rope_words and _words_aligned(k, k.stride(0) * 2) and _words_aligned(blocks, blocks.stride(0))
    tiles = cdiv(num_tokens, config.tokens_per_program)
    launch(_quantize_and_insert_k_kernel, (min(tiles, config.insert_programs or tiles),),
        k.view(torch.int16), k.stride(0),
        slot_mapping, num_tokens, blocks.shape[0] * block_size,
        blocks, blocks.stride(0),
        BLOCK_SIZE=block_size,
        TOKENS=config.tokens_per_program,
        FNUZ=use_fnuz,
        FP8_MAX=_fp8_max(use_fnuz),
        MAX_EXP_FIELD=max_exp_field,
        MAX_MANTISSA=max_mantissa,
        MIN_EXPONENT=min_exponent,
        FNUZ_CVT=_option("fnuz_encode", config.fnuz_encode, ("int", "cvt")) == "cvt",
        ROPE_WORDS=rope_words,
        LOOP=config.insert_programs > 0,
        STAGES=config.stages,
        STREAM="evict_first" if config.evict else "",
        KEEP="evict_last" if config.evict else "",
        num_warps=config.num_warps,
        **register_cap(config.insert_registers(use_fnuz)),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Gather: dequantize each request's last gather_len tokens into a dense bf16 workspace.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_table_entries(i, gather_end, first, req, block_table_ptr, block_table_stride, block_table_cols,
                          BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """For gather tokens ``i`` of request ``req``: the block-table entry of position ``first + i``,
    or -1 where the token has no row in ``out`` (``i >= gather_end``) or no table column."""
    pos = first + i
    col = pos // BLOCK_SIZE
    has_col = (i < gather_end) & (pos >= 0) & (col < block_table_cols)
    return tl.load(block_table_ptr + req * block_table_stride + col, mask=has_col, other=-1)


@triton.jit
def _gather_token_blocks(i, block, gather_end, first, num_blocks, cache_ptr, block_stride, BLOCK_SIZE: tl.constexpr):
    """For gather tokens ``i`` and their ``_gather_table_entries``: ``(in_out, live, pos, block_ptr)``.
    ``in_out``: the token has a row in ``out``; ``live``: its position ``pos = first + i`` has a table
    column whose block lies inside the cache; ``block_ptr``: that block's start (garbage where not ``live``)."""
    live = (block >= 0) & (block < num_blocks)  # an entry of -1 also stands for no row in out or no column
    # int64: block * block_stride passes 2^31 from ~57K blocks of 37440 bytes.
    return i < gather_end, live, first + i, cache_ptr + block.to(tl.int64) * block_stride


@triton.jit
def _dequantize_and_gather_k_kernel(
    out_ptr, out_stride_r, out_stride_t, out_rows,
    cache_ptr, block_stride, num_blocks,
    seq_lens_ptr, gather_lens_ptr,
    block_table_ptr, block_table_stride, block_table_cols,
    offset, table_ptr,
    HAS_GATHER_LENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    FNUZ: tl.constexpr,
    DECODE: tl.constexpr,
    ROPE_WORDS: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    STAGES: tl.constexpr,
    STREAM: tl.constexpr,
):  # fmt: skip
    """Grid ``(R, workers)``: worker ``w`` of request ``r`` owns the tiles of ``TOKENS`` gather
    tokens starting at ``(w + k * workers) * TOKENS``.

    A fixed worker count (not one derived from the lengths) keeps the launch the same for any
    batch, so it can be captured in a CUDA graph. A tile has ``8 * TOKENS`` rows, row ``8t + g``
    being group ``g`` of token ``t`` (group 7: RoPE). Per token it reads the block-table entry
    once, then the token's 448 fp8 bytes, 7 codes and 128 RoPE bytes, and writes its 512 bf16
    values as int16 bits: rows of groups 0..6 dequantized, group 7 the RoPE bits.

    Memory safety without host checks: only rows ``offset + i < out_rows`` are written, and a
    token whose position has no table column (``pos < 0`` or past the table) or whose block lies
    outside the cache is written as NaN (bf16 ``0x7FC0``) without reading the cache.

    ``DECODE`` picks the e4m3 -> fp32 decode: ``"int"`` (:func:`e4m3_bits_to_f32`), ``"cvt"``
    (:func:`e4m3_bits_to_f32_cvt`), ``"branch"`` (``"cvt"``; FNUZ decodes a tile without 0x80 and
    S.1111.111 bytes as OCP times ``scale / 2``) or ``"table"`` (``table_ptr[byte]``, 256 fp32 values).
    ``PREFETCH_TABLE``: the next tile's block-table entries are loaded during this tile's.
    ``ROPE_WORDS`` (the host checked that every record's RoPE part and ``out``'s rows are 4-byte
    aligned): the tile leaves group 7 alone; a ``[TOKENS, 32]`` tile copies each token's RoPE
    part as 32 words (``0x7FC07FC0``, two NaNs, for a token with no valid block).
    """
    req = tl.program_id(0).to(tl.int64)
    worker = tl.program_id(1)
    num_workers = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    if HAS_GATHER_LENS:
        gather_len = tl.load(gather_lens_ptr + req).to(tl.int32)
    else:
        gather_len = seq_len
    first = seq_len - gather_len

    row = tl.arange(0, 8 * TOKENS)
    dim = tl.arange(0, _GROUP)
    group = row % 8
    gather_end = tl.minimum(gather_len, out_rows - offset)  # rows past the end of out are not written
    step = num_workers * TOKENS
    t = worker * TOKENS + tl.arange(0, TOKENS)
    if PREFETCH_TABLE:  # the first tile's entries; each iteration loads the next tile's
        block = _gather_table_entries(worker * TOKENS + row // 8, gather_end, first, req, block_table_ptr,
                                      block_table_stride, block_table_cols, BLOCK_SIZE)  # fmt: skip
        t_block = _gather_table_entries(t, gather_end, first, req, block_table_ptr, block_table_stride,
                                        block_table_cols, BLOCK_SIZE)  # fmt: skip
    else:
        block = tl.full([8 * TOKENS], -1, block_table_ptr.dtype.element_ty)
        t_block = tl.full([TOKENS], -1, block_table_ptr.dtype.element_ty)
    for start in tl.range(worker * TOKENS, gather_end, step, num_stages=STAGES):
        i = start + row // 8
        t = start + tl.arange(0, TOKENS)
        if not PREFETCH_TABLE:
            block = _gather_table_entries(i, gather_end, first, req, block_table_ptr, block_table_stride,
                                          block_table_cols, BLOCK_SIZE)  # fmt: skip
            t_block = _gather_table_entries(t, gather_end, first, req, block_table_ptr, block_table_stride,
                                            block_table_cols, BLOCK_SIZE)  # fmt: skip
        in_out, live, pos, block_ptr = _gather_token_blocks(i, block, gather_end, first, num_blocks, cache_ptr,
                                                            block_stride, BLOCK_SIZE)  # fmt: skip
        data_ptr = block_ptr + (pos % BLOCK_SIZE) * _DATA
        scale_ptr = block_ptr + BLOCK_SIZE * _DATA + (pos % BLOCK_SIZE) * _SCALES
        is_nope = live & (group < _GROUPS)
        is_rope = live & (group == _GROUPS)

        fp8 = tl.load(data_ptr[:, None] + group[:, None] * _GROUP + dim[None, :], mask=is_nope[:, None], other=0,
                      eviction_policy=STREAM)
        code = tl.load(scale_ptr + group, mask=is_nope, other=127).to(tl.int32)
        if ROPE_WORDS:  # the RoPE words are loaded with the tile, before its stores (which a later load waits behind)
            word = tl.arange(0, _GROUP // 2)
            t_in_out, t_live, t_pos, t_block_ptr = _gather_token_blocks(
                t, t_block, gather_end, first, num_blocks, cache_ptr, block_stride, BLOCK_SIZE)  # fmt: skip
            src = (t_block_ptr + (t_pos % BLOCK_SIZE) * _DATA + _NOPE).to(tl.pointer_type(tl.int32))
            words = tl.load(src[:, None] + word[None, :], mask=t_live[:, None], other=0x7FC07FC0,
                            eviction_policy=STREAM)
        if PREFETCH_TABLE:  # the next tile's entries, loaded while this tile's data is in flight
            block = _gather_table_entries(i + step, gather_end, first, req, block_table_ptr, block_table_stride,
                                          block_table_cols, BLOCK_SIZE)  # fmt: skip
            t_block = _gather_table_entries(t + step, gather_end, first, req, block_table_ptr, block_table_stride,
                                            block_table_cols, BLOCK_SIZE)  # fmt: skip
        # 2^(code - 127) from bits: for code 1..254 the code is the fp32 exponent field; code 0 is
        # the subnormal 2^-127; code 255 is E8M0's NaN. The product has <= 4 significant bits and is
        # >= 2^-136, so fp32 holds it exactly; for codes < 10 it is subnormal. Compiled Triton on
        # NVIDIA keeps subnormals in a plain fp32 multiply and in the bf16 conversion (its FTZ
        # setting reaches only libdevice calls), so the bits equal the golden model's:
        # tests/test_ue8m0_cache.py::test_gather_decodes_every_byte_at_every_code checks every pair.
        scale_bits = tl.where(code == 0, 0x00400000, code << 23)
        scale = tl.where(code == 255, 0x7FC00000, scale_bits).to(tl.float32, bitcast=True)
        if DECODE == "table":
            nope = tl.load(table_ptr + fp8) * scale[:, None]
        elif DECODE == "branch" and FNUZ:
            # A FNUZ code's value is half its OCP value except at 0x80 (NaN; OCP's -0) and S.1111.111
            # (+-240; OCP's NaN). A tile without those (the insert writes neither for finite groups)
            # decodes as OCP times scale / 2 (exact: the product has <= 4 significant bits and is
            # >= 2^-137); else every value takes the fix-ups. sm_90: 336 -> 244 warp instructions per
            # token, but 48 -> 80 registers (ptxas sizes the kernel for the branch).
            ocp = e4m3_bits_to_f32_cvt(fp8, False, False)
            odd = (ocp.to(tl.int32, bitcast=True) == -0x80000000) | (ocp != ocp)
            if tl.max(odd.to(tl.int32)) == 0:
                nope = ocp * (scale * 0.5)[:, None]
            else:
                nope = e4m3_bits_to_f32_cvt(fp8, True, False) * scale[:, None]
        elif DECODE != "int":  # "cvt", and "branch" for OCP; NaN codes give a NaN, its payload free
            nope = e4m3_bits_to_f32_cvt(fp8, FNUZ, False) * scale[:, None]
        else:
            nope = e4m3_bits_to_f32(fp8, FNUZ) * scale[:, None]
        nope_bits = cast_for_store(nope, tl.bfloat16).to(tl.int16, bitcast=True)
        out_row = out_ptr + req * out_stride_r + (offset + i).to(tl.int64) * out_stride_t

        if ROPE_WORDS:
            out_ptr_tile = out_row[:, None] + group[:, None] * _GROUP + dim[None, :]
            is_out = in_out[:, None] & (group[:, None] < _GROUPS)
            no_block = tl.full([8 * TOKENS, _GROUP], 0x7FC0, tl.int16)  # bf16 NaN: a token without a block
            if FNUZ:  # a select per value: two stores cost FNUZ registers, 71.9% -> 64.9% of copy BW
                tl.store(out_ptr_tile, tl.where(live[:, None], nope_bits, no_block), mask=is_out)
            else:  # two stores instead of a select per value: valid rows, then the rows without a block
                tl.store(out_ptr_tile, nope_bits, mask=is_out & live[:, None])
                tl.store(out_ptr_tile, no_block, mask=is_out & (live[:, None] == 0))
            dst = out_ptr + req * out_stride_r + (offset + t).to(tl.int64) * out_stride_t + _NOPE
            dst = dst.to(tl.pointer_type(tl.int32))
            tl.store(dst[:, None] + word[None, :], words, mask=t_in_out[:, None])
        else:
            rope_ptr = data_ptr[:, None] + _NOPE + 2 * dim[None, :]
            rope_lo = tl.load(rope_ptr, mask=is_rope[:, None], other=0).to(tl.int32)
            rope_hi = tl.load(rope_ptr + 1, mask=is_rope[:, None], other=0).to(tl.int32)
            rope_bits = (rope_lo | (rope_hi << 8)).to(tl.int16)

            values = tl.where(is_rope[:, None], rope_bits, nope_bits)
            values = tl.where(live[:, None], values, tl.full([1, 1], 0x7FC0, tl.int16))  # NaN: no valid block
            tl.store(out_row[:, None] + group[:, None] * _GROUP + dim[None, :], values, mask=in_out[:, None])


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
) -> None:
    """Dequantize request ``r``'s last ``gl`` tokens into ``out[r, offset : offset + gl]`` (vLLM's signature).

    ``gl = gather_lens[r]`` (``seq_lens[r]`` when None); gather token ``i`` is position
    ``seq_lens[r] - gl + i`` at block ``block_table[r, pos // bs]``. NoPE = ``e4m3 * 2^(code - 127)``
    rounded to bf16 (exact except overflow; code 255 gives NaN), RoPE copied bit for bit. Other
    rows of ``out`` are untouched. Without the content checks, bad contents stay memory-safe: a
    token with no valid block (a negative position, a column past the table, a block outside the
    cache) is written as NaN, and rows past the end of ``out`` are not written.
    Twin: ``golden.ue8m0_cache.gather_k_cache``. Paper: papers.md#ue8m0-cache.

    Args:
        out: ``[R, T, 512]`` bf16, unit last stride (any other strides), written in place.
        k_cache: uint8 ``[num_blocks, ...]`` as for :func:`quantize_and_insert_k_cache`.
        seq_lens: ``[R]`` int32 (or int64).
        gather_lens: ``[R]`` int32 (or int64), ``0 <= gl <= seq_len``, or None.
        block_table: ``[R', Bmax]`` int32 (or int64), ``R' >= R``; any row stride (a column slice
            of a wider table works); only the entries covering the gathered positions are read.
        block_size: tokens per block.
        offset: first row of ``out`` to write; ``offset + gl <= T``.
        use_fnuz: the cache holds e4m3fnuz bytes (must match the encoder that wrote it).

    Traffic: reads ``584*G + 4*G/bs`` bytes (``G = sum gl``); writes ``1024*G``.
    """
    check_positive("block_size", block_size)
    check_tensor("out", out, ndim=3, dtypes=(torch.bfloat16,))
    if out.shape[2] != HEAD_DIM:
        raise ValueError(f"out: expected [R, T, {HEAD_DIM}], got {list(out.shape)}")
    num_reqs = out.shape[0]
    check_tensor("seq_lens", seq_lens, shape=(num_reqs,), dtypes=_INDEX_DTYPES, device=out.device)
    if gather_lens is not None:
        check_tensor("gather_lens", gather_lens, shape=(num_reqs,), dtypes=_INDEX_DTYPES, device=out.device)
    check_tensor("block_table", block_table, ndim=2, dtypes=_INDEX_DTYPES, device=out.device)
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table: expected >= {num_reqs} rows (one per request), got {block_table.shape[0]}")
    check_flag("use_fnuz", use_fnuz)
    if not is_int(offset) or offset < 0:
        raise ValueError(f"offset: expected a non-negative int, got {offset!r}")
    blocks = _block_view(k_cache, block_size, out.device)
    if content_checks_enabled(out.device) and num_reqs:
        _check_gather_contents(out, blocks.shape[0], seq_lens, gather_lens, block_table, block_size, offset)
    if num_reqs == 0:
        return
    config = select_launch_config(out.device)
    decode = _option("decode", config.decode, ("int", "cvt", "branch", "table"))
    rope_words = config.rope_words and _words_aligned(blocks, blocks.stride(0))
    rope_words = rope_words and _words_aligned(out, out.stride(0) * 2, out.stride(1) * 2)
    launch(_dequantize_and_gather_k_kernel, (num_reqs, config.gather_workers),
        out.view(torch.int16), out.stride(0), out.stride(1), out.shape[1],
        blocks, blocks.stride(0), blocks.shape[0],
        seq_lens, seq_lens if gather_lens is None else gather_lens,
        block_table, block_table.stride(0), block_table.shape[1],
        offset, _decode_table(out.device, use_fnuz) if decode == "table" else blocks,
        HAS_GATHER_LENS=gather_lens is not None,
        BLOCK_SIZE=block_size,
        TOKENS=(use_fnuz and config.fnuz_gather_tokens) or config.gather_tokens or config.tokens_per_program,
        FNUZ=use_fnuz,
        DECODE=decode,
        ROPE_WORDS=rope_words,
        PREFETCH_TABLE=config.prefetch_table,
        STAGES=config.stages,
        STREAM="evict_first" if config.evict else "",
        num_warps=(use_fnuz and config.fnuz_gather_warps) or config.num_warps,
        **register_cap(config.gather_max_registers),
    )  # fmt: skip


def _check_gather_contents(
    out: torch.Tensor,
    num_blocks: int,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """Lengths in range, and the block-table entries that cover gathered positions address a block."""
    check_int32_lengths("seq_lens", seq_lens)
    if gather_lens is not None:
        check_int32_lengths("gather_lens", gather_lens)
    seq = seq_lens.to(torch.int64).cpu()
    lens = seq if gather_lens is None else gather_lens.to(torch.int64).cpu()
    if bool((seq < 0).any()):
        raise ValueError(f"seq_lens: expected >= 0, got {seq.tolist()}")
    if bool(((lens < 0) | (lens > seq)).any()):
        raise ValueError(f"gather_lens: expected 0 <= gather_len <= seq_len, got {lens.tolist()} for {seq.tolist()}")
    if int(lens.max()) + offset > out.shape[1]:
        raise ValueError(f"out: offset {offset} + gather_len {int(lens.max())} is past its {out.shape[1]} rows")
    table = block_table[: seq.shape[0]].to(torch.int64).cpu()
    cols = torch.arange(table.shape[1])
    first_col = (seq - lens) // block_size
    end_col = (seq + block_size - 1) // block_size
    if int(end_col.max()) > table.shape[1]:
        raise ValueError(f"block_table: a request needs {int(end_col.max())} blocks but the table has {table.shape[1]}")
    read = (cols >= first_col[:, None]) & (cols < end_col[:, None]) & (lens[:, None] > 0)
    bad = read & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table: entry [{row}, {col}] = {int(table[row, col])} is outside the cache's {num_blocks} blocks"
        )
