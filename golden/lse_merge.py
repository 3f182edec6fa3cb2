"""LSE merge: combining attention states computed over disjoint key sets.

The attention state of a query row over a key set ``K`` is ``(o, lse)`` with
``o = sum_j softmax_j * v_j`` and ``lse = ln sum_j exp(s_j)``. Two states over disjoint key sets
merge into the state over their union: that is what makes split-KV decoding (flash-decoding),
cascade/prefix attention and decode context parallelism exact. The empty key set has the neutral
state ``(0, -inf)``, the identity of the merge; the merge is associative and commutative up to
rounding. Kernels: ``triton_impl/lse_merge.py`` (vLLM's ``merge_attn_states`` and the split-KV
stage 2 ``merge_splits``). Paper: papers.md#lse-merge.
"""

from __future__ import annotations

import math

import torch
from einops import einsum

from golden._paged import masked_softmax_state

NEG_INF = float("-inf")


def merge_states(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` attention states into one.

    ``M = max_i lse_i``; ``w_i = exp(lse_i - M)``; ``o = sum_i (w_i / sum w) * o_i``;
    ``lse = M + ln sum_i w_i``. ``+inf`` LSEs count as ``-inf`` (an empty set, as FlashAttention-2
    reports it). A state of weight 0 never contributes, even if its ``o`` is NaN. When every state
    is empty the result is the neutral state ``(0, -inf)``. A NaN LSE (a poisoned state, as a split
    whose keys came from outside the cache reports it) makes the result ``(NaN, NaN)``.

    Args:
        o: ``[..., N, D]`` float, the states' normalized outputs.
        lse: ``[..., N]`` float, their natural-log LSEs.

    Returns:
        ``(o [..., D], lse [...])`` in ``float64`` if either input is float64, else ``float32``.

    Traffic: reads ``N*(D+1)`` values per row; writes ``D+1``.
    """
    dtype = torch.float64 if torch.float64 in (o.dtype, lse.dtype) else torch.float32
    o, lse = o.to(dtype), lse.to(dtype)
    lse = torch.where(torch.isposinf(lse), NEG_INF, lse)
    m = lse.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(m)
    w = torch.exp(lse - torch.where(empty, 0.0, m))  # 0 for empty states, never NaN
    total = w.sum(dim=-1, keepdim=True)
    scale = torch.where(empty, 0.0, w / torch.where(empty, 1.0, total))
    contrib = torch.where(scale.unsqueeze(-1) == 0, 0.0, scale.unsqueeze(-1) * o)  # NaN weights stay NaN
    merged_o = contrib.sum(dim=-2)
    merged_lse = torch.where(empty, NEG_INF, m + torch.log(total)).squeeze(-1)
    return merged_o, merged_lse


def merge_two(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-state merge (prefix/suffix, cascade): ``merge_states`` of ``[(o_a, lse_a), (o_b, lse_b)]``.

    Args:
        o_a, o_b: ``[..., D]``; lse_a, lse_b: ``[...]``.

    Returns:
        ``(o [..., D], lse [...])`` as in :func:`merge_states`.
    """
    return merge_states(torch.stack([o_a, o_b], dim=-2), torch.stack([lse_a, lse_b], dim=-1))


def merge_attn_states(
    prefix_o: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_o: torch.Tensor,
    suffix_lse: torch.Tensor,
    tokens_with_context: int | None = None,
    output_scale: float | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's prefix/suffix merge, token-major: :func:`merge_two` for tokens ``t < P``, the
    suffix state copied unchanged for ``t >= P`` (no prefix); then optional FP8 output quantization.

    ``P = tokens_with_context`` (None: every token). With ``output_scale`` the output is
    ``clamp(o * fp32(1 / scale), -M8, M8)`` rounded to nearest even into ``fp8_dtype``
    (``M8`` = 448 for ``float8_e4m3fn``, 240 for ``float8_e4m3fnuz``), the multiply in fp32 as the
    kernel's epilogue does it.

    Args:
        prefix_o, suffix_o: ``[T, H, D]`` float; prefix_lse, suffix_lse: ``[T, H]`` natural-log.
        tokens_with_context: ``P`` or None. output_scale: the FP8 scale or None. fp8_dtype: the FP8 output type.

    Returns:
        ``(o [T, H, D], lse [T, H])``: float64/float32 as :func:`merge_states`, or ``o`` in
        ``fp8_dtype`` with ``output_scale``.
    """
    o, lse = merge_two(prefix_o, prefix_lse, suffix_o, suffix_lse)
    num_tokens = o.shape[0]
    copied = torch.arange(num_tokens) >= (num_tokens if tokens_with_context is None else tokens_with_context)
    o = torch.where(copied[:, None, None], suffix_o.to(o.dtype), o)
    lse = torch.where(copied[:, None], suffix_lse.to(lse.dtype), lse)
    if output_scale is None:
        return o, lse
    limit = 240.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0
    inverse = torch.tensor(1.0, dtype=torch.float32) / output_scale
    return (o.to(torch.float32) * inverse).clamp(-limit, limit).to(fp8_dtype), lse


def attention_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over a key set, as a state ``(o, lse)``.

    ``s_j = scale * q . k_j``; ``o = softmax(s) @ v`` over the visible keys; ``lse = ln sum exp s_j``.

    Args:
        q: ``[R, D]``; k: ``[J, D]``; v: ``[J, Dv]``; visible: ``[R, J]`` bool or None (all keys).

    Returns:
        ``(o [R, Dv], lse [R])``; rows that see no key get ``(0, -inf)``.
    """
    scores = scale * einsum(q, k, "r d, j d -> r j")
    if visible is None:
        visible = torch.ones_like(scores, dtype=torch.bool)
    p, lse = masked_softmax_state(scores, visible)
    return einsum(p, v, "r j, j e -> r e"), lse


def split_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, parts: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention states of ``q`` over each part of a partition of the keys (the split-KV stage 1).

    Args:
        q: ``[R, D]``; k: ``[J, D]``; v: ``[J, Dv]``; parts: ``S`` index tensors into ``[0, J)``.

    Returns:
        ``(o [R, S, Dv], lse [R, S])``; an empty part gives ``(0, -inf)``.
    """
    states = [attention_state(q, k[idx], v[idx], scale) for idx in parts]
    return torch.stack([o for o, _ in states], dim=1), torch.stack([lse for _, lse in states], dim=1)


def lse_base2_to_e(lse2: torch.Tensor) -> torch.Tensor:
    """Convert a base-2 LSE (FlashInfer's convention) to natural log: ``lse_e = lse_2 * ln 2``."""
    return lse2 * math.log(2.0)
