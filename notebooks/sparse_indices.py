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
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import triton_impl  # selects the Triton interpreter on a CPU-only machine; locates the repository
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
PAPERS = Path(triton_impl.__file__).resolve().parent.parent / "papers.md"

# %% [markdown]
# ## One prefill token
#
# The sizes below are this notebook's example values, small enough to draw: a request of
# `seq_len = 96` raw tokens whose last 24 are this chunk's queries, `topk = 8`, window `W = 16`;
# take the query at position `pos = 90`. With `compress_ratio = 4` the compressed cache holds one
# entry per 4 raw tokens, so the token may choose among `(pos + 1) // 4 = 22` complete entries and
# keeps `topk_len = min(22, topk)` of them. Its window is `[max(pos - (W - 1), 0), pos]`.
# DeepSeek-V4's own sizes are larger: papers.md#sparse-indices records its configuration's
# sliding window, 128, and V4-Flash's index top-k, 512; the cell reads both from that file.

# %%
seq_len, query_len, ratio, topk, window = 96, 24, 4, 8, 16  # example sizes, chosen for the picture
pos = 90
complete = (pos + 1) // ratio  # compressed entries whose `ratio` raw tokens all exist
assert complete == 22
topk_len = min(complete, topk)
start, length = swa_window(torch.tensor([pos]), torch.tensor([0]), torch.tensor([0]), window)
assert (int(start), int(start + length - 1)) == (max(pos - (window - 1), 0), pos)
print(f"topk_len = min({complete}, {topk}) = {topk_len}; window = [{int(start)}, {int(start + length - 1)}]")

v4_row = next(line for line in PAPERS.read_text().splitlines() if line.startswith("| DeepSeek-V4 configuration"))
v4_window = int(re.search(r"sliding window (\d+)", v4_row).group(1))
v4_topk = int(re.search(r"index top-k (\d+)", v4_row).group(1))
assert (v4_window, v4_topk) == (128, 512)
print(f"DeepSeek-V4 per papers.md: W = {v4_window}, index top-k {v4_topk}")

# The indexer's choice (random here): topk_len distinct compressed entries among the visible ones.
chosen = torch.randperm(complete, generator=gen)[:topk_len].sort().values

# %% [markdown]
# Inside an image span the window also opens to the right (bidirectional attention over the
# image's tokens) and may reach further left: `left = min(pos - s, IMG - 1)`,
# `right = min(e - pos, IMG)` for a span `[s, e]`. Reaching further left takes `left > W - 1`,
# so only an image longer than the window (`IMG > W`) does it. Here `IMG` is below `W`, and the
# token is less than `IMG` tokens from either end of its span: `left = pos - s`,
# `right = e - pos`, the start stays where the causal window put it and the end moves to
# `pos + right`.

# %%
span, max_image = (84, 93), 12
s, e = span
left, right = image_visibility(torch.tensor([pos]), [span], max_image)
img_start, img_length = swa_window(torch.tensor([pos]), left, right, window)
img_end = int(img_start + img_length - 1)
print(f"in image span {span}: left {int(left)}, right {int(right)} -> window [{int(img_start)}, {img_end}]")
assert (int(left), int(right)) == (min(pos - s, max_image - 1), min(e - pos, max_image)) == (pos - s, e - pos)
assert max_image < window and pos - s < max_image and e - pos < max_image and int(left) <= window - 1
assert int(img_start) == int(start) and img_end == pos + int(right)

fig, ax = plt.subplots(figsize=(10, 2.4))
for c in chosen.tolist():
    ax.broken_barh([(c * ratio, ratio)], (2, 0.8), color="tab:blue")
ax.broken_barh([(int(start), int(length))], (1, 0.8), color="tab:orange")
ax.broken_barh([(int(img_start), int(img_length))], (0, 0.8), color="tab:green")
ax.axvline(pos + 0.5, color="k", linewidth=0.8)
ax.set_yticks([0.4, 1.4, 2.4], ["window, in image", "window", f"top-{topk_len} compressed"])
ax.set_xlim(0, seq_len)
ax.set_xlabel(f"raw token position (each compressed entry covers {ratio})")
plt.show()

# %% [markdown]
# ## Into the prefill workspace
#
# Sparse prefill gathers, per request, its `N` compressed rows and its last `gather_len` raw
# tokens into a dense workspace of `M` rows (compressed at `[0, N)`, raw at
# `[N, N + gather_len)`). `combine_topk_swa_indices` writes each token's row indices into it:
# the `topk_len` chosen entries, then the window's rows, then -1 up to a width rounded up to a
# multiple of 128. At DeepSeek-V4's sizes that width is `round_up(512 + 128, 128)`, printed below.

# %%
N = seq_len // ratio
gather_len = query_len + min(seq_len - query_len, window - 1)
M = N + gather_len
topk_indices = torch.full((query_len, topk), -1, dtype=I32)
t_pos = pos - (seq_len - query_len)  # the token's chunk row
topk_indices[t_pos, :topk_len] = chosen.to(I32)
args = (topk_indices, torch.tensor([0, query_len], dtype=I32), torch.tensor([seq_len], dtype=I32))
args += (torch.tensor([gather_len], dtype=I32),)
combined, lens = combine_topk_swa_indices(*(t.to(device) for t in args), window, ratio, topk, M, N)
expected = golden.combine_topk_swa_indices(*args, window, ratio, topk, M, N)
assert torch.equal(combined.cpu(), expected[0]) and torch.equal(lens.cpu(), expected[1])
width = combined.shape[1]
assert width % 128 == 0 and width == golden.combined_width(topk, window) >= topk + window
v4_width = golden.combined_width(v4_topk, v4_window)
assert v4_width % 128 == 0 and v4_width - 128 < v4_topk + v4_window <= v4_width
print(f"width {width} (at DeepSeek-V4's sizes: {v4_width}), lens {int(lens[t_pos])}")

row = combined[t_pos].cpu()
swa_end = topk_len + int(length)
window_rows = N + torch.arange(int(start), pos + 1) - (seq_len - gather_len)
assert row[:topk_len].tolist() == chosen.tolist()  # request 0: no M * b offset
assert row[topk_len:swa_end].tolist() == window_rows.tolist()
assert (row[swa_end:] == -1).all() and int(lens[t_pos]) == swa_end
print("top-k part:", row[:topk_len].tolist())
print("window part (workspace rows N + position - gather_start):", row[topk_len:swa_end].tolist())
print("then", int((row[swa_end:] == -1).sum()), "entries of -1")

# %% [markdown]
# ## Global top-k slots: bounds and compaction
#
# For decode, the indexer's request-local positions become global cache slots through the
# block table. An entry is kept only if it is non-negative and its request row and block column
# exist; kept slots move to the front in their order, so `lens` entries from the left are all valid
# and the rest are -1 (the seed left holes, and read the table out of bounds for a bad column or
# request).

# %%
table = torch.tensor([[10, 11], [20, 21]], dtype=I32)
block_size = 64
local = torch.tensor([[128, 64, -1, 3, 70], [5, 6, 7, 8, 9], [1, 2, 3, 4, 5]], dtype=I32)
token_to_req = torch.tensor([0, 1, 7], dtype=I32)  # token 2 names a request the table lacks
valid_token = torch.ones(3, dtype=torch.bool)
slots, slot_lens = compute_global_topk_indices_and_lens(
    local.to(device), token_to_req.to(device), table.to(device), block_size, valid_token.to(device)
)
slots, slot_lens = slots.cpu(), slot_lens.cpu()
golden_slots, golden_slot_lens = golden.compute_global_topk_indices_and_lens(
    local, token_to_req, table, block_size, valid_token
)
assert torch.equal(slots, golden_slots) and torch.equal(slot_lens, golden_slot_lens)
for t in range(3):
    n = int(slot_lens[t])
    assert (slots[t, :n] >= 0).all() and (slots[t, n:] == -1).all()  # valid entries first, then -1
    req = int(token_to_req[t])
    kept = [x for x in local[t].tolist() if x >= 0 and req < table.shape[0] and x // block_size < table.shape[1]]
    assert slots[t, :n].tolist() == [int(table[req, x // block_size]) * block_size + x % block_size for x in kept]
    print(f"token {t}: local {local[t].tolist()} -> {slots[t].tolist()} (lens {n})")

# %% [markdown]
# ## FlashInfer's mixed matrix
#
# FlashInfer takes one matrix for a decode-first batch: per row, the SWA slots (decode rows copy
# theirs; prefill rows derive them from the window), then the compressed slots (width rounded up
# to a multiple of 4 for 16-byte loads of int32 indices). Its `lens` count the whole SWA region,
# -1 entries included, plus the kept compressed entries: a row whose window is short has more
# `lens` than non -1 entries.

# %%
fi_window, fi_ratio, fi_topk, swa_bs, comp_bs = 8, 4, 6, 64, 16
decode_swa = torch.randint(0, 500, (2, fi_window), generator=gen, dtype=I32)
decode_swa[1, 5:] = -1  # a short decode request: fewer window tokens than the window holds
query_lens, seq_lens = [1, 1, 6], [40, 5, 30]
qsl = torch.tensor([0, 1, 2, 8], dtype=I32)
token_to_req = torch.tensor([0, 1, 2, 2, 2, 2, 2, 2], dtype=I32)
prefill_topk = torch.randint(0, 7, (6, fi_topk), generator=gen, dtype=I32)
swa_table = torch.tensor([[0], [1], [2]], dtype=I32)
fi_args = (decode_swa, None, None, prefill_topk, qsl, torch.tensor(seq_lens, dtype=I32), token_to_req, swa_table)
fi_scalars = (swa_bs, None, comp_bs, fi_window, fi_ratio, fi_topk)  # compressed table None: the SWA one
indices, fi_lens = build_flashinfer_mixed_sparse_indices(
    *(t if t is None else t.to(device) for t in fi_args), *fi_scalars
)
indices, fi_lens = indices.cpu(), fi_lens.cpu()
golden_indices, golden_lens = golden.build_flashinfer_mixed_sparse_indices(*fi_args, *fi_scalars)
assert torch.equal(indices, golden_indices) and torch.equal(fi_lens, golden_lens)
print("shape", tuple(indices.shape), "lens", fi_lens.tolist())

num_decode, num_prefill = decode_swa.shape[0], prefill_topk.shape[0]
swa_total, padded_topk = golden.flashinfer_widths(decode_swa.shape[1], fi_topk, 0, 0)
assert indices.shape == (num_decode + num_prefill, swa_total + padded_topk)
assert padded_topk % 4 == 0 and padded_topk - 4 < fi_topk <= padded_topk
assert 4 * indices.element_size() == 16
assert (indices[:, swa_total + fi_topk :] == -1).all()  # the padding columns
assert torch.equal(fi_lens, swa_total + (indices[:, swa_total:] >= 0).sum(dim=1).to(I32))
short_by = fi_lens - (indices >= 0).sum(dim=1).to(I32)  # lens minus the non -1 entries
assert short_by.tolist() == (indices[:, :swa_total] == -1).sum(dim=1).tolist() and short_by.tolist()[1] > 0
print("lens minus non -1 entries per row:", short_by.tolist())

plt.figure(figsize=(7, 3))
plt.imshow((indices >= 0).int(), cmap="Blues", aspect="auto")
plt.axvline(swa_total - 0.5, color="k")
plt.axhline(num_decode - 0.5, color="k")
plt.xlabel(f"column: {swa_total} SWA | {padded_topk} compressed (top-k {fi_topk} rounded up to {padded_topk})")
plt.ylabel(f"row: {num_decode} decode, then {num_prefill} prefill")
plt.title("valid entries (blue) of the FlashInfer matrix")
plt.show()
