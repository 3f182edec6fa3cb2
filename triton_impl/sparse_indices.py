"""DeepSeek sparse-attention index preparation kernels, vLLM's signatures.

Twin of ``golden/sparse_indices.py``, whose module docstring gives the formulas. The kernels are
integer-only, so they equal the golden model exactly in both modes. Beyond the seed:

- every block-table read is bounds-checked (request row and logical column), an out-of-range
  entry becoming -1, so no input makes a kernel read outside its tensors;
- ``compute_global_topk_indices_and_lens`` compacts valid entries to the left;
- every column of a written row is written (``out=`` buffers get their tails reset to -1);
- window sizes need not be powers of two (rows are written in column tiles, not window tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_impl.launch import launch, select_config
from triton_impl.validation import (
    check_int_at_least,
    check_positive,
    check_tensor,
    content_checks_enabled,
    next_pow2,
)

_I32 = (torch.int32,)
_COLUMN_TILE = 128  # combine: columns per tile (the width is a multiple of 128)
_TOPK_TILE = 1024  # global top-k: at most this many entries per tile, as upstream
_COMBINE_ALIGNMENT = 128  # combine: the row width rounds up to a multiple of 128 (sparse prefill's tile)
_FLASHINFER_TOPK_ALIGNMENT = 4  # FlashInfer: the top-k columns round up to a multiple of 4


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _combined_width(topk: int, window_size: int, max_image_tokens: int) -> int:
    """Columns of a combined row: ``topk + W + IMG`` rounded up to 128."""
    return _round_up(topk + window_size + max_image_tokens, _COMBINE_ALIGNMENT)


def _flashinfer_widths(swa_index_width: int, topk: int, decode_topk: int, max_image_tokens: int) -> tuple[int, int]:
    """``(swa_total, padded_topk)``: SWA columns ``Wswa + IMG``, then ``max(topk, Kd)`` rounded up to 4."""
    return swa_index_width + max_image_tokens, _round_up(max(topk, decode_topk), _FLASHINFER_TOPK_ALIGNMENT)


def _swa_lengths(pos: torch.Tensor, left: torch.Tensor, right: torch.Tensor, window_size: int) -> torch.Tensor:
    """Host twin of :func:`_swa_window`'s length, for the content checks."""
    pos, left, right = (t.to(torch.int64) for t in (pos, left, right))
    start = (pos - (window_size - 1) - (left - (window_size - 1)).clamp(min=0)).clamp(min=0)
    return pos + right - start + 1


@dataclass(frozen=True)
class LaunchConfig:
    combine_workers: int  # programs per request along grid axis 1; fixed, so CUDA graphs can replay it
    num_warps: int


# Launch configs as data, keyed by GPU architecture ("sm90", ...). These kernels move a few KB
# per token; the benchmark has no case for them, so every GPU gets upstream's launch
# (256 combine workers per request; 4 warps), not tuned; the interpreter runs programs one after another
# in Python, so it gets 2 workers (results do not depend on the count; a test checks it).
LAUNCH_CONFIGS: dict[str, LaunchConfig] = {
    "default": LaunchConfig(combine_workers=256, num_warps=4),
    "interpreter": LaunchConfig(combine_workers=2, num_warps=1),
}


def select_launch_config(device: torch.device) -> LaunchConfig:
    return select_config(LAUNCH_CONFIGS, device)


@triton.jit
def _table_slots(block_table_ptr, table_stride, num_rows, num_cols, req, local, valid, block_size):
    """``block_table[req, local // bs] * bs + local % bs`` where ``valid`` and the entry exists, else -1.

    The entry exists when ``local >= 0``, ``0 <= req < num_rows`` and ``local // bs < num_cols``;
    only existing entries are loaded. Returns ``(slots, exists & valid)``.
    """
    # tl.where, not &, joins the scalar request test to the block: under the interpreter (Triton
    # 3.9) a scalar bool & a block of bools yields an int32 block, which tl.load rejects as a mask.
    req_ok = (req >= 0) & (req < num_rows)
    exists = tl.where(req_ok, valid & (local >= 0) & (local // block_size < num_cols), False)
    entry = tl.load(block_table_ptr + req.to(tl.int64) * table_stride + local // block_size, mask=exists, other=0)
    return tl.where(exists, entry * block_size + local % block_size, -1), exists


@triton.jit
def _remap_block_span(values, block_size, block_span):
    """``blk * bs + off -> blk * span + off`` for slots ``>= 0``; -1 stays (FlashInfer packed pages)."""
    is_slot = values >= 0
    safe = tl.where(is_slot, values, 0)
    return tl.where(is_slot, (safe // block_size) * block_span + safe % block_size, -1)


@triton.jit
def _swa_window(pos, left_ptr, right_ptr, token, WINDOW: tl.constexpr, HAS_IMAGE: tl.constexpr):
    """The SWA keys of the token at position ``pos``: ``[start, start + len)`` with
    ``start = max(pos - (W-1) - max(left - (W-1), 0), 0)`` and ``len = pos + right - start + 1``,
    ``left``/``right`` being the token's image visibility (0 without images)."""
    left = 0
    right = 0
    if HAS_IMAGE:
        left = tl.load(left_ptr + token)
        right = tl.load(right_ptr + token)
    start = tl.maximum(pos - (WINDOW - 1) - tl.maximum(left - (WINDOW - 1), 0), 0)
    return start, pos + right - start + 1


# ----------------------------------------------------------------------------------------------
# Global top-k: request-local positions -> global cache slots, compacted, with counts.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _global_topk_kernel(
    out_ptr, out_stride,
    lens_ptr,
    topk_ptr, topk_stride, topk,
    token_to_req_ptr,
    block_table_ptr, table_stride, num_rows, num_cols,
    is_valid_token_ptr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    """Grid ``(T,)``: a program owns one token's row.

    It reads the token's request and validity once, then walks the row in tiles of ``TILE``
    entries: each valid entry's slot is stored at ``count + (its rank among the tile's valid
    entries)``, an exclusive prefix sum that keeps the original order. A second pass fills the
    columns ``[count, K)`` with -1; the two passes write disjoint columns.
    """
    token = tl.program_id(0).to(tl.int64)
    req = tl.load(token_to_req_ptr + token)
    token_valid = tl.load(is_valid_token_ptr + token) != 0
    out_row = out_ptr + token * out_stride
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, topk, TILE):
        cols = start + tl.arange(0, TILE)
        local = tl.load(topk_ptr + token * topk_stride + cols, mask=cols < topk, other=-1)
        slots, valid = _table_slots(
            block_table_ptr,
            table_stride,
            num_rows,
            num_cols,
            req,
            local,
            tl.where(token_valid, cols < topk, False),
            BLOCK_SIZE,
        )
        rank = tl.cumsum(valid.to(tl.int32), axis=0) - 1
        tl.store(out_row + count + rank, slots, mask=valid)
        count += tl.sum(valid.to(tl.int32), axis=0)
    for start in range(0, topk, TILE):
        cols = start + tl.arange(0, TILE)
        tl.store(out_row + cols, tl.full((TILE,), -1, tl.int32), mask=(cols < topk) & (cols >= count))
    tl.store(lens_ptr + token, count)


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each token's request-local top-k positions to global cache slots, compacted, and count them.

    Entry ``local`` of token ``t`` is valid when ``local >= 0``, ``0 <= req < R`` and
    ``0 <= local // bs < Bmax`` (``req = token_to_req_indices[t]``); its slot is
    ``block_table[req, local // bs] * bs + local % bs``. Valid slots move to the left in their
    order, the rest is -1, ``lens`` counts them; ``is_valid_token[t]`` false gives ``lens = 0``
    and a row of -1. Twin: ``golden.sparse_indices.compute_global_topk_indices_and_lens``.
    Paper: papers.md#sparse-indices.

    Args:
        topk_indices: ``[T, K]`` int32 (any row stride).
        token_to_req_indices: ``[T]`` int32 (or int64).
        block_table: ``[R, Bmax]`` int32 (any row stride: a column slice of a wider table works).
        block_size: tokens per block.
        is_valid_token: ``[T]`` bool.

    Returns:
        ``(global [T, K] int32, lens [T] int32)``, newly allocated.

    Traffic: reads ``4*T*K`` index bytes and up to ``4*T*K`` table bytes; writes ``4*T*K + 4*T``.
    """
    check_positive("block_size", block_size)
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=_I32)
    num_tokens, topk = topk_indices.shape
    device = topk_indices.device
    check_tensor(
        "token_to_req_indices",
        token_to_req_indices,
        shape=(num_tokens,),
        dtypes=(torch.int32, torch.int64),
        device=device,
    )
    check_tensor("block_table", block_table, ndim=2, dtypes=_I32, device=device)
    check_tensor("is_valid_token", is_valid_token, shape=(num_tokens,), dtypes=(torch.bool,), device=device)
    out = torch.empty((num_tokens, topk), dtype=topk_indices.dtype, device=device)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return out, lens
    launch(_global_topk_kernel, (num_tokens,),
        out, out.stride(0),
        lens,
        topk_indices, topk_indices.stride(0), topk,
        token_to_req_indices,
        block_table, block_table.stride(0), block_table.shape[0], block_table.shape[1],
        is_valid_token,
        BLOCK_SIZE=block_size,
        TILE=min(_TOPK_TILE, next_pow2(max(topk, 1))),
        num_warps=select_launch_config(device).num_warps,
    )  # fmt: skip
    return out, lens


# ----------------------------------------------------------------------------------------------
# Sparse prefill: top-k workspace rows, then the SWA window's workspace rows.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    out_ptr, out_stride,
    lens_ptr,
    topk_ptr, topk_stride, num_tokens,
    query_start_loc_ptr, seq_lens_ptr, gather_lens_ptr,
    left_ptr, right_ptr,
    M, N,
    TOP_K: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    WIDTH: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    """Grid ``(Rc, workers)``: worker ``w`` of request ``b`` owns its query tokens ``w, w + workers, ...``.

    Per request it reads the query range, ``seq_len`` and ``gather_len`` once; per token it
    derives ``topk_len`` and the window, then writes the whole row in tiles of ``TILE`` columns,
    each column from its index alone (top-k entry, window row or -1), so no column keeps a stale
    value and the window length needs no power-of-two tiling. Tokens outside ``[0, num_tokens)``
    (possible only for a bad ``query_start_loc`` with the content checks off) are not touched.
    """
    req = tl.program_id(0)
    worker = tl.program_id(1)
    num_workers = tl.num_programs(1)
    base = tl.load(query_start_loc_ptr)
    query_start = tl.load(query_start_loc_ptr + req) - base
    query_end = tl.load(query_start_loc_ptr + req + 1) - base
    seq_len = tl.load(seq_lens_ptr + req)
    gather_start = seq_len - tl.load(gather_lens_ptr + req)
    first_pos = seq_len - (query_end - query_start)
    request_base = M * req
    for token in range(tl.maximum(query_start, 0) + worker, tl.minimum(query_end, num_tokens), num_workers):
        pos = first_pos + (token - query_start)
        topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
        swa_start, swa_len = _swa_window(pos, left_ptr, right_ptr, token, WINDOW, HAS_IMAGE)
        row = tl.cast(token, tl.int64)
        for tile in range(0, WIDTH, TILE):
            cols = tile + tl.arange(0, TILE)
            picked = tl.load(topk_ptr + row * topk_stride + cols, mask=cols < topk_len, other=-1)
            topk_part = tl.where(picked >= 0, picked + request_base, -1)
            swa_part = request_base + N + swa_start + (cols - topk_len) - gather_start
            values = tl.where(cols < topk_len, topk_part, tl.where(cols < topk_len + swa_len, swa_part, -1))
            tl.store(out_ptr + row * out_stride + cols, values)
        tl.store(lens_ptr + row, topk_len + swa_len)


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-prefill indices: each token's top-k workspace rows, then its SWA window's rows (vLLM's signature).

    Request ``b`` owns workspace rows ``[M*b, M*b + M)`` (compressed K at ``[0, N)``, the SWA
    tail at ``[N, N + gather_len)``); formulas in
    ``golden.sparse_indices.combine_topk_swa_indices`` (the twin). Every column of each request
    token's row is written: ``out=`` tails are reset to -1 (upstream leaves them stale), and a
    negative top-k entry stays -1 (upstream adds ``M*b``). Paper: papers.md#sparse-indices.

    Args:
        topk_indices: ``[Tc, Kw]`` int32, chunk-local rows, ``Kw >= topk`` (any row stride).
        query_start_loc: ``[Rc + 1]`` int32, non-decreasing; rebased on its first entry.
        seq_lens, gather_lens: ``[Rc]`` int32, ``seq_len >= query_len``; ``gather_len <= min(seq_len, M - N)``
            and at least the span from each request's earliest position a window sees to its end.
        window_size: ``W >= 1``; compress_ratio: ``>= 1``; topk: ``>= 0``; M, N: workspace sizes, ``M >= N >= 0``.
        out: ``(combined [>= Tc, width], lens [>= Tc])`` int32 buffers, or None to allocate
            (``-1`` / ``0`` for chunk rows past the last request).
        left_visible, right_visible: ``[>= Tc]`` int32 (both or neither), with
            ``swa_len <= W + max_image_tokens`` for every token.
        max_image_tokens: the widest image span, in tokens.

    Returns:
        ``(combined, lens)``: ``width = round_up(topk + W + IMG, 128)`` columns.

    Traffic: reads ``4*topk_len`` bytes per token; writes ``4*width + 4`` per token.
    """
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=_I32)
    num_tokens, topk_width = topk_indices.shape
    device = topk_indices.device
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_I32, device=device)
    num_reqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, shape=(num_reqs + 1,), dtypes=_I32, device=device)
    check_tensor("gather_lens", gather_lens, shape=(num_reqs,), dtypes=_I32, device=device)
    check_int_at_least("window_size", window_size, 1)
    check_int_at_least("compress_ratio", compress_ratio, 1)
    check_int_at_least("topk", topk, 0)
    check_int_at_least("max_image_tokens", max_image_tokens, 0)
    check_int_at_least("N", N, 0)
    check_int_at_least("M", M, N)
    if topk > topk_width:
        raise ValueError(f"topk: expected <= topk_indices.shape[1] = {topk_width}, got {topk}")
    if (left_visible is None) != (right_visible is None):
        raise ValueError("left_visible, right_visible: give both or neither")
    has_image = left_visible is not None
    if has_image:
        for name, t in (("left_visible", left_visible), ("right_visible", right_visible)):
            check_tensor(name, t, ndim=1, dtypes=_I32, device=device)
            if t.shape[0] < num_tokens:
                raise ValueError(f"{name}: expected >= {num_tokens} entries (one per chunk token), got {t.shape[0]}")
    image_width = max_image_tokens if has_image else 0
    width = _combined_width(topk, window_size, image_width)
    if out is None:
        combined = torch.full((num_tokens, width), -1, dtype=torch.int32, device=device)
        lens = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out: expected a pair (combined, lens) of tensors or None, got {type(out).__name__}"
                            f"{f' of {len(out)}' if isinstance(out, (tuple, list)) else ''}")  # fmt: skip
        combined, lens = out
        check_tensor("out[0]", combined, ndim=2, dtypes=_I32, device=device)
        check_tensor("out[1]", lens, ndim=1, dtypes=_I32, device=device)
        if combined.shape[0] < num_tokens or combined.shape[1] != width:
            raise ValueError(f"out[0]: expected [>= {num_tokens}, {width}], got {list(combined.shape)}")
        if lens.shape[0] < num_tokens:
            raise ValueError(f"out[1]: expected >= {num_tokens} entries, got {lens.shape[0]}")
    if content_checks_enabled(device) and num_reqs:
        _check_combine_contents(
            num_tokens, query_start_loc, seq_lens, gather_lens, window_size, left_visible, right_visible, image_width,
            M - N,
        )
    if num_reqs == 0 or num_tokens == 0:
        return combined, lens
    config = select_launch_config(device)
    launch(_combine_kernel, (num_reqs, config.combine_workers),
        combined, combined.stride(0),
        lens,
        topk_indices, topk_indices.stride(0), num_tokens,
        query_start_loc, seq_lens, gather_lens,
        left_visible if has_image else seq_lens, right_visible if has_image else seq_lens,
        M, N,
        TOP_K=topk,
        COMPRESS_RATIO=compress_ratio,
        WINDOW=window_size,
        HAS_IMAGE=has_image,
        WIDTH=width,
        TILE=_COLUMN_TILE,
        num_warps=config.num_warps,
    )  # fmt: skip
    return combined, lens


def _check_combine_contents(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    left_visible: torch.Tensor | None,
    right_visible: torch.Tensor | None,
    image_width: int,
    tail_rows: int,
) -> None:
    """Query ranges inside the chunk, ``seq_len >= query_len``, every window within its columns, and each request's
    gathered tail (``gather_len`` raw tokens at workspace rows ``[N, N + gather_len)``, at most ``tail_rows = M - N``
    of them) holding every position its tokens' windows see: else a window's first rows would fall into the
    compressed rows below ``N`` (or into the next request's rows)."""
    qsl = query_start_loc.to(torch.int64).cpu()
    query_lens = qsl[1:] - qsl[:-1]
    if bool((query_lens < 0).any()) or int(qsl[-1] - qsl[0]) > num_tokens:
        raise ValueError(
            f"query_start_loc: expected non-decreasing, spanning <= {num_tokens} chunk tokens, got {qsl.tolist()}"
        )
    seq = seq_lens.to(torch.int64).cpu()
    if bool((seq < query_lens).any()):
        raise ValueError(f"seq_lens: expected >= the query lengths {query_lens.tolist()}, got {seq.tolist()}")
    gathered = gather_lens.to(torch.int64).cpu()
    if bool(((gathered < 0) | (gathered > seq) | (gathered > tail_rows)).any()):
        raise ValueError(
            f"gather_lens: expected 0 <= gather_len <= seq_len and <= M - N = {tail_rows}, got {gathered.tolist()} "
            f"for seq_lens {seq.tolist()}"
        )
    tokens = int(qsl[-1] - qsl[0])
    positions = torch.cat(
        [torch.arange(int(s) - int(q), int(s)) for s, q in zip(seq, query_lens)] or [torch.zeros(0, dtype=torch.int64)]
    )
    request = torch.repeat_interleave(torch.arange(seq.shape[0]), query_lens)
    if left_visible is None:
        left = right = torch.zeros_like(positions)
    else:
        left, right = left_visible[:tokens].cpu(), right_visible[:tokens].cpu()
        _check_visibility(positions, left, right, window_size, window_size + image_width)
    first_seen = positions + 1 - _swa_lengths(positions, left, right, window_size) + right
    short = first_seen < seq[request] - gathered[request]
    if bool(short.any()):
        token = int(short.nonzero()[0, 0])
        b = int(request[token])
        raise ValueError(
            f"gather_lens: request {b} gathers its last {int(gathered[b])} tokens, but its token at position "
            f"{int(positions[token])} sees position {int(first_seen[token])} through its window"
        )


def _check_visibility(
    positions: torch.Tensor, left: torch.Tensor, right: torch.Tensor, window_size: int, columns: int
) -> None:
    """Visibility is non-negative and each token's window fits its ``columns`` SWA columns."""
    if bool((left < 0).any()) or bool((right < 0).any()):
        raise ValueError("left_visible, right_visible: expected >= 0")
    length = _swa_lengths(positions, left, right, window_size)
    if length.numel() and int(length.max()) > columns:
        worst = int(length.argmax())
        raise ValueError(
            f"left_visible, right_visible: token {worst}'s window has {int(length[worst])} positions, more than "
            f"the {columns} SWA columns (window_size + max_image_tokens)"
        )


# ----------------------------------------------------------------------------------------------
# FlashInfer mixed decode/prefill sparse indices.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _flashinfer_decode_row(
    out_row, lens_ptr, row, req,
    decode_swa_ptr, decode_swa_stride,
    decode_comp_ptr, decode_comp_stride,
    decode_lens_ptr,
    decode_valid_ptr,
    swa_block_size, swa_block_span,
    comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols, comp_block_size, comp_block_span,
    SWA_INDEX_WIDTH: tl.constexpr,
    SWA_TOTAL: tl.constexpr,
    DECODE_TOPK: tl.constexpr,
    PADDED_TOPK: tl.constexpr,
    DECODE_LOCAL: tl.constexpr,
    HAS_DECODE_LENS: tl.constexpr,
    SWA_TILE: tl.constexpr,
    TOPK_TILE: tl.constexpr,
):  # fmt: skip
    """A decode row: its SWA slots copied, its compressed entries (local ones translated through
    the compressed table and the valid ones counted), every column written."""
    for tile in tl.static_range(0, SWA_TOTAL, SWA_TILE):
        cols = tile + tl.arange(0, SWA_TILE)
        slots = tl.load(decode_swa_ptr + row * decode_swa_stride + cols, mask=cols < SWA_INDEX_WIDTH, other=-1)
        slots = _remap_block_span(slots, swa_block_size, swa_block_span)
        tl.store(out_row + cols, slots, mask=cols < SWA_TOTAL)
    counted = tl.zeros((), dtype=tl.int32)
    for tile in tl.static_range(0, PADDED_TOPK, TOPK_TILE):
        cols = tile + tl.arange(0, TOPK_TILE)
        entries = tl.load(decode_comp_ptr + row * decode_comp_stride + cols, mask=cols < DECODE_TOPK, other=-1)
        if DECODE_LOCAL:
            entries, valid = _table_slots(
                comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols,
                req, entries, cols < DECODE_TOPK, comp_block_size,
            )  # fmt: skip
            token_valid = tl.load(decode_valid_ptr + row) != 0
            counted += tl.sum(tl.where(token_valid, valid, False).to(tl.int32), axis=0)
        entries = _remap_block_span(entries, comp_block_size, comp_block_span)
        tl.store(out_row + SWA_TOTAL + cols, entries, mask=cols < PADDED_TOPK)
    # Constexpr branches: only the taken one is compiled, so `count` may differ in kind between them.
    if DECODE_LOCAL:
        count = counted
    elif DECODE_TOPK == 0:
        count = tl.zeros((), dtype=tl.int32)
    elif HAS_DECODE_LENS:
        count = tl.load(decode_lens_ptr + row)
    else:
        count = tl.full((), DECODE_TOPK, tl.int32)
    tl.store(lens_ptr + row, SWA_TOTAL + count)


@triton.jit
def _flashinfer_prefill_row(
    out_row, lens_ptr, row, req, token, num_decode,
    prefill_topk_ptr, prefill_topk_stride, prefill_topk_width,
    left_ptr, right_ptr,
    query_start_loc_ptr, seq_lens_ptr, num_reqs,
    swa_table_ptr, swa_table_stride, swa_table_cols, swa_block_size, swa_block_span,
    comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols, comp_block_size, comp_block_span,
    WINDOW: tl.constexpr,
    SWA_TOTAL: tl.constexpr,
    PADDED_TOPK: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    SWA_TILE: tl.constexpr,
    TOPK_TILE: tl.constexpr,
):  # fmt: skip
    """A prefill row: its request's query range and length read once, then each SWA column's
    position and each compressed column's local index derived from the column alone."""
    # The request's loads are masked so that an out-of-range request (possible only with the
    # content checks off) reads nothing; its columns then all come out -1.
    req_ok = (req >= 0) & (req < num_reqs)
    query_start = tl.load(query_start_loc_ptr + req, mask=req_ok, other=0)
    query_len = tl.load(query_start_loc_ptr + req + 1, mask=req_ok, other=0) - query_start
    seq_len = tl.load(seq_lens_ptr + req, mask=req_ok, other=0)
    pos = seq_len - query_len + (token - query_start)
    swa_start, swa_len = _swa_window(pos, left_ptr, right_ptr, row, WINDOW, HAS_IMAGE)
    topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
    for tile in tl.static_range(0, SWA_TOTAL, SWA_TILE):
        cols = tile + tl.arange(0, SWA_TILE)
        slots, _ = _table_slots(
            swa_table_ptr, swa_table_stride, num_reqs, swa_table_cols,
            req, swa_start + cols, cols < swa_len, swa_block_size,
        )  # fmt: skip
        slots = _remap_block_span(slots, swa_block_size, swa_block_span)
        tl.store(out_row + cols, slots, mask=cols < SWA_TOTAL)
    prefill_row = (token - num_decode).to(tl.int64)
    for tile in tl.static_range(0, PADDED_TOPK, TOPK_TILE):
        cols = tile + tl.arange(0, TOPK_TILE)
        picked = (cols < prefill_topk_width) & (cols < topk_len)
        local = tl.load(prefill_topk_ptr + prefill_row * prefill_topk_stride + cols, mask=picked, other=-1)
        slots, _ = _table_slots(
            comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols,
            req, local, picked, comp_block_size,
        )  # fmt: skip
        slots = _remap_block_span(slots, comp_block_size, comp_block_span)
        tl.store(out_row + SWA_TOTAL + cols, slots, mask=cols < PADDED_TOPK)
    tl.store(lens_ptr + row, SWA_TOTAL + topk_len)


@triton.jit
def _flashinfer_kernel(
    out_ptr, out_stride,
    lens_ptr,
    decode_swa_ptr, decode_swa_stride,
    decode_comp_ptr, decode_comp_stride,
    decode_lens_ptr,
    decode_valid_ptr,
    prefill_topk_ptr, prefill_topk_stride, prefill_topk_width,
    left_ptr, right_ptr,
    query_start_loc_ptr, seq_lens_ptr, num_reqs,
    token_to_req_ptr,
    swa_table_ptr, swa_table_stride, swa_table_cols, swa_block_size, swa_block_span,
    comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols, comp_block_size, comp_block_span,
    num_decode,
    WINDOW: tl.constexpr,
    SWA_INDEX_WIDTH: tl.constexpr,
    SWA_TOTAL: tl.constexpr,
    DECODE_TOPK: tl.constexpr,
    PADDED_TOPK: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
    TOP_K: tl.constexpr,
    DECODE_LOCAL: tl.constexpr,
    HAS_DECODE_LENS: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    SWA_TILE: tl.constexpr,
    TOPK_TILE: tl.constexpr,
):  # fmt: skip
    """Grid ``(Td + Tp,)``: a program owns one row (decode rows first).

    A decode row copies its SWA slots and compressed entries (translating local ones through the
    compressed table and counting the valid ones); a prefill row reads its request's query range
    and length once, then derives each SWA column's position and each compressed column's local
    index from the column alone. Both write every column, in tiles of the next power of two.

    The two kinds of row are two functions, so the run-time ``if`` below assigns no variable:
    compiled Triton requires a name assigned in both branches to have one type and shape, and
    the two kinds tile their columns differently.
    """
    token = tl.program_id(0)
    row = token.to(tl.int64)
    out_row = out_ptr + row * out_stride
    req = tl.load(token_to_req_ptr + row)
    if token < num_decode:
        _flashinfer_decode_row(
            out_row, lens_ptr, row, req,
            decode_swa_ptr, decode_swa_stride,
            decode_comp_ptr, decode_comp_stride,
            decode_lens_ptr,
            decode_valid_ptr,
            swa_block_size, swa_block_span,
            comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols, comp_block_size, comp_block_span,
            SWA_INDEX_WIDTH, SWA_TOTAL, DECODE_TOPK, PADDED_TOPK, DECODE_LOCAL, HAS_DECODE_LENS, SWA_TILE, TOPK_TILE,
        )  # fmt: skip
    else:
        _flashinfer_prefill_row(
            out_row, lens_ptr, row, req, token, num_decode,
            prefill_topk_ptr, prefill_topk_stride, prefill_topk_width,
            left_ptr, right_ptr,
            query_start_loc_ptr, seq_lens_ptr, num_reqs,
            swa_table_ptr, swa_table_stride, swa_table_cols, swa_block_size, swa_block_span,
            comp_table_ptr, comp_table_stride, comp_table_rows, comp_table_cols, comp_block_size, comp_block_span,
            WINDOW, SWA_TOTAL, PADDED_TOPK, COMPRESS_RATIO, TOP_K, HAS_IMAGE, SWA_TILE, TOPK_TILE,
        )  # fmt: skip


def build_flashinfer_mixed_sparse_indices(
    decode_swa_indices: torch.Tensor,
    decode_compressed_indices: torch.Tensor | None,
    decode_compressed_topk_lens: torch.Tensor | None,
    prefill_topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_block_size: int,
    compressed_block_table: torch.Tensor | None,
    compressed_block_size: int,
    window_size: int,
    compress_ratio: int,
    topk: int,
    decode_compressed_indices_are_local: bool = False,
    decode_is_valid_token: torch.Tensor | None = None,
    swa_block_span: int | None = None,
    compressed_block_span: int | None = None,
    prefill_left_visible: torch.Tensor | None = None,
    prefill_right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's decode-first sparse-index matrix: SWA slots, then compressed slots (vLLM's signature).

    Layout and formulas in ``golden.sparse_indices.build_flashinfer_mixed_sparse_indices`` (the
    twin): ``[Td + Tp, SWA_TOTAL + padded_topk]`` with ``SWA_TOTAL = Wswa + IMG`` and
    ``padded_topk = round_up(max(topk, Kd), 4)``; lens count the whole SWA region. Block-table
    reads are bounds-checked (out-of-range -> -1), which upstream does not do.
    Paper: papers.md#sparse-indices.

    Args:
        decode_swa_indices: ``[Td, Wswa]`` int32 global SWA slots, ``Wswa >= window_size``.
        decode_compressed_indices: ``[Td, Kd]`` int32 or None.
        decode_compressed_topk_lens: ``[>= Td]`` int32 or None.
        prefill_topk_indices: ``[Tp, Kp]`` int32 request-local compressed positions or -1.
        query_start_loc: ``[R + 1]`` int32 (batch token numbering, decodes first).
        seq_lens: ``[R]`` int32; token_to_req_indices: ``[>= Td + Tp]`` int32.
        swa_block_table: ``[>= R, B]`` int32; compressed_block_table: ``[R', B']`` int32 or None (the SWA table;
            a request past its ``R'`` rows gets -1 slots).
        swa_block_size, compressed_block_size: tokens per block; spans: page stride in tokens
            (None: the block size).
        window_size, compress_ratio, topk: as in the golden model.
        decode_compressed_indices_are_local: translate decode entries through the compressed table.
        decode_is_valid_token: ``[>= Td]`` bool, required when the decode entries are local.
        prefill_left_visible, prefill_right_visible: ``[>= Td + Tp]`` int32 (both or neither).
        max_image_tokens: image columns added to the SWA region when visibility is given.

    Returns:
        ``(sparse_indices, lens)`` int32, newly allocated.

    Traffic: writes ``4*(SWA_TOTAL + padded_topk) + 4`` bytes per token; reads about as many.
    """
    check_tensor("decode_swa_indices", decode_swa_indices, ndim=2, dtypes=_I32)
    device = decode_swa_indices.device
    num_decode, swa_index_width = decode_swa_indices.shape
    check_tensor("prefill_topk_indices", prefill_topk_indices, ndim=2, dtypes=_I32, device=device)
    num_tokens = num_decode + prefill_topk_indices.shape[0]
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_I32, device=device)
    num_reqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, shape=(num_reqs + 1,), dtypes=_I32, device=device)
    check_tensor("token_to_req_indices", token_to_req_indices, ndim=1, dtypes=_I32, device=device)
    if token_to_req_indices.shape[0] < num_tokens:
        raise ValueError(f"token_to_req_indices: expected >= {num_tokens} entries, got {token_to_req_indices.shape[0]}")
    check_tensor("swa_block_table", swa_block_table, ndim=2, dtypes=_I32, device=device)
    if swa_block_table.shape[0] < num_reqs:  # the kernel bounds the SWA table's rows by the request count
        raise ValueError(
            f"swa_block_table: expected >= {num_reqs} rows (one per request), got {list(swa_block_table.shape)}"
        )
    compressed_table = swa_block_table if compressed_block_table is None else compressed_block_table
    check_tensor("compressed_block_table", compressed_table, ndim=2, dtypes=_I32, device=device)
    for name, value in (("swa_block_size", swa_block_size), ("compressed_block_size", compressed_block_size)):
        check_positive(name, value)
    swa_span = swa_block_size if swa_block_span is None else swa_block_span
    compressed_span = compressed_block_size if compressed_block_span is None else compressed_block_span
    check_positive("swa_block_span", swa_span)
    check_positive("compressed_block_span", compressed_span)
    check_int_at_least("window_size", window_size, 1)
    check_int_at_least("compress_ratio", compress_ratio, 1)
    check_int_at_least("topk", topk, 0)
    check_int_at_least("max_image_tokens", max_image_tokens, 0)
    if swa_index_width < window_size:
        raise ValueError(f"decode_swa_indices: expected >= window_size = {window_size} columns, got {swa_index_width}")
    decode_topk = 0
    if decode_compressed_indices is not None:
        check_tensor("decode_compressed_indices", decode_compressed_indices, ndim=2, dtypes=_I32, device=device)
        if decode_compressed_indices.shape[0] != num_decode:
            raise ValueError(
                f"decode_compressed_indices: expected {num_decode} rows (one per decode token), "
                f"got {decode_compressed_indices.shape[0]}"
            )
        decode_topk = decode_compressed_indices.shape[1]
    if decode_compressed_topk_lens is not None:
        check_tensor("decode_compressed_topk_lens", decode_compressed_topk_lens, ndim=1, dtypes=_I32, device=device)
        if decode_compressed_topk_lens.shape[0] < num_decode:
            raise ValueError(
                f"decode_compressed_topk_lens: expected >= {num_decode} entries, "
                f"got {decode_compressed_topk_lens.shape[0]}"
            )
    local = decode_compressed_indices_are_local and decode_topk > 0
    if local:
        if decode_is_valid_token is None:
            raise ValueError("decode_is_valid_token: required when decode_compressed_indices_are_local")
        check_tensor("decode_is_valid_token", decode_is_valid_token, ndim=1, dtypes=(torch.bool,), device=device)
        if decode_is_valid_token.shape[0] < num_decode:
            raise ValueError(
                f"decode_is_valid_token: expected >= {num_decode} entries, got {decode_is_valid_token.shape[0]}"
            )
    if (prefill_left_visible is None) != (prefill_right_visible is None):
        raise ValueError("prefill_left_visible, prefill_right_visible: give both or neither")
    has_image = prefill_left_visible is not None
    if has_image:
        for name, t in (
            ("prefill_left_visible", prefill_left_visible),
            ("prefill_right_visible", prefill_right_visible),
        ):
            check_tensor(name, t, ndim=1, dtypes=_I32, device=device)
            if t.shape[0] < num_tokens:
                raise ValueError(f"{name}: expected >= {num_tokens} entries (one per batch row), got {t.shape[0]}")
    image_width = max_image_tokens if has_image else 0
    swa_total, padded_topk = _flashinfer_widths(swa_index_width, topk, decode_topk, image_width)
    indices = torch.empty((num_tokens, swa_total + padded_topk), dtype=torch.int32, device=device)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return indices, lens
    if content_checks_enabled(device) and num_tokens > num_decode:
        _check_flashinfer_contents(
            num_decode, num_tokens, query_start_loc, seq_lens, token_to_req_indices,
            window_size, prefill_left_visible, prefill_right_visible, swa_total,
        )  # fmt: skip
    dummy = token_to_req_indices  # pointer for absent optional tensors; never read
    launch(_flashinfer_kernel, (num_tokens,),
        indices, indices.stride(0),
        lens,
        decode_swa_indices, decode_swa_indices.stride(0),
        dummy if decode_compressed_indices is None else decode_compressed_indices,
        0 if decode_compressed_indices is None else decode_compressed_indices.stride(0),
        dummy if decode_compressed_topk_lens is None else decode_compressed_topk_lens,
        decode_is_valid_token if local else dummy,
        prefill_topk_indices, prefill_topk_indices.stride(0), prefill_topk_indices.shape[1],
        prefill_left_visible if has_image else dummy, prefill_right_visible if has_image else dummy,
        query_start_loc, seq_lens, num_reqs,
        token_to_req_indices,
        swa_block_table, swa_block_table.stride(0), swa_block_table.shape[1], swa_block_size, swa_span,
        compressed_table, compressed_table.stride(0), compressed_table.shape[0], compressed_table.shape[1],
        compressed_block_size, compressed_span,
        num_decode,
        WINDOW=window_size,
        SWA_INDEX_WIDTH=swa_index_width,
        SWA_TOTAL=swa_total,
        DECODE_TOPK=decode_topk,
        PADDED_TOPK=padded_topk,
        COMPRESS_RATIO=compress_ratio,
        TOP_K=topk,
        DECODE_LOCAL=local,
        HAS_DECODE_LENS=decode_compressed_topk_lens is not None,
        HAS_IMAGE=has_image,
        SWA_TILE=next_pow2(max(swa_total, 1)),
        TOPK_TILE=next_pow2(max(padded_topk, 1)),
        num_warps=select_launch_config(device).num_warps,
    )  # fmt: skip
    return indices, lens


def _check_flashinfer_contents(
    num_decode: int,
    num_tokens: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    window_size: int,
    left_visible: torch.Tensor | None,
    right_visible: torch.Tensor | None,
    swa_total: int,
) -> None:
    """Each prefill row names a request, lies in its query range, and its window fits the SWA columns."""
    req = token_to_req_indices[num_decode:num_tokens].to(torch.int64).cpu()
    num_reqs = seq_lens.shape[0]
    if bool(((req < 0) | (req >= num_reqs)).any()):
        raise ValueError(
            f"token_to_req_indices: prefill rows must name one of the {num_reqs} requests, got {req.tolist()}"
        )
    qsl = query_start_loc.to(torch.int64).cpu()
    rows = torch.arange(num_decode, num_tokens)
    if bool(((rows < qsl[req]) | (rows >= qsl[req + 1])).any()):
        raise ValueError("query_start_loc: a prefill row lies outside its request's query range")
    query_len = qsl[req + 1] - qsl[req]
    seq = seq_lens.to(torch.int64).cpu()[req]
    if bool((seq < query_len).any()):
        raise ValueError(f"seq_lens: expected >= the query length for every prefill request, got {seq.tolist()}")
    if left_visible is not None:  # without it a window is at most window_size <= Wswa long
        left, right = left_visible[num_decode:num_tokens].cpu(), right_visible[num_decode:num_tokens].cpu()
        _check_visibility(seq - query_len + (rows - qsl[req]), left, right, window_size, swa_total)
