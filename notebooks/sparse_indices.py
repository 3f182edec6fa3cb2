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
# # Sparse-attention indices: top-k compressed entries plus a sliding window
#
# A DeepSeek-V4 attention layer lets each query token see two sets of KV rows: `topk` entries
# of a compressed cache (one entry per `compress_ratio` raw tokens; the lightning indexer picks
# which) and the last `window_size` raw tokens, widened inside an image span. The kernels here
# only turn those choices into indices, but every attention kernel downstream trusts them. This
# notebook builds the indices of one prefill token step by step, then shows the global top-k
# compaction and FlashInfer's mixed decode/prefill matrix. Ops: `golden/sparse_indices.py`,
# `triton_impl/sparse_indices.py` (papers.md#sparse-indices).

# %%
import matplotlib.pyplot as plt
import torch

import triton_impl  # noqa: F401  (selects the Triton interpreter on a CPU-only machine)
from golden import sparse_indices as golden
from golden.sparse_indices import image_visibility, swa_window
from triton_impl.sparse_indices import (
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
)

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)
I32 = torch.int32

# %% [markdown]
# ## One prefill token
#
# A request of `seq_len = 96` raw tokens whose last 24 are this chunk's queries; take the query at
# position `pos = 90`. With `compress_ratio = 4` the compressed cache holds one entry per 4 raw
# tokens, so the token may choose among `(pos + 1) // 4 = 22` entries and keeps
# `topk_len = min(22, topk)` of them. Its window is `[max(pos - (W - 1), 0), pos]`.
# (Small sizes for the picture; DeepSeek-V4 uses W = 128 and top-k 512.)

# %%
seq_len, query_len, ratio, topk, window = 96, 24, 4, 8, 16
pos = 90
topk_len = min((pos + 1) // ratio, topk)
start, length = swa_window(torch.tensor([pos]), torch.tensor([0]), torch.tensor([0]), window)
print(f"topk_len = min({(pos + 1) // ratio}, {topk}) = {topk_len}; window = [{int(start)}, {int(start + length - 1)}]")

# The indexer's choice (random here): topk_len distinct compressed entries among the visible ones.
chosen = torch.randperm((pos + 1) // ratio, generator=gen)[:topk_len].sort().values

# %% [markdown]
# Inside an image span the window also opens to the right (bidirectional attention over the
# image's tokens) and may reach further left: `left = min(pos - s, IMG - 1)`,
# `right = min(e - pos, IMG)` for a span `[s, e]`.

# %%
span, max_image = (84, 93), 12
left, right = image_visibility(torch.tensor([pos]), [span], max_image)
img_start, img_length = swa_window(torch.tensor([pos]), left, right, window)
img_end = int(img_start + img_length - 1)
print(f"in image span {span}: left {int(left)}, right {int(right)} -> window [{int(img_start)}, {img_end}]")

fig, ax = plt.subplots(figsize=(10, 2.4))
for c in chosen.tolist():
    ax.broken_barh([(c * ratio, ratio)], (2, 0.8), color="tab:blue")
ax.broken_barh([(int(start), int(length))], (1, 0.8), color="tab:orange")
ax.broken_barh([(int(img_start), int(img_length))], (0, 0.8), color="tab:green")
ax.axvline(pos + 0.5, color="k", linewidth=0.8)
ax.set_yticks([0.4, 1.4, 2.4], ["window, in image", "window", f"top-{topk_len} compressed"])
ax.set_xlim(0, seq_len)
ax.set_xlabel("raw token position (each compressed entry covers 4)")
plt.show()

# %% [markdown]
# ## Into the prefill workspace
#
# Sparse prefill gathers, per request, its `N` compressed rows and its last `gather_len` raw
# tokens into a dense workspace of `M` rows (compressed at `[0, N)`, raw at
# `[N, N + gather_len)`). `combine_topk_swa_indices` writes each token's row indices into it:
# the `topk_len` chosen entries, then the window's rows, then -1 up to a width rounded to 128.

# %%
N = seq_len // ratio
gather_len = query_len + min(seq_len - query_len, window - 1)
M = N + gather_len
topk_indices = torch.full((query_len, topk), -1, dtype=I32)
topk_indices[pos - (seq_len - query_len), :topk_len] = chosen.to(I32)
args = (topk_indices, torch.tensor([0, query_len], dtype=I32), torch.tensor([seq_len], dtype=I32))
args += (torch.tensor([gather_len], dtype=I32),)
combined, lens = combine_topk_swa_indices(*(t.to(device) for t in args), window, ratio, topk, M, N)
expected = golden.combine_topk_swa_indices(*args, window, ratio, topk, M, N)
assert torch.equal(combined.cpu(), expected[0]) and torch.equal(lens.cpu(), expected[1])
row = combined[pos - (seq_len - query_len)].cpu()
print(f"width {combined.shape[1]}, lens {int(lens[pos - (seq_len - query_len)])}")
print("top-k part:", row[:topk_len].tolist())
print("window part (workspace rows N + position - gather_start):", row[topk_len : topk_len + int(length)].tolist())
print("then", int((row[topk_len + int(length) :] == -1).sum()), "entries of -1")

# %% [markdown]
# ## Global top-k slots: bounds and compaction
#
# For decode, the indexer's request-local positions become global cache slots through the
# block table. An entry is kept only if it is non-negative and its request row and block column
# exist; kept slots move to the front in their order, so `lens` entries from the left are all valid
# (the seed left holes, and read the table out of bounds for a bad column or request).

# %%
table = torch.tensor([[10, 11], [20, 21]], dtype=I32)
local = torch.tensor([[128, 64, -1, 3, 70], [5, 6, 7, 8, 9], [1, 2, 3, 4, 5]], dtype=I32)
token_to_req = torch.tensor([0, 1, 7], dtype=I32)  # token 2 names a request the table lacks
slots, slot_lens = compute_global_topk_indices_and_lens(
    local.to(device), token_to_req.to(device), table.to(device), 64, torch.ones(3, dtype=torch.bool, device=device)
)
for t in range(3):
    print(f"token {t}: local {local[t].tolist()} -> {slots[t].tolist()} (lens {int(slot_lens[t])})")

# %% [markdown]
# ## FlashInfer's mixed matrix
#
# FlashInfer takes one matrix for a decode-first batch: per row, the SWA slots (decode rows copy
# theirs; prefill rows derive them from the window), then the compressed slots (width rounded up
# to a multiple of 4 for 16-byte loads). Its `lens` count the whole SWA region, -1 entries
# included.

# %%
decode_swa = torch.randint(0, 500, (2, 8), generator=gen, dtype=I32)
decode_swa[1, 5:] = -1  # a short decode request: fewer than 8 window tokens
query_lens, seq_lens = [1, 1, 6], [40, 5, 30]
qsl = torch.tensor([0, 1, 2, 8], dtype=I32)
token_to_req = torch.tensor([0, 1, 2, 2, 2, 2, 2, 2], dtype=I32)
prefill_topk = torch.randint(0, 7, (6, 6), generator=gen, dtype=I32)
swa_table = torch.tensor([[0], [1], [2]], dtype=I32)
fi_args = (decode_swa, None, None, prefill_topk, qsl, torch.tensor(seq_lens, dtype=I32), token_to_req, swa_table)
fi_scalars = (64, None, 16, 8, 4, 6)  # swa bs, compressed table (the SWA one), compressed bs, window, ratio, topk
indices, fi_lens = build_flashinfer_mixed_sparse_indices(
    *(t if t is None else t.to(device) for t in fi_args), *fi_scalars
)
golden_indices, golden_lens = golden.build_flashinfer_mixed_sparse_indices(*fi_args, *fi_scalars)
assert torch.equal(indices.cpu(), golden_indices) and torch.equal(fi_lens.cpu(), golden_lens)
print("shape", tuple(indices.shape), "lens", fi_lens.tolist())
plt.figure(figsize=(7, 3))
plt.imshow((indices.cpu() >= 0).int(), cmap="Blues", aspect="auto")
plt.axvline(7.5, color="k")
plt.axhline(1.5, color="k")
plt.xlabel("column: 8 SWA | 8 compressed (top-k 6 rounded up to 8)")
plt.ylabel("row: 2 decode, then 6 prefill")
plt.title("valid entries (blue) of the FlashInfer matrix")
plt.show()
