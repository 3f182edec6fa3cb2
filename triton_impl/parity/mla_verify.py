"""Parity cases for causal MLA verify: DeepSeek latent widths (Lk 576 = 512 + 64), page 64.

bf16/fp16 and FP8 caches, one split and the serving split count, padding requests through
``real_seq_lens``. Short lengths and 16 heads on a CPU (interpreter); serving sizes on a GPU.
"""

from __future__ import annotations

import torch

from golden.mla_verify import mla_verify
from triton_impl.mla_verify import decode_attention_fwd_verify, verify_num_kv_splits
from triton_impl.parity import Case, Check
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
        pages = [-(-n // _PAGE) for n in lens]
        num_pages = sum(pages) + 1
        values = torch.randn(num_pages, _PAGE, 1, _LV + _ROPE, generator=gen) / (0.05 if fp8 else 1.0)
        cache = values.to(torch.float8_e4m3fn if fp8 else dtype).to(device)
        order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        used = 0
        for b, n_pages in enumerate(pages):
            table[b, :n_pages] = order[used : used + n_pages]
            used += n_pages
        table = table.to(device)
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
