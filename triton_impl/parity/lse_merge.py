"""Parity cases for the LSE merge: cascade-prefix sizes and decode stage-2 sizes."""

from __future__ import annotations

import torch

from golden.lse_merge import merge_states, merge_two
from triton_impl.lse_merge import merge_attn_states, merge_splits
from triton_impl.parity import Case, Check
from triton_impl.tolerances import tolerance


def _two_state(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(tokens * heads + head_dim)
        p_out = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
        s_out = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
        p_lse = torch.randn(heads, tokens, generator=gen) * 8
        s_lse = torch.randn(heads, tokens, generator=gen) * 8
        p_lse[:, ::7] = float("-inf")  # some tokens have no prefix (no cached context)
        out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=device)
        out_lse = torch.full((heads, tokens), float("nan"), device=device)
        merge_attn_states(out, p_out.to(device), p_lse.to(device), s_out.to(device), s_lse.to(device), out_lse)
        ref_o, ref_lse = merge_two(
            p_out.double().transpose(0, 1), p_lse.double(), s_out.double().transpose(0, 1), s_lse.double()
        )
        name = str(dtype).removeprefix("torch.")
        return [
            Check("o", out.transpose(0, 1), ref_o, tolerance("lse_merge", "o", name)),
            Check("lse", out_lse, ref_lse, tolerance("lse_merge", "lse", "float32")),
        ]

    return Case("lse_merge", f"merge_attn_states T={tokens} H={heads} D={head_dim} {str(dtype)[6:]}", run)


def _splits(rows: int, heads: int, splits: int, head_dim: int, dtype: torch.dtype) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(rows + splits)
        partials = torch.randn(rows, heads, splits, head_dim + 1, generator=gen)
        partials[..., head_dim] *= 4
        partials[:, :, splits // 2 :, head_dim] = float("-inf")  # short requests leave trailing splits empty
        partials[:, :, splits // 2 :, :head_dim] = float("nan")
        o = torch.full((rows, heads, head_dim), float("nan"), dtype=dtype, device=device)
        lse = torch.full((rows, heads), float("nan"), device=device)
        merge_splits(partials.to(device), o, lse)
        ref_o, ref_lse = merge_states(partials[..., :head_dim].double(), partials[..., head_dim].double())
        name = str(dtype).removeprefix("torch.")
        return [
            Check("o", o, ref_o, tolerance("lse_merge", "o", name)),
            Check("lse", lse, ref_lse, tolerance("lse_merge", "lse", "float32")),
        ]

    return Case("lse_merge", f"merge_splits R={rows} H={heads} S={splits} D={head_dim} {str(dtype)[6:]}", run)


def cases() -> list[Case]:
    gpu = torch.cuda.is_available()
    tokens = 4096 if gpu else 64
    rows = 256 if gpu else 8
    return [
        _two_state(tokens, 32, 128, torch.bfloat16),
        _two_state(tokens, 16, 192, torch.float16),
        _two_state(tokens, 8, 64, torch.float32),
        _splits(rows, 16, 8, 512, torch.bfloat16),  # DeepSeek MLA decode stage 2
        _splits(rows, 32, 16, 128, torch.float16),  # GQA decode stage 2
    ]
