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


def bench_cases() -> list:
    """Decode per preset at B=32, Hq=32, Hk=8, D=128 (block 16), against a bf16 GQA decode of the same shape."""
    from triton_impl.bench import Bench, BenchCase, device_paged_cache
    from triton_impl.decode_attention import _compute_num_kv_splits, decode_attention_fwd

    def case(preset: str, length: int, batch: int = 32, heads: int = 32, kv_heads: int = 8) -> BenchCase:
        head_dim, block_size = 128, 16

        def setup(device: torch.device) -> Bench:
            config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
            centroids, midpoints = (t.to(device) for t in solve_lloyd_max(head_dim, config.centroid_bits))
            pit = hadamard_rotation(head_dim).T.contiguous().to(device)
            blocks = batch * length // block_size
            cache = torch.zeros(
                blocks, block_size, kv_heads, config.slot_size_aligned, dtype=torch.uint8, device=device
            )
            table = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
            positions = torch.arange(block_size, device=device)
            slots = (table.to(torch.int64)[:, :, None] * block_size + positions).flatten()
            key = torch.randn(slots.numel(), kv_heads, head_dim, device=device).to(torch.bfloat16)
            value = torch.randn_like(key)
            triton_turboquant_store(key, value, cache, slots, pit, midpoints, config.key_mse_bits,
                                    config.key_packed_size, config.value_quant_bits, config.key_fp8, centroids,
                                    config.norm_correction)  # fmt: skip
            seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
            query = torch.randn(batch, heads, head_dim, device=device).to(torch.bfloat16)
            lse = torch.empty(batch, heads, device=device)
            sizes = (config.key_mse_bits, config.key_packed_size, config.value_quant_bits, config.value_packed_size)
            args = (query, cache, table, seq_lens, pit.T.contiguous(), centroids, head_dim**-0.5, *sizes)
            holder = type("Buffers", (), {})()  # buffers allocated once, reused by every call

            def run() -> torch.Tensor:
                return triton_turboquant_decode_attention_v2(*args, key_fp8=config.key_fp8,
                                                             norm_correction=config.norm_correction, lse_buf=lse,
                                                             buf_holder=holder)  # fmt: skip

            def check() -> list[Check]:
                out = run()
                ref_out, ref_lse = turboquant_decode_attention(query[:1], cache, table[:1], seq_lens[:1], pit,
                                                               centroids, head_dim**-0.5, config)  # fmt: skip
                return [
                    Check("out", out[:1], ref_out, tolerance("turboquant", "out", query.dtype)),
                    Check("lse", lse[:1], ref_lse, tolerance("turboquant", "lse", "float32")),
                ]

            # bf16 GQA decode of the same shape: the baseline the compressed cache must beat.
            kv, kv_table = device_paged_cache([length] * batch, block_size, kv_heads, 2 * head_dim, torch.bfloat16,
                                              device)  # fmt: skip
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = _compute_num_kv_splits(length, sms)
            o_bf16 = torch.empty(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
            lse_bf16 = torch.empty(batch, heads, device=device)
            logits = torch.empty(batch, heads, splits, head_dim + 1, device=device)

            def bf16_decode() -> None:
                decode_attention_fwd(query, kv[..., :head_dim], kv[..., head_dim:], o_bf16, lse_bf16, kv_table,
                                     seq_lens, logits, splits, head_dim**-0.5, block_size)  # fmt: skip

            nbytes = blocks * cache.stride(0) + query.numel() * 2 * 2 + table.numel() * 4
            flops = 2 * batch * heads * length * 2 * head_dim
            return Bench(run, check, nbytes, flops, {"bf16 GQA decode": bf16_decode},
                         kernels=("_decode_stage1_kernel",))  # fmt: skip

        return BenchCase("turboquant", f"{preset} decode B={batch} Hq={heads} Hk={kv_heads} D=128 L={length}", setup)

    presets = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
    return [case(p, 8192) for p in presets] + [case("turboquant_4bit_nc", 32768)]
