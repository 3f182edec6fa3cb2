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
# # LSE merge: why split-KV attention is exact
#
# Attention of one query row over a key set is a softmax-weighted average. Decode kernels cut a
# long key set into splits, attend to each split in parallel, and merge the partial results.
# This notebook shows why the merge is exact when every partial carries its **log-sum-exp**
# (LSE), what the online softmax inside a kernel does, and what goes wrong when the LSE is
# stored in bf16 or mixed up with base 2. Ops come from `golden/lse_merge.py` and
# `triton_impl/lse_merge.py` (papers.md#lse-merge).

# %%
import itertools
import math

import matplotlib.pyplot as plt
import torch

import triton_impl  # noqa: F401  (selects the Triton interpreter on a CPU-only machine)
from golden.lse_merge import attention_state, lse_base2_to_e, merge_states, split_states
from triton_impl.lse_merge import merge_splits
from triton_impl.tolerances import compare, tolerance

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# %% [markdown]
# ## 1. The attention state `(o, lse)`
#
# For scores `s_j` and values `v_j`, the state over a key set `K` is
# `o = sum_j exp(s_j - lse) v_j` and `lse = ln sum_j exp(s_j)`. The LSE is exactly the
# normalizer, so `exp(lse_A - lse_AB)` is the share of the softmax mass that part `A` holds.
# Merging two parts is therefore a weighted average with weights `exp(lse_i - M)`, `M` the max.

# %%
d, dv, keys = 64, 32, 1000
q = torch.randn(4, d, dtype=torch.float64)
k = torch.randn(keys, d, dtype=torch.float64)
v = torch.randn(keys, dv, dtype=torch.float64)
scale = d**-0.5

full_o, full_lse = attention_state(q, k, v, scale)
eps = torch.finfo(torch.float64).eps
print(f"float64 machine epsilon: {eps:.1e}")
for num_splits in (1, 2, 7, 64):
    parts = list(torch.arange(keys).tensor_split(num_splits))
    part_o, part_lse = split_states(q, k, v, scale, parts)
    o, lse = merge_states(part_o, part_lse)
    print(
        f"{num_splits:3d} splits: max |o - full| = {(o - full_o).abs().max():.1e}, "
        f"max |lse - full| = {(lse - full_lse).abs().max():.1e}"
    )
    assert (o - full_o).abs().max() <= 8 * eps and ((lse - full_lse) / full_lse).abs().max() <= 8 * eps

# %% [markdown]
# In float64 the merged result equals the unsplit one to a few float64 roundings (the machine
# epsilon is printed above): the split-KV identity is an algebraic fact, not an approximation.
# `tests/test_lse_merge.py::test_split_kv_identity` checks it on random partitions, including
# empty parts.
#
# ## 2. The online softmax inside a kernel
#
# A kernel streams key tiles and keeps a running max `m`, a running sum `l` and an
# unnormalized accumulator `acc`. When a tile raises the max, the old sum and accumulator are
# rescaled by `exp(m_old - m_new)`. This is the same merge, applied tile by tile, and gives the
# unsplit result to a few float64 roundings. (`notebooks/decode_attention.py` and
# `notebooks/mla_verify.py` step through the Triton kernels' own loop, in base 2.)


# %%
def online_softmax(q_row, k, v, scale, tile):
    m, l_sum, acc = -math.inf, 0.0, torch.zeros(v.shape[1], dtype=torch.float64)
    history = []
    for start in range(0, k.shape[0], tile):
        s = scale * (k[start : start + tile] @ q_row)
        m_new = max(m, float(s.max()))
        correction = math.exp(m - m_new)
        p = torch.exp(s - m_new)
        l_sum = l_sum * correction + float(p.sum())
        acc = acc * correction + p @ v[start : start + tile]
        m = m_new
        history.append((start + tile, m, m + math.log(l_sum)))
    return acc / l_sum, m + math.log(l_sum), history


o_online, lse_online, history = online_softmax(q[0], k, v, scale, tile=64)
print("online vs full:", float((o_online - full_o[0]).abs().max()), abs(lse_online - float(full_lse[0])))
assert (o_online - full_o[0]).abs().max() <= 8 * eps and abs(lse_online / float(full_lse[0]) - 1) <= 8 * eps
running_lse = [h[2] for h in history]
assert all(later >= earlier * (1 - 4 * eps) for earlier, later in itertools.pairwise(running_lse))  # only grows

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot([h[0] for h in history], [h[1] for h in history], label="running max m")
ax.plot([h[0] for h in history], [h[2] for h in history], label="running lse")
ax.axhline(float(full_lse[0]), color="gray", ls=":", label="final lse")
ax.set_xlabel("keys seen")
ax.legend()
ax.set_title("Online softmax: the running LSE only grows")
plt.show()

# %% [markdown]
# ## 3. The Triton stage-2 kernel
#
# Split-KV kernels write each split's normalized output and LSE into a scratch tensor
# `[rows, H, S, D+1]`; `merge_splits` reduces it. An empty split (a short request, or a row
# whose causal limit ends before the split) is written as `(0, -inf)` and contributes nothing:
# below, the outputs of head 1's empty splits are NaN garbage, and no NaN reaches the result.
# The kernel agrees with the golden merge within the fp32 tolerance (`tests/TOLERANCES.md`), and
# head 0 with the unsplit attention.

# %%
rows, heads, splits, dim = 4, 2, 8, 32
parts = list(torch.arange(keys).tensor_split(splits))
part_o, part_lse = split_states(q, k, v[:, :dim], scale, parts)
partials = torch.cat([part_o, part_lse.unsqueeze(-1)], dim=-1).float()  # [4, S, D+1]
partials = partials.unsqueeze(1).expand(rows, heads, splits, dim + 1).contiguous()
partials[:, 1, 5:, dim] = float("-inf")  # head 1: the last three splits are empty
partials[:, 1, 5:, :dim] = float("nan")  # ... and their scratch holds garbage that is never read
o = torch.full((rows, heads, dim), float("nan"), device=device)
lse = torch.full((rows, heads), float("nan"), device=device)
merge_splits(partials.to(device), o, lse)
ref_o, ref_lse = merge_states(partials[..., :dim].double(), partials[..., dim].double())
print("Triton vs golden, max |o| error:", float((o.cpu().double() - ref_o).abs().max()))
print("head 0 equals the unsplit attention:", float((o[:, 0].cpu().double() - full_o[:, :dim]).abs().max()))
o_tol = tolerance("lse_merge", "o", "float32")
assert not o.isnan().any() and compare(o, ref_o, o_tol).ok  # the NaN scratch of empty splits was never read
assert compare(lse, ref_lse, tolerance("lse_merge", "lse", "float32")).ok
assert compare(o[:, 0], full_o[:, :dim], o_tol).ok  # to fp32 rounding (the partials were rounded to fp32)

# %% [markdown]
# ## 4. What goes wrong: LSE in bf16, and base 2 taken for base e
#
# Serving sometimes stores the LSE in the model dtype (bf16). A bf16 LSE of magnitude 20 (in
# `[16, 32)`, where the bf16 spacing is `2^-3`) is off by up to half of that, `0.0625`, so a merge
# weight `exp(lse_i - M)` can be off by up to `e^0.0625 - 1 = 6.4%`. And
# FlashInfer reports base-2 LSEs: merging them as if they were natural logs raises every weight
# to the power `1/ln 2 = 1.44`, silently over-weighting the dominant split. Each of these numbers
# is computed here:

# %%
lse20 = torch.tensor(20.0, dtype=torch.bfloat16)
spacing = float((lse20.view(torch.int16) + 1).view(torch.bfloat16)) - 20.0  # the next bf16 value up
binade = 16 + torch.arange(0, 16, 2**-6, dtype=torch.float64)  # [16, 32) on a grid finer than bf16's
worst = float((binade.to(torch.bfloat16).double() - binade).abs().max())
print(f"bf16 spacing at 20: 2^{math.log2(spacing):.0f}; worst rounding in [16, 32): {worst}; "
      f"weight error e^{worst} - 1 = {math.expm1(worst):.1%}; 1/ln 2 = {1 / math.log(2):.2f}")  # fmt: skip
assert spacing == 2**-3 and worst == spacing / 2 == 0.0625
assert round(math.expm1(worst), 3) == 0.064 and round(1 / math.log(2), 2) == 1.44
w = torch.exp(part_lse - part_lse.amax(-1, keepdim=True))
w_base2_as_e = torch.exp((part_lse - part_lse.amax(-1, keepdim=True)) / math.log(2.0))
assert torch.allclose(w_base2_as_e, w ** (1 / math.log(2.0)))  # every weight raised to the power 1/ln 2

# %%
split_lse_scale = torch.linspace(0, 30, 16)
errors_bf16, errors_base = [], []
for shift in split_lse_scale:
    lse_true = part_lse + shift  # same relative weights, larger magnitude
    exact_o, _ = merge_states(part_o, lse_true)
    bf16_o, _ = merge_states(part_o, lse_true.to(torch.bfloat16).double())
    base2_as_e, _ = merge_states(part_o, lse_true / math.log(2.0))  # forgot lse_base2_to_e
    errors_bf16.append(float((bf16_o - exact_o).abs().max()))
    errors_base.append(float((base2_as_e - exact_o).abs().max()))
    assert bool(bf16_o.isfinite().all() and base2_as_e.isfinite().all())  # a finiteness test sees nothing
fixed_o, _ = merge_states(part_o, lse_base2_to_e((part_lse + 30) / math.log(2.0)))
fixed_error = float((fixed_o - merge_states(part_o, part_lse + 30)[0]).abs().max())
print("after lse_base2_to_e the error is", fixed_error)
assert fixed_error <= 8 * eps
assert errors_bf16 == sorted(errors_bf16) and errors_bf16[-1] > errors_bf16[0]  # grows with the magnitude
assert min(errors_base) > 0.99 * max(errors_base) > 1e3 * eps  # the same error at every magnitude
unweighted = part_o.mean(dim=-2)  # a merge that skips the rescale
unweighted_ok = compare(unweighted.float(), merge_states(part_o, part_lse)[0], o_tol).ok
print("unrescaled merge within the fp32 tolerance:", unweighted_ok)
assert not unweighted_ok

fig, ax = plt.subplots(figsize=(6, 3))
ax.semilogy(split_lse_scale, errors_bf16, "o-", label="LSE stored in bf16")
ax.semilogy(split_lse_scale, errors_base, "s-", label="base-2 LSE merged as base e")
ax.set_xlabel("LSE magnitude (shift added to every split)")
ax.set_ylabel("max |o - exact|")
ax.legend()
ax.set_title("Merge error from a lossy or mis-based LSE")
plt.show()

# %% [markdown]
# The bf16 error grows with the LSE's magnitude (its ulp does), while the base mix-up gives the
# same error at any magnitude. Both stay invisible to a test that only checks finiteness; the
# package's tolerance table (`tests/TOLERANCES.md`) is tight enough to catch a merge that skips
# the rescale (checked above, and by `test_negative_control_unrescaled_merge_fails`).
