"""MLA stage 1 on NVIDIA Hopper, in Gluon: the sm_90 fast path of
:func:`triton_impl.decode_attention.decode_attention_fwd` (MLA decode) and of
:func:`triton_impl.mla_verify.decode_attention_fwd_verify` (causal verify) for DeepSeek's latent cache (576 = 512 + 64).

The portable Triton kernels (``decode_attention._decode_stage1_kernel``, ``mla_verify._fwd_verify_kernel_stage1``)
compute the same partials and stay the readable twins (they run under the interpreter; this one does not). This
kernel writes down the schedule that Triton's compiler does not find for that loop. One program owns one split of
one request for 64 rows (decode: 64 query heads; verify: 64 (draft token, head) pairs, each with its causal
limit), one program per SM (224 KiB of shared memory: the query, two key tiles of 64 keys and ``P``), in three
warp-specialized partitions, which start as soon as the split's bounds are known:

- the loader (1 warp) brings each key tile by TMA (three boxes: latent ``[0, 256)``, ``[256, 512)``, rope)
  into one of two stages, as soon as both consumers have released the stage;
- the softmax warpgroup (4 warps) copies the query into shared memory (``cp.async``) while it checks the block
  table, then computes the scores ``S = Q K^T`` (``[64 heads, 64 keys]``, K = 576, ``wgmma`` from shared
  memory), the online softmax, hands ``P`` and the rescale factor to the other warpgroup through shared memory,
  and accumulates the first latent half of the output, ``O[:, :256] += P V[:, :256]`` with ``P`` from its
  registers;
- the value warpgroup (4 warps) accumulates the second half, ``O[:, 256:] += P V[:, 256:]``.

Each warpgroup stores its output half through the key stages of one latent half, free after the loop, so that a
warp's store covers 32 consecutive elements of one row; stored from the accumulator's layout, each store touched 8
rows (16 cache lines for fp32 partials), which took 19-20 us a program (``notebooks/results/mla_timeline_h200.md``).

Nothing is computed twice and the query is read from shared memory once per tile. The softmax warpgroup waits for
its half of tile ``i``'s value product, releases the tile's stage to the loader and only then issues tile ``i + 1``'s
scores, so the load two tiles ahead starts a score product (~1150 cycles) earlier than if it also waited for those
scores (3-13% faster on the H200); the value warpgroup's half runs beside the scores. The softmax itself runs with
the tensor cores idle, which with the wait for tiles (34% of the loop at B=32 H=128 L=32K) bounds the kernel now.
mbarriers order everything: ``k_full`` / ``k_free`` per stage (TMA landed / both warpgroups done with it),
``p_full`` / ``p_free`` for the ``P`` buffer (written / read), and after the loop ``p_full`` once more, for the row
scale the value warpgroup applies to its half.

Numerics are the portable kernel's: bf16 (or fp16) operands, ``P`` rounded to the query dtype, fp32 accumulation, online
softmax in base 2. ``LEAN_SOFTMAX`` (on in the sm90 entries; 0.7-2.7% off stage 1 on the H200, an FP8 cache within
noise) masks only the tiles some row does not see whole and folds the score scale into each exponent's fma
(:func:`_softmax`: the same row max, ``P`` rounded once where it was rounded twice). ``RESCALE_IF_GREW`` (on in the sm90
entries; 0.5-6.4% off stage 1) lets each warp of the value warpgroup skip its rescale where none of its rows' max grew
(:func:`_rescaled`: the same bits). Partial tiles at a split's
ends are loaded whole (their page holds them) and their keys outside the split are zeroed in shared memory before
any MMA reads them, so a NaN in an unused cache slot never reaches the value product.

An FP8 (e4m3) cache takes the same schedule with its codes widened in shared memory (:func:`_attend` says where
they live): TMA brings two stages of codes (36 KiB a tile), and each warpgroup widens its parts of a tile into one
16-bit tile once its last value product is done (the softmax warpgroup the first latent half and the rope part, the
value warpgroup the second half), exactly, since every e4m3 value is a bf16 and an fp16 value; the scale multiplies
the scores and the output, as in the portable kernels. bf16 is widened by integer moves and one exact multiply per
two codes (:data:`_E4M3_TO_BF16_ASM`: sm_90's conversion unit runs at a quarter of the integer pipe's rate, and
Triton's conversion takes two of its instructions a code). The shared memory holds one widened tile, no second:
the softmax warpgroup's widening runs beside the value warpgroup's product, the value warpgroup's beside the scores
of the first latent half and the rope part (``w_full`` then lets the second half's scores start). On the H200 an
FP8 verify tile takes ~5900 cycles against ~4200 for a 16-bit one (B=32 H=128 qlen=2 L=8K, stage 1 375 us); what
binds it is in ``notebooks/results/perf_log.md`` (twentieth and twenty-first sessions).

Served (:func:`supports`): compiled for compute capability 9.x, MLA with ``Lk = 576``, ``Lv = 512``, a 16-bit
cache of the query's dtype or an FP8 e4m3 cache (the 64-row schedule only), pages a multiple of 64 keys back to
back (the cache as ``[pages * page_size, 576]`` rows for TMA), a query whose address and row and head strides are
multiples of 16 bytes and 16 elements, ``MIN_ROWS`` (32) rows or more per request. Everything else runs the
portable kernels.

Decode with at most 16 heads (:func:`supports_few_rows`; a 64-row tile would be three-quarters empty) runs
:func:`mla_decode_few_rows_kernel` instead: one warpgroup takes the keys as wgmma's M, ``S^T = K Q^T`` (``[64 keys,
16 heads]``) and ``O^T = V^T P^T`` (two ``[256, 16]`` halves, V^T the key tile read transposed), with TMA two tiles
ahead; 164 KiB of shared memory, one program per SM. A tile costs the tensor cores 544 cycles against ~4000 of its
bytes at this SM's share of the copy bandwidth: the kernel streams keys. With 2 to 8 splits it can also merge them
(``CLUSTER_MERGE``, :func:`merges_in_cluster`): the splits of a row run as one thread-block cluster, wait for each
other at a cluster barrier once their partials are stored, and then each merges a share of the row's columns
(:func:`_merge_in_cluster`), so no merge kernel follows (decode B=8 H=16 L=4K on the H200: stage 1 16.3 us and the
merge 2.4 us behind a 1.2-1.7 us gap became one kernel of 18.2-18.4 us).

On the H200 (``notebooks/results/bench_h200.md``: ``attnref bench --op decode_attention --op mla_verify --case
bf16`` at a474ebd, FlashInfer 0.7 in the same run): decode B=32 H=128 L=32K 0.482 ms (FlashInfer 0.532 ms), B=1
H=128 L=32K 0.0276 ms (0.0382), verify B=16 H=128 qlen=8 L=4K 0.243 ms (0.244), B=32 H=128 qlen=4 L=32K 1.897 ms
(1.964), B=8 H=16 qlen=4 L=4K 0.0196 ms (0.0216); few rows: decode B=32 H=16 L=32K 0.281 ms (0.290), 100.8% of the
copy roofline measured in that run. ``notebooks/results/perf_log.md`` has what bounds it (the softmax warpgroup's
chain and two stages; at 132 busy SMs a tile took 2.05 us where FlashInfer's took 1.90, before ``RESCALE_IF_GREW``:
``notebooks/results/mla_rounds_h200.md``) and the variants that lost (the softmax pipelined under the value MMAs,
32-key tiles in four stages, twice).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triton_impl.launch import cluster_capacity, device_arch

LK = 576  # key width: latent + rope
LV = 512  # latent width, which is also V
HALF = gl.constexpr(256)  # the latent is moved and multiplied as two halves (TMA boxes and MMA N stay <= 256)
ROPE = gl.constexpr(64)
BLOCK_H = gl.constexpr(64)  # (query token, head) rows per program: wgmma's M
BLOCK_N = gl.constexpr(64)  # keys per tile
NUM_WARPS = gl.constexpr(4)  # the softmax warpgroup; the value warpgroup and the loader are workers
STAGES = gl.constexpr(2)
# The fewest (query token, head) rows per request the kernel is routed for: its wgmma tiles have 64 rows, and
# the empty ones cost compute. On the H200 (benchmarks/kernel_times.py) it beats the portable kernel at 32 rows
# (verify B=64 H=16 qlen=2 L=4K, stage 1 87.2 against 141.2 us) and ties at 16 (decode B=32 H=16 L=32K, 326.6
# against 326.9 us).
MIN_ROWS = 32
VALUE_REGS = gl.constexpr(208)  # registers per thread of the value warpgroup
LOADER_REGS = gl.constexpr(40)
_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
# A barrier of the warps running the code: Gluon's name for it changed (Triton 3.6 ``thread_barrier``, later
# ``barrier``).
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# The TMA load and the cp.async copy likewise (Triton 3.6 ``async_copy_global_to_shared``, later ``async_load``),
# and a shared buffer's view as another type (3.6 ``_reinterpret``, later ``reinterpret``).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_copy_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret

# Scores [64 rows, 64 keys] and each output half [64 rows, 256], one warpgroup each.
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
_O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
_P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT, k_width=2))
_ROWS = gl.constexpr(gl.SliceLayout(1, _O_LAYOUT))
_S_ROWS = gl.constexpr(gl.SliceLayout(1, _S_LAYOUT))
# Global <-> register tiles of 64 rows: 16-byte pieces, a warp covers 4 rows x 64 columns.
_ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
# The swizzled shared layout of every 16-bit tile (128-byte swizzle rows: 64 columns); per-row floats plain.
_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
_VEC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# An FP8 cache's codes as TMA lands them: the latent halves in 128-byte swizzle rows, the 64-byte rope rows in 64.
_SMEM8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
_SMEM8_PE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
# Codes -> 16-bit keys as 32-bit words, 4 words (16 codes) a thread: a warp covers 2 keys x 256 codes (latent), 8 x 64
# (rope); the 16-bit tiles' words in the same swizzle.
_WIDEN_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0]))
_WIDEN_PE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
_SMEM32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
# An output half on its way out, [64, 256] fp32 in the 64 KiB of a latent half's two key stages: 32-byte pieces
# swizzled by row, so the accumulator's stores (8 rows x 32 bytes a warp) and the row reads are conflict-free.
_OUT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [1, 0]))


def supports(*, device: torch.device, is_mla: bool, key_width: int, value_width: int, q: torch.Tensor,
             cache_dtype: torch.dtype, rows: int, page_size: int, tma_rows: bool) -> bool:  # fmt: skip
    """Whether a call is one this kernel serves (else the portable kernel runs). ``q``: the query ``[rows, heads,
    Lk]``, whose address and row and head strides must be multiples of 16 bytes and 16 elements (it is copied
    by ``cp.async`` in 16-byte pieces, which Triton proves aligned from those facts); ``rows``: the (query
    token, head) rows of one request (decode: the heads), at least ``MIN_ROWS``; ``tma_rows``: the cache is
    addressable as ``[pages * page_size, Lk]`` rows by tensor descriptors (``decode_attention.tma_layout`` is not
    None)."""
    return rows >= MIN_ROWS and _served(device, is_mla, key_width, value_width, q, cache_dtype, page_size, tma_rows)


def uses_lean_softmax(config: dict[str, Any], sm_scale: float) -> bool:
    """The 64-row kernels' ``LEAN_SOFTMAX`` under a launch config: where the config asks for it and the scale is
    positive (:func:`_softmax` takes the row max of unscaled scores, which only a positive scale keeps in order)."""
    return bool(config.get("LEAN_SOFTMAX")) and sm_scale > 0


def supports_few_rows(*, device: torch.device, is_mla: bool, key_width: int, value_width: int, q: torch.Tensor,
                      cache_dtype: torch.dtype, rows: int, page_size: int, tma_rows: bool) -> bool:  # fmt: skip
    """Whether a decode call is one :func:`mla_decode_few_rows_kernel` serves: as :func:`supports`, with at most
    16 heads (``rows``)."""
    return (rows <= FEW_ROWS and cache_dtype == q.dtype
            and _served(device, is_mla, key_width, value_width, q, cache_dtype, page_size, tma_rows))


def _served(device, is_mla, key_width, value_width, q, cache_dtype, page_size, tma_rows) -> bool:
    """What both schedules need (:func:`supports`), the row count aside."""
    served = is_mla and key_width == LK and value_width == LV and cache_dtype in (q.dtype, torch.float8_e4m3fn)
    served = served and q.dtype in (torch.bfloat16, torch.float16) and page_size % 64 == 0
    served = served and q.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in q.stride()[:2])
    return served and tma_rows and device_arch(device).startswith("sm9")


def descriptors(k_buffer: torch.Tensor, rows: tuple) -> tuple[Any, Any]:
    """``(latent, rope)`` tensor descriptors of the cache as rows (``rows``: ``decode_attention.tma_layout`` with
    64-key tiles: shape, strides, the ``[64, 256]`` latent and ``[64, 64]`` rope boxes). A plan remembers them by
    the cache's address (``launch.DescriptorsByAddress``)."""
    shape, strides, lat_box, pe_box = rows
    lat, pe = _tile_layouts(k_buffer.dtype.itemsize == 1)
    return (TensorDescriptor(k_buffer, shape, strides, lat_box, lat),
            TensorDescriptor(k_buffer, shape, strides, pe_box, pe))  # fmt: skip


def _tile_layouts(fp8: bool) -> tuple[Any, Any]:
    """The shared layouts TMA lands a tile's latent and rope parts in: 16-bit keys, or an FP8 cache's codes."""
    return (_SMEM8.value, _SMEM8_PE.value) if fp8 else (_SMEM.value, _SMEM.value)


@gluon.jit
def _zero_rows(buf, live):
    """Zero the rows of a ``[64, W]`` shared tile where ``live`` (``[64]``) is false."""
    x = buf.load(_ROWS_LAYOUT)
    live = gl.convert_layout(live, gl.SliceLayout(1, _ROWS_LAYOUT))
    buf.store(gl.where(live[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _issue_tile(lat_desc, pe_desc, bar, lat0, lat1, pe, table_row_ptr, stride_t_p, num_pages, tile,
                PAGE_SIZE: gl.constexpr):  # fmt: skip
    """Start the TMA loads of the key tile at key ``tile`` (a multiple of 64, inside one page) into one
    stage; ``bar`` completes when its bytes have landed. The table entry is clamped into the cache (a bad
    entry has poisoned its rows already)."""
    page = gl.load(table_row_ptr + (tile // PAGE_SIZE) * stride_t_p)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1)
    key_row = (page * PAGE_SIZE + tile % PAGE_SIZE).to(gl.int32)  # < 2**31: the host checks
    mbarrier.expect(bar, BLOCK_N * (2 * HALF + ROPE) * lat_desc.dtype.primitive_bitwidth // 8)
    _tma_load(lat_desc, [key_row, 0], bar, lat0)
    _tma_load(lat_desc, [key_row, HALF], bar, lat1)
    _tma_load(pe_desc, [key_row, 2 * HALF], bar, pe)


@gluon.jit
def _first_bad_key(table_row_ptr, stride_t_p, start, end, num_pages, PAGE_SIZE: gl.constexpr):
    """The first key in ``[start, end)`` whose table entry lies outside ``[0, num_pages)``, else ``end``
    (``triton_impl.block_table.first_bad_key`` for this kernel's layouts)."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [NUM_WARPS], [0])
    first = start // PAGE_SIZE
    last = gl.where(end > start, gl.cdiv(end, PAGE_SIZE), first)
    found = gl.full([256], 0, gl.int32, layout=layout) + end
    for p0 in range(first, last, 256):
        p = p0 + gl.arange(0, 256, layout=layout)
        entry = gl.load(table_row_ptr + p * stride_t_p, mask=p < last, other=0)
        bad = (p < last) & ((entry < 0) | (entry >= num_pages))
        found = gl.minimum(found, gl.where(bad, gl.maximum(p * PAGE_SIZE, start), end))
    return gl.min(found, axis=0)


@gluon.jit
def _rows(request, row_block, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr, LAYOUT: gl.constexpr):
    """This program's 64 rows as ``(query row r, head h, token t within the request, row in range)``: row
    ``i = row_block * 64 + m`` of request ``request`` is token ``t = i // NUM_HEADS``, head ``i % NUM_HEADS``."""
    i = row_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=LAYOUT)
    ok = i < QLEN * NUM_HEADS
    i = gl.where(ok, i, 0)
    t = i // NUM_HEADS
    return request * QLEN + t, i % NUM_HEADS, t, ok


@gluon.jit
def _loader(lat_desc, pe_desc, k_s0, k_s1, k_spe, k_full, k_free, table_row, stride_t_p, num_pages, first_tile,
            num_tiles, PAGE_SIZE: gl.constexpr):  # fmt: skip
    """The loader partition: tile ``i`` into stage ``i % STAGES`` once both warpgroups freed it."""
    for i in range(num_tiles):
        stage = i % STAGES
        if i >= STAGES:
            mbarrier.wait(k_free.index(stage), (i // STAGES - 1) & 1)
        _issue_tile(lat_desc, pe_desc, k_full.index(stage), k_s0.index(stage), k_s1.index(stage), k_spe.index(stage),
                    table_row, stride_t_p, num_pages, first_tile + i * BLOCK_N, PAGE_SIZE)  # fmt: skip


@gluon.jit
def _values(k_s1, codes1, p_s, vec_s, k_full, k_free, w_full, p_full, p_free, first_tile, num_tiles, start, tile_end,
            out_ptr, stride_out_r, stride_out_h, request, row_block, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr,
            OUT_VEC: gl.constexpr, RESCALE_IF_GREW: gl.constexpr):  # fmt: skip
    """The value warpgroup: ``O[:, 256:]``, rescaled by each tile's factor and finally by the row scale that the
    softmax warpgroup leaves in ``vec_s`` after the loop, stored at ``out_ptr`` (partials or the output). With an
    FP8 cache it first widens each tile's second latent half (``codes1`` -> :func:`_key_tile` of ``k_s1``)."""
    FP8: gl.constexpr = codes1.dtype.primitive_bitwidth == 8
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=_O_LAYOUT)
    for i in range(num_tiles):
        stage = i % STAGES
        if FP8:
            _widen_parts(codes1, k_s1.index(0), None, None, k_full, k_free, w_full, i, first_tile, start, tile_end)
        else:
            mbarrier.wait(k_full.index(stage), (i // STAGES) & 1)
        mbarrier.wait(p_full, i & 1)
        alpha = vec_s.load(_ROWS)
        acc = warpgroup_mma(p_s, _key_tile(k_s1, i, FP8), _rescaled(acc, alpha, RESCALE_IF_GREW),
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        mbarrier.arrive(p_free, count=1)
        if not FP8:
            mbarrier.arrive(k_free.index(stage), count=1)
    mbarrier.wait(p_full, num_tiles & 1)  # the row scale, handed over once every MMA of the loop is done
    row_scale = vec_s.load(_ROWS)
    _store_half(acc * row_scale[:, None], k_s1, out_ptr + HALF, stride_out_r, stride_out_h, request, row_block, QLEN,
                NUM_HEADS, OUT_VEC)  # fmt: skip


@gluon.jit
def _store_half(acc, stages, out_ptr, stride_out_r, stride_out_h, request, row_block, QLEN: gl.constexpr,
                NUM_HEADS: gl.constexpr, VEC: gl.constexpr):  # fmt: skip
    """Store an output half ``[64, 256]`` at ``out_ptr`` (its first column) by way of shared memory: ``stages``
    (the two key stages of one latent half, which no MMA reads any more) hold it while each warp reads whole row
    pieces back, ``VEC`` elements a thread (:func:`_store_vec`). Stored from the accumulator's layout, a warp's
    store would touch 8 rows (16 cache lines for fp32 partials, whose rows are 4-byte aligned) per instruction;
    this way it touches one or two."""
    staged = _reinterpret(stages, gl.float32, [BLOCK_H, HALF], _OUT_SMEM)
    staged.store(acc)
    _barrier()
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
    r, h, _, ok = _rows(request, row_block, QLEN, NUM_HEADS, gl.SliceLayout(1, layout))
    ptrs = out_ptr + (r.to(gl.int64) * stride_out_r + h * stride_out_h)[:, None]
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    gl.store(ptrs + cols[None, :], staged.load(layout).to(out_ptr.dtype.element_ty), mask=ok[:, None])


@gluon.jit
def _wait_tile(k_s0, k_s1, k_spe, k_full, i, first_tile, start, tile_end):
    """Wait for key tile ``i`` and zero its keys outside ``[start, tile_end)`` if it is partial: its stage's latent
    halves and rope part."""
    stage = i % STAGES
    tile = first_tile + i * BLOCK_N
    k0 = k_s0.index(stage)
    k1 = k_s1.index(stage)
    kpe = k_spe.index(stage)
    mbarrier.wait(k_full.index(stage), (i // STAGES) & 1)
    if (tile < start) | (tile + BLOCK_N > tile_end):  # a partial tile: zero its keys outside [start, tile_end)
        keys = tile + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _ROWS_LAYOUT))
        live = (keys >= start) & (keys < tile_end)
        _zero_rows(k0, live)
        _zero_rows(k1, live)
        _zero_rows(kpe, live)
        fence_async_shared()
        _barrier()
    return k0, k1, kpe


@gluon.jit
def _key_tile(k_s, i, FP8: gl.constexpr):
    """Tile ``i``'s 16-bit keys of one part: its stage, or with an FP8 cache the one widened tile."""
    if FP8:
        tile = k_s.index(0)
    else:
        tile = k_s.index(i % STAGES)
    return tile


@gluon.jit
def _codes(k_s, WIDTH: gl.constexpr, LAYOUT: gl.constexpr):
    """An FP8 cache's stages of one key part, ``[STAGES, 64, WIDTH]`` codes in the upper half of the part's 16-bit
    allocation ``k_s`` (``[STAGES, 64, WIDTH]``, two stages: the codes of both fill its stage 1); its lower half,
    stage 0, holds the one widened tile."""
    gl.static_assert(STAGES == 2)
    return _reinterpret(k_s.index(1), gl.float8e4nv, [STAGES, BLOCK_N, WIDTH], LAYOUT)


# e4m3 -> bf16 for 4 codes (a uint32 word, code i in byte i) -> 2 uint32 words of bf16 pairs (codes 0, 1 and 2, 3),
# exactly and on the integer and half-precision pipes, not the conversion unit's (a quarter of their rate on sm_90;
# Triton's conversion is 3 instructions a code there, 2 of them conversions). With the bytes reordered to (0, 2, 1,
# 3), shifting the word left by 4 puts codes 0 and 1 at bits 4..11 of the two 16-bit lanes, right by 4 codes 2 and
# 3. A code's 7 magnitude bits there, with its sign at bit 15 (shifted by 8 for codes 0, 1; in place for 2, 3), are
# the bf16 whose exponent is e4m3's 4 exponent bits: the code's value times 2**-120, subnormals included (each is a
# bf16 subnormal), so one multiply by 2**120 (bf16 0x7B80) is exact. The NaN codes (magnitude 0x7F) would give
# +-480; their lanes (magnitude bits 0x07F0, compared as a bf16) become all ones, a NaN.
_E4M3_TO_BF16_ASM = gl.constexpr("""{
        .reg .b32 x, a, b, m, n, f, g, k;
        prmt.b32 x, $2, 0, 0x3120;
        shl.b32 a, x, 4;
        shr.b32 b, x, 4;
        and.b32 m, a, 0x07F007F0;
        and.b32 n, b, 0x07F007F0;
        shl.b32 a, x, 8;
        lop3.b32 a, a, 0x80008000, m, 0xEA;
        lop3.b32 b, x, 0x80008000, n, 0xEA;
        mov.b32 k, 0x07F007F0;
        set.eq.u32.bf16x2 f, m, k;
        set.eq.u32.bf16x2 g, n, k;
        mov.b32 k, 0x7B807B80;
        mul.rn.bf16x2 a, a, k;
        mul.rn.bf16x2 b, b, k;
        or.b32 $0, a, f;
        or.b32 $1, b, g;
        }""")


# e4m3 -> fp16 for the same 4 codes: the hardware conversion, one instruction for two codes.
_E4M3_TO_F16_ASM = gl.constexpr("""{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""")


@gluon.jit
def _e4m3_words(x, DTYPE: gl.constexpr):
    """uint32 words of 4 e4m3 codes -> ``(codes 0, 1; codes 2, 3)`` as uint32 words of ``DTYPE`` (bf16 or fp16)
    pairs (:data:`_E4M3_TO_BF16_ASM`, :data:`_E4M3_TO_F16_ASM`)."""
    asm: gl.constexpr = _E4M3_TO_BF16_ASM if DTYPE.is_bf16() else _E4M3_TO_F16_ASM
    return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def _widen(codes, wide, tile, start, tile_end, SWIZZLE: gl.constexpr, LAYOUT: gl.constexpr):
    """Widen one stage's codes ``[64, W]`` (e4m3, rows swizzled by ``SWIZZLE`` bytes) into ``wide`` (the query's 16-bit
    type, exactly: every e4m3 value is a bf16 and an fp16 value) as 32-bit words (``LAYOUT``: 4 words of codes a
    thread in a row): a swizzled layout places each 16-byte piece by its byte offset, so a tile read or written as
    words is the same bytes. All 64 keys are read before any is written: the codes and the widened tile share an
    allocation, so a read after a write would need a barrier. A partial tile's keys outside ``[start, tile_end)``
    become zeros (their codes, before widening)."""
    W: gl.constexpr = codes.shape[1]
    x = _reinterpret(codes, gl.uint32, [BLOCK_N, W // 4], gl.NVMMASharedLayout(SWIZZLE, 32, rank=2)).load(LAYOUT)
    if (tile < start) | (tile + BLOCK_N > tile_end):
        keys = tile + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
        x = gl.where(((keys >= start) & (keys < tile_end))[:, None], x, gl.zeros_like(x))
    lo, hi = _e4m3_words(x, wide.dtype)
    out = _reinterpret(wide, gl.uint32, [BLOCK_N, W // 2], _SMEM32)
    out.store(gl.join(lo, hi).reshape([BLOCK_N, W // 2]))


@gluon.jit
def _widen_parts(codes, wide, codes_pe, wide_pe, k_full, k_free, w_full, i, first_tile, start, tile_end):
    """An FP8 cache: wait for tile ``i``'s codes, widen this warpgroup's parts (a latent half, and the rope part
    unless ``codes_pe`` is None), then give the stage back to the loader (``k_free``) and, unless ``w_full`` is None,
    tell the other warpgroup (``w_full``)."""
    stage = i % STAGES
    tile = first_tile + i * BLOCK_N
    mbarrier.wait(k_full.index(stage), (i // STAGES) & 1)
    _widen(codes.index(stage), wide, tile, start, tile_end, 128, _WIDEN_LAYOUT)
    if codes_pe is not None:
        _widen(codes_pe.index(stage), wide_pe, tile, start, tile_end, 64, _WIDEN_PE_LAYOUT)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(k_free.index(stage), count=1)
    if w_full is not None:
        mbarrier.arrive(w_full, count=1)


@gluon.jit
def _issue_scores(q_s0, q_s1, q_spe, k_s0, k_s1, k_spe, k_full, w_full, i, first_tile, start, tile_end,
                  FP8: gl.constexpr):  # fmt: skip
    """Wait for tile ``i`` (:func:`_wait_tile`) and start ``S = Q K^T`` (three asynchronous MMAs: the latent halves
    and the rope part). With an FP8 cache the caller has widened the first latent half and the rope part: their
    MMAs start at once, and the second half's waits for the value warpgroup to have widened it (``w_full``), which
    it does while they run."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=_S_LAYOUT)
    if FP8:
        s = warpgroup_mma(q_s0, k_s0.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_spe, k_spe.index(0).permute((1, 0)), s, is_async=True)
        mbarrier.wait(w_full, i & 1)
        s = warpgroup_mma(q_s1, k_s1.index(0).permute((1, 0)), s, is_async=True)
    else:
        k0, k1, kpe = _wait_tile(k_s0, k_s1, k_spe, k_full, i, first_tile, start, tile_end)
        s = warpgroup_mma(q_s0, k0.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_s1, k1.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_spe, kpe.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, tile, start, row_end, row_min, m_i, l_i, qk_scale, logit_cap, HAS_CAP: gl.constexpr,
             EDGE_MASKS: gl.constexpr = 0, FOLD_SCALE: gl.constexpr = 0):
    """A tile's scores -> ``(P, alpha, m, l)`` of the online softmax (base 2): row ``r`` sees keys ``[start,
    row_end[r])``, the rest get probability 0. A row with no key so far keeps ``m = -inf`` and gets
    ``alpha = 1``, ``P = 0`` (its max is taken as 0 in the exponents).

    ``EDGE_MASKS``: the mask is applied only to a tile that some row does not see whole, one starting before
    ``start`` or ending past ``row_min`` (the least ``row_end``); every other tile is seen whole by every row and
    its mask would select every score (a branch on scalars, the same for the whole warpgroup). ``FOLD_SCALE``
    (``qk_scale > 0``, no cap): the scale goes into each exponent's fma, ``exp2(s qk_scale - m)``, instead of a
    multiplication of every score first, and the row max is taken of the unscaled scores, then scaled: rounding is
    monotone, so that is the max of the scaled scores, the same ``m`` bit for bit; ``P`` differs from the
    unfolded one by the rounding of ``s qk_scale`` (the fma rounds once)."""
    scale = qk_scale  # what multiplies the scores in the exponents: qk_scale where folded, else 1 (already applied)
    if not FOLD_SCALE:
        s = s * qk_scale
        scale = 1.0
    if HAS_CAP:
        s = logit_cap * (2.0 / (1.0 + gl.exp2(s * (-2.0 * _LOG2E / logit_cap))) - 1.0) * _LOG2E
    key = tile + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _S_LAYOUT))
    if (not EDGE_MASKS) or (tile < start) | (tile + BLOCK_N > row_min):
        s = gl.where((key[None, :] >= start) & (key[None, :] < row_end[:, None]), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * scale - m_use[:, None])
    return p, gl.convert_layout(alpha, _ROWS), m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.constexpr_function
def unit_flag_asm():
    """Inline PTX over a thread's two rows' rescale factors (``pack=2``): 1 (both outputs) where every factor of the
    warp's 16 rows is exactly 1 (no row's max grew: ``vote.all``), else 0. The result is the same in every lane."""
    return ("{ .reg .pred one; setp.eq.f32 one, $2, 0f3F800000; setp.eq.and.f32 one, $3, 0f3F800000, one; "
            "vote.sync.all.pred one, one, 0xffffffff; selp.u32 $0, 1, 0, one; mov.b32 $1, $0; }")


@gluon.constexpr_function
def unit_rescale_asm(n):
    """Inline PTX over ``n`` accumulator values ``$n..$2n-1``, their rows' factors ``$2n..$3n-1`` and the warp's
    flag (:func:`unit_flag_asm`, ``$3n``): the values times their factors, or, where the flag is set, the values
    as they are, the multiplications skipped by a branch the whole warp takes (a factor of exactly 1 changes
    nothing)."""
    moves = " ".join(f"mov.b32 ${i}, ${n + i};" for i in range(n))
    products = " ".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n))
    return (f"{{ .reg .pred same; setp.ne.u32 same, ${3 * n}, 0; {moves} @same bra.uni UNIT; {products} UNIT: }}")


@gluon.constexpr_function
def unit_rescale_constraints(n):
    """The operands of :func:`unit_rescale_asm`: ``n`` float outputs, ``2 n`` float inputs, ``n`` flags."""
    return ",".join(["=f"] * n + ["f"] * (2 * n) + ["r"] * n)


_RESCALE_PACK = gl.constexpr(32)  # accumulator values an asm block: 4 blocks (4 branches) for a thread's 128


@gluon.jit
def _rescaled(acc, alpha, IF_GREW: gl.constexpr):
    """``acc * alpha[:, None]`` for an output half in ``_O_LAYOUT``; with ``IF_GREW``, the multiplications are
    skipped by each warp whose 16 rows' factors are all exactly 1 (no row's max grew), which changes no bit. Gluon's
    ``if`` takes a scalar of the whole warpgroup (a reduction across its warps, and ptxas spilled the accumulator
    carried through that branch); the branch here is the warp's own, in PTX (:func:`unit_rescale_asm`). The value
    warpgroup's loop uses it; in the softmax warpgroup, where the rescale likely fills the hand-over's latency, the
    branch made every case slower (perf_log.md, forty-fourth session)."""
    if not IF_GREW:
        return acc * alpha[:, None]
    flag = gl.inline_asm_elementwise(unit_flag_asm(), "=r,=r,f,f", [alpha], dtype=gl.uint32, is_pure=True, pack=2)
    return gl.inline_asm_elementwise(unit_rescale_asm(_RESCALE_PACK), unit_rescale_constraints(_RESCALE_PACK),
                                     [acc, gl.broadcast(alpha[:, None], acc)[0], gl.broadcast(flag[:, None], acc)[0]],
                                     dtype=gl.float32, is_pure=True, pack=_RESCALE_PACK)  # fmt: skip


@gluon.jit
def _hand_over(p, row_values, p_s, vec_s, p_full, p_free, i):
    """Give the value warpgroup ``P`` (if not None) and a per-row vector (the rescale factor, or after the
    loop the row scale) through shared memory, once it is done with the last ones (``i`` hand-overs so far)."""
    if i > 0:
        mbarrier.wait(p_free, (i - 1) & 1)
    if p is not None:
        p_s.store(p)
    vec_s.store(row_values)
    fence_async_shared()
    _barrier()
    mbarrier.arrive(p_full, count=1)


@gluon.jit
def _scores(q_ptr, stride_q_r, stride_q_h, q_s0, q_s1, q_spe, k_s0, k_s1, k_spe, codes0, codes_pe, p_s, vec_s, k_full,
            k_free, w_full, p_full, p_free, table_row, stride_t_p, num_pages, table_keys, first_tile, num_tiles, start,
            tile_end, limit, row_end, row_min, qk_scale, out_scale, logit_cap, out_ptr, stride_out_r, stride_out_h,
            request, row_block, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr,
            HAS_CAP: gl.constexpr, OUT_VEC: gl.constexpr, LEAN_SOFTMAX: gl.constexpr):  # fmt: skip
    """The softmax warpgroup (the default partition): the query into shared memory and the block-table check
    (their loads in flight together, and beside the loader's first tiles), then per tile the scores, the online
    softmax and ``O[:, :256]``; the value product of a tile runs under the wait for the next tile and its
    scores. With an FP8 cache it first widens each tile's first latent half and rope part (``codes0``,
    ``codes_pe``; :func:`_issue_scores` waits for the value warpgroup's half). Stores ``O[:, :256]`` times the row
    scale (times ``out_scale``), leaves the row scale for the value warpgroup and returns ``(lse,)``."""
    dtype: gl.constexpr = q_s0.dtype
    FP8: gl.constexpr = codes0.dtype.primitive_bitwidth == 8
    # (an FP8 cache's scale, in qk_scale, is read on the device: its sign is not known to the host, which sets
    # LEAN_SOFTMAX only for a positive sm_scale)
    FOLD_SCALE: gl.constexpr = LEAN_SOFTMAX and not FP8 and not HAS_CAP
    r, h, _, ok = _rows(request, row_block, QLEN, NUM_HEADS, gl.SliceLayout(1, _ROWS_LAYOUT))
    q_rows = q_ptr + r.to(gl.int64) * stride_q_r + h * stride_q_h
    _copy_q(q_s0, q_rows, ok, 0, HALF)
    _copy_q(q_s1, q_rows, ok, HALF, HALF)
    _copy_q(q_spe, q_rows, ok, 2 * HALF, ROPE)
    async_copy.commit_group()
    # Memory safety without host checks, as the portable kernels: a row longer than its table, or one meeting
    # a table entry outside the cache, is NaN (the loader clamps every entry, so no address outside the cache
    # is read).
    first_bad = _first_bad_key(table_row, stride_t_p, start, tile_end, num_pages, PAGE_SIZE)
    poisoned = (limit > table_keys) | (row_end > first_bad)
    async_copy.wait_group(0)
    fence_async_shared()
    _barrier()

    row_end = gl.convert_layout(row_end, _S_ROWS)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=_S_ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=_S_ROWS)
    # The value product of a tile is left running into the next tile's scores: the loop carries it pending.
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, layout=_O_LAYOUT))
    for i in range(num_tiles):
        # The last tile's value product done, its stage is released before these scores run (not after them), so
        # the load two tiles ahead starts a score product earlier; the scores queue behind it on the tensor cores.
        # With an FP8 cache this warpgroup's parts of the one widened tile are free once its last value product is
        # done: it widens this tile's first latent half and rope part (while the value warpgroup's product runs).
        acc = warpgroup_mma_wait(0, deps=[acc])
        if FP8:
            _widen_parts(codes0, k_s0.index(0), codes_pe, k_spe.index(0), k_full, k_free, None, i, first_tile,
                         start, tile_end)  # fmt: skip
        elif i > 0:
            mbarrier.arrive(k_free.index((i - 1) % STAGES), count=1)
        s = _issue_scores(q_s0, q_s1, q_spe, k_s0, k_s1, k_spe, k_full, w_full, i, first_tile, start, tile_end, FP8)
        s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _softmax(s, first_tile + i * BLOCK_N, start, row_end, row_min, m_i, l_i, qk_scale,
                                      logit_cap, HAS_CAP, LEAN_SOFTMAX, FOLD_SCALE)  # fmt: skip
        p = p.to(dtype)
        _hand_over(p, alpha, p_s, vec_s, p_full, p_free, i)
        acc = warpgroup_mma(gl.convert_layout(p, _P_OPERAND), _key_tile(k_s0, i, FP8), acc * alpha[:, None],
                            is_async=True)  # fmt: skip
    acc = warpgroup_mma_wait(0, deps=[acc])

    # A row with no key in this split is the neutral state (0, -inf): stage 2 then needs no boundaries.
    l_o = gl.convert_layout(l_i, _ROWS)
    empty = gl.convert_layout(row_end <= start, _ROWS)
    row_scale = gl.where(empty, 0.0, out_scale / gl.where(empty, 1.0, l_o))
    lse = gl.where(empty, float("-inf"), (gl.convert_layout(m_i, _ROWS) + gl.log2(gl.where(empty, 1.0, l_o))) * _LN2)
    poisoned = gl.convert_layout(poisoned, _ROWS)
    row_scale = gl.where(poisoned, float("nan"), row_scale)
    lse = gl.where(poisoned, float("nan"), lse)
    _hand_over(None, row_scale, p_s, vec_s, p_full, p_free, num_tiles)
    _store_half(acc * row_scale[:, None], k_s0, out_ptr, stride_out_r, stride_out_h, request, row_block, QLEN,
                NUM_HEADS, OUT_VEC)  # fmt: skip
    return (lse,)  # the partition's results as a tuple


@gluon.jit
def _copy_q(q_s, q_rows, row_ok, COL0: gl.constexpr, WIDTH: gl.constexpr):
    """Start copying the query elements at columns ``COL0 .. COL0 + WIDTH`` of this program's rows into ``q_s``
    (``cp.async``, no registers held; zeros for rows past the request's)."""
    c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, _ROWS_LAYOUT))
    _copy_async(q_s, q_rows[:, None] + COL0 + c[None, :], mask=row_ok[:, None])


@gluon.jit
def _attend(q_ptr, stride_q_r, stride_q_h, lat_desc, pe_desc, table_row, stride_t_p, num_pages, table_keys,
            out_ptr, stride_out_r, stride_out_h, lse_ptr, stride_lse_r, stride_lse_h, seq_len, real_len, start, end,
            qk_scale, k_scale_ptr, logit_cap, request, row_block, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr,
            PAGE_SIZE: gl.constexpr, HAS_CAP: gl.constexpr, OUT_VEC: gl.constexpr,
            LEAN_SOFTMAX: gl.constexpr = 0, RESCALE_IF_GREW: gl.constexpr = 0):  # fmt: skip
    """One program: keys ``[start, end)`` of request ``request`` for its 64 rows, row ``r`` (token ``t``) up to
    its causal limit ``min(seq_len - QLEN + 1 + t, real_len)``; the output halves and LSE (natural log) stored
    at ``out_ptr`` / ``lse_ptr`` with the given row (query row) and head strides.

    An FP8 cache (the descriptors' type): the codes go to the MMAs undequantized, widened to the query's type in
    shared memory, and its scale ``k_scale_ptr[0]`` multiplies the scores and the output (MLA's V is part of K),
    as in the portable kernels. Each part's allocation then holds the TMA stages of its codes in its upper half
    (the same bytes: two stages of one-byte codes) and one widened tile in its lower half, which both warpgroups
    refill once the tile's value products are done."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    FP8: gl.constexpr = lat_desc.dtype.primitive_bitwidth == 8
    out_scale = 1.0
    if FP8:
        out_scale = gl.load(k_scale_ptr).to(gl.float32)
        qk_scale = qk_scale * out_scale
    _, _, t, ok = _rows(request, row_block, QLEN, NUM_HEADS, _ROWS)
    limit = gl.where(ok, gl.maximum(gl.minimum(seq_len - QLEN + 1 + t, real_len), 0), 0)
    row_end = gl.minimum(gl.minimum(limit, end), table_keys)
    tile_end = gl.max(row_end, axis=0)
    row_min = gl.min(row_end, axis=0)  # a tile below it, at or past start, is seen whole by every row
    first_tile = start // BLOCK_N * BLOCK_N
    num_tiles = gl.where(tile_end > start, gl.cdiv(tile_end - first_tile, BLOCK_N), 0)

    q_s0 = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], _SMEM)
    q_s1 = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], _SMEM)
    q_spe = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], _SMEM)
    k_s0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], _SMEM)
    k_s1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], _SMEM)
    k_spe = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], _SMEM)
    p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], _SMEM)
    vec_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], _VEC_SMEM)
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    w_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # FP8: a second latent half widened
    for st in gl.static_range(STAGES):
        mbarrier.init(k_full.index(st), count=1)
        mbarrier.init(k_free.index(st), count=2)
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(w_full, count=1)
    fence_async_shared()
    if FP8:  # where TMA puts the codes (the loader's stages)
        codes0 = _codes(k_s0, HALF, _SMEM8)
        codes1 = _codes(k_s1, HALF, _SMEM8)
        codes_pe = _codes(k_spe, ROPE, _SMEM8_PE)
    else:
        codes0, codes1, codes_pe = k_s0, k_s1, k_spe

    (lse,) = gl.warp_specialize([
        (_scores, (q_ptr, stride_q_r, stride_q_h, q_s0, q_s1, q_spe, k_s0, k_s1, k_spe, codes0, codes_pe, p_s, vec_s,
                   k_full, k_free, w_full, p_full, p_free, table_row, stride_t_p, num_pages, table_keys, first_tile,
                   num_tiles, start, tile_end, limit, row_end, row_min, qk_scale, out_scale, logit_cap, out_ptr,
                   stride_out_r, stride_out_h, request, row_block, QLEN, NUM_HEADS, PAGE_SIZE, HAS_CAP, OUT_VEC,
                   LEAN_SOFTMAX)),
        (_values, (k_s1, codes1, p_s, vec_s, k_full, k_free, w_full, p_full, p_free, first_tile, num_tiles, start,
                   tile_end, out_ptr, stride_out_r, stride_out_h, request, row_block, QLEN, NUM_HEADS, OUT_VEC,
                   RESCALE_IF_GREW)),
        (_loader, (lat_desc, pe_desc, codes0, codes1, codes_pe, k_full, k_free, table_row, stride_t_p, num_pages,
                   first_tile, num_tiles, PAGE_SIZE)),
    ], [4, 1], [VALUE_REGS, LOADER_REGS])  # fmt: skip

    r, h, _, ok = _rows(request, row_block, QLEN, NUM_HEADS, _ROWS)
    gl.store(lse_ptr + r.to(gl.int64) * stride_lse_r + h * stride_lse_h, lse.to(lse_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _destinations(o_ptr, stride_o_r, stride_o_h, lse_ptr, stride_lse_r, stride_lse_h, part_ptr, stride_p_r, stride_p_h,
                  stride_p_s, split, SINGLE_SPLIT: gl.constexpr, BF16_PARTIALS: gl.constexpr):  # fmt: skip
    """Where a program's rows go, as (output, its query-row and head strides, LSE, its strides): ``o`` and ``lse``
    with one split, else split ``split``'s slot of the fp32 partials ``[rows, heads, S, 512 + 1]`` (LSE last), with
    ``BF16_PARTIALS`` its outputs as bf16 (``lse_merge.partial_values``: the same records, strides in bf16)."""
    if SINGLE_SPLIT:
        where = (o_ptr, stride_o_r, stride_o_h, lse_ptr, stride_lse_r, stride_lse_h)
    else:
        slot = part_ptr + split * stride_p_s
        if BF16_PARTIALS:
            values = slot.to(gl.pointer_type(gl.bfloat16))
            where = (values, 2 * stride_p_r, 2 * stride_p_h, slot + 2 * HALF, stride_p_r, stride_p_h)
        else:
            where = (slot, stride_p_r, stride_p_h, slot + 2 * HALF, stride_p_r, stride_p_h)
    return where


@gluon.constexpr_function
def _store_vec(single_split, bf16_partials, out_bits):
    """Elements a thread stores at once (:func:`_store_half`): 16 bytes of a 16-bit output, whose rows are 16-byte
    aligned; one fp32 or two bf16 of a partial record (4 bytes: records are ``4 * 513`` bytes apart)."""
    if single_split:
        return 8 if out_bits == 16 else 1
    return 2 if bf16_partials else 1


@gluon.jit
def _decode_program(num_kv_splits, HEAD_BLOCKS: gl.constexpr):
    """This program's ``(row, head block, split)`` in decode's grid ``(HEAD_BLOCKS * R * S,)``, the head blocks of
    a row adjacent in the program id and the splits outermost. Programs that run together then read the same key
    tiles, the second read an L2 hit. With ``R`` fastest (the grid ``(R, HEAD_BLOCKS, S)`` this replaced), a call of
    more programs than SMs ran the second head block of most rows in the second round, after their keys had left
    the L2, and read the keys from memory twice: decode B=128 H=128 L=1K (151 MB of keys, 256 programs) ran its
    stage 1 in 91.3 us that way and in 76.9 us this way on the H200 (``benchmarks/kernel_times.py``)."""
    pid = gl.program_id(0)
    per_split = gl.num_programs(0) // num_kv_splits
    rest = pid % per_split
    return rest // HEAD_BLOCKS, rest % HEAD_BLOCKS, pid // per_split


@gluon.jit
def _decode_split(seq_lens_ptr, stride_sl, row, split, window, num_kv_splits, sm_scale, HAS_CAP: gl.constexpr):
    """Decode row ``row``'s length ``n``, its split ``[start, end)`` of the visible keys ``[lo, n)``
    (golden.decode_attention.split_bounds), and the score scale (base 2 unless a cap applies first)."""
    n = gl.maximum(gl.load(seq_lens_ptr + row.to(gl.int64) * stride_sl).to(gl.int32), 0)
    lo = gl.maximum(n - window, 0)
    chunk = gl.cdiv(n - lo, num_kv_splits)
    start = gl.minimum(lo + split * chunk, n)
    end = gl.minimum(start + chunk, n)
    qk_scale = sm_scale
    if not HAS_CAP:
        qk_scale = qk_scale * _LOG2E
    return n, start, end, qk_scale


@gluon.jit
def mla_decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, seq_lens_ptr, real_lens_ptr, k_scale_ptr, v_scale_ptr,
    lat_desc, pe_desc,
    sm_scale, logit_cap, window, num_kv_splits, num_pages, table_keys,
    stride_q_r, stride_q_h,
    stride_o_r, stride_o_h,
    stride_lse_r, stride_lse_h,
    stride_p_r, stride_p_h, stride_p_s,
    stride_t_r, stride_t_p, stride_sl,
    GROUP: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    HAS_CAP: gl.constexpr,
    SINGLE_SPLIT: gl.constexpr,
    BF16_PARTIALS: gl.constexpr,
    LEAN_SOFTMAX: gl.constexpr = 0,  # interior tiles unmasked; the scale in the exponents' fma (_softmax)
    RESCALE_IF_GREW: gl.constexpr = 0,  # value warpgroup: a warp skips its rescale where no row's max grew
):  # fmt: skip
    """Decode, grid ``(cdiv(GROUP, 64) * R * S,)`` (:func:`_decode_program`): a split of a row's visible keys for 64
    query heads; the same partials (or, with ``SINGLE_SPLIT``, outputs) as ``decode_attention._decode_stage1_kernel``.
    ``k_ptr``, ``v_ptr``, ``real_lens_ptr`` and ``v_scale_ptr`` are unused (the head of the portable kernel's
    arguments, so one call site launches either; MLA's V takes ``k_scale``)."""
    row, head_block, split = _decode_program(num_kv_splits, (GROUP + BLOCK_H - 1) // BLOCK_H)
    n, start, end, qk_scale = _decode_split(seq_lens_ptr, stride_sl, row, split, window, num_kv_splits, sm_scale,
                                            HAS_CAP)  # fmt: skip
    out_ptr, stride_out_r, stride_out_h, lse_out_ptr, stride_lo_r, stride_lo_h = _destinations(
        o_ptr, stride_o_r, stride_o_h, lse_ptr, stride_lse_r, stride_lse_h, part_ptr, stride_p_r, stride_p_h,
        stride_p_s, split, SINGLE_SPLIT, BF16_PARTIALS)  # fmt: skip
    _attend(q_ptr, stride_q_r, stride_q_h, lat_desc, pe_desc, table_ptr + row.to(gl.int64) * stride_t_r, stride_t_p,
            num_pages, table_keys, out_ptr, stride_out_r, stride_out_h, lse_out_ptr, stride_lo_r, stride_lo_h,
            n, n, start, end, qk_scale, k_scale_ptr, logit_cap, row, head_block, 1, GROUP, PAGE_SIZE,
            HAS_CAP, _store_vec(SINGLE_SPLIT, BF16_PARTIALS, o_ptr.dtype.element_ty.primitive_bitwidth),
            LEAN_SOFTMAX, RESCALE_IF_GREW)  # fmt: skip


@gluon.jit
def mla_verify_stage1_kernel(
    q_ptr, k_ptr, sm_scale_log2, table_ptr, seq_lens_ptr, real_seq_lens_ptr, part_ptr, o_ptr, lse_ptr, k_scale_ptr,
    lat_desc, pe_desc,
    num_pages, table_keys, stride_sl, stride_rl,
    stride_t_b, stride_t_p, stride_q_r, stride_q_h,
    stride_p_r, stride_p_h, stride_p_s, stride_o_r, stride_o_h, stride_lse_r, stride_lse_h,
    QLEN: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HAS_REAL: gl.constexpr,
    NUM_KV_SPLITS: gl.constexpr,
    SPLIT_ALIGN: gl.constexpr,
    MIN_SPLIT_LEN: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SINGLE_SPLIT: gl.constexpr,
    BF16_PARTIALS: gl.constexpr,
    LEAN_SOFTMAX: gl.constexpr = 0,  # interior tiles unmasked; the scale in the exponents' fma (_softmax)
    RESCALE_IF_GREW: gl.constexpr = 0,  # value warpgroup: a warp skips its rescale where no row's max grew
):  # fmt: skip
    """Verify, grid ``(B * S * cdiv(QLEN * NUM_HEADS, 64),)`` as ``mla_verify._fwd_verify_kernel_stage1`` (its
    split rule and partials; the row blocks of one request and split adjacent in the program id, so they share
    each key tile through L2). ``k_ptr`` is unused; ``k_scale_ptr`` only with an FP8 cache."""
    ROW_BLOCKS: gl.constexpr = (QLEN * NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = gl.program_id(0)
    row_block = pid % ROW_BLOCKS
    split = (pid // ROW_BLOCKS) % NUM_KV_SPLITS
    b = pid // (ROW_BLOCKS * NUM_KV_SPLITS)
    # int32 whatever the lengths' dtype (int64 ones fit: the content check says so), as the loop's stage indices need
    seq_len = gl.maximum(gl.load(seq_lens_ptr + b.to(gl.int64) * stride_sl).to(gl.int32), 0)
    real_len = seq_len
    if HAS_REAL:
        real_len = gl.load(real_seq_lens_ptr + b.to(gl.int64) * stride_rl).to(gl.int32)
    per_split = gl.cdiv(seq_len, NUM_KV_SPLITS)
    chunk = gl.maximum(gl.cdiv(per_split, SPLIT_ALIGN) * SPLIT_ALIGN, MIN_SPLIT_LEN)
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    out_ptr, stride_out_r, stride_out_h, lse_out_ptr, stride_lo_r, stride_lo_h = _destinations(
        o_ptr, stride_o_r, stride_o_h, lse_ptr, stride_lse_r, stride_lse_h, part_ptr, stride_p_r, stride_p_h,
        stride_p_s, split, SINGLE_SPLIT, BF16_PARTIALS)  # fmt: skip
    _attend(q_ptr, stride_q_r, stride_q_h, lat_desc, pe_desc, table_ptr + b.to(gl.int64) * stride_t_b, stride_t_p,
            num_pages, table_keys, out_ptr, stride_out_r, stride_out_h, lse_out_ptr, stride_lo_r, stride_lo_h,
            seq_len, real_len, start, end, sm_scale_log2, k_scale_ptr, 0.0, b, row_block, QLEN, NUM_HEADS, PAGE_SIZE,
            False, _store_vec(SINGLE_SPLIT, BF16_PARTIALS, o_ptr.dtype.element_ty.primitive_bitwidth),
            LEAN_SOFTMAX, RESCALE_IF_GREW)  # fmt: skip


# -- Few rows: decode with at most 16 query heads (DeepSeek's 128 heads under tensor parallelism of 8) ---------------
#
# With 16 rows a 64-row wgmma tile is three-quarters empty, and the tile's tensor work (64 x 64 x 1088 MACs) is as
# long as its bytes take to arrive. Here the keys are wgmma's M: the scores come as ``S^T = K Q^T`` ([64 keys, 16
# rows]) and the output as ``O^T = V^T P^T`` ([512 dims, 16 rows], V^T the key tile read transposed), a quarter of
# the work. One warpgroup does everything; the TMA loads run two tiles ahead.
FEW_ROWS = gl.constexpr(16)
_ST_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
_KEYS = gl.constexpr(gl.SliceLayout(1, _ST_LAYOUT))  # one value per key (a row of S^T)
_COLS = gl.constexpr(gl.SliceLayout(0, _ST_LAYOUT))  # one value per query row (a column of S^T and O^T)
_PT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))  # P^T [64, 16]
# O^T [256, 16] fp32 on its way out, read back as [16, 256]: element (d, n) at column n ^ (d % 16) of row d.
_OT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 16, [1, 0]))
# The split merge in the stage 1 (CLUSTER_MERGE): the S <= MAX_CLUSTER splits of a row run as one thread-block
# cluster, and after a cluster barrier program ``split`` merges output columns [64 k, 64 k + 64) for k = split,
# split + S, ... < 8, each thread all S splits of 8 columns of one head: [splits, heads, columns] tiles.
MAX_CLUSTER = gl.constexpr(8)  # the largest portable cluster
_MERGE_COLS = gl.constexpr(64)
_MERGE_LAYOUT = gl.constexpr(gl.BlockedLayout([8, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0]))


@gluon.jit
def _store_half_t(acc_t, stages, out_ptr, stride_out_h, group):
    """Store an output half given transposed, ``acc_t`` ``[256 dims, 16 rows]``, at ``out_ptr`` (head 0's first
    column) by way of shared memory (``stages``, as :func:`_store_half`): a warp stores 32 consecutive dims of
    one head (two bf16 a thread would take 8 more bytes of stack under Triton 3.9)."""
    staged = _reinterpret(stages, gl.float32, [HALF, FEW_ROWS], _OT_SMEM)
    staged.store(acc_t)
    _barrier()
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    heads = gl.arange(0, FEW_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + (heads * stride_out_h)[:, None] + cols[None, :]
    gl.store(ptrs, staged.permute((1, 0)).load(layout).to(out_ptr.dtype.element_ty), mask=(heads < group)[:, None])


@gluon.jit
def _attend_few(q_rows, group, lat_desc, pe_desc, table_row, stride_t_p, num_pages, table_keys, out_ptr,
                stride_out_h, lse_ptr, stride_lse_h, seq_len, start, end, qk_scale, logit_cap,
                PAGE_SIZE: gl.constexpr, HAS_CAP: gl.constexpr):  # fmt: skip
    """One program: keys ``[start, end)`` of one query row for its ``group`` (<= 16) heads, ``q_rows`` their query
    rows (``[16]`` pointers, ``_ROWS_LAYOUT`` rows); the output halves and the LSE (natural log) stored at
    ``out_ptr`` / ``lse_ptr`` with the given head strides."""
    dtype: gl.constexpr = q_rows.dtype.element_ty
    q_s0 = gl.allocate_shared_memory(dtype, [FEW_ROWS, HALF], _SMEM)
    q_s1 = gl.allocate_shared_memory(dtype, [FEW_ROWS, HALF], _SMEM)
    q_spe = gl.allocate_shared_memory(dtype, [FEW_ROWS, ROPE], _SMEM)
    k_s0 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], _SMEM)
    k_s1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HALF], _SMEM)
    k_spe = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], _SMEM)
    p_s = gl.allocate_shared_memory(dtype, [BLOCK_N, FEW_ROWS], _PT_SMEM)
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(k_full.index(st), count=1)
    fence_async_shared()

    # Every row sees the same keys: a split cut to the table's keys (a row longer than its table is NaN).
    tile_end = gl.minimum(end, table_keys)
    first_tile = start // BLOCK_N * BLOCK_N
    num_tiles = gl.where(tile_end > start, gl.cdiv(tile_end - first_tile, BLOCK_N), 0)
    for st in gl.static_range(STAGES):
        if st < num_tiles:
            _issue_tile(lat_desc, pe_desc, k_full.index(st), k_s0.index(st), k_s1.index(st), k_spe.index(st),
                        table_row, stride_t_p, num_pages, first_tile + st * BLOCK_N, PAGE_SIZE)  # fmt: skip
    heads = gl.arange(0, FEW_ROWS, layout=gl.SliceLayout(1, _ROWS_LAYOUT))
    _copy_q(q_s0, q_rows, heads < group, 0, HALF)
    _copy_q(q_s1, q_rows, heads < group, HALF, HALF)
    _copy_q(q_spe, q_rows, heads < group, 2 * HALF, ROPE)
    async_copy.commit_group()
    first_bad = _first_bad_key(table_row, stride_t_p, start, tile_end, num_pages, PAGE_SIZE)
    poisoned = (seq_len > table_keys) | (tile_end > first_bad)
    async_copy.wait_group(0)
    fence_async_shared()
    _barrier()

    m_i = gl.full([FEW_ROWS], float("-inf"), gl.float32, layout=_COLS)
    l_part = gl.zeros([BLOCK_N, FEW_ROWS], gl.float32, layout=_ST_LAYOUT)  # per-thread sums, reduced at the end
    o0 = gl.zeros([HALF, FEW_ROWS], gl.float32, layout=_ST_LAYOUT)
    o1 = gl.zeros([HALF, FEW_ROWS], gl.float32, layout=_ST_LAYOUT)
    for i in range(num_tiles):
        stage = i % STAGES
        tile = first_tile + i * BLOCK_N
        k0, k1, kpe = _wait_tile(k_s0, k_s1, k_spe, k_full, i, first_tile, start, tile_end)
        s = gl.zeros([BLOCK_N, FEW_ROWS], gl.float32, layout=_ST_LAYOUT)
        s = warpgroup_mma(k0, q_s0.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(k1, q_s1.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(kpe, q_spe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        s = s * qk_scale
        if HAS_CAP:
            s = logit_cap * (2.0 / (1.0 + gl.exp2(s * (-2.0 * _LOG2E / logit_cap))) - 1.0) * _LOG2E
        key = tile + gl.arange(0, BLOCK_N, layout=_KEYS)
        s = gl.where(((key >= start) & (key < tile_end))[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_part = l_part * alpha[None, :] + p
        m_i = m_new
        p_s.store(p.to(dtype))
        fence_async_shared()
        _barrier()
        o0 = warpgroup_mma(k0.permute((1, 0)), p_s, o0 * alpha[None, :], is_async=True)
        o1 = warpgroup_mma(k1.permute((1, 0)), p_s, o1 * alpha[None, :], is_async=True)
        o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
        _barrier()  # every warp is done with this stage and with P before either is written again
        if i + STAGES < num_tiles:
            _issue_tile(lat_desc, pe_desc, k_full.index(stage), k0, k1, kpe, table_row, stride_t_p, num_pages,
                        tile + STAGES * BLOCK_N, PAGE_SIZE)  # fmt: skip

    # An empty split is the neutral state (0, -inf); a poisoned one NaN.
    l_i = gl.sum(l_part, axis=0)
    empty = tile_end <= start
    row_scale = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * _LN2)
    row_scale = gl.where(poisoned, float("nan"), row_scale)
    lse = gl.where(poisoned, float("nan"), lse)
    _store_half_t(o0 * row_scale[None, :], k_s0, out_ptr, stride_out_h, group)
    _store_half_t(o1 * row_scale[None, :], k_s1, out_ptr + HALF, stride_out_h, group)
    heads_c = gl.arange(0, FEW_ROWS, layout=_COLS)
    gl.store(lse_ptr + heads_c * stride_lse_h, lse.to(lse_ptr.dtype.element_ty), mask=heads_c < group)


@gluon.jit
def mla_decode_few_rows_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, part_ptr, table_ptr, seq_lens_ptr, real_lens_ptr, k_scale_ptr, v_scale_ptr,
    lat_desc, pe_desc,
    sm_scale, logit_cap, window, num_kv_splits, num_pages, table_keys,
    stride_q_r, stride_q_h,
    stride_o_r, stride_o_h,
    stride_lse_r, stride_lse_h,
    stride_p_r, stride_p_h, stride_p_s,
    stride_t_r, stride_t_p, stride_sl,
    GROUP: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    HAS_CAP: gl.constexpr,
    SINGLE_SPLIT: gl.constexpr,
    BF16_PARTIALS: gl.constexpr,
    CLUSTER_MERGE: gl.constexpr,
):  # fmt: skip
    """Decode with ``GROUP <= 16`` heads, grid ``(R * S,)``: the arguments and partials of
    :func:`mla_decode_stage1_kernel`, with the keys as wgmma's M (:func:`_attend_few`). With ``CLUSTER_MERGE``
    (launched in clusters of the ``S`` splits of a row, ``1 < S <= MAX_CLUSTER``) the programs of a row also merge
    their partials into ``o`` and ``lse`` (:func:`_merge_in_cluster`): no merge kernel follows."""
    if CLUSTER_MERGE:  # the splits of a row adjacent in the program id: one cluster
        pid = gl.program_id(0)
        row, split = pid // num_kv_splits, pid % num_kv_splits
    else:
        row, _, split = _decode_program(num_kv_splits, 1)
    n, start, end, qk_scale = _decode_split(seq_lens_ptr, stride_sl, row, split, window, num_kv_splits, sm_scale,
                                            HAS_CAP)  # fmt: skip
    out_ptr, stride_out_r, stride_out_h, lse_out_ptr, stride_lo_r, stride_lo_h = _destinations(
        o_ptr, stride_o_r, stride_o_h, lse_ptr, stride_lse_r, stride_lse_h, part_ptr, stride_p_r, stride_p_h,
        stride_p_s, split, SINGLE_SPLIT, BF16_PARTIALS)  # fmt: skip
    heads = gl.arange(0, FEW_ROWS, layout=gl.SliceLayout(1, _ROWS_LAYOUT))
    q_rows = q_ptr + row.to(gl.int64) * stride_q_r + heads * stride_q_h
    _attend_few(q_rows, GROUP, lat_desc, pe_desc, table_ptr + row.to(gl.int64) * stride_t_r, stride_t_p, num_pages,
                table_keys, out_ptr + row.to(gl.int64) * stride_out_r, stride_out_h,
                lse_out_ptr + row.to(gl.int64) * stride_lo_r, stride_lo_h, n, start, end, qk_scale, logit_cap,
                PAGE_SIZE, HAS_CAP)  # fmt: skip
    if CLUSTER_MERGE:
        _cluster_barrier()
        _merge_in_cluster(part_ptr + row.to(gl.int64) * stride_p_r, stride_p_h, stride_p_s,
                          o_ptr + row.to(gl.int64) * stride_o_r, stride_o_h, lse_ptr + row.to(gl.int64) * stride_lse_r,
                          stride_lse_h, split, num_kv_splits, GROUP, BF16_PARTIALS)  # fmt: skip


@gluon.jit
def _cluster_barrier():
    """Wait until every thread of this program's cluster has arrived here (PTX ``barrier.cluster``, sm_90): what
    each stored before it arrived (release) is visible to every thread after the wait (acquire). Every thread of
    the program runs it, as ``.aligned`` requires."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\t"
                              "mov.b32 $0, $1;", "=r,r", [gl.full([32 * NUM_WARPS], 0, gl.int32, layout)],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _merge_in_cluster(part_row, stride_p_h, stride_p_s, o_row, stride_o_h, lse_row, stride_lse_h, split, num_splits,
                      group, BF16_PARTIALS: gl.constexpr):  # fmt: skip
    """The split merge of one row (``lse_merge._merge_splits_kernel``'s arithmetic and its special cases: an empty
    split, LSE ``-inf`` or ``+inf``, weighs 0 and its values are not used; a NaN LSE makes the head NaN) for
    output columns ``[64 k, 64 k + 64)``, ``k = split, split + num_splits, ... < 8``, after every split of the row
    has stored its record (``part_row``: the row's first record; its LSE in slot 512). Each column block is one
    load of every split's values, issued with the LSEs' load: one round trip to L2. Program 0 stores the LSE."""
    lse_layout: gl.constexpr = gl.SliceLayout(2, _MERGE_LAYOUT)
    out_layout: gl.constexpr = gl.SliceLayout(0, _MERGE_LAYOUT)
    s = gl.arange(0, MAX_CLUSTER, layout=gl.SliceLayout(1, lse_layout))
    h = gl.arange(0, FEW_ROWS, layout=gl.SliceLayout(0, lse_layout))
    live = (s < num_splits)[:, None] & (h < group)[None, :]
    records = part_row + s[:, None] * stride_p_s + h[None, :] * stride_p_h
    values = records
    if BF16_PARTIALS:  # value d of a record is its d-th bf16 (lse_merge.partial_values)
        values = records.to(gl.pointer_type(gl.bfloat16))
    cols = gl.arange(0, _MERGE_COLS, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MERGE_LAYOUT)))
    lse_s = gl.load(records + 2 * HALF, mask=live, other=float("-inf"), cache_modifier=".cg")
    part = gl.load(values[:, :, None] + (split * _MERGE_COLS + cols)[None, None, :], mask=live[:, :, None],
                   other=0.0, cache_modifier=".cg")  # fmt: skip

    poison = gl.max((lse_s != lse_s).to(gl.int32), axis=0) > 0
    clean = gl.where((lse_s == float("inf")) | (lse_s != lse_s), float("-inf"), lse_s)
    m = gl.max(clean, axis=0)
    empty = m == float("-inf")
    m_safe = gl.where(empty, 0.0, m)
    w = gl.exp(clean - m_safe[None, :])
    w_sum = gl.sum(w, axis=0)
    inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, w_sum))
    # Normalized in the LSEs' layout, so that the sum over splits needs no other; a poisoned head's weights are NaN
    # and taken, an empty split's are not.
    take = ((w > 0) | poison[None, :])[:, :, None]
    weight = gl.where(poison[None, :], float("nan"), w * inv[None, :])[:, :, None]
    heads = gl.arange(0, FEW_ROWS, layout=gl.SliceLayout(1, out_layout))
    out_cols = gl.arange(0, _MERGE_COLS, layout=gl.SliceLayout(0, out_layout))
    for block in range(split, 2 * HALF // _MERGE_COLS, num_splits):
        if block != split:
            part = gl.load(values[:, :, None] + (block * _MERGE_COLS + cols)[None, None, :], mask=live[:, :, None],
                           other=0.0, cache_modifier=".cg")  # fmt: skip
        acc = gl.sum(gl.where(take, part.to(gl.float32) * weight, 0.0), axis=0)
        gl.store(o_row + (heads * stride_o_h)[:, None] + (block * _MERGE_COLS + out_cols)[None, :],
                 acc.to(o_row.dtype.element_ty), mask=(heads < group)[:, None])  # fmt: skip
    if split == 0:
        lse = gl.where(empty, float("-inf"), m_safe + gl.log(gl.where(empty, 1.0, w_sum)))
        lse = gl.where(poison, float("nan"), lse)
        gl.store(lse_row + h * stride_lse_h, lse.to(lse_row.dtype.element_ty), mask=h < group)


def merges_in_cluster(device: torch.device, num_rows: int, num_kv_splits: int) -> bool:
    """Whether :func:`mla_decode_few_rows_kernel` merges the ``num_kv_splits`` splits of each of ``num_rows`` rows
    itself (``CLUSTER_MERGE``): more than one and at most ``MAX_CLUSTER`` splits, and a cluster a row all running at
    once (:func:`triton_impl.launch.cluster_capacity`, one program an SM). Clusters of a second wave would wait for
    the first: at decode B=32 H=16 L=32K (four splits, 128 programs) stage 1 took 435 us against 276 us unclustered
    on the H200 (``benchmarks/kernel_times.py``, perf_log.md's thirty-second session)."""
    if not 1 < num_kv_splits <= int(MAX_CLUSTER) or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_rows <= cluster_capacity(index, num_kv_splits)


def compile_for_sm90(*, verify: bool = False, heads: int = 128, qlen: int = 1, page_size: int = 64,
                     single_split: bool = False, few_rows: bool = False, fp8: bool = False,
                     bf16_partials: bool = True, cluster_merge: bool | None = None,
                     lean_softmax: bool = False, rescale_if_grew: bool = False,
                     lengths: str = "i32") -> Any:  # fmt: skip
    """The decode (or, ``verify``, the verify) stage 1 compiled for sm_90 on any machine (no GPU needed),
    specialized as a bench launch is (a bf16 query, a bf16 or, ``fp8``, an FP8 cache, 16-byte aligned pointers, the
    block table's unit column stride a constant; partials in bf16 as for a bf16 output, unless ``bf16_partials`` is
    false; the few-rows kernel with several splits merging them itself unless ``cluster_merge`` is false; the 64-row
    kernels' ``LEAN_SOFTMAX`` as ``lean_softmax``, ``RESCALE_IF_GREW`` as ``rescale_if_grew``; length vectors of
    ``lengths``, ``"i32"`` or ``"i64"``): the ``CompiledKernel``, with ``asm["cubin"]``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = mla_verify_stage1_kernel if verify else mla_decode_few_rows_kernel if few_rows else mla_decode_stage1_kernel
    names = fn.arg_names
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32",
                "part_ptr": "*fp32", "table_ptr": "*i32", "seq_lens_ptr": f"*{lengths}",
                "real_seq_lens_ptr": f"*{lengths}", "real_lens_ptr": f"*{lengths}",
                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}  # fmt: skip
    cache = "fp8e4nv" if fp8 else "bf16"
    lat, pe = _tile_layouts(fp8)
    pointers["k_ptr"] = pointers["v_ptr"] = f"*{cache}"
    descs = {"lat_desc": f"tensordesc<{cache}[64, 256],{lat!r}>", "pe_desc": f"tensordesc<{cache}[64, 64],{pe!r}>"}
    floats = ("sm_scale", "sm_scale_log2", "logit_cap")
    if verify:
        constexprs = dict(QLEN=qlen, NUM_HEADS=heads, HAS_REAL=True, NUM_KV_SPLITS=1 if single_split else 4,
                          SPLIT_ALIGN=64, MIN_SPLIT_LEN=256, PAGE_SIZE=page_size, SINGLE_SPLIT=single_split)
    else:
        constexprs = dict(GROUP=heads, PAGE_SIZE=page_size, HAS_CAP=False, SINGLE_SPLIT=single_split)
        if few_rows:
            constexprs["CLUSTER_MERGE"] = not single_split if cluster_merge is None else cluster_merge
    constexprs["BF16_PARTIALS"] = bf16_partials
    if not few_rows:
        constexprs["LEAN_SOFTMAX"] = lean_softmax
        constexprs["RESCALE_IF_GREW"] = rescale_if_grew
    constexprs["stride_t_p"] = 1
    if verify:  # contiguous length vectors, as the bench's
        constexprs["stride_sl"] = constexprs["stride_rl"] = 1
    signature = {n: "constexpr" if n in constexprs else pointers.get(n) or descs.get(n) or
                 ("fp32" if n in floats else "i32") for n in names}  # fmt: skip
    values = {(names.index(n),): v for n, v in constexprs.items()}
    aligned = [n for n in (*pointers, "stride_q_r", "stride_q_h") if n in names]  # as supports() requires
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton_compile(GluonASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": int(NUM_WARPS)})  # fmt: skip
