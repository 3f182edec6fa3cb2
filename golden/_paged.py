"""Shared golden helpers: reading a paged KV cache and the softmax state of a masked row.

Used by every attention op's golden model; not an op of its own (hence the underscore).
"""

from __future__ import annotations

import torch


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


def gather_tokens(cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """Keys ``0 .. num_tokens-1`` of one request as a dense ``[num_tokens, HKV, D]`` tensor.

    Key ``j`` lives at page ``block_table_row[j // page_size]``, slot ``j % page_size``.
    """
    pages = as_pages(cache, page_size)
    j = torch.arange(num_tokens, device=cache.device)
    page_ids = block_table_row.to(torch.int64)[j // page_size]
    return pages[page_ids, j % page_size]


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
