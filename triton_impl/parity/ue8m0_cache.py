"""Parity cases for the UE8M0 FP8 K cache: serving layouts (SWA cache bs 64, compressed bs 16), OCP and FNUZ.

Both outputs are bit-level: the cache bytes after insert, and the gathered bf16 (no NaN in these
inputs, so bits compare exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from golden.ue8m0_cache import SCALE_BYTES, TOKEN_DATA_BYTES, block_bytes, gather_k_cache, insert_k_cache, read_records
from triton_impl.bench import Bench, BenchCase
from triton_impl.cases import Check
from triton_impl.parity import Case
from triton_impl.ue8m0_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache


def _keys(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """K rows as a model produces them: unit-scale NoPE with a few outlier channels, RoPE in [-1, 1]."""
    k = torch.randn(num_tokens, 512, generator=gen)
    k[:, torch.randint(0, 448, (8,), generator=gen)] *= 30.0
    return k.to(torch.bfloat16)


def _insert(num_tokens: int, block_size: int, padded: bool, use_fnuz: bool) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(num_tokens + block_size)
        num_blocks = 2 * -(-num_tokens // block_size) + 1
        cache = torch.randint(0, 256, (num_blocks, block_bytes(block_size, padded)), generator=gen, dtype=torch.uint8)
        k = _keys(num_tokens, gen)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::17] = -1  # padded tokens of the batch
        expected = insert_k_cache(k, cache, slots, block_size, use_fnuz)
        actual = cache.to(device)
        quantize_and_insert_k_cache(k.to(device), actual, slots.to(device), block_size, use_fnuz=use_fnuz)
        return [Check("cache bytes", actual.cpu(), expected, None)]

    fmt = "fnuz" if use_fnuz else "ocp"
    return Case("ue8m0_cache", f"insert N={num_tokens} bs={block_size} {'padded' if padded else 'unpadded'} {fmt}", run)


def _gather(seq_lens: list[int], gather: int | None, block_size: int, use_fnuz: bool) -> Case:
    """``gather`` tokens per request (the SWA tail, at offset N = 8) or the whole sequence (None)."""

    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(sum(seq_lens) + block_size)
        blocks_per_req = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_req)
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
        slots, start = [], 0
        for r, n in enumerate(seq_lens):
            table[r, : blocks_per_req[r]] = order[start : start + blocks_per_req[r]]
            start += blocks_per_req[r]
            j = torch.arange(n)
            slots.append(table[r, j // block_size].long() * block_size + j % block_size)
        cache = torch.zeros(num_blocks, block_bytes(block_size), dtype=torch.uint8)
        all_slots = torch.cat(slots)
        cache = insert_k_cache(_keys(all_slots.numel(), gen), cache, all_slots, block_size, use_fnuz)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        gather_lens = None if gather is None else torch.minimum(lens, torch.tensor(gather, dtype=torch.int32))
        offset = 0 if gather is None else 8
        out = torch.zeros(len(seq_lens), offset + max(seq_lens), 512, dtype=torch.bfloat16)
        expected = gather_k_cache(out, cache, lens, gather_lens, table, block_size, offset, use_fnuz)
        actual = out.to(device)
        dequantize_and_gather_k_cache(
            actual, cache.to(device), lens.to(device), None if gather_lens is None else gather_lens.to(device),
            table.to(device), block_size, offset, use_fnuz=use_fnuz,
        )  # fmt: skip
        return [Check("gathered bf16", actual.cpu(), expected, None)]

    what = "all" if gather is None else f"last {gather}"
    fmt = "fnuz" if use_fnuz else "ocp"
    return Case("ue8m0_cache", f"gather R={len(seq_lens)} {what} bs={block_size} {fmt}", run)


def cases() -> list[Case]:
    gpu = torch.cuda.is_available()
    tokens = 4096 if gpu else 48
    seq_lens = [8192, 3000, 129, 1] if gpu else [70, 33, 1]
    compressed_lens = [n // 4 for n in seq_lens]  # C4A compressed cache: seq_len // compress_ratio
    return [
        _insert(tokens, 64, padded=True, use_fnuz=False),  # SWA cache
        _insert(tokens, 64, padded=True, use_fnuz=True),  # SWA cache on an FNUZ platform
        _insert(tokens, 16, padded=False, use_fnuz=False),  # compressed cache, bs 64 / 4
        _gather(seq_lens, 128 + 7 if gpu else 20, 64, use_fnuz=False),  # SWA tail: query + window - 1
        _gather(seq_lens, 128 + 7 if gpu else 20, 64, use_fnuz=True),
        _gather(compressed_lens, None, 16, use_fnuz=False),  # the whole compressed cache
    ]


@triton.jit
def _scatter_kernel(k_ptr, cache_ptr, slot_ptr, block_stride, TOKENS_PER_PROGRAM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, DATA_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr,
                    K_WORDS: tl.constexpr):  # fmt: skip
    """Per token: its K row read as ``K_WORDS`` 4-byte words, the first ``DATA_WORDS`` written to its record and
    the first ``SCALE_WORDS`` to its scale bytes (the cache's layout: a block's records, then its scales)."""
    token = tl.program_id(0) * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block, position = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    words = tl.arange(0, K_WORDS)
    k = tl.load(k_ptr + token[:, None].to(tl.int64) * K_WORDS + words[None, :])
    base = block * block_stride
    record = base + position * DATA_WORDS
    tl.store(cache_ptr + record[:, None] + words[None, :], k, mask=words[None, :] < DATA_WORDS)
    scale = base + BLOCK_SIZE * DATA_WORDS + position * SCALE_WORDS
    tl.store(cache_ptr + scale[:, None] + words[None, :], k, mask=words[None, :] < SCALE_WORDS)


def scatter_records(k: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
    """The insert's memory traffic with no arithmetic: each token's bf16 K row read (1024 bytes) and its first
    576 and 8 bytes copied to its slot's record and scale bytes, 8 tokens a program. For ``len(slots)`` a multiple
    of 8 and every slot in the cache (no checks: a benchmark's baseline, the ceiling of the access pattern)."""
    _scatter_kernel[(len(slots) // 8,)](k.view(torch.int32), k_cache.view(torch.int32), slots, k_cache.stride(0) // 4,
                                        TOKENS_PER_PROGRAM=8, BLOCK_SIZE=block_size, DATA_WORDS=TOKEN_DATA_BYTES // 4,
                                        SCALE_WORDS=SCALE_BYTES // 4, K_WORDS=k.shape[1] // 2, num_warps=4)  # fmt: skip


def bench_cases() -> list[BenchCase]:
    """Insert and gather of 1M tokens (DeepSeek-V4 K cache, block 64, padded block stride).

    The insert writes at slots from ``randperm`` (decode's scattered pattern) and, in a second pair of rows, at
    consecutive slots (a prefill's); its baseline, :func:`scatter_records`, moves the same bytes to the same
    addresses with no arithmetic: the ceiling of the access pattern, below the sequential copy for random slots.
    """
    tokens, block_size = 1 << 20, 64

    def insert(use_fnuz: bool, sequential: bool = False) -> BenchCase:
        def setup(device: torch.device) -> Bench:
            num_blocks = tokens // block_size
            k = torch.randn(tokens, 512, device=device).to(torch.bfloat16)
            k_cache = torch.zeros(num_blocks, block_bytes(block_size), dtype=torch.uint8, device=device)
            slots = torch.arange(tokens, device=device) if sequential else torch.randperm(tokens, device=device)
            run = lambda: quantize_and_insert_k_cache(k, k_cache, slots, block_size, use_fnuz=use_fnuz)

            def check() -> list[Check]:
                few = slots[:4096]
                expected = insert_k_cache(k[:4096], torch.zeros_like(k_cache), few, block_size, use_fnuz)
                return [Check("records", read_records(k_cache, few, block_size),
                              read_records(expected, few, block_size), None)]  # fmt: skip

            scratch = torch.empty_like(k_cache)
            scatter = lambda: scatter_records(k, scratch, slots, block_size)
            return Bench(run, check, tokens * (512 * 2 + 584 + 8), 0.0, {"scatter, no arithmetic": scatter})

        order = " consecutive slots" if sequential else ""
        return BenchCase("ue8m0_cache", f"insert 1M tokens block 64 {'FNUZ' if use_fnuz else 'OCP'}{order}", setup)

    def gather(use_fnuz: bool) -> BenchCase:
        def setup(device: torch.device) -> Bench:
            requests = 64
            per_request = tokens // requests
            blocks = per_request // block_size
            k = torch.randn(tokens, 512, device=device).to(torch.bfloat16)
            k_cache = torch.zeros(tokens // block_size, block_bytes(block_size), dtype=torch.uint8, device=device)
            slots = torch.randperm(tokens, device=device)
            quantize_and_insert_k_cache(k, k_cache, slots, block_size, use_fnuz=use_fnuz)
            table = torch.randperm(tokens // block_size, device=device).to(torch.int32).view(requests, blocks)
            seq_lens = torch.full((requests,), per_request, dtype=torch.int32, device=device)
            out = torch.empty(requests, per_request, 512, dtype=torch.bfloat16, device=device)
            run = lambda: dequantize_and_gather_k_cache(out, k_cache, seq_lens, None, table, block_size, 0, use_fnuz)

            def check() -> list[Check]:
                expected = gather_k_cache(torch.zeros_like(out[:1]), k_cache, seq_lens[:1], None, table[:1],
                                          block_size, 0, use_fnuz)  # fmt: skip
                return [Check("gathered", out[:1], expected, None)]

            return Bench(run, check, tokens * (584 + 512 * 2) + table.numel() * 4, 0.0)

        return BenchCase(
            "ue8m0_cache", f"gather 1M tokens (64 requests x 16K) block 64 {'FNUZ' if use_fnuz else 'OCP'}", setup
        )

    return [insert(False), insert(True), insert(False, True), insert(True, True), gather(False), gather(True)]
