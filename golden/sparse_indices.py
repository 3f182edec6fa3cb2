"""DeepSeek sparse-attention index preparation: which KV rows each query token attends to.

DeepSeek-V4 attention layers combine a top-k branch over compressed KV entries (the lightning
indexer picks ``topk`` of them; compress ratio 4 for CSA, 128 for HCA) with a sliding window of
the last ``window_size`` raw tokens. Three index layouts feed the kernels:

- :func:`compute_global_topk_indices_and_lens`: the indexer's request-local top-k positions
  become global cache slots through the block table (decode, FlashMLA sparse);
- :func:`combine_topk_swa_indices`: for sparse prefill, rows of a per-request dense workspace
  (compressed K at rows ``[0, N)``, the gathered SWA tail at ``[N, N + gather_len)``);
- :func:`build_flashinfer_mixed_sparse_indices`: FlashInfer's decode-first matrix of SWA slots
  then compressed slots.

What a query token at absolute position ``pos`` of a ``seq_len``-token request sees:

- top-k branch: a compressed entry is complete once all ``compress_ratio`` raw tokens it covers
  exist, so ``(pos + 1) // compress_ratio`` entries are, and the token keeps the first
  ``topk_len = min((pos + 1) // compress_ratio, topk)`` of its indexer row;
- SWA branch (:func:`visible_positions`): the raw positions ``p < seq_len`` in its causal window
  ``pos - W < p <= pos`` or in its image neighbourhood ``pos - left <= p <= pos + right``
  (bidirectional attention inside an image span, :func:`image_visibility`; ``left = right = 0``
  elsewhere).

Both windows contain ``pos``, so the SWA set is one interval; :func:`swa_window` gives its start
and length in closed form. The layouts list these entries in ascending order, and every index is
an integer with -1 marking an unused entry. Paper: papers.md#sparse-indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

SPARSE_PREFILL_TOPK_ALIGNMENT = 128  # FlashMLA sparse prefill needs topk % B_TOPK == 0, B_TOPK in {64, 128}
FLASHINFER_TOPK_ALIGNMENT = 4  # TRTLLM-gen sparse MLA loads index rows with 16-byte vector loads


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def combined_width(topk: int, window_size: int, max_image_tokens: int = 0) -> int:
    """Columns of :func:`combine_topk_swa_indices`: ``topk + window + image`` rounded up to 128."""
    return round_up(topk + window_size + max_image_tokens, SPARSE_PREFILL_TOPK_ALIGNMENT)


def visible_positions(
    pos: torch.Tensor, left: torch.Tensor, right: torch.Tensor, seq_len: torch.Tensor, window_size: int
) -> torch.Tensor:
    """Which raw positions each query token sees through the SWA branch, as a mask over positions.

    Token ``t`` sees position ``p`` when the key exists (``p < seq_len[t]``) and ``p`` lies in
    its causal window or in its image neighbourhood::

        sees[t, p] = (p < seq_len[t]) and (pos[t] - W < p <= pos[t]  or  pos[t] - left[t] <= p <= pos[t] + right[t])

    Args:
        pos: ``[T]`` int, absolute query positions.
        left, right: ``[T]`` int, image visibility (>= 0; 0 outside images).
        seq_len: ``[T]`` int (or a scalar tensor), the length of each token's request.
        window_size: ``W >= 1``.

    Returns:
        ``sees [T, P]`` bool over positions ``0 .. P-1``, ``P = max(seq_len)``.
    """
    columns = torch.broadcast_tensors(*(t.to(torch.int64) for t in (pos, left, right, seq_len)))
    pos, left, right, seq_len = (rearrange(t, "t -> t 1") for t in columns)
    p = torch.arange(int(seq_len.max()) if seq_len.numel() else 0, device=pos.device)
    causal = (p > pos - window_size) & (p <= pos)
    image = (p >= pos - left) & (p <= pos + right)
    return (causal | image) & (p < seq_len)


def swa_window(
    pos: torch.Tensor, left: torch.Tensor, right: torch.Tensor, window_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SWA window ``[start, start + length)`` of query positions ``pos``, in closed form.

    The union of ``(pos - W, pos]`` and ``[pos - left, pos + right]`` clipped at 0 (the set of
    :func:`visible_positions` while ``pos + right < seq_len``):
    ``start = max(pos - (W-1) - max(left - (W-1), 0), 0)``, ``length = pos + right - start + 1``;
    with ``left = right = 0`` it is the causal window ``min(pos + 1, W)`` long.

    Args:
        pos, left, right: ``[T]`` int (broadcastable).
        window_size: ``W >= 1``.

    Returns:
        ``(start [T], length [T])`` int64.
    """
    pos, left, right = (t.to(torch.int64) for t in (pos, left, right))
    left_add = (left - (window_size - 1)).clamp(min=0)
    start = (pos - (window_size - 1) - left_add).clamp(min=0)
    return start, pos + right - start + 1


def image_visibility(
    positions: torch.Tensor, spans: list[tuple[int, int]], max_image_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-image bidirectional visibility of a request's query tokens (vLLM's reference rule).

    A token at ``pos`` inside an image span ``[s, e]`` (inclusive) sees ``left = min(pos - s,
    IMG - 1)`` tokens back and ``right = min(e - pos, IMG)`` ahead of the plain window
    (``IMG = max_image_tokens``); outside every span both are 0.

    Args:
        positions: ``[T]`` int, absolute positions of one request's query tokens.
        spans: disjoint inclusive ``(start, end)`` position pairs.

    Returns:
        ``(left [T], right [T])`` int32.
    """
    pos = positions.to(torch.int64)
    left = torch.zeros_like(pos)
    right = torch.zeros_like(pos)
    for s, e in spans:
        inside = (pos >= s) & (pos <= e)
        left = torch.where(inside, (pos - s).clamp(max=max_image_tokens - 1), left)
        right = torch.where(inside, (e - pos).clamp(max=max_image_tokens), right)
    return left.to(torch.int32), right.to(torch.int32)


def _topk_len(pos: torch.Tensor, compress_ratio: int, topk: int) -> torch.Tensor:
    """Top-k entries a token at ``pos`` keeps: the complete compressed entries, at most ``topk``."""
    return torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp(max=topk)


def _pack_rows(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """One output row per list entry: its values from column 0 on, then -1 up to ``width`` (int64)."""
    packed = torch.full((len(rows), width), -1, dtype=torch.int64, device=device)
    for t, values in enumerate(rows):
        packed[t, : values.numel()] = values
    return packed


def _fit_columns(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Entry ``j`` of each row for ``j < width``, -1 where the tensor has no column ``j`` (int64)."""
    kept = indices[:, :width].to(torch.int64)
    return F.pad(kept, (0, width - kept.shape[1]), value=-1)


def _table_slots(
    block_table: torch.Tensor, req: torch.Tensor, local: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_table[req, local // bs] * bs + local % bs`` where that entry exists, else -1.

    An entry exists when ``local >= 0``, ``0 <= req < R`` and ``0 <= local // bs < Bmax``
    (the table's logical columns, not its row stride).

    Args:
        block_table: ``[R, Bmax]`` int; req: ``[T]`` int; local: ``[T, K]`` int.

    Returns:
        ``(slots [T, K] int64, exists [T, K] bool)``.
    """
    num_reqs, num_cols = block_table.shape
    req = rearrange(req.to(torch.int64), "t -> t 1").expand_as(local)
    local = local.to(torch.int64)
    col = torch.div(local, block_size, rounding_mode="floor")
    exists = (local >= 0) & (req >= 0) & (req < num_reqs) & (col < num_cols)
    slots = torch.full_like(local, -1)
    pages = block_table.to(torch.int64)[req[exists], col[exists]]
    slots[exists] = pages * block_size + local[exists] % block_size
    return slots, exists


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global cache slots of each token's top-k positions, valid ones compacted to the left.

    An entry ``local = topk_indices[t, j]`` is valid when ``local >= 0``, the token's request
    ``req = token_to_req_indices[t]`` is a row of the table and ``local // bs`` one of its
    columns; its slot is ``block_table[req, local // bs] * bs + local % bs``. Row ``t`` lists the
    slots of its valid entries in their original order, then -1; ``lens[t]`` counts them.
    A token with ``is_valid_token[t]`` false (CUDA-graph padding) gets ``lens = 0`` and a row of
    -1. (The seed left -1 holes in place and read the table out of bounds; this matches
    upstream's later fix.) Paper: papers.md#sparse-indices.

    Args:
        topk_indices: ``[T, K]`` int32, request-local token positions or -1.
        token_to_req_indices: ``[T]`` int.
        block_table: ``[R, Bmax]`` int32.
        block_size: tokens per block.
        is_valid_token: ``[T]`` bool.

    Returns:
        ``(global [T, K] like topk_indices, lens [T] int32)``.

    Traffic: reads ``4*T*K`` index bytes and up to ``4*T*K`` table bytes; writes ``4*T*K + 4*T``.
    """
    slots, exists = _table_slots(block_table, token_to_req_indices, topk_indices, block_size)
    valid = exists & rearrange(is_valid_token.to(torch.bool), "t -> t 1")
    rows = [row_slots[row_valid] for row_slots, row_valid in zip(slots, valid)]
    packed = _pack_rows(rows, topk_indices.shape[1], topk_indices.device)
    return packed.to(topk_indices.dtype), valid.sum(dim=1).to(torch.int32)


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
    """Sparse-prefill indices into a per-request workspace: top-k rows, then the SWA window's rows.

    Request ``b`` owns workspace rows ``[M*b, M*b + M)``: compressed K at ``[0, N)``, its last
    ``gather_len`` raw tokens at ``[N, N + gather_len)``, so raw position ``p`` is row
    ``M*b + N + p - (seq_len - gather_len)``. Its query token ``i`` (chunk row ``t =
    query_start_loc[b] - query_start_loc[0] + i``) at ``pos = seq_len - query_len + i`` lists::

        [topk_indices[t, j] + M*b  for j < topk_len]  (a -1 entry stays -1, in place)
        + [workspace row of p  for p in its SWA positions, ascending]
        + [-1, ...]  up to the width;   lens[t] = topk_len + number of SWA positions

    with ``topk_len`` and the SWA positions as in the module docstring (``left``/``right`` from
    ``left_visible``/``right_visible`` when given). Every column of every request token's row is
    written, so an ``out=`` buffer never keeps stale tails (upstream leaves them), and a negative
    top-k entry stays -1 (upstream adds ``M*b`` to it, which points into request ``b - 1``'s
    rows). Chunk rows past the last request are -1 / 0 when ``out`` is None and untouched
    otherwise. Paper: papers.md#sparse-indices.

    Args:
        topk_indices: ``[Tc, Kw]`` int32 chunk-local rows, compressed-workspace rows (``< N``) or -1.
        query_start_loc: ``[Rc + 1]`` int32 (a slice of the global one; rebased on its first entry).
        seq_lens, gather_lens: ``[Rc]`` int32.
        window_size: ``W``; compress_ratio: 1, 4 or 128; topk: ``<= Kw``; M, N: workspace sizes.
        out: ``(combined [Tc, width], lens [Tc])`` int32 buffers, or None.
        left_visible, right_visible: ``[Tc]`` int32 or None; max_image_tokens: ``IMG``.

    Returns:
        ``(combined [Tc, width] int32, lens [Tc] int32)``,
        ``width = round_up(topk + W + IMG, 128)`` (``IMG = 0`` without visibility).

    Traffic: reads ``4*topk_len`` bytes per token; writes ``4*width + 4`` per token.
    """
    num_tokens = topk_indices.shape[0]
    image_width = max_image_tokens if left_visible is not None else 0
    width = combined_width(topk, window_size, image_width)
    device = topk_indices.device
    if out is None:
        combined = torch.full((num_tokens, width), -1, dtype=torch.int32, device=device)
        lens = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    else:
        combined, lens = out[0].clone(), out[1].clone()
    qsl = query_start_loc.to(torch.int64) - int(query_start_loc[0])
    for b in range(seq_lens.shape[0]):
        rows = torch.arange(int(qsl[b]), int(qsl[b + 1]), device=device)
        seq_len, gather_len = int(seq_lens[b]), int(gather_lens[b])
        pos = seq_len - rows.numel() + torch.arange(rows.numel(), device=device)
        if left_visible is None:
            left = right = torch.zeros_like(pos)
        else:
            left, right = left_visible[rows], right_visible[rows]
        sees = visible_positions(pos, left, right, torch.tensor(seq_len, device=device), window_size)
        workspace_row = M * b + N + torch.arange(sees.shape[1], device=device) - (seq_len - gather_len)
        selected = topk_indices[rows].to(torch.int64)
        topk_rows = torch.where(selected >= 0, selected + M * b, -1)
        entries = [
            torch.cat([topk_rows[i, :kept], workspace_row[sees[i]]])
            for i, kept in enumerate(_topk_len(pos, compress_ratio, topk).tolist())
        ]
        combined[rows] = _pack_rows(entries, width, device).to(torch.int32)
        lens[rows] = torch.tensor([e.numel() for e in entries], dtype=torch.int32, device=device)
    return combined, lens


def flashinfer_widths(swa_index_width: int, topk: int, decode_topk: int, max_image_tokens: int) -> tuple[int, int]:
    """``(swa_total, padded_topk)``: SWA columns ``Wswa + IMG``, then ``max(topk, Kd)`` rounded up to 4."""
    return swa_index_width + max_image_tokens, round_up(max(topk, decode_topk), FLASHINFER_TOPK_ALIGNMENT)


def remap_block_span(values: torch.Tensor, block_size: int, block_span: int) -> torch.Tensor:
    """Slot ``v = blk * bs + off`` -> ``blk * span + off``; -1 stays.

    FlashInfer's DSv4 kernel addresses KV by token stride, so a cache whose pages lie further
    apart than ``bs`` tokens (packed pages) needs the block span; with ``span == bs`` this is the
    identity.
    """
    v = values.to(torch.int64)
    remapped = torch.div(v, block_size, rounding_mode="floor") * block_span + v % block_size
    return torch.where(v >= 0, remapped, -1)


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
    """FlashInfer's sparse-index matrix for a decode-first batch: SWA slots, then compressed slots.

    Rows ``t < Td`` are decode tokens, rows ``Td + p`` prefill tokens. Columns
    ``[0, SWA_TOTAL)`` hold SWA slots (``SWA_TOTAL = Wswa + IMG``, ``IMG = max_image_tokens``
    when visibility is given, else 0), columns ``[SWA_TOTAL, SWA_TOTAL + padded_topk)``
    compressed slots (``padded_topk = round_up(max(topk, Kd), 4)``). Every slot then goes through
    ``remap_block_span`` with its cache's span (default: its block size, the identity).

    Decode row ``t``: SWA column ``j`` = ``decode_swa_indices[t, j]`` (-1 past ``Wswa``);
    compressed column ``j`` = ``decode_compressed_indices[t, j]`` (-1 past ``Kd``), translated
    through ``compressed_block_table`` row ``token_to_req_indices[t]`` when the indices are local
    (bounds as in :func:`compute_global_topk_indices_and_lens`; invalid -> -1).
    ``lens = SWA_TOTAL + c`` with ``c`` = 0 if ``Kd == 0``; else the valid entries of valid tokens
    when local; else ``decode_compressed_topk_lens[t]`` if given; else ``Kd``.

    Prefill row (request ``req = token_to_req_indices[t]``, ``pos = seq_len - query_len + t -
    query_start_loc[req]``): the SWA columns list the slots of its SWA positions (module
    docstring), ascending, through ``swa_block_table``, then -1; compressed column ``j <
    topk_len`` is the slot of ``prefill_topk_indices[p, j]`` through the compressed table (-1
    where that entry is invalid, in place), -1 beyond; ``lens = SWA_TOTAL + topk_len``.
    FlashInfer's lens count the whole SWA region, -1 entries included (the kernel skips them).
    Paper: papers.md#sparse-indices.

    Args:
        decode_swa_indices: ``[Td, Wswa]`` int32 global SWA slots (``Wswa >= window_size``).
        decode_compressed_indices: ``[Td, Kd]`` int32 or None (``Kd = 0``).
        decode_compressed_topk_lens: ``[>= Td]`` int32 or None.
        prefill_topk_indices: ``[Tp, Kp]`` int32 request-local compressed positions or -1.
        query_start_loc: ``[R + 1]`` int32 in the batch's token numbering (decodes first).
        seq_lens: ``[R]`` int32; token_to_req_indices: ``[>= Td + Tp]`` int32.
        swa_block_table, compressed_block_table: ``[R, B]`` int32 (compressed: default the SWA one).
        decode_is_valid_token: ``[>= Td]`` bool, needed when the decode indices are local.
        prefill_left_visible, prefill_right_visible: ``[>= Td + Tp]`` int32 (indexed by batch row) or None.

    Returns:
        ``(sparse_indices [Td + Tp, SWA_TOTAL + padded_topk] int32, lens [Td + Tp] int32)``.

    Traffic: writes ``4*(SWA_TOTAL + padded_topk) + 4`` bytes per token; reads about as many.
    """
    num_decode, swa_index_width = decode_swa_indices.shape
    num_tokens = num_decode + prefill_topk_indices.shape[0]
    decode_topk = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    has_image = prefill_left_visible is not None
    swa_total, padded_topk = flashinfer_widths(swa_index_width, topk, decode_topk, max_image_tokens if has_image else 0)
    compressed_table = swa_block_table if compressed_block_table is None else compressed_block_table
    swa_span = swa_block_size if swa_block_span is None else swa_block_span
    compressed_span = compressed_block_size if compressed_block_span is None else compressed_block_span
    device = decode_swa_indices.device

    # Decode rows: the given slots, in their columns.
    decode_swa = remap_block_span(_fit_columns(decode_swa_indices, swa_total), swa_block_size, swa_span)
    if decode_compressed_indices is None:
        decode_comp = torch.full((num_decode, padded_topk), -1, dtype=torch.int64, device=device)
    else:
        decode_comp = _fit_columns(decode_compressed_indices, padded_topk)
    if decode_topk == 0:
        counts = torch.zeros(num_decode, dtype=torch.int64, device=device)
    elif decode_compressed_indices_are_local:
        decode_comp, exists = _table_slots(
            compressed_table, token_to_req_indices[:num_decode], decode_comp, compressed_block_size
        )
        counts = (exists & rearrange(decode_is_valid_token[:num_decode].to(torch.bool), "t -> t 1")).sum(dim=1)
    elif decode_compressed_topk_lens is not None:
        counts = decode_compressed_topk_lens[:num_decode].to(torch.int64)
    else:
        counts = torch.full((num_decode,), decode_topk, dtype=torch.int64, device=device)
    decode_comp = remap_block_span(decode_comp, compressed_block_size, compressed_span)
    decode_rows = torch.cat([decode_swa, decode_comp], dim=1)
    decode_lens = swa_total + counts

    # Prefill rows: the visible positions' slots, then the kept top-k entries' slots.
    t = torch.arange(num_decode, num_tokens, device=device)
    req = token_to_req_indices[num_decode:num_tokens].to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    query_start, query_len, seq_len = qsl[req], qsl[req + 1] - qsl[req], seq_lens.to(torch.int64)[req]
    pos = seq_len - query_len + (t - query_start)
    if has_image:
        left, right = prefill_left_visible[num_decode:num_tokens], prefill_right_visible[num_decode:num_tokens]
    else:
        left = right = torch.zeros_like(pos)
    sees = visible_positions(pos, left, right, seq_len, window_size)
    positions = torch.arange(sees.shape[1], device=device)
    window = _pack_rows([positions[row] for row in sees], swa_total, device)  # ascending, then -1
    swa_slots, _ = _table_slots(swa_block_table, req, window, swa_block_size)
    topk_len = _topk_len(pos, compress_ratio, topk)
    kept = torch.arange(padded_topk, device=device) < rearrange(topk_len, "t -> t 1")
    local = torch.where(kept, _fit_columns(prefill_topk_indices, padded_topk), -1)  # entry j in column j
    comp_slots, _ = _table_slots(compressed_table, req, local, compressed_block_size)
    prefill_rows = torch.cat(
        [
            remap_block_span(swa_slots, swa_block_size, swa_span),
            remap_block_span(comp_slots, compressed_block_size, compressed_span),
        ],
        dim=1,
    )
    prefill_lens = swa_total + topk_len

    indices = torch.cat([decode_rows, prefill_rows], dim=0).to(torch.int32)
    lens = torch.cat([decode_lens, prefill_lens], dim=0).to(torch.int32)
    return indices, lens
