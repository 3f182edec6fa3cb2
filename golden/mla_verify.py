"""Causal MLA verify attention over a paged latent KV cache, and its split-KV view.

Speculative decoding verifies ``Q`` draft tokens of every request in one pass. Row ``t`` of
request ``b`` (flattened row ``r = b*Q + t``) sees the committed prefix plus the block tokens
``0..t``, cut by the request's real length ``R_b``::

    n(b, t) = max(min(L_b - Q + 1 + t, R_b), 0)          keys j in [0, n(b, t))

MLA's decode runs in latent space (the "absorbed" MQA form): one KV head, each key the ``Lk``-wide
``[c_kv | k_pe]`` and its value the first ``Lv`` columns of the same key. :func:`mla_verify` is
the definition, computed directly per row. The split view (:func:`split_bounds`,
:func:`mla_verify_split_partials`) is the kernel's stage 1; merging its states with
``golden.lse_merge.merge_states`` gives :func:`mla_verify` (the tests check it).
Paper: papers.md#mla-verify.
"""

from __future__ import annotations

import torch

from golden._paged import as_block_table, as_pages, attend, dequantize_keys, gather_positions


def row_limits(seq_lens: torch.Tensor, real_seq_lens: torch.Tensor | None, qlen: int) -> torch.Tensor:
    """How many keys each verify row sees: ``n(b, t) = max(min(L_b - Q + 1 + t, R_b), 0)``.

    Args:
        seq_lens: ``[B]`` int, ``L_b`` (the request's ``Q`` verify tokens included).
        real_seq_lens: ``[B]`` int ``R_b``, or None for ``R_b = L_b``; it can only shrink a row
            (a CUDA-graph padding request has ``R_b = 0``).
        qlen: ``Q >= 1``.

    Returns:
        ``[B, Q]`` int64; the last row of a request sees ``min(L_b, R_b)`` keys.
    """
    if not isinstance(qlen, int) or qlen < 1:
        raise ValueError(f"qlen: expected a positive int, got {qlen!r}")
    lens = seq_lens.to(torch.int64)
    t = torch.arange(qlen, device=seq_lens.device)
    n = lens[:, None] - qlen + 1 + t[None, :]
    if real_seq_lens is not None:
        n = torch.minimum(n, real_seq_lens.to(torch.int64)[:, None])
    return n.clamp(min=0)


def split_bounds(
    seq_lens: torch.Tensor, num_kv_splits: int, split_align: int, min_split_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key ranges ``[start, end)`` of every split of every request (the kernel's stage-1 partition).

    Request ``b`` is cut into chunks of ``c_b = max(round_up(cdiv(L_b, S), SPLIT_ALIGN),
    MIN_SPLIT_LEN)`` keys; split ``s`` covers ``[s*c_b, min((s+1)*c_b, L_b))`` for every row of the
    request, and a row uses the part of it below its limit. Short requests use fewer, longer
    splits: trailing splits are empty (``start == end``).

    Args:
        seq_lens: ``[B]`` int, ``L_b`` (negative counts as 0).
        num_kv_splits: ``S >= 1``.
        split_align: ``SPLIT_ALIGN >= 1``, so splits start on a key tile.
        min_split_len: ``MIN_SPLIT_LEN``, a multiple of ``split_align``.

    Returns:
        ``(start [B, S], end [B, S])`` int64 with ``0 <= start <= end <= L_b``.
    """
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits: expected a positive int, got {num_kv_splits}")
    if split_align < 1 or min_split_len < split_align or min_split_len % split_align:
        raise ValueError(
            f"split_align/min_split_len: expected min_split_len a positive multiple of split_align, "
            f"got {split_align} / {min_split_len}"
        )
    lens = seq_lens.to(torch.int64).clamp(min=0)
    per_split = (lens + num_kv_splits - 1) // num_kv_splits
    chunk = ((per_split + split_align - 1) // split_align * split_align).clamp(min=min_split_len)
    s = torch.arange(num_kv_splits, device=seq_lens.device)
    start = torch.minimum(s[None, :] * chunk[:, None], lens[:, None])
    end = torch.minimum(start + chunk[:, None], lens[:, None])
    return start, end


def _checked_block_table(
    q: torch.Tensor, k_buffer: torch.Tensor, req_to_token: torch.Tensor, limits: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Checks the shapes; returns the block table as ``[>= B, max_pages]``."""
    batch, qlen = limits.shape
    if q.dim() != 3 or q.shape[0] != batch * qlen:
        raise ValueError(f"q: expected [{batch} * {qlen}, H, Lk], got {list(q.shape)}")
    if k_buffer.shape[-2] != 1 or k_buffer.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_buffer: expected [..., 1, {q.shape[-1]}] (one latent KV head), got {list(k_buffer.shape)}")
    as_pages(k_buffer, page_size)
    return as_block_table(req_to_token, batch)


def _state(
    q_row: torch.Tensor,
    k_buffer: torch.Tensor,
    block_table_row: torch.Tensor,
    start: int,
    end: int,
    value_width: int,
    sm_scale: float,
    page_size: int,
    k_scale: torch.Tensor | float | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [H, Lv], lse [H])`` of one verify row over its request's keys ``[start, end)``."""
    keys = gather_positions(k_buffer, block_table_row, torch.arange(start, end), page_size)  # [J, 1, Lk]
    keys = dequantize_keys(keys, k_scale, dtype)
    return attend(q_row.to(dtype), keys, keys[..., :value_width], sm_scale)


def attend_rows(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    limits: torch.Tensor,
    value_width: int,
    sm_scale: float,
    page_size: int,
    *,
    split_starts: torch.Tensor | None = None,
    split_ends: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of every verify row over its keys ``[0, limits[b, t])``, optionally per split.

    With ``split_starts``/``split_ends`` (``[B, S]``) the state of split ``s`` of row ``(b, t)``
    covers keys ``[start_s, min(end_s, limit))`` (empty: ``(0, -inf)``); without them one state
    covers all the row's keys, which is :func:`mla_verify` with the limits given.

    Args:
        q, k_buffer, req_to_token, value_width, sm_scale, page_size, k_scale, dtype: as
            :func:`mla_verify`.
        limits: ``[B, Q]`` int, keys each row sees (:func:`row_limits`).
        split_starts, split_ends: ``[B, S]`` int (:func:`split_bounds`), or None for one split.

    Returns:
        ``(o [R, H, S, Lv], lse [R, H, S])`` in ``dtype`` (``S = 1`` without splits).

    Traffic: as :func:`mla_verify`.
    """
    req_to_token = _checked_block_table(q, k_buffer, req_to_token, limits, page_size)
    batch, qlen = limits.shape
    if split_starts is None or split_ends is None:
        split_starts = torch.zeros(batch, 1, dtype=torch.int64)
        split_ends = limits.max(dim=1, keepdim=True).values
    num_splits = split_starts.shape[1]
    o = torch.zeros(batch * qlen, q.shape[1], num_splits, value_width, dtype=dtype, device=q.device)
    lse = torch.full((batch * qlen, q.shape[1], num_splits), float("-inf"), dtype=dtype, device=q.device)
    for b in range(batch):
        for t in range(qlen):
            r = b * qlen + t
            for s in range(num_splits):
                start = int(split_starts[b, s])
                end = max(start, min(int(split_ends[b, s]), int(limits[b, t])))  # a split past the row: empty
                o[r, :, s], lse[r, :, s] = _state(
                    q[r], k_buffer, req_to_token[b], start, end, value_width, sm_scale, page_size, k_scale, dtype
                )
    return o, lse


def mla_verify(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    real_seq_lens: torch.Tensor | None,
    qlen: int,
    value_width: int,
    sm_scale: float,
    page_size: int,
    *,
    k_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal verify attention of every (row, head) over its request's paged latent keys (the definition).

    For row ``r = b*Q + t`` and head ``h``, with ``n = n(b, t)`` from :func:`row_limits`::

        K_j = cache[req_to_token[b, j // page_size], j % page_size, 0, :]   (* k_scale if FP8)
        s_j = sm_scale * q[r, h, :] . K_j                                   (all Lk columns)
        o[r, h]   = sum_{j < n} softmax(s)_j * K_j[:Lv]                     (V = first Lv columns)
        lse[r, h] = ln sum_{j < n} exp(s_j)

    Rows with ``n = 0`` get the neutral state ``o = 0, lse = -inf`` (never NaN). Computed
    directly: per row, its keys are gathered through the block table and the formula is applied in
    ``dtype`` (no splits, no masks).

    Args:
        q: ``[R, H, Lk]`` float, ``R = B*Q``, the verify tokens of a request adjacent.
        k_buffer: ``[num_pages, page_size, 1, Lk]`` or ``[num_pages * page_size, 1, Lk]``, float or
            FP8 (``float8_e4m3fn``); any page stride (a per-layer view of a cross-layer cache).
        req_to_token: ``[>= B, max_pages]`` (or ``[>= B, max_pages, 1]``) int, one block-table row
            per request (not per row); entries past ``cdiv(max_t n(b, t), page_size)`` and rows past
            ``B`` are never read.
        seq_lens: ``[B]`` int, ``L_b``.
        real_seq_lens: ``[B]`` int ``R_b`` or None.
        qlen: ``Q``, verify tokens per request.
        value_width: ``Lv``.
        sm_scale: softmax scale.
        page_size: tokens per page.
        k_scale: FP8 dequant scale (scalar tensor or float); ignored for a 16-bit cache.
        dtype: compute and output dtype, float32 or float64 (the test oracle).

    Returns:
        ``(o [R, H, Lv], lse [R, H])`` in ``dtype``; ``lse`` is natural-log.

    Traffic: reads ``R*H*Lk`` query elements and, per request, its ``max_t n(b, t)`` keys of ``Lk``
    cache elements once (every verify token and head shares them); writes ``R*H*Lv`` + ``R*H``.
    """
    limits = row_limits(seq_lens, real_seq_lens, qlen)
    req_to_token = _checked_block_table(q, k_buffer, req_to_token, limits, page_size)
    o = torch.zeros(q.shape[0], q.shape[1], value_width, dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=dtype, device=q.device)
    for b in range(limits.shape[0]):
        for t in range(qlen):
            r = b * qlen + t
            o[r], lse[r] = _state(
                q[r], k_buffer, req_to_token[b], 0, int(limits[b, t]), value_width, sm_scale, page_size, k_scale, dtype
            )
    return o, lse


def mla_verify_split_partials(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    real_seq_lens: torch.Tensor | None,
    qlen: int,
    value_width: int,
    sm_scale: float,
    page_size: int,
    num_kv_splits: int,
    split_align: int,
    min_split_len: int,
    *,
    k_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Stage 1 of split-KV verify: each row's attention state over each split, in the kernel's layout.

    Split ``s`` of request ``b`` is ``[start, end)`` from :func:`split_bounds`; row ``(b, t)`` uses
    ``[start, min(end, n(b, t)))``. A split that is empty for a row is the neutral ``(0, -inf)``.
    ``golden.lse_merge.merge_states`` of a row's ``S`` states equals :func:`mla_verify`.

    Args:
        As :func:`mla_verify`, plus ``num_kv_splits`` (``S``), ``split_align`` and ``min_split_len``
        (the launch config's ``SPLIT_ALIGN``/``MIN_SPLIT_LEN``).

    Returns:
        ``[R, H, S, Lv + 1]`` in ``dtype``: ``[..., :Lv]`` the normalized partial output, ``[..., Lv]``
        its natural-log LSE (the kernel's ``attn_logits``).

    Traffic: as :func:`mla_verify`, plus ``R*H*S*(Lv + 1)`` fp32 partials written.
    """
    limits = row_limits(seq_lens, real_seq_lens, qlen)
    starts, ends = split_bounds(seq_lens, num_kv_splits, split_align, min_split_len)
    o, lse = attend_rows(
        q, k_buffer, req_to_token, limits, value_width, sm_scale, page_size,
        split_starts=starts, split_ends=ends, k_scale=k_scale, dtype=dtype,
    )  # fmt: skip
    return torch.cat([o, lse[..., None]], dim=-1)
