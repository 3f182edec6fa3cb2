"""Parity cases for causal MLA verify: DeepSeek latent widths (Lk 576 = 512 + 64), page 64.

bf16/fp16 and FP8 caches, one split and the serving split count, padding requests through
``real_seq_lens``. Short lengths and 16 heads on a CPU (interpreter); serving sizes on a GPU.
"""

from __future__ import annotations

import torch

from golden.mla_verify import mla_verify
from triton_impl.bench import Bench, BenchCase, flashinfer_mla
from triton_impl.cases import Check, block_table_for, device_paged_cache
from triton_impl.decode_attention import _compute_num_kv_splits, decode_attention_fwd, expand_decode_rows
from triton_impl.mla_verify import decode_attention_fwd_verify, select_verify_config, verify_num_kv_splits
from triton_impl.parity import Case
from triton_impl.tolerances import tolerance

_H200_SMS = 132
_LV, _ROPE, _PAGE = 512, 64, 64
_SM_SCALE = 192**-0.5  # DeepSeek's prefill scale (qk_nope 128 + qk_rope 64), as serving passes it


def _case(
    name: str,
    lens: list[int],
    qlen: int,
    heads: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    real: list[int] | None = None,
    splits: int | None = None,
) -> Case:
    def run(device: torch.device) -> list[Check]:
        gen = torch.Generator().manual_seed(sum(lens) + qlen * heads)
        k_scale = torch.tensor(0.05, device=device) if fp8 else None
        table, num_pages = block_table_for(lens, _PAGE, gen=gen, device=device, spare_pages=1, extra_columns=1)
        values = torch.randn(num_pages, _PAGE, 1, _LV + _ROPE, generator=gen) / (0.05 if fp8 else 1.0)
        cache = values.to(torch.float8_e4m3fn if fp8 else dtype).to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        real_lens = None if real is None else torch.tensor(real, dtype=torch.int32, device=device)
        rows = len(lens) * qlen
        q = (torch.randn(rows, heads, _LV + _ROPE, generator=gen) * 0.5).to(dtype).to(device)
        num_splits = splits or verify_num_kv_splits(max(lens), len(lens), qlen, heads, _H200_SMS)
        o = torch.full((rows, heads, _LV), float("nan"), dtype=dtype, device=device)
        lse = torch.full((rows, heads), float("nan"), device=device)
        logits = torch.full((rows, heads, num_splits, _LV + 1), float("nan"), device=device)
        decode_attention_fwd_verify(
            q, cache, cache[..., :_LV], o, lse, table, seq_lens, real_lens, qlen,
            logits if num_splits > 1 else None, num_splits, _SM_SCALE, _PAGE, k_scale=k_scale,
        )  # fmt: skip
        ref_o, ref_lse = mla_verify(
            q, cache, table, seq_lens, real_lens, qlen, _LV, _SM_SCALE, _PAGE, k_scale=k_scale, dtype=torch.float64
        )
        return [
            Check("o", o, ref_o, tolerance("mla_verify", "o", dtype)),
            Check("lse", lse, ref_lse, tolerance("mla_verify", "lse", "float32")),
        ]

    return Case("mla_verify", name, run)


def cases() -> list[Case]:
    if torch.cuda.is_available():
        long, mid, heads_many = [4096, 1500, 700, 3], [2048, 1024, 513, 64], 128
    else:
        long, mid, heads_many = [70, 40, 3], [65, 33, 2], 16
    return [
        _case(f"H=16 qlen=4 bf16 L<={max(long)} S=auto", long, 4, 16),
        _case(f"H={heads_many} qlen=2 bf16 L<={max(mid)} S=1", mid, 2, heads_many, splits=1),
        _case(f"H=16 qlen=8 fp8 cache L<={max(mid)} S=auto", mid, 8, 16, fp8=True),
        _case(f"H=16 qlen=3 fp16 L<={max(long)} S=4", long, 3, 16, dtype=torch.float16, splits=4),
        _case("H=16 qlen=4 bf16 real_seq_lens (padding R=0)", mid, 4, 16, real=[mid[0] - 2, 0, *mid[2:-1], 1]),
    ]


def bench_case(batch: int, heads: int, qlen: int, length: int, fp8: bool = False) -> BenchCase:
    """One bench case: ``batch`` requests of ``length`` keys, ``qlen`` draft tokens of ``heads`` heads each."""

    def setup(device: torch.device) -> Bench:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        lens = [length] * batch
        cache, table = device_paged_cache(lens, _PAGE, 1, _LV + _ROPE, torch.bfloat16, device)
        k_scale = torch.tensor(0.05, device=device) if fp8 else None
        if fp8:
            cache = (cache.float() / 0.05).to(torch.float8_e4m3fn)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        rows = batch * qlen
        q = (torch.randn(rows, heads, _LV + _ROPE, device=device) * 0.5).to(torch.bfloat16)
        block_h = select_verify_config(batch, qlen, heads)["BLOCK_H"]
        splits = verify_num_kv_splits(length, batch, qlen, heads, sms, block_h=block_h)
        o = torch.empty(rows, heads, _LV, dtype=torch.bfloat16, device=device)
        lse = torch.empty(rows, heads, device=device)
        logits = torch.empty(rows, heads, splits, _LV + 1, device=device)
        v = cache[..., :_LV]

        def run() -> None:
            decode_attention_fwd_verify(q, cache, v, o, lse, table, seq_lens, None, qlen,
                                        logits, splits, _SM_SCALE, _PAGE, k_scale=k_scale)  # fmt: skip

        def checks(out: torch.Tensor, out_lse: torch.Tensor) -> list[Check]:
            first = slice(0, qlen)  # the float64 golden on the first request
            ref_o, ref_lse = mla_verify(q[first], cache, table[:1], seq_lens[:1], None, qlen, _LV, _SM_SCALE,
                                        _PAGE, k_scale=k_scale, dtype=torch.float64)  # fmt: skip
            return [
                Check("o", out[first], ref_o, tolerance("mla_verify", "o", torch.bfloat16)),
                Check("lse", out_lse[first], ref_lse, tolerance("mla_verify", "lse", "float32")),
            ]

        row_table, row_lens = expand_decode_rows(table, seq_lens, qlen, causal=True)
        decode_splits = _compute_num_kv_splits(length, sms)
        decode_logits = torch.empty(rows, heads, decode_splits, _LV + 1, device=device)
        scales = {"k_scale": k_scale, "v_scale": k_scale} if fp8 else {}

        def per_row_decode() -> None:
            decode_attention_fwd(q, cache, v, o, lse, row_table, row_lens, decode_logits, decode_splits,
                                 _SM_SCALE, _PAGE, is_mla=True, **scales)  # fmt: skip

        visible = sum(max(length - qlen + 1 + t, 0) for t in range(qlen))  # keys summed over a request's rows
        nbytes = batch * length * (_LV + _ROPE) * cache.element_size() + q.numel() * 2 + o.numel() * 2 + lse.numel() * 4
        flops = 2 * batch * heads * visible * (2 * _LV + _ROPE)
        peers = flashinfer_mla(q, cache, table, seq_lens, qlen=qlen, value_width=_LV, sm_scale=_SM_SCALE,
                               page_size=_PAGE, k_scale=k_scale, checks=checks)  # fmt: skip
        return Bench(run, lambda: checks(o, lse), nbytes, flops, {"per-row decode (flattened)": per_row_decode},
                     kernels=("_fwd_verify_kernel_stage1",), peers=peers)  # fmt: skip

    name = f"MLA verify B={batch} H={heads} qlen={qlen} L={length} {'fp8' if fp8 else 'bf16'}"
    return BenchCase("mla_verify", name, setup)


def bench_cases(small: bool = False) -> list[BenchCase]:
    """DeepSeek MLA verify (Lk 576, Lv 512, page 64): 16 and 128 heads, qlen 1..8, bf16 and FP8 caches.

    Baseline: the per-row path serving used before this kernel, the flattened causal multi-token
    decode (``expand_decode_rows`` + ``decode_attention_fwd``, one row per draft token). Peer:
    FlashInfer's causal MLA where it imports (``triton_impl.bench``, Peers).

    ``small``: a few cases at sizes a CPU sets up at once (tests of the wiring).
    """
    if small:
        return [bench_case(2, 16, 4, 130), bench_case(2, 16, 1, 70), bench_case(2, 16, 2, 130, fp8=True)]
    return [
        bench_case(8, 16, 4, 4096),
        bench_case(32, 16, 4, 4096),
        bench_case(64, 16, 2, 4096),
        bench_case(8, 128, 4, 4096),
        bench_case(64, 128, 1, 2048),
        bench_case(16, 128, 8, 4096),
        bench_case(32, 128, 2, 8192, fp8=True),
        # The long-context and small-batch verify shapes FlashInfer was first measured at.
        bench_case(32, 16, 4, 32768),
        bench_case(32, 128, 4, 32768),
        bench_case(1, 128, 4, 32768),
        # Eight draft tokens at 16 heads: 128 (token, head) rows a request, two 64-row tiles; 2 * 128 * 1088 FLOP
        # per 1152-byte key row (242 a byte) is past the H200's ~165 FLOP a byte, so its roofline is compute.
        bench_case(32, 16, 8, 32768),
    ]
