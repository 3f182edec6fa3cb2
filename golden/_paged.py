"""Shared golden helpers: reading a paged KV cache, dequantizing it, and attention states.

Used by every attention op's golden model; not an op of its own (hence the underscore).
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def as_pages(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a cache as ``[num_pages, page_size, ...]``.

    A 4-D cache ``[num_pages, page_size, HKV, D]`` is returned as it is (its page stride may be
    larger than ``page_size * token_stride`` in a cross-layer view); a 3-D token-major cache
    ``[num_pages * page_size, HKV, D]`` is split into pages.
    """
    if cache.dim() == 3:
        if cache.shape[0] % page_size:
            raise ValueError(f"cache: {cache.shape[0]} tokens is not a multiple of page_size={page_size}")
        return cache.unflatten(0, (-1, page_size))
    if cache.dim() != 4 or cache.shape[1] != page_size:
        raise ValueError(f"cache: expected [pages, {page_size}, HKV, D] or [tokens, HKV, D], got {list(cache.shape)}")
    return cache


def as_block_table(block_table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A block table as ``[rows, max_pages]``, from ``[rows, max_pages]`` or ``[rows, max_pages, 1]``
    (a trailing unit dimension, as some callers build it), with at least ``num_rows`` rows (a table
    sized for the largest batch serves a smaller one; the rows past ``num_rows`` are never read)."""
    if block_table.dim() == 3 and block_table.shape[2] == 1:
        block_table = block_table[:, :, 0]
    if block_table.dim() != 2 or block_table.shape[0] < num_rows:
        raise ValueError(
            f"req_to_token: expected [>= {num_rows}, max_pages] or [>= {num_rows}, max_pages, 1], "
            f"got {list(block_table.shape)}"
        )
    return block_table


def gather_positions(
    cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """The keys at the given positions of one request as a dense ``[J, HKV, D]`` tensor.

    Key ``j`` lives at page ``block_table_row[j // page_size]``, slot ``j % page_size``; only the
    pages of the given positions are read.

    Args:
        cache: ``[num_pages, page_size, HKV, D]`` or ``[num_pages * page_size, HKV, D]``.
        block_table_row: ``[max_pages]`` int, the request's pages in key order.
        positions: ``[J]`` int, key positions of the request.
        page_size: tokens per page.

    Returns:
        ``[J, HKV, D]`` in the cache dtype.
    """
    pages = as_pages(cache, page_size)
    positions = positions.to(device=cache.device, dtype=torch.int64)
    page_ids = block_table_row.to(device=cache.device, dtype=torch.int64)[positions // page_size]
    return pages[page_ids, positions % page_size]


def gather_tokens(cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """Keys ``0 .. num_tokens-1`` of one request as a dense ``[num_tokens, HKV, D]`` tensor
    (:func:`gather_positions` of the first ``num_tokens`` positions)."""
    return gather_positions(cache, block_table_row, torch.arange(num_tokens), page_size)


def dequantize_keys(entries: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries in ``dtype``: ``fp8 * scale`` for an FP8 cache, the plain cast otherwise.

    The one dequantization rule of the decode and verify caches: keys use ``k_scale``, GQA values
    read from their own cache use ``v_scale``, and MLA values (a slice of the keys) are dequantized
    with the keys. A 16-bit cache ignores the scale (serving passes one regardless).

    Args:
        entries: ``[...]`` float or ``float8_e4m3fn``/``float8_e4m3fnuz``.
        scale: a scalar tensor or float, or None for 1.
        dtype: the result dtype (float32 or float64).

    Returns:
        ``[...]`` in ``dtype``.
    """
    if entries.dtype in FP8_DTYPES:
        return entries.to(dtype) * (1.0 if scale is None else float(scale))
    return entries.to(dtype)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sm_scale: float, logit_cap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of one query row's heads over a dense key set (the formula every op shares).

    Query head ``h`` reads KV head ``h // G`` with ``G = H / HKV``::

        s_j = sm_scale * q[h] . K_j[h // G]          (then cap * tanh(s_j / cap) when logit_cap > 0)
        o[h]   = sum_j softmax(s)_j * V_j[h // G]
        lse[h] = ln sum_j exp(s_j)

    With no key (``J = 0``) the softmax is undefined; the result is the neutral state
    ``o = 0, lse = -inf``, which every merge ignores.

    Args:
        q: ``[H, Lk]`` float, in the compute dtype.
        keys: ``[J, HKV, Lk]``, values: ``[J, HKV, Lv]``, dequantized, in the compute dtype.
        sm_scale: softmax scale, applied before the cap.
        logit_cap: soft cap ``> 0``, or ``0`` for none.

    Returns:
        ``(o [H, Lv], lse [H])`` in ``q``'s dtype; ``lse`` natural-log.
    """
    num_heads, value_width = q.shape[0], values.shape[-1]
    if keys.shape[0] == 0:
        return q.new_zeros(num_heads, value_width), q.new_full((num_heads,), float("-inf"))
    # Heads grouped by KV head rather than the keys repeated per head: a long row at 128 heads
    # would otherwise need J * H * Lk float64s.
    q_grouped = rearrange(q, "(hkv g) d -> hkv g d", hkv=keys.shape[1])
    s = sm_scale * einsum(q_grouped, keys, "hkv g d, j hkv d -> hkv g j")
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    o = einsum(torch.softmax(s, dim=-1), values, "hkv g j, j hkv e -> hkv g e")
    return rearrange(o, "hkv g e -> (hkv g) e"), rearrange(torch.logsumexp(s, dim=-1), "hkv g -> (hkv g)")


def masked_softmax_state(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities and natural-log LSE over the visible entries of the last axis.

    Args:
        scores: ``[..., J]`` float32/float64 logits.
        visible: ``[..., J]`` bool, broadcastable to ``scores``.

    Returns:
        ``(p [..., J], lse [...])``: ``p`` is 0 where not visible; a row with nothing visible has
        ``p = 0`` everywhere and ``lse = -inf`` (the neutral attention state), never NaN.
    """
    masked = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    empty = torch.isneginf(lse)
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.exp(masked - safe_lse.unsqueeze(-1))
    return p, lse
