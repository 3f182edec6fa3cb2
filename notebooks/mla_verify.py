# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Causal MLA verify: one K/V load for every draft token
#
# Speculative decoding proposes `qlen` draft tokens per request and the target model checks them
# in one pass. In DeepSeek's MLA, decode runs in latent space: every query head of every draft
# token attends to the *same* single latent KV head (`Lk = 576 = 512 + 64` elements per key, the
# value being its first 512). This notebook shows which keys each row sees, how the kernel cuts
# the work into splits and row tiles, how accurate bf16 and FP8 caches are, and why loading each
# K/V tile once per request tile beats running a per-row decode. Ops come from
# `golden/mla_verify.py` and `triton_impl/mla_verify.py` (papers.md#mla-verify).

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import triton_impl  # noqa: F401  (selects the Triton interpreter on a CPU-only machine)
from golden.mla_verify import mla_verify, row_limits, split_bounds
from triton_impl.mla_verify import (
    _VERIFY_SMALL_MAX_ROWS,
    VERIFY_CONFIGS,
    VERIFY_DEFAULT_CONFIG,
    decode_attention_fwd_verify,
    verify_row_blocks,
)

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# %% [markdown]
# ## 1. The causal limit
#
# Row `t` of request `b` sees the committed prefix (`L_b - qlen` keys) plus the draft tokens
# `0..t`: `n(b, t) = max(min(L_b - qlen + 1 + t, R_b), 0)`. `R_b` (`real_seq_lens`) only shrinks a
# row: a CUDA-graph padding request has `R_b = 0`, and a request whose real length is shorter
# than its padded block loses its last keys. The heatmap shows key `j` visible (dark) for each
# (request, row).

# %%
qlen = 4
seq_lens = torch.tensor([12, 7, 10, 3])
real_seq_lens = torch.tensor([12, 5, 0, 3])
limits = row_limits(seq_lens, real_seq_lens, qlen)
print("row limits n(b, t):\n", limits)

keys = torch.arange(int(seq_lens.max()))
fig, axes = plt.subplots(1, len(seq_lens), figsize=(13, 2.4), sharey=True)
for b, ax in enumerate(axes):
    visible = (keys[None, :] < limits[b][:, None]).float()
    visible[:, int(seq_lens[b]) :] = float("nan")  # past L_b: not part of the request
    ax.imshow(visible, cmap="Blues", vmin=0, vmax=1.3, aspect="auto")
    ax.set_title(f"L={int(seq_lens[b])}, R={int(real_seq_lens[b])}")
    ax.set_xlabel("key j")
axes[0].set_ylabel("draft token t")
plt.tight_layout()
plt.show()

# %% [markdown]
# The last row of a request sees all `min(L, R)` keys; with `L < qlen` the first rows see nothing
# and get the neutral state `(o = 0, lse = -inf)`, never NaN.

# %% [markdown]
# ## 2. How splits and row tiles cover the work
#
# A program owns `BLOCK_H` (token, head) rows of one request and one KV split. Splits are the same
# for every row of a request: chunks of `max(round_up(cdiv(L, S), SPLIT_ALIGN), MIN_SPLIT_LEN)`
# keys. Each program walks its split up to the largest limit among its rows, so a tile of early
# draft tokens stops sooner. Below: one request, `qlen = 4`, 8 heads (32 rows), `BLOCK_H = 16`, four
# splits; colour = split, hatched lines = row-tile boundaries, white = masked by the causal limit.

# %%
L, heads, block_h, num_splits, align, min_len = 150, 8, 16, 4, 16, 32
starts, ends = split_bounds(torch.tensor([L]), num_splits, align, min_len)
n = row_limits(torch.tensor([L]), None, qlen)[0]
rows = qlen * heads
owner = np.full((rows, L), np.nan)
for i in range(rows):
    t = i // heads
    for s in range(num_splits):
        lo, hi = int(starts[0, s]), min(int(ends[0, s]), int(n[t]))
        owner[i, lo:hi] = s
fig, ax = plt.subplots(figsize=(10, 3))
ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")
for rb in range(1, verify_row_blocks(qlen, heads, block_h)):
    ax.axhline(rb * block_h - 0.5, color="k", linestyle="--")
ax.set_xlabel("key j")
ax.set_ylabel("row i = t * H + h")
ax.set_title(f"splits {[(int(a), int(b)) for a, b in zip(starts[0], ends[0])]}; programs = row tiles x splits")
plt.show()
print(
    f"{verify_row_blocks(qlen, heads, block_h)} row tiles x {num_splits} splits = "
    f"{verify_row_blocks(qlen, heads, block_h) * num_splits} programs for this request"
)

# %% [markdown]
# Every split slot of every row is written, an empty one as `(0, -inf)`; the stage-2 merge
# (`merge_splits`, papers.md#lse-merge) therefore needs no boundaries and never reads stale scratch.
# `verify_num_kv_splits` picks the split cap from the batch's program count and the SM count.

# %% [markdown]
# ## 3. Accuracy: bf16 and FP8 caches against the float64 golden model
#
# Two errors matter. The *kernel* error compares Triton with the golden model on the same
# (quantized) cache: it is a few bf16 roundings, independent of the length. The *cache* error
# compares against the unquantized keys: FP8 (e4m3, 3 mantissa bits, scaled by `k_scale`) costs
# far more than bf16 (8 bits). Small widths (Lv 64, P 16) keep this fast under the interpreter.

# %%
lv, rope, h, page = 64, 16, 4, 16
lengths = [8, 32, 96, 192]
errors = {"kernel, bf16 cache": [], "kernel, FP8 cache": [], "cache, bf16": [], "cache, FP8": []}
for length in lengths:
    gen = torch.Generator().manual_seed(length)
    exact_keys = torch.randn(1, length, 1, lv + rope, generator=gen, dtype=torch.float64)
    pages = -(-length // page)
    table = torch.arange(pages, dtype=torch.int32)[None].to(device)
    lens = torch.tensor([length], dtype=torch.int32, device=device)
    q = torch.randn(qlen, h, lv + rope, generator=gen).to(torch.bfloat16).to(device)
    scale = 2 / math.sqrt(lv + rope)
    padded = torch.zeros(pages * page, 1, lv + rope, dtype=torch.float64)
    padded[:length] = exact_keys[0]
    padded = padded.view(pages, page, 1, lv + rope)
    exact_o, _ = mla_verify(q, padded.to(device), table, lens, None, qlen, lv, scale, page, dtype=torch.float64)
    for name, cache_dtype in (("bf16", torch.bfloat16), ("FP8", torch.float8_e4m3fn)):
        k_scale = torch.tensor(float(padded.abs().max()) / 448, device=device) if name == "FP8" else None
        stored = padded / (1.0 if k_scale is None else float(k_scale))
        cache = stored.to(torch.float32).to(cache_dtype).to(device)
        o = torch.empty(qlen, h, lv, dtype=torch.bfloat16, device=device)
        lse = torch.empty(qlen, h, device=device)
        decode_attention_fwd_verify(q, cache, cache[..., :lv], o, lse, table, lens, None, qlen, None, 1, scale, page,
                                    k_scale=k_scale)  # fmt: skip
        ref_o, _ = mla_verify(q, cache, table, lens, None, qlen, lv, scale, page, k_scale=k_scale, dtype=torch.float64)
        errors[f"kernel, {name} cache"].append(float((o.double() - ref_o).abs().max()))
        errors[f"cache, {name}"].append(float((o.double() - exact_o).abs().max()))

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, errs in errors.items():
    ax.semilogy(lengths, errs, "o-", label=name)
ax.set_xlabel("sequence length L")
ax.set_ylabel("max |o - reference|")
ax.legend()
ax.grid(True, which="both", alpha=0.3)
plt.show()
for name, errs in errors.items():
    print(f"{name:20s}", " ".join(f"{e:.1e}" for e in errs))

# %% [markdown]
# The kernel's error stays at bf16 output rounding (a few 1e-3) at every length: scores come from
# exact 16-bit products summed in fp32, and the online softmax rescales without loss. FP8 dequantizes
# exactly to bf16 inside the kernel (the scalar `k_scale` folds into the fp32 scores and output), so
# its kernel error is the same; the FP8 *cache* error is an order of magnitude larger.

# %% [markdown]
# ## 4. Why one K/V load per request tile beats per-row decode
#
# The flattened decode path (`expand_decode_rows` + `decode_attention_fwd`) gives every draft token
# its own row, and a program serves at most 16 heads of one row: each key of a request is fetched
# `qlen * cdiv(H, 16)` times (`sum_t n(b, t)` keys per head group). The verify kernel serves
# `BLOCK_H` (token, head) rows of one request per program, so it fetches each key
# `cdiv(qlen * H, BLOCK_H)` times. Repeats may hit L2, but every fetch is SM load bandwidth and
# issue slots; the unique HBM traffic (each key once) is the same for both. Counted for DeepSeek
# widths (576 bf16 elements per key), per request of `L = 4096` keys in a serving batch of 32
# requests, with the Hopper configs (the batch's row count picks the small or large one):

# %%
key_bytes, L, batch = 576 * 2, 4096, 32


def decode_fetches(q_len: int, num_heads: int) -> int:
    per_row = row_limits(torch.tensor([L]), None, q_len)[0]
    return int(per_row.sum()) * math.ceil(num_heads / 16) * key_bytes


def verify_fetches(q_len: int, num_heads: int) -> int:
    size = "small" if batch * q_len * num_heads <= _VERIFY_SMALL_MAX_ROWS else "large"
    cfg = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS["sm_90"][size]}
    return L * verify_row_blocks(q_len, num_heads, cfg["BLOCK_H"]) * key_bytes


print(f"{'H':>4} {'qlen':>4} {'decode MB':>10} {'verify MB':>10} {'ratio':>6}")
ratios = {}
for num_heads in (16, 128):
    for q_len in (1, 2, 4, 8):
        d, v = decode_fetches(q_len, num_heads), verify_fetches(q_len, num_heads)
        ratios[(num_heads, q_len)] = d / v
        print(f"{num_heads:4d} {q_len:4d} {d / 1e6:10.1f} {v / 1e6:10.1f} {d / v:6.2f}")
print(f"unique HBM bytes per request either way: {L * key_bytes / 1e6:.1f} MB")

fig, ax = plt.subplots(figsize=(6, 3))
for num_heads, marker in ((16, "o"), (128, "s")):
    ax.plot([1, 2, 4, 8], [ratios[(num_heads, ql)] for ql in (1, 2, 4, 8)], marker + "-", label=f"H = {num_heads}")
ax.set_xlabel("qlen (draft tokens)")
ax.set_ylabel("decode / verify K/V bytes fetched")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# With 16 heads a 64-row tile holds up to four whole draft tokens, so up to four rows share each
# fetch that per-row decode repeats; with 128 heads a draft token spans two 64-row tiles where
# decode's 16-head groups span eight, a fourfold saving at every `qlen`. The single-token case
# (`qlen = 1`, few rows) gains nothing: there verify is plain decode. This row reuse, plus one
# block-table row per request instead of `qlen` copies, is the point of a dedicated verify kernel;
# `triton_impl/mla_verify.py` records the H200 sweep behind its configs next to them, and
# `notebooks/results/bench_h200.md` times verify against the flattened per-row decode on an H200
# (1.1-1.8x faster at commit a30c1ca).
