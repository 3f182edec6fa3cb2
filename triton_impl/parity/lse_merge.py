"""Parity cases for the LSE merge: cascade-prefix sizes and decode stage-2 sizes."""

from __future__ import annotations

import torch

from golden.lse_merge import merge_states, merge_two
from triton_impl.bench import Bench, BenchCase, flashinfer_merge_state
from triton_impl.cases import Check
from triton_impl.lse_merge import merge_attn_states, merge_splits
from triton_impl.parity import Case
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


def bench_cases(small: bool = False) -> list[BenchCase]:
    """The two-state merge (cascade prefix/suffix; FlashInfer's ``merge_state`` beside it where it
    imports, ``triton_impl.bench``, Peers) and the split merge of decode stage 2.

    ``small``: one case of each at sizes a CPU sets up at once (tests of the wiring).
    """

    def two_state(tokens: int, heads: int, head_dim: int) -> BenchCase:
        def setup(device: torch.device) -> Bench:
            dtype = torch.bfloat16
            p_out = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
            s_out = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
            p_lse = torch.randn(heads, tokens, device=device) * 8
            s_lse = torch.randn(heads, tokens, device=device) * 8
            out = torch.empty_like(p_out)
            out_lse = torch.empty_like(p_lse)
            run = lambda: merge_attn_states(out, p_out, p_lse, s_out, s_lse, out_lse)
            rows = slice(0, 256)  # golden in float64 on a slice of the tokens

            def checks(merged: torch.Tensor, merged_lse: torch.Tensor) -> list[Check]:
                ref_o, ref_lse = merge_two(
                    p_out[rows].double().transpose(0, 1), p_lse[:, rows].double(),
                    s_out[rows].double().transpose(0, 1), s_lse[:, rows].double(),
                )  # fmt: skip
                return [
                    Check("o", merged[rows].transpose(0, 1), ref_o, tolerance("lse_merge", "o", "bfloat16")),
                    Check("lse", merged_lse[:, rows], ref_lse, tolerance("lse_merge", "lse", "float32")),
                ]

            golden = lambda: merge_two(p_out.transpose(0, 1), p_lse, s_out.transpose(0, 1), s_lse)
            compiled = torch.compile(merge_two)
            nbytes = tokens * heads * (3 * head_dim * 2 + 3 * 4)
            return Bench(
                run, lambda: checks(out, out_lse), nbytes, 0.0,
                {"golden eager": golden,
                 "golden compiled": lambda: compiled(p_out.transpose(0, 1), p_lse, s_out.transpose(0, 1), s_lse)},
                peers=flashinfer_merge_state(p_out, p_lse, s_out, s_lse, checks=checks),
            )  # fmt: skip

        return BenchCase("lse_merge", f"merge_attn_states T={tokens} H={heads} D={head_dim} bf16", setup)

    def splits(rows: int, heads: int, num_splits: int, head_dim: int) -> BenchCase:
        def setup(device: torch.device) -> Bench:
            partials = torch.randn(rows, heads, num_splits, head_dim + 1, device=device)
            o = torch.empty(rows, heads, head_dim, device=device, dtype=torch.bfloat16)
            lse = torch.empty(rows, heads, device=device)
            run = lambda: merge_splits(partials, o, lse)

            def check() -> list[Check]:
                ref_o, ref_lse = merge_states(
                    partials[:8, ..., :head_dim].double(), partials[:8, ..., head_dim].double()
                )
                return [
                    Check("o", o[:8], ref_o, tolerance("lse_merge", "o", "bfloat16")),
                    Check("lse", lse[:8], ref_lse, tolerance("lse_merge", "lse", "float32")),
                ]

            golden = lambda: merge_states(partials[..., :head_dim], partials[..., head_dim])
            compiled = torch.compile(merge_states)
            nbytes = rows * heads * (num_splits * (head_dim + 1) * 4 + head_dim * 2 + 4)
            return Bench(
                run, check, nbytes, 0.0,
                {"golden eager": golden,
                 "golden compiled": lambda: compiled(partials[..., :head_dim], partials[..., head_dim])},
            )  # fmt: skip

        return BenchCase("lse_merge", f"merge_splits R={rows} H={heads} S={num_splits} D={head_dim}", setup)

    if small:
        return [two_state(48, 4, 128), splits(8, 4, 3, 128)]
    return [
        two_state(32768, 32, 128),
        two_state(16384, 128, 128),
        splits(1024, 128, 8, 512),
        splits(4096, 32, 16, 128),
    ]
