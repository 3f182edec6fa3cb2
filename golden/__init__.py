"""Golden models: the readable definitions the Triton kernels are tested against.

Each ``golden/<op>.py`` is the textbook version of ``triton_impl/<op>.py``: PyTorch + einops,
float32 or float64 math, pure functions. Golden code never calls Triton. ``golden/_paged.py`` holds
what the attention goldens share: reading keys through a block table (``gather_positions``), the
one FP8 cache dequantization (``dequantize_keys``) and the attention state of a query row's heads
over a key set (``attend``), with a row that sees no key as ``o = 0, lse = -inf``.

Axis glossary (used in einops patterns, docstrings and tests across the package):

====== ==========================================================================
``B``  requests in the batch
``Q``  verify (draft) tokens per request, ``qlen``
``R``  flattened query rows, ``R = B * Q`` (row ``r = b * Q + t``)
``H``  query heads
``HKV`` KV heads (1 for MLA's latent cache; ``H % HKV == 0`` for GQA)
``L``  KV length (keys a request or row can see)
``S``  KV splits (split-KV / flash-decoding partitions)
``N``  merged states (LSE merge)
``T``  tokens (LSE merge: rows of ``merge_attn_states``; caches: inserted tokens)
``Lk`` key width (576 for DeepSeek MLA = 512 latent + 64 rope)
``Lv`` value width (512 for DeepSeek MLA: V is the first ``Lv`` columns of K)
``P``  rope width, ``P = Lk - Lv``
``D``  head dimension where keys and values share it
====== ==========================================================================

Conventions: LSEs are natural-log float32 unless a function says otherwise; a row that sees no key
has the neutral attention state ``o = 0, lse = -inf``; references are computed in float64 where a
test needs an oracle.
"""
