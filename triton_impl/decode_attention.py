"""Split-KV decode attention over a paged KV cache: MLA and GQA/MHA, sliding window, logit cap, FP8.

Twin of ``golden/decode_attention.py``, with vLLM's ``decode_attention_fwd``
signature. Every query row has its own extent ``b_seq_len[r]`` and block-table row
``req_to_token[r]``; multi-token decode is served by flattening (:func:`expand_decode_rows`).

Two stages. Stage 1 (:func:`_decode_stage1_kernel`) cuts each row's visible keys ``[lo, n)`` into
``S`` splits (window-aware: ``lo = max(0, n - W)``) and writes every split's normalized partial
output and natural-log LSE into ``attn_logits[r, h, s, :Lv]`` / ``[..., Lv]`` (for a bf16 output the
partial output in bf16, two values a slot of ``[:Lv / 2]``: ``lse_merge.bf16_partials``), an empty
split as ``(0, -inf)``. Stage 2 is ``triton_impl.lse_merge.merge_splits``; because every slot is written it
needs no split boundaries, so stage 1 is the only place the window shapes the partition. With
``S == 1`` stage 1 writes ``o``/``lse`` directly, and a row's result depends on nothing but that
row (batch invariance, bit for bit).

Also here: vLLM's serving helpers ``_compute_num_kv_splits`` and :func:`expand_decode_rows`, and
decode context parallelism over ``torch.distributed`` (:func:`decode_attention_dcp`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from triton_impl import decode_attention_sm90
from triton_impl.block_table import first_bad_key
from triton_impl.interpreter import cast_for_store, dot_dtype
from triton_impl.launch import (
    DescriptorsByAddress,
    Launch,
    Plans,
    current_target,
    no_launch,
    register_cap,
    select_config,
    with_overrides,
)
from triton_impl.lse_merge import bf16_partials, launch_merge_splits, merge_splits_launch, partial_values
from triton_impl.validation import (
    block_table_2d,
    cdiv,
    check_block_table,
    check_flag,
    check_float,
    check_lengths,
    check_positive,
    check_power_of_two,
    check_scale,
    check_split_workspace,
    check_tensor,
    content_checks_on,
    is_int,
    next_pow2,
    tensor_facts,
)

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2 e)
_LN2 = tl.constexpr(0.6931471805599453)  # the stored LSE is natural-log: ln(x) = log2(x) * ln 2
_NO_WINDOW = 2**31 - 1  # "no window" as a window no int32 extent reaches: lo = max(n - W, 0) = 0

# vLLM serving constants of `_compute_num_kv_splits` (vllm/v1/attention/backends/mla/triton_mla.py).
_MIN_WORK_PER_SPLIT = 512
_SPLIT_OCCUPANCY_MULTIPLIER = 2

# Launch configs as data, keyed by GPU architecture ("sm90" = Hopper), then by cache kind.
# BLOCK_H query heads share one K/V tile (tl.dot needs M >= 16); BLOCK_N keys per tile. The
# "default" numbers are upstream vLLM's CUDA choices for this kernel (BLOCK_N 32, BLOCK_H 16,
# 4 warps, 2 stages; 1 stage when the latent tile is >= 1024 wide); the Hopper entry starts from
# them. The sm90 MLA entry comes from benchmarks/sweep_decode.py (notebooks/results/sweep_decode_h200.md):
# 64-head tiles (the smallest M Hopper's wgmma takes; H=16 clamps the tile to 16) with the latent
# in two 256-wide halves (SPLIT_LATENT) and 64-key tiles: at B=32 L=32K, H=128 went from 3345 us
# (BLOCK_H 16) to 1657 us and H=16 from 470 us to 385 us. GQA (32/8 heads, D=128, page 16): 64-key
# tiles, the best of 8 configs at B=128 L=1K, B=32 L=8K and L=32K (graph replay, 87.6 -> 90.8%,
# 92.7 -> 95.0%, 98.3 -> 98.7% of the copy roofline against upstream's 32-key tiles; 62cb554,
# sweep_decode_h200.md). The config never depends on the
# batch, so the summation order of a row does not either (batch invariance with one split).
# Optional keys: SPLIT_LATENT (0), maxnreg (registers per thread the compiler may use; none: its choice),
# maxnreg_h16 (the same cap, only where the head tile clamps to 16 heads). The sm90 MLA entry caps the
# 16-head tile at 128: uncapped, Triton 3.6 gives it 150 registers, so one 8-warp program fits an SM
# where two fit at 128 (94 KiB of shared memory each); B=32 H=16 L=32K went 543 -> 385 us (8f5b45e,
# sweep_decode_h200.md). The same cap on the 64-head tile (255 registers) doubled its time.
# TMA (0): load whole page-aligned MLA tiles with tensor descriptors (see _decode_stage1_kernel); TMA_H16 the same
# for the 16-head tile. On the H200 (sweep_decode_h200.md, graph replay, with the split cap): MLA B=32 H=128 L=32K
# 1226.7 -> 1059.7 us, B=8 H=128 L=8K 108.3 -> 94.5 us; the 16-head tile went 365.7 -> 705.2 us (its shared memory
# grows 94 -> 114 KiB, one program per SM instead of two), so the sm90 entry keeps it on gathers.
# SPLIT_ROUNDS (none: no cap) caps the splits stage 1 runs at what fills that many rounds of resident programs,
# PROGRAMS_PER_SM (PROGRAMS_PER_SM_H16 for the 16-head tile) per SM: see stage1_splits. MLA fills one round, GQA
# two: in two split sweeps on the H200 (sweep_decode_h200.md, 2026-11-30 and 2026-12-01) MLA at 1 round of
# programs was within 2% of the fastest count at every bench shape where the two runs agree, and GQA at B=32 ran
# 990-1002 us (L=32K) and 250-257 us (L=8K) at 2 rounds against 998-1067 and 250-268 at 1.
# GLUON (0): MLA with a 16-bit or FP8 cache at DeepSeek's widths, pages of 64n keys and 32 or more heads runs the Gluon
# stage 1 of triton_impl/decode_attention_sm90.py (decode_attention_sm90.supports): on the H200 (bench_h200.md,
# 72fbe8a, against the portable kernel at 580e9fc) B=32 H=128 L=32K 1.0411 -> 0.6346 ms, B=128 H=128 L=1K 0.1513 ->
# 0.1061, B=8 H=128 L=8K 0.0890 -> 0.0585, B=1 H=128 L=32K 0.0615 -> 0.0346. The config stays batch-independent.
# Releasing a key stage before the next tile's scores (c7e2fb0): 0.6072, 0.1007, 0.0518 and 0.0318 ms.
# GLUON_FEW (0): the same with at most 16 heads runs decode_attention_sm90.mla_decode_few_rows_kernel (the keys as
# wgmma's M, a quarter of the tensor work of a 64-row tile; decode_attention_sm90.supports_few_rows), one program
# per SM. On the H200 (bench_h200.md, 72fbe8a -> c7e2fb0, the portable kernel before): B=32 H=16 L=32K 0.3401 ->
# 0.2898 ms (83.8 -> 98.3% of copy bandwidth), B=128 H=16 L=8K 0.3440 -> 0.2864, B=8 H=16 L=4K 0.0327 -> 0.0191.
# CLUSTER_MERGE (0): the few-rows kernel merges 2-8 splits of a row itself, the row's programs one thread-block
# cluster, where every row's cluster runs at once (decode_attention_sm90.merges_in_cluster): decode B=8 H=16 L=4K
# 0.0191 -> 0.0181 ms (bench_h200.md, 6412cb9 -> a4d4a28; 0.96x -> 1.04x FlashInfer).
# LEAN_SOFTMAX (0; the 64-row Gluon stage 1, decode and verify alike, for a positive sm_scale): a tile that every row
# sees whole skips its mask, and the score scale goes into each exponent's fma (decode_attention_sm90._softmax): the
# softmax warpgroup's path through such a tile 614 -> 505 instructions (decode, H=128) and 590 -> 495 (verify,
# qlen 4), its ALU-pipe instructions 151 -> 87 and 128 -> 80; an FP8 cache (the masks only) 1198 -> 1135 (Triton
# 3.6, bench.sass_main_path; perf_log.md, forty-second session). The softmax runs with the tensor cores idle:
# predicted 3-5% off a compute-bound tile; measured on the H200 (kernel_times.py, stage 1, two runs each, c2c2eac
# with the flag off -> on): decode B=32 H=128 L=32K 508.2 -> 495.9 us, verify B=32 H=128 qlen 4 L=32K 1871.6 ->
# 1821.7 us, qlen 8 L=4K 245.5 -> 242.3 us; with an FP8 cache within +-1% (perf_log.md, forty-third session).
# RESCALE_IF_GREW (0; the 64-row Gluon stage 1, decode and verify alike): the value warpgroup's warps skip the
# rescale of their output half where none of their 16 rows' max grew (every factor exactly 1: the same bits;
# decode_attention_sm90._rescaled), its loop's path 173 -> 53 instructions. Measured on the H200 (kernel_times.py,
# stage 1, two runs each, fef9649's kernel with the flag off -> on): decode B=32 H=128 L=32K 493.7 -> 462.0 us,
# B=128 H=128 L=1K 75.6 -> 74.1, verify B=32 H=128 qlen 4 L=32K 1811.2 -> 1771.0, qlen 8 L=4K 241.6 -> 235.9, every
# H=128 case 0.5-6.4% faster; the same skip in the softmax warpgroup made every case 0.3-8.6% slower (perf_log.md,
# forty-fourth session).
# Every key ending in _h16 / _H16 replaces its base key where the head tile is 16 heads (tile_config).
_CONFIG_KEYS = frozenset({"BLOCK_N", "BLOCK_H", "num_warps", "num_stages"})
DECODE_CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    "default": {
        "mla": {"BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
        "gqa": {"BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2},
    },
    "sm90": {
        "mla": {"BLOCK_N": 64, "BLOCK_H": 64, "num_warps": 8, "num_stages": 2, "SPLIT_LATENT": 1, "GLUON": 1,
                "maxnreg_h16": 128, "TMA": 1, "TMA_H16": 0, "SPLIT_ROUNDS": 1, "PROGRAMS_PER_SM": 1,
                "PROGRAMS_PER_SM_H16": 2, "GLUON_FEW": 1, "CLUSTER_MERGE": 1, "LEAN_SOFTMAX": 1,
                "RESCALE_IF_GREW": 1},
        "gqa": {"BLOCK_N": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2, "SPLIT_ROUNDS": 2, "PROGRAMS_PER_SM": 4},
    },
}


def select_decode_config(device: torch.device, is_mla: bool, block_dv: int) -> dict[str, int]:
    """The launch config for a cache kind on a device (never a function of the batch)."""
    config = dict(select_config(DECODE_CONFIGS, device)["mla" if is_mla else "gqa"])
    if block_dv >= 1024:
        config["num_stages"] = 1  # a second stage of 1024-wide tiles does not fit in shared memory
    return config


def tile_config(config: dict[str, int], group: int) -> tuple[int, dict[str, int]]:
    """``(BLOCK_H, config)`` for ``group`` query heads per KV head: the head tile is ``BLOCK_H``
    clamped to the group (at least 16, ``tl.dot``'s smallest M), and where it is 16 every key
    ending in ``_h16``/``_H16`` replaces its base key (``maxnreg_h16`` -> ``maxnreg``)."""
    block_h = min(config["BLOCK_H"], max(16, next_pow2(group)))
    if block_h == 16:
        config = with_overrides(config, "_h16")
    return block_h, config


def stage1_splits(num_kv_splits: int, programs_per_split: int, sm_count: int | None, config: dict[str, int]) -> int:
    """The splits stage 1 runs: ``num_kv_splits``, capped where the config has ``SPLIT_ROUNDS``.

    The cap is ``SPLIT_ROUNDS * PROGRAMS_PER_SM * sm_count // programs_per_split`` (at least 1):
    the fewest splits that still give every SM that many rounds of resident programs, where a
    program is one (row, KV-head block, split). Every split costs a query load, a partial write and
    its read in the merge, so past a full GPU more splits only cost time. Split sweeps on the H200
    (``benchmarks/sweep_decode.py 160 splits``, ``sweep_decode_h200.md``; graph replay of both stages,
    vLLM's split count -> the sm90 entries' cap, one round for MLA, two for GQA, at b4b01fc): MLA B=32
    H=128 L=32K 1067.9 -> 1081.5 us (64 -> 2 splits; 1656.5 -> 1216.2 before whole-tile loads), MLA B=32
    H=16 L=32K 366.8 -> 338.3 us (64 -> 8), MLA B=8 H=128 L=8K 94.8 -> 82.2 (16 -> 8), MLA B=128 H=128
    L=1K 200.2 -> 159.6 (2 -> 1), GQA B=32 L=32K 995.6 -> 990.1 us (64 -> 4), GQA B=128 L=1K 141.5 ->
    130.1 (2 -> 1). The rows
    of a batch are assumed alike: a batch of one long row among short ones gets its long row cut
    in fewer pieces than ``num_kv_splits``. No cap off CUDA (``sm_count`` None), with one split,
    or without the key; the merge then reads only the splits run, and slots past them in
    ``attn_logits`` are not written. ``config``: the head tile's (:func:`tile_config`).
    """
    rounds = config.get("SPLIT_ROUNDS")
    if not rounds or sm_count is None or num_kv_splits == 1:
        return num_kv_splits
    return max(1, min(num_kv_splits, rounds * config["PROGRAMS_PER_SM"] * sm_count // max(1, programs_per_split)))


def tma_layout(k_buffer: torch.Tensor, page_size: int, page_stride: int, token_stride: int, num_pages: int,
               block_n: int, latent_width: int, rope_block: int) -> tuple | None:  # fmt: skip
    """The MLA cache as ``[pages * page_size, Lk]`` rows for tensor descriptors: ``(shape, strides,
    latent block [block_n, latent_width // 2], rope block [block_n, rope_block])``, or None where
    descriptors cannot address it. They need whole ``block_n``-key tiles inside a page, pages back
    to back, 16-byte aligned rows and base, a rope part, and int32 row coordinates."""
    row_bytes = token_stride * k_buffer.element_size()
    if (rope_block == 0 or page_size % block_n or row_bytes % 16 or page_stride != page_size * token_stride
            or k_buffer.data_ptr() % 16 or num_pages * page_size >= 2**31):  # fmt: skip
        return None
    return ([num_pages * page_size, k_buffer.shape[-1]], [token_stride, 1], [block_n, latent_width // 2],
            [block_n, rope_block])  # fmt: skip


def tma_descriptors(k_buffer: torch.Tensor, layout: tuple | None) -> tuple:
    """``(latent, rope)`` tensor descriptors of ``k_buffer`` for a :func:`tma_layout`, or
    ``(None, None)``. A plan remembers them by the cache's address (``launch.DescriptorsByAddress``)."""
    if layout is None:
        return None, None
    shape, strides, lat_block, pe_block = layout
    return TensorDescriptor(k_buffer, shape, strides, lat_block), TensorDescriptor(k_buffer, shape, strides, pe_block)


# ----------------------------------------------------------------------------------------------
# Serving helpers (TritonMLAImpl.forward_mqa).
# ----------------------------------------------------------------------------------------------


def _compute_num_kv_splits(max_seq_len: int, sm_count: int, sliding_window: int | None = None) -> int:
    """vLLM's split count: ``min(next_pow2(max(1, L // 512)), 2 * sm_count)``.

    ``L`` is ``max_seq_len`` clamped to the sliding window first (a windowed row never sees more
    than ``W`` keys). Examples: 1023 -> 1, 1024 -> 2, 5000 -> 16; with ``W = 1024``, 5000 -> 2.
    The result ignores batch size and heads, as upstream does.
    """
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len: expected >= 0, got {max_seq_len}")
    check_positive("sm_count", sm_count)
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window: expected None, 0 or a positive int, got {sliding_window}")
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window)
    ideal = next_pow2(max(1, max_seq_len // _MIN_WORK_PER_SPLIT))
    return min(ideal, _SPLIT_OCCUPANCY_MULTIPLIER * sm_count)


def expand_decode_rows(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten multi-token decode to one row per query token, as ``forward_mqa`` does.

    Request ``b`` becomes rows ``b*Q .. b*Q + Q - 1`` with its block-table row repeated; causal
    extents ``clamp(L_b - (Q-1) + t, 0)``, non-causal extents ``L_b``. No host synchronization
    (CUDA-graph safe). Golden: ``golden.decode_attention.expand_decode_rows``.

    Args:
        block_table: ``[B, max_pages]`` int32/int64.
        seq_lens: ``[B]`` int32/int64.
        query_len: ``Q >= 1``; ``Q == 1`` returns the inputs unchanged.
        causal: per-row causal extents, or ``L_b`` for every row.

    Returns:
        ``(block_table [B*Q, max_pages], seq_lens [B*Q])``.

    Traffic: reads ``B*(max_pages + 1)`` ints; writes ``Q`` times that.
    """
    # Plain torch ops, no kernel: any device is fine (kernel_arg=False).
    check_tensor("block_table", block_table, ndim=2, dtypes=_INDEX_DTYPES, unit_last_stride=False, kernel_arg=False)
    check_tensor("seq_lens", seq_lens, shape=(block_table.shape[0],), dtypes=_INDEX_DTYPES,
                 device=block_table.device, unit_last_stride=False, kernel_arg=False)  # fmt: skip
    check_positive("query_len", query_len)
    if query_len == 1:
        return block_table, seq_lens
    block_table = block_table.repeat_interleave(query_len, dim=0)
    if not causal:
        return block_table, seq_lens.repeat_interleave(query_len)
    offsets = torch.arange(1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
    return block_table, (seq_lens[:, None] + offsets[None, :]).flatten().clamp(min=0)


# ----------------------------------------------------------------------------------------------
# Stage 1.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tl has no tanh that runs compiled and interpreted alike; tanh(x) = 2 sigmoid(2x) - 1.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gather_tile(k_ptr, v_ptr, table_row_ptr, stride_t_p, num_pages, kv_head, tile, end,
                 stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
                 offs_d0, d0_ok, offs_d1, d1_ok, offs_dpe, dpe_ok, offs_dv, dv_ok,
                 D_FIRST: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_MLA: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_DPE: tl.constexpr, SPLIT_LATENT: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Keys ``[tile, tile + BLOCK_N)`` cut at ``end``, addressed one by one through the block table:
    ``(k0, k1, k_pe, v, tok_ok)``, zeros past ``end`` (unused pieces repeat ``k0``)."""
    toks = tile + tl.arange(0, BLOCK_N)
    tok_ok = toks < end
    page = tl.load(table_row_ptr + (toks // PAGE_SIZE) * stride_t_p, mask=tok_ok, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # in the cache (it has a page: wrapper)
    slot = (toks % PAGE_SIZE).to(tl.int64)
    k_rows = k_ptr + page.to(tl.int64) * stride_k_page + slot * stride_k_tok + kv_head * stride_k_head
    k0 = tl.load(k_rows[:, None] + offs_d0[None, :], mask=tok_ok[:, None] & d0_ok[None, :], other=0.0)
    k0 = k0.to(DOT_DTYPE)
    k1 = k0
    k_pe = k0
    if SPLIT_LATENT:
        k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=tok_ok[:, None] & d1_ok[None, :], other=0.0)
        k1 = k1.to(DOT_DTYPE)
    if BLOCK_DPE > 0:
        k_pe = tl.load(k_rows[:, None] + D_FIRST + offs_dpe[None, :], mask=tok_ok[:, None] & dpe_ok[None, :], other=0.0)
        k_pe = k_pe.to(DOT_DTYPE)
    if IS_MLA:
        v = k0  # BLOCK_D == BLOCK_DV and D_FIRST == LV: the latent tile is V
    else:
        v_rows = v_ptr + page.to(tl.int64) * stride_v_page + slot * stride_v_tok + kv_head * stride_v_head
        v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=tok_ok[:, None] & dv_ok[None, :], other=0.0)
        v = v.to(DOT_DTYPE)
    return k0, k1, k_pe, v, tok_ok


@triton.jit
def descriptor_tile(lat_desc, pe_desc, table_row_ptr, stride_t_p, num_pages, tile, PAGE_SIZE: tl.constexpr,
                    HALF: tl.constexpr, ROPE_COL: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """The MLA key tile starting at key ``tile`` (a multiple of the tile, inside one page) by tensor
    descriptors (``tma_layout``): ``(k0, k1, k_pe)``, the latent halves and the rope part at column
    ``ROPE_COL``. One table entry, clamped into the cache (a bad one poisons the split before the loop)."""
    page = tl.load(table_row_ptr + (tile // PAGE_SIZE) * stride_t_p)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    key_row = (page * PAGE_SIZE + tile % PAGE_SIZE).to(tl.int32)  # < 2**31: tma_layout checks
    k0 = lat_desc.load([key_row, 0]).to(DOT_DTYPE)
    k1 = lat_desc.load([key_row, HALF]).to(DOT_DTYPE)
    k_pe = pe_desc.load([key_row, ROPE_COL]).to(DOT_DTYPE)
    return k0, k1, k_pe


@triton.jit
def _attend_tile(q0, q1, q_pe, k0, k1, k_pe, v, tok_ok, m_i, l_i, acc0, acc1, qk_scale, logit_cap,
                 HAS_CAP: tl.constexpr, BLOCK_DPE: tl.constexpr, SPLIT_LATENT: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax (base 2): the scores of its keys where ``tok_ok``, then the
    running max ``m_i``, sum ``l_i`` and accumulators rescaled and updated. Every tile holds at least
    one live key, so the new max is finite (finite data)."""
    qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    if SPLIT_LATENT:
        qk += tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    if BLOCK_DPE > 0:
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    qk = qk * qk_scale
    if HAS_CAP:
        qk = logit_cap * _tanh(qk / logit_cap) * _LOG2E
    qk = tl.where(tok_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(DOT_DTYPE)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    if SPLIT_LATENT:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, k1, input_precision=DOT_PRECISION)
    return m_new, l_i, acc0, acc1


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, seq_lens_ptr, real_lens_ptr, k_scale_ptr, v_scale_ptr,
    lat_desc, pe_desc,
    sm_scale, logit_cap, window, num_kv_splits, num_pages, table_keys,
    stride_q_r, stride_q_h,
    stride_k_page, stride_k_tok, stride_k_head,
    stride_v_page, stride_v_tok, stride_v_head,
    stride_o_r, stride_o_h,
    stride_lse_r, stride_lse_h,
    stride_p_r, stride_p_h, stride_p_s,
    stride_t_r, stride_t_p, stride_sl, stride_rl,
    QLEN: tl.constexpr,
    HAS_REAL: tl.constexpr,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    D_FIRST: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_MLA: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_CAP: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    BF16_PARTIALS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SPLIT_LATENT: tl.constexpr,
    TMA: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid ``(KV_HEADS * HEAD_BLOCKS * R * S,)``: a program owns one split of one row for ``BLOCK_H`` of
    the ``GROUP`` query heads that share one KV head. The program id runs over the head blocks first, then the
    rows, then the splits, so that the head blocks of one KV head (MLA at 128 heads: two) run together and
    their second read of each key tile hits the L2 (MLA B=128 H=128 L=1K on the H200, this kernel forced: 146 ->
    140 us; ``decode_attention_sm90._decode_program`` has the Gluon kernel's numbers).

    Rows and table rows: with ``QLEN`` 1 (decode) row ``r`` has table row ``r`` and ``seq_lens[r]`` keys.
    With ``QLEN`` > 1 (verify, :func:`portable_stage1`) row ``r`` is draft token ``t = r % QLEN`` of request
    ``b = r // QLEN``: table row ``b`` and ``seq_lens[b] - QLEN + 1 + t`` keys (at most ``real_lens[b]`` with
    ``HAS_REAL``), its causal prefix.

    The query tile ``[BLOCK_H, Lk]`` is loaded once. Each K tile ``[BLOCK_N, Lk]`` (and V tile, or
    for MLA the first ``Lv`` columns of the same K tile) is read once and serves all ``BLOCK_H``
    heads through ``tl.dot``. Keys are addressed one by one through the block table (64-bit page
    offsets, page stride from the tensor), so split starts need no alignment. The key columns
    are read as two pieces, ``[0, D_FIRST)`` and ``[D_FIRST, Lk)``: for MLA the first piece is the
    latent ``[0, Lv)`` that is also V and the second the rope part; for GQA the first piece is all
    of K. Online softmax in base 2 (``sm_scale * log2 e``); the stored LSE is natural-log.

    Names as in the verify kernel (``mla_verify._fwd_verify_kernel_stage1``): ``q0``/``k0`` hold
    the first piece (its first half with ``SPLIT_LATENT``), ``q1``/``k1`` its second half, and
    ``q_pe``/``k_pe`` the rope part; ``acc0``/``acc1`` are the accumulators of the two halves.
    ``BLOCK_D``/``BLOCK_DV`` are the first piece's and V's tile widths and ``BLOCK_DPE`` the rope
    tile's, ``LK - D_FIRST`` padded to a power of two of at least 16 (0 without a rope part); the
    masks cut every tile at the true widths. ``SINGLE_SPLIT``: one split, results straight to
    ``o``/``lse``; else ``BF16_PARTIALS``: the partial outputs stored in bf16 (``lse_merge.partial_values``).

    ``SPLIT_LATENT`` (MLA): the latent tile, which is also V, is handled as two halves of
    ``BLOCK_D // 2`` columns, each with its own ``[BLOCK_H, BLOCK_D // 2]`` accumulator, as in the
    verify kernel: each product then fits one wgmma (N <= 256), and in the verify sweep 64-row
    tiles without the split failed to compile at 64-key tiles (``sweep_verify_h200.md`` records a
    CompilationError for each such config and no cause).

    ``TMA`` (MLA with ``SPLIT_LATENT``, pages a multiple of ``BLOCK_N`` keys, pages contiguous): the
    tiles of the split that start on a multiple of ``BLOCK_N`` and end by ``end`` lie in one page
    each and are loaded whole by tensor descriptors over the cache as ``[pages * PAGE_SIZE, Lk]``
    rows (``lat_desc``: ``[BLOCK_N, BLOCK_D // 2]`` blocks, ``pe_desc``: ``[BLOCK_N, BLOCK_DPE]``),
    one table entry a tile; the at most two partial tiles at the split's ends are gathered key by
    key with masks, so no key outside ``[start, end)`` reaches the value product (a NaN left in an
    unused slot of a page stays out). Otherwise every tile is gathered.
    """
    HALF: tl.constexpr = BLOCK_D // 2 if SPLIT_LATENT else BLOCK_D
    ACC_W: tl.constexpr = BLOCK_DV // 2 if SPLIT_LATENT else BLOCK_DV
    HEAD_PROGRAMS: tl.constexpr = KV_HEADS * HEAD_BLOCKS
    pid = tl.program_id(0)
    per_split = tl.num_programs(0) // num_kv_splits
    split = pid // per_split
    row = (pid % per_split // HEAD_PROGRAMS).to(tl.int64)
    request = row // QLEN  # the table row (decode: the row itself)
    pid_h = pid % HEAD_PROGRAMS
    kv_head = pid_h // HEAD_BLOCKS
    in_group = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = in_group < GROUP
    heads = kv_head * GROUP + in_group

    # This row's split [start, end) of its visible keys [lo, n): golden.decode_attention.split_bounds.
    n = tl.load(seq_lens_ptr + request * stride_sl).to(tl.int32)
    if QLEN > 1:
        n = n - QLEN + 1 + (row % QLEN).to(tl.int32)
    if HAS_REAL:
        n = tl.minimum(n, tl.load(real_lens_ptr + request * stride_rl).to(tl.int32))
    n = tl.maximum(n, 0)
    lo = tl.maximum(n - window, 0)
    chunk = tl.cdiv(n - lo, num_kv_splits)
    start = tl.minimum(lo + split * chunk, n)
    end = tl.minimum(start + chunk, n)
    # Memory safety without host checks: a row whose keys need a table column past the table
    # (``table_keys = columns * PAGE_SIZE``) is NaN in every split, and the loop stops at the table;
    # a split that meets a table entry outside the cache is NaN (its o and lse), found before the key
    # loop (triton_impl.block_table); the loop clamps each entry into the cache. No address outside
    # the cache is read.
    too_long = n > table_keys
    end = tl.minimum(end, table_keys).to(tl.int32)
    bad = first_bad_key(table_ptr + request * stride_t_r, stride_t_p, start, end, num_pages, PAGE_SIZE) < end

    offs_d0 = tl.arange(0, HALF)
    d0_ok = offs_d0 < D_FIRST
    offs_dv = tl.arange(0, ACC_W)
    dv_ok = offs_dv < LV
    q_rows = q_ptr + row * stride_q_r + heads[:, None].to(tl.int64) * stride_q_h
    q0 = tl.load(q_rows + offs_d0[None, :], mask=head_ok[:, None] & d0_ok[None, :], other=0.0).to(DOT_DTYPE)
    if SPLIT_LATENT:  # MLA: D_FIRST == LV, so the second half's masks serve the latent and V alike
        offs_d1 = HALF + tl.arange(0, HALF)
        d1_ok = offs_d1 < D_FIRST
        q1 = tl.load(q_rows + offs_d1[None, :], mask=head_ok[:, None] & d1_ok[None, :], other=0.0).to(DOT_DTYPE)
    if BLOCK_DPE > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        dpe_ok = offs_dpe < LK - D_FIRST
        q_pe = tl.load(q_rows + D_FIRST + offs_dpe[None, :], mask=head_ok[:, None] & dpe_ok[None, :], other=0.0)
        q_pe = q_pe.to(DOT_DTYPE)

    # FP8 codes are exact in bf16/fp16, so the tiles go to the dot undequantized and the scales
    # act on fp32 results: k_scale on the scores, v_scale on the output (for MLA, V is K: k_scale).
    qk_scale = sm_scale
    out_scale = 1.0
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)
        if IS_MLA:
            out_scale = tl.load(k_scale_ptr).to(tl.float32)
        else:
            out_scale = tl.load(v_scale_ptr).to(tl.float32)
    if not HAS_CAP:
        qk_scale = qk_scale * _LOG2E

    if not SPLIT_LATENT:  # placeholders: the tile helpers take every piece
        offs_d1, d1_ok, q1 = offs_d0, d0_ok, q0
    if BLOCK_DPE == 0:
        offs_dpe, dpe_ok, q_pe = offs_d0, d0_ok, q0
    table_row = table_ptr + request * stride_t_r
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, ACC_W), tl.float32)
    acc1 = acc0
    if TMA:
        whole_lo = tl.cdiv(start, BLOCK_N) * BLOCK_N  # tiles [whole_lo, whole_hi) lie in [start, end)
        whole_hi = tl.maximum(end // BLOCK_N * BLOCK_N, whole_lo)
        head_end = tl.minimum(whole_lo, end)
        all_live = tl.full((BLOCK_N,), 1, tl.int1)
        for tile in range(whole_lo, whole_hi, BLOCK_N):
            k0, k1, k_pe = descriptor_tile(lat_desc, pe_desc, table_row, stride_t_p, num_pages, tile, PAGE_SIZE,
                                           HALF, D_FIRST, DOT_DTYPE)  # fmt: skip
            m_i, l_i, acc0, acc1 = _attend_tile(q0, q1, q_pe, k0, k1, k_pe, k0, all_live, m_i, l_i, acc0, acc1,
                                                qk_scale, logit_cap, HAS_CAP, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
                                                DOT_PRECISION)  # fmt: skip
        # The partial tiles, at most one at each end: [start, head_end) and [whole_hi, end).
        for tile in tl.range(start, head_end, BLOCK_N, num_stages=1):
            k0, k1, k_pe, v, tok_ok = _gather_tile(
                k_ptr, v_ptr, table_row, stride_t_p, num_pages, kv_head, tile, head_end,
                stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
                offs_d0, d0_ok, offs_d1, d1_ok, offs_dpe, dpe_ok, offs_dv, dv_ok,
                D_FIRST, PAGE_SIZE, IS_MLA, BLOCK_N, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
            )  # fmt: skip
            m_i, l_i, acc0, acc1 = _attend_tile(q0, q1, q_pe, k0, k1, k_pe, v, tok_ok, m_i, l_i, acc0, acc1,
                                                qk_scale, logit_cap, HAS_CAP, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
                                                DOT_PRECISION)  # fmt: skip
        for tile in tl.range(whole_hi, end, BLOCK_N, num_stages=1):
            k0, k1, k_pe, v, tok_ok = _gather_tile(
                k_ptr, v_ptr, table_row, stride_t_p, num_pages, kv_head, tile, end,
                stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
                offs_d0, d0_ok, offs_d1, d1_ok, offs_dpe, dpe_ok, offs_dv, dv_ok,
                D_FIRST, PAGE_SIZE, IS_MLA, BLOCK_N, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
            )  # fmt: skip
            m_i, l_i, acc0, acc1 = _attend_tile(q0, q1, q_pe, k0, k1, k_pe, v, tok_ok, m_i, l_i, acc0, acc1,
                                                qk_scale, logit_cap, HAS_CAP, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
                                                DOT_PRECISION)  # fmt: skip
    else:
        for tile in range(start, end, BLOCK_N):
            k0, k1, k_pe, v, tok_ok = _gather_tile(
                k_ptr, v_ptr, table_row, stride_t_p, num_pages, kv_head, tile, end,
                stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
                offs_d0, d0_ok, offs_d1, d1_ok, offs_dpe, dpe_ok, offs_dv, dv_ok,
                D_FIRST, PAGE_SIZE, IS_MLA, BLOCK_N, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
            )  # fmt: skip
            m_i, l_i, acc0, acc1 = _attend_tile(q0, q1, q_pe, k0, k1, k_pe, v, tok_ok, m_i, l_i, acc0, acc1,
                                                qk_scale, logit_cap, HAS_CAP, BLOCK_DPE, SPLIT_LATENT, DOT_DTYPE,
                                                DOT_PRECISION)  # fmt: skip

    # An empty split is the neutral state (0, -inf): stage 2 then needs no boundaries.
    empty = end <= start
    row_scale = tl.where(empty, 0.0, out_scale / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    row_scale = tl.where(too_long | bad, float("nan"), row_scale)
    lse = tl.where(too_long | bad, float("nan"), lse)
    head_offs = heads.to(tl.int64)
    out0 = acc0 * row_scale[:, None]
    out0_mask = head_ok[:, None] & dv_ok[None, :]
    if SPLIT_LATENT:
        out1 = acc1 * row_scale[:, None]
        out1_mask = head_ok[:, None] & d1_ok[None, :]
    if SINGLE_SPLIT:
        o_rows = o_ptr + row * stride_o_r + head_offs[:, None] * stride_o_h
        tl.store(o_rows + offs_dv[None, :], cast_for_store(out0, o_ptr.dtype.element_ty), mask=out0_mask)
        if SPLIT_LATENT:
            tl.store(o_rows + offs_d1[None, :], cast_for_store(out1, o_ptr.dtype.element_ty), mask=out1_mask)
        lse_out = lse_ptr + row * stride_lse_r + head_offs * stride_lse_h
        tl.store(lse_out, cast_for_store(lse, lse_ptr.dtype.element_ty), mask=head_ok)
    else:
        p_rows = part_ptr + row * stride_p_r + head_offs * stride_p_h + split * stride_p_s
        values = partial_values(p_rows, BF16_PARTIALS)
        tl.store(values[:, None] + offs_dv[None, :], cast_for_store(out0, values.dtype.element_ty), mask=out0_mask)
        if SPLIT_LATENT:
            tl.store(values[:, None] + offs_d1[None, :], cast_for_store(out1, values.dtype.element_ty), mask=out1_mask)
        tl.store(p_rows + LV, lse, mask=head_ok)


# ----------------------------------------------------------------------------------------------
# Public wrapper.
# ----------------------------------------------------------------------------------------------


def _paged_strides(name: str, buf: torch.Tensor, page_size: int) -> tuple[int, int, int, int]:
    """``(num_pages, page_stride, token_stride, head_stride)`` of a 3-D or 4-D cache.

    The page stride is read from the tensor: a per-layer view into a cross-layer cache has a
    larger one than ``page_size * token_stride``.
    """
    sizes, strides = buf.shape, buf.stride()
    if len(sizes) == 4:
        if sizes[1] != page_size:
            raise ValueError(f"{name}: expected [num_pages, {page_size}, HKV, D], got {list(sizes)}")
        return sizes[0], strides[0], strides[1], strides[2]
    if sizes[0] % page_size:
        raise ValueError(f"{name}: {sizes[0]} tokens is not a multiple of page_size={page_size}")
    return sizes[0] // page_size, strides[0] * page_size, strides[0], strides[1]


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    req_to_token: torch.Tensor,
    b_seq_len: torch.Tensor,
    attn_logits: torch.Tensor | None,
    num_kv_splits: int,
    sm_scale: float,
    page_size: int = 1,
    logit_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    is_mla: bool = False,
    sliding_window: int | None = None,
    *,
    config: dict[str, int] | None = None,
) -> None:
    """Split-KV decode attention, one KV extent and block-table row per query row (vLLM signature).

    Row ``r`` sees keys ``[lo, n)``, ``n = b_seq_len[r]``, ``lo = max(0, n - W)`` with a window;
    ``s = sm_scale * q . K`` (then ``cap * tanh(s / cap)`` when ``logit_cap > 0``);
    ``o = softmax(s) @ V``, ``lse = ln sum exp s``. Rows with no key get ``(0, -inf)``.
    Golden: ``golden.decode_attention.decode_attention`` (stage 1 alone:
    ``decode_attention_splits``). Paper: papers.md#decode-attention.

    Args:
        q: ``[R, H, Lk]`` bf16/fp16/fp32 (unit last stride; row and head strides free).
        k_buffer: ``[num_pages, page_size, HKV, Lk]`` (any page stride, e.g. a cross-layer view) or
            ``[num_pages * page_size, HKV, Lk]``; the query dtype or ``float8_e4m3fn``.
        v_buffer: like ``k_buffer`` with width ``Lv``, same dtype. MLA: a view ``k_buffer[..., :Lv]``,
            of which only the width is used (V is read from the K tile).
        o: ``[R, H, Lv]`` fp32/fp16/bf16, written.
        lse: ``[R, H]`` fp32 (or fp16/bf16 as serving passes it), written, natural-log.
        req_to_token: ``[>= R, max_pages]`` (or ``[>= R, max_pages, 1]``) int32/int64 block table,
            any strides; row ``r`` serves query row ``r``. Entries covering ``[0, n)`` should
            address a page: one that does not (or a row longer than the table) makes that row
            ``o = lse = NaN`` and is never dereferenced. Entries past ``n`` are never read.
        b_seq_len: ``[>= R]`` int32/int64 extents (``<= 0``: empty row).
        attn_logits: ``[>= R, H, S, Lv+1]`` fp32 split scratch (a worst-case workspace works), or
            None when ``S == 1``. Each split's record holds its partial output (for a bf16 ``o`` in bf16,
            two values a fp32 slot: ``lse_merge.bf16_partials``) and its LSE in slot ``Lv``.
        num_kv_splits: ``S >= 1``; splits cover the visible window, so ``S`` past the window length
            only adds empty splits. On a GPU whose config caps splits (``stage1_splits``: the H200's
            does), stage 1 runs ``min(S, cap)`` splits when ``S`` programs per row would overfill
            the GPU, and only those slots of ``attn_logits`` are written; with ``S == 1`` nothing
            changes (and a row's bits then depend on that row alone).
        sm_scale: softmax scale. page_size: tokens per page (default 1: a token-level table).
        logit_cap: ``0`` (none) or ``> 0``.
        k_scale, v_scale: one-element fp32 tensors dequantizing an FP8 cache, or None (1); ignored
            for a 16-bit cache; MLA's V uses ``k_scale`` (it is part of K).
        is_mla: one latent KV head, V = first ``Lv`` columns of K; ``Lv`` and ``Lk - Lv`` powers of
            two (``Lk - Lv = 0`` allowed).
        sliding_window: ``W > 0`` keys (the row's last key included) or ``None``/``0``.
        config: launch config override (keys of ``DECODE_CONFIGS``' entries), for sweeps and tests;
            default ``select_decode_config(device, is_mla, Lv)``.

    Content checks (opt-in on CUDA, see ``triton_impl.validation``) look at the table entries on
    the host; with them off the call never synchronizes. CUDA graphs: capture with the largest
    ``R`` and ``S`` the graph serves and replay with new ``b_seq_len`` / ``req_to_token`` contents
    written in place; the tensors (their addresses and shapes), ``num_kv_splits``, ``sm_scale``,
    ``page_size``, ``logit_cap``, ``is_mla`` and ``sliding_window`` stay fixed across replays.

    Traffic: reads ``R*H*Lk`` query elements and per row its ``n - lo`` visible keys once per KV
    head (``Lk`` cache elements each for MLA, ``Lk + Lv`` for GQA; MLA with ``H > BLOCK_H`` re-reads
    them per head block, from L2); with ``S > 1`` writes and re-reads ``R*H*S*(Lv+1)`` fp32
    partials (a bf16 output: ``R*H*S*(Lv/2+1)``, its values in bf16); writes ``R*H*Lv`` + ``R*H`` outputs.
    """
    device_index, stream = current_target()
    try:
        key = (device_index, tensor_facts(q), tensor_facts(k_buffer), tensor_facts(v_buffer), tensor_facts(o),
               tensor_facts(lse), tensor_facts(req_to_token), tensor_facts(b_seq_len), tensor_facts(attn_logits),
               num_kv_splits, type(num_kv_splits), sm_scale, page_size, type(page_size), logit_cap, type(logit_cap),
               tensor_facts(k_scale), tensor_facts(v_scale), is_mla, sliding_window, type(sliding_window))  # fmt: skip
        plan = _PLANS.get(key) if config is None else None
    except (AttributeError, TypeError, ValueError):  # a non-tensor or unhashable argument: the checks name it
        key, plan = None, None
    if plan is None:
        plan = _plan_decode(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits,
                            sm_scale, page_size, logit_cap, k_scale, v_scale, is_mla, sliding_window,
                            config)  # fmt: skip
        if key is not None and config is None:
            _PLANS.add(key, plan)
    if content_checks_on(plan.on_cuda):
        table = block_table_2d("req_to_token", req_to_token, min_rows=0, device=q.device, dtypes=_INDEX_DTYPES)
        check_block_table("req_to_token", table, b_seq_len[: plan.num_rows], page_size, plan.num_pages, "b_seq_len")
    unit = plan.unit_scale
    lat_desc, pe_desc = plan.descriptors(k_buffer, plan.tma)
    plan.stage1(stream, q, k_buffer, v_buffer, o, lse, o if plan.merge is None else attn_logits, req_to_token,
                b_seq_len, b_seq_len, unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
                lat_desc, pe_desc)  # fmt: skip
    if plan.merge is not None:
        plan.merge(stream, attn_logits, o, lse)


class _DecodePlan(NamedTuple):
    """A checked call layout of :func:`decode_attention_fwd` and what it launches."""

    stage1: Callable[..., None]  # (stream, q, k, v, o, lse, part, table, lens, lens, k_scale, v_scale, lat, pe)
    merge: Callable[..., None] | None  # (stream, attn_logits, o, lse); None: one split, stage 1 writes o, lse
    # (no_launch: stage 1 merges its splits itself, decode_attention_sm90.merges_in_cluster)
    unit_scale: torch.Tensor  # k_scale / v_scale when None
    tma: tuple | None  # (shape, strides, latent block, rope block) of the cache's descriptors, or None
    descriptors: Callable[..., tuple]  # (k_buffer, tma) -> the (latent, rope) descriptors stage 1 takes
    num_rows: int
    num_pages: int
    on_cuda: bool  # where the content checks would read (see content_checks_on)


# Plans by call key (``triton_impl.validation`` says what a key holds).
_PLANS = Plans()


def _plan_decode(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
                 page_size, logit_cap, k_scale, v_scale, is_mla, sliding_window, config) -> _DecodePlan:  # fmt: skip
    """The argument checks of :func:`decode_attention_fwd` (all but the content checks) and its launches."""
    check_tensor("q", q, ndim=3, dtypes=_Q_DTYPES)
    num_rows, num_heads, key_width = q.shape
    device = q.device
    cache_dtypes = (q.dtype, torch.float8_e4m3fn)
    check_tensor("k_buffer", k_buffer, ndim=(3, 4), dtypes=cache_dtypes, device=device)
    check_tensor("v_buffer", v_buffer, ndim=k_buffer.dim(), dtypes=(k_buffer.dtype,), device=device)
    check_positive("page_size", page_size)
    check_positive("num_kv_splits", num_kv_splits)
    check_float("sm_scale", sm_scale)
    check_flag("is_mla", is_mla)
    num_pages, stride_k_page, stride_k_tok, _ = _paged_strides("k_buffer", k_buffer, page_size)
    _paged_strides("v_buffer", v_buffer, page_size)  # its layout checks; the launch takes its strides
    if k_buffer.shape[-1] != key_width:
        raise ValueError(f"k_buffer: expected key width {key_width} (q's), got {k_buffer.shape[-1]}")
    num_kv_heads, value_width = k_buffer.shape[-2], v_buffer.shape[-1]
    if v_buffer.shape[:-1] != k_buffer.shape[:-1]:
        raise ValueError(f"v_buffer: expected shape {[*k_buffer.shape[:-1], value_width]}, got {list(v_buffer.shape)}")
    if num_kv_heads < 1:
        raise ValueError(f"k_buffer: expected at least one KV head, got shape {list(k_buffer.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} query heads is not a multiple of k_buffer's {num_kv_heads} KV heads")
    if is_mla:
        if num_kv_heads != 1:
            raise ValueError(f"k_buffer: MLA expects one latent KV head, got {num_kv_heads}")
        if value_width > key_width:
            raise ValueError(f"v_buffer: MLA value width {value_width} exceeds the key width {key_width}")
        check_power_of_two("v_buffer width (MLA Lv)", value_width)
        check_power_of_two("rope width (MLA Lk - Lv)", key_width - value_width, allow_zero=True)
    check_tensor("o", o, shape=(num_rows, num_heads, value_width), dtypes=_OUT_DTYPES, device=device)
    check_tensor("lse", lse, shape=(num_rows, num_heads), dtypes=_OUT_DTYPES, device=device, unit_last_stride=False)
    req_to_token = block_table_2d("req_to_token", req_to_token, min_rows=num_rows, device=device, dtypes=_INDEX_DTYPES)
    check_lengths("b_seq_len", b_seq_len, num_rows, device, _INDEX_DTYPES)
    single = num_kv_splits == 1
    if not single:
        check_split_workspace(attn_logits, num_rows, num_heads, num_kv_splits, value_width, device)
    if isinstance(logit_cap, bool) or not isinstance(logit_cap, (int, float)) or not 0 <= logit_cap < math.inf:
        raise ValueError(f"logit_cap: expected a float >= 0, finite (0: no cap), got {logit_cap!r}")
    if sliding_window is not None and not (is_int(sliding_window) and sliding_window >= 0):
        raise ValueError(f"sliding_window: expected None, 0 or a positive int, got {sliding_window!r}")
    unit_scale = check_scale("k_scale", None, device)
    check_scale("k_scale", k_scale, device)
    check_scale("v_scale", v_scale, device)
    make_plan = partial(_DecodePlan, unit_scale=unit_scale, num_rows=num_rows, num_pages=num_pages,
                        on_cuda=device.type == "cuda")  # fmt: skip
    if num_rows == 0 or num_heads == 0:
        return make_plan(no_launch, None, tma=None, descriptors=tma_descriptors)
    if num_pages == 0:  # the kernels read page 0 in place of a bad entry
        raise ValueError(f"k_buffer: expected at least one page, got shape {list(k_buffer.shape)}")

    _, block_d, block_dv, block_dpe = _tile_widths(key_width, value_width, is_mla)
    group = num_heads // num_kv_heads
    if config is None:
        config = select_decode_config(device, is_mla, block_dv)
    elif missing := _CONFIG_KEYS - set(config):
        raise ValueError(f"config: missing keys {sorted(missing)} (expected those of DECODE_CONFIGS' entries)")
    block_h, config = tile_config(config, group)
    head_blocks = cdiv(group, block_h)
    split_latent = is_mla and bool(config.get("SPLIT_LATENT", 0)) and block_dv >= 32
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    tma = None
    if split_latent and config.get("GLUON"):
        tma = tma_layout(k_buffer, page_size, stride_k_page, stride_k_tok, num_pages, 64, block_d, block_dpe)
    # The sm_90 fast paths (triton_impl/decode_attention_sm90.py): same partials, hand-made schedules.
    served = dict(device=device, is_mla=is_mla, key_width=key_width, value_width=value_width, q=q,
                  cache_dtype=k_buffer.dtype, rows=group, page_size=page_size, tma_rows=tma is not None)
    gluon = None
    if config.get("GLUON") and decode_attention_sm90.supports(**served):
        gluon = decode_attention_sm90.mla_decode_stage1_kernel
        head_blocks = cdiv(group, int(decode_attention_sm90.BLOCK_H))
    elif config.get("GLUON_FEW") and decode_attention_sm90.supports_few_rows(**served):
        gluon, head_blocks = decode_attention_sm90.mla_decode_few_rows_kernel, 1
        config = {**config, "PROGRAMS_PER_SM": 1}  # 164 KiB of shared memory a program
    num_kv_splits = stage1_splits(num_kv_splits, num_rows * num_kv_heads * head_blocks, sm_count, config)
    if num_kv_splits == 1 and not single:
        single = True  # capped to one split: stage 1 writes o and lse, attn_logits is not touched
    part_strides = (0, 0, 0) if single else attn_logits.stride()[:3]  # with one split, o stands in for part
    bf16_values = bf16_partials(o.dtype)
    if gluon is not None:
        constexprs = dict(GROUP=group, PAGE_SIZE=page_size, HAS_CAP=logit_cap > 0, SINGLE_SPLIT=single,
                          BF16_PARTIALS=bf16_values, num_warps=int(decode_attention_sm90.NUM_WARPS))  # fmt: skip
        cluster = 1
        if gluon is decode_attention_sm90.mla_decode_few_rows_kernel:
            # The splits of a row as one thread-block cluster that merges them (no merge kernel, nor its launch gap).
            merged = config.get("CLUSTER_MERGE", 0) and not single and decode_attention_sm90.merges_in_cluster(
                device, num_rows, num_kv_splits)  # fmt: skip
            constexprs["CLUSTER_MERGE"] = bool(merged)
            cluster = num_kv_splits if merged else 1
        else:
            constexprs["LEAN_SOFTMAX"] = decode_attention_sm90.uses_lean_softmax(config, sm_scale)
            constexprs["RESCALE_IF_GREW"] = bool(config.get("RESCALE_IF_GREW"))
        stage1 = Launch(gluon, (head_blocks * num_rows * num_kv_splits,), (
            float(sm_scale), float(logit_cap), sliding_window or _NO_WINDOW, num_kv_splits,
            num_pages, req_to_token.shape[1] * page_size,
            *q.stride()[:2], *o.stride()[:2], *lse.stride(), *part_strides,
            *req_to_token.stride(), b_seq_len.stride(0),
        ), constexprs, cluster=cluster)  # fmt: skip
        merge = None if single else no_launch if cluster > 1 else merge_splits_launch(
            num_rows, attn_logits[:, :, :num_kv_splits], o, lse, bf16_values=bf16_values)  # fmt: skip
        return make_plan(stage1, merge, tma=tma, descriptors=DescriptorsByAddress(decode_attention_sm90.descriptors))
    stage1, tma = portable_stage1(q, k_buffer, v_buffer, o, lse, req_to_token, part_strides, b_seq_len.stride(0),
                                  num_kv_splits=num_kv_splits, sm_scale=sm_scale, logit_cap=logit_cap,
                                  window=sliding_window, page_size=page_size, num_pages=num_pages, is_mla=is_mla,
                                  single=single, config=config)  # fmt: skip
    merge = None if single else merge_splits_launch(num_rows, attn_logits[:, :, :num_kv_splits], o, lse,
                                                    bf16_values=bf16_values)  # fmt: skip
    return make_plan(stage1, merge, tma=tma, descriptors=DescriptorsByAddress(tma_descriptors))


def _tile_widths(key_width: int, value_width: int, is_mla: bool) -> tuple[int, int, int, int]:
    """``(D_FIRST, BLOCK_D, BLOCK_DV, BLOCK_DPE)`` of :func:`_decode_stage1_kernel` (its docstring says what each
    is): MLA's first piece is the latent (also V), GQA's all of K; tiles are powers of two of at least 16."""
    block_dv = max(16, next_pow2(value_width))
    d_first = value_width if is_mla else key_width
    block_d = block_dv if is_mla else max(16, next_pow2(key_width))
    rope_width = key_width - d_first
    return d_first, block_d, block_dv, max(16, next_pow2(rope_width)) if rope_width else 0


def portable_stage1(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, table: torch.Tensor, part_strides: tuple[int, int, int], seq_len_stride: int, *,
                    num_kv_splits: int, sm_scale: float, logit_cap: float, window: int | None, page_size: int,
                    num_pages: int, is_mla: bool, single: bool, config: dict[str, int] | None, qlen: int = 1,
                    has_real: bool = False, real_len_stride: int = 0) -> tuple[Launch, tuple | None]:  # fmt: skip
    """The launch of :func:`_decode_stage1_kernel` for checked arguments, and the cache's :func:`tma_layout` (None:
    gathers), to be called as ``(stream, q, k, v, o, lse, part, table, seq_lens, real_lens, k_scale, v_scale, lat,
    pe)``. ``table``: the 2-D block table; ``part_strides``: the partials' row, head and split strides (zeros with
    ``single``, where ``o`` stands in for them); ``config``: a ``DECODE_CONFIGS`` entry (None: the device's, as
    :func:`select_decode_config` gives it). Decode has one query row
    per table row; ``mla_verify`` (``qlen`` > 1) passes ``B * qlen`` query rows over ``B`` table rows, each row
    its draft token's causal prefix (``has_real``: capped by ``real_seq_lens``)."""
    num_rows, num_heads, key_width = q.shape
    num_kv_heads, value_width = k_buffer.shape[-2], v_buffer.shape[-1]
    d_first, block_d, block_dv, block_dpe = _tile_widths(key_width, value_width, is_mla)
    if config is None:
        config = select_decode_config(q.device, is_mla, block_dv)
    group = num_heads // num_kv_heads
    block_h, config = tile_config(config, group)
    head_blocks = cdiv(group, block_h)
    split_latent = is_mla and bool(config.get("SPLIT_LATENT", 0)) and block_dv >= 32
    _, stride_k_page, stride_k_tok, stride_k_head = _paged_strides("k_buffer", k_buffer, page_size)
    _, stride_v_page, stride_v_tok, stride_v_head = _paged_strides("v_buffer", v_buffer, page_size)
    tma = None
    if split_latent and config.get("TMA"):
        tma = tma_layout(k_buffer, page_size, stride_k_page, stride_k_tok, num_pages, config["BLOCK_N"], block_d,
                         block_dpe)  # fmt: skip
    grid = (num_kv_heads * head_blocks * num_rows * num_kv_splits,)
    stage1 = Launch(_decode_stage1_kernel, grid, (
        float(sm_scale), float(logit_cap), window or _NO_WINDOW, num_kv_splits,
        num_pages, table.shape[1] * page_size,
        *q.stride()[:2],
        stride_k_page, stride_k_tok, stride_k_head,
        stride_v_page, stride_v_tok, stride_v_head,
        *o.stride()[:2],
        *lse.stride(),
        *part_strides,
        *table.stride(), seq_len_stride, real_len_stride,
    ), dict(
        QLEN=qlen,
        HAS_REAL=has_real,
        GROUP=group,
        KV_HEADS=num_kv_heads,
        HEAD_BLOCKS=head_blocks,
        LK=key_width,
        LV=value_width,
        D_FIRST=d_first,
        PAGE_SIZE=page_size,
        IS_MLA=is_mla,
        IS_FP8=k_buffer.dtype != q.dtype,
        HAS_CAP=logit_cap > 0,
        SINGLE_SPLIT=single,
        BF16_PARTIALS=bf16_partials(o.dtype),
        BLOCK_H=block_h,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        SPLIT_LATENT=split_latent,
        TMA=tma is not None,
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 queries: no TF32 truncation
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **register_cap(config.get("maxnreg")),
    ))  # fmt: skip
    return stage1, tma


# ----------------------------------------------------------------------------------------------
# Decode context parallelism over torch.distributed.
# ----------------------------------------------------------------------------------------------


def decode_attention_dcp(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    req_to_token: torch.Tensor,
    b_seq_len: torch.Tensor,
    attn_logits: torch.Tensor | None,
    num_kv_splits: int,
    sm_scale: float,
    page_size: int,
    group: dist.ProcessGroup | None = None,
    logit_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    is_mla: bool = False,
) -> None:
    """Decode attention with each request's keys spread over the ranks of a process group (DCP).

    Every rank holds the full query ``q`` and a disjoint part of each row's keys (striped or sliced:
    ``golden.decode_attention.dcp_local_positions``) in its own paged cache, addressed by its own
    ``req_to_token`` and local extents ``b_seq_len``. Each rank computes its partial state
    ``(o_k, lse_k)`` with :func:`decode_attention_fwd` into one packed fp32 buffer
    ``[R, H, Lv+1]`` (output, then natural-log LSE), the ranks exchange the packed states with one
    ``all_gather`` and every rank merges the ``N`` states exactly with the split merge
    (``merge_splits``: ``o = sum_k e^(lse_k - M) o_k / sum_k e^(lse_k - M)``,
    ``lse = M + ln sum_k e^(lse_k - M)``). A rank holding no key of a row contributes ``(0, -inf)``.
    All-gather rather than LSE all-gather + reduce-scatter (vLLM's ``cp_lse_ag_out_rs``): one
    collective, every rank ends with every head, and the merge is the tested stage-2 kernel.

    Args:
        q, k_buffer, v_buffer: as :func:`decode_attention_fwd`, for this rank's keys.
        req_to_token, b_seq_len: this rank's block table and local extents.
        attn_logits, num_kv_splits, sm_scale, page_size: as :func:`decode_attention_fwd`.
        logit_cap, k_scale, v_scale, is_mla: as :func:`decode_attention_fwd`. No sliding window: a
            window over global positions is not a window over a rank's local keys (vLLM asserts
            the same).
        o: ``[R, H, Lv]`` fp32/fp16/bf16, written with the merged output on every rank.
        lse: ``[R, H]`` fp32/fp16/bf16, written with the merged natural-log LSE on every rank.
        group: the DCP process group (default: the world). Backend gloo (CPU) or NCCL (GPU).

    Traffic: this rank's local decode (see :func:`decode_attention_fwd`), plus an all-gather that
    sends ``R*H*(Lv+1)`` fp32 and receives ``N`` times that, and the merge of ``N`` states.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    check_tensor("o", o, ndim=3, dtypes=_OUT_DTYPES)
    num_rows, num_heads, value_width = o.shape
    world_size = dist.get_world_size(group)
    packed = torch.empty(num_rows, num_heads, value_width + 1, dtype=torch.float32, device=o.device)
    decode_attention_fwd(
        q, k_buffer, v_buffer, packed[..., :value_width], packed[..., value_width], req_to_token, b_seq_len,
        attn_logits, num_kv_splits, sm_scale, page_size, logit_cap=logit_cap, k_scale=k_scale, v_scale=v_scale,
        is_mla=is_mla,
    )  # fmt: skip
    check_tensor("lse", lse, shape=(num_rows, num_heads), dtypes=_OUT_DTYPES, device=o.device, unit_last_stride=False)
    gathered = torch.empty(world_size, num_rows, num_heads, value_width + 1, dtype=torch.float32, device=o.device)
    # all_gather into views of one buffer: the portable form (gloo rejects the stacked
    # all_gather_into_tensor layout, and torch 2.13 deprecates that function).
    dist.all_gather(list(gathered.unbind(0)), packed, group=group)
    launch_merge_splits(gathered.permute(1, 2, 0, 3), o, lse)
