"""Causal MLA verify attention: split-KV over a paged latent cache, one K/V load per request tile.

Twin of ``golden/mla_verify.py``, with vLLM's signatures
(``vllm.v1.attention.ops.triton_decode_attention``): ``decode_attention_fwd_verify``,
``verify_row_blocks``, ``select_verify_config``, ``verify_num_kv_splits``,
``warmup_decode_attention_fwd_verify`` and ``_storage_view``.

Speculative decoding verifies ``Q`` tokens of every request at once, and all ``Q*H`` (token, head)
rows of a request read the same latent keys. The per-row decode kernel loads every K/V tile once
per row; here one program owns ``BLOCK_H`` (token, head) rows of one request and one split, so a
tile is loaded once per row *block* and feeds two tensor-core products (``QK^T`` and ``PV``).
Stage 2 is the package's split merge, ``triton_impl.lse_merge.merge_splits``. Where a row block holds one
draft token, that saves nothing, and some configs (``FP8_VIA_DECODE``) run decode's stage 1 instead, each row
seeing its token's causal prefix (``decode_attention.portable_stage1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from triton_impl import decode_attention_sm90
from triton_impl.block_table import first_bad_key
from triton_impl.decode_attention import (
    DECODE_CONFIGS,
    _plan_decode,
    descriptor_tile,
    portable_stage1,
    tma_descriptors,
    tma_layout,
)
from triton_impl.interpreter import INTERPRETING, cast_for_store, dot_dtype
from triton_impl.launch import DescriptorsByAddress, Launch, Plans, current_target, device_arch, no_launch
from triton_impl.lse_merge import bf16_partials, merge_splits_launch, partial_values
from triton_impl.validation import (
    block_table_2d,
    cdiv,
    check_block_table,
    check_float,
    check_int32_lengths,
    check_lengths,
    check_positive,
    check_power_of_two,
    check_scale,
    check_split_workspace,
    check_tensor,
    content_checks_enabled,
    content_checks_on,
    next_pow2,
    tensor_facts,
)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_Q_DTYPES = (torch.bfloat16, torch.float16)
_FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

# ----------------------------------------------------------------------------------------------
# Launch configs: data, keyed by GPU architecture, chosen by select_verify_config.
# ----------------------------------------------------------------------------------------------

# B * qlen * H at or below this many rows takes the small config (the seed's rule, 640 rows), per architecture.
# sm_90: never. With the split count verify_num_kv_splits gives each tile (block_h = its BLOCK_H), the 64-row
# tile was faster at every bench shape on the H200 (benchmarks/sweep_verify.py 120 splits at b4b01fc,
# sweep_verify_h200.md), the smallest one included: B=8 qlen=4 H=16 L=4K, 512 rows, 36.2 us (S=16) against
# 43.8 us for the 32-row tile (S=8), both 128 programs, the 64-row tile's with twice the warps.
_VERIFY_SMALL_MAX_ROWS: dict[str, int] = {"sm90": 0, "default": 640, "interpreter": 640}

# Keys every config has. BLOCK_H: (token, head) rows per program; BLOCK_N: keys per tile;
# SPLIT_ALIGN / MIN_SPLIT_LEN: split chunks are multiples of SPLIT_ALIGN and at least MIN_SPLIT_LEN
# keys (a multiple of SPLIT_ALIGN), so a split is never a sliver not worth its launch slot;
# SPLIT_LATENT: hold the latent part of Q, K and the accumulator as two halves (bounds the live
# tile sizes; the decode kernel's config key of the same name does the same); TMA: load whole tiles by
# tensor descriptors where the cache allows (the decode kernel's key of the same name).
VERIFY_DEFAULT_CONFIG: dict[str, Any] = {
    "BLOCK_N": 32,
    "BLOCK_H": 32,
    "SPLIT_ALIGN": 64,
    "MIN_SPLIT_LEN": 256,
    "SPLIT_LATENT": False,
    "TMA": False,
    "GLUON": False,
    "num_warps": 4,
    "num_stages": 2,
}

# Per architecture: overrides of VERIFY_DEFAULT_CONFIG for few rows ("small") and many ("large").
# - "sm90" (Hopper: H100/H200): from the sweeps in notebooks/results/sweep_verify_h200.md on one
#   H200 (Triton 3.6, bf16, Lk 576 / Lv 512, page 64, CUDA-graph timing, 15 configs x 5 shapes),
#   as % of max(FLOPs / 790 TFLOP/s, unique bytes / 4.3 TB/s); SL = SPLIT_LATENT (``qs1`` in the
#   sweep file, which was measured when the key was called QSPLIT):
#     B=8  qlen=4 H=16  L=4096 ( 512 rows):  BH32 BN64 w4 SL  20.6% (S=8);  BH16 BN32 w4     13.8%
#     B=64 qlen=2 H=16  L=4096 (2048 rows):  BH32 BN32 w4 SL  52.5% (S=4);  BH64 BN64 w8 SL  43.7%
#     B=32 qlen=4 H=16  L=4096 (2048 rows):  BH64 BN64 w8 SL  37.3% (S=4);  BH32 BN32 w4 SL  27.9%
#     B=8  qlen=4 H=128 L=4096 (4096 rows):  BH64 BN64 w8 SL  27.4% (S=2);  BH32 BN32 w4 SL  20.0%
#     B=64 qlen=1 H=128 L=2048 (8192 rows):  BH64 BN64 w8 SL  29.6% (S=1, 3 stages; 28.7% with 2)
#   SPLIT_LATENT won in every shape; BH64 without it failed to compile at BN64 (the sweep file records a
#   CompilationError for each such config, no cause) and was slower at BN32. At the verify target's
#   shape (B=32 qlen=4 H=128 L=32K) the large config is the best of six:
#   4.70 ms (BN32 6.51 ms; 3 stages 6.95 ms). Since whole-tile loads (TMA) the 64-row tile also wins at 512
#   rows, so sm_90 no longer takes the small config by row count (_VERIFY_SMALL_MAX_ROWS). SASS: large 80
#   HGMMA, small 272 HMMA (notebooks/results/sass_sm90.md). 27.8% of roofline (geomean, bench_h200.md) against the
#   80% target: notebooks/results/perf_log.md says what bounds it.
#   GLUON: a 16-bit or FP8 cache at DeepSeek's widths, pages of 64n keys and >= 32 rows a request runs the Gluon
#   stage 1 of triton_impl/decode_attention_sm90.py (same split rule and partials): B=16 qlen=8 H=128 0.5136 ->
#   0.2657 ms,
#   B=8 qlen=4 H=128 0.1533 -> 0.0862, B=64 qlen=1 H=128 0.1440 -> 0.0859, B=32 qlen=4 H=16 0.0902 -> 0.0640,
#   B=8 qlen=4 H=16 0.0362 -> 0.0255, B=64 qlen=2 H=16 0.1526 -> 0.1007 (bench_h200.md: the portable kernel at
#   580e9fc, 35e837f for B=64 qlen=2, against 72fbe8a).
#   FP8_VIA_DECODE (where GLUON does not serve): an FP8 cache whose verify tiles hold one draft token each (heads a
#   multiple of BLOCK_H) runs decode's stage 1 with per-token lengths (_via_decode): where a tile holds one token
#   both kernels read the same bytes: B=32 H=128 qlen=2 L=8K 0.8114 -> 0.7510 ms (bench_h200.md, 72fbe8a ->
#   c7e2fb0; the flattened per-row decode 0.753 in the same run).
#   FEW_ROWS_VIA_DECODE: one draft token (qlen 1, no real_seq_lens) at 16 heads or fewer is a decode call, and runs
#   as one where decode's sm90 entry takes it to decode_attention_sm90.mla_decode_few_rows_kernel (the keys as wgmma's
#   M, every head from one read of each key) instead of a 64-row verify tile three-quarters empty: B=32 H=16 qlen=1
#   L=32K 0.5403 ms through the portable verify kernel (53.0% of the copy roofline) -> 0.2841 ms (99.4%;
#   benchmarks/verify_qlen.py at 04c9edb and ed2f980).
#   LEAN_SOFTMAX: the Gluon stage 1's lean softmax (decode_attention.py's DECODE_CONFIGS comment says what it does
#   and its counts and timings): verify B=32 H=128 qlen 4 L=32K stage 1 1871.6 -> 1821.7 us on the H200.
#   RESCALE_IF_GREW: the value warpgroup skips its rescale where no row's max grew (decode_attention.py's
#   DECODE_CONFIGS comment): verify B=32 H=128 qlen 4 L=32K stage 1 1811.2 -> 1771.0 us on the H200.
# - "default": any other GPU; the same shapes, untuned.
# - "interpreter": TRITON_INTERPRET=1 on a CPU, where a tile's cost is NumPy work: small tiles
#   and short splits keep tests fast and exercise many splits on short sequences.
VERIFY_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sm90": {
        "small": {
            "BLOCK_N": 64,
            "BLOCK_H": 32,
            "SPLIT_ALIGN": 64,
            "MIN_SPLIT_LEN": 128,
            "SPLIT_LATENT": True,
            "num_warps": 4,
            "num_stages": 2,
        },
        "large": {
            "BLOCK_N": 64,
            "BLOCK_H": 64,
            "SPLIT_ALIGN": 64,
            "MIN_SPLIT_LEN": 256,
            "SPLIT_LATENT": True,
            "TMA": True,
            "GLUON": True,
            "LEAN_SOFTMAX": True,
            "RESCALE_IF_GREW": True,
            "FP8_VIA_DECODE": True,
            "FEW_ROWS_VIA_DECODE": True,
            "num_warps": 8,
            "num_stages": 2,
        },
    },
    "default": {
        "small": {"SPLIT_LATENT": True},
        "large": {"BLOCK_H": 64, "SPLIT_LATENT": True, "num_warps": 8},
    },
    "interpreter": {
        "small": {"BLOCK_N": 16, "BLOCK_H": 16, "SPLIT_ALIGN": 16, "MIN_SPLIT_LEN": 16, "num_stages": 1},
        "large": {
            "BLOCK_N": 16,
            "BLOCK_H": 32,
            "SPLIT_ALIGN": 16,
            "MIN_SPLIT_LEN": 32,
            "SPLIT_LATENT": True,
            "num_stages": 1,
        },
    },
}


def verify_arch() -> str:
    """The ``VERIFY_CONFIGS`` key of the current device: ``"interpreter"``, ``"sm90"`` or ``"default"``."""
    device = torch.device("cuda") if not INTERPRETING and torch.cuda.is_available() else torch.device("cpu")
    arch = device_arch(device)
    return arch if arch in VERIFY_CONFIGS else "default"


def select_verify_config(batch: int, qlen: int, num_heads: int, *, arch: str | None = None) -> dict[str, Any]:
    """Launch config for this batch on the current architecture (or on ``arch``, a ``VERIFY_CONFIGS`` key).

    Few rows (``B * qlen * H <= 640``; on sm_90 none, see ``_VERIFY_SMALL_MAX_ROWS``): 32-row tiles, so more
    programs (and KV splits) fill the GPU. Otherwise 64-row tiles (the latent in two 256-wide halves) halve
    the K/V re-reads per request. Configs are data: ``VERIFY_DEFAULT_CONFIG`` overlaid with ``VERIFY_CONFIGS[arch]``.
    """
    arch = arch or verify_arch()
    size = "small" if batch * qlen * num_heads <= _VERIFY_SMALL_MAX_ROWS[arch] else "large"
    return {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS[arch][size]}


def verify_row_blocks(qlen: int, num_heads: int, block_h: int) -> int:
    """Programs per (request, split): ``cdiv(qlen * H, BLOCK_H)`` tiles of (token, head) rows."""
    return cdiv(qlen * num_heads, block_h)


def verify_num_kv_splits(
    max_seq_len: int,
    batch: int,
    qlen: int,
    num_heads: int,
    sm_count: int,
    block_h: int = VERIFY_DEFAULT_CONFIG["BLOCK_H"],
    occupancy: float = 1.0,
    min_work_per_split: int = 64,
    max_splits: int = 8,
) -> int:
    """Static upper bound on KV splits (safe to bake into a cudagraph); the seed's formula exactly.

    The kernel splits each request's own length into ``max(cdiv(L, splits), MIN_SPLIT_LEN)``
    chunks, so this only caps the split count. ``occupancy`` is the number of resident stage-1
    programs per SM. If one split of every request fits in a single dispatch round, use as many
    splits as fit in that round (``max_splits`` does not apply there); otherwise pick
    ``n <= max_splits`` minimising ``rounds(n) / n`` (the idle tail of the last round), preferring
    fewer splits within 5% of the best. Always ``<= cdiv(max_seq_len, min_work_per_split)`` and
    ``<= 2 * sm_count``.

    Pass the launch's tile, ``block_h=select_verify_config(batch, qlen, num_heads)["BLOCK_H"]``: the
    default (32 rows, the seed's) counts twice the programs the sm_90 64-row tile launches, so the GPU
    runs half full (H200, B=8 qlen=4 H=128 L=4K: 1 split and 255.5 us against 2 splits and 149.0 us,
    ``benchmarks/sweep_verify.py 120 splits``).
    """
    programs_per_split = max(1, batch) * verify_row_blocks(qlen, num_heads, block_h)
    ideal = cdiv(max(1, max_seq_len), max(1, min_work_per_split))
    slots = max(1, int(occupancy * sm_count))
    if programs_per_split <= slots:
        n = slots // programs_per_split
    else:
        cost = [(cdiv(n * programs_per_split, slots) / n, n) for n in range(1, max(1, min(ideal, max_splits)) + 1)]
        best = min(c for c, _ in cost)
        n = min(n for c, n in cost if c <= best * 1.05)
    return max(1, min(ideal, n, sm_count * 2))


def _storage_view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Contiguous ``shape`` over ``t``'s storage, or a new tensor if too small."""
    if math.prod(shape) > t.untyped_storage().nbytes() // t.element_size():
        return t.new_empty(shape)
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return torch.as_strided(t, shape, strides, 0)


def _page_stride(k_buffer: torch.Tensor, page_size: int) -> int:
    """Elements between pages, read from the tensor (a cross-layer view's is larger than
    ``page_size * token_stride``); a 3-D token-major buffer is viewed as pages first."""
    if k_buffer.dim() == 3:
        return page_size * k_buffer.stride(0)
    return k_buffer.stride(0)


# ----------------------------------------------------------------------------------------------
# Stage 1.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _verify_tile(q0, q1, q_pe, k0, k1, k_pe, seen, m_i, l_i, acc0, acc1, qk_scale, SPLIT_LATENT: tl.constexpr,
                 BLOCK_DPE: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax (base 2) for rows whose keys are ``seen``; a row with no
    key yet stays ``(0, -inf)``."""
    qk = tl.dot(q0, tl.trans(k0))
    if SPLIT_LATENT:
        qk += tl.dot(q1, tl.trans(k1))
    if BLOCK_DPE > 0:
        qk += tl.dot(q_pe, tl.trans(k_pe))
    qk = tl.where(seen, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_dot = p.to(DOT_DTYPE)
    acc0 = acc0 * alpha[:, None] + tl.dot(p_dot, k0)
    if SPLIT_LATENT:
        acc1 = acc1 * alpha[:, None] + tl.dot(p_dot, k1)
    return m_new, l_i, acc0, acc1


@triton.jit
def _verify_gather(k_ptr, table_row, stride_t_p, num_pages, stride_k_page, stride_k_tok, offs_n, key_ok, offs_d0,
                   offs_d1, offs_pe, pe_ok, PAGE_SIZE: tl.constexpr, SPLIT_LATENT: tl.constexpr,
                   BLOCK_DPE: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Keys ``offs_n`` addressed one by one through the block table: ``(k0, k1, k_pe)``, zeros where
    not ``key_ok`` (unused pieces repeat ``k0``)."""
    page = tl.load(table_row + (offs_n // PAGE_SIZE) * stride_t_p, mask=key_ok, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # in the cache; rows that see a bad one: NaN
    k_rows = k_ptr + page * stride_k_page + (offs_n % PAGE_SIZE) * stride_k_tok
    k0 = tl.load(k_rows[:, None] + offs_d0[None, :], mask=key_ok[:, None], other=0.0).to(DOT_DTYPE)
    k1 = k0
    if SPLIT_LATENT:
        k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=key_ok[:, None], other=0.0).to(DOT_DTYPE)
    k_pe = k0
    if BLOCK_DPE > 0:
        k_pe = tl.load(k_rows[:, None] + offs_pe[None, :], mask=key_ok[:, None] & pe_ok[None, :], other=0.0)
        k_pe = k_pe.to(DOT_DTYPE)
    return k0, k1, k_pe


@triton.jit
def _fwd_verify_kernel_stage1(
    q_ptr, k_ptr, sm_scale_log2, table_ptr, seq_lens_ptr, real_seq_lens_ptr, part_ptr, o_ptr, lse_ptr, k_scale_ptr,
    lat_desc, pe_desc,
    num_pages, table_keys, stride_sl, stride_rl,
    stride_t_b, stride_t_p, stride_q_r, stride_q_h, stride_k_page, stride_k_tok,
    stride_p_r, stride_p_h, stride_p_s, stride_o_r, stride_o_h, stride_lse_r, stride_lse_h,
    QLEN: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HAS_REAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    SPLIT_LATENT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    BF16_PARTIALS: tl.constexpr,
    IS_FP8: tl.constexpr,
    TMA: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Grid ``(B * S * cdiv(Q*H, BLOCK_H),)``; program ``pid = (b*S + s) * row_blocks + rb``.

    A program owns ``BLOCK_H`` (token, head) rows ``i = rb*BLOCK_H + m`` of request ``b``
    (``t = i // H``, ``h = i % H``: a tile is whole verify tokens when ``H >= BLOCK_H``, and its
    queries are contiguous) and split ``s``. It keeps its queries in registers, walks the split's
    keys in ``BLOCK_N`` tiles up to the largest row limit in the tile, and loads each K tile once
    for all its rows: ``QK^T`` over the ``Lk`` columns and ``PV`` with ``V`` = the tile's first
    ``Lv`` columns (no second load). Row blocks of one (request, split) are adjacent in ``pid`` so
    they run together and share the tile through L2. Softmax is online in base 2
    (``sm_scale * log2 e`` folded into one multiply; an FP8 cache's scalar ``k_scale`` folds into
    the same multiply and into the output). Every row writes its split slot, an empty one as
    ``(0, -inf)`` with a natural-log LSE, so stage 2 needs no boundaries; with one split
    (``SINGLE_SPLIT``) the result goes to ``o``/``lse`` directly. ``BF16_PARTIALS``: the partial outputs are
    stored in bf16 (``lse_merge.partial_values``).

    Names as in the decode kernel (``decode_attention._decode_stage1_kernel``): ``LK``/``LV`` are
    the key and value widths (the value is the latent, the key's first ``LV`` columns); ``BLOCK_D``
    the latent tile's width (``LV``, a power of two >= 16); ``BLOCK_DPE`` the rope tile's width,
    ``LK - LV`` padded to a power of two of at least 16 (``tl.dot`` needs every dim >= 16; columns
    at or past ``LK`` load as zero), 0 without a rope part. ``SPLIT_LATENT``: the latent is handled
    as two halves of ``HALF = BLOCK_D // 2`` columns, ``q0``/``q1`` and ``k0``/``k1`` (the key
    halves are also V's halves) with accumulators ``acc0``/``acc1``; without it ``q0``, ``k0`` and
    ``acc0`` span the whole latent. ``q_pe``/``k_pe`` are the rope parts.

    ``TMA`` (``SPLIT_LATENT``, pages and ``SPLIT_ALIGN`` multiples of ``BLOCK_N``, pages back to
    back): split starts are multiples of ``BLOCK_N``, so every tile lies in one page; the whole
    ones are loaded by tensor descriptors over the cache as ``[pages * PAGE_SIZE, Lk]`` rows (as in
    the decode kernel), and the last tile, cut at ``tile_end``, is gathered with masks, so no key
    past ``tile_end`` (a NaN in an unused slot of the page) reaches the value product.
    """
    ROWS: tl.constexpr = QLEN * NUM_HEADS
    ROW_BLOCKS: tl.constexpr = (ROWS + BLOCK_H - 1) // BLOCK_H
    HALF: tl.constexpr = BLOCK_D // 2 if SPLIT_LATENT else BLOCK_D

    pid = tl.program_id(0)
    rb = pid % ROW_BLOCKS
    split = (pid // ROW_BLOCKS) % NUM_KV_SPLITS
    b = (pid // (ROW_BLOCKS * NUM_KV_SPLITS)).to(tl.int64)

    rows = rb * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    t = rows // NUM_HEADS
    h = rows % NUM_HEADS
    r = b * QLEN + t

    # Row limits n(b, t) and this split's keys [split_start, split_end) of the request, in int32 whatever the lengths'
    # dtype (int64 ones fit: the content check says so; int64 arithmetic here did not compile for sm_90).
    seq_len = tl.maximum(tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32), 0)
    limit = seq_len - QLEN + 1 + t
    if HAS_REAL:
        limit = tl.minimum(limit, tl.load(real_seq_lens_ptr + b * stride_rl).to(tl.int32))
    limit = tl.where(row_ok, tl.maximum(limit, 0), 0)
    per_split = tl.cdiv(seq_len, NUM_KV_SPLITS)
    chunk = tl.maximum(tl.cdiv(per_split, SPLIT_ALIGN) * SPLIT_ALIGN, MIN_SPLIT_LEN)
    split_start = split * chunk
    split_end = tl.minimum(split_start + chunk, seq_len)
    # Memory safety without host checks: a row whose keys need a table column past the table
    # (``table_keys = columns * PAGE_SIZE``) or a page outside the cache is poisoned (o = lse =
    # NaN), and no such address is read. Every split of the row sees the first condition; the
    # second is found before the key loop (triton_impl.block_table), which clamps each entry.
    too_long = limit > table_keys
    row_end = tl.minimum(tl.minimum(limit, split_end), table_keys).to(tl.int32)
    tile_end = tl.max(row_end, axis=0)
    first_bad = first_bad_key(table_ptr + b * stride_t_b, stride_t_p, split_start, tile_end, num_pages, PAGE_SIZE)
    poisoned = too_long | (row_end > first_bad)

    offs_d0 = tl.arange(0, HALF)
    offs_d1 = HALF + tl.arange(0, HALF)
    q_rows = q_ptr + r * stride_q_r + h * stride_q_h
    q0 = tl.load(q_rows[:, None] + offs_d0[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    q1 = q0
    if SPLIT_LATENT:
        q1 = tl.load(q_rows[:, None] + offs_d1[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_pe = q0
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        pe_ok = offs_pe < LK
        q_pe = tl.load(q_rows[:, None] + offs_pe[None, :], mask=row_ok[:, None] & pe_ok[None, :], other=0.0)
        q_pe = q_pe.to(DOT_DTYPE)

    qk_scale = sm_scale_log2
    k_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        qk_scale = qk_scale * k_scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc1 = acc0
    if BLOCK_DPE == 0:  # placeholders: the tile helpers take every piece
        offs_pe, pe_ok = offs_d0, offs_d0 < LK
    table_row = table_ptr + b * stride_t_b
    if TMA:
        last_tile = tl.maximum(split_start + (tile_end - split_start) // BLOCK_N * BLOCK_N, split_start)
        for start_n in range(split_start, last_tile, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k0, k1, k_pe = descriptor_tile(lat_desc, pe_desc, table_row, stride_t_p, num_pages, start_n, PAGE_SIZE,
                                           HALF, BLOCK_D, DOT_DTYPE)  # fmt: skip
            seen = offs_n[None, :] < row_end[:, None]
            m_i, l_i, acc0, acc1 = _verify_tile(q0, q1, q_pe, k0, k1, k_pe, seen, m_i, l_i, acc0, acc1, qk_scale,
                                                SPLIT_LATENT, BLOCK_DPE, DOT_DTYPE)  # fmt: skip
        for start_n in tl.range(last_tile, tile_end, BLOCK_N, num_stages=1):  # the cut tile, if any
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < tile_end
            k0, k1, k_pe = _verify_gather(k_ptr, table_row, stride_t_p, num_pages, stride_k_page, stride_k_tok,
                                          offs_n, key_ok, offs_d0, offs_d1, offs_pe, pe_ok, PAGE_SIZE, SPLIT_LATENT,
                                          BLOCK_DPE, DOT_DTYPE)  # fmt: skip
            seen = offs_n[None, :] < row_end[:, None]
            m_i, l_i, acc0, acc1 = _verify_tile(q0, q1, q_pe, k0, k1, k_pe, seen, m_i, l_i, acc0, acc1, qk_scale,
                                                SPLIT_LATENT, BLOCK_DPE, DOT_DTYPE)  # fmt: skip
    else:
        for start_n in range(split_start, tile_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < tile_end
            k0, k1, k_pe = _verify_gather(k_ptr, table_row, stride_t_p, num_pages, stride_k_page, stride_k_tok,
                                          offs_n, key_ok, offs_d0, offs_d1, offs_pe, pe_ok, PAGE_SIZE, SPLIT_LATENT,
                                          BLOCK_DPE, DOT_DTYPE)  # fmt: skip
            seen = offs_n[None, :] < row_end[:, None]
            m_i, l_i, acc0, acc1 = _verify_tile(q0, q1, q_pe, k0, k1, k_pe, seen, m_i, l_i, acc0, acc1, qk_scale,
                                                SPLIT_LATENT, BLOCK_DPE, DOT_DTYPE)  # fmt: skip

    has_keys = ~(l_i <= 0)  # l_i > 0, or NaN (a bad page), which must reach o and lse
    row_scale = tl.where(has_keys, k_scale / tl.where(has_keys, l_i, 1.0), 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row_scale = tl.where(poisoned, float("nan"), row_scale)
    lse = tl.where(poisoned, float("nan"), lse)
    if SINGLE_SPLIT:
        o_rows = o_ptr + r * stride_o_r + h * stride_o_h
        out_ty = o_ptr.dtype.element_ty
        tl.store(
            o_rows[:, None] + offs_d0[None, :], cast_for_store(acc0 * row_scale[:, None], out_ty), mask=row_ok[:, None]
        )
        if SPLIT_LATENT:
            tl.store(
                o_rows[:, None] + offs_d1[None, :],
                cast_for_store(acc1 * row_scale[:, None], out_ty),
                mask=row_ok[:, None],
            )
        tl.store(lse_ptr + r * stride_lse_r + h * stride_lse_h, lse, mask=row_ok)
    else:
        p_rows = part_ptr + r * stride_p_r + h * stride_p_h + split * stride_p_s
        values = partial_values(p_rows, BF16_PARTIALS)
        value_ty = values.dtype.element_ty
        tl.store(values[:, None] + offs_d0[None, :], cast_for_store(acc0 * row_scale[:, None], value_ty),
                 mask=row_ok[:, None])  # fmt: skip
        if SPLIT_LATENT:
            tl.store(values[:, None] + offs_d1[None, :], cast_for_store(acc1 * row_scale[:, None], value_ty),
                     mask=row_ok[:, None])  # fmt: skip
        tl.store(p_rows + LV, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Public wrapper.
# ----------------------------------------------------------------------------------------------


def _check_verify_args(
    q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
    num_kv_splits, page_size, k_scale,
) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """Argument checks of ``decode_attention_fwd_verify``, the content check included when enabled
    (see ``triton_impl.validation``); returns what :func:`_check_verify_layout` returns."""
    block_table, k_scale, num_pages = _check_verify_layout(
        q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
        num_kv_splits, page_size, k_scale,
    )  # fmt: skip
    if content_checks_enabled(q.device):
        _check_verify_table(req_to_token, seq_lens, real_seq_lens, q.shape[0] // qlen, page_size, num_pages)
    return block_table, k_scale, num_pages


def _check_verify_layout(
    q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
    num_kv_splits, page_size, k_scale,
) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The metadata checks of ``decode_attention_fwd_verify``; returns the 2-D block table, the
    ``k_scale`` to launch with (1.0 for a 16-bit cache) and the cache's page count."""
    check_positive("qlen", qlen)
    check_positive("num_kv_splits", num_kv_splits)
    check_positive("page_size", page_size)
    check_tensor("q", q, ndim=3, dtypes=_Q_DTYPES)
    num_rows, num_heads, key_width = q.shape
    if num_rows % qlen:
        raise ValueError(f"q: expected a multiple of qlen={qlen} rows (B * qlen), got q.shape[0]={num_rows}")
    if num_heads < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    batch, device = num_rows // qlen, q.device
    check_tensor("k_buffer", k_buffer, ndim=(3, 4), dtypes=(q.dtype, *_FP8_CACHE_DTYPES), device=device)
    if k_buffer.shape[-2] != 1 or k_buffer.shape[-1] != key_width:
        raise ValueError(
            f"k_buffer: expected [..., 1, {key_width}] (one latent KV head, q's width), got {list(k_buffer.shape)}"
        )
    if k_buffer.dim() == 4 and k_buffer.shape[1] != page_size:
        raise ValueError(
            f"k_buffer: expected [pages, {page_size}, 1, Lk] for page_size={page_size}, got {list(k_buffer.shape)}"
        )
    if k_buffer.dim() == 3 and k_buffer.shape[0] % page_size:
        raise ValueError(f"k_buffer: {k_buffer.shape[0]} tokens is not a multiple of page_size={page_size}")
    if not isinstance(v_buffer, torch.Tensor):
        raise TypeError(f"v_buffer: expected a torch.Tensor, got {type(v_buffer).__name__}")
    value_width = v_buffer.shape[-1]
    if v_buffer.data_ptr() != k_buffer.data_ptr() or v_buffer.shape[:-1] != k_buffer.shape[:-1]:
        raise ValueError("v_buffer: expected k_buffer[..., :Lv] (MLA reads V from K), got another tensor")
    check_power_of_two("Lv (v_buffer.shape[-1])", value_width)
    if value_width < 16:
        raise ValueError(f"v_buffer: Lv must be >= 16 (tl.dot's smallest width), got {value_width}")
    if value_width > key_width:
        raise ValueError(f"v_buffer: value width {value_width} exceeds key width {key_width}")
    check_power_of_two("P (Lk - Lv, the rope width)", key_width - value_width, allow_zero=True)
    check_tensor("o", o, shape=(num_rows, num_heads, value_width), dtypes=_OUT_DTYPES, device=device)
    check_tensor(
        "lse", lse, shape=(num_rows, num_heads), dtypes=(torch.float32,), device=device, unit_last_stride=False
    )
    block_table = block_table_2d("req_to_token", req_to_token, min_rows=batch, device=device, dtypes=_INDEX_DTYPES)
    check_lengths("seq_lens", seq_lens, batch, device, _INDEX_DTYPES)
    if real_seq_lens is not None:
        check_lengths("real_seq_lens", real_seq_lens, batch, device, _INDEX_DTYPES)
    if num_kv_splits > 1:
        check_split_workspace(attn_logits, num_rows, num_heads, num_kv_splits, value_width, device)
    k_scale = check_scale("k_scale", k_scale if k_buffer.dtype in _FP8_CACHE_DTYPES else None, device)
    num_pages = k_buffer.shape[0] if k_buffer.dim() == 4 else k_buffer.shape[0] // page_size
    return block_table, k_scale, num_pages


def _check_verify_table(req_to_token, seq_lens, real_seq_lens, batch, page_size, num_pages) -> None:
    """The content check of ``decode_attention_fwd_verify``: the table entries covering the keys the
    kernel reads, ``[0, min(L, R))`` of each request (see ``check_block_table``)."""
    block_table = block_table_2d("req_to_token", req_to_token, min_rows=0, device=req_to_token.device,
                                 dtypes=_INDEX_DTYPES)  # fmt: skip
    keys_read = seq_lens[:batch]
    check_int32_lengths("seq_lens", keys_read)
    if real_seq_lens is not None:
        check_int32_lengths("real_seq_lens", real_seq_lens[:batch])
        keys_read = torch.minimum(keys_read, real_seq_lens[:batch])
    check_block_table("req_to_token", block_table, keys_read, page_size, num_pages)


def decode_attention_fwd_verify(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    real_seq_lens: torch.Tensor | None,
    qlen: int,
    attn_logits: torch.Tensor | None,
    num_kv_splits: int,
    sm_scale: float,
    page_size: int,
    k_scale: torch.Tensor | None = None,
    *,
    config: dict[str, Any] | None = None,
) -> None:
    """Causal MLA verify over a per-request block table (seed signature; writes ``o`` and ``lse``).

    Row ``r = b*qlen + t``, head ``h`` attends to keys ``[0, n)`` of request ``b`` with
    ``n = max(min(L_b - qlen + 1 + t, R_b), 0)``; ``s_j = sm_scale * q[r, h] . K_j`` over all ``Lk``
    columns, ``o = softmax(s) @ K[:, :Lv]``, ``lse = ln sum_j exp(s_j)``. Rows with no key get
    ``(0, -inf)``. Golden: ``golden.mla_verify.mla_verify``.

    Args:
        q: ``[B * qlen, H, Lk]`` bf16/fp16, verify tokens of a request contiguous.
        k_buffer: paged latent cache, ``[num_pages, page_size, 1, Lk]`` (any page stride, e.g. a
            per-layer view of a cross-layer cache) or ``[num_pages * page_size, 1, Lk]``; q's dtype
            or ``float8_e4m3fn``.
        v_buffer: ``k_buffer[..., :Lv]`` (V is read from K; only its width is used).
            ``Lv`` and ``P = Lk - Lv`` must be powers of two (``P = 0`` allowed).
        o: ``[B * qlen, H, Lv]`` bf16/fp16/fp32 output.
        lse: ``[B * qlen, H]`` fp32 natural-log LSE (-inf for rows with no key).
        req_to_token: ``[>= B, max_pages]`` (or ``[>= B, max_pages, 1]``) int32/int64 per-request
            block table (not repeated), any strides. Entries covering a row's keys should address
            a page: one that does not (or a row longer than the table) makes that row
            ``o = lse = NaN`` and is never dereferenced; entries past the keys are never read.
        seq_lens: ``[>= B]`` int kernel KV lengths ``L``, any stride.
        real_seq_lens: ``[>= B]`` int or None, any stride; row limit is ``max(min(L - qlen + 1 + t, L_real), 0)``.
        qlen: verify tokens per request.
        attn_logits: fp32 workspace ``[>= B * qlen, H, num_kv_splits, Lv + 1]``; unused, and may be
            None, when ``num_kv_splits`` is 1. Each split's record holds its partial output (for a bf16 ``o`` in
            bf16, two values a fp32 slot: ``lse_merge.bf16_partials``) and its LSE in slot ``Lv``.
        num_kv_splits: static cap on KV splits per request (see :func:`verify_num_kv_splits`);
            shorter requests use fewer, longer splits.
        sm_scale: softmax scale.
        page_size: tokens per KV cache page.
        k_scale: scalar fp32 tensor dequantizing an FP8 cache (default 1); ignored for bf16/fp16.
        config: launch config overriding :func:`select_verify_config` (tests cover every variant).

    Content checks (opt-in on CUDA, see ``triton_impl.validation``) look at the table on the host;
    with them off the call never synchronizes. CUDA graphs: capture with the largest batch and
    ``num_kv_splits`` the graph serves, then replay with new ``seq_lens`` / ``real_seq_lens`` /
    ``req_to_token`` contents written in place; the tensors (addresses and shapes), ``qlen``,
    ``num_kv_splits``, ``sm_scale``, ``page_size`` and ``config`` stay fixed across replays.

    Traffic: reads ``B*qlen*H*Lk`` query elements and, per request, each key below
    ``max_t n(b, t)`` once per row block (``cdiv(qlen*H, BLOCK_H)`` times, the repeats mostly from
    L2); writes ``B*qlen*H*(Lv + 1)`` (plus ``S`` times that in partials when ``S > 1``: fp32, and for a bf16
    output the values in bf16, ``4 * (Lv / 2 + 1)`` bytes a record).
    """
    device_index, stream = current_target()
    try:
        key = (device_index, tensor_facts(q), tensor_facts(k_buffer), tensor_facts(v_buffer),
               v_buffer.data_ptr() == k_buffer.data_ptr(), tensor_facts(o), tensor_facts(lse),
               tensor_facts(req_to_token), tensor_facts(seq_lens), tensor_facts(real_seq_lens), qlen, type(qlen),
               tensor_facts(attn_logits), num_kv_splits, type(num_kv_splits), sm_scale, page_size, type(page_size),
               tensor_facts(k_scale))  # fmt: skip
        plan = _PLANS.get(key) if config is None else None
    except (AttributeError, TypeError, ValueError):  # a non-tensor or unhashable argument: the checks name it
        key, plan = None, None
    if plan is None:
        plan = _plan_verify(q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
                            num_kv_splits, sm_scale, page_size, k_scale, config)  # fmt: skip
        if key is not None and config is None:
            _PLANS.add(key, plan)
    if content_checks_on(plan.on_cuda):
        _check_verify_table(req_to_token, seq_lens, real_seq_lens, plan.batch, page_size, plan.num_pages)
    plan.stage1(stream, q, k_buffer, plan.sm_scale_log2, req_to_token, seq_lens,
                seq_lens if real_seq_lens is None else real_seq_lens, o if plan.merge is None else attn_logits, o, lse,
                k_scale if plan.k_scale is None else plan.k_scale, *plan.descriptors(k_buffer, plan.tma))  # fmt: skip
    if plan.merge is not None:
        plan.merge(stream, attn_logits, o, lse)


def _via_decode(q, k_buffer, v_buffer, o, lse, block_table, seq_lens, real_seq_lens, qlen, part_strides,
                num_kv_splits, sm_scale, page_size, num_pages, single) -> tuple[Callable[..., None], Any]:  # fmt: skip
    """``(stage 1, tma layout)`` of a verify call run by decode's stage 1 (``decode_attention.portable_stage1``):
    the ``B * qlen`` rows as decode rows over the ``B`` table rows, each row its draft token's causal prefix. The
    same keys and merged outputs (the split slots follow decode's split rule); where a verify tile holds one draft
    token the two kernels read the same bytes, and decode's was the faster (FP8_VIA_DECODE in ``VERIFY_CONFIGS``)."""
    launch, tma = portable_stage1(
        q, k_buffer, v_buffer, o, lse, block_table, part_strides, seq_lens.stride(0), num_kv_splits=num_kv_splits,
        sm_scale=sm_scale, logit_cap=0.0, window=None, page_size=page_size, num_pages=num_pages, is_mla=True,
        single=single, config=None, qlen=qlen, has_real=real_seq_lens is not None,
        real_len_stride=0 if real_seq_lens is None else real_seq_lens.stride(0),
    )  # fmt: skip

    return _decode_stage1(launch), tma


def _decode_stage1(launch: Callable[..., None]) -> Callable[..., None]:
    """A decode stage-1 launch (``(stream, q, k, v, o, lse, part, table, lens, real lens, k_scale, v_scale, lat,
    pe)``, MLA: ``v`` is ``k``'s first ``Lv`` columns) called with verify's stage-1 arguments."""

    def stage1(stream, q, k, _sm_scale_log2, table, lens, real_lens, part, o, lse, k_scale, lat, pe) -> None:
        launch(stream, q, k, k, o, lse, part, table, lens, real_lens, k_scale, k_scale, lat, pe)

    return stage1


class _VerifyPlan(NamedTuple):
    """A checked call layout of :func:`decode_attention_fwd_verify` and what it launches."""

    stage1: Callable[..., None]  # (stream, q, k, sm_scale_log2, table, lens, real lens, part, o, lse, k_scale, lat, pe)
    merge: Callable[..., None] | None  # (stream, attn_logits, o, lse); None: one split, stage 1 writes o, lse
    tma: tuple | None  # decode_attention.tma_layout of the cache, or None
    descriptors: Callable[..., tuple]  # (k_buffer, tma) -> the (latent, rope) descriptors stage 1 takes
    sm_scale_log2: float
    k_scale: torch.Tensor | None  # the scale to launch with; None: the caller's (an FP8 cache's)
    batch: int
    num_pages: int
    on_cuda: bool  # where the content checks would read (see content_checks_on)


# Plans by call key (``triton_impl.validation`` says what a key holds).
_PLANS = Plans()


def _plan_verify(q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
                 num_kv_splits, sm_scale, page_size, k_scale, config) -> _VerifyPlan:  # fmt: skip
    """The argument checks of :func:`decode_attention_fwd_verify` (all but the content check) and its launches."""
    check_float("sm_scale", sm_scale)
    block_table, launch_scale, num_pages = _check_verify_layout(
        q, k_buffer, v_buffer, o, lse, req_to_token, seq_lens, real_seq_lens, qlen, attn_logits,
        num_kv_splits, page_size, k_scale,
    )  # fmt: skip
    num_rows, num_heads, key_width = q.shape
    value_width = v_buffer.shape[-1]
    batch = num_rows // qlen
    make_plan = partial(_VerifyPlan, sm_scale_log2=sm_scale * _LOG2E,
                        k_scale=None if launch_scale is k_scale else launch_scale, batch=batch, num_pages=num_pages,
                        on_cuda=q.device.type == "cuda")  # fmt: skip
    if batch == 0:
        return make_plan(no_launch, None, None, tma_descriptors)
    if num_pages == 0:  # the kernel reads page 0 in place of a bad entry
        raise ValueError(f"k_buffer: expected at least one page, got shape {list(k_buffer.shape)}")
    cfg = config if config is not None else select_verify_config(batch, qlen, num_heads)
    if cfg.get("FEW_ROWS_VIA_DECODE") and qlen == 1 and real_seq_lens is None:  # a decode call: as one, if few rows
        decode = _plan_decode(q, k_buffer, v_buffer, o, lse, block_table, seq_lens, attn_logits, num_kv_splits,
                              sm_scale, page_size, 0.0, k_scale, k_scale, True, None, DECODE_CONFIGS["sm90"]["mla"])
        if getattr(decode.stage1, "kernel", None) is decode_attention_sm90.mla_decode_few_rows_kernel:
            return make_plan(_decode_stage1(decode.stage1), decode.merge, decode.tma, decode.descriptors)
    single = num_kv_splits == 1
    part_strides = (0, 0, 0) if single else attn_logits.stride()[:3]  # with one split, o stands in for part
    length_strides = (seq_lens.stride(0), seq_lens.stride(0) if real_seq_lens is None else real_seq_lens.stride(0))
    split_latent = bool(cfg["SPLIT_LATENT"]) and value_width >= 32
    rope_width = key_width - value_width
    # tl.dot needs every dim >= 16: a rope width below 16 (test shapes only) loads a 16-wide tile
    # whose extra columns are masked to zero (_check_verify_args requires Lv >= 16).
    block_dpe = max(16, next_pow2(rope_width)) if rope_width else 0
    bf16_values = bf16_partials(o.dtype)
    merge = None if single else merge_splits_launch(num_rows, attn_logits, o, lse, bf16_values=bf16_values)
    tma = None
    if split_latent and cfg.get("GLUON") and cfg["SPLIT_ALIGN"] % 64 == 0:
        tma = tma_layout(k_buffer, page_size, _page_stride(k_buffer, page_size), k_buffer.stride(-3), num_pages,
                         64, value_width, block_dpe)  # fmt: skip
    if cfg.get("GLUON") and decode_attention_sm90.supports(
        device=q.device, is_mla=True, key_width=key_width, value_width=value_width, q=q,
        cache_dtype=k_buffer.dtype, rows=qlen * num_heads, page_size=page_size, tma_rows=tma is not None,
    ):  # the sm_90 fast path (triton_impl/decode_attention_sm90.py): the same partials, a hand-made schedule
        stage1 = Launch(decode_attention_sm90.mla_verify_stage1_kernel,
                        (verify_row_blocks(qlen, num_heads, 64) * batch * num_kv_splits,), (
            num_pages, block_table.shape[1] * page_size, *length_strides, block_table.stride(0), block_table.stride(1),
            q.stride(0), q.stride(1), *part_strides, o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        ), dict(QLEN=qlen, NUM_HEADS=num_heads, HAS_REAL=real_seq_lens is not None, NUM_KV_SPLITS=num_kv_splits,
                SPLIT_ALIGN=cfg["SPLIT_ALIGN"], MIN_SPLIT_LEN=cfg["MIN_SPLIT_LEN"], PAGE_SIZE=page_size,
                SINGLE_SPLIT=single, BF16_PARTIALS=bf16_values,
                LEAN_SOFTMAX=decode_attention_sm90.uses_lean_softmax(cfg, sm_scale),
                RESCALE_IF_GREW=bool(cfg.get("RESCALE_IF_GREW")),
                num_warps=int(decode_attention_sm90.NUM_WARPS)))  # fmt: skip
        return make_plan(stage1, merge, tma, DescriptorsByAddress(decode_attention_sm90.descriptors))
    if cfg.get("FP8_VIA_DECODE") and k_buffer.dtype == torch.float8_e4m3fn and num_heads % cfg["BLOCK_H"] == 0:
        stage1, tma = _via_decode(q, k_buffer, v_buffer, o, lse, block_table, seq_lens, real_seq_lens, qlen,
                                  part_strides, num_kv_splits, sm_scale, page_size, num_pages, single)  # fmt: skip
        return make_plan(stage1, merge, tma, DescriptorsByAddress(tma_descriptors))
    tma = None
    if split_latent and cfg.get("TMA") and cfg["SPLIT_ALIGN"] % cfg["BLOCK_N"] == 0:
        tma = tma_layout(k_buffer, page_size, _page_stride(k_buffer, page_size), k_buffer.stride(-3), num_pages,
                         cfg["BLOCK_N"], value_width, block_dpe)  # fmt: skip
    grid = (verify_row_blocks(qlen, num_heads, cfg["BLOCK_H"]) * batch * num_kv_splits,)
    stage1 = Launch(_fwd_verify_kernel_stage1, grid, (
        num_pages, block_table.shape[1] * page_size, *length_strides,
        block_table.stride(0), block_table.stride(1),
        q.stride(0), q.stride(1), _page_stride(k_buffer, page_size), k_buffer.stride(-3),
        *part_strides, o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
    ), dict(
        QLEN=qlen,
        NUM_HEADS=num_heads,
        HAS_REAL=real_seq_lens is not None,
        BLOCK_D=value_width,
        BLOCK_DPE=block_dpe,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_H=cfg["BLOCK_H"],
        NUM_KV_SPLITS=num_kv_splits,
        SPLIT_ALIGN=cfg["SPLIT_ALIGN"],
        MIN_SPLIT_LEN=cfg["MIN_SPLIT_LEN"],
        PAGE_SIZE=page_size,
        LK=key_width,
        LV=value_width,
        SPLIT_LATENT=split_latent,
        SINGLE_SPLIT=single,
        BF16_PARTIALS=bf16_values,
        IS_FP8=k_buffer.dtype in _FP8_CACHE_DTYPES,
        TMA=tma is not None,
        DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    ))  # fmt: skip
    return make_plan(stage1, merge, tma, DescriptorsByAddress(tma_descriptors))


def warmup_decode_attention_fwd_verify(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    req_to_token: torch.Tensor,
    has_real: bool,
    qlens: Iterable[int],
    attn_logits: torch.Tensor | None,
    sm_scale: float,
    page_size: int,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Compile every launch variant serving can reach for these tensors.

    A launch specializes on qlen, the row-count config and a single split, but graph capture and
    profiling only run the full verify length. Each variant runs once on scratch tensors with the
    strides of the real ones; the split scratch reuses ``attn_logits``' storage, whose size the
    launch specializes on.
    """
    num_heads, value_width = q.shape[1], o.shape[-1]
    req_to_token = block_table_2d("req_to_token", req_to_token, min_rows=0, device=q.device, dtypes=_INDEX_DTYPES)
    if attn_logits is None:
        attn_logits = q.new_empty(0, dtype=torch.float32)

    def scratch(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.empty_strided((rows, *t.shape[1:]), t.stride(), dtype=t.dtype, device=t.device)

    for qlen in qlens:
        for batch in {1, _VERIFY_SMALL_MAX_ROWS[verify_arch()] // (qlen * num_heads) + 1}:
            rows = batch * qlen
            seq_lens = torch.full((batch,), qlen, dtype=torch.int32, device=q.device)
            block_table = torch.empty_strided(
                (batch, req_to_token.shape[1]), req_to_token.stride(), dtype=req_to_token.dtype,
                device=req_to_token.device,
            ).zero_()  # fmt: skip
            for num_kv_splits in (1, 2):
                decode_attention_fwd_verify(
                    scratch(q, rows).zero_(),
                    k_buffer,
                    k_buffer[..., :value_width],
                    scratch(o, rows),
                    scratch(lse, rows),
                    block_table,
                    seq_lens,
                    seq_lens if has_real else None,
                    qlen,
                    None
                    if num_kv_splits == 1
                    else _storage_view(attn_logits, (rows, num_heads, num_kv_splits, value_width + 1)),
                    num_kv_splits,
                    sm_scale,
                    page_size,
                    k_scale=k_scale,
                )
