"""Parity cases for split-KV decode: DeepSeek MLA (bf16, FP8, windowed multi-token decode) and GQA.

Realistic widths and heads everywhere; lengths and batch are short on a CPU (interpreter) and
serving-sized on a GPU.
"""

from __future__ import annotations

import torch

from golden.decode_attention import decode_attention
from triton_impl.bench import Bench, BenchCase, flashinfer_gqa_decode, flashinfer_mla
from triton_impl.cases import Check, block_table_for, device_paged_cache
from triton_impl.decode_attention import _compute_num_kv_splits, decode_attention_fwd, expand_decode_rows
from triton_impl.parity import Case
from triton_impl.tolerances import tolerance

_H200_SMS = 132


def _paged(lens: list[int], page_size: int, kv_heads: int, width: int, dtype: torch.dtype, gen: torch.Generator):
    """A cache holding ``lens[b]`` random tokens per request in shuffled pages, and its block table."""
    table, num_pages = block_table_for(lens, page_size, gen=gen, spare_pages=1, extra_columns=1)
    cache = torch.randn(num_pages, page_size, kv_heads, width, generator=gen).to(dtype)
    return cache, table, torch.tensor(lens, dtype=torch.int32)


def _case(
    name: str,
    lens: list[int],
    *,
    is_mla: bool,
    heads: int,
    kv_heads: int,
    key_width: int,
    value_width: int,
    page_size: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    window: int | None = None,
    cap: float = 0.0,
    query_len: int = 1,
    lse_dtype: torch.dtype = torch.float32,
    splits: int | None = None,
) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(len(name))
        cache_dtype = torch.float8_e4m3fn if fp8 else dtype
        width = key_width if is_mla else key_width + value_width
        cache, table, seq_lens = _paged(lens, page_size, kv_heads, width, cache_dtype, gen)
        table, seq_lens = expand_decode_rows(table, seq_lens, query_len, causal=True)
        cache, table, seq_lens = cache.to(device), table.to(device), seq_lens.to(device)
        k, v = (cache, cache[..., :value_width]) if is_mla else (cache[..., :key_width], cache[..., key_width:])
        rows = len(seq_lens)
        q = (torch.randn(rows, heads, key_width, generator=gen) * 0.5).to(dtype).to(device)
        num_splits = splits or _compute_num_kv_splits(max(lens), _H200_SMS, window)
        o = torch.full((rows, heads, value_width), float("nan"), dtype=dtype, device=device)
        lse = torch.full((rows, heads), float("nan"), dtype=lse_dtype, device=device)
        logits = torch.empty(rows, heads, num_splits, value_width + 1, device=device) if num_splits > 1 else None
        scales = {}
        if fp8:
            scales = {"k_scale": torch.tensor(0.05, device=device), "v_scale": torch.tensor(0.05, device=device)}
        sm_scale = 192**-0.5 if is_mla else key_width**-0.5
        decode_attention_fwd(
            q, k, v, o, lse, table, seq_lens, logits, num_splits, sm_scale, page_size,
            logit_cap=cap, is_mla=is_mla, sliding_window=window, **scales,
        )  # fmt: skip
        ref_o, ref_lse = decode_attention(
            q, k, v, table, seq_lens, sm_scale, page_size, logit_cap=cap, is_mla=is_mla, sliding_window=window,
            dtype=torch.float64, **scales,
        )  # fmt: skip
        return [
            Check("o", o, ref_o, tolerance("decode_attention", "o", dtype)),
            Check("lse", lse, ref_lse, tolerance("decode_attention", "lse", lse_dtype)),
        ]

    return Case("decode_attention", name, run)


def _batch_invariance(lens: list[int]) -> Case:
    """One split: each row computed alone has the bits it has inside the batch."""

    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(7)
        cache, table, seq_lens = _paged(lens, 64, 1, 576, torch.bfloat16, gen)
        cache, table, seq_lens = cache.to(device), table.to(device), seq_lens.to(device)
        q = (torch.randn(len(lens), 16, 576, generator=gen) * 0.5).to(torch.bfloat16).to(device)

        def decode(rows: list[int]) -> torch.Tensor:
            o = torch.full((len(rows), 16, 512), float("nan"), dtype=torch.bfloat16, device=device)
            lse = torch.full((len(rows), 16), float("nan"), device=device)
            decode_attention_fwd(q[rows], cache, cache[..., :512], o, lse, table[rows], seq_lens[rows], None, 1,
                                 192**-0.5, 64, is_mla=True)  # fmt: skip
            return o

        batch = decode(list(range(len(lens))))
        alone = torch.cat([decode([r]) for r in range(len(lens))])
        return [Check("o (row alone vs in batch)", alone, batch, None)]

    return Case("decode_attention", f"batch invariance S=1 MLA 576/512 B={len(lens)}", run)


def cases() -> list[Case]:
    gpu = torch.cuda.is_available()
    mla_lens = [1025, 4096, 77, 0, 2048, 300, 9000, 1] * 4 if gpu else [37, 0, 5]
    gqa_lens = [1027, 4096, 513, 0, 8192, 3, 2000, 1500] * 4 if gpu else [37, 0, 5]
    window = 1024 if gpu else 8
    splits = None if gpu else 2  # GPU: vLLM's _compute_num_kv_splits for an H200 (132 SMs)
    mla = dict(is_mla=True, heads=128 if gpu else 16, kv_heads=1, key_width=576, value_width=512, page_size=64)
    gqa = dict(is_mla=False, page_size=16, splits=splits)
    return [
        _case(f"MLA 576/512 bf16 B={len(mla_lens)}", mla_lens, **mla, splits=splits),
        _case(f"MLA 576/512 fp8 cache B={len(mla_lens)}", mla_lens, **mla, fp8=True, splits=splits),
        _case(
            f"MLA W={window} causal Q=4, bf16 LSE",
            mla_lens[:8],
            **mla,
            window=window,
            query_len=4,
            lse_dtype=torch.bfloat16,
            splits=splits,
        ),
        _case(
            f"GQA H=32 HKV=8 D=128 W={window}",
            gqa_lens,
            heads=32,
            kv_heads=8,
            key_width=128,
            value_width=128,
            window=window,
            **gqa,
        ),
        _case(
            "GQA H=16 HKV=2 Dqk=192 Dv=128 fp16 cap=30",
            gqa_lens,
            heads=16,
            kv_heads=2,
            key_width=192,
            value_width=128,
            dtype=torch.float16,
            cap=30.0,
            **gqa,
        ),
        _batch_invariance([1025, 77, 4096, 0] if gpu else [37, 0, 5]),
    ]


def bench_cases(small: bool = False) -> list[BenchCase]:
    """DeepSeek MLA decode (Lk 576, Lv 512, page 64) and GQA decode (H 32, HKV 8, D 128, page 16),
    with FlashInfer beside ours where it imports (``triton_impl.bench``, Peers).

    ``small``: one case of each kind at sizes a CPU sets up at once (tests of the wiring).
    """

    def case(batch: int, heads: int, length: int, *, is_mla: bool, fp8: bool = False) -> BenchCase:
        kv_heads, key_width, value_width, page = (1, 576, 512, 64) if is_mla else (8, 128, 128, 16)

        def setup(device: torch.device) -> Bench:
            cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            lens = [length] * batch
            width = key_width if is_mla else key_width + value_width
            cache, table = device_paged_cache(lens, page, kv_heads, width, cache_dtype, device)
            k, v = (cache, cache[..., :value_width]) if is_mla else (cache[..., :key_width], cache[..., key_width:])
            seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
            q = (torch.randn(batch, heads, key_width, device=device) * 0.5).to(torch.bfloat16)
            splits = _compute_num_kv_splits(length, torch.cuda.get_device_properties(device).multi_processor_count)
            o = torch.empty(batch, heads, value_width, dtype=torch.bfloat16, device=device)
            lse = torch.empty(batch, heads, device=device)
            logits = torch.empty(batch, heads, splits, value_width + 1, device=device)
            scales = {"k_scale": torch.tensor(0.05, device=device), "v_scale": torch.tensor(0.05, device=device)}
            scales = scales if fp8 else {}
            sm_scale = 192**-0.5 if is_mla else key_width**-0.5
            args = (table, seq_lens, sm_scale, page)

            def run() -> None:
                decode_attention_fwd(q, k, v, o, lse, table, seq_lens, logits, splits, sm_scale, page,
                                     is_mla=is_mla, **scales)  # fmt: skip

            def checks(out: torch.Tensor, out_lse: torch.Tensor) -> list[Check]:
                rows = slice(0, 2)  # the float64 golden on two rows
                ref_o, ref_lse = decode_attention(q[rows], k, v, table[rows], seq_lens[rows], *args[2:], is_mla=is_mla,
                                                  dtype=torch.float64, **scales)  # fmt: skip
                return [
                    Check("o", out[rows], ref_o, tolerance("decode_attention", "o", torch.bfloat16)),
                    Check("lse", out_lse[rows], ref_lse, tolerance("decode_attention", "lse", torch.float32)),
                ]

            kv_bytes = batch * length * kv_heads * (width if is_mla else key_width + value_width) * cache.element_size()
            nbytes = kv_bytes + q.numel() * 2 + o.numel() * 2 + lse.numel() * 4
            flops = 2 * batch * heads * length * (key_width + value_width)
            baselines = {}
            if batch * heads * length <= 2**22:  # the golden materializes [rows, H, L] scores
                baselines["golden eager"] = lambda: decode_attention(q, k, v, *args, is_mla=is_mla, **scales)
            if is_mla:
                peers = flashinfer_mla(q, cache, table, seq_lens, qlen=1, value_width=value_width, sm_scale=sm_scale,
                                       page_size=page, k_scale=scales.get("k_scale"), checks=checks)  # fmt: skip
            else:
                peers = flashinfer_gqa_decode(q, k, v, table, seq_lens, sm_scale=sm_scale, checks=checks)
            return Bench(run, lambda: checks(o, lse), nbytes, flops, baselines, kernels=("_decode_stage1_kernel",),
                         peers=peers)  # fmt: skip

        kind = "MLA 576/512" if is_mla else "GQA 32/8 D128"
        return BenchCase("decode_attention", f"{kind} B={batch} H={heads} L={length} {'fp8' if fp8 else 'bf16'}", setup)

    if small:
        return [case(2, 16, 130, is_mla=True), case(2, 16, 130, is_mla=True, fp8=True), case(2, 32, 40, is_mla=False)]
    return [
        case(32, 16, 32768, is_mla=True),
        case(32, 128, 32768, is_mla=True),
        case(128, 16, 8192, is_mla=True),
        case(8, 128, 8192, is_mla=True),
        case(1, 128, 32768, is_mla=True),
        case(32, 128, 8192, is_mla=True, fp8=True),
        case(128, 128, 1024, is_mla=True),
        case(8, 16, 4096, is_mla=True),  # small batches, as FlashInfer was first measured at
        case(8, 128, 4096, is_mla=True),
        case(32, 32, 8192, is_mla=False),
        case(32, 32, 32768, is_mla=False),
        case(128, 32, 1024, is_mla=False),
    ]
