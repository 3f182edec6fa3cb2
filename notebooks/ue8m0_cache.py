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
# # UE8M0 FP8 K cache: power-of-two scales, rounding up, and the 584-byte record
#
# DeepSeek-V4 stores each K vector in its paged cache as 448 FP8 e4m3 values in 7 groups of 64,
# each group with one shared power-of-two scale written as an 8-bit exponent (UE8M0), plus the 64
# RoPE dimensions kept as bf16. This notebook looks at the FP8 grid, at what restricting the scale
# to powers of two costs, at DeepSeek's rounding of the scale *up* against the OCP MX rule that
# rounds it *down*, and at the byte layout. Ops: `golden/ue8m0_cache.py`,
# `triton_impl/ue8m0_cache.py` (papers.md#ue8m0-cache).

# %%
import matplotlib.pyplot as plt
import torch

import triton_impl  # noqa: F401  (selects the Triton interpreter on a CPU-only machine)
from golden.ue8m0_cache import (
    GROUP_SIZE,
    NOPE_DIM,
    NUM_GROUPS,
    PAGE_ALIGNMENT,
    RECORD_BYTES,
    ROPE_DIM,
    SCALE_BYTES,
    TOKEN_DATA_BYTES,
    block_bytes,
    decode_records,
    dequantize_ue8m0,
    encode_records,
    fp8_dtype,
    fp8_max,
    quantize_mx,
    quantize_ue8m0,
    read_records,
    ue8m0_exponent,
)
from triton_impl.ue8m0_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)
torch.manual_seed(0)  # torch.distributions samples from the global generator

# %% [markdown]
# ## The e4m3 grid
#
# Every byte decodes to a value; the positive finite ones are the grid a scaled group is rounded
# to. OCP `e4m3fn` (bias 7) tops out at 448 and has 126 positive values; the FNUZ variant (bias 8)
# at 240 with 127 (vLLM clamps FNUZ at 224). Between consecutive powers of two there are 8 values,
# so the spacing relative to the value is 1/15 to 1/8 and round-to-nearest is within half of
# that: at most 1/16 = 6.25% relative error for normal values.

# %%
for use_fnuz in (False, True):
    values = torch.arange(256, dtype=torch.uint8).view(fp8_dtype(use_fnuz)).float()
    positive = values[torch.isfinite(values) & (values > 0)].unique()
    print(
        f"{'FNUZ' if use_fnuz else 'OCP '}: {positive.numel()} positive values, max {positive.max().item():g}, "
        f"smallest normal {positive[positive >= 2.0 ** (-6 - use_fnuz)].min().item():g}, "
        f"smallest subnormal {positive.min().item():g}"
    )
ocp = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
ocp = ocp[torch.isfinite(ocp) & (ocp > 0)].unique()
relative_step = (ocp[1:] - ocp[:-1]) / ocp[:-1]
normal = ocp[:-1] >= 2.0**-6
print(
    f"relative step between normal neighbours: {relative_step[normal].min():.4f} .. {relative_step[normal].max():.4f}"
)
all_values = {
    fnuz: torch.arange(256, dtype=torch.uint8).view(fp8_dtype(fnuz)).float().unique() for fnuz in (False, True)
}  # every distinct value of each format
for fnuz, count, top in ((False, 126, 448), (True, 127, 240)):
    positive = all_values[fnuz][torch.isfinite(all_values[fnuz]) & (all_values[fnuz] > 0)]
    assert positive.numel() == count and positive.max() == top
assert fp8_max(True) == 224  # the FNUZ clamp serving uses
per_binade = torch.floor(torch.log2(ocp[ocp >= 2.0**-6])).unique(return_counts=True)[1]
assert bool((per_binade[:-1] == 8).all())  # 8 values per binade (the top one stops at 448)
assert relative_step[normal].min() == 1 / 15 and relative_step[normal].max() == 1 / 8
print(f"largest rounding error of a normal value: half the largest step, {relative_step[normal].max() / 2:.2%}")

fig, ax = plt.subplots(figsize=(9, 2.2))
ax.vlines(ocp, 0, 1, linewidth=0.6)
ax.set_xscale("log", base=2)
ax.set_yticks([])
ax.set_title("positive e4m3fn values (log2 axis): 8 per binade, subnormals below 2^-6")
plt.show()

# %% [markdown]
# ## What a power-of-two scale costs
#
# With an exact scale `s = amax / 448` the group's largest value lands on 448. A UE8M0 scale is
# `2^e` with `e = ceil(log2(amax / 448))`, so `amax / 2^e` lands anywhere in `(224, 448]`: the
# scale is between 1 and 2 times larger than needed, at most one bit of the format's range. The
# exponent is computed from the binary exponent (`frexp`), exactly; at `amax = 448 * 2^k` it is
# `k`, one bf16 ulp above it `k + 1`.

# %%
amax = torch.tensor([448.0, 3584.0, 3600.0, 3568.0, 500.0, 1e-4, 0.0])
print("amax:        ", amax.tolist())
exponents = ue8m0_exponent(amax.clamp(min=1e-4), fp8_max(False))
print("e (OCP, 448):", exponents.tolist())
above = (torch.tensor(3584.0, dtype=torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16)  # 448 * 2^3, one ulp up
assert float(above) == 3600.0 and exponents[1] == 3 and exponents[2] == 4
ratio = torch.linspace(1.0, 4.0, 601)
headroom = ratio / torch.exp2(ue8m0_exponent(ratio * 448.0, 448.0).double())
assert bool(((448 * headroom > 224) & (448 * headroom <= 448)).all())
plt.figure(figsize=(7, 2.8))
plt.plot(ratio, 448 * headroom)
plt.xlabel("amax / 448")
plt.ylabel("amax / 2^e  (stored top value)")
plt.title("the group's largest value after the power-of-two scale: always in (224, 448]")
plt.show()

# %% [markdown]
# Because e4m3 is itself a floating-point grid, its relative rounding error hardly depends on
# where the scale puts the values: the RMS error of a Gaussian group with a UE8M0 scale stays
# within 25% of that with an exact fp32 scale `amax / 448` (the ratio is printed below). What the
# power-of-two scale costs is range: the top binade may go unused, so small values of the group
# sit up to one binade closer to the subnormals and to zero.

# %%
groups = torch.randn(2000, 64, generator=gen, dtype=torch.float64)
rms_ratio = []
for r in ratio[::20]:
    x = groups / groups.abs().amax(-1, keepdim=True) * 448.0 * r.item()  # every group has amax = r * 448
    fp8, codes = quantize_ue8m0(x)
    ue8m0_err = (dequantize_ue8m0(fp8, codes) - x).pow(2).mean().sqrt()
    exact_scale = x.abs().amax(-1, keepdim=True) / 448.0  # the baseline: an fp32 scale, e4m3 values
    exact_err = (
        ((x / exact_scale).to(torch.float32).to(torch.float8_e4m3fn).double() * exact_scale - x).pow(2).mean().sqrt()
    )
    rms_ratio.append((ue8m0_err / exact_err).item())
plt.figure(figsize=(7, 2.8))
plt.plot(ratio[::20], rms_ratio, marker=".")
plt.xlabel("amax / 448")
plt.ylabel("RMS error, UE8M0 / exact scale")
plt.show()
print(f"RMS error ratio: min {min(rms_ratio):.2f}, max {max(rms_ratio):.2f}")
assert min(rms_ratio) > 0.75 and max(rms_ratio) < 1.25

# %% [markdown]
# ## Rounding the exponent up (DeepSeek) or down (OCP MX)
#
# The OCP MX reference picks `e = floor(log2(amax)) - 8`, which puts `amax / 2^e` in `[256, 512)`
# and saturates what lands above 448. With `amax = 500`: MX keeps `e = 0` and stores 448 (-10.4%);
# DeepSeek's rule takes `e = 1`, scales to 250, which e4m3 rounds to 256, and gathers 512 (+2.4%).

# %%
x = torch.zeros(1, 64)
x[0, 0] = 500.0
gathered = {}
for name, quantize in (("UE8M0 (ceil)", quantize_ue8m0), ("OCP MX (floor)", quantize_mx)):
    fp8, codes = quantize(x)
    back = dequantize_ue8m0(fp8, codes)[0, 0].item()
    gathered[name] = (int(codes[0, 0]) - 127, back)
    print(f"{name:15s} e = {int(codes[0, 0]) - 127:+d}, stored byte 0x{int(fp8[0, 0]):02X}, gathers {back:g} "
          f"({(back - 500) / 500:+.1%})")  # fmt: skip
assert gathered == {"UE8M0 (ceil)": (1, 512.0), "OCP MX (floor)": (0, 448.0)}
assert torch.tensor(250.0).to(torch.float8_e4m3fn).float() == 256  # 500 / 2^1 rounds to 256 in e4m3

# %% [markdown]
# Over many groups the two rules agree (the same bytes) whenever MX's `amax / 2^e` is at most
# 448; otherwise MX clips the largest values (errors up to 64 units of the scale, the gap
# between 448 and 512), while round-up keeps every value within half an ulp of e4m3 at the cost
# of a coarser grid.

# %%
heavy = torch.distributions.StudentT(3.0).sample((4000, 64)).double()  # heavy tails: outliers near amax
results, quantized, scaled = {}, {}, {}
for name, quantize in (("UE8M0 (ceil)", quantize_ue8m0), ("OCP MX (floor)", quantize_mx)):
    fp8, codes = quantize(heavy)
    quantized[name] = (fp8, codes)
    scale = torch.exp2(codes.double() - 127).repeat_interleave(64, dim=-1)
    scaled[name] = heavy / scale
    results[name] = ((dequantize_ue8m0(fp8, codes) - heavy) / scale).flatten()
saturates = heavy.abs().amax(-1) / torch.exp2(torch.floor(torch.log2(heavy.abs().amax(-1)))) * 256 > 448
print(f"groups that MX saturates: {100 * saturates.float().mean():.1f}%")
(ds_fp8, ds_codes), (mx_fp8, mx_codes) = quantized["UE8M0 (ceil)"], quantized["OCP MX (floor)"]
assert torch.equal(ds_codes[~saturates], mx_codes[~saturates]) and torch.equal(ds_fp8[~saturates], mx_fp8[~saturates])
mx_error = results["OCP MX (floor)"].abs()
assert 16 < mx_error.max() <= 64  # beyond half an ulp of the top binade, at most the 448..512 gap
y = scaled["UE8M0 (ceil)"].abs().flatten()
half_ulp = torch.exp2(torch.floor(torch.log2(y.clamp(min=2.0**-6))) - 3) / 2  # e4m3: 3 mantissa bits, subnormals below
assert bool((results["UE8M0 (ceil)"].abs() <= half_ulp).all())
fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, (name, err) in zip(axes, results.items()):
    ax.hist(err.numpy(), bins=120, log=True)
    ax.set_title(f"{name}: max |err| = {err.abs().max():.1f} units of 2^e")
    ax.set_xlabel("error / group scale")
plt.show()

# %% [markdown]
# ## The record and the block
#
# A token takes 584 bytes, in two places of its block: 576 bytes of token data (448 e4m3 bytes,
# then 64 bf16 RoPE values, little-endian) at `p * 576`, and 8 scale bytes (7 codes and a zero)
# after all token data, at `bs * 576 + p * 8`. Serving pads a block to a multiple of 576 bytes.

# %%
bs = 4
fig, ax = plt.subplots(figsize=(10, 1.8))
for p in range(bs):
    ax.broken_barh([(p * 576, 448)], (0, 1), color="tab:blue")
    ax.broken_barh([(p * 576 + 448, 128)], (0, 1), color="tab:orange")
    ax.broken_barh([(bs * 576 + p * 8, 7)], (0, 1), color="tab:green")
    ax.text(p * 576 + 200, 0.4, f"token {p}", fontsize=8)
ax.broken_barh([(bs * 584, block_bytes(bs) - bs * 584)], (0, 1), color="lightgray")
ax.set_yticks([])
ax.set_xlabel("byte offset in the block")
ax.set_title(f"block of {bs} tokens: fp8 NoPE (blue), bf16 RoPE (orange), UE8M0 codes (green), padding (grey)")
plt.show()
print({b: (block_bytes(b, padded=False), block_bytes(b)) for b in (16, 64, 256)})
assert (NOPE_DIM, ROPE_DIM, GROUP_SIZE, NUM_GROUPS) == (448, 64, 64, 7)
assert TOKEN_DATA_BYTES == NOPE_DIM + 2 * ROPE_DIM == 576 and SCALE_BYTES == NUM_GROUPS + 1 == 8
assert RECORD_BYTES == TOKEN_DATA_BYTES + SCALE_BYTES == 584 and PAGE_ALIGNMENT == 576
for b in (bs, 16, 64, 256):
    assert block_bytes(b, padded=False) == b * 584 and block_bytes(b) % 576 == 0 and block_bytes(b) - b * 584 < 576

# %% [markdown]
# The Triton kernels write and read exactly these bytes: insert three tokens, compare the records
# with the golden encoder, gather them back and compare with the golden decoder, bit for bit.

# %%
k = (torch.randn(3, 512, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]).to(torch.bfloat16)
cache = torch.zeros(2, block_bytes(16), dtype=torch.uint8, device=device)
slots = torch.tensor([17, 3, 30], device=device)
quantize_and_insert_k_cache(k.to(device), cache, slots, block_size=16)
records = read_records(cache.cpu(), slots.cpu(), 16)
assert torch.equal(records, encode_records(k))
print("scale codes of the three tokens:", records[:, 576:583].tolist())
block, p = divmod(17, 16)  # slot 17: block 1, position 1; the record's two places in the block's bytes
raw = cache[block].cpu()
assert torch.equal(raw[p * 576 : p * 576 + 576], records[0, :576]) and raw[16 * 576 + p * 8 + 7] == 0
assert torch.equal(raw[16 * 576 + p * 8 : 16 * 576 + p * 8 + 8], records[0, 576:])
assert torch.equal(raw[p * 576 + 448 : p * 576 + 576].view(torch.bfloat16), k[0, 448:])  # RoPE as bf16 bytes

out = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device=device)
table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
seq_lens, gather_lens = (torch.tensor([n], dtype=torch.int32, device=device) for n in (4, 1))  # position 3
dequantize_and_gather_k_cache(out, cache, seq_lens, gather_lens, table, 16, 0)
assert torch.equal(out[0, 0].cpu().view(torch.int16), decode_records(encode_records(k[1:2]))[0].view(torch.int16))
error = (out[0, 0, :448].cpu().float() - k[1, :448].float()).abs().max().item()
rope_identical = torch.equal(out[0, 0, 448:].cpu(), k[1, 448:])
print(f"token at slot 3 gathered back; max NoPE error {error:.4f}, RoPE identical: {rope_identical}")
assert rope_identical
