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
# windows and how splits follow them, one stage-1 program stepped through in plain PyTorch, what
# batch invariance (one split) costs in parallelism, decode context parallelism (DCP) with two
# simulated ranks, and the Hopper head tiles. Ops come from `golden/decode_attention.py` and
# `triton_impl/decode_attention.py` (papers.md#decode-attention). Every claim below is checked by
# an `assert` in the cell that shows it.

# %%
import json
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import triton_impl  # selects the Triton interpreter on a CPU-only machine; locates the repository
from golden.decode_attention import (
    dcp_local_positions,
    decode_attention,
    decode_attention_splits,
    split_bounds,
    window_start,
)
from triton_impl.decode_attention import (
    DECODE_CONFIGS,
    _compute_num_kv_splits,
    decode_attention_fwd,
    expand_decode_rows,
    stage1_splits,
    tile_config,
)
from triton_impl.interpreter import INTERPRETING
from triton_impl.lse_merge import merge_splits, split_outputs
from triton_impl.mla_verify import (
    decode_attention_fwd_verify,
    select_verify_config,
    verify_row_blocks,
)
from triton_impl.tolerances import compare, tolerance

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)
RESULTS = Path(triton_impl.__file__).resolve().parent.parent / "notebooks" / "results"  # measured on an H200


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


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()  # triton.next_power_of_2 (importing triton here would precede triton_impl)


def decode_head_tile(config: dict[str, int], group: int) -> int:
    """Heads per stage-1 program: ``BLOCK_H`` clamped to the group, as ``decode_attention_fwd`` does."""
    return tile_config(config, group)[0]


def verify_config_sm90(batch: int, qlen: int, heads: int) -> dict:
    """The verify kernel's Hopper config for a batch (``select_verify_config`` on an sm_90 GPU)."""
    return select_verify_config(batch, qlen, heads, arch="sm90")


# %% [markdown]
# ## 1. Multi-token decode vs verify: same answer, different traffic
#
# A speculative-decoding step scores `Q` draft tokens per request. `TritonMLAImpl.forward_mqa`
# serves it with the decode kernel by **flattening**: request `b` becomes `Q` rows that share its
# block-table row, row `t` with extent `L_b - (Q-1) + t` (the prefix plus draft tokens `0..t`).
# The verify kernel (`triton_impl.mla_verify.decode_attention_fwd_verify`) takes the per-request
# table instead and lets one K tile serve several of the `Q` rows. Both compute the same
# attention: each is checked against the float64 golden model with the package's tolerance table
# (`tests/TOLERANCES.md`), and their empty rows (the CUDA-graph padding request) agree.

# %%
Q, heads, lv, rope = 4, 16, 64, 16  # a small MLA: one latent head, Lk = 64 + 16
lens = torch.tensor([3 + Q, 40 + Q, 0], dtype=torch.int32)  # the last request is CUDA-graph padding
keys = [torch.randn(int(n), 1, lv + rope, generator=gen).to(torch.bfloat16) for n in lens]
cache, table = paged(keys, page_size=16)
q = (torch.randn(len(lens) * Q, heads, lv + rope, generator=gen) * 0.5).to(torch.bfloat16).to(device)
sm_scale = (lv + rope) ** -0.5

rows_table, rows_lens = expand_decode_rows(table, lens.to(device), Q, causal=True)
print("flattened extents per row:", rows_lens.tolist())
o_flat, lse_flat = run_decode(q, cache, cache[..., :lv], rows_table, rows_lens, 1, sm_scale, 16, is_mla=True)

o_verify = torch.empty_like(o_flat)
lse_verify = torch.empty_like(lse_flat)
decode_attention_fwd_verify(q, cache, cache[..., :lv], o_verify, lse_verify, table, lens.to(device), None, Q, None, 1,
                            sm_scale, 16)  # fmt: skip
ref_o, ref_lse = decode_attention(q, cache, cache[..., :lv], rows_table, rows_lens, sm_scale, 16, is_mla=True,
                                  dtype=torch.float64)  # fmt: skip
for name, o_k, lse_k in (("flattened decode", o_flat, lse_flat), ("verify", o_verify, lse_verify)):
    o_cmp = compare(o_k, ref_o, tolerance("decode_attention", "o", q.dtype))
    lse_cmp = compare(lse_k, ref_lse, tolerance("decode_attention", "lse", lse_k.dtype))
    print(f"{name:16s} vs golden: max |o| error {o_cmp.max_abs:.1e}, max |lse| error {lse_cmp.max_abs:.1e}")
    assert o_cmp.ok and lse_cmp.ok
finite = torch.isfinite(lse_flat)
print(f"max |o_flat - o_verify| = {(o_flat.float() - o_verify.float()).abs().max():.2e} (bf16 outputs)")
print(f"max |lse_flat - lse_verify| = {(lse_flat - lse_verify)[finite].abs().max():.2e}")
empty_agree = torch.equal(torch.isneginf(lse_flat), torch.isneginf(lse_verify))
print("empty rows agree:", empty_agree)
assert empty_agree and bool(torch.isneginf(lse_flat[-Q:]).all())

# %% [markdown]
# The traffic differs. Each flattened row streams its own extent from the cache, once per decode
# head tile; the verify kernel streams a request's keys once per row tile of `BLOCK_H`
# (token, head) rows, each tile up to the largest causal limit among its rows, so the draft tokens
# that share a tile share every fetch. Counted exactly below for DeepSeek's 576-wide bf16 latent,
# 16 heads per GPU (its 128 at tensor parallelism 8), with both kernels' Hopper launch configs
# (`DECODE_CONFIGS["sm90"]["mla"]`; verify: `select_verify_config(..., arch="sm90")`, the 64-row tile
# at every batch):

# %%
bytes_per_key, heads_per_gpu = 576 * 2, 16
decode_cfg = DECODE_CONFIGS["sm90"]["mla"]
decode_passes = math.ceil(heads_per_gpu / decode_head_tile(decode_cfg, heads_per_gpu))
print(f"decode: {decode_head_tile(decode_cfg, heads_per_gpu)}-head tiles, each key fetched {decode_passes}x per row")
for batch, context, qlen in [(32, 4096, 2), (32, 4096, 4), (8, 32768, 8)]:
    extents = torch.tensor([context + 1 + t for t in range(qlen)])  # flattened row t: prefix + drafts 0..t
    flat = batch * int(extents.sum()) * decode_passes * bytes_per_key
    block_h = verify_config_sm90(batch, qlen, heads_per_gpu)["BLOCK_H"]
    tiles = extents.repeat_interleave(heads_per_gpu).split(block_h)  # verify rows i = t * H + h, BLOCK_H per tile
    assert len(tiles) == verify_row_blocks(qlen, heads_per_gpu, block_h)
    verify = batch * sum(int(tile.max()) for tile in tiles) * bytes_per_key
    tokens_per_tile = min(qlen, block_h // heads_per_gpu)
    print(
        f"B={batch:3d} L={context:6d} Q={qlen}: flattened {flat / 2**20:8.1f} MiB, verify {verify / 2**20:7.1f} MiB "
        f"(BLOCK_H {block_h}: {tokens_per_tile} draft tokens per tile), ratio {flat / verify:.2f}"
    )
    assert abs(flat / verify / tokens_per_tile - 1) < 1e-2

# %% [markdown]
# The ratio is the number of draft tokens that share a verify tile: all `Q` while `Q * H` rows
# fit in one tile, `BLOCK_H / H` beyond (the last case). The flattened rows' repeated fetches may
# partly hit L2; the verify kernel does not issue those within a tile. With 128 heads a Hopper
# verify tile holds less than one draft token and the two kernels fetch the same:
# `notebooks/mla_verify.py` counts it.
#
# ## 2. Sliding windows and window-aware splits
#
# With a window of `W` keys, a row with extent `n` sees `[max(0, n - W), n)`, its own key
# included. The split-KV partition must follow the window: the kernel cuts `[lo, n)` into `S`
# chunks, so a windowed row keeps all `S` splits busy however long its prefix is. Below: the
# flattened causal rows of one request (context 20, `Q = 4`) with `W = 8`, each visible key
# colored by the split (of `S = 3`) that computes it; every split of every row holds keys.

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
assert bool((end > start).all()) and torch.equal(start[:, 0], window_start(row_lens, W))

# %% [markdown]
# vLLM's split count clamps the length to the window before choosing `S`
# (`min(next_pow2(max(1, L // 512)), 2 * sm_count)`), here for an H200's SM count:

# %%
H200_SMS = 132
for max_len in (1000, 8192, 131072):
    s_plain, s_window = _compute_num_kv_splits(max_len, H200_SMS), _compute_num_kv_splits(max_len, H200_SMS, 1024)
    print(f"max_seq_len {max_len:6d}: S = {s_plain:3d} without a window, {s_window} with W = 1024")
    assert s_window == _compute_num_kv_splits(min(max_len, 1024), H200_SMS)
    assert s_plain == min(next_power_of_2(max(1, max_len // 512)), 2 * H200_SMS)

# %% [markdown]
# A window off by one key is a real bug (sglang once stored `W - 1` as a radius and attended
# `W + 1` keys). The kernel with `W` against the golden model with `W - 1`, `W` and `W + 1`: only
# `W` is within the fp32 tolerance.

# %%
lens2 = torch.tensor([30, 12], dtype=torch.int32)
kv = [torch.randn(int(n), 2, 32 + 32, generator=gen) for n in lens2]  # GQA: K and V side by side
cache2, table2 = paged(kv, page_size=4)
q2 = (torch.randn(2, 8, 32, generator=gen) * 0.5).to(device)
k2, v2 = cache2[..., :32], cache2[..., 32:]
o_w, lse_w = run_decode(q2, k2, v2, table2, lens2.to(device), 3, 32**-0.5, 4, sliding_window=W)
for golden_w in (W - 1, W, W + 1):
    ref_o, _ = decode_attention(q2, k2, v2, table2, lens2.to(device), 32**-0.5, 4, sliding_window=golden_w,
                                dtype=torch.float64)  # fmt: skip
    result = compare(o_w, ref_o, tolerance("decode_attention", "o", q2.dtype))
    print(f"golden W={golden_w:2d}: max |o_kernel - o_golden| = {result.max_abs:.1e}, within tolerance: {result.ok}")
    assert result.ok == (golden_w == W)

# %% [markdown]
# ## 3. One stage-1 program, step by step
#
# Stage 1 (`_decode_stage1_kernel`) runs on a grid `(R, HKV * HEAD_BLOCKS, S)`: program
# `(row, pid_h, split)` computes the attention state of one split of one row for `BLOCK_H` query
# heads that share a KV head, and writes it to `attn_logits[row, heads, split]` (`Lv` outputs,
# then the LSE). Below, the kernel's steps in plain PyTorch, with its names, on a tiny MLA cache
# (`Lv = 64`, rope 16, pages of 16 keys in shuffled order): two rows of 150 keys and 1 key,
# 16 heads, `S = 2`. The launch config is the `"default"` entry of `DECODE_CONFIGS` (what a GPU
# without a tuned entry gets), passed explicitly so that a GPU run walks the same tiles. First
# the real kernel, with its split scratch filled with NaN: afterwards no output or LSE of a split is NaN, because
# every slot is written, an empty split too. For this bf16 output a split's outputs are stored in bf16, two to a fp32
# slot of the record's first `Lv / 2` (the LSE stays fp32 in slot `Lv`; `lse_merge.bf16_partials`), and
# `split_outputs` reads them back.

# %%
cfg = DECODE_CONFIGS["default"]["mla"]
BLOCK_N, BLOCK_H = cfg["BLOCK_N"], cfg["BLOCK_H"]
LV, LK, PAGE_SIZE, num_kv_splits = 64, 80, 16, 2
D_FIRST = LV  # MLA: the first column piece of a key is the latent (also its value), the rest is rope
b_seq_len = torch.tensor([150, 1], dtype=torch.int32)
k_buffer, req_to_token = paged([torch.randn(int(n), 1, LK, generator=gen).to(torch.bfloat16) for n in b_seq_len],
                               PAGE_SIZE)  # fmt: skip
q_w = (torch.randn(len(b_seq_len), 16, LK, generator=gen) * 0.5).to(torch.bfloat16).to(device)
sm_scale_w = LK**-0.5

attn_logits = torch.full((len(b_seq_len), 16, num_kv_splits, LV + 1), float("nan"), device=device)
o_w = torch.empty(len(b_seq_len), 16, LV, dtype=torch.bfloat16, device=device)
lse_out = torch.empty(len(b_seq_len), 16, device=device)
decode_attention_fwd(q_w, k_buffer, k_buffer[..., :LV], o_w, lse_out, req_to_token, b_seq_len.to(device),
                     attn_logits, num_kv_splits, sm_scale_w, PAGE_SIZE, is_mla=True, config=cfg)  # fmt: skip
print("config:", cfg)
print("block table (page ids):", req_to_token.tolist())
split_o, split_lse = split_outputs(attn_logits, o_w.dtype), attn_logits[..., LV]
print("attn_logits:", tuple(attn_logits.shape), "= [R, H, S, Lv + 1]; split outputs", tuple(split_o.shape),
      "; NaN left:", bool(split_o.isnan().any() or split_lse.isnan().any()))  # fmt: skip
assert not split_o.isnan().any() and not split_lse.isnan().any()

# %% [markdown]
# The walk. Each step is a line or two of the kernel:
#
# 1. **Which work.** `pid_h` picks the KV head and the block of `BLOCK_H` heads in its group.
# 2. **Which keys.** The row sees `[lo, n)` (`lo = max(n - window, 0)`; no window here, so 0),
#    cut into `S` chunks of `chunk = cdiv(n - lo, S)` keys; this split is `[start, end)`.
# 3. **Queries once.** The `[BLOCK_H, Lk]` query tile is loaded once, as two pieces: `q0`, the
#    first `D_FIRST` columns (the latent), and `q_pe`, the rope columns.
# 4. **Base 2.** `exp(x) = exp2(x * log2 e)`, so the kernel folds `log2 e` into the score scale
#    once (`qk_scale`) and calls `exp2` (one hardware instruction) everywhere.
# 5. **Key tiles.** For each tile of `BLOCK_N` positions `toks`, the block table gives each key's
#    `page` (`toks // PAGE_SIZE`) and `slot` (`toks % PAGE_SIZE`); keys at or past `end` are
#    masked: their page is never read, their K is 0, their score `-inf`. `tl.dot` takes operands
#    in `DOT_DTYPE` (fp32 under the interpreter, bf16 compiled) and sums in fp32. The kernel also
#    checks each page id against the cache size and the row's extent against the table width (a
#    row that fails becomes NaN, and no such address is read); with a valid table that never
#    fires, and the walk leaves it out.
# 6. **Online softmax.** `m_i` is the running max of the scaled scores, `l_i` the running sum of
#    `exp2(score - m_i)`, `acc0` the running unnormalized output. A tile that raises the max
#    rescales the old sum and output by `alpha = exp2(m_i - m_new)` (`m_i` starts at `-inf`, so
#    the first tile's `alpha` is 0). For MLA the value tile is the latent part of the key tile
#    already loaded (`v = k0`).
# 7. **Finish.** `out = acc0 / l_i` and `lse = (m_i + log2 l_i) * ln 2`: stage 2 expects
#    natural-log LSEs. An empty split (`end <= start`) stores the neutral state `(0, -inf)`.
#
# The Hopper entry (`SPLIT_LATENT`) keeps the latent as two halves with two accumulators (`q0`/`q1`,
# `k0`/`k1`, `acc0`/`acc1`; the verify kernel uses the same names); the arithmetic per column is
# the same.

# %%
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
DOT_DTYPE = torch.float32 if INTERPRETING else q_w.dtype  # triton_impl.interpreter.dot_dtype(q.dtype)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """tl.dot: operands in DOT_DTYPE, products summed in fp32."""
    return a.to(DOT_DTYPE).float() @ b.to(DOT_DTYPE).float()


def stage1_program(row: int, pid_h: int, split: int, show: bool = False):
    q, table, cache = q_w.cpu(), req_to_token.cpu(), k_buffer.cpu()
    GROUP = q.shape[1] // cache.shape[-2]  # query heads per KV head
    HEAD_BLOCKS = math.ceil(GROUP / BLOCK_H)
    # 1. which heads
    kv_head = pid_h // HEAD_BLOCKS
    in_group = (pid_h % HEAD_BLOCKS) * BLOCK_H + torch.arange(BLOCK_H)
    heads = kv_head * GROUP + in_group
    assert bool((in_group < GROUP).all())  # head_ok: 16 heads fill the tile here
    # 2. which keys
    n = max(int(b_seq_len[row]), 0)
    lo = 0  # max(n - window, 0) without a window
    chunk = math.ceil((n - lo) / num_kv_splits)
    start = min(lo + split * chunk, n)
    end = min(start + chunk, n)
    # 3. the query tile, once
    q0, q_pe = q[row, heads, :D_FIRST], q[row, heads, D_FIRST:]
    # 4. softmax in base 2
    qk_scale = sm_scale_w * LOG2E
    m_i = torch.full((BLOCK_H,), float("-inf"))
    l_i = torch.zeros(BLOCK_H)
    acc0 = torch.zeros(BLOCK_H, LV)
    if show:
        print(f"program (row={row}, pid_h={pid_h}, split={split}): heads {heads[0]}..{heads[-1]}, n={n}, "
              f"chunk={chunk}, keys [{start}, {end}); q0 {tuple(q0.shape)}, q_pe {tuple(q_pe.shape)}")  # fmt: skip
    # 5./6. key tiles through the block table, online softmax
    for tile in range(start, end, BLOCK_N):
        toks = tile + torch.arange(BLOCK_N)
        tok_ok = toks < end
        page = torch.zeros(BLOCK_N, dtype=torch.int64)  # a masked load: other=0
        page[tok_ok] = table[row, toks[tok_ok] // PAGE_SIZE].long()
        slot = toks % PAGE_SIZE
        k_rows = cache[page, slot, kv_head] * tok_ok[:, None]  # [BLOCK_N, Lk], masked keys are 0
        k0, k_pe = k_rows[:, :D_FIRST], k_rows[:, D_FIRST:]
        qk = dot(q0, k0.T) + dot(q_pe, k_pe.T)  # [BLOCK_H, BLOCK_N]
        qk = qk * qk_scale
        qk = torch.where(tok_ok[None, :], qk, float("-inf"))
        m_new = torch.maximum(m_i, qk.max(dim=1).values)
        alpha = torch.exp2(m_i - m_new)
        p = torch.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + p.sum(dim=1)
        v = k0  # MLA: the latent tile is V
        acc0 = acc0 * alpha[:, None] + dot(p, v)
        m_i = m_new
        if show:
            print(f"  tile {tile:3d}: {int(tok_ok.sum()):2d} keys on pages {sorted(set(page[tok_ok].tolist()))}, "
                  f"k0 {tuple(k0.shape)}, qk {tuple(qk.shape)}; head 0: alpha {alpha[0]:.3f}, "
                  f"m_i {m_i[0]:.3f}, l_i {l_i[0]:.3f}")  # fmt: skip
    # 7. normalize; natural-log LSE; an empty split is (0, -inf)
    empty = end <= start
    row_scale = torch.zeros(BLOCK_H) if empty else 1.0 / l_i
    lse = torch.full((BLOCK_H,), float("-inf")) if empty else (m_i + torch.log2(l_i)) * LN2
    out = acc0 * row_scale[:, None]
    if show:
        print(f"  -> out {tuple(out.shape)}, head 0: lse {lse[0]:.4f}, out[0, :3] {out[0, :3].numpy().round(4)}")
    return heads, out, lse


_ = stage1_program(row=0, pid_h=0, split=1, show=True)
_ = stage1_program(row=1, pid_h=0, split=1, show=True)

# %% [markdown]
# The walk against the kernel's `attn_logits` and against the float64 golden stage 1
# (`decode_attention_splits`), for every program of the grid. Under the interpreter the walk
# does the kernel's fp32 operations in another summation order, so it matches to fp32 rounding, and the outputs
# to the one bf16 rounding of their store (at most `2^-9` relative);
# compiled, `exp2` and the bf16 rounding of `p` may differ in the last bit, so there it is held to
# the package's tolerance. The empty split is `(0, -inf)` in all three, bit for bit.

# %%
golden_o, golden_lse = decode_attention_splits(q_w, k_buffer, k_buffer[..., :LV], req_to_token, b_seq_len.to(device),
                                               num_kv_splits, sm_scale_w, PAGE_SIZE, is_mla=True,
                                               dtype=torch.float64)  # fmt: skip
kernel_out, kernel_lse = split_o.cpu(), split_lse.cpu()
worst, worst_golden = 0.0, 0.0
for row in range(len(b_seq_len)):
    for split in range(num_kv_splits):
        heads, out, lse = stage1_program(row, 0, split)
        k_out, k_lse = kernel_out[row, heads, split], kernel_lse[row, heads, split]
        if torch.isneginf(lse).all():  # an empty split
            print(f"row {row} split {split}: empty; kernel slot (0, -inf):", bool((k_out == 0).all() and
                  torch.isneginf(k_lse).all()))  # fmt: skip
            assert torch.equal(out, k_out) and torch.equal(lse, k_lse)
            assert torch.equal(golden_o[row, heads, split].float().cpu(), out)
            assert torch.equal(golden_lse[row, heads, split].float().cpu(), lse)
            continue
        worst = max(worst, float((out - k_out).abs().max()), float((lse - k_lse).abs().max()))
        if INTERPRETING:
            assert torch.allclose(out, k_out, rtol=2**-8, atol=1e-6)  # fp32 order, then the store's bf16 rounding
            assert torch.allclose(lse, k_lse, rtol=1e-6, atol=1e-6)
        assert compare(k_out, out.double(), tolerance("decode_attention", "o", q_w.dtype)).ok
        assert compare(out, golden_o[row, heads, split].cpu(), tolerance("decode_attention", "o", q_w.dtype)).ok
        assert compare(lse, golden_lse[row, heads, split].cpu(), tolerance("decode_attention", "lse", "float32")).ok
        worst_golden = max(worst_golden, float((out - golden_o[row, heads, split].cpu()).abs().max()))
print(f"walk vs float64 golden, every non-empty slot: max |o difference| {worst_golden:.1e}")
print(f"walk vs kernel, every non-empty slot: max |difference| {worst:.1e}")

# %% [markdown]
# ## 4. What batch invariance costs
#
# With one split the kernel reduces each row's keys in a fixed order that depends on nothing but
# the row (the launch config never depends on the batch): a row's bits are the same alone or in
# any batch. With `S > 1` the result changes in the last bits when `S` does (and vLLM picks `S`
# from the batch's longest row, so a row's neighbours change its bits); both results stay within
# the fp32 tolerance of each other.

# %%
o_all, _ = run_decode(q2, k2, v2, table2, lens2.to(device), 1, 32**-0.5, 4)
o_alone, _ = run_decode(q2[:1], k2, v2, table2[:1], lens2[:1].to(device), 1, 32**-0.5, 4)
alone_equal = torch.equal(o_alone, o_all[:1])
print("S=1, row 0 alone vs in the batch, bit-equal:", alone_equal)
o_s4, _ = run_decode(q2, k2, v2, table2, lens2.to(device), 4, 32**-0.5, 4)
split_equal = torch.equal(o_all, o_s4)
print(f"S=1 vs S=4: bit-equal {split_equal}, max difference {(o_all - o_s4).abs().max():.1e} (fp32 rounding)")
assert alone_equal and not split_equal
assert compare(o_s4, o_all.double(), tolerance("decode_attention", "o", q2.dtype)).ok

# %% [markdown]
# The cost is parallelism. A stage-1 program owns one split of one row for a tile of heads, so
# the grid has `R * cdiv(H, tile) * S` programs. For DeepSeek MLA (`H = 16` heads per GPU at
# TP 8) with the Hopper config, the head tile covers all 16 heads: one program per row and split.
# On an H200's SMs (`H200_SMS` above):

# %%
mla_tile = decode_head_tile(DECODE_CONFIGS["sm90"]["mla"], 16)
assert math.ceil(16 / mla_tile) == 1
print(f"{'rows':>5} {'max L':>7} {'S':>4} {'programs S=1':>13} {'programs S':>11} {'scratch MiB':>12}")
grids = {}
for rows in (1, 8, 64):
    for max_len in (4096, 32768):
        splits = _compute_num_kv_splits(max_len, H200_SMS)
        programs = rows * math.ceil(16 / mla_tile)
        scratch = rows * 16 * splits * (512 + 1) * 4 / 2**20
        grids[(rows, max_len)] = (programs, programs * splits)
        print(f"{rows:5d} {max_len:7d} {splits:4d} {programs:13d} {programs * splits:11d} {scratch:12.2f}")
assert grids[(1, 32768)][0] == 1 and grids[(1, 32768)][1] < H200_SMS  # one request: most SMs idle either way
assert all(p1 == rows for (rows, _), (p1, _) in grids.items())

# %% [markdown]
# A single request at 32k keys runs one program on the H200 with one split and `S` (the table's
# second line) with vLLM's split count, still fewer than the SMs: batch invariance leaves most of
# the GPU idle for small batches and long contexts. At 64 rows the one-split grid already has a
# program per row; splitting buys less and costs fp32 scratch.
#
# ## 5. Decode context parallelism with two simulated ranks
#
# Under DCP each rank stores part of every request's keys: striped (key `j` on rank `j % N`, or
# groups of `I` keys with an interleave) or sliced (contiguous chunks). Each rank attends to its
# own keys and returns `(o_k, lse_k)`; the exact merge weighs rank `k` by
# `exp(lse_k - lse)`, its share of the softmax mass. `decode_attention_dcp` does this over
# `torch.distributed` (one all-gather of the packed states, then `merge_splits`); here two ranks
# are simulated in one process with the same two calls.


# %%
def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place (bit patterns as ordered ints)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max())


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
    share = torch.exp(gathered[..., 32] - merged_lse[..., None])  # [R, H, ranks]
    naive = gathered[..., :32].mean(dim=2)
    print(f"{layout}: request 0's keys on rank 0: {dcp_local_positions(50, 2, 0, layout).tolist()}")
    print(
        "  rank shares of the softmax mass, head 0, per request: "
        f"{[[round(x, 3) for x in r] for r in share[:, 0].tolist()]}"
    )
    ulps = f" ({bf16_ulps(merged_o, full_o)} bf16 ulps)" if INTERPRETING else ""
    print(
        f"  merged vs single process: max |o| diff {(merged_o.float() - full_o.float()).abs().max():.1e}{ulps}, "
        f"max |lse| diff {(merged_lse - full_lse).abs().max():.1e}; "
        f"plain average of the ranks' outputs: {(naive - full_o.float()).abs().max():.1e}"
    )
    assert torch.allclose(share.sum(-1), torch.ones(()), atol=1e-5)  # the shares sum to 1
    assert bool(torch.isneginf(gathered[1, :, 1, 32]).all()) and not gathered[1, :, 1, :32].any()  # rank 1: (0, -inf)
    assert not share[1, :, 1].any()
    assert compare(merged_o, full_o.double(), tolerance("decode_attention", "o", q3.dtype)).ok
    if INTERPRETING:
        assert bf16_ulps(merged_o, full_o) <= 1
    assert compare(merged_lse, full_lse.double(), tolerance("decode_attention", "lse", "float32")).ok
    assert not compare(naive, full_o.double(), tolerance("decode_attention", "o", q3.dtype)).ok

# %% [markdown]
# Each rank's share is the fraction of the row's softmax mass among its keys; the shares sum to 1.
# Request 1 has a single key, so rank 1 holds none of it and contributes the neutral state
# `(0, -inf)` with share 0 in both layouts. The plain average of the ranks' outputs ignores the
# shares and is far outside the tolerance; the LSE-weighted merge matches the single-process
# kernel within the bf16 tolerance, and under the interpreter to the last bit of its bf16 output
# (at most one ulp apart). Compiled, the single-process kernel feeds its probabilities to the PV
# product in bf16 while the ranks' fp32 states are merged in fp32, so the two differ by more.
# `tests/test_decode_attention_dcp.py` runs the real thing over gloo with 2 and 3 processes, and
# `tests/dcp_nccl_check.py` over NCCL on GPUs.

# %% [markdown]
# ## 6. Head tiles on Hopper: why 64 heads, and why the latent comes in two halves
#
# For MLA, every head reads the same 576-element latent per key. A program that owns a tile of
# heads loads each K tile once for all of them, so a request's keys are read `cdiv(H, tile)`
# times (from L2 after the first). Hopper's warpgroup MMA (wgmma) needs 64 rows per warpgroup, so
# where the heads are the MMA's rows, as in the portable Triton kernel, 16-head tiles compile to the
# older warp-level MMA (section 8 turns the product around): the SASS counts below (`sass_sm90.md`,
# each config compiled for sm_90) show wgmma (HGMMA) exactly for the 64-head tile. A 64-head tile,
# however, keeps a `64 x 512` fp32 output accumulator, printed below in bytes and in registers
# per thread, next to the queries and the softmax state. `SPLIT_LATENT` handles the latent as two
# halves with two accumulators, as the verify kernel's `SPLIT_LATENT` does: each product then fits one
# wgmma (N <= 256). The config table, the launch clamp and the SASS file give every number:

# %%
LV_DEEPSEEK, sm90 = 512, DECODE_CONFIGS["sm90"]["mla"]
sass = {}
for line in (RESULTS / "sass_sm90.md").read_text().splitlines():
    m = re.match(r"\| _decode_stage1_kernel \| ([^|]*) \| (\d+) \| (\d+) \|", line)
    if m:
        variant = dict(kv.split("=") for kv in m[1].split())
        assert variant["BLOCK_N"] == str(sm90["BLOCK_N"]) and variant["num_warps"] == str(sm90["num_warps"])
        sass[(int(variant["GROUP"]), int(variant["BLOCK_H"]))] = (int(m[2]), int(m[3]))
for heads in (16, 128):
    for arch in ("default", "sm90"):
        c = DECODE_CONFIGS[arch]["mla"]
        tile = decode_head_tile(c, heads)
        acc_bytes = tile * LV_DEEPSEEK * 4
        regs = acc_bytes // 4 // (c["num_warps"] * 32)
        mma = ""
        if arch == "sm90":
            hgmma, hmma = sass[(heads, tile)]
            mma = f"; sm_90 SASS: {hgmma} HGMMA, {hmma} HMMA"
            assert (hgmma > 0) == (tile >= 64) and (hmma > 0) == (tile < 64)
        print(f"H={heads:3d} {arch:7s} (BLOCK_H {c['BLOCK_H']:2d}): tile {tile:2d} heads, K tile loaded "
              f"{math.ceil(heads / tile)}x per key, accumulator {acc_bytes // 1024:3d} KiB = {regs:3d} fp32 "
              f"registers/thread over {c['num_warps']} warps{mma}")  # fmt: skip
half = LV_DEEPSEEK // 2 if sm90.get("SPLIT_LATENT") else LV_DEEPSEEK
print(f"SPLIT_LATENT={sm90.get('SPLIT_LATENT', 0)}: latent products of N = {half} columns each")
assert half <= 256

# %% [markdown]
# Without the halves, 64-row tiles did not compile at 64-key tiles in the verify sweep
# (`sweep_verify_h200.md`: every failed config there is a 64-row tile with 64-key tiles and no
# `SPLIT_LATENT`, and with it the same tiles ran; that file was measured when the key was called
# `QSPLIT`, so its rows say `qs0`/`qs1` where the sweep script now writes `sl0`/`sl1`). The decode
# sweep (`sweep_decode_h200.md`, B=32, L=32K, CUDA graphs) timed the configs; below its rows for
# the upstream config, the 64-head tile with halves at 32-key tiles, and the committed Hopper
# config, with each row's bound from the sweep's own ceilings:

# %%
verify_sweep = (RESULTS / "sweep_verify_h200.md").read_text()
failed = re.findall(r"BH(\d+) BN(\d+) w\d+ s\d+ (?:qs|sl)(\d): FAIL", verify_sweep)
ran = re.findall(r"BH(\d+) BN(\d+) w\d+ s\d+ (?:qs|sl)(\d)\s+[\d.]+ us", verify_sweep)
print(f"verify sweep: {len(failed)} failed configs, all {set(failed)}; BH64 BN64 with SPLIT_LATENT ran "
      f"{ran.count(('64', '64', '1'))} times")  # fmt: skip
assert failed and set(failed) == {("64", "64", "0")} and ("64", "64", "0") not in ran and ("64", "64", "1") in ran

text = (RESULTS / "sweep_decode_h200.md").read_text()
tflops_ceiling, tbps_ceiling = map(float, re.search(r"FLOPs / ([\d.]+) TFLOP/s, bytes / ([\d.]+) TB/s", text).groups())
# A row's key: (BLOCK_H, BLOCK_N, warps, stages, SPLIT_LATENT, register cap or 0); a later row of the
# same shape and key replaces an earlier one.
row_re = (r"MLA B=(\d+) H=(\d+)/1 L=(\d+) S=\s*\d+ BH(\d+) BN(\d+) w(\d+) s(\d+) sl(\d)(?: r(\d+))?\s+([\d.]+) us\s+"
          r"([\d.]+) TF/s\s+([\d.]+) GB/s roofline\s+([\d.]+)%")  # fmt: skip
sweep: dict[tuple, dict[tuple, tuple]] = {}
for m in re.finditer(row_re, text):
    shape, key = tuple(map(int, m.groups()[:3])), tuple(int(g or 0) for g in m.groups()[3:9])
    sweep.setdefault(shape, {})[key] = tuple(map(float, m.groups()[9:]))


def sweep_key(c: dict, heads: int) -> tuple:
    """A config's sweep key at ``heads`` query heads (the 16-head tile takes ``maxnreg_h16``)."""
    cap = c.get("maxnreg_h16", 0) if min(c["BLOCK_H"], heads) == 16 else c.get("maxnreg", 0)
    return c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["num_stages"], c.get("SPLIT_LATENT", 0), cap


upstream, halves_bn32 = sweep_key(DECODE_CONFIGS["default"]["mla"], 128), (64, 32, 8, 2, 1, 0)
for (_, heads, _), rows in sweep.items():
    fastest = min(rows.values())[0]
    print(f"H={heads:3d}: committed {rows[sweep_key(sm90, heads)][0]:.1f} us, fastest of the sweep {fastest:.1f} us")
    assert rows[sweep_key(sm90, heads)][0] <= 1.04 * fastest  # the committed config is within 4% of the fastest
for heads in (128, 16):
    rows = sweep[(32, heads, 32768)]
    for name, key in (("upstream", upstream), ("64-head, halves, BN32", halves_bn32),
                      ("sm90 config", sweep_key(sm90, heads))):  # fmt: skip
        us, tf, gb, pct = rows[key]
        bound = "compute" if tf / tflops_ceiling > gb / (tbps_ceiling * 1000) else "memory"
        print(f"H={heads:3d} {name:22s} {key}: {us:7.1f} us, {pct:4.1f}% of the roofline ({bound}-bound)")
    assert rows[upstream][0] > rows[sweep_key(sm90, heads)][0]
big = sweep[(32, 128, 32768)]
assert big[upstream][0] > big[halves_bn32][0] > big[sweep_key(sm90, 128)][0]
assert big[sweep_key(sm90, 128)][1] / tflops_ceiling > big[sweep_key(sm90, 128)][2] / (tbps_ceiling * 1000)  # compute
assert sweep[(32, 16, 32768)][halves_bn32][0] > sweep[(32, 16, 32768)][upstream][0]
small = sweep[(32, 16, 32768)][sweep_key(sm90, 16)]
assert small[1] / tflops_ceiling < small[2] / (tbps_ceiling * 1000)  # memory-bound

# %% [markdown]
# At H=128 the 64-head tiles with halves cut the time, and 64-key tiles cut it again; the kernel
# is then compute-bound at the printed fraction of its roofline. H=16 keeps one 16-head tile in
# every config, so the tile is not what changed there: of the printed configs only the committed
# one, with 64-key tiles and its registers capped at 128 per thread (uncapped, Triton 3.6 gives
# that tile 150, and one 8-warp program fits an SM instead of two), beats upstream, and it is
# memory-bound. The committed config is the fastest of the sweep at H=128 and within 4% of it at
# H=16 (a capped 32-key tile on 4 warps: 374 against 387 us). These are the portable kernel's configs. On an
# H100/H200 the committed entry now sends H=128 to the warp-specialized Gluon kernel (`notebooks/mla_verify.py`,
# section 7: the overlap of softmax and MMA that FlashMLA gets from warp specialization) and H=16 with a 16-bit cache
# to the few-rows kernel (section 8); the capped 16-head tile is their fallback (an FP8 cache at 16 heads, pages
# that are no multiple of 64 keys).

# %% [markdown]
# ## 7. How many splits stage 1 runs, and whole tiles by tensor descriptors
#
# vLLM picks the split count from the longest row alone (`_compute_num_kv_splits`: 64 at 32K keys),
# so at B=32 and H=128 stage 1 launches 32 rows x 2 head tiles x 64 splits = 4096 programs of 8 warps
# on 132 SMs that hold one each: 31 rounds. Every split costs a query load (64 heads x 576 bf16),
# a partial write (64 x 513 fp32 slots; a bf16 output's values in bf16, half of them) and its read in the merge,
# however few keys it has. The H200's
# config therefore caps the splits stage 1 runs (`stage1_splits`: one round of resident programs for
# MLA, two for GQA; the rows of a batch are assumed alike). The cell reads the two split sweeps
# (`sweep_decode_h200.md`, CUDA-graph replay of both stages): the first, before whole-tile loads,
# and the newest, which the cap was chosen from, and shows what the cap picks against vLLM's count
# and the fastest count. These sweeps time the portable kernel; the Gluon kernels count one program
# per SM (the few-rows kernel of section 8 takes 164 KiB of shared memory), so at H=16 they run half
# the splits printed here.

# %%
split_re = r"(MLA|GQA) B=(\d+) H=(\d+)/(\d+) L=(\d+) S=\s*(\d+) \(vLLM\s+(\d+),\s+[\d.]+ rounds\)\s+([\d.]+) us"


def split_times(section: str) -> dict[tuple, dict[int, float]]:
    """``{(kind, B, H, HKV, L): {splits: us}}`` from one sweep section's rows."""
    times: dict[tuple, dict[int, float]] = {}
    for m in re.finditer(split_re, section):
        kind, batch_, heads_, kv_heads_, length_, splits_, _, us = m.groups()
        times.setdefault((kind, int(batch_), int(heads_), int(kv_heads_), int(length_)), {})[int(splits_)] = float(us)
    return times


split_sections = [split_times(part) for part in re.split(r"^## ", text, flags=re.M) if re.search(split_re, part)]
first_splits, split_sweep = split_sections[0], split_sections[-1]
for (kind, batch_, heads_, kv_heads_, length_), times in split_sweep.items():
    tile, config = tile_config(DECODE_CONFIGS["sm90"]["mla" if kind == "MLA" else "gqa"], heads_ // kv_heads_)
    vllm = _compute_num_kv_splits(length_, H200_SMS)
    capped = stage1_splits(vllm, batch_ * kv_heads_ * math.ceil(heads_ // kv_heads_ / tile), H200_SMS, config)
    fastest = min(times, key=times.get)
    print(f"{kind} B={batch_:3d} H={heads_:3d} L={length_:5d}: vLLM {vllm:2d} splits {times[vllm]:7.1f} us, "
          f"capped {capped:2d} {times[capped]:7.1f} us, fastest {fastest:2d} {times[fastest]:7.1f} us")  # fmt: skip
    assert times[capped] <= 1.05 * times[vllm]  # run-to-run differences reach 7% (sweep_decode_h200.md)
    assert times[capped] <= 1.08 * times[fastest]
assert first_splits[("MLA", 32, 128, 1, 32768)][64] > 1.3 * first_splits[("MLA", 32, 128, 1, 32768)][8]  # 1656 -> 1240
assert split_sweep[("MLA", 8, 128, 1, 8192)][16] > 1.1 * split_sweep[("MLA", 8, 128, 1, 8192)][8]
assert split_sweep[("MLA", 128, 128, 1, 1024)][2] > 1.2 * split_sweep[("MLA", 128, 128, 1, 1024)][1]

# %% [markdown]
# Before whole-tile loads, vLLM's 64 splits at MLA B=32 H=128 L=32K cost a third more than 8 (the
# first sweep: 1656 against 1240 us); with descriptors every count from 2 to 64 lands within 5%
# there, since a split's fixed cost shrank with the tile loads. The cap is within 5% of vLLM's count
# everywhere and within 8% of the fastest count; it gains most where vLLM's count overfills the
# GPU with short splits: MLA B=8 H=128 L=8K (16 -> 8 splits, 95 -> 82 us), B=128 H=128 L=1K (2 -> 1,
# 200 -> 160 us) and GQA B=128 L=1K (2 -> 1, 142 -> 130 us). Differences under ~7% between two counts
# moved between the two sweeps, so they are not findings; the cap is what both sweeps agree on.
#
# Stage 1 can also load whole tiles: when pages hold a multiple of
# 64 keys and lie back to back, a 64-key tile that starts on a multiple of 64 lies in one page, so
# one table entry addresses it and a tensor descriptor (TMA on Hopper) loads its three pieces
# (two 256-column latent halves and the 64-column rope) with no per-key address math. Only the at
# most two partial tiles at a split's ends are gathered key by key with masks, so a NaN left in an
# unused slot of a page never meets the value product. The descriptor sweep below (the sm90 entry
# with and without descriptors, both capped) shows the 64-head tile gaining and the 16-head tile
# losing, which is why that portable tile keeps the gathers (`TMA_H16` 0): its shared memory grows
# past what two programs per SM can share. (With a 16-bit cache the H200 runs the few-rows Gluon
# kernel of section 8 at 16 heads, which loads whole tiles by TMA at one program per SM.)

# %%
tma_re = r"MLA B=(\d+) H=(\d+) L=(\d+) S=\s*\d+ (TMA, cap|gathers, cap|TMA, no cap)\s+([\d.]+) us"
tma_sweep: dict[tuple, dict[str, float]] = {}
for m in re.finditer(tma_re, text):
    tma_sweep.setdefault(tuple(map(int, m.groups()[:3])), {})[m[4]] = float(m[5])
for (batch_, heads_, length_), times in tma_sweep.items():
    print(f"MLA B={batch_:3d} H={heads_:3d} L={length_:5d}: descriptors {times['TMA, cap']:7.1f} us, "
          f"gathers {times['gathers, cap']:7.1f} us")  # fmt: skip
    assert (times["TMA, cap"] < times["gathers, cap"]) == (heads_ > 16)

# %% [markdown]
# **The schedule, per tile.** One program owns 64 heads of one row and one split and walks 64-key tiles: the three
# QK^T products (two latent halves and the rope part, wgmma), the online softmax on the scores, and the two P V
# products (the latent halves are V). On an H100/H200 this row runs the Gluon kernel of
# `triton_impl/decode_attention_sm90.py` (32 or more heads, a 16-bit cache or an FP8 one whose codes it widens in
# shared memory; 16 or fewer heads with a 16-bit cache run the few-rows Gluon kernel of section 8, and everything
# else the portable Triton kernel this notebook runs on a CPU). The cell below takes the H=128
# B=32 L=32K bench row (`bench_h200.json`) and divides it into tiles: the bytes a tile loads, its FLOPs, and the time
# one SM spends on it.

# %%
bench_rows = {row["case"]: row for row in json.loads((RESULTS / "bench_h200.json").read_text())["results"]}
row = bench_rows["MLA 576/512 B=32 H=128 L=32768 bf16"]
batch_, heads_, length_, tile_keys, tile_heads = 32, 128, 32768, 64, 64
tile_bytes = tile_keys * 576 * 2  # one K tile (bf16); V is its first 512 columns, not loaded again
tile_flops = 2 * tile_heads * tile_keys * (576 + 512)  # QK^T over 576 columns, P V over 512
tiles = batch_ * (heads_ // tile_heads) * (length_ // tile_keys)  # (row, head tile, key tile) triples
per_sm_us = row["ms"] * 1e3 * H200_SMS / tiles
per_sm_tflops = tile_flops / per_sm_us / 1e6
print(f"a tile: {tile_bytes / 1024:.0f} KiB loaded, {tile_flops / 1e6:.1f} MFLOP "
      f"({tile_flops / tile_bytes:.0f} FLOP per byte; the H200's ridge is about 160)")  # fmt: skip
bench_ceiling = row["tflops"] * 100 / row["pct_roofline"]  # the matmul rate the bench measured in the same run
print(f"{tiles} tiles on {H200_SMS} SMs: {per_sm_us:.2f} us per tile per SM, {per_sm_tflops:.2f} TFLOP/s per SM, "
      f"{100 * per_sm_tflops * H200_SMS / bench_ceiling:.0f}% of the matmul ceiling ({bench_ceiling:.0f} TFLOP/s)")
assert abs(per_sm_tflops * H200_SMS - row["tflops"]) < 0.02 * row["tflops"]
assert tile_flops / tile_bytes > 100 and 0.75 * bench_ceiling < per_sm_tflops * H200_SMS < 0.9 * bench_ceiling

# %% [markdown]
# A tile is compute-heavy (121 FLOP per byte) and the SM spends about 1.9 us on it at 84% of the matmul rate (2.1 us
# and three quarters before the value warpgroup skipped its rescale where no row's max grew, `RESCALE_IF_GREW`).
# Triton's own schedule for this loop, the portable kernel, ran the same row at 1.0411 ms (the bench at 580e9fc,
# `perf_log.md`): 4.2 us a tile at 39% of this run's matmul rate. What each of its warpgroups does is in the
# SASS of the loop (Triton 3.6, the H200's compiler; `notebooks/results/sass_sm90.md` says how to get it): per 64-key
# tile, each of the two warpgroups issues 72 `HGMMA.64x32x16` (the whole [64 heads, 64 keys] score tile over 576
# columns, in two 32-key halves), 34 `MUFU.EX2` per thread (the exponentials of all 64 x 64 scores), and 8
# `HGMMA.64x128x16` (P V for its own 128 of each latent half's 256 columns). Triton splits P V between the warpgroups
# by output columns, and each needs all of P, so both compute all of QK^T: the scores are computed twice. The cell
# counts what the tensor cores execute in that schedule.

# %%
portable_ms = 1.0411  # the portable kernel on this row, bench at 580e9fc
portable_tflops = row["tflops"] * row["ms"] / portable_ms
hgmma_flops = {"64x32x16": 2 * 64 * 32 * 16, "64x128x16": 2 * 64 * 128 * 16}
per_warpgroup = 72 * hgmma_flops["64x32x16"] + 8 * hgmma_flops["64x128x16"]  # sass_sm90.md, the loop's HGMMA
executed = 2 * per_warpgroup  # two warpgroups
score_flops, value_flops = 2 * tile_heads * tile_keys * 576, 2 * tile_heads * tile_keys * 512
assert 72 * hgmma_flops["64x32x16"] == score_flops  # each warpgroup: every score of the tile
assert 2 * 8 * hgmma_flops["64x128x16"] == value_flops  # P V: split between the two
executed_tflops = portable_tflops * executed / tile_flops
print(f"tensor work per tile: {executed / 1e6:.2f} MFLOP executed for {tile_flops / 1e6:.2f} MFLOP of attention "
      f"({executed / tile_flops:.2f}x); at the matmul ceiling the tile would reach "
      f"{100 * tile_flops / executed:.0f}% of the roofline; measured: {portable_tflops:.0f} TFLOP/s of attention = "
      f"{executed_tflops:.0f} TFLOP/s executed ({100 * executed_tflops / tflops_ceiling:.0f}% of the ceiling)")
assert 1.5 < executed / tile_flops < 1.6

# %% [markdown]
# So in Triton's schedule the tensor cores run at about 60% of their rate, but a third of that work repeats the scores,
# and even at the full rate it stops at 65% of the roofline; the softmax between the products is the rest (Nsight
# Compute: issue slots 24% busy). The Gluon kernel computes each tile's scores once: a softmax warpgroup computes the
# scores and the softmax and half of P V, a value warpgroup the other half with P through shared memory, a loader warp
# feeds both by TMA (the verify notebook's section 7 counts its tile). On this row it takes 0.4821 ms, 1.10x
# FlashInfer's speed (bench at a474ebd, the value warpgroup skipping its rescale where no row's max grew; at 64a60c0
# 0.5262 ms and 1.03x; at 6412cb9 0.5108 ms and 1.02x; at cc1dbc3 0.5344 ms and 1.01x; at e8603a5
# 0.5339 ms and 1.00x, on a GPU that measured a 9% higher matmul rate than the earlier runs; at c7e2fb0 0.6072 ms and
# 0.95x, and 0.6346 ms and 0.92x before the softmax warpgroup released each key stage ahead of the next tile's scores,
# the verify notebook's section 7). What keeps it short: the tensor pipe idles while the softmax runs, and the query
# leaves room for only two stages of keys
# (`perf_log.md`).
#
# The order of the programs matters as much as any of that once a call has more programs than SMs. At 128 heads a row
# has two head blocks, which read the same keys. With the rows fastest in the grid (`(R, head blocks, S)`, as CUDA
# numbers blocks x first), decode B=128 H=128 L=1K (256 programs on 132 SMs, 151 MB of keys) ran the first head block of
# every row in the first round and the second in the second, by which time the L2 had long dropped those keys (151 MB
# against a 50 MB L2): every key came from memory twice. With the head blocks of a row adjacent in the program id
# (`decode_attention_sm90._decode_program`) the two read each tile at about the same time and the second read hits the
# L2: stage 1 91.3 -> 76.9 us (`benchmarks/kernel_times.py`), the call 0.0933 -> 0.0815 ms in the bench (cc1dbc3 ->
# 6412cb9), from 0.88x to 1.01x FlashInfer's speed. The portable kernel takes the same order (stage 1 146 -> 140 us
# there); the verify kernels always had their row blocks adjacent.
#
# How the two warpgroups stay in step: each tile the softmax warpgroup hands the value warpgroup `P` and a per-row
# vector (the rescale factor, after the loop the row scale) through shared memory, with two mbarriers
# (`decode_attention_sm90._hand_over`): it waits until the value warpgroup has freed the buffer (`p_free`), stores,
# fences, and arrives on `p_full`; the value warpgroup waits on `p_full`, reads, and arrives on `p_free` only after its
# product with the tile is done. A mistake there would not fail loudly: a read of the next tile's vector gives a wrong
# rescale that the golden comparison catches only when it changes the output. `compute-sanitizer` checks what it can on
# the H200 (`bash .ci/gpu_job sanitizer` with `SANITIZER_TOOL`): memcheck and synccheck report nothing on these kernels,
# while racecheck reports every hand-over as a race because it does not follow mbarrier ordering. It reports
# `tests/racecheck_probe.py` (the same hand-over in a kernel of its own, whose sums come out exact) the same way, and
# the probe's deliberately wrong variant (`--early-free`, the buffer freed before the read: its sums differ) too, so
# on these kernels its report cannot tell a correct hand-over from a wrong one. What checks the protocol is the golden
# comparison over many shapes, and the probe's compile test, which holds its SASS to the order it claims (the arrival
# after the read) (`perf_log.md`, thirty-seventh session).

# %% [markdown]
# ## 8. Sixteen heads on Hopper: the keys as wgmma's M
#
# With 16 heads a decode row has 16 (token, head) rows, a quarter of the 64 rows wgmma wants as M. The 64-row Gluon
# kernel would compute on 48 empty rows; the portable kernel's 16-head tile runs on warp-level MMAs at 83-84% of the
# copy bandwidth (0.3401 ms at 72fbe8a for B=32 L=32K). `mla_decode_few_rows_kernel` turns both products around so
# that the 64 keys of a tile are M and the 16 heads are N (wgmma takes N down to 8):
#
# - scores transposed, `S^T = K Q^T`: `[64 keys, 16 heads]`, K = 576, the key tile and the query from shared memory;
# - the softmax runs down the columns (one column per head), `P^T` goes to shared memory as bf16;
# - values transposed, `O^T = V^T P^T`: two `[256 latent dims, 16 heads]` accumulators, the key tile read as V^T
#   (its transpose in shared memory, no copy).
#
# One warpgroup does all of it; TMA refills each stage with the tile two ahead as soon as that stage's value product
# is done, so the next tile's load runs while it works. Every MMA is the
# full size of the data, so the tile's tensor work is the attention's, and the query's 18 KiB leave room for the two
# 72 KiB stages at one program per SM. The cell counts a tile and reads the bench rows.

# %%
few_heads, keys_per_tile, key_width, latent_width = 16, 64, 576, 512
mmas = {"S^T = K Q^T": (keys_per_tile, few_heads, key_width), "O^T = V^T P^T": (latent_width, few_heads, keys_per_tile)}
instructions = sum((m // 64) * (k // 16) for m, n, k in mmas.values())  # HGMMA.64x16x16: M 64, N 16, K 16 each
few_flops = sum(2 * m * n * k for m, n, k in mmas.values())
few_bytes = keys_per_tile * key_width * 2
few_smem = (few_heads * key_width + 2 * keys_per_tile * key_width + keys_per_tile * few_heads) * 2
sm_hz = 1.76e9  # the SM clock Nsight Compute reported under load
tensor_cycles = few_flops / 4096  # dense bf16 MMA per SM and cycle
memory_cycles = few_bytes / (tbps_ceiling * 1e12 / H200_SMS) * sm_hz  # this SM's share of the copy bandwidth
print(f"per tile: {instructions} HGMMA.64x16x16, {few_flops / 1e6:.2f} MFLOP, {few_bytes // 1024} KiB of keys, "
      f"{few_smem // 1024} KiB of shared memory; {tensor_cycles:.0f} tensor-core cycles against {memory_cycles:.0f} "
      f"cycles of this SM's share of the bandwidth")
for case in ("B=32 H=16 L=32768", "B=128 H=16 L=8192", "B=8 H=16 L=4096"):
    row = bench_rows[f"MLA 576/512 {case} bf16"]
    print(f"{case:18s} {row['ms']:.4f} ms, {row['pct_roofline']:.1f}% of the copy roofline, FlashInfer "
          f"{row['peers_ms']['FlashInfer']:.4f} ms ({row['peers_ms']['FlashInfer'] / row['ms']:.2f}x)")
assert instructions == 68  # what tests/test_decode_attention.py counts in the kernel compiled for sm_90
assert few_smem <= 227 * 1024 < few_smem + few_bytes and memory_cycles > 5 * tensor_cycles
assert bench_rows["MLA 576/512 B=32 H=16 L=32768 bf16"]["pct_roofline"] > 95

# %% [markdown]
# A tile costs the tensor cores about a seventh of the time its bytes take, so the kernel is a stream of keys: B=32
# and B=128 run at 100-102% of the bench's copy ceiling (4279 GB/s in that run), 1.03-1.04x FlashInfer's speed. At
# B=8 L=4K the call is 18-19 us for 38 MB (9 us of bandwidth): each program has a few tiles, and the first two loads
# and the stores of the partials are not hidden.
#
# What is left of such a call is fixed costs, and the split merge was one of them: a second kernel (2.3-2.5 us at B=8
# L=4K) behind a launch gap (1.2-1.7 us). There the few-rows stage 1 now merges the splits itself. Its programs are
# numbered with the splits of a row adjacent and launched as thread-block clusters of one row's splits (2 to 8: the
# portable cluster size), which the GPU schedules together on one GPC. Each program stores its partial record as
# before, then waits at a cluster barrier (`barrier.cluster.arrive.release` / `wait.acquire`: every store of the
# cluster's programs is visible after it); then program `s` merges output columns `[64k, 64k + 64)` for `k = s, s + S,
# ...`, loading the row's LSEs and those columns of every split at once (one round trip to L2), with the merge
# kernel's arithmetic and special cases (`decode_attention_sm90._merge_in_cluster`). No counter, no zeroed buffer,
# nothing kept between calls: a CUDA graph replays it as it is. On the H200 at B=8 (`benchmarks/kernel_times.py`,
# one call, HEAD against the tree): stage 1 16.3-16.4 us plus the merge 2.3-2.5 us became one kernel of 18.1-18.4 us,
# the graph replay 20.9-21.2 -> 19.8-20.1 us, and the bench 0.0191 -> 0.0184 ms, 0.96x -> 1.00x FlashInfer's speed
# (4d339f2); with the weights normalized before the sum (no layout conversion; a4d4a28) stage 1 takes 18.2-18.4 us
# and the bench 0.0181 ms, 1.04x FlashInfer's 0.0188 in that run.
# A cluster waits for the rest of itself, so every cluster must be resident at once: at B=32 (four splits, 128
# programs of one SM each) clusters of four fit fewer than 32 at a time on the H200's GPCs, and the first version,
# which clustered them anyway, took 435 us against 276 for stage 1. So the plan clusters a row's splits only where
# `triton_impl.launch.cluster_capacity` (the driver's `cuOccupancyMaxActiveClusters`) runs every row's cluster at
# once; B=32 keeps the merge kernel.
