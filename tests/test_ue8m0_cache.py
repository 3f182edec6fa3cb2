"""UE8M0 FP8 K cache: Triton insert/gather == golden byte for byte, the format's edge cases by hand."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import triton_impl.ue8m0_cache as kernels
from golden.ue8m0_cache import (
    NOPE_DIM,
    RECORD_BYTES,
    TOKEN_DATA_BYTES,
    block_bytes,
    decode_records,
    dequantize_ue8m0,
    encode_records,
    gather_k_cache,
    insert_k_cache,
    quantize_mx,
    quantize_ue8m0,
    read_records,
)
from tests.support import assert_bits_equal, generator
from triton_impl.ue8m0_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache

BF16_MAX = torch.finfo(torch.bfloat16).max  # 0x7F7F = (2 - 2^-7) * 2^127
E4M3_MIN_EXPONENT = {False: -6, True: -7}  # smallest normal binade: OCP bias 7, FNUZ bias 8

# The per-value variants of LaunchConfig, applied over the device's table entry (whose own choice,
# e.g. sm90's "cvt", they override): the integer code, and every other option in at least one
# variant. The exhaustive and property tests run each.
VARIANTS = {
    "int": {"decode": "int", "fnuz_encode": "int", "rope_words": False},
    "cvt": {"decode": "cvt", "fnuz_encode": "cvt", "rope_words": True},
    "table": {"decode": "table", "fnuz_encode": "int", "rope_words": True},
    # Loops: the insert's grid capped at 1 program (looping over every tile), pipelined loads (compiled), the
    # gather's block-table entries loaded an iteration ahead, in 4-token gather tiles; register caps.
    "loop": {"decode": "cvt", "fnuz_encode": "cvt", "rope_words": True, "insert_programs": 1, "stages": 2,
             "prefetch_table": True, "gather_tokens": 4, "insert_max_registers": 48, "gather_max_registers": 40},
    "branch": {"decode": "branch", "fnuz_encode": "cvt", "rope_words": True, "evict": True, "fnuz_gather_warps": 2,
               "fnuz_gather_tokens": 2},
}
variants = pytest.mark.parametrize("variant", list(VARIANTS))


@contextlib.contextmanager
def _variant(name: str):
    """Launch both kernels with ``VARIANTS[name]`` over the device's config."""
    select = kernels.select_launch_config
    with mock.patch.object(kernels, "select_launch_config", lambda d: dataclasses.replace(select(d), **VARIANTS[name])):
        yield


def _keys(num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 K rows whose 8 groups of 64 have magnitudes 2^-40 .. 2^40 (some below the 1e-4 floor),
    some all-zero groups and some -0 entries."""
    k = torch.randn(num_rows, 512, generator=gen, dtype=torch.float64)
    group_exponent = torch.randint(-40, 41, (num_rows, 8), generator=gen).double()
    k = k * torch.exp2(group_exponent).repeat_interleave(64, dim=1)
    zero_groups = (torch.rand(num_rows, 8, generator=gen) < 0.1).repeat_interleave(64, dim=1)
    k[zero_groups] = 0.0
    k[torch.rand(num_rows, 512, generator=gen) < 0.02] = -0.0
    return k.to(torch.bfloat16)


def _cache(num_blocks: int, block_size: int, stride: str, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A cache of random bytes (so untouched bytes are checked too) with the block stride of
    serving ("padded" to a multiple of 576), "unpadded" (bs * 584) or "odd" (bs * 584 + 1)."""
    raw = block_bytes(block_size, padded=False)
    width = {"padded": block_bytes(block_size), "unpadded": raw, "odd": raw + 1}[stride]
    storage = torch.randint(0, 256, (num_blocks, width), generator=gen, dtype=torch.uint8)
    if layout == "3d":  # [nb, bs, 584] view, as vLLM allocates it; stride(0) stays the padded width
        return storage[:, :raw].view(num_blocks, block_size, RECORD_BYTES)
    return storage


def _slots(num_tokens: int, capacity: int, gen: torch.Generator, skip_fraction: float) -> torch.Tensor:
    """Distinct slots in a shuffled order; some tokens skipped with -1 or another negative value."""
    slots = torch.randperm(capacity, generator=gen)[:num_tokens]
    skip = torch.rand(num_tokens, generator=gen) < skip_fraction
    slots[skip] = -torch.randint(1, 3, (int(skip.sum()),), generator=gen)
    return slots


def _assert_same_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Identical bf16 bits, except that any NaN equals any NaN (NaN payloads differ between
    torch's and the GPU's float -> bf16 conversions and carry no value)."""
    a, e = actual.cpu(), expected.cpu()
    assert torch.equal(torch.isnan(a), torch.isnan(e)), "NaN positions differ"
    keep = ~torch.isnan(e)
    assert_bits_equal(a[keep], e[keep])


def _half_ulp_bound(x: torch.Tensor, codes: torch.Tensor, use_fnuz: bool) -> torch.Tensor:
    """Half an e4m3 ulp of ``x / 2^e`` at its group's scale ``2^e``: the round-to-nearest error bound."""
    scale = torch.exp2(codes.double() - 127).repeat_interleave(64, dim=-1)
    y = (x.double() / scale).abs()
    binade = torch.floor(torch.log2(y.clamp(min=1e-300))).clamp(min=E4M3_MIN_EXPONENT[use_fnuz])
    return 0.5 * torch.exp2(binade - 3) * scale


# -- insert ---------------------------------------------------------------------------------------


@variants
@given(
    num_tokens=st.integers(1, 24),
    block_size=st.sampled_from([16, 64, 256]),
    stride=st.sampled_from(["padded", "unpadded", "odd"]),
    layout=st.sampled_from(["2d", "3d"]),
    use_fnuz=st.booleans(),
    skip_fraction=st.sampled_from([0.0, 0.3]),
    padding_rows=st.sampled_from([0, 3]),
    slot_dtype=st.sampled_from([torch.int64, torch.int32]),
    seed=st.integers(0, 2**31 - 1),
)
@example(
    num_tokens=1, block_size=16, stride="odd", layout="2d", use_fnuz=False, skip_fraction=0.0, padding_rows=0,
    slot_dtype=torch.int64, seed=0,
)  # fmt: skip
@example(
    num_tokens=17, block_size=16, stride="padded", layout="3d", use_fnuz=True, skip_fraction=0.3, padding_rows=3,
    slot_dtype=torch.int32, seed=1,
)  # fmt: skip
def test_insert_matches_golden_bytes(
    device, variant, num_tokens, block_size, stride, layout, use_fnuz, skip_fraction, padding_rows, slot_dtype, seed
) -> None:
    """Every byte of the cache equals the golden insert's: records at their slots, the rest untouched."""
    gen = generator(seed)
    num_blocks = -(-num_tokens // block_size) + 1
    cache = _cache(num_blocks, block_size, stride, layout, gen)
    k = _keys(num_tokens + padding_rows, gen)  # DP padding rows past the slot count are ignored
    slots = _slots(num_tokens, num_blocks * block_size, gen, skip_fraction).to(slot_dtype)
    expected = insert_k_cache(k, cache, slots, block_size, use_fnuz)

    actual = cache.to(device)
    with _variant(variant):
        quantize_and_insert_k_cache(k.to(device), actual, slots.to(device), block_size, use_fnuz=use_fnuz)

    assert_bits_equal(actual, expected)


def test_insert_layout_by_hand(device) -> None:
    """One token's record at the byte positions drawn in ``golden/ue8m0_cache.py``'s docstring, without its code."""
    block_size, pos, block = 16, 5, 2
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    k[0, 64 * 3] = 448.0 * 4  # group 3: e = 2, code 129, stored as 448
    k[0, NOPE_DIM] = 1.5  # first RoPE value: bf16 0x3FC0, little-endian bytes C0 3F
    cache = torch.zeros(3, block_bytes(block_size), dtype=torch.uint8, device=device)
    slot = torch.tensor([block * block_size + pos], device=device)
    quantize_and_insert_k_cache(k.to(device), cache, slot, block_size)
    cache = cache.cpu()

    record = cache[block, pos * 576 : pos * 576 + 576]
    scales = cache[block, block_size * 576 + pos * 8 : block_size * 576 + pos * 8 + 8]
    assert record[64 * 3] == 0x7E
    assert record[448] == 0xC0 and record[449] == 0x3F
    assert scales.tolist() == [105, 105, 105, 129, 105, 105, 105, 0]
    written = torch.zeros_like(cache, dtype=torch.bool)
    written[block, pos * 576 : pos * 576 + 576] = True
    written[block, block_size * 576 + pos * 8 : block_size * 576 + pos * 8 + 8] = True
    assert int(cache[~written].count_nonzero()) == 0


def test_block_bytes_of_serving() -> None:
    """Pages padded to a multiple of 576 bytes: 9792 / 37440 / 149760 for block sizes 16 / 64 / 256."""
    assert [block_bytes(bs) for bs in (16, 64, 256)] == [9792, 37440, 149760]
    assert [block_bytes(bs, padded=False) for bs in (16, 64, 256)] == [9344, 37376, 149504]


# -- the boundary table -----------------------------------------------------------------------------

# (case, use_fnuz, {element index: bf16 value} of one group (the rest 0), expected code,
#  {element index: expected e4m3 byte}). Worked by hand from the formulas, not by either model.
BOUNDARY_TABLE = [
    ("amax = 448", False, {0: 448.0}, 127, {0: 0x7E}),
    ("amax = 448 * 2^3", False, {0: 3584.0}, 130, {0: 0x7E}),
    ("one bf16 ulp above 448 * 2^3", False, {0: 3600.0}, 131, {0: 0x76}),  # 225 -> 224
    ("one bf16 ulp below 448 * 2^3", False, {0: 3568.0}, 130, {0: 0x7E}),  # 446 -> 448
    ("amax = 448 * 2^-20", False, {0: 448.0 * 2**-20}, 107, {0: 0x7E}),
    ("negative amax = -448 * 2^5", False, {0: -448.0 * 32}, 132, {0: 0xFE}),
    ("all zero", False, {}, 105, {0: 0x00}),
    ("below the 1e-4 floor", False, {0: 2.0**-20}, 105, {0: 0x48}),  # 2^-20 * 2^22 = 4
    ("largest bf16", False, {0: BF16_MAX}, 247, {0: 0x78}),  # 255 -> 256
    (
        "subnormal results",
        False,
        {0: 448.0, 1: 2.0**-8, 2: 2.0**-10, 3: 3 * 2.0**-10},
        127,
        {1: 0x02, 2: 0x00, 3: 0x02},
    ),
    ("-0", False, {0: 448.0, 1: -0.0}, 127, {1: 0x80}),
    ("ties to even", False, {0: 448.0, 1: 17.0, 2: 19.0, 3: -17.0}, 127, {1: 0x58, 2: 0x5A, 3: 0xD8}),
    ("FNUZ amax = 224", True, {0: 224.0}, 127, {0: 0x7E}),
    ("FNUZ one bf16 ulp above 224 * 2^4", True, {0: 3600.0}, 132, {0: 0x76}),  # 112.5 -> 112
    ("FNUZ all zero", True, {}, 106, {0: 0x00}),
    ("FNUZ largest bf16", True, {0: BF16_MAX}, 248, {0: 0x78}),  # 127.5 -> 128
    ("FNUZ -0", True, {0: 224.0, 1: -0.0}, 127, {1: 0x00}),
    ("FNUZ subnormal results", True, {0: 224.0, 1: 2.0**-9, 2: 2.0**-11}, 127, {1: 0x02, 2: 0x00}),
]


def _boundary_key(values: dict[int, float], group: int = 2) -> torch.Tensor:
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    for index, value in values.items():
        k[0, 64 * group + index] = value
    return k


@variants
@pytest.mark.parametrize(
    ("case", "use_fnuz", "values", "code", "fp8_bytes"), BOUNDARY_TABLE, ids=[r[0] for r in BOUNDARY_TABLE]
)
def test_boundary_table(device, variant, case, use_fnuz, values, code, fp8_bytes) -> None:
    """Golden and kernel give the hand-worked scale code and e4m3 bytes; the kernel's bytes equal the golden's."""
    k = _boundary_key(values)
    golden_fp8, golden_codes = quantize_ue8m0(k[:, :NOPE_DIM], use_fnuz)
    assert int(golden_codes[0, 2]) == code
    assert {i: int(golden_fp8[0, 128 + i]) for i in fp8_bytes} == fp8_bytes

    cache = torch.zeros(1, block_bytes(16), dtype=torch.uint8, device=device)
    with _variant(variant):
        quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([3], device=device), 16, use_fnuz=use_fnuz)
    record = read_records(cache.cpu(), torch.tensor([3]), 16)
    assert int(record[0, TOKEN_DATA_BYTES + 2]) == code
    assert {i: int(record[0, 128 + i]) for i in fp8_bytes} == fp8_bytes
    assert_bits_equal(record, encode_records(k, use_fnuz))


@variants
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 256 * 2^120 -> inf, on purpose
def test_largest_bf16_gathers_as_inf(device, variant) -> None:
    """The format's limit, reproduced: the largest bf16 rounds to e4m3 256 at code 247 (248 FNUZ) = 2^128 -> inf."""
    with _variant(variant):
        for use_fnuz in (False, True):
            k = _boundary_key({0: BF16_MAX, 1: -BF16_MAX, 2: 1.0})
            cache = torch.zeros(1, block_bytes(16), dtype=torch.uint8, device=device)
            quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([0], device=device), 16, use_fnuz=use_fnuz)
            out = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device=device)
            dequantize_and_gather_k_cache(
                out, cache, torch.tensor([1], dtype=torch.int32, device=device), None,
                torch.zeros(1, 1, dtype=torch.int32, device=device), 16, 0, use_fnuz=use_fnuz,
            )  # fmt: skip
            assert out[0, 0, 128].item() == float("inf") and out[0, 0, 129].item() == float("-inf")
            assert out[0, 0, 130].item() == 0.0  # 1.0 / 2^120 is far below e4m3's smallest subnormal


def test_amax_500_round_up_vs_mx_round_down() -> None:
    """amax = 500 (papers.md#ue8m0-cache). UE8M0 (ceil): e = 1, 250 -> e4m3 256, gathers 512. MX: clips to 448."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0] = 500.0
    fp8, codes = quantize_ue8m0(x)
    mx_fp8, mx_codes = quantize_mx(x)
    assert (int(codes[0, 0]), int(mx_codes[0, 0])) == (128, 127)
    assert dequantize_ue8m0(fp8, codes)[0, 0].item() == 512.0
    assert dequantize_ue8m0(mx_fp8, mx_codes)[0, 0].item() == 448.0


# -- gather ---------------------------------------------------------------------------------------


@variants
@given(
    seq_lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    block_size=st.sampled_from([16, 64, 256]),
    use_gather_lens=st.booleans(),
    offset=st.integers(0, 3),
    stride=st.sampled_from(["padded", "unpadded"]),
    use_fnuz=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(seq_lens=[9, 23, 7], block_size=64, use_gather_lens=False, offset=0, stride="padded", use_fnuz=False, seed=0)
@example(seq_lens=[19, 8, 0], block_size=16, use_gather_lens=True, offset=5, stride="unpadded", use_fnuz=True, seed=1)
def test_gather_matches_golden(
    device, variant, seq_lens, block_size, use_gather_lens, offset, stride, use_fnuz, seed
) -> None:
    """Gathered bf16 equal the golden's, rows outside the gathers stay NaN, with a shuffled,
    non-contiguous block table whose unread entries hold garbage."""
    gen = generator(seed)
    num_reqs = len(seq_lens)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    cache = _cache(num_blocks, block_size, stride, "2d", gen)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_req) + 1
    backing = torch.full((num_reqs, width + 2), -1_000_000, dtype=torch.int32)  # garbage never read
    table = backing[:, :width]  # row stride width + 2 != width
    slots, next_block = [], 0
    for r, n in enumerate(seq_lens):
        table[r, : blocks_per_req[r]] = order[next_block : next_block + blocks_per_req[r]].to(torch.int32)
        next_block += blocks_per_req[r]
        j = torch.arange(n)
        slots.append(table[r, j // block_size].long() * block_size + j % block_size)
    slots = torch.cat(slots)
    k = _keys(slots.numel(), gen)
    cache = insert_k_cache(k, cache, slots, block_size, use_fnuz)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    gather_lens = torch.minimum(torch.randint(0, 41, (num_reqs,), generator=gen, dtype=torch.int32), lens)
    gather_lens = gather_lens if use_gather_lens else None
    if gather_lens is not None:
        table[:, : (lens - gather_lens).min() // block_size] = -7  # entries before the gather are never read
    num_rows = offset + max(seq_lens) + 2
    out = torch.full((num_reqs, num_rows, 512), float("nan"), dtype=torch.bfloat16)
    expected = gather_k_cache(out, cache, lens, gather_lens, table, block_size, offset, use_fnuz)

    actual = out.to(device)
    with _variant(variant):
        dequantize_and_gather_k_cache(
            actual, cache.to(device), lens.to(device), None if gather_lens is None else gather_lens.to(device),
            table.to(device), block_size, offset, use_fnuz=use_fnuz,
        )  # fmt: skip

    _assert_same_bf16(actual, expected)
    rope = expected[..., NOPE_DIM:]
    assert_bits_equal(actual[..., NOPE_DIM:].cpu(), rope)  # RoPE bit for bit, NaN rows included


@variants
@pytest.mark.parametrize("byte", [0x80, 0x7F, 0xFF])
def test_gather_finds_a_lone_special_byte_in_a_tile(device, variant, byte) -> None:
    """One byte of FNUZ's NaN (0x80) or +-240 (0x7F, 0xFF) among finite bytes (0x38, 0.5) of every token: each decode
    gives the golden bits, NaN or +-240 there. The every-byte test holds these three bytes in the same tiles, so a
    decode that tested a tile for one of them and fixed up all three passed it whatever it did with the others."""
    block_size, num_tokens = 16, 4
    cache = torch.zeros(1, block_bytes(block_size), dtype=torch.uint8)
    for t in range(num_tokens):
        record = torch.full((NOPE_DIM,), 0x38, dtype=torch.uint8)
        record[5 + 64 * t] = byte  # a group of its own in each token
        cache[0, t * 576 : t * 576 + NOPE_DIM] = record
        cache[0, block_size * 576 + t * 8 : block_size * 576 + t * 8 + 7] = 127  # scale 2^0
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([num_tokens], dtype=torch.int32)
    out = torch.zeros(1, num_tokens, 512, dtype=torch.bfloat16)
    expected = gather_k_cache(out, cache, lens, None, table, block_size, 0, True)
    actual = out.to(device)
    with _variant(variant):
        dequantize_and_gather_k_cache(actual, cache.to(device), lens.to(device), None, table.to(device), block_size, 0,
                                      use_fnuz=True)  # fmt: skip
    _assert_same_bf16(actual, expected)


@variants
@pytest.mark.parametrize("special", [True, False])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # codes near 254 overflow bf16: inf
def test_gather_decodes_every_byte_at_every_code(device, variant, special) -> None:
    """All 256 e4m3 bytes x all 256 scale codes (0: the subnormal 2^-127, 255: E8M0 NaN), OCP and FNUZ.

    ``special=False``: the bytes 0x7F, 0x80 and 0xFF (FNUZ's NaN and +-240) made 0, so every tile
    takes the "branch" decode's path without fix-ups."""
    block_size = 16
    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256))  # (byte, code), 65536 pairs
    if not special:  # those bytes replaced by 0, so that each group of 64 still shares a code
        pairs[(pairs[:, 0] & 0x7F == 0x7F) | (pairs[:, 0] == 0x80), 0] = 0
    num_tokens = -(-pairs.shape[0] // NOPE_DIM)
    fp8 = torch.zeros(num_tokens * NOPE_DIM, dtype=torch.uint8)
    codes = torch.zeros(num_tokens * 7, dtype=torch.uint8)
    # Token t, group g holds 64 pairs that share a code: order the pairs by code, then byte.
    by_code = pairs[torch.argsort(pairs[:, 1] * 256 + pairs[:, 0])]
    fp8[: by_code.shape[0]] = by_code[:, 0].to(torch.uint8)
    codes[: by_code.shape[0] // 64] = by_code[::64, 1].to(torch.uint8)
    records = torch.zeros(num_tokens, RECORD_BYTES, dtype=torch.uint8)
    records[:, :NOPE_DIM] = fp8.view(num_tokens, NOPE_DIM)
    records[:, NOPE_DIM:TOKEN_DATA_BYTES] = torch.arange(128, dtype=torch.uint8)
    records[:, TOKEN_DATA_BYTES : TOKEN_DATA_BYTES + 7] = codes.view(num_tokens, 7)
    num_blocks = -(-num_tokens // block_size)
    cache = torch.zeros(num_blocks, block_bytes(block_size), dtype=torch.uint8)
    for t in range(num_tokens):  # place records by the layout (the golden insert takes bf16, not records)
        block, pos = divmod(t, block_size)
        cache[block, pos * 576 : pos * 576 + 576] = records[t, :576]
        cache[block, block_size * 576 + pos * 8 : block_size * 576 + pos * 8 + 8] = records[t, 576:]
    assert_bits_equal(read_records(cache, torch.arange(num_tokens), block_size), records)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    for use_fnuz in (False, True):
        out = torch.zeros(1, num_tokens, 512, dtype=torch.bfloat16)
        expected = gather_k_cache(out, cache, lens, None, table, block_size, 0, use_fnuz)
        assert_bits_equal(expected[0], decode_records(records, use_fnuz))
        actual = out.to(device)
        with _variant(variant):
            dequantize_and_gather_k_cache(
                actual, cache.to(device), lens.to(device), None, table.to(device), block_size, 0, use_fnuz=use_fnuz
            )
        _assert_same_bf16(actual, expected)


@variants
@pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning"
)  # NumPy on the interpreter's masked lanes
def test_rope_is_copied_bit_for_bit(device, variant) -> None:
    """NaN payloads, infinities, -0 and subnormal bf16 RoPE values survive insert + gather unchanged."""
    patterns = [0x7FC1, 0xFFFF, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x3F80, 0x7F7F]
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    rope_bits = torch.tensor(patterns * 7, dtype=torch.int32)[:64].to(torch.int16)
    k[0, NOPE_DIM:] = rope_bits.view(torch.bfloat16)
    cache = torch.zeros(1, block_bytes(16), dtype=torch.uint8, device=device)
    out = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device=device)
    lens, gather = (torch.tensor([n], dtype=torch.int32, device=device) for n in (8, 1))
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with _variant(variant):
        quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([7], device=device), 16)
        dequantize_and_gather_k_cache(out, cache, lens, gather, table, 16, 0)
    assert torch.equal(out[0, 0, NOPE_DIM:].cpu().view(torch.int16), rope_bits)


@variants
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_nonfinite_group_gathers_nan_and_leaves_other_groups(device, variant, use_fnuz) -> None:
    """inf in group 2 and NaN in group 5: code 255 (E8M0 NaN) there and the unscaled values
    clamped (inf -> fp8_max, where FNUZ's own cast would give NaN); NaN on gather there only."""
    gen = generator(5)
    k = _keys(2, gen)
    k[0, 64 * 2 + 3] = float("inf")
    k[0, 64 * 2 + 4] = float("-inf")
    k[0, 64 * 5 + 60] = float("nan")
    cache = torch.zeros(1, block_bytes(16), dtype=torch.uint8, device=device)
    with _variant(variant):
        quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([0, 1], device=device), 16, use_fnuz=use_fnuz)
    records = read_records(cache.cpu(), torch.tensor([0, 1]), 16)
    assert_bits_equal(records, encode_records(k, use_fnuz))
    assert records[0, TOKEN_DATA_BYTES + 2] == 255 and records[0, TOKEN_DATA_BYTES + 5] == 255
    assert records[0, 64 * 2 + 3 : 64 * 2 + 5].tolist() == [0x7E, 0xFE]  # +-448 OCP, +-224 FNUZ
    out = torch.zeros(1, 2, 512, dtype=torch.bfloat16, device=device)
    with _variant(variant):
        dequantize_and_gather_k_cache(
            out, cache, torch.tensor([2], dtype=torch.int32, device=device), None,
            torch.zeros(1, 1, dtype=torch.int32, device=device), 16, 0, use_fnuz=use_fnuz,
        )  # fmt: skip
    nan_groups = torch.isnan(out[0, 0, :NOPE_DIM].cpu()).view(7, 64).all(dim=1)
    assert nan_groups.tolist() == [False, False, True, False, False, True, False]
    _assert_same_bf16(out[0].cpu(), decode_records(encode_records(k, use_fnuz), use_fnuz))


# -- properties ---------------------------------------------------------------------------------


@variants
@given(num_tokens=st.integers(1, 20), use_fnuz=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(num_tokens=16, use_fnuz=False, seed=0)
def test_round_trip_within_half_an_e4m3_ulp(device, variant, num_tokens, use_fnuz, seed) -> None:
    """Insert then gather (both kernels): each NoPE value within half an e4m3 ulp at its group's scale
    (so within 16 * scale OCP / 8 * scale FNUZ per group, vLLM's bound); RoPE exact."""
    gen = generator(seed)
    k = _keys(num_tokens, gen)
    cache = torch.zeros(-(-num_tokens // 16), block_bytes(16), dtype=torch.uint8, device=device)
    out = torch.zeros(1, num_tokens, 512, dtype=torch.bfloat16, device=device)
    table = torch.arange(cache.shape[0], dtype=torch.int32, device=device)[None]
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    with _variant(variant):
        quantize_and_insert_k_cache(
            k.to(device), cache, torch.arange(num_tokens, device=device), 16, use_fnuz=use_fnuz
        )
        dequantize_and_gather_k_cache(out, cache, lens, None, table, 16, 0, use_fnuz=use_fnuz)

    codes = read_records(cache.cpu(), torch.arange(num_tokens), 16)[:, TOKEN_DATA_BYTES : TOKEN_DATA_BYTES + 7]
    error = (out[0, :, :NOPE_DIM].cpu().double() - k[:, :NOPE_DIM].double()).abs()
    bound = _half_ulp_bound(k[:, :NOPE_DIM], codes, use_fnuz)
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).max()):.3f}"
    top_half_ulp = (16.0 if not use_fnuz else 8.0) * torch.exp2(codes.double() - 127)
    assert bool((error.view(num_tokens, 7, 64).amax(-1) <= top_half_ulp).all())
    assert torch.equal(out[0, :, NOPE_DIM:].cpu(), k[:, NOPE_DIM:])


def test_insert_is_independent_of_token_order(device) -> None:
    """Permuting tokens together with their slots writes the same bytes."""
    gen = generator(11)
    k = _keys(20, gen)
    slots = torch.randperm(64, generator=gen)[:20]
    perm = torch.randperm(20, generator=gen)
    first = torch.zeros(1, block_bytes(64), dtype=torch.uint8, device=device)
    second = first.clone()
    quantize_and_insert_k_cache(k.to(device), first, slots.to(device), 64)
    quantize_and_insert_k_cache(k[perm].to(device), second, slots[perm].to(device), 64)
    assert_bits_equal(first, second)


def test_results_do_not_depend_on_the_launch_config(device, monkeypatch) -> None:
    """One token per program / 3 workers (compiled-style) gives the bytes and values of the default config."""
    gen = generator(12)
    k = _keys(21, gen)
    cache = torch.zeros(2, block_bytes(16), dtype=torch.uint8, device=device)
    lens = torch.tensor([21], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    results = []
    for config in (None, kernels.LaunchConfig(tokens_per_program=1, gather_workers=3, num_warps=1)):
        if config is not None:
            monkeypatch.setattr(kernels, "select_launch_config", lambda _device, c=config: c)
        c = cache.clone()
        quantize_and_insert_k_cache(k.to(device), c, torch.arange(21, device=device), 16)
        out = torch.zeros(1, 21, 512, dtype=torch.bfloat16, device=device)
        dequantize_and_gather_k_cache(out, c, lens, None, table, 16, 0)
        results.append((c, out))
    assert_bits_equal(results[0][0], results[1][0])
    assert_bits_equal(results[0][1], results[1][1])


def test_block_offsets_are_64_bit(device) -> None:
    """Blocks past 2^31 bytes (57400 blocks of 37440 B; int32 slots and table): written and read at the right place.

    The cache is allocated but only two blocks are touched, so the memory stays virtual on a CPU.
    """
    num_blocks, block_size = 57_400, 64
    assert num_blocks * block_bytes(block_size) > 2**31
    cache = torch.empty(num_blocks, block_bytes(block_size), dtype=torch.uint8, device=device)
    k = _keys(2, generator(13))
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, (num_blocks - 2) * block_size + 63], dtype=torch.int32)
    quantize_and_insert_k_cache(k.to(device), cache, slots.to(device), block_size)
    assert_bits_equal(read_records(cache, slots.to(device), block_size).cpu(), encode_records(k))
    out = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device=device)
    table = torch.tensor([[0, num_blocks - 1]], dtype=torch.int32, device=device)
    lens, gather = (torch.tensor([n], dtype=torch.int32, device=device) for n in (block_size + 6, 1))
    dequantize_and_gather_k_cache(out, cache, lens, gather, table, block_size, 0)
    assert_bits_equal(out[0].cpu(), decode_records(encode_records(k[:1])))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # random bytes: codes near 254 give inf
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_rope_words_only_where_aligned(device, use_fnuz) -> None:
    """rope_words copies RoPE as words only where every address involved is a multiple of 4, and
    gives the golden's bytes and bf16 either way: a cache at an odd address, an odd block stride,
    k or out with an odd row stride fall back to bytes."""
    gen = generator(15)
    block_size, num_tokens = 16, 20
    raw = block_bytes(block_size)
    storage = torch.randint(0, 256, (2 * raw + 8,), generator=gen, dtype=torch.uint8).to(device)
    caches = {  # views of one buffer on the device, so each keeps its address and stride
        "aligned": storage[: 2 * raw].view(2, raw),
        "odd address": storage[1 : 1 + 2 * raw].view(2, raw),
        "odd stride": storage[: 2 * (raw + 1)].view(2, raw + 1),
    }
    wide = _keys(num_tokens, gen).repeat(1, 3).to(device)
    keys = {"aligned": wide[:, :512], "odd row stride": wide.view(-1)[: num_tokens * 1025].view(num_tokens, 1025)}
    keys["odd row stride"] = keys["odd row stride"][:, :512]
    slots = torch.randperm(2 * block_size, generator=gen)[:num_tokens]
    launched = []
    launch = kernels.launch

    def spy(kernel, grid, *args, **constexprs):
        launched.append(constexprs["ROPE_WORDS"])
        launch(kernel, grid, *args, **constexprs)

    for cache_name, cache in caches.items():
        for key_name, k in keys.items():
            expected = insert_k_cache(k.cpu(), cache.cpu(), slots, block_size, use_fnuz)
            with _variant("cvt"), mock.patch.object(kernels, "launch", spy):
                quantize_and_insert_k_cache(k, cache, slots.to(device), block_size, use_fnuz=use_fnuz)
            assert_bits_equal(cache.cpu(), expected)
            assert launched.pop() == (cache_name == key_name == "aligned"), (cache_name, key_name)

    cache = caches["aligned"]
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    outs = {
        "aligned": torch.zeros(1, 22, 512, dtype=torch.bfloat16, device=device),
        "odd row stride": torch.zeros(1, 22, 513, dtype=torch.bfloat16, device=device)[..., :512],
    }
    for out_name, out in outs.items():
        expected = gather_k_cache(out.cpu(), cache.cpu(), lens.cpu(), None, table.cpu(), block_size, 2, use_fnuz)
        with _variant("table"), mock.patch.object(kernels, "launch", spy):
            dequantize_and_gather_k_cache(out, cache, lens, None, table, block_size, 2, use_fnuz=use_fnuz)
        _assert_same_bf16(out, expected)
        assert launched.pop() == (out_name == "aligned"), out_name


@variants
def test_variants_stay_memory_safe_with_the_checks_off(device, variant, monkeypatch) -> None:
    """Bad contents with the content checks off: slots outside the cache are not written, tokens
    without a block gather as bf16 0x7FC0 (RoPE too), rows past ``out`` and bytes around the
    cache and ``out`` stay untouched -- every variant writes the bits of the default one."""
    monkeypatch.setenv("ATTNREF_CHECK_CONTENTS", "0")
    gen = generator(16)
    block_size, num_blocks, rows = 4, 4, 6
    record = block_bytes(block_size)
    storage = torch.full(((num_blocks + 2) * record,), 0xAB, dtype=torch.uint8, device=device)
    cache = storage[record : (num_blocks + 1) * record].view(num_blocks, record)
    k = _keys(num_blocks * block_size + 2, gen).to(device)
    capacity = num_blocks * block_size
    slots = torch.cat([torch.arange(capacity), torch.tensor([capacity, 2**40])]).to(device)
    out_storage = torch.full((5, rows, 512), -7.0, dtype=torch.bfloat16, device=device)
    table = torch.tensor([[0, 1], [2, 7], [3, 0]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([6, 7, 5], dtype=torch.int32, device=device)
    gather_lens = torch.tensor([6, 7, 9], dtype=torch.int32, device=device)  # request 2: 9 > 5, and 1 + 9 > 6
    results = {}
    for name in ("int", variant):
        storage.fill_(0xAB)
        out_storage.fill_(-7.0)
        with _variant(name):
            quantize_and_insert_k_cache(k, cache, slots, block_size)
            dequantize_and_gather_k_cache(out_storage[1:4], cache, seq_lens, gather_lens, table, block_size, 1)
        results[name] = (storage.clone(), out_storage.clone())
    assert_bits_equal(results[variant][0], results["int"][0])
    assert_bits_equal(results[variant][1], results["int"][1])
    assert bool((storage[:record] == 0xAB).all()) and bool((storage[-record:] == 0xAB).all())
    gathered = out_storage[1:4].view(torch.int16)
    assert bool((gathered[1, 5:] == 0x7FC0).all()) and bool((gathered[2, 1:5] == 0x7FC0).all())
    assert bool((out_storage[0] == -7.0).all()) and bool((out_storage[4] == -7.0).all())
    assert bool((out_storage[1:4, 0] == -7.0).all())


@variants
def test_a_position_past_the_tables_last_column_gathers_nan(device, variant, monkeypatch) -> None:
    """With the content checks off, request 0 is one key longer than its 2-column table holds (9 keys, blocks of 4):
    its position 8 has no column and gathers as NaN, and the positions the table covers gather their keys. The
    table's rows are back to back, so a bound of ``col <= columns`` would read request 1's first entry there (block
    2's token 0) instead; no other test has a request exactly one column past its table."""
    monkeypatch.setenv("ATTNREF_CHECK_CONTENTS", "0")
    block_size = 4
    cache = torch.zeros(4, block_bytes(block_size), dtype=torch.uint8, device=device)
    keys = _keys(4 * block_size, generator(17)).to(device)
    quantize_and_insert_k_cache(keys, cache, torch.arange(4 * block_size, device=device), block_size)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    out = torch.full((2, 5, 512), -7.0, dtype=torch.bfloat16, device=device)
    with _variant(variant):
        dequantize_and_gather_k_cache(out, cache, torch.tensor([9, 4], dtype=torch.int32, device=device),
                                      torch.tensor([5, 4], dtype=torch.int32, device=device), table, block_size, 0)
    expected = gather_k_cache(torch.zeros(2, 5, 512, dtype=torch.bfloat16), cache.cpu(), torch.tensor([8, 4]),
                              torch.tensor([4, 4]), table.cpu(), block_size, 0)  # positions 4-7 and request 1
    _assert_same_bf16(out[0, :4], expected[0, :4])
    _assert_same_bf16(out[1, :4], expected[1, :4])
    assert bool((out[0, 4].view(torch.int16) == 0x7FC0).all())  # position 8: no column


def test_decode_table_is_made_once_per_device_and_format() -> None:
    """The "table" decode's 256 values: torch's decode of each byte, one tensor per (device, format), kept."""
    cpu = torch.device("cpu")
    for use_fnuz, dtype in ((False, torch.float8_e4m3fn), (True, torch.float8_e4m3fnuz)):
        table = kernels._decode_table(cpu, use_fnuz)
        assert kernels._decode_table(cpu, use_fnuz) is table
        expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        assert torch.equal(table.isnan(), expected.isnan())
        assert_bits_equal(table[~table.isnan()], expected[~expected.isnan()])
        assert table[table.isnan()].view(torch.int32).tolist() == [0x7FC00000] * (1 if use_fnuz else 2)
    assert kernels._decode_table(cpu, False) is not kernels._decode_table(cpu, True)


def test_unknown_config_option_is_rejected(device) -> None:
    """A misspelt option in a config table fails loudly instead of running the default."""
    bad_encode = mock.patch.dict(VARIANTS, {"int": {"fnuz_encode": "hw"}})
    with bad_encode, _variant("int"), pytest.raises(ValueError, match=r"LaunchConfig.fnuz_encode: expected one of"):
        quantize_and_insert_k_cache(**_insert_args(device))
    bad_decode = mock.patch.dict(VARIANTS, {"int": {"decode": "lut"}})
    with bad_decode, _variant("int"), pytest.raises(ValueError, match=r"LaunchConfig.decode: expected one of"):
        dequantize_and_gather_k_cache(**_gather_args(device))


# -- negative controls ----------------------------------------------------------------------------


def test_negative_control_floor_rounded_exponent() -> None:
    """A floor-rounded exponent (the OCP MX rule) gives other bytes and clips: the exact byte
    comparison and the half-ulp round-trip bound both catch it."""
    gen = generator(14)
    k = _keys(8, gen)[:, :NOPE_DIM]
    k[0, 0] = 500.0  # with the rest of group 0 far smaller: MX clips it to 448
    k[0, 1:64] = 1.0
    mx_fp8, mx_codes = quantize_mx(k)
    _, codes = quantize_ue8m0(k)
    assert not torch.equal(mx_codes, codes)
    error = (dequantize_ue8m0(mx_fp8, mx_codes) - k.double()).abs()
    assert bool((error > _half_ulp_bound(k, mx_codes, False)).any())
    assert error[0, 0].item() == 52.0  # 500 clipped to 448


def test_negative_control_ocp_bytes_read_as_fnuz(device) -> None:
    """OCP bytes gathered with use_fnuz=True: normal values halve (bias 7 vs 8) and -0 (0x80) becomes NaN."""
    k = _boundary_key({0: 448.0, 1: 3.0, 2: -0.0}, group=0)
    cache = torch.zeros(1, block_bytes(16), dtype=torch.uint8, device=device)
    quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([0], device=device), 16, use_fnuz=False)
    args = (
        cache,
        torch.tensor([1], dtype=torch.int32, device=device),
        None,
        torch.zeros(1, 1, dtype=torch.int32, device=device),
        16,
        0,
    )
    right = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device=device)
    wrong = right.clone()
    dequantize_and_gather_k_cache(right, *args, use_fnuz=False)
    dequantize_and_gather_k_cache(wrong, *args, use_fnuz=True)
    assert right[0, 0, :3].tolist() == [448.0, 3.0, 0.0]
    assert wrong[0, 0, :2].tolist() == [224.0, 1.5]
    assert torch.isnan(wrong[0, 0, 2])


# -- bad input ------------------------------------------------------------------------------------


def _on_device(device, args: dict) -> dict:
    """``args`` with every tensor moved to ``device`` (keeping its strides): compiled Triton reads no
    CPU tensor, and the wrappers would reject one before the check under test."""
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in args.items()}


def _insert_args(device, **change):
    args = dict(
        k=torch.zeros(4, 512, dtype=torch.bfloat16),
        k_cache=torch.zeros(2, block_bytes(16), dtype=torch.uint8),
        slot_mapping=torch.tensor([0, 1, 2, -1]),
        block_size=16,
    )
    args.update(change)
    return _on_device(device, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k": torch.zeros(4, 512)}, TypeError, r"k: expected dtype"),
        ({"k": torch.zeros(4, 576, dtype=torch.bfloat16)}, ValueError, r"k: expected \[N, 512\]"),
        ({"slot_mapping": torch.arange(5)}, ValueError, r"slot_mapping: 5 slots but k has only 4 rows"),
        ({"slot_mapping": torch.tensor([0.0, 1.0])}, TypeError, r"slot_mapping: expected dtype"),
        ({"slot_mapping": torch.tensor([0, 32])}, ValueError, r"slot_mapping: slot 32 is past the cache's 32 slots"),
        ({"slot_mapping": torch.tensor([3, 3])}, ValueError, r"slot_mapping: non-negative slots must be distinct"),
        ({"k_cache": torch.zeros(2, block_bytes(16), dtype=torch.int8)}, TypeError, r"k_cache: expected dtype"),
        (
            {"k_cache": torch.zeros(2, 16 * 584 - 1, dtype=torch.uint8)},
            ValueError,
            r"k_cache: a block of block_size=16",
        ),
        (
            {"k_cache": torch.zeros(9792, 2, dtype=torch.uint8).t()},
            ValueError,
            r"k_cache: the bytes of a block must be contiguous",
        ),
        ({"block_size": 0}, ValueError, r"block_size: expected a positive int"),
        ({"is_ue8m0": False}, ValueError, r"is_ue8m0: only UE8M0"),
        ({"k_cache": None}, TypeError, r"k_cache: expected a torch.Tensor, got NoneType"),
        ({"k_cache": [[0] * 9344] * 2}, TypeError, r"k_cache: expected a torch.Tensor, got list"),
        ({"use_fnuz": "yes"}, ValueError, r"use_fnuz: expected a bool, got 'yes'"),
    ],
)
def test_insert_rejects_bad_input(device, change, error, match) -> None:
    quantize_and_insert_k_cache(**_insert_args(device))  # the unchanged arguments are fine
    with pytest.raises(error, match=match):
        quantize_and_insert_k_cache(**_insert_args(device, **change))


def _gather_args(device, **change):
    args = dict(
        out=torch.zeros(2, 8, 512, dtype=torch.bfloat16),
        k_cache=torch.zeros(2, block_bytes(16), dtype=torch.uint8),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32),
        gather_lens=torch.tensor([5, 3], dtype=torch.int32),
        block_table=torch.tensor([[0, 9], [9, 1]], dtype=torch.int32),  # entry [1, 0] is never read
        block_size=16,
        offset=2,
    )
    args.update(change)
    return _on_device(device, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"out": torch.zeros(2, 8, 512)}, TypeError, r"out: expected dtype"),
        ({"out": torch.zeros(2, 8, 576, dtype=torch.bfloat16)}, ValueError, r"out: expected \[R, T, 512\]"),
        ({"seq_lens": torch.tensor([5, 20, 1], dtype=torch.int32)}, ValueError, r"seq_lens: expected shape \[2\]"),
        (
            {"gather_lens": torch.tensor([6, 3], dtype=torch.int32)},
            ValueError,
            r"gather_lens: expected 0 <= gather_len <= seq_len",
        ),
        ({"offset": 6}, ValueError, r"out: offset 6 \+ gather_len 5 is past its 8 rows"),
        ({"offset": -1}, ValueError, r"offset: expected a non-negative int"),
        (
            {"block_table": torch.tensor([[0, 9], [9, 2]], dtype=torch.int32)},
            ValueError,
            r"block_table: entry \[1, 1\] = 2",
        ),
        ({"block_table": torch.tensor([[0, 9]], dtype=torch.int32)}, ValueError, r"block_table: expected >= 2 rows"),
        (
            {"block_table": torch.tensor([[0], [1]], dtype=torch.int32)},
            ValueError,
            r"block_table: a request needs 2 blocks",
        ),
        ({"block_table": torch.tensor([[0.0, 1.0], [1.0, 1.0]])}, TypeError, r"block_table: expected dtype"),
        ({"k_cache": None}, TypeError, r"k_cache: expected a torch.Tensor, got NoneType"),
        ({"offset": True}, ValueError, r"offset: expected a non-negative int, got True"),
        ({"use_fnuz": 2}, ValueError, r"use_fnuz: expected a bool, got 2"),
        ({"seq_lens": torch.tensor([5, 2**32 + 20])}, ValueError, r"seq_lens: entry 1 = 4294967316 is outside int32"),
    ],
)
def test_gather_rejects_bad_input(device, change, error, match) -> None:
    dequantize_and_gather_k_cache(**_gather_args(device))  # the unchanged arguments are fine
    with pytest.raises(error, match=match):
        dequantize_and_gather_k_cache(**_gather_args(device, **change))


def test_content_checks_can_be_switched_off(device, monkeypatch) -> None:
    """ATTNREF_CHECK_CONTENTS=0 skips the device-to-host reads: a duplicate slot is then not looked for."""
    monkeypatch.setenv("ATTNREF_CHECK_CONTENTS", "0")
    quantize_and_insert_k_cache(**_insert_args(device, slot_mapping=torch.tensor([3, 3])))
    monkeypatch.setenv("ATTNREF_CHECK_CONTENTS", "1")
    with pytest.raises(ValueError, match="distinct"):
        quantize_and_insert_k_cache(**_insert_args(device, slot_mapping=torch.tensor([3, 3])))


def test_the_benchmarks_scatter_baseline_writes_the_bytes_the_insert_writes(device) -> None:
    """The bench's insert baseline (``scatter_records``: the insert's traffic, no arithmetic) writes exactly the
    cache bytes an insert at the same slots writes, so its time is the ceiling of the same access pattern. A byte
    is written where a call leaves the same value over a cache of zeros and over a cache of 0xFF."""
    from triton_impl.parity.ue8m0_cache import scatter_records

    gen = generator(3)
    k = torch.randn(128, 512, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(3 * 64, generator=gen)[:128].to(device)

    def written(call) -> torch.Tensor:
        caches = [torch.full((3, block_bytes(64)), fill, dtype=torch.uint8, device=device) for fill in (0, 255)]
        for cache in caches:
            call(cache)
        return caches[0] == caches[1]

    inserted = written(lambda cache: quantize_and_insert_k_cache(k, cache, slots, 64))
    assert torch.equal(written(lambda cache: scatter_records(k, cache, slots, 64)), inserted)
    assert int(inserted.sum()) == 128 * RECORD_BYTES
