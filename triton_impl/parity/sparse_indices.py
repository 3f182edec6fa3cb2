"""Parity cases for sparse-attention index preparation at DeepSeek-V4 sizes (window 128, top-k 512, ratios 4/128).

All outputs are integers and compared exactly.
"""

from __future__ import annotations

import torch

from golden import sparse_indices as golden
from triton_impl.parity import Case, Check
from triton_impl.sparse_indices import (
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
)

WINDOW = 128  # n_win of DeepSeek-V4 (papers.md#sparse-indices)


def _to(device: torch.device, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(device) for t in tensors]


def _global_topk(num_tokens: int, topk: int, num_reqs: int, block_size: int) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(num_tokens + topk)
        max_blocks = 64
        local = torch.randint(0, max_blocks * block_size, (num_tokens, topk), generator=gen, dtype=torch.int32)
        local[:, topk // 2 :] = torch.where(
            torch.rand(num_tokens, topk - topk // 2, generator=gen) < 0.3, -1, local[:, topk // 2 :]
        )
        token_to_req = torch.randint(0, num_reqs, (num_tokens,), generator=gen, dtype=torch.int32)
        table = torch.randint(0, 100_000, (num_reqs, max_blocks), generator=gen, dtype=torch.int32)
        is_valid = torch.ones(num_tokens, dtype=torch.bool)
        is_valid[-num_tokens // 8 :] = False  # CUDA-graph padding
        args = (local, token_to_req, table, block_size, is_valid)
        expected = golden.compute_global_topk_indices_and_lens(*args)
        actual = compute_global_topk_indices_and_lens(
            *_to(device, local, token_to_req, table), block_size, is_valid.to(device)
        )
        return [Check("global", actual[0].cpu(), expected[0], None), Check("lens", actual[1].cpu(), expected[1], None)]

    return Case("sparse_indices", f"global top-k T={num_tokens} K={topk} bs={block_size}", run)


def _combine(query_lens: list[int], prefix_lens: list[int], ratio: int, topk: int) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(sum(query_lens) + ratio)
        seq_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
        gather_lens = [q + min(p, WINDOW - 1) for q, p in zip(query_lens, prefix_lens)]
        N = max(s // ratio for s in seq_lens)
        M = N + max(gather_lens)
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        topk_indices = torch.randint(0, max(N, 1), (int(qsl[-1]), max(topk, 1)), generator=gen, dtype=torch.int32)
        tensors = (
            topk_indices,
            qsl,
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(gather_lens, dtype=torch.int32),
        )
        expected = golden.combine_topk_swa_indices(*tensors, WINDOW, ratio, topk, M, N)
        actual = combine_topk_swa_indices(*_to(device, *tensors), WINDOW, ratio, topk, M, N)
        return [
            Check("combined", actual[0].cpu(), expected[0], None),
            Check("lens", actual[1].cpu(), expected[1], None),
        ]

    return Case("sparse_indices", f"combine R={len(query_lens)} Q={max(query_lens)} cr={ratio} topk={topk}", run)


def _flashinfer(num_decode: int, prefill_query_lens: list[int], topk: int) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(num_decode + topk)
        swa_bs, comp_bs, ratio = 64, 16, 4
        query_lens = [1] * num_decode + prefill_query_lens
        seq_lens = [int(torch.randint(q + 1, q + 2000, (1,), generator=gen)) for q in query_lens]
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        token_to_req = torch.repeat_interleave(
            torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens)
        )
        swa_table = torch.randint(
            0, 50_000, (len(query_lens), -(-max(seq_lens) // swa_bs)), generator=gen, dtype=torch.int32
        )
        comp_cols = -(-(max(seq_lens) // ratio) // comp_bs) + 1
        comp_table = torch.randint(0, 50_000, (len(query_lens), comp_cols), generator=gen, dtype=torch.int32)
        decode_swa = torch.randint(0, 3_000_000, (num_decode, WINDOW), generator=gen, dtype=torch.int32)
        decode_local = torch.randint(-1, comp_cols * comp_bs, (num_decode, topk), generator=gen, dtype=torch.int32)
        num_prefill = int(qsl[-1]) - num_decode
        prefill_topk = torch.randint(-1, comp_cols * comp_bs, (num_prefill, topk), generator=gen, dtype=torch.int32)
        is_valid = torch.ones(num_decode, dtype=torch.bool)
        lens = torch.tensor(seq_lens, dtype=torch.int32)

        def build(fn, dev: torch.device):
            return fn(
                decode_swa.to(dev), decode_local.to(dev), None, prefill_topk.to(dev), qsl.to(dev), lens.to(dev),
                token_to_req.to(dev), swa_table.to(dev), swa_bs, comp_table.to(dev), comp_bs, WINDOW, ratio, topk,
                decode_compressed_indices_are_local=True, decode_is_valid_token=is_valid.to(dev),
                compressed_block_span=2 * comp_bs,
            )  # fmt: skip

        expected = build(golden.build_flashinfer_mixed_sparse_indices, torch.device("cpu"))
        actual = build(build_flashinfer_mixed_sparse_indices, device)
        return [Check("indices", actual[0].cpu(), expected[0], None), Check("lens", actual[1].cpu(), expected[1], None)]

    return Case("sparse_indices", f"flashinfer Td={num_decode} Tp={sum(prefill_query_lens)} topk={topk}", run)


def cases() -> list[Case]:
    gpu = torch.cuda.is_available()
    return [
        _global_topk(4096 if gpu else 16, 512 if gpu else 64, 8, 64),  # V4-Flash index_topk 512
        _combine([1024, 512, 37] if gpu else [8, 3], [4000, 0, 9000] if gpu else [200, 0], 4, 512),  # CSA
        _combine([1024, 512] if gpu else [8, 3], [4000, 9000] if gpu else [200, 300], 128, 8192 if gpu else 8),  # HCA
        _combine([1024] if gpu else [8], [100], 1, 0),  # window-only layer
        _flashinfer(256 if gpu else 4, [512, 100] if gpu else [5, 3], 512 if gpu else 64),
    ]
