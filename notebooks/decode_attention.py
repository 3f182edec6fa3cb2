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
# # Split-KV decode attention: per-row extents, windows, batch invariance, DCP
#
# `decode_attention_fwd` (vLLM's Triton MLA/GQA decode) gives every query row its own KV extent
# and block-table row. This notebook shows what that buys and costs: multi-token decode served by
# flattening against the dedicated verify kernel (same answer, different traffic), sliding
# windows and how splits follow them, what batch invariance (one split) costs in parallelism, and
# decode context parallelism (DCP) with two simulated ranks. Ops come from
# `golden/decode_attention.py` and `triton_impl/decode_attention.py` (papers.md#decode-attention).

# %%
import math

import matplotlib.pyplot as plt
import torch

import triton_impl  # noqa: F401  (selects the Triton interpreter on a CPU-only machine)
from golden.decode_attention import dcp_local_positions, decode_attention, split_bounds, window_start
from triton_impl.decode_attention import (
    DECODE_CONFIGS,
    _compute_num_kv_splits,
    decode_attention_fwd,
    expand_decode_rows,
)
from triton_impl.lse_merge import merge_splits
from triton_impl.mla_verify import decode_attention_fwd_verify

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)


def paged(tokens: list[torch.Tensor], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay each request's dense keys ``[n, HKV, D]`` out in shuffled pages; return (cache, table)."""
    pages = [math.ceil(t.shape[0] / page_size) for t in tokens]
    order = torch.randperm(sum(pages) + 1, generator=gen)
    cache = torch.zeros(sum(pages) + 1, page_size, *tokens[0].shape[1:], dtype=tokens[0].dtype)
    table = torch.zeros(len(tokens), max(pages) + 1, dtype=torch.int32)
    used = 0
    for b, t in enumerate(tokens):
        ids = order[used : used + pages[b]]
        used += pages[b]
        table[b, : len(ids)] = ids.to(torch.int32)
        j = torch.arange(t.shape[0])
        cache[ids[j // page_size], j % page_size] = t
    return cache.to(device), table.to(device)


def run_decode(q, k, v, table, lens, splits, sm_scale, page_size, out_dtype=None, **kw):
    """The kernel with fresh outputs (``o`` in ``out_dtype``, default q's); returns (o, lse)."""
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=out_dtype or q.dtype, device=device)
    lse = torch.empty(q.shape[0], q.shape[1], device=device)
    logits = torch.empty(q.shape[0], q.shape[1], splits, v.shape[-1] + 1, device=device) if splits > 1 else None
    decode_attention_fwd(q, k, v, o, lse, table, lens, logits, splits, sm_scale, page_size, **kw)
    return o, lse


# %% [markdown]
# ## 1. Multi-token decode vs verify: same answer, different traffic
#
# A speculative-decoding step scores `Q` draft tokens per request. `TritonMLAImpl.forward_mqa`
# serves it with the decode kernel by **flattening**: request `b` becomes `Q` rows that share its
# block-table row, row `t` with extent `L_b - (Q-1) + t` (the prefix plus draft tokens `0..t`).
# The verify kernel (`triton_impl.mla_verify.decode_attention_fwd_verify`) takes the per-request
# table instead and lets one K tile serve all `Q` rows. Both compute the same attention.

# %%
Q, heads, lv, rope = 4, 16, 64, 16  # a small MLA: one latent head, Lk = 64 + 16
lens = torch.tensor([3 + Q, 40 + Q, 0], dtype=torch.int32)  # the last request is CUDA-graph padding
keys = [torch.randn(int(n), 1, lv + rope, generator=gen).to(torch.bfloat16) for n in lens]
cache, table = paged(keys, page_size=16)
q = (torch.randn(len(lens) * Q, heads, lv + rope, generator=gen) * 0.5).to(torch.bfloat16).to(device)
sm_scale = (lv + rope) ** -0.5

rows_table, rows_lens = expand_decode_rows(table, lens.to(device), Q, causal=True)
print("flattened extents per row:", rows_lens.tolist())
o_flat, lse_flat = run_decode(q, cache, cache[..., :lv], rows_table, rows_lens, 2, sm_scale, 16, is_mla=True)

o_verify = torch.empty_like(o_flat)
lse_verify = torch.empty_like(lse_flat)
logits = torch.empty(q.shape[0], heads, 2, lv + 1, device=device)
decode_attention_fwd_verify(
    q, cache, cache[..., :lv], o_verify, lse_verify, table, lens.to(device), None, Q, logits, 2, sm_scale, 16
)
finite = torch.isfinite(lse_flat)
print(f"max |o_flat - o_verify| = {(o_flat.float() - o_verify.float()).abs().max():.2e} (bf16 outputs)")
print(f"max |lse_flat - lse_verify| = {(lse_flat - lse_verify)[finite].abs().max():.2e}")
print("empty rows agree:", torch.equal(torch.isneginf(lse_flat), torch.isneginf(lse_verify)))

# %% [markdown]
# The traffic differs. The flattened rows each stream their own extent from the cache; the verify
# kernel streams a request's keys once for all its `Q` rows (when `Q * H` fits one row block).
# Cache bytes read for a serving-sized step, DeepSeek's 576-wide bf16 latent cache:

# %%
bytes_per_key = 576 * 2
for batch, context, qlen in [(32, 4096, 2), (32, 4096, 4), (8, 32768, 8)]:
    flat = batch * sum(context + 1 + t for t in range(qlen)) * bytes_per_key
    verify = batch * (context + qlen) * bytes_per_key
    print(
        f"B={batch:3d} L={context:6d} Q={qlen}: flattened {flat / 2**20:8.1f} MiB, "
        f"verify {verify / 2**20:7.1f} MiB, ratio {flat / verify:.2f}"
    )

# %% [markdown]
# The ratio approaches `Q`: a memory-bound decode step over the flattened rows reads the cache
# `Q` times. (In practice the repeats partly hit L2; the verify kernel removes them by design.)
#
# ## 2. Sliding windows and window-aware splits
#
# With a window of `W` keys, a row with extent `n` sees `[max(0, n - W), n)`, its own key
# included. The split-KV partition must follow the window: the kernel cuts `[lo, n)` into `S`
# chunks, so a windowed row keeps all `S` splits busy however long its prefix is. Below: the
# flattened causal rows of one request (context 20, `Q = 4`) with `W = 8`, each visible key
# colored by the split (of `S = 3`) that computes it.

# %%
W, S, qlen, context = 8, 3, 4, 20
_, row_lens = expand_decode_rows(torch.zeros(1, 4, dtype=torch.int32), torch.tensor([context + qlen]), qlen, True)
start, end = split_bounds(row_lens, S, W)
grid = torch.full((qlen, context + qlen), float("nan"))
for t in range(qlen):
    for s in range(S):
        grid[t, start[t, s] : end[t, s]] = s
plt.figure(figsize=(8, 1.8))
plt.imshow(grid, cmap="viridis", aspect="auto", interpolation="nearest")
plt.xlabel("key position j")
plt.ylabel("draft token t")
plt.title(f"visible keys per flattened row (W={W}), colored by split (S={S})")
plt.colorbar(ticks=range(S))
plt.show()
print("window starts:", window_start(row_lens, W).tolist(), "extents:", row_lens.tolist())

# %% [markdown]
# vLLM's split count clamps the length to the window before choosing `S`
# (`min(next_pow2(max(1, L // 512)), 2 * sm_count)`; 132 SMs on an H200):

# %%
for max_len in (1000, 8192, 131072):
    print(
        f"max_seq_len {max_len:6d}: S = {_compute_num_kv_splits(max_len, 132):3d} without a window, "
        f"{_compute_num_kv_splits(max_len, 132, sliding_window=1024)} with W = 1024"
    )

# %% [markdown]
# A window off by one key is a real bug (sglang once stored `W - 1` as a radius and attended
# `W + 1` keys). The kernel with `W` against the golden model with `W - 1`, `W` and `W + 1`:

# %%
lens2 = torch.tensor([30, 12], dtype=torch.int32)
kv = [torch.randn(int(n), 2, 32 + 32, generator=gen) for n in lens2]  # GQA: K and V side by side
cache2, table2 = paged(kv, page_size=4)
q2 = (torch.randn(2, 8, 32, generator=gen) * 0.5).to(device)
k2, v2 = cache2[..., :32], cache2[..., 32:]
o_w, lse_w = run_decode(q2, k2, v2, table2, lens2.to(device), 3, 32**-0.5, 4, sliding_window=W)
for golden_w in (W - 1, W, W + 1):
    ref_o, _ = decode_attention(q2, k2, v2, table2, lens2.to(device), 32**-0.5, 4, sliding_window=golden_w)
    print(f"golden W={golden_w:2d}: max |o_kernel - o_golden| = {(o_w - ref_o).abs().max():.1e}")

# %% [markdown]
# ## 3. What batch invariance costs
#
# With one split the kernel reduces each row's keys in a fixed order that depends on nothing but
# the row (the launch config never depends on the batch): a row's bits are the same alone or in
# any batch. With `S > 1` the result changes in the last bits when `S` does (and vLLM picks `S`
# from the batch's longest row, so a row's neighbours change its bits).

# %%
o_all, _ = run_decode(q2, k2, v2, table2, lens2.to(device), 1, 32**-0.5, 4)
o_alone, _ = run_decode(q2[:1], k2, v2, table2[:1], lens2[:1].to(device), 1, 32**-0.5, 4)
print("S=1, row 0 alone vs in the batch, bit-equal:", torch.equal(o_alone, o_all[:1]))
o_s4, _ = run_decode(q2, k2, v2, table2, lens2.to(device), 4, 32**-0.5, 4)
print(
    f"S=1 vs S=4: bit-equal {torch.equal(o_all, o_s4)}, max difference {(o_all - o_s4).abs().max():.1e} (fp32 rounding)"
)

# %% [markdown]
# The cost is parallelism. A stage-1 program owns one split of one row for `BLOCK_H` heads, so
# the grid has `R * ceil(H / BLOCK_H) * S` programs. For DeepSeek MLA (`H = 16` heads per GPU at
# TP 8, one program per row and split) on an H200's 132 SMs:

# %%
block_h = DECODE_CONFIGS["sm90"]["mla"]["BLOCK_H"]
print(f"{'rows':>5} {'max L':>7} {'S':>4} {'programs S=1':>13} {'programs S':>11} {'scratch MiB':>12}")
for rows in (1, 8, 64):
    for max_len in (4096, 32768):
        splits = _compute_num_kv_splits(max_len, 132)
        programs = rows * math.ceil(16 / block_h)
        scratch = rows * 16 * splits * (512 + 1) * 4 / 2**20
        print(f"{rows:5d} {max_len:7d} {splits:4d} {programs:13d} {programs * splits:11d} {scratch:12.2f}")

# %% [markdown]
# A single request at 32k keys runs 1 program on 132 SMs with one split, 64 with vLLM's split
# count: batch invariance leaves most of the GPU idle for small batches and long contexts. At 64
# rows the one-split grid already has 64 programs; splitting buys less and costs fp32 scratch.
#
# ## 4. Decode context parallelism with two simulated ranks
#
# Under DCP each rank stores part of every request's keys: striped (key `j` on rank `j % N`, or
# groups of `I` keys with an interleave) or sliced (contiguous chunks). Each rank attends to its
# own keys and returns `(o_k, lse_k)`; the exact merge weighs rank `k` by
# `exp(lse_k - lse)`, its share of the softmax mass. `decode_attention_dcp` does this over
# `torch.distributed` (one all-gather of the packed states, then `merge_splits`); here two ranks
# are simulated in one process with the same two calls.

# %%
lens3 = [50, 1]
kv3 = [torch.randn(n, 1, 48, generator=gen).to(torch.bfloat16) for n in lens3]  # MLA: Lv 32, rope 16
q3 = (torch.randn(2, 4, 48, generator=gen) * 0.5).to(torch.bfloat16).to(device)
cache3, table3 = paged(kv3, 8)
full_o, full_lse = run_decode(q3, cache3, cache3[..., :32], table3, torch.tensor(lens3, device=device), 1, 0.2, 8,
                              is_mla=True)  # fmt: skip

for layout in ("striped", "sliced"):
    states = []
    for rank in range(2):
        local = [t[dcp_local_positions(t.shape[0], 2, rank, layout)] for t in kv3]
        local_cache, local_table = paged(local, 8)
        local_lens = torch.tensor([t.shape[0] for t in local], device=device)
        o_k, lse_k = run_decode(q3, local_cache, local_cache[..., :32], local_table, local_lens, 1, 0.2, 8,
                                out_dtype=torch.float32, is_mla=True)  # fmt: skip
        states.append(torch.cat([o_k, lse_k[..., None]], dim=-1))  # fp32, as decode_attention_dcp packs them
    gathered = torch.stack(states, dim=2)  # [R, H, ranks, Lv + 1]: what the all-gather delivers
    merged_o = torch.empty_like(full_o)
    merged_lse = torch.empty_like(full_lse)
    merge_splits(gathered, merged_o, merged_lse)
    share = torch.exp(gathered[..., 32] - merged_lse[..., None])[:, 0]
    naive = gathered[..., :32].mean(dim=2)
    print(f"{layout}: request 0's keys on rank 0: {dcp_local_positions(50, 2, 0, layout).tolist()}")
    print(
        f"  rank shares of the softmax mass, head 0, per request: {[[round(x, 3) for x in r] for r in share.tolist()]}"
    )
    print(
        f"  merged vs single process: max |o| diff {(merged_o.float() - full_o.float()).abs().max():.1e}, "
        f"max |lse| diff {(merged_lse - full_lse).abs().max():.1e}; "
        f"plain average of the ranks' outputs: {(naive - full_o.float()).abs().max():.1e}"
    )

# %% [markdown]
# Each rank's share is the fraction of the row's softmax mass among its keys; the shares sum to 1.
# Request 1 has a single key, so rank 1 holds none of it and contributes the neutral state
# `(0, -inf)` with share 0 in both layouts. The plain average of the ranks' outputs ignores the
# shares and is off by the printed amount; the LSE-weighted merge matches the single-process
# kernel to the last bits of its bf16 output.
# `tests/test_decode_attention_dcp.py` runs the real thing over gloo with 2 and 3 processes, and
# `tests/dcp_nccl_check.py` over NCCL on GPUs.

# %% [markdown]
# ## 5. Head tiles on Hopper: why 64 heads, and why the latent comes in two halves
#
# For MLA, every head reads the same 576-element latent per key. A program that owns `BLOCK_H`
# heads loads each K tile once for all of them, so a request's keys are read `cdiv(H, BLOCK_H)`
# times (from L2 after the first). Hopper's warpgroup MMA (wgmma) needs 64 rows per warpgroup, so
# 16-head tiles can only use the older warp-level MMA. A 64-head tile, however, keeps a
# `64 x 512` fp32 output accumulator: 128 KiB, or 128 registers per thread over 8 warps, next to
# the queries and the softmax state. `SPLIT_LATENT` handles the latent as two 256-wide halves
# with two accumulators, as the verify kernel's `QSPLIT` does: each product then fits one wgmma
# (N <= 256), and in the verify sweep 64-row tiles without the split ran out of shared memory at
# 64-key tiles. The count below is exact; the timings are the H200 sweep's
# (`notebooks/results/sweep_decode_h200.md`, B=32, L=32K, CUDA graphs).

# %%
for heads in (16, 128):
    for block_h in (16, 64):
        tile = min(block_h, heads)
        passes = -(-heads // tile)
        acc_regs = tile * 512 // (8 * 32)  # fp32 accumulator words per thread, 8 warps of 32
        mma = "wgmma" if tile >= 64 else "mma.sync"
        print(f"H={heads:3d} BLOCK_H={block_h}: tile {tile:2d} heads, K/V tile loaded {passes} times per key, "
              f"accumulator {acc_regs} registers/thread (8 warps), MMA {mma}")  # fmt: skip

# %% [markdown]
# On the H200 sweep, H=128 went from 3345 us with 16-head tiles to 2163 us with 64-head tiles
# and halves, and to 1657 us with 64-key tiles: 25% of its compute roofline. H=16 (one 16-head
# tile either way) went from 470 us to 385 us with 64-key tiles and 8 warps: 74% of its memory
# roofline. At H=128 what is left is the overlap of softmax and MMA that FlashMLA gets from warp
# specialization (`notebooks/results/perf_log.md`).
