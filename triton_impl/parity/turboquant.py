"""Parity cases for TurboQuant: the SoA store (bytes, exact) and the split-KV decode, every preset.

Each case stores the same tokens with the Triton kernel and the golden model (the bytes must be
equal), then decodes with the Triton kernel and with golden on those bytes (float64). Llama-3-8B
style GQA (32 query heads, 8 KV heads, D = 128) on a GPU; fewer heads and tokens on a CPU.
"""

from __future__ import annotations

import torch

from golden.turboquant import TurboQuantConfig, hadamard_rotation, solve_lloyd_max, turboquant_decode_attention
from golden.turboquant import turboquant_store as golden_store
from triton_impl.parity import Case, Check
from triton_impl.tolerances import tolerance
from triton_impl.turboquant import triton_turboquant_decode_attention_v2, triton_turboquant_store


def _case(name: str, preset: str, head_dim: int, heads: int, kv_heads: int, block_size: int = 16) -> Case:
    def run(device: torch.device) -> list[Check]:
        gpu = device.type == "cuda"
        lens = [1, 17, 129, 1000] if gpu else [1, 19]
        splits = 32 if gpu else 2  # upstream's default max_num_kv_splits on a GPU
        num_q_heads, num_kv_heads = (heads, kv_heads) if gpu else (heads // 2, kv_heads // 2 or 1)
        gen = torch.Generator().manual_seed(len(name))
        config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
        centroids, midpoints = solve_lloyd_max(head_dim, config.centroid_bits)
        pit = hadamard_rotation(head_dim).T.contiguous()

        pages = [-(-n // block_size) for n in lens]
        num_blocks = sum(pages) + 1
        order = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        slots, used = [], 0
        for b, n in enumerate(lens):
            table[b, : pages[b]] = order[used : used + pages[b]].to(torch.int32)
            used += pages[b]
            slots += [int(table[b, j // block_size]) * block_size + j % block_size for j in range(n)]
        tokens = len(slots)
        key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        query = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(torch.bfloat16)
        cache = torch.randint(0, 256, (num_blocks, block_size, num_kv_heads, config.slot_size_aligned),
                              dtype=torch.uint8, generator=gen)  # fmt: skip
        key, value, query, cache, table, pit, centroids, midpoints = (
            t.to(device) for t in (key, value, query, cache, table, pit, centroids, midpoints)
        )
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)

        expected_cache = golden_store(cache, key, value, slot_mapping, pit, midpoints, centroids, config)
        triton_turboquant_store(key, value, cache, slot_mapping, pit, midpoints, config.key_mse_bits,
                                config.key_packed_size, config.value_quant_bits, config.key_fp8, centroids,
                                config.norm_correction)  # fmt: skip
        lse = torch.full((len(lens), num_q_heads), float("nan"), device=device)
        out = triton_turboquant_decode_attention_v2(
            query, cache, table, seq_lens, pit.T.contiguous(), centroids, head_dim**-0.5, config.key_mse_bits,
            config.key_packed_size, config.value_quant_bits, config.value_packed_size, key_fp8=config.key_fp8,
            norm_correction=config.norm_correction, lse_buf=lse, max_num_kv_splits=splits,
        )  # fmt: skip
        ref_out, ref_lse = turboquant_decode_attention(
            query, expected_cache, table, seq_lens, pit, centroids, head_dim**-0.5, config
        )
        return [
            Check("kv_cache", cache, expected_cache, None),
            Check("out", out, ref_out, tolerance("turboquant", "out", query.dtype)),
            Check("lse", lse, ref_lse, tolerance("turboquant", "lse", "float32")),
        ]

    return Case("turboquant", name, run)


def cases() -> list[Case]:
    return [
        _case("k8v4 D128 GQA 32/8", "turboquant_k8v4", 128, 32, 8),
        _case("4bit_nc D128 GQA 32/8", "turboquant_4bit_nc", 128, 32, 8),
        _case("k3v4_nc D128 GQA 32/8", "turboquant_k3v4_nc", 128, 32, 8),
        _case("3bit_nc D128 GQA 32/8", "turboquant_3bit_nc", 128, 32, 8),
        _case("4bit_nc D256 GQA 8/1", "turboquant_4bit_nc", 256, 8, 1),
        _case("3bit_nc D64 MHA 8/8 block 32", "turboquant_3bit_nc", 64, 8, 8, block_size=32),
    ]
