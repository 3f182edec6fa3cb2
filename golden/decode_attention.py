"""Decode attention over a paged KV cache, one KV extent per query row, and its split-KV view.

Every query row ``r`` has its own block-table row ``req_to_token[r]`` and its own extent
``n_r = seq_lens[r]``; it attends to the keys ``[lo_r, n_r)`` of that row, where
``lo_r = max(0, n_r - W)`` under a sliding window of ``W`` keys and ``0`` without one. Two cache
kinds share the definition:

- MLA (``is_mla=True``): one latent KV head; keys are ``Lk`` wide and the value of key ``j`` is the
  first ``Lv`` columns of the same (dequantized) key (``v_buffer`` only gives ``Lv``).
- GQA/MHA: ``HKV`` KV heads, ``H % HKV == 0``, query head ``h`` reads KV head ``h // (H / HKV)``;
  values come from ``v_buffer``.

Multi-token decode is served by flattening a request's ``Q`` query tokens into ``Q`` rows
(:func:`expand_decode_rows`). :func:`decode_attention` is the definition, computed directly per
row. The split view (:func:`split_bounds`, :func:`decode_attention_splits`) is what the kernel's
stage 1 computes; merging its states (``golden.lse_merge.merge_states``) gives
:func:`decode_attention` (the tests check it). Paper: papers.md#decode-attention.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat

from golden._paged import as_block_table, as_pages, attend, dequantize_keys, gather_positions


def window_start(seq_lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """First visible key of each row: ``max(0, n - W)``, or ``0`` without a window.

    Args:
        seq_lens: ``[R]`` int, row extents ``n`` (negative extents count as 0).
        sliding_window: ``W > 0`` keys (the row's own key included), or ``None``/``0`` for none.

    Returns:
        ``[R]`` int64.
    """
    n = seq_lens.to(torch.int64).clamp(min=0)
    if sliding_window is None or sliding_window == 0:
        return torch.zeros_like(n)
    if sliding_window < 0:
        raise ValueError(f"sliding_window: expected None, 0 or a positive int, got {sliding_window}")
    return (n - sliding_window).clamp(min=0)


def split_bounds(
    seq_lens: torch.Tensor, num_kv_splits: int, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key ranges ``[start, end)`` of every split of every row (the kernel's stage-1 partition).

    The visible range ``[lo, n)`` (see :func:`window_start`) is cut into chunks of
    ``c = cdiv(n - lo, S)`` keys: split ``s`` covers ``[lo + s*c, min(lo + (s+1)*c, n))``. Trailing
    splits of a short row are empty (``start == end``); a row with no visible key has only empty
    splits. The boundaries follow the window, so a windowed row of any length uses all ``S`` splits
    when it has at least ``S`` visible keys.

    Args:
        seq_lens: ``[R]`` int, row extents.
        num_kv_splits: ``S >= 1``.
        sliding_window: as in :func:`window_start`.

    Returns:
        ``(start [R, S], end [R, S])`` int64, ``lo <= start <= end <= n``.
    """
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits: expected a positive int, got {num_kv_splits}")
    n = seq_lens.to(torch.int64).clamp(min=0)
    lo = window_start(n, sliding_window)
    chunk = (n - lo + num_kv_splits - 1) // num_kv_splits
    s = torch.arange(num_kv_splits, device=n.device)
    start = torch.minimum(lo[:, None] + s[None, :] * chunk[:, None], n[:, None])
    end = torch.minimum(start + chunk[:, None], n[:, None])
    return start, end


def _check_inputs(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    is_mla: bool,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: expected [R, H, Lk], got {list(q.shape)}")
    if k_buffer.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_buffer: key width {k_buffer.shape[-1]} != q width {q.shape[-1]}")
    num_kv_heads = k_buffer.shape[-2]
    if is_mla and num_kv_heads != 1:
        raise ValueError(f"k_buffer: MLA has one latent KV head, got {num_kv_heads}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of {num_kv_heads} KV heads")
    if is_mla and v_buffer.shape[-1] > k_buffer.shape[-1]:
        raise ValueError(f"v_buffer: MLA value width {v_buffer.shape[-1]} exceeds key width {k_buffer.shape[-1]}")
    if not is_mla and v_buffer.shape[-2] != num_kv_heads:
        raise ValueError(f"v_buffer: {v_buffer.shape[-2]} KV heads != k_buffer's {num_kv_heads}")
    as_pages(k_buffer, page_size)
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens: expected [{q.shape[0]}] (q's rows), got {list(seq_lens.shape)}")


def _keys_values(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    block_table_row: torch.Tensor,
    start: int,
    end: int,
    page_size: int,
    *,
    is_mla: bool,
    k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[J, HKV, Lk]`` and values ``[J, HKV, Lv]`` at positions ``[start, end)`` of one row,
    read through its block-table row and dequantized (MLA: V is the first ``Lv`` key columns)."""
    positions = torch.arange(start, end)
    keys = dequantize_keys(gather_positions(k_buffer, block_table_row, positions, page_size), k_scale, dtype)
    if is_mla:
        return keys, keys[..., : v_buffer.shape[-1]]
    values = dequantize_keys(gather_positions(v_buffer, block_table_row, positions, page_size), v_scale, dtype)
    return keys, values


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    page_size: int,
    *,
    logit_cap: float = 0.0,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    is_mla: bool = False,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of every query row over its own paged KV extent (the definition).

    For row ``r`` with extent ``n = seq_lens[r]``, visible keys ``j in [lo, n)``
    (``lo = max(0, n - W)`` with a window ``W``, else 0), and query head ``h`` on KV head
    ``h // (H / HKV)``::

        s_j = sm_scale * q[r, h] . K_j                 (over all Lk columns)
        s_j = cap * tanh(s_j / cap)                    (only when logit_cap > 0)
        o[r, h]   = sum_j softmax(s)_j * V_j
        lse[r, h] = ln sum_j exp(s_j)

    Key ``j`` of row ``r`` lives at page ``req_to_token[r, j // page_size]``, slot
    ``j % page_size``. FP8 caches (``float8_e4m3fn``/``fnuz``) dequantize as ``K = fp8 * k_scale``
    and ``V = fp8 * v_scale``; for MLA ``V = K[:, :Lv]`` so only ``k_scale`` applies. Scales are
    ignored for a 16-bit cache. Rows with no visible key get ``o = 0, lse = -inf`` (never NaN).
    Computed directly: per row, its visible keys are gathered through the block table and the
    formula is applied in ``dtype`` (no splits, no masks).

    Args:
        q: ``[R, H, Lk]`` float (bf16/fp16/fp32/fp64), query rows.
        k_buffer: ``[num_pages, page_size, HKV, Lk]`` or ``[num_pages * page_size, HKV, Lk]``,
            float or fp8; MLA has ``HKV = 1``.
        v_buffer: ``[..., HKV, Lv]`` like ``k_buffer``; for MLA only its width ``Lv`` is used.
        req_to_token: ``[>= R, max_pages]`` (or ``[>= R, max_pages, 1]``) int, block-table row of
            each query row; entries past ``cdiv(n, page_size)`` and rows past ``R`` are never read.
        seq_lens: ``[R]`` int, extents ``n`` (``<= 0`` means an empty row).
        sm_scale: softmax scale (applied before the cap).
        page_size: tokens per page.
        logit_cap: soft cap ``> 0``, or ``0`` for none.
        k_scale, v_scale: FP8 dequant scales (scalar tensors or floats) or None (1).
        is_mla: V is the first ``Lv`` columns of K.
        sliding_window: ``W > 0`` keys, or ``None``/``0`` for no window.
        dtype: compute and output dtype, float32 or float64 (the test oracle).

    Returns:
        ``(o [R, H, Lv], lse [R, H])`` in ``dtype``; ``lse`` is natural-log.

    Traffic: reads ``R*H*Lk`` query elements and, per row, its ``n - lo`` visible keys: ``HKV*Lk``
    cache elements each for MLA, ``HKV*(Lk + Lv)`` for GQA; writes ``R*H*Lv`` + ``R*H`` elements.
    """
    _check_inputs(q, k_buffer, v_buffer, seq_lens, page_size, is_mla)
    num_rows, num_heads = q.shape[:2]
    req_to_token = as_block_table(req_to_token, num_rows)
    o = torch.zeros(num_rows, num_heads, v_buffer.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((num_rows, num_heads), float("-inf"), dtype=dtype, device=q.device)
    lo, n = window_start(seq_lens, sliding_window), seq_lens.to(torch.int64).clamp(min=0)
    for r in range(num_rows):
        keys, values = _keys_values(
            k_buffer, v_buffer, req_to_token[r], int(lo[r]), int(n[r]), page_size,
            is_mla=is_mla, k_scale=k_scale, v_scale=v_scale, dtype=dtype,
        )  # fmt: skip
        o[r], lse[r] = attend(q[r].to(dtype), keys, values, sm_scale, logit_cap)
    return o, lse


def decode_attention_splits(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    page_size: int,
    *,
    logit_cap: float = 0.0,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    is_mla: bool = False,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of split-KV decode: the attention state of every row over each of its splits.

    Split ``s`` of row ``r`` covers keys ``[start, end)`` from :func:`split_bounds` (window-aware);
    its state is :func:`decode_attention` restricted to those keys. An empty split is ``(0, -inf)``.
    ``golden.lse_merge.merge_states`` of the ``S`` states equals :func:`decode_attention`.

    Args:
        As :func:`decode_attention`, plus ``num_kv_splits`` = ``S >= 1``.

    Returns:
        ``(o [R, H, S, Lv], lse [R, H, S])`` in ``dtype``: normalized partial outputs and
        natural-log LSEs, the kernel's ``attn_logits[..., :Lv]`` and ``attn_logits[..., Lv]``.

    Traffic: as :func:`decode_attention`, plus ``R*H*S*(Lv + 1)`` fp32 partials written.
    """
    _check_inputs(q, k_buffer, v_buffer, seq_lens, page_size, is_mla)
    num_rows, num_heads = q.shape[:2]
    req_to_token = as_block_table(req_to_token, num_rows)
    start, end = split_bounds(seq_lens, num_kv_splits, sliding_window)
    o = torch.zeros(num_rows, num_heads, num_kv_splits, v_buffer.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((num_rows, num_heads, num_kv_splits), float("-inf"), dtype=dtype, device=q.device)
    for r in range(num_rows):
        for s in range(num_kv_splits):
            keys, values = _keys_values(
                k_buffer, v_buffer, req_to_token[r], int(start[r, s]), int(end[r, s]), page_size,
                is_mla=is_mla, k_scale=k_scale, v_scale=v_scale, dtype=dtype,
            )  # fmt: skip
            o[r, :, s], lse[r, :, s] = attend(q[r].to(dtype), keys, values, sm_scale, logit_cap)
    return o, lse


def expand_decode_rows(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten multi-token decode into one row per query token (``TritonMLAImpl.forward_mqa``).

    Request ``b`` with ``Q = query_len`` tokens becomes rows ``r = b*Q + t``, ``t in [0, Q)``, all
    with ``b``'s block-table row (a request's rows stay adjacent). Causal: row ``t`` sees the
    prefix plus block tokens ``0..t``, extent ``max(L_b - (Q-1) + t, 0)`` (padding requests with
    ``L_b = 0`` give empty rows); not causal: every row sees ``L_b``.

    Args:
        block_table: ``[B, max_pages]`` int.
        seq_lens: ``[B]`` int, ``L_b`` (the block's ``Q`` tokens included).
        query_len: ``Q >= 1``.
        causal: per-row causal extents, or the full ``L_b`` for every row.

    Returns:
        ``(block_table [B*Q, max_pages], seq_lens [B*Q])`` in the input dtypes.

    Traffic: reads ``B*(max_pages + 1)`` ints; writes ``Q`` times that.
    """
    if not isinstance(query_len, int) or query_len < 1:
        raise ValueError(f"query_len: expected a positive int, got {query_len!r}")
    if seq_lens.dim() != 1 or block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_table/seq_lens: expected [B, max_pages] and [B], got {list(block_table.shape)} / "
            f"{list(seq_lens.shape)}"
        )
    rows_table = repeat(block_table, "b p -> (b q) p", q=query_len)
    lens = repeat(seq_lens, "b -> b q", q=query_len)
    if causal:
        t = torch.arange(query_len, device=seq_lens.device, dtype=seq_lens.dtype)
        lens = (lens - (query_len - 1) + t[None, :]).clamp(min=0)
    return rows_table, rearrange(lens, "b q -> (b q)")


def dcp_local_positions(
    seq_len: int, world_size: int, rank: int, layout: str = "striped", interleave: int = 1
) -> torch.Tensor:
    """The keys of one request that rank ``rank`` holds under decode context parallelism (DCP).

    ``"striped"``: key ``j`` lives on rank ``(j // I) % N`` (``I = interleave``; SGLang stripes
    single tokens, ``I = 1``; vLLM's ``cp_kv_cache_interleave_size`` is ``I``). ``"sliced"``: rank
    ``k`` holds the contiguous range ``[k*c, min((k+1)*c, L))``, ``c = cdiv(L, N)``. Either way the
    ranks' key sets partition ``[0, L)``, so merging their attention states
    (``golden.lse_merge.merge_states``) gives the single-process result.

    Args:
        seq_len: ``L``, keys of the request. world_size: ``N``. rank: ``k in [0, N)``.
        layout: ``"striped"`` or ``"sliced"``. interleave: ``I >= 1`` (striped only).

    Returns:
        ``[L_k]`` int64, the global positions this rank holds, ascending (its local key ``i`` is
        global key ``positions[i]``).

    Traffic: none (index arithmetic).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if interleave < 1:
        raise ValueError(f"interleave: expected a positive int, got {interleave}")
    j = torch.arange(max(seq_len, 0))
    if layout == "striped":
        return j[(j // interleave) % world_size == rank]
    if layout == "sliced":
        chunk = (max(seq_len, 0) + world_size - 1) // world_size
        return j[(j >= rank * chunk) & (j < (rank + 1) * chunk)]
    raise ValueError(f"layout: expected 'striped' or 'sliced', got {layout!r}")
