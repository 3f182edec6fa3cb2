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
# # TurboQuant: a KV cache at 3-4 bits per coordinate
#
# TurboQuant (papers.md#turboquant) quantizes a key `k` as its norm `n = ||k||` plus codes for
# its direction. A rotation `Pi` first makes the direction's coordinates follow one known
# distribution, so one scalar Lloyd-Max codebook serves every coordinate. Decode never
# un-rotates a key: `<q, k> = n <q Pi^T, c[idx]>`, so the query is rotated once and scored
# against centroids. This notebook shows each step with the ops of `golden/turboquant.py` and
# `triton_impl/turboquant.py`: the rotated coordinates against the Beta density, the codebooks,
# distortion against the paper's bounds, attention error per preset, and the pair lookup table.

# %%
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import triton_impl  # selects the Triton interpreter on a CPU-only machine; locates the repository
from golden import turboquant as tq
from triton_impl.bench import per_length_line
from triton_impl.parity.turboquant import compare_store, decode_expected
from triton_impl.tolerances import compare, tolerance
from triton_impl.turboquant import (
    build_pair_lut,
    stream_k_pieces,
    triton_turboquant_decode_attention_v2,
    triton_turboquant_store,
)
from triton_impl.turboquant_sm90 import _score_dim, _span_selectors, _value_dim

torch.manual_seed(0)
D = 128
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernels run compiled on a GPU

# %% [markdown]
# ## 1. After a rotation, every coordinate has the same distribution
#
# A uniformly random unit vector in `R^d` has coordinates with density
# `f(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2)` on `[-1, 1]`, i.e.
# `(x + 1)/2 ~ Beta((d-1)/2, (d-1)/2)`, close to `N(0, 1/d)` (the paper's Lemma 1). Real keys are
# not uniform: below, synthetic keys with a few large "outlier" channels (as LLM keys have) are
# normalized and rotated by the Sylvester-Hadamard matrix that vLLM uses. Before the rotation the
# outlier channels dominate: the 4 outlier channels carry more than half of the directions' energy
# (the sum of squared coordinates over all tokens), where an even spread would give them `4/d`.
# After it no channel stands out: the 4 channels with the most energy carry less than twice that
# even share, and every coordinate is spread like the Beta density.


# %%
OUTLIERS = 4  # channels 0..3 of every synthetic key are the outliers


def synthetic_keys(tokens: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian keys with a channel-wise mean and ``OUTLIERS`` outlier channels 8x larger."""
    keys = torch.randn(tokens, d, generator=gen) + 0.5 * torch.randn(d, generator=gen)
    keys[:, :OUTLIERS] *= 8
    return keys


gen = torch.Generator().manual_seed(1)
keys = synthetic_keys(2048, D, gen)
directions = keys / keys.norm(dim=-1, keepdim=True)
pit = tq.hadamard_rotation(D).T.contiguous()
_, rotated = tq.rotate_keys(keys[:, None, :], pit)
rotated = rotated[:, 0]

x = torch.linspace(-0.45, 0.45, 400, dtype=torch.float64)
log_c = math.lgamma(D / 2) - 0.5 * math.log(math.pi) - math.lgamma((D - 1) / 2)
beta_density = torch.exp(log_c + (D - 3) / 2 * torch.log1p(-(x**2)))
gauss_density = torch.exp(-(x**2) * D / 2) * math.sqrt(D / (2 * math.pi))

fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
for ax, data, title in [
    (axes[0], directions, "k / ||k|| (before rotation)"),
    (axes[1], rotated, "y = (k / ||k||) Pi^T"),
]:
    ax.hist(data.flatten().numpy(), bins=120, range=(-0.45, 0.45), density=True, alpha=0.6, label="coordinates")
    ax.plot(x, beta_density, "k", lw=1.5, label=f"Beta marginal, d={D}")
    ax.plot(x, gauss_density, "r--", lw=1, label="N(0, 1/d)")
    ax.set_title(title)
    ax.set_yscale("log")
    ax.set_ylim(1e-3, 10)
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"largest |coordinate|: before {directions.abs().max():.3f}, after {rotated.abs().max():.3f}")

outliers = OUTLIERS
energy_before = directions.double().square().sum(0)
energy_after = rotated.double().square().sum(0)
share_before = float(energy_before[:outliers].sum() / energy_before.sum())
share_after = float(energy_after.topk(outliers).values.sum() / energy_after.sum())
even_share = outliers / D
print(
    f"energy share of {outliers} channels: before, the outlier channels {share_before:.3f}; after, the "
    f"{outliers} largest channels {share_after:.3f}; even spread {even_share:.4f}"
)
assert share_before > 0.5, share_before
assert share_after < 2 * even_share, (share_after, even_share)

# %% [markdown]
# ## 2. Lloyd-Max codebooks
#
# For a known density the best `b`-bit scalar quantizer satisfies Lloyd's two conditions: each
# centroid is the mean of its cell, each boundary the midpoint of two centroids.
# `solve_lloyd_max` iterates them to convergence in float64 for the Gaussian limit (what serving
# uses; `c * sqrt(d)` is then the same for every `d`) or the exact Beta marginal.

# %%
fig, ax = plt.subplots(figsize=(10, 3))
ax.plot(x * math.sqrt(D), beta_density / math.sqrt(D), "k", lw=1)
for bits in (1, 2, 3, 4):
    centroids, boundaries = tq.solve_lloyd_max(D, bits)
    ax.scatter(centroids * math.sqrt(D), [0.45 - 0.08 * bits] * len(centroids), s=14, label=f"{bits} bits")
    print(
        f"{bits} bits: positive centroids * sqrt(d) =",
        [round(v, 4) for v in (centroids * math.sqrt(D)).tolist()[2 ** (bits - 1) :]],
    )
ax.set_xlabel("x * sqrt(d)")
ax.set_yticks([])
ax.legend(fontsize=8, ncol=4)
plt.show()

# %% [markdown]
# ## 3. Distortion against the paper's bounds
#
# For a unit vector, `D_mse = E ||x - x~||^2 = d * E(X - c(X))^2`. Theorem 1 bounds it by
# `(sqrt(3) pi / 2) 4^-b`; Theorem 3 shows no quantizer beats `4^-b`. Below: the exact distortion
# of the Gaussian and Beta codebooks at `d = 128` (`codebook_distortion`), and the one measured on
# 1024 random unit vectors rotated and quantized by the golden store's own arithmetic. A unit vector
# in `R^d` has coordinates of variance `1/d`, so `d * E(X - c(X))^2` is the distortion per unit
# variance that the theorems bound. All three lie within `[4^-b, (sqrt(3) pi / 2) 4^-b]` at every `b`.

# %%
unit = torch.randn(1024, 1, D, generator=gen)
unit = unit / unit.norm(dim=-1, keepdim=True)
_, y_unit = tq.rotate_keys(unit, pit)
rows = []
for bits in (1, 2, 3, 4):
    gauss_c, gauss_b = tq.solve_lloyd_max(D, bits)
    beta_c, _ = tq.solve_lloyd_max(D, bits, model="beta")
    codes = (y_unit[..., None] >= gauss_b).sum(-1)
    measured = float((y_unit.double() - gauss_c.double()[codes]).square().sum(-1).mean())
    rows.append((bits, tq.codebook_distortion(gauss_c, D), tq.codebook_distortion(beta_c, D, "beta"), measured))
    lower, upper = 4.0**-bits, math.sqrt(3) * math.pi / 2 * 4.0**-bits
    print(
        f"b={bits}: Gaussian codebook {rows[-1][1]:.5f} (N(0,1/d)), Beta codebook {rows[-1][2]:.5f} (exact d={D}), "
        f"measured {measured:.5f}, bounds [{lower:.5f}, {upper:.5f}]"
    )
    assert all(lower <= value <= upper for value in rows[-1][1:]), (rows[-1], lower, upper)

bits_axis = [r[0] for r in rows]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(bits_axis, [r[1] for r in rows], "o-", label="Lloyd-Max, Gaussian limit")
ax.semilogy(bits_axis, [r[3] for r in rows], "x", ms=10, label="measured, d=128 unit vectors")
ax.semilogy(bits_axis, [math.sqrt(3) * math.pi / 2 * 4.0**-b for b in bits_axis], "k--", label="upper bound (Thm 1)")
ax.semilogy(bits_axis, [4.0**-b for b in bits_axis], "k:", label="lower bound (Thm 3)")
ax.set_xlabel("bits per coordinate")
ax.set_ylabel("E ||x - x~||^2")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 4. Attention error per preset
#
# The presets trade bits for accuracy: FP8 keys (`k8v4`), 4-bit keys (`4bit_nc`) and 3-bit keys
# (`k3v4_nc`, `3bit_nc`); values are min-max quantized to 4 or 3 bits, and `_nc` presets fold
# `1 / ||c[idx]||` into the stored norm so reconstructed keys keep their length. Below, one
# request of 256 synthetic keys (with outlier channels) and Gaussian values is stored (golden
# store; the Triton store is checked against it on the first 16 tokens with `compare_store`: the
# same codes except where a coordinate lies within fp32 rounding of a decision boundary), and 8
# query heads on 2 KV heads attend to it with the Triton decode kernel. The error is against float64
# attention over the unquantized keys and values; "golden == triton" compares the kernel with the
# golden decode on the same cache bytes and the same fp16-rounded centroids (the kernel reads its
# codebook as fp16, as upstream's does; `centroid_rounding_bound` in `triton_impl/parity/turboquant.py`
# bounds what that rounding moves), and each preset asserts that the kernel's output is within
# TurboQuant's `out` tolerance for its output dtype (`tests/TOLERANCES.md`) of that golden decode.

# %%
tokens, kv_heads, heads, block_size = 256, 2, 8, 16
key = torch.stack([synthetic_keys(tokens, D, gen) for _ in range(kv_heads)], dim=1).half()
value = torch.randn(tokens, kv_heads, D, generator=gen).half()
# Each query head looks for one key of its KV head (as retrieval heads do), so the softmax is peaked.
targets = torch.randint(0, tokens, (heads,), generator=gen)
query = 0.15 * key[targets, torch.arange(heads) // (heads // kv_heads)].float()
query = (query + 0.5 * torch.randn(heads, D, generator=gen))[None].half()
scale = D**-0.5
block_table = torch.arange(tokens // block_size, dtype=torch.int32)[None]
seq_lens = torch.tensor([tokens], dtype=torch.int32)

group = heads // kv_heads
k_rep = key.double().repeat_interleave(group, dim=1)  # [tokens, heads, D]
v_rep = value.double().repeat_interleave(group, dim=1)
p = torch.softmax(torch.einsum("hd,thd->ht", query[0].double(), k_rep) * scale, dim=-1)
exact = torch.einsum("ht,thd->hd", p, v_rep)

errors = {}
for preset in sorted(tq.PRESETS):
    config = tq.TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints = tq.solve_lloyd_max(D, config.centroid_bits)
    empty = torch.zeros(tokens // block_size, block_size, kv_heads, config.slot_size_aligned, dtype=torch.uint8)
    cache = tq.turboquant_store(empty, key, value, torch.arange(tokens), pit, midpoints, centroids, config)
    first_block = empty[:1].clone().to(device)
    key16, value16, pit_d, midpoints_d, centroids_d = (t.to(device) for t in (key[:16], value[:16], pit, midpoints,
                                                                               centroids))  # fmt: skip
    triton_turboquant_store(key16, value16, first_block, torch.arange(16, device=device), pit_d, midpoints_d,
                            config.key_mse_bits, config.key_packed_size, config.value_quant_bits, config.key_fp8,
                            centroids_d, config.norm_correction)  # fmt: skip
    store = compare_store(first_block, empty[:1], key16, value16, torch.arange(16), pit, midpoints, centroids, config)
    assert store.ok, store.summary()
    out = triton_turboquant_decode_attention_v2(
        query.to(device), cache.to(device), block_table.to(device), seq_lens.to(device), pit.T.contiguous().to(device),
        centroids_d, scale, config.key_mse_bits, config.key_packed_size, config.value_quant_bits,
        config.value_packed_size, key_fp8=config.key_fp8, max_num_kv_splits=4,
    ).cpu()  # fmt: skip
    # Golden on the same bytes as this device's decode is checked (the kernel's fp16 centroids; on sm_90 also its
    # fp16 query, within the bound on its weights' fp16 rounding).
    expected = decode_expected(query, cache.to(device), block_table, seq_lens, pit, centroids, scale, config)
    golden_out = expected.out
    parity = compare(out, golden_out, tolerance("turboquant", "out", out.dtype), expected.out_bound)
    assert parity.ok, (preset, parity)
    errors[preset] = float((out[0].double() - exact).norm() / exact.norm())
    print(
        f"{preset:20s} {8 * config.slot_size_aligned / (2 * D):.2f} bits/coordinate  "
        f"relative error vs float64 {errors[preset]:.4f}  golden == triton to "
        f"{(out[0].double() - golden_out[0]).abs().max():.1e}; store codes in tie bands: "
        f"{store.ties('key codes')} key, {store.ties('value codes')} value"
    )

fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(range(len(errors)), list(errors.values()))
ax.set_xticks(range(len(errors)), [p.removeprefix("turboquant_") for p in errors])
ax.set_ylabel("||out - exact|| / ||exact||")
plt.show()

# %% [markdown]
# ## 5. The pair lookup table: two lookups become one
#
# A 4-bit key stores two codes per byte: `lo = byte & 15` (coordinate `2i`) and `hi = byte >> 4`
# (coordinate `2i+1`). Scoring needs `c[lo]` and `c[hi]`, two gathers from a 16-entry table. The
# pair LUT is FLUTE's vectorized lookup (the FLUTE row of papers.md#turboquant): a table indexed by
# both codes of a packed byte rather than by one code, so each byte costs one load that returns both
# dequantized values. It precomputes every pair, `lut[i*16 + j] = (c_i, c_j)` (256 entries of 8
# bytes = 2 KiB, asserted on the tensor below), so one 8-byte gather at `lo*16 + hi` returns
# `(c_lo, c_hi)`. The decode kernel (`use_pair_lut=True`) reads the same pairs as fp16, re-indexed
# by the byte's value (entry `b` holds `c[b & 15]` and `c[b >> 4]` in one 32-bit word, 1 KiB), and
# puts the two halves back at coordinates `2i` and `2i+1`. The table is rebuilt on every call: caching
# it by `centroids.data_ptr()` returns a stale table when the allocator reuses an address.
#
# Fewer gathers are not fewer cycles on every GPU. On the H200 the pair table made the 4-bit decode
# about 2x slower than two gathers from the 16-entry fp16 table (`notebooks/results/sweep_memory_bound_h200.md`):
# a warp's 32 lookups into 32 bytes hit one L1 line, into 1 KiB up to 8. The kernel's H200 config
# therefore reads the 16-entry table (`use_pair_lut=None` lets the config choose).

# %%
centroids, _ = tq.solve_lloyd_max(D, 4)
lut = build_pair_lut(centroids)
byte = 0x3A
lo, hi = byte & 0xF, byte >> 4
print(f"byte 0x{byte:02X}: lo={lo}, hi={hi}; lut[{lo}*16 + {hi}] = {lut[lo * 16 + hi].tolist()}")
print(f"centroids[lo], centroids[hi] = {[centroids[lo].item(), centroids[hi].item()]}")
print(
    f"table: {tuple(lut.shape)} {lut.dtype} = {lut.numel() * lut.element_size()} bytes; "
    f"gathers per packed byte: 1 (pair LUT) vs 2 (centroids)"
)
assert centroids.numel() == 16
assert lut.shape == (256, 2) and lut[0].numel() * lut.element_size() == 8
assert lut.numel() * lut.element_size() == 2 * 1024
assert torch.equal(lut[lo * 16 + hi], torch.stack([centroids[lo], centroids[hi]]))
# Every entry, not just this byte: row i*16 + j holds (c_i, c_j).
assert torch.equal(lut, torch.stack([centroids.repeat_interleave(16), centroids.repeat(16)], dim=-1))

fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
ax[0].imshow(lut[:, 0].reshape(16, 16).numpy(), cmap="coolwarm")
ax[0].set_title("lut[i*16 + j][0] = c_i")
ax[1].imshow(lut[:, 1].reshape(16, 16).numpy(), cmap="coolwarm")
ax[1].set_title("lut[i*16 + j][1] = c_j")
for a in ax:
    a.set_xlabel("j (hi nibble)")
    a.set_ylabel("i (lo nibble)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Performance: where the decode's time goes
#
# A 4-bit cache exists to make long-context decode cheaper: per (token, KV head) it holds 134 bytes
# where bf16 holds 512. The cells below read the H200 benchmark of this decode
# (`notebooks/results/bench_h200.json`, the data of `bench_h200.md`) at B=32, Hq=32, Hk=8, D=128,
# block 16, beside this package's bf16 GQA decode of the same shape.
#
# On the H200, 3-bit, 4-bit and FP8 keys with 3- or 4-bit values run stage 1 as a Gluon kernel
# (`triton_impl/turboquant_sm90.py`, whose docstring says which of its kernels serves which call); the portable
# Triton kernel (what this notebook runs on a CPU) serves everything else. The Gluon kernel builds every tensor-core
# operand in the registers `mma.sync` reads it from, by choosing which bytes each thread loads:
#
# - scores as `S^T = K q^T`, the keys the MMA's M (16 per chunk), the group's heads its N (8): a GQA
#   group of 4 fills half of each MMA instead of a quarter;
# - a thread's 16 bytes of 4-bit key codes are one read, and each byte becomes one A-operand register: its two
#   codes' fp16 centroids, the entry of the pair LUT of section 5, assembled by `prmt` (byte permute) from 8
#   registers that hold the 16 centroids' bytes (a cell below checks that the two agree). 3-bit keys: 12 bytes, each
#   6 bits a pair of codes, from 4 such registers; FP8 keys: one hardware e4m3x2 -> f16x2 conversion. The dot
#   product does not care in which order it visits dimensions, so the query is loaded in the same permuted order;
# - the value product `O^T = V^T P^T` pairs two keys' code words into registers holding both keys' code at one
#   dimension, each code masked in place in its 16-bit half: bits `c` under a zero exponent are the fp16 subnormal `c
#   2^-24`, exact, so one `lop3` makes two operands and the output rows take the `2^24` back at the end: no lookup, no
#   conversion (until the fifty-first session, `0x6400 | c` per half and a packed `sub.f16x2` of 1024, one more
#   instruction a register). The products stay exact, but the tensor cores sum them a little more coarsely than normal
#   fp16 codes (measured: at most `2^-12.8` of a step's largest weight, in code units;
#   `benchmarks/mma_subnormal_codes.py`), which the check's bound takes as `SUBNORMAL_CODES`. With 3-bit values a lane
#   quad holds 16 dimensions, a 6-byte span of each key's values, whose four 12-bit fields one `prmt` each takes out
#   (the cells below).
#
# Every call runs one warp a program: its 16-key chunks copied by TMA into a ring of shared-memory buffers, two
# chunks an iteration through one online-softmax step, 16 programs a SM (3-bit values: 12). 3- and 4-bit keys divide
# each KV head's keys over the whole batch evenly among one round of programs (stream-K, below), and the splits'
# partial states are merged by the second kernel, `merge_splits` (the LSE merge op).
#
# **What a step costs, and what binds it.** A step (32 keys of one KV head, one warp) compiles, under the H200's
# Triton 3.6, to these warp instructions (`benchmarks/sass_sm90_turboquant.py` counts them from the SASS):
#
# | preset | instructions a step | of them on the ALU pipe | per key and KV head |
# | --- | --- | --- | --- |
# | turboquant_k8v4 (FP8 keys) | 515 | 209 | 16.1 |
# | turboquant_4bit_nc | 744 | 402 | 23.2 |
# | turboquant_k3v4_nc (its key pairs from a shared table, below) | 730 | 294 | 22.8 |
# | turboquant_3bit_nc | 860 | 428 | 26.9 |
#
# (Before the value codes became fp16 subnormals: 566, 805, 787 and 924 instructions, the ALU counts the same.)
#
# The ALU pipe (`prmt`, `lop3`, shifts, selects, compares) takes 2 cycles of its scheduler a warp instruction, where
# issuing any instruction takes 1. Two probes on the 4-bit loop, work that changes no result added to its lookups
# (`benchmarks/variants/pipe_probe_alu.patch`, `pipe_probe_fma.patch`), say which binds: 128 more ALU instructions
# a step made stage 1 20% slower (354 -> 426 us at L=32K), 113 more `IMAD`s (the FMA pipe) 1.6% (-> 360). The same
# probes on 3-bit keys (k3v4 / 3bit_nc): +20% / +19% with 128 more ALU instructions, +2% / +3% with 102 more `IMAD`s.
# So the lever is the ALU count, and most of it is the keys' lookups: 256 of the 402 for 4-bit keys, 208 of the 426 for
# 3-bit keys and values (13 a group of 8 codes, whose 3 left shifts ptxas issues as `IMAD.SHL` on the FMA pipe; the
# loop's SASS: `benchmarks/sass_sm90_turboquant.py --loop turboquant_3bit_nc` under Triton 3.6). Cuts on other
# pipes moved the time little: fewer `IMAD.MOV`, nothing; the value codes biased (24-36 instructions fewer), nothing;
# the value codes as fp16 subnormals (64 `HADD2` and 51-64 instructions fewer), 2-5% for 4-bit keys and k3v4 on the
# H200 in one A/B, 1% or less for 3-bit values and FP8 keys, nothing on an H100. Moving the lookups' shifts to
# `IMAD.HI` made it 2-4% slower.
#
# That brings a shared-memory pair table back for a new reason: in this loop the shared-memory pipe is nearly idle
# while the ALU pipe binds, and a lookup there is one `LDS` a pair of codes and one or two ALU instructions for its
# address, against about four by `prmt`. `WARP_SHARED_PAIRS` (a thread's first 0-4 words or 24-bit groups through a
# 1 KiB table its inline PTX declares, writes and reads by name) takes a step from 402 to 210 ALU instructions for
# 4-bit keys and 391 to 294 for k3v4, at about 3.3 bank conflicts an `LDS` for the 256-entry table
# (`tests/test_turboquant.py` compiles it and runs its PTX on a model of the instructions). On the H200 only 3-bit keys
# with 4-bit values gained (k3v4, all four words: 101 -> 95 us at L=8K, 353 -> 331 at 32K); 4-bit keys ran 10-12%
# slower with all four words and 3-bit values 3-9% slower. By the SASS counts, likely the 256-entry table's bank
# conflicts (its 64 `LDS` a step become ~210 shared-memory wavefronts) and, for 3-bit values, their 12 programs a SM
# (3 warps a scheduler to hide each `LDS`'s latency, against 4 for k3v4). The sm90 entry uses it for k3v4 alone.
#
# **Where the warps wait.** Nsight Compute on the entries' stream-K kernels at L=8K (`perf_log.md`, forty-fourth
# session; its per-instruction samples summed by `benchmarks/ncu_stalls.py`): 90% of the samples fall in the loop,
# whose schedulers issue on 62-66% of cycles with 2.9-3.5 warps each. Of a warp's samples 21-24% are issuing and
# another 21% ready but not chosen; the largest waits are on a fixed-latency result the next instruction needs
# (18-23%) and on the busy ALU pipe (10% for k3v4 through its table, 14-16% for 4-bit keys and 3-bit values). The
# table moves k3v4's wait to shared-memory results (13% of its samples, 5% for the others). DRAM is 41-58% busy: no
# preset waits on memory, as the roofline percentages below say.
#
# **How it got here.** The cell below lists each change that landed, as timed on the H200 against the kernel before
# it in one device call: stage 1 (`benchmarks/kernel_times.py`) or the whole call (the bench), in us.
#
# Fewer bytes still does not mean proportionally less time: the cost is per-key decode work, not memory (4-bit keys
# at 61% / 72% of their copy roofline, 3-bit keys and values at 42% / 52%). `notebooks/results/perf_log.md` has every
# change with its prediction and outcome, the variants that lost, and what is still open.

# %%
HISTORY = [  # (change, what was timed, length, before, after): each row one A/B call on the H200, Triton 3.6
    ("the Gluon kernel (4 warps, 64-key tiles), not the portable one", "stage 1, 4-bit", "32K", 1344, 789),
    ("  the same", "stage 1, FP8 keys", "32K", 1177, 690),
    ("  the same", "stage 1, 3-bit keys", "32K", 1480, 672),
    ("tiles copied by cp.async into three shared-memory stages", "call, 4-bit", "32K", 761, 670),
    ("the query and p * scale rounded once to fp16: one MMA, not two", "stage 1, 4-bit", "32K", 641, 593),
    ("4-bit centroids by prmt from registers, not the shared pair LUT", "stage 1, 4-bit", "32K", 594, 571),
    ("one warp a program: one copy of the loop, no CTA barrier", "stage 1, 4-bit", "8K", 154, 127),
    ("each value code masked and biased by one lop3; two chunks a step", "stage 1, 4-bit", "8K", 132, 120),
    ("two rounds of resident programs, not four", "stage 1, 4-bit", "8K", 119, 107),
    ("a symmetric codebook's lookup: 18 instructions for 8 codes, not 21", "stage 1, 4-bit", "8K", 107, 98),
    ("stream-K: each KV head's keys divided evenly (1-32K mixed)", "stage 1, 4-bit", "mixed", 268, 204),
    ("3-bit values at 168 registers, two chunks a step", "stage 1, 3bit_nc", "32K", 492, 469),
    ("3-bit values read as each lane quad's 6-byte span", "stage 1, 3bit_nc", "8K", 114, 107),
    ("3-bit keys' centroid pairs from a table in shared memory", "stage 1, k3v4", "32K", 353, 331),
]
for change, timed, length, before, after in HISTORY:
    print(f"{change:68s} {timed:19s} L={length:5s} {before:5d} -> {after:4d} us ({after / before - 1:+.0%})")
    assert after < before, change

# %% [markdown]
# Which dimensions a thread holds. In the scores' A operand, thread `t` of each lane quad holds K
# indices `16c + 8j + 2t + e` (chunk `c`, half `j`, pair element `e`): the kernel makes them the
# dimensions `_score_dim(k)`, 32 consecutive ones, so its 16 bytes of 4-bit codes are one load and
# each byte (two neighbouring dimensions) fills one register. In the value product, lane quad `g` of
# warp `w` holds output rows `64m + 16w + 8h + g`: dimensions `_value_dim(d)`, the 4 codes of one
# 16-bit word. The cell runs the kernel's own index arithmetic (the functions' Python bodies).

# %%
for t in range(4):
    k = torch.tensor([16 * c + 8 * j + 2 * t + e for c in range(8) for j in range(2) for e in range(2)])
    dims = _score_dim.fn(k)
    print(f"scores, thread t={t}: K indices {k[:4].tolist()}, ... -> dimensions {dims[:4].tolist()}, ... "
          f"({int(dims.min())}..{int(dims.max())})")  # fmt: skip
    assert sorted(dims.tolist()) == list(range(32 * t, 32 * t + 32))
for g in (0, 1, 7):
    rows = torch.tensor([64 * m + 16 * 0 + 8 * h + g for m in range(2) for h in range(2)])
    print(f"values, warp 0, lane quad g={g}: rows {rows.tolist()} -> dimensions {_value_dim.fn(rows).tolist()}")
    assert sorted(_value_dim.fn(rows).tolist()) == list(range(4 * g, 4 * g + 4))

# %% [markdown]
# With 3-bit keys a thread's 32 codes are 96 bits, 12 bytes read as three 32-bit words, and a pair of codes (the
# two dimensions one A-operand register holds) is 6 bits, bits `[6u, 6u + 6)` for pair `u`: two of the sixteen
# pairs (`u = 5`, `10`) cross a word. The Gluon kernel first joins the words into four 24-bit groups (bits `24g`:
# `w0`, `w0 >> 24 | w1 << 8`, `w1 >> 16 | w2 << 16`, `w2 >> 8`), then takes four 6-bit pairs of each; every pair
# indexes a 64-entry pair LUT. The cell does that arithmetic on codes packed by the golden model.

# %%
gen = torch.Generator().manual_seed(3)
codes = torch.randint(0, 8, (32,), generator=gen)  # one thread's 32 dimensions of one key
words = torch.cat([tq.pack_codes(codes, 3), torch.zeros(4, dtype=torch.uint8)]).view(torch.int32).long() & 0xFFFFFFFF
w0, w1, w2 = words[:3].tolist()
groups = [w0 & 0xFFFFFF, ((w0 >> 24) | (w1 << 8)) & 0xFFFFFF, ((w1 >> 16) | (w2 << 16)) & 0xFFFFFF, w2 >> 8]
pairs = [(group >> (6 * j)) & 63 for group in groups for j in range(4)]  # pair u = 4g + j
print("pairs (lo code | hi code << 3):", pairs[:6], "...")
assert pairs == [int(codes[2 * u]) | int(codes[2 * u + 1]) << 3 for u in range(16)]

# %% [markdown]
# 3-bit values. The one-warp programs the H200 runs hold all 128 output rows in one warp, so lane quad `g` holds 16
# dimensions of each key; the kernel makes them `16g .. 16g + 15` (`_span_dim`), the 48 bits at value byte `6g`,
# which two aligned 32-bit words hold (from byte `6g - 2(g & 1)`: the span starts at byte 0 or 2 of the first).
# Each 12-bit field of 4 codes lies inside 16 bits that start at a byte (span bytes 0-1, 1-2, 3-4 and 4-5, the field
# at bit 0, 4, 0 and 4), so one `prmt` (byte permute, its selector set by the quad's parity) takes those 16 bits of
# two keys into the two halves of one register, which are then masked code by code; the middle two fields come from
# the span's bytes 1-4, one more `prmt` a key. No field leaves the lane's two words. An earlier layout gave each
# lane quad 4 codes of each of four 12-byte groups: 12-bit fields at bit `12g`, two of eight crossing a 32-bit word,
# whose rest came from the next lane quad by a warp shuffle and a funnel shift. The spans took a two-chunk step of
# stream-K (3bit_nc) from 988 to 924 warp instructions (Triton 3.6) and stage 1 at B=32 L=8K from 113.8 to 106.6
# us on the H200 (`perf_log.md`, twenty-fifth session). The cell reads one key's spans from bytes packed by the
# golden model with the kernel's selectors (`_span_selectors`, its Python body), one key at a time (the kernel's
# `prmt` takes two keys' halves at once).


# %%
def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte ``i`` of the result is byte ``selector``'s nibble ``i`` of ``b:a``."""
    source = a | b << 32
    return sum(((source >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


codes = torch.randint(0, 8, (128,), generator=gen)  # one key's value codes
value_bytes = bytes(tq.pack_codes(codes, 3).tolist())  # 48 bytes
for g in range(8):
    first = 6 * g - 2 * (g & 1)
    w0, w1 = (int.from_bytes(value_bytes[first + 4 * i : first + 4 * i + 4], "little") for i in (0, 1))
    middle_selector, pair_selector = (int(s) for s in _span_selectors.fn(torch.tensor(g & 1)))
    middle = prmt(w0, w1, middle_selector)  # span bytes 1-4
    halves = [(prmt(w0, w0, pair_selector), 0), (middle, 4), (middle >> 16, 0), (prmt(w1, w1, pair_selector), 4)]
    fields = [((half & 0xFFFF) >> bit) & 0xFFF for half, bit in halves]
    assert [(field >> 3 * r) & 7 for field in fields for r in range(4)] == codes[16 * g : 16 * g + 16].tolist()
    print(f"lane quad {g}: words from byte {first}, selectors {middle_selector:#06x} {pair_selector:#06x}")

# %% [markdown]
# A 16-entry table without memory. At the 4-bit kernel's speed before the stages, 9.8M of its 18.9M shared-memory
# wavefronts were bank conflicts of the pair-LUT gathers, so the lookup looked like the bound. `prmt` (byte permute)
# picks 4 bytes out of the 8 of two registers by 3-bit indices: the 16 fp16 centroids become 8 registers (the low
# bytes of centroids 0-3, 4-7, 8-11, 12-15, then the high bytes). Per 4 codes, two `prmt` pick among centroids
# 0-7 and 8-15; a byte mask from each code's bit 3 chooses between them (`prmt`'s sign mode copies the top bit of
# the byte it picks, and bit 3 of code `i` is the top bit of a byte of `w` or `w << 4`); the same for the high
# bytes; two more `prmt` interleave low and high bytes into fp16 pairs: 21 instructions for a word of 8 codes. The
# cell runs those instructions' definitions and checks them against the pair LUT. On the H200 the kernel with it
# first had 4.9M shared-memory wavefronts instead of 18.9M, 575 bank conflicts instead of 9.8M, and the same time
# (stage 1 at L=8K 172.5 -> 174.9 us, four programs a SM, hi + lo operands): the kernel waited on latency, not on
# its shared memory. With one fp16 rounding of the operands and five programs a SM the bound moved: Nsight Compute
# put 3.1 of a warp's 10 cycles between instructions on waits for shared-memory instructions, and the same lookup
# (`_nibble_pairs` in `triton_impl/turboquant_sm90.py`, 49 -> 15 shared loads a tile) took stage 1 from 163.9 to
# 156.7 us at L=8K and 594.4 to 570.9 at 32K (one A/B call). So it is the kernel's lookup now.


# %%
def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32 d, a, b, c`` (default mode): byte ``i`` of ``d`` is byte ``c[4i+2 : 4i]`` of ``b:a``, or
    that byte's top bit copied 8 times where ``c[4i+3]`` is set."""
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> 4 * i) & 0xF
        byte = source[nibble & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << 8 * i
    return out


def select_bytes(a: int, b: int, mask: int) -> int:
    """``lop3.b32 d, a, b, mask, 0xD8``: ``b`` where ``mask`` is set, else ``a``."""
    return (b & mask) | (a & ~mask & 0xFFFFFFFF)


fp16_bits = centroids.half().view(torch.int16).long().tolist()
tables = [sum(((fp16_bits[4 * k + i] >> shift) & 0xFF) << 8 * i for i in range(4))
          for shift in (0, 8) for k in range(4)]  # fmt: skip
pair_lut = [(fp16_bits[b & 15] & 0xFFFF) | (fp16_bits[b >> 4] & 0xFFFF) << 16 for b in range(256)]  # the kernel's


def nibble_pairs(w: int) -> list[int]:
    """The variant's 21 instructions: a word of 8 codes -> its 4 pair-LUT entries."""
    s0 = w & 0x77777777
    s1, y = s0 >> 16, (w << 4) & 0xFFFFFFFF
    masks = prmt(w, y, 0x9D8C), prmt(w, y, 0xBFAE)  # 0xFF in byte i where code i of the half is >= 8
    pairs = []
    for sel, mask in ((s0, masks[0]), (s1, masks[1])):
        lo = select_bytes(prmt(tables[0], tables[1], sel), prmt(tables[2], tables[3], sel), mask)
        hi = select_bytes(prmt(tables[4], tables[5], sel), prmt(tables[6], tables[7], sel), mask)
        pairs += [prmt(lo, hi, 0x5140), prmt(lo, hi, 0x7362)]
    return pairs


words = [*torch.randint(0, 2**32, (2000,), generator=gen).tolist(), 0, 0xFFFFFFFF, 0x89ABCDEF, 0x76543210]
for w in words:
    assert nibble_pairs(w) == [pair_lut[(w >> 8 * j) & 0xFF] for j in range(4)], hex(w)
print(f"prmt lookup == pair LUT for {len(words)} words (every byte value among them: "
      f"{len({(w >> 8 * j) & 0xFF for w in words for j in range(4)})} of 256)")  # fmt: skip

# %% [markdown]
# The shared-memory stages (4-bit values; 4-bit and FP8 keys by 16-byte copies, 3-bit keys by 4-byte copies of
# each thread's 12 bytes into a 16-byte slot): a stage holds a 64-key tile's keys as
# `[64 keys][key bytes]` and its values as `[warp q][64 keys][16 bytes]` (chunk `q` of a key's value bytes is
# warp `q`'s codes). Shared memory has 32 banks of 4 bytes; a warp's request takes one wavefront per phase
# (32 lanes for 2- and 4-byte reads, 16 for 8-byte, 8 for 16-byte ones) plus one more for every further
# distinct word a bank must deliver in that phase. The cell counts the wavefronts of the kernel's reads from
# a stage: lane `4 quad + t` of warp `w` reads key `16w + 8h + quad` at byte `16t` (4-bit: one 16-byte read
# a half) or `32t` (FP8: two), and the 16-bit value word `(64w + k) 16 + 2 quad` of key `k = 16c + 8j + 2t + e`.


# %%
def wavefronts(addresses: list[int], width: int) -> int:
    """Wavefronts of one warp-wide shared-memory read of ``width`` bytes a lane at ``addresses`` (lane order)."""
    lanes_per_phase = {2: 32, 4: 32, 8: 16, 16: 8}[width]
    total = 0
    for phase in range(0, 32, lanes_per_phase):
        words_of_bank = {}
        for address in addresses[phase : phase + lanes_per_phase]:
            for word in range(address // 4, (address + width + 3) // 4):
                words_of_bank.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in words_of_bank.values())
    return total


lanes = [(lane // 4, lane % 4) for lane in range(32)]  # (quad, t)
for name, key_bytes in (("4-bit keys", 64), ("FP8 keys", 128)):
    per_lane = key_bytes // 4  # bytes a lane reads from its key row
    reads = [[(16 * 0 + 8 * h + quad) * key_bytes + per_lane * t + 16 * i for quad, t in lanes]
             for h in range(2) for i in range(per_lane // 16)]  # fmt: skip
    counts = [wavefronts(read, 16) for read in reads]
    print(f"{name}: {len(reads)} 16-byte reads a lane and tile, {counts} wavefronts (4 is the least for 512 bytes)")
    assert counts == [4 if key_bytes == 64 else 8] * len(reads)  # FP8 rows: 8 lanes on each bank group
value_reads = [[(64 * 0 + 16 * c + 8 * j + 2 * t + e) * 16 + 2 * quad for quad, t in lanes]
               for c in range(4) for j in range(2) for e in range(2)]  # fmt: skip
counts = {wavefronts(read, 2) for read in value_reads}
print(f"4-bit values: {len(value_reads)} 2-byte reads a lane and tile, wavefronts {counts}")
assert counts == {1}

# %%
RESULTS = Path(triton_impl.__file__).resolve().parent.parent / "notebooks" / "results"
bench = json.loads((RESULTS / "bench_h200.json").read_text())
by_case = {row["case"]: row for row in bench["results"]}
batch, q_heads, bench_kv_heads = 32, 32, 8  # the case names below hold this shape


def decode_row(preset: str, length: int) -> dict:
    """The bench's decode row of ``preset`` at this shape and ``length`` keys a request."""
    return by_case[f"{preset} decode B={batch} Hq={q_heads} Hk={bench_kv_heads} D={D} L={length}"]


print(bench["header"])
for length in (8192, 32768):
    timed = []
    for preset in tq.PRESETS:
        row = decode_row(preset, length)
        slot_bytes = tq.TurboQuantConfig.from_cache_dtype(preset, D).slot_size_aligned
        # bytes the benchmark counted per (token, KV head): the cache slot plus a little query and output traffic
        counted = row["gbps"] * row["ms"] * 1e6 / (batch * bench_kv_heads * length)
        assert row["correct"], preset
        assert abs(counted - slot_bytes) < 0.01 * slot_bytes, (preset, counted, slot_bytes)
        timed.append((preset, slot_bytes, row))
    print(f"L={length}: against the bf16 GQA decode (512 cache bytes per token and KV head), timed beside each row")
    timed.sort(key=lambda item: -item[1])
    for preset, slot_bytes, row in timed:
        bf16_ms = row["baselines_ms"]["bf16 GQA decode"]
        print(f"  {preset:20s} {slot_bytes:4d} bytes  {row['ms']:.3f} ms  {bf16_ms / row['ms']:.2f}x the bf16 speed "
              f"({bf16_ms:.3f} ms)  {row['pct_roofline']:.1f}% of its copy roofline")  # fmt: skip
        assert row["ms"] < bf16_ms, preset  # every preset beats the bf16 decode
        layout = tq.TurboQuantConfig.from_cache_dtype(preset, D)
        # at twice its speed or more: every preset at both lengths (2.04-2.83x; 3-bit values 2.10x / 2.48x)
        assert row["ms"] <= 0.5 * bf16_ms, preset
        # MSE keys short of byte-bound (42-72% of the copy roofline), FP8 keys 78-82%
        assert row["pct_roofline"] < (85 if layout.key_fp8 else 75), preset
    for (fat, fat_bytes, fat_row), (lean, lean_bytes, lean_row) in itertools.pairwise(timed):
        assert fat_row["ms"] / fat_bytes < lean_row["ms"] / lean_bytes, (fat, lean)  # fewer bytes, more time a byte

# %% [markdown]
# **The part of a call that does not shrink with L.** At L=8K the MSE presets sit further from their roofline than
# at 32K (4-bit keys 61% against 72%). Stage 1 alone, timed on the H200 at every request length from 1K to 32K
# (`perf_log.md`, twenty-first session; the profiler's kernel time, the bench's shape: `benchmarks/turboquant_kernels.py
# 3bit_nc lengths`), grows by a fixed time per
# 1K keys and starts well above zero: the cell fits the line through 2K-32K. That intercept, the query's rotation
# and the split merge (3.4-3.8 and 2.5-3.6 us, two more kernels) and the idle gaps before and between the three
# kernels are paid once a call, whatever L. Two attempts to shorten it made stage 1 slower (merging the pieces in
# stage 1 itself, and fewer steps for the programs that hold two pieces), both kept in `benchmarks/variants/`. One
# did shorten it: for serving's rotation `PiT = c H_128` each stage 1 program now rotates its query itself (fp32
# butterflies over the 128 dimensions, in the order its MMA reads them; `H` is unchanged when the bits of both its
# indices are permuted alike), and the call launches no rotation kernel: 4-bit keys 112.8 -> 108.3 us at L=8K, 3-bit
# keys with 4-bit values 116.7 -> 110.6 (`perf_log.md`, thirty-fifth session). 3-bit values keep the launch, whose
# counts weigh their stream-K places.

# %%
stage1_us = {  # B=32 Hq=32 Hk=8 D=128, block 16, every request L keys: L -> stage 1 in us (H200, Triton 3.6)
    "turboquant_3bit_nc": {1024: 26.5, 2048: 43.3, 4096: 71.4, 8192: 128.1, 16384: 240.5, 32768: 464.8},
    "turboquant_4bit_nc": {1024: 22.3, 2048: 34.2, 4096: 55.7, 8192: 98.6, 16384: 184.3, 32768: 352.6},
}
for preset, times in stage1_us.items():
    slope, intercept = per_length_line(times)  # least squares through L = 2K..32K
    call_8k = decode_row(preset, 8192)["ms"] * 1e3
    print(f"{preset:20s} stage 1 = {slope:.2f} us per 1K keys + {intercept:.1f} us; the bench's L=8K call "
          f"{call_8k:.1f} us, of which {call_8k - slope * 8:.1f} us do not grow with L")
    assert 12 < intercept < 18 and 10 < slope < 15

# %% [markdown]
# The same line through the bench's own two lengths (the whole call, L=8K and 32K) splits each preset's call into a
# part per 1K keys and a part at L=0, and says what 70% of the roofline at L=8K would ask of either. Two lengths cannot
# tell a fixed cost from a per-key rate that is better at 32K than at 8K: the line is a way to read the rows, not a
# measurement of the fixed cost (`perf_log.md`, forty-fifth session).

# %%
for preset in tq.PRESETS:
    short, long = decode_row(preset, 8192), decode_row(preset, 32768)
    per_1k = (long["ms"] - short["ms"]) * 1e3 / 24  # us per 1K keys
    at_zero = short["ms"] * 1e3 - 8 * per_1k
    streamed = short["roofline_ms"] * 1e3 / 8 / per_1k  # the per-key part against the roofline's rate
    target = short["roofline_ms"] * 1e3 / 0.7  # the L=8K call at 70% of its roofline
    room = target - 8 * per_1k  # what the L=0 part may take at this slope
    print(f"{preset:20s} {per_1k:5.2f} us per 1K keys ({streamed:.0%} of the roofline's rate) + {at_zero:4.1f} us; "
          f"70% at L=8K is {target:5.1f} us: " + (f"an L=0 part of at most {room:.1f} us" if room > 0 else
                                                   "out of reach at this slope, whatever the L=0 part"))
    layout = tq.TurboQuantConfig.from_cache_dtype(preset, D)
    if layout.key_fp8:
        assert at_zero < 12 and short["pct_roofline"] > 70  # the FP8 grid kernel: little at L=0, 70% met
    elif layout.value_quant_bits == 4:
        assert streamed > 0.7 and at_zero > 20  # 3- and 4-bit keys: the keys stream near 70%, L=0 holds them back

# %% [markdown]
# **The same kernels on an H100.** A roofline belongs to a machine. The H100 has the H200's SMs at the same clock and
# 3.03 TB/s of copy bandwidth to the H200's 4.27, so a loop bound by its ALU pipe on the H200 sits nearer its memory
# floor there. One run of `benchmarks/read_floor.py` on an H100 at L=32K (`perf_log.md`, forty-ninth session): 4-bit
# keys at 87% of the H100's copy roofline, 3-bit keys and values 73%, FP8 keys 76%, the bf16 decode 99.6%. The
# exception is 3-bit keys with 4-bit values, at 53%: 1.98x the time of a plain read of its bytes, where 3-bit keys
# with 3-bit values (more ALU work a key, the same key codes) take 1.42x. What only that preset does is copy each
# token as two TMA boxes that share 16 bytes (its 64-byte data box and its 64-byte value box over a 112-byte slot).
# Three probes on 4-bit keys (`benchmarks/variants/tma_*_probe.patch`, fiftieth session) say that is not it: one more
# box a token costs about 4%, whether its bytes are in flight twice or not, and 3 points more when it starts 16 bytes
# off a 32-byte boundary. Nsight says what is: k3v4's stage 1 reads 1.65x its bytes from DRAM there, the other MSE
# presets 1.01-1.02x (`benchmarks/dram_bytes.py`). The L2's fill size for TMA copies moves it: with 64-byte fills
# instead of Triton's 128, k3v4's stage 1 at L=32K is 11% faster on the H100, which points there at lines filled and
# evicted before their other reader came, and 15% slower on the H200 (`benchmarks/tma_l2_promotion.sh`). Why k3v4's
# lines and not 3-bit values' (whose 96-byte slots share lines between KV heads too) is still open.

# %% [markdown]
# **Splitting where the keys are (stream-K).** The grid of splits gives every request `S` splits, whatever its
# length: a 32K-key request's splits are ten times as long as a 3K one's, and the last programs to finish keep SMs
# waiting. For 3- and 4-bit keys the sm_90 decode instead concatenates each KV head's 32-key steps over all requests
# and gives every program of one round the same number of them; a program's range may cross requests (each piece is
# a split of its own, in its own partial slot), and a long request among short ones is cut into more pieces. The
# kernel and `triton_impl.turboquant.stream_k_pieces` (the plain-Python division its tests check it against) make
# the same cut. Below, one KV head's keys of a small mixed batch over 6 programs and 8 slots, beside the grid's 8
# splits a request. The bench's mixed batch (32 requests of 1-32K keys) took stage 1 from 268 us to 204 us on the H200.

# %%
mixed_lengths, slots, programs = [32768, 3000, 300, 0, 17000], 8, 6
pieces = stream_k_pieces(mixed_lengths, table_keys=32768, step_keys=32, programs=programs, num_splits=slots)
steps = sum(-(-n // 32) for n in mixed_lengths)
print(f"{steps} steps of 32 keys over {programs} programs: {steps // programs}-{-(-steps // programs)} steps each")
for b, (length, taken) in enumerate(zip(mixed_lengths, pieces, strict=True)):
    sizes = [end - start for _, start, end in taken]
    grid = [min((s + 1) * -(-length // slots), length) - s * -(-length // slots) for s in range(slots)]
    print(f"  request {b} ({length:5d} keys): stream-K pieces {sizes}, grid splits {[n for n in grid if n > 0]}")
    assert sum(sizes) == length and len(taken) <= slots
# the longest request takes the most pieces; a short one one, or two where a program's steps begin inside it
assert [len(taken) for taken in pieces] == [4, 2, 1, 0, 2]

# %% [markdown]
# **A miscompile the golden model catches.** vLLM's v2 TurboQuant decode interleaves the two
# nibbles of each value byte (`tl.interleave`) and feeds them to a `tl.dot` over 16 keys. Triton 3.6
# (the H200 machine's) picks an operand layout too wide for K = 16 and returns wrong products; K = 32
# is right (fixed upstream in Triton PR 11691). No unit test of the unpacking sees it, because the
# unpacking is right: only comparing the kernel's attention output with the golden decode on the same
# cache bytes shows it. `tests/test_turboquant.py::test_interleaved_nibbles_into_a_16_key_dot_are_never_our_pattern`
# reproduces the miscompile on a GPU (skipped where the compiler gets it right) and holds this
# package's decode to tiles of at least 32 keys.

# %% [markdown]
# ## 7. The store: a memory-bound kernel that is not
#
# The store writes one (token, KV head) row per key and value: it reads 256 bytes of bf16 key and 256 of value
# (D = 128), rotates the key (`k @ PiT`), takes its norm, bucketizes each rotated coordinate against the codebook's
# midpoints, packs the codes, quantizes the values min-max, and writes a slot (4-bit keys and values: 64 + 64 bytes of
# codes and three fp16 fields). About 650 bytes moved and ~30 arithmetic operations per coordinate: on paper a copy.
# The cell reads the H200 benchmark's store rows (1M tokens x 8 KV heads), beside the copy roofline of their bytes.

# %%
for preset in tq.PRESETS:
    row = by_case[f"{preset} store Hk=8 D=128 1024K tokens"]
    assert row["correct"], preset
    print(f"{preset:20s} {row['ms']:.3f} ms  {row['gbps']:5.0f} GB/s  {row['pct_roofline']:.1f}% of the copy roofline "
          f"({row['roofline_ms']:.3f} ms)")  # fmt: skip
    # FP8 keys (no rotation, no bucketize) near 71%; the MSE presets 63-70%
    assert 58 < row["pct_roofline"] < 80, preset

# %% [markdown]
# On sm_90 the MSE presets' store is a Gluon kernel (`triton_impl/turboquant_sm90.py`, `store_kernel`): persistent
# programs of one warpgroup, each on 64-row tiles, `PiT` split into two bf16 parts in shared memory (64 KiB: three
# programs a SM) so that the rotation is 16 exact warpgroup MMAs a tile, and the bucketize one lookup per code in a
# 64-slot table (`grid_table`; 32 slots now) instead of a binary search. Its path on the H200, 4-bit keys and values
# (`perf_log.md` has each step's prediction and A/B): the portable Triton kernel 9.52 ms; the Gluon store with the
# binary search 3.61; with the table 2.98; three programs a SM 2.80; each program's next tile prefetched into L2 2.75;
# each tile's keys loaded into registers during the tile before it 2.71; each row's value scale and zero stored from the
# layout they were reduced to 2.57.
#
# That last step is the one to learn from. A Triton tensor has a layout: which thread and register holds each
# element. Every `convert_layout` that moves elements between warps, and every `gl.gather` whose table is spread over
# warps, goes through shared memory between two barriers of the whole program (`bar.sync`): all four warps wait for
# the slowest. The store used to convert each row's two value fields, their slot offsets and their mask to a layout
# of one row per thread before storing them: four conversions, eight barriers a tile, to buy coalescing that rows
# headed for scattered slots cannot have. Stored from the layout they were computed in, the loop has 37 instructions
# fewer (Triton 3.6 at the entry's 168 registers, 2176 -> 2139) and 4 barriers a tile instead of 12, and the store
# is 2-6% faster (4-bit 2.73 -> 2.58 ms, 3-bit 2.44 -> 2.39). Fewer barriers is not always faster, though: the norm
# correction's lookup done by warp shuffles (a copy of the table per warp, no barrier) was 2-11% slower
# (`benchmarks/variants/warp_local_centroids.patch`).
#
# What held that kernel at half its roofline was occupancy: `PiT`'s 64 KiB a program and 168 registers a thread
# allow three programs, 12 warps a SM, and each tile waits on its loads and its gathers. The rotation serving uses is
# the Sylvester-Hadamard matrix (`hadamard_rotation` without a seed: `PiT = c H` with `c = 128^-1/2` and `H[j, n] =
# (-1)^popcount(j & n)`), and `k @ H` needs no matrix: it is seven butterfly stages (`a, b -> a + b, a - b`, the fast
# Walsh-Hadamard transform), 7 x 128 additions a row against 128 x 128 multiply-adds. `store_hadamard_kernel` gives
# each lane quad one row (32 contiguous dimensions a thread): `H_128 = H_4 (x) H_32`, so five stages run in each
# thread's registers and two across the quad (a shuffle and an fma each). In fp32 the butterflies are exact but for
# their roundings (`FP32_GEMM`'s tie band, tighter than the MMA store's `BF16X2_GEMM`). With no `PiT` in shared memory
# and 32 values a thread instead of 64, six programs of 4 warps share a SM at 80 registers, 24 warps; the price is
# 21% more instructions a row (the butterflies are 288 of a tile's 1298 a thread). 4-bit 2.58 -> 2.20 ms, k3v4 2.61
# -> 2.21, 3-bit 2.41 -> 2.03 (56-59% of the copy roofline). The wrapper checks `PiT` once per tensor
# (`turboquant_sm90.is_hadamard_rotation`); any other rotation takes the MMA store. For 4-bit keys the entry takes the
# `H_32` factor to the tensor cores after all (`_hadamard_rows_mma`: the +-1 matrix is exact in bf16 and small enough
# for registers, a row's four residues mod 4 are four MMA rows of the thread that loaded them, and `H_4` stays in
# registers), 1070 instructions a tile, 2.20 -> 2.12 ms at five programs a SM.
#
# Then Nsight's source page showed what its warps waited on: 14% of the samples at the two barriers around the gathers'
# table stores, and L1 at 86% of its throughput, 44% of it the gathers' shared-memory wavefronts (a lookup of a 64-slot
# table of 8-byte entries conflicts on its banks: 4.6 wavefronts a load where 2 would do). A table of 32 slots fits a
# warp, an entry a lane; viewed as `[warps, 1024]`, each warp's codes index its own copy, and `gl.gather` lowers to one
# `shfl.idx` a code (`turboquant_sm90._lookup`): no shared memory, no barrier. With the codes' stores 16 bytes wide and
# L2 hints that keep the slots' 2-byte fields (a sector the block's other 15 positions fill later) and let the rows and
# codes go first: 4-bit 2.14 -> 1.82 ms, k3v4 2.21 -> 1.97, 3-bit 2.03 -> 1.92 (the bench at 658a2cf and 00a5c3a; 63-70%
# of the copy roofline, a prefill's consecutive slots 70-78%). In the MMA store the same shuffles, for the centroids'
# squares alone, had lost 2-11% (why was not measured); here they replace all of the loop's shared-memory traffic and
# its barriers. Last, occupancy: the 3-bit keys' loop compiles to the same 1282 instructions a tile at 64 registers as
# at 80, with no spill (ptxas issues the tile's loads later instead), so eight programs share a SM, 32 warps where 24
# were: k3v4 1.97 -> 1.92 ms, 3-bit 1.92 -> 1.86 (64.5%, 64.9%; the bench at 076fef5). Nsight still finds 37% of
# the 3-bit store's samples at two waits on the tile's own loads. For 4-bit keys, each row's value min and max by
# packed bf16 `min` / `max` on the values as loaded (two an instruction, exact; 1080 -> 1043 instructions a tile) took
# the store 1.83 -> 1.80 ms (69.6 -> 70.5%, the bench at 4bd4524); the same cut made the 3-bit store 7% slower.
#
# What binds the 3-bit stores is not their instruction count: `H_4` by warp MMAs took 7% of the 3-bit loop's
# instructions (all 64 butterfly shuffles across a row's four threads) and changed nothing, and Nsight Compute's byte
# counts say it is not DRAM either. At random slots DRAM moves about 15% more than the roofline counts (the partly
# written sectors of other tokens' slots are read to be merged, 340 MB for the 3-bit store); at consecutive slots it
# moves exactly the roofline's bytes, yet the store takes 96% as long, with DRAM at 2.9 of its 4.3 TB/s
# (`perf_log.md`, thirty-eighth session, has the table and the variants).
#
# What moved them was the order of their stores. A thread's 12 bytes of 3-bit codes go out as three 4-byte stores,
# and a sector of a slot is written by several of them; Nsight's L2 counts show that stores of a warp to one line that
# issue back to back arrive as fewer requests and sectors than the same stores apart (the packed extrema above had
# moved the 3-bit key stores 21 instructions apart: 39.1M write requests against 28.5M, the 7%). With each row's key
# code stores issued beside its value code stores, its key norm beside its value fields, the next tile's keys read
# after them, and the packed extrema for 3-bit keys too: k3v4 1.91 -> 1.78 ms, 3-bit 1.84 -> 1.73-1.76 (64.6 ->
# 69.5-69.8%, 65.4 -> 68.8-69.5%; two bench runs at e28c9a3). 4-bit keys, whose codes were whole 16-byte stores
# already, lost at consecutive slots that way and keep the old order. The sectors alone do not set the time: moving
# the 3-bit codes across each lane quad so that a row's three 32-byte sectors are three 8-byte stores took L2's write
# sectors to their floor (six a row) and made the store 4.5% slower (35 more instructions a tile).
#
# Last, two clamps a value and one a code went into saturating arithmetic. A value's level is `LEVELS` times its share
# of the row's range, and one `mul.rn.sat.f32` takes that share clamped to `[0, 1]`, NaN to 0: the clamp of the value to
# the row's min and max (two `FMNMX`) comes with the product. A key's grid slot by `fma.rn.sat.f32` sends a negative
# result or NaN to slot 0 instead of slot 31, where the same table gives them the same code 0, and drops the integer min
# that caught them (`turboquant_sm90.saturated_grid_slot`; the grid's model checks it on every kind of codebook on the
# CPU, the GPU probe on the H200). 1242 -> 1214 instructions a tile for 3-bit keys, 1043 -> 1012 for 4-bit keys, the cut
# mostly on the ALU pipe (the 3-bit loop's ALU instructions 348 -> 325, `FMNMX` and `VIMNMX` 142 -> 47; the `H_4` MMAs
# above had taken shuffles and fmas instead), and the stores 0.3-1.9% faster: k3v4 1.78 -> 1.76 ms, 3-bit 1.73-1.76 ->
# 1.72 (70.3-70.4% of the copy roofline at random slots in two bench runs at b8f087c), 4-bit 70.7-70.9%, FP8 keys
# 70.4-70.6%.
#
# The cell compiles both stores for sm_90 on this machine (Triton's own `ptxas`; no GPU needed, a process of its own
# since the interpreter is on here) and counts what is in their tile loops: in the MMA store two barriers around each
# of the two gathers (the grid's table and, with norm correction, the centroids' squares); in the Hadamard store no
# barrier, an index shuffle a code for each table, and the butterflies' 64 shuffles a tile beside the row
# reductions'.

# %%
COUNT_LOOP = """
import json
from triton_impl.bench import sass_loop
from triton_impl.turboquant import STORE_CONFIGS
from triton_impl.turboquant_sm90 import compile_store_for_sm90
entry = STORE_CONFIGS["sm90"]  # the butterflies' and the MMA store's register caps
for hadamard, norm_correction in ((False, True), (False, False), (True, True), (True, False)):
    # the innermost loop with the rotation's MMAs (the Hadamard store's: its shuffles): the grid lookup's tile loop
    # (the binary search, for codebooks the grid cannot separate, is a second, longer copy of it)
    cubin = compile_store_for_sm90(norm_correction=norm_correction, hadamard=hadamard,
                                   maxnreg=entry["HADAMARD_MAXNREG" if hadamard else "GLUON_MAXNREG"]).asm["cubin"]
    body = [line for line in sass_loop(cubin, "SHFL" if hadamard else "HGMMA") if " NOP " not in line]
    print(json.dumps([hadamard, norm_correction, len(body), sum(" BAR.SYNC" in line for line in body),
                      sum(" STS" in line for line in body), sum(" SHFL.BFLY" in line for line in body),
                      sum(" SHFL.IDX" in line for line in body)]))
"""
env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(triton_impl.__file__).resolve().parent.parent)}
done = subprocess.run([sys.executable, "-c", COUNT_LOOP], env=env, capture_output=True, text=True, timeout=600)
assert done.returncode == 0, done.stderr[-2000:]
for line in done.stdout.splitlines():
    hadamard, norm_correction, instructions, barriers, table_stores, shuffles, lookups = json.loads(line)
    rows = 32 if hadamard else 64
    print(f"{'Hadamard' if hadamard else 'MMA':8s} store, norm correction {norm_correction!s:5}: {instructions} "
          f"instructions a tile of {rows} rows and thread ({instructions * 4 / rows:.0f} warp instructions a row), "
          f"{barriers} barriers, {table_stores} gather tables stored to shared memory, {shuffles} butterfly shuffles, "
          f"{lookups} lookup shuffles")
    if hadamard:  # a thread's 32 codes, looked up in two tables (and the centroids' squares) by shuffles
        assert barriers == table_stores == 0 and shuffles >= 64 and lookups == 32 * (2 + norm_correction)
    else:
        assert barriers == 2 * table_stores == (4 if norm_correction else 2)
