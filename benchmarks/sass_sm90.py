"""SASS of the benchmarked MLA launch configs for sm_90, compiled on a CPU (no GPU needed).

A pytest file for the ``tests/compile_sm90.py`` plugin: it launches, under the interpreter, the
sm_90 configs of verify (large and small) and decode (H=128 and H=16) at DeepSeek widths on tiny
inputs; the plugin compiles each launched variant for sm_90 and, with a report path, counts HGMMA
and HMMA in its SASS (``cuobjdump`` from the Triton wheel)::

    ATTNREF_COMPILE_SM90=1 ATTNREF_COMPILE_SM90_REPORT=/tmp/sass.jsonl PYTHONPATH=. \\
        .venv/bin/python -m pytest -q -n 0 -p tests.compile_sm90 -p no:cacheprovider benchmarks/sass_sm90.py

Results (Triton 3.9 on the CPU machine; the H200 runs 3.6) are in ``notebooks/results/sass_sm90.md``.
"""

import torch

from triton_impl.decode_attention import DECODE_CONFIGS, decode_attention_fwd
from triton_impl.mla_verify import VERIFY_CONFIGS, VERIFY_DEFAULT_CONFIG, decode_attention_fwd_verify


def test_mla_configs_sm90() -> None:
    heads, qlen, page = 128, 4, 64
    cache = torch.randn(2, page, 1, 576).to(torch.bfloat16)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    for size in ("large", "small"):
        cfg = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS["sm90"][size]}
        q = torch.randn(2 * qlen, heads, 576).to(torch.bfloat16)
        o = torch.empty(2 * qlen, heads, 512, dtype=torch.bfloat16)
        lse = torch.empty(2 * qlen, heads)
        decode_attention_fwd_verify(
            q, cache, cache[..., :512], o, lse, table, lens, None, qlen, None, 1, 0.1, page, config=cfg
        )
    for h in (128, 16):
        q = torch.randn(2, h, 576).to(torch.bfloat16)
        o = torch.empty(2, h, 512, dtype=torch.bfloat16)
        lse = torch.empty(2, h)
        decode_attention_fwd(
            q,
            cache,
            cache[..., :512],
            o,
            lse,
            table,
            lens,
            None,
            1,
            0.1,
            page,
            is_mla=True,
            config=DECODE_CONFIGS["sm90"]["mla"],
        )
