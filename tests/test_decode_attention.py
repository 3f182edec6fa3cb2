"""Split-KV decode attention: Triton == golden, the golden's split view, invariances, serving flatten,
negative controls on the kernel's path, bad input."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import triton
from hypothesis import example, given
from hypothesis import strategies as st
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from golden.decode_attention import decode_attention, decode_attention_splits, split_bounds, window_start
from golden.decode_attention import expand_decode_rows as golden_expand_decode_rows
from golden.lse_merge import merge_states
from tests.support import (
    assert_bits_equal,
    assert_close,
    compiled_rows,
    fails_tolerance,
    generator,
    nan_filled,
    paged_cache,
    paginate,
    run_compiled,
    run_ptx,
    sm90_only,
)
from triton_impl import decode_attention_sm90
from triton_impl.decode_attention import (
    DECODE_CONFIGS,
    _compute_num_kv_splits,
    _decode_stage1_kernel,
    _plan_decode,
    decode_attention_fwd,
    expand_decode_rows,
    stage1_splits,
    tile_config,
)
from triton_impl.launch import Launch, cluster_capacity, cluster_launches, no_launch
from triton_impl.lse_merge import bf16_partials, merge_splits, split_outputs
from triton_impl.validation import CONTENT_CHECKS_ENV, cdiv

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# MLA (Lv, rope width P) and GQA (Lk, Lv) widths: small, with non-powers of two for GQA. MLA widths
# with Lv >= 32 reach SPLIT_LATENT (the latent in two halves) under the sm90 config.
MLA_WIDTHS = [(16, 0), (16, 16), (32, 16), (32, 0)]
GQA_WIDTHS = [(16, 16), (24, 40), (64, 32), (48, 48)]
# Every launch config a GPU selects, by architecture; the kernel takes any of them on any device.
ARCHS = sorted(DECODE_CONFIGS)
# Lengths up to 300 keys, plus one past each key-tile size the configs use (16, 32, 64, 128), and
# extents at a window's edge ("W-1", "W", "W+1" keys).
LENGTHS = st.one_of(st.sampled_from([0, 1, 17, 33, 65, 129]), st.integers(0, 300), st.sampled_from(["W-1", "W", "W+1"]))
# Pages of one token, a common 16, DeepSeek's 64, and sizes that do not divide any tile.
PAGE_SIZES = st.one_of(st.sampled_from([1, 16, 64]), st.integers(1, 40))


@st.composite
def head_layouts(draw: st.DrawFn) -> tuple[bool, int, int]:
    """``(is_mla, HKV, G)``: MLA has one KV head and 1 to 40 query heads (40 fill one sm90 64-head
    tile, 24 rows masked; fewer clamp the tile to 16); GQA 1 or 2 KV heads of 1, 3 or 4 query heads
    (every GQA entry tiles 16 heads, so wider groups only add interpreter time)."""
    if draw(st.booleans()):
        return True, 1, draw(st.sampled_from([1, 3, 16, 40]))
    return False, draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3, 4]))


@dataclass
class Decode:
    """One decode problem: inputs of ``decode_attention_fwd`` and the float64 golden result."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    sm_scale: float
    page_size: int
    is_mla: bool
    window: int | None = None
    cap: float = 0.0
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(
            logit_cap=self.cap, k_scale=self.k_scale, v_scale=self.v_scale, is_mla=self.is_mla,
            sliding_window=self.window,
        )  # fmt: skip

    def golden(self) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_attention(
            self.q, self.k, self.v, self.table, self.lens, self.sm_scale, self.page_size, dtype=torch.float64,
            **self.kwargs(),
        )  # fmt: skip

    def run(
        self, splits: int, lse_dtype: torch.dtype = torch.float32, **override
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The kernel's ``(o, lse, attn_logits)``, every output pre-filled with NaN; ``override``
        replaces any argument of ``decode_attention_fwd`` (negative controls plant bugs with it)."""
        rows, heads = self.q.shape[:2]
        device = self.q.device
        o = nan_filled((rows, heads, self.v.shape[-1]), self.q.dtype, device)
        lse = nan_filled((rows, heads), lse_dtype, device)
        logits = nan_filled((rows, heads, splits, self.v.shape[-1] + 1), torch.float32, device) if splits > 1 else None
        args = dict(
            q=self.q, k_buffer=self.k, v_buffer=self.v, o=o, lse=lse, req_to_token=self.table, b_seq_len=self.lens,
            attn_logits=logits, num_kv_splits=splits, sm_scale=self.sm_scale, page_size=self.page_size,
        )  # fmt: skip
        decode_attention_fwd(**(args | self.kwargs() | override))
        return o, lse, logits


def make_decode(
    device: torch.device,
    seed: int,
    lens: list[int],
    *,
    is_mla: bool,
    num_heads: int,
    num_kv_heads: int = 1,
    widths: tuple[int, int],
    page_size: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    layout: str = "4d",
    index_dtype: torch.dtype = torch.int32,
    window: int | None = None,
    cap: float = 0.0,
    fp8_scale: float = 0.37,
) -> Decode:
    """Build a paged cache (shuffled pages, NaN moat) and queries. ``widths`` is ``(Lv, P)`` for MLA
    and ``(Lk, Lv)`` for GQA; GQA's K and V are the two column ranges of one cache (as views) or,
    for the "4d" layout, separate contiguous copies of them."""
    gen = generator(seed)
    key_width, value_width = (widths[0] + widths[1], widths[0]) if is_mla else widths
    cache_width = key_width if is_mla else key_width + value_width
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    pc = paged_cache(lens, page_size, num_kv_heads, cache_width, cache_dtype, device, gen, layout=layout)
    if is_mla:
        k, v = pc.cache, pc.cache[..., :value_width]
    else:
        k, v = pc.cache[..., :key_width], pc.cache[..., key_width:]
        if layout == "4d":
            k, v = k.contiguous(), v.contiguous()
    q_gen = generator(seed + 1)  # independent of how many values the cache layout drew
    q = (torch.randn(len(lens), num_heads, key_width, generator=q_gen) * 0.7).to(dtype).to(device)
    scales = {}
    if fp8:
        scales = {"k_scale": torch.tensor(fp8_scale, device=device), "v_scale": torch.tensor(1.9, device=device)}
    return Decode(
        q, k, v, pc.block_table.to(index_dtype), pc.seq_lens.to(index_dtype), key_width**-0.5, page_size, is_mla,
        window, cap, **scales,
    )  # fmt: skip


def _extent(length: int | str, window: int | None) -> int:
    """A drawn length: keys, or an offset from the window (8 keys when there is none)."""
    if isinstance(length, int):
        return length
    return max(0, (window or 8) + {"W-1": -1, "W": 0, "W+1": 1}[length])


def _config(arch: str, is_mla: bool) -> dict[str, int]:
    """The launch config a GPU of ``arch`` selects for this cache kind."""
    return DECODE_CONFIGS[arch]["mla" if is_mla else "gqa"]


def _splits_run(d: Decode, splits: int, config: dict[str, int]) -> int:
    """The splits stage 1 runs for ``d`` under ``config`` on its device (``stage1_splits``)."""
    rows, heads = d.q.shape[:2]
    kv_heads = d.k.shape[-2]
    tile, config = tile_config(config, heads // kv_heads)
    sms = torch.cuda.get_device_properties(d.q.device).multi_processor_count if d.q.is_cuda else None
    return stage1_splits(splits, rows * kv_heads * cdiv(heads // kv_heads, tile), sms, config)


def test_stage1_splits_cap() -> None:
    """The cap fills SPLIT_ROUNDS rounds of resident programs and never raises the split count."""
    config = {"SPLIT_ROUNDS": 4, "PROGRAMS_PER_SM": 1, "PROGRAMS_PER_SM_H16": 2}
    assert stage1_splits(64, 64, 132, config) == 8  # MLA B=32 H=128: 2 head tiles of 64
    assert stage1_splits(64, 32, 132, tile_config({**config, "BLOCK_H": 64}, 16)[1]) == 33  # MLA B=32 H=16
    assert stage1_splits(64, 2, 132, config) == 64  # B=1: the caller's count
    assert stage1_splits(2, 4096, 132, config) == 1  # a full GPU: one split
    assert stage1_splits(1, 1, 132, config) == 1
    assert stage1_splits(64, 64, None, config) == 64  # not on CUDA: no cap
    assert stage1_splits(64, 64, 132, {"PROGRAMS_PER_SM": 1}) == 64  # no SPLIT_ROUNDS: no cap


# -- Triton == golden ------------------------------------------------------------------------


@given(
    heads=head_layouts(),
    width_index=st.integers(0, 3),
    page_size=PAGE_SIZES,
    lengths=st.lists(LENGTHS, min_size=1, max_size=3),
    window=st.one_of(st.sampled_from([None, 0, 1, 16, 64]), st.integers(1, 300)),
    cap=st.sampled_from([0.0, 1.5, 30.0]),
    splits=st.sampled_from([1, 2, 3, 5, 8]),
    dtype=st.sampled_from(list(DTYPES)),
    fp8=st.booleans(),
    fp8_scale=st.sampled_from([0.02, 0.37, 3.0]),
    lse_in_model_dtype=st.booleans(),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    layout=st.sampled_from(["4d", "3d", "cross_layer"]),
    arch=st.sampled_from(ARCHS),
    seed=st.integers(0, 2**31 - 1),
)
@example(heads=(True, 1, 4), width_index=1, page_size=4, lengths=[0, "W", "W+1"], window=5, cap=0.0,
         splits=3, dtype="bfloat16", fp8=False, fp8_scale=0.37, lse_in_model_dtype=False, index_dtype=torch.int32,
         layout="4d", arch="default", seed=0)  # fmt: skip
@example(heads=(False, 2, 3), width_index=1, page_size=1, lengths=[1, 37], window=None, cap=1.5,
         splits=5, dtype="float16", fp8=True, fp8_scale=3.0, lse_in_model_dtype=True, index_dtype=torch.int64,
         layout="cross_layer", arch="sm90", seed=1)  # fmt: skip
# The Hopper MLA entry at full strength: 40 heads in one 64-head tile (24 rows masked), the latent in
# two halves, pages of 64, a split of 65 keys crossing into a second 64-key tile, a window.
@example(heads=(True, 1, 40), width_index=2, page_size=64, lengths=[129, 65, 0], window=100, cap=0.0,
         splits=2, dtype="bfloat16", fp8=True, fp8_scale=0.37, lse_in_model_dtype=False, index_dtype=torch.int32,
         layout="4d", arch="sm90", seed=2)  # fmt: skip
# The default MLA entry past its 32-key tiles, odd pages, more splits than a short row has keys.
@example(heads=(True, 1, 3), width_index=3, page_size=7, lengths=[300, 2, 33], window=None, cap=30.0,
         splits=8, dtype="float32", fp8=False, fp8_scale=0.37, lse_in_model_dtype=False, index_dtype=torch.int64,
         layout="3d", arch="default", seed=3)  # fmt: skip
def test_matches_golden(
    device, heads, width_index, page_size, lengths, window, cap, splits, dtype, fp8, fp8_scale,
    lse_in_model_dtype, index_dtype, layout, arch, seed,
) -> None:  # fmt: skip
    """Output, LSE and (with S > 1) every stage-1 split slot against the float64 golden model, under
    the launch config a GPU of ``arch`` selects."""
    is_mla, kv_heads, group = heads
    widths = MLA_WIDTHS[width_index] if is_mla else GQA_WIDTHS[width_index]
    d = make_decode(
        device, seed, [_extent(n, window) for n in lengths], is_mla=is_mla, num_heads=kv_heads * group,
        num_kv_heads=kv_heads, widths=widths, page_size=page_size, dtype=DTYPES[dtype], fp8=fp8, layout=layout,
        index_dtype=index_dtype, window=window, cap=cap, fp8_scale=fp8_scale,
    )  # fmt: skip
    lse_dtype = DTYPES[dtype] if lse_in_model_dtype else torch.float32
    o, lse, logits = d.run(splits, lse_dtype, config=_config(arch, is_mla))
    ref_o, ref_lse = d.golden()
    assert_close(o, ref_o, ("decode_attention", "o", dtype))
    assert_close(lse, ref_lse, ("decode_attention", "lse", lse_dtype))
    run = _splits_run(d, splits, _config(arch, is_mla))
    if run > 1:
        part_o, part_lse = decode_attention_splits(
            d.q, d.k, d.v, d.table, d.lens, run, d.sm_scale, d.page_size, dtype=torch.float64, **d.kwargs()
        )
        value_width = d.v.shape[-1]
        assert_close(split_outputs(logits[:, :, :run], o.dtype), part_o, ("decode_attention", "o", dtype))
        assert_close(logits[:, :, :run, value_width], part_lse, ("decode_attention", "lse", "float32"))
    if run < splits:  # the capped splits' slots are never written
        assert bool(torch.isnan(logits[:, :, run:]).all())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("fp8", "splits"), [(False, 1), (True, 2)])
def test_deepseek_mla_dims(device, arch, fp8, splits) -> None:
    """DeepSeek's latent cache (Lk 576 = 512 + 64), 16 heads, pages of 64, bf16 and FP8 with a
    scale, each architecture's MLA config; the 70-key row crosses a 64-key tile in one split."""
    d = make_decode(device, 5, [3, 0, 70], is_mla=True, num_heads=16, widths=(512, 64), page_size=64, fp8=fp8)
    d.sm_scale = 192**-0.5  # serving passes the prefill scale (qk_nope 128 + rope 64)
    o, lse, _ = d.run(splits, config=_config(arch, True))
    ref_o, ref_lse = d.golden()
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


@pytest.mark.parametrize("arch", ARCHS)
def test_deepseek_mla_wide_config(device, arch) -> None:
    """128 heads at DeepSeek's widths under each architecture's MLA config: on sm90 two 64-head
    tiles with the latent in two halves, by default eight 16-head tiles; FP8, one split, so the
    70-key row runs into a second 64-key tile."""
    d = make_decode(device, 6, [70, 1, 0], is_mla=True, num_heads=128, widths=(512, 64), page_size=64, fp8=True)
    d.sm_scale = 192**-0.5
    o, lse, _ = d.run(1, config=_config(arch, True))
    ref_o, ref_lse = d.golden()
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


def test_a_register_cap_changes_no_result(device) -> None:
    """``maxnreg`` and ``maxnreg_h16`` (optional config keys, a compiler option) cap registers per
    thread; the results are the uncapped sm90 MLA entry's bit for bit (DeepSeek widths, 16 heads,
    two splits)."""
    d = make_decode(device, 7, [70, 3, 129], is_mla=True, num_heads=16, widths=(512, 64), page_size=64)
    d.sm_scale = 192**-0.5
    uncapped = {k: v for k, v in _config("sm90", True).items() if not k.startswith("maxnreg")}
    o, lse, _ = d.run(2, config=uncapped)
    for cap in ({"maxnreg": 128}, {"maxnreg_h16": 128}, {"maxnreg": 255, "maxnreg_h16": 128}):
        o_capped, lse_capped, _ = d.run(2, config={**uncapped, **cap})
        assert torch.equal(o, o_capped) and torch.equal(lse, lse_capped)


def test_empty_rows_are_neutral(device) -> None:
    """Extents 0 and negative: o = 0 and lse = -inf exactly, in both the one- and multi-split paths."""
    d = make_decode(device, 3, [0, 0], is_mla=False, num_heads=2, num_kv_heads=1, widths=(16, 16), page_size=4)
    d.lens = torch.tensor([0, -3], dtype=torch.int32, device=device)
    for splits in (1, 4):
        o, lse, logits = d.run(splits)
        assert torch.equal(o, torch.zeros_like(o))
        assert bool(torch.isneginf(lse).all())
        if logits is not None:
            assert bool(torch.isneginf(logits[..., -1]).all())
            outputs = split_outputs(logits, o.dtype)
            assert torch.equal(outputs, torch.zeros_like(outputs))


def test_golden_split_bounds_hand_computed() -> None:
    """Window-aware chunks: n = 10, W = 4 -> keys [6, 10) in chunks of cdiv(4, 3) = 2; n = 3 (< W)
    -> [0, 3) in chunks of 1; n = 0 -> all empty; no window, n = 10 -> chunks of 4."""
    start, end = split_bounds(torch.tensor([10, 3, 0]), 3, 4)
    assert start.tolist() == [[6, 8, 10], [0, 1, 2], [0, 0, 0]]
    assert end.tolist() == [[8, 10, 10], [1, 2, 3], [0, 0, 0]]
    start, end = split_bounds(torch.tensor([10]), 3, None)
    assert start.tolist() == [[0, 4, 8]] and end.tolist() == [[4, 8, 10]]


@given(
    is_mla=st.booleans(),
    lengths=st.lists(st.one_of(st.integers(-2, 40), st.sampled_from(["W-1", "W", "W+1"])), min_size=1, max_size=4),
    window=st.sampled_from([None, 0, 1, 3, 6, 64]),
    splits=st.sampled_from([1, 2, 7, 40]),
    cap=st.sampled_from([0.0, 3.0]),
    fp8=st.booleans(),
    page_size=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
@example(is_mla=False, lengths=[0, -2, 1, 30], window=3, splits=40, cap=3.0, fp8=True, page_size=4, seed=0)
def test_golden_splits_merge_to_the_direct_definition(
    is_mla, lengths, window, splits, cap, fp8, page_size, seed
) -> None:  # fmt: skip
    """Golden only, float64: the split view's ranges partition each row's visible keys [lo, n), and
    merging its states (``merge_states``) gives the direct definition to rounding, for empty and
    negative extents, windows shorter and longer than the row, and more splits than visible keys."""
    lens = [_extent(n, window) if isinstance(n, str) else n for n in lengths]
    d = make_decode(torch.device("cpu"), seed, [max(n, 0) for n in lens], is_mla=is_mla, num_heads=6,
                    num_kv_heads=1 if is_mla else 2, widths=(16, 8) if is_mla else (24, 40), page_size=page_size,
                    dtype=torch.float32, fp8=fp8, window=window, cap=cap)  # fmt: skip
    d.lens = torch.tensor(lens, dtype=torch.int32)
    start, end = split_bounds(d.lens, splits, window)
    n = d.lens.to(torch.int64).clamp(min=0)
    assert torch.equal(start[:, 0], window_start(d.lens, window)) and torch.equal(end[:, -1], n)
    assert torch.equal(start[:, 1:], end[:, :-1]) and bool((end >= start).all())
    whole_o, whole_lse = d.golden()
    part_o, part_lse = decode_attention_splits(
        d.q, d.k, d.v, d.table, d.lens, splits, d.sm_scale, d.page_size, dtype=torch.float64, **d.kwargs()
    )
    o, lse = merge_states(part_o, part_lse)
    assert torch.allclose(o, whole_o, rtol=0, atol=1e-12)
    empty = n == window_start(d.lens, window)
    assert bool((whole_o[empty] == 0).all()) and bool(torch.isneginf(whole_lse[empty]).all())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(whole_lse)) and not bool(torch.isnan(lse).any())
    finite = torch.isfinite(whole_lse)
    assert torch.allclose(lse[finite], whole_lse[finite], rtol=0, atol=1e-12)


def test_deepseek_mla_fp8_window_bf16_lse(device) -> None:
    """DeepSeek MLA at 32 heads, lengths up to 300, FP8 cache, 4 splits, window 128, bf16 LSE, under
    the Hopper config (a 32-head tile, the latent in two halves)."""
    d = make_decode(device, 31, [300, 129, 0, 7], is_mla=True, num_heads=32, widths=(512, 64), page_size=64,
                    fp8=True, window=128)  # fmt: skip
    d.sm_scale = 192**-0.5
    o, lse, _ = d.run(4, torch.bfloat16, config=_config("sm90", True))
    ref_o, ref_lse = d.golden()
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "bfloat16"))


@pytest.mark.parametrize(
    ("page_size", "layout", "fp8", "window", "index_dtype"),
    [(64, "4d", False, None, torch.int32), (128, "3d", True, 150, torch.int64), (64, "4d", False, 150, torch.int32),
     (64, "cross_layer", False, None, torch.int32)],
)  # fmt: skip
def test_tma_tiles_and_gathered_ends(device, page_size, layout, fp8, window, index_dtype) -> None:
    """The Hopper MLA config loads page-aligned tiles whole by tensor descriptors (head tiles wider than
    16; the 16-head tile keeps the gathers, ``TMA_H16``) and gathers the
    partial tiles at each split's ends (unaligned starts from the window and the split bounds, rows
    shorter than a tile, an empty row), with the cache's NaN moat around every row: both paths
    match golden (a descriptor row off by one key fails the three descriptor cases: tried by hand).
    Pages not back to back (a cross-layer view) fall back to the gathers."""
    d = make_decode(device, 41, [300, 200, 64, 63, 1, 0], is_mla=True, num_heads=32, widths=(512, 64),
                    page_size=page_size, layout=layout, fp8=fp8, window=window, index_dtype=index_dtype)  # fmt: skip
    d.sm_scale = 192**-0.5
    config = _config("sm90", True)
    assert config.get("TMA")
    rows = len(d.lens)
    args = (d.q, d.k, d.v, torch.empty(rows, 32, 512, device=device), torch.empty(rows, 32, device=device), d.table,
            d.lens, torch.empty(rows, 32, 2, 513, device=device), 2, d.sm_scale, page_size, 0.0, d.k_scale,
            d.v_scale, True, window, config)  # fmt: skip
    assert (_plan_decode(*args).tma is not None) == (layout != "cross_layer")
    ref_o, ref_lse = d.golden()
    for tma in (1, 0):
        o, lse, _ = d.run(2, config={**config, "TMA": tma})
        assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
        assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


def padded_query(q: torch.Tensor, pad: int) -> torch.Tensor:
    """``q`` as a view of a buffer ``pad`` elements wider per head (head stride ``Lk + pad``)."""
    wide = q.new_zeros(*q.shape[:-1], q.shape[-1] + pad)
    wide[..., : q.shape[-1]] = q
    return wide[..., : q.shape[-1]]


@sm90_only("the Gluon stage 1")
@pytest.mark.parametrize(
    ("num_heads", "page_size", "layout", "window", "splits", "cap", "dtype", "fp8", "lean"),
    [(128, 64, "4d", None, 2, 0.0, torch.bfloat16, False, False),
     (128, 128, "3d", 150, 3, 0.0, torch.bfloat16, False, False),
     (96, 64, "4d", None, 1, 0.0, torch.bfloat16, False, False),
     (64, 64, "4d", 150, 5, 30.0, torch.float16, False, False),
     (128, 64, "4d", None, 1, 0.0, torch.bfloat16, False, False),
     (40, 64, "4d", None, 2, 0.0, torch.bfloat16, False, False),
     (16, 64, "4d", None, 2, 0.0, torch.bfloat16, False, False),
     (16, 128, "3d", 150, 3, 30.0, torch.float16, False, False),
     (10, 64, "4d", None, 1, 0.0, torch.bfloat16, False, False),
     (1, 64, "4d", 150, 5, 0.0, torch.bfloat16, False, False),
     (16, 64, "4d", None, 8, 0.0, torch.bfloat16, False, False),
     (12, 64, "4d", 150, 7, 30.0, torch.float16, False, False),
     (16, 64, "4d", None, 9, 0.0, torch.bfloat16, False, False),
     (128, 64, "4d", None, 2, 0.0, torch.bfloat16, True, False),
     (64, 128, "3d", 150, 3, 30.0, torch.float16, True, False),
     (40, 64, "4d", None, 1, 0.0, torch.bfloat16, True, False),
     (128, 128, "3d", 150, 3, 0.0, torch.bfloat16, False, True),
     (96, 64, "4d", None, 1, 0.0, torch.bfloat16, False, True),
     (64, 64, "4d", 150, 5, 30.0, torch.float16, False, True),
     (40, 64, "4d", None, 2, 0.0, torch.bfloat16, False, True),
     (128, 64, "4d", None, 2, 0.0, torch.bfloat16, True, True)],
)  # fmt: skip
def test_sm90_mla_fast_path_matches_golden(device, num_heads, page_size, layout, window, splits, cap, dtype,
                                           fp8, lean) -> None:  # fmt: skip
    """The Gluon stage 1 (DeepSeek's widths, 32 heads or more, pages of 64k keys) against golden: whole tiles and
    the partial tiles at each split's ends (window and split starts off a tile, rows shorter than a tile, an
    empty row), the NaN moat around every row, a head count that leaves a half-empty head block and one (40
    heads) with 24 empty rows, one split (o and lse written directly) and several, a logit cap, fp16, a query
    whose heads are 592 elements apart (96 heads); an FP8 cache (its codes widened in shared memory, the moat's
    NaN codes zeroed there, the scale on scores and output) with bf16 and fp16 queries. ``lean``: ``LEAN_SOFTMAX``
    (masks on a split's edge tiles only, the scale in the exponents' fma; with a cap or an FP8 cache only the former),
    over a window and splits that start inside a tile and head blocks with empty rows."""
    lens = [300, 200, 64, 63, 1, 0, 1000]
    d = make_decode(device, 43, lens, is_mla=True, num_heads=num_heads, widths=(512, 64), page_size=page_size,
                    layout=layout, dtype=dtype, fp8=fp8, window=window, cap=cap)  # fmt: skip
    d.q = padded_query(d.q, 16) if num_heads == 96 else d.q
    d.sm_scale = 192**-0.5
    config = {**_config("sm90", True), "LEAN_SOFTMAX": lean}
    rows = len(lens)
    o, lse = torch.empty(rows, num_heads, 512, device=device), torch.empty(rows, num_heads, device=device)
    args = (d.q, d.k, d.v, o, lse, d.table, d.lens, torch.empty(rows, num_heads, splits, 513, device=device), splits,
            d.sm_scale, page_size, cap, d.k_scale, d.v_scale, True, window, config)  # fmt: skip
    few = num_heads <= 16
    kernel = decode_attention_sm90.mla_decode_few_rows_kernel if few else decode_attention_sm90.mla_decode_stage1_kernel
    plan = _plan_decode(*args)
    assert plan.stage1._kernel is kernel and plan.stage1._constexprs.get("LEAN_SOFTMAX", False) == (lean and not few)
    # the few-rows kernel merges 2 to 8 splits itself, in one cluster a row (7 clusters fit any Hopper GPU); one split
    # needs no merge, 9 the merge kernel
    assert (plan.merge is no_launch) == (few and 1 < splits <= 8), (plan.merge, splits)
    o, lse, _ = d.run(splits, config=config)
    ref_o, ref_lse = d.golden()
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16" if dtype == torch.bfloat16 else "float16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


@sm90_only("the Gluon stage 1")
@pytest.mark.parametrize(("num_heads", "splits", "window", "fp8"),
                         [(128, 1, None, False), (64, 3, 700, False), (40, 2, None, True)])  # fmt: skip
def test_sm90_mla_rescale_if_grew_changes_no_bit(device, num_heads, splits, window, fp8) -> None:
    """``RESCALE_IF_GREW`` (each warp of the 64-row kernel's value warpgroup skips its rescale where no row of its 16
    has a new max: every factor is exactly 1) gives the outputs, LSE and partials of the rescale on every tile bit
    for bit, over rows of 1-63 tiles (their first tiles rescale, most late ones skip), a window, empty head rows (40
    heads) and an FP8 cache."""
    d = make_decode(device, 47, [4000, 1500, 300, 1, 0], is_mla=True, num_heads=num_heads, widths=(512, 64),
                    page_size=64, fp8=fp8, window=window)  # fmt: skip
    d.sm_scale = 192**-0.5
    rescaling, skipping = ({**_config("sm90", True), "RESCALE_IF_GREW": grew} for grew in (False, True))
    runs = [d.run(splits, config=config) for config in (rescaling, skipping)]
    plan = _plan_decode(d.q, d.k, d.v, *runs[1][:2], d.table, d.lens, runs[1][2], splits, d.sm_scale, 64, 0.0,
                        d.k_scale, d.v_scale, True, window, skipping)
    assert plan.stage1._constexprs["RESCALE_IF_GREW"]
    for rescaled, skipped in zip(*runs):
        if rescaled is not None:
            torch.testing.assert_close(skipped, rescaled, rtol=0, atol=0, equal_nan=True)


def test_this_triton_can_launch_clusters_of_a_compiled_kernel() -> None:
    """The clustered launch (``Launch(..., cluster=c)``) rests on Triton's NVIDIA launcher reading the packed
    metadata as ``(num_warps, num_ctas, shared)`` and launching ``num_ctas``-program clusters along x: true of the
    Triton versions this package pins (3.6 on the H200, 3.9 in CI). A Launch cannot cluster a grid it cannot cut."""
    assert cluster_launches()
    with pytest.raises(ValueError, match="cluster"):
        Launch(decode_attention_sm90.mla_decode_few_rows_kernel, (12,), (), {}, cluster=8)


@sm90_only("a thread-block cluster")
def test_few_rows_decode_clusters_its_splits_only_where_every_cluster_runs_at_once(device) -> None:
    """``cluster_capacity`` (the driver's ``cuOccupancyMaxActiveClusters``) lies between 1 and ``SMs // c`` clusters
    of ``c`` one-SM programs, and the few-rows decode merges in clusters exactly up to that many rows: a second wave
    of clusters would wait for the first (decode B=32 H=16 L=32K: 435 against 276 us on the H200)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    capacities = {c: cluster_capacity(index, c) for c in range(2, 9)}
    print(f"clusters at once on {torch.cuda.get_device_name(index)} ({sms} SMs): {capacities}")
    for c, capacity in capacities.items():
        assert 1 <= capacity <= sms // c, (c, capacity)
        assert decode_attention_sm90.merges_in_cluster(device, capacity, c)
        assert not decode_attention_sm90.merges_in_cluster(device, capacity + 1, c)
    assert not decode_attention_sm90.merges_in_cluster(device, 1, 9)


@pytest.mark.parametrize(
    ("heads", "page_size", "fp8", "layout", "q_pad", "served"),
    [(128, 64, False, "4d", 0, "wide"), (64, 128, False, "3d", 0, "wide"), (40, 64, False, "4d", 0, "wide"),
     (16, 64, False, "4d", 0, "few"), (20, 64, False, "4d", 0, None), (128, 16, False, "4d", 0, None),
     (16, 16, False, "4d", 0, None), (128, 64, True, "4d", 0, "wide"), (16, 64, True, "4d", 0, None),
     (128, 16, True, "4d", 0, None),
     (128, 64, False, "cross_layer", 0, None), (128, 64, False, "4d", 16, "wide"), (128, 64, False, "4d", 8, None),
     (16, 64, False, "4d", 8, None)],
)  # fmt: skip
def test_the_sm90_decode_path_takes_exactly_the_calls_it_serves(device, monkeypatch, heads, page_size, fp8, layout,
                                                                q_pad, served) -> None:  # fmt: skip
    """With the device taken for an H100/H200, the plan launches a Gluon stage 1 at DeepSeek's widths,
    TMA-addressable pages of 64k keys and a query whose strides are multiples of 16 elements: the 64-row schedule
    for 32 heads or more (a 16-bit or an FP8 cache), the few-rows one for 16 or fewer (a 16-bit cache); the
    portable kernel otherwise (20 heads, pages of 16, FP8 at 16 heads, pages not back to back, a head stride of
    584). Nothing is launched: only the plan is built (on the CPU in CI)."""
    monkeypatch.setattr(decode_attention_sm90, "device_arch", lambda device: "sm90")
    asked = []  # whether the GPU could run a cluster a row is the device's to say; here: yes
    monkeypatch.setattr(decode_attention_sm90, "merges_in_cluster", lambda *args: asked.append(args[1:]) or True)
    d = make_decode(device, 3, [70, 0], is_mla=True, num_heads=heads, widths=(512, 64), page_size=page_size, fp8=fp8,
                    layout=layout)  # fmt: skip
    d.q = padded_query(d.q, q_pad) if q_pad else d.q
    o, lse = torch.empty(2, heads, 512, device=device), torch.empty(2, heads, device=device)
    workspace = torch.empty(2, heads, 2, 513, device=device)
    plan = _plan_decode(d.q, d.k, d.v, o, lse, d.table, d.lens, workspace, 2, d.sm_scale, page_size, 0.0, d.k_scale,
                        d.v_scale, True, None, _config("sm90", True))  # fmt: skip
    kernels = {"wide": decode_attention_sm90.mla_decode_stage1_kernel,
               "few": decode_attention_sm90.mla_decode_few_rows_kernel}  # fmt: skip
    assert plan.stage1._kernel is kernels.get(served, _decode_stage1_kernel)
    assert (plan.descriptors.make is decode_attention_sm90.descriptors) == (served is not None)
    assert (plan.merge is no_launch) == (served == "few")  # its two splits merged in one cluster a row
    assert asked == ([(2, 2)] if served == "few" else [])  # (rows, splits)


def test_inline_ptx_of_the_fp8_widening_is_exact_for_every_code() -> None:
    """The Gluon stage 1's e4m3 -> bf16 widening (``decode_attention_sm90._E4M3_TO_BF16_ASM``, run only compiled) on
    the model of its instructions (:func:`tests.support.run_ptx`): each of the 256 codes at each of a word's 4 bytes
    gives torch's conversion bit for bit, the NaN codes (0x7F, 0xFF) a NaN; and the patch is needed: without it they
    give +-480."""
    asm = decode_attention_sm90._E4M3_TO_BF16_ASM.value
    codes = torch.arange(256, dtype=torch.int32)
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    unpatched = asm.replace("or.b32 $0, a, f;", "mov.b32 $0, a;").replace("or.b32 $1, b, g;", "mov.b32 $1, b;")
    for code in range(256):
        for position in range(4):
            word = (code << (8 * position)) | (0x38 << (8 * ((position + 1) % 4)))  # a neighbour: 1.0
            lanes = []
            for out in run_ptx(asm, [word], 2):
                lanes += [out & 0xFFFF, out >> 16]
            got = torch.tensor(lanes, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            want = torch.tensor([code if p == position else 0x38 if p == (position + 1) % 4 else 0 for p in range(4)],
                                dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)  # fmt: skip
            if expected[code].isnan():
                assert got[position].isnan(), hex(code)
                got[position] = want[position] = 0
                plain = run_ptx(unpatched, [word], 2)[position // 2] >> (16 * (position % 2)) & 0xFFFF
                assert plain == (0x43F0 if code == 0x7F else 0xC3F0), hex(code)  # +-480
            assert_bits_equal(got, want)


@gluon.jit
def _widen_probe(codes_ptr, out_ptr, start, end, WIDTH: gl.constexpr, SWIZZLE: gl.constexpr,
                 WORDS_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):  # fmt: skip
    """``decode_attention_sm90._widen`` alone: 64 rows of ``WIDTH`` FP8 codes through shared memory laid out as the
    stage 1's TMA leaves them, widened to ``DTYPE`` and written back out."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    offsets = rows[:, None] * WIDTH + cols[None, :]
    codes = gl.allocate_shared_memory(gl.float8e4nv, [64, WIDTH], gl.NVMMASharedLayout(SWIZZLE, 8, rank=2))
    wide = gl.allocate_shared_memory(DTYPE, [64, WIDTH], decode_attention_sm90._SMEM)
    codes.store(gl.load(codes_ptr + offsets))
    decode_attention_sm90._barrier()
    decode_attention_sm90._widen(codes, wide, 0, start, end, SWIZZLE, WORDS_LAYOUT)
    decode_attention_sm90._barrier()
    gl.store(out_ptr + offsets, wide.load(layout))


@sm90_only("the Gluon stage 1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("part", ["latent", "rope"])
@pytest.mark.parametrize(("start", "end"), [(0, 64), (5, 50)])
def test_sm90_fp8_widening_is_exact_for_every_code(device, dtype, part, start, end) -> None:
    """The Gluon stage 1 widens an FP8 cache's codes in shared memory (bf16: integer moves and one exact multiply,
    the NaN codes patched; fp16: the hardware conversion): every one of the 256 codes, in both swizzles its parts
    use, against torch's conversion bit for bit (NaN codes: NaN), keys outside ``[start, end)`` zero."""
    width, swizzle, words = ((256, 128, decode_attention_sm90._WIDEN_LAYOUT) if part == "latent" else
                             (64, 64, decode_attention_sm90._WIDEN_PE_LAYOUT))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.int32).repeat(64 * width // 256)[torch.randperm(64 * width, generator=gen)]
    codes = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(64, width).to(device)
    out = torch.empty(64, width, dtype=dtype, device=device)
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    _widen_probe[(1,)](codes, out, start, end, width, swizzle, words, gl_dtype, num_warps=4)
    expected = codes.to(dtype)
    expected[:start] = 0
    expected[end:] = 0
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert_bits_equal(out[~nan], expected[~nan])


_SM90_COMPILE = """
import json
from triton_impl import decode_attention_sm90
from triton_impl.bench import cuobjdump, sass_resources
for verify, heads, qlen, fp8 in ((False, 128, 1, False), (False, 64, 1, False), (True, 16, 4, False),
                                 (True, 128, 2, False), (False, 16, 1, False), (False, 128, 1, True),
                                 (True, 128, 2, True)):
    for single_split in (False, True):
        kernel = decode_attention_sm90.compile_for_sm90(verify=verify, heads=heads, qlen=qlen, fp8=fp8,
                                                        single_split=single_split, few_rows=heads == 16 and not verify)
        sass = cuobjdump(kernel.asm["cubin"], "--dump-sass")
        stores16 = kernel.asm["ptx"].count("st.global.b16")
        print(json.dumps([verify, heads, single_split, *sass_resources(kernel.asm["cubin"]), kernel.metadata.shared,
                          sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR"), stores16,
                          kernel.asm["ptx"].count("barrier.cluster.wait")]))
"""


def test_sm90_mla_kernels_compile_for_hopper() -> None:
    """The Gluon MLA stage 1 never runs under the interpreter: compile the decode and verify entries for sm_90
    here (a process of its own, TRITON_INTERPRET=0), one and several splits, the few-rows decode entry and the
    64-row entries over an FP8 cache. Shared memory: the query, two 64-key stages and P (224 KiB of the 227 an
    H100/H200 block may take; an FP8 cache's two stages of codes and its one widened tile take the same bytes; the
    few-rows schedule's 16-row query leaves 164 KiB). No stack under the H200's Triton 3.6 (168 registers at
    launch; the partitions then take 256 / 208 / 40; the few-rows kernel, one warpgroup, 242, or 246 where it merges
    several splits itself); Triton 3.9 spills 32 bytes (the few-rows kernel 40-48). The few-rows kernel with several
    splits waits once for its cluster (``barrier.cluster``), then merges them. The MMAs stay asynchronous: no wait
    after each one. Several splits of a bf16 output store the partials as bf16 pairs, one 4-byte store each."""
    rows = compiled_rows(_SM90_COMPILE)
    assert len(rows) == 14
    for verify, heads, single_split, registers, stack, shared, hgmma, waits, stores16, cluster_waits in rows:
        few = heads == 16 and not verify  # the few-rows schedule: a 16-row query, 48 bytes of stack under Triton 3.9
        spill = 0 if triton.__version__.startswith("3.6") else 48 if few else 32
        least = 160 * 1024 if few else 224 * 1024
        assert stack <= spill and registers <= 255 and least <= shared <= 232448, rows
        # 36 score and 8 value HGMMA (few rows: 36 and 32), issued as groups with a few waits; where ptxas cannot
        # prove a group's registers untouched it waits after every HGMMA and the tensor cores idle between them
        assert hgmma == (68 if few else 44) and waits <= 4, rows
        # the 64-row kernel's bf16 partials go out as 4-byte words (two values; records are 2052 bytes apart), not
        # one 2-byte value a store
        assert few or single_split or stores16 == 0, rows
        # several splits of the few-rows kernel wait once for their cluster, then merge: nothing else waits so
        assert cluster_waits == (few and not single_split), rows


def test_sm90_mla_kernels_compile_for_int64_lengths() -> None:
    """The API takes int64 ``seq_lens`` / ``real_seq_lens`` (torch's default integer): every Gluon MLA stage 1 reads a
    length as an int32, so it compiles for int64 length vectors too. The verify stage 1 did not (its tile index, and
    with it a stage's ``index``, came out int64), and a verify call with int64 lengths failed on sm_90."""
    script = (
        "from triton_impl import decode_attention_sm90\n"
        "for verify, heads, qlen in ((True, 16, 4), (True, 128, 2), (False, 128, 1), (False, 16, 1)):\n"
        "    decode_attention_sm90.compile_for_sm90(verify=verify, heads=heads, qlen=qlen, few_rows=heads == 16 and not"
        " verify, lengths='i64')\n"
        "print('compiled')\n"
    )
    assert "compiled" in run_compiled(script)


_SOFTMAX_PATHS_COMPILE = """
import json, re
from triton_impl import decode_attention_sm90
from triton_impl.bench import sass_code, sass_main_path, sass_resources
for verify, qlen, fp8 in ((False, 1, False), (True, 4, False), (True, 2, True)):
    for lean, grew in ((False, False), (True, False), (True, True)):
        kernel = decode_attention_sm90.compile_for_sm90(verify=verify, heads=128, qlen=qlen, fp8=fp8,
                                                        single_split=True, lean_softmax=lean, rescale_if_grew=grew)
        code, loops = sass_code(kernel.asm["cubin"])
        counts = []
        # the softmax warpgroup's tile loop (the innermost loop that holds a tile's 36 score HGMMA), then the value
        # warpgroup's (its 4 HGMMA)
        for hgmma in (36, 4):
            head, tail = min(((h, t) for h, t in loops if sum(h <= a <= t and op == "HGMMA" for a, op, _, _ in code)
                              >= hgmma), key=lambda loop: loop[1] - loop[0])  # fmt: skip
            path = sass_main_path(code, head, tail)
            masks = sum(bool(re.search(r"FSEL R\\d+, R\\d+, -INF", line)) for line in path)
            counts += [len(path), masks, sum(" FFMA " in line for line in path), sum(" FMUL " in line for line in path)]
        print(json.dumps([verify, fp8, lean, grew, *sass_resources(kernel.asm["cubin"]), *counts]))
"""


@functools.cache
def _softmax_paths() -> dict[tuple, list[int]]:
    """The 64-row MLA kernels compiled for sm_90 (decode, verify qlen 4, verify qlen 2 over an FP8 cache; H=128, one
    split) without ``LEAN_SOFTMAX``, with it, and with it and ``RESCALE_IF_GREW``: ``(verify, fp8, lean, grew) ->
    [registers, stack, then per loop (the softmax warpgroup's, the value warpgroup's) the instructions on the path a
    tile takes through it when every row sees it whole and no row's max grew (bench.sass_main_path), the masks
    among them, the FFMA, the FMUL]``."""
    rows = {tuple(row[:4]): row[4:] for row in compiled_rows(_SOFTMAX_PATHS_COMPILE)}
    assert len(rows) == 9
    return rows


def test_sm90_mla_lean_softmax_takes_the_masks_off_the_interior_tiles() -> None:
    """``LEAN_SOFTMAX`` (the sm90 entries', decode and verify) compiled for sm_90: on the path a
    tile takes through the softmax warpgroup's loop when every row sees it whole, no score is masked (the masks sit
    in a block that a branch on the tile's bounds skips) and, for a 16-bit cache, each exponent's argument is one
    fma (the scale folded in: 32 ``FFMA`` a thread, where the tree multiplies, then subtracts). Triton 3.6, the
    interior tile's path (``bench.sass_main_path``): decode 614 -> 505 instructions, verify 590 -> 495, verify over
    an FP8 cache 1198 -> 1135; registers and stack as without it."""
    rows = {key[:3]: row[:5] for key, row in _softmax_paths().items() if not key[3]}
    for (verify, fp8, lean), (registers, stack, path, masks, ffma) in rows.items():
        tree_registers, tree_stack, tree_path, tree_masks, tree_ffma = rows[verify, fp8, False]
        assert registers <= tree_registers and stack <= tree_stack, rows
        if lean:
            assert masks == 0 and tree_masks >= 32, rows  # 32 scores a thread and tile
            assert path <= tree_path - (32 if fp8 else 64), rows
            assert fp8 or ffma >= tree_ffma + 32, rows


def test_sm90_mla_rescale_if_grew_takes_the_rescale_off_the_path() -> None:
    """``RESCALE_IF_GREW`` compiled for sm_90 (with ``LEAN_SOFTMAX``, as the sm90 entries run it): on the path a tile
    takes where no row's max grew, the value warpgroup does not multiply its output half (128 ``FMUL`` a thread
    without it; the branch is the warp's own, :func:`decode_attention_sm90._rescaled`), the softmax warpgroup's
    code is as before (skipping there made every case 0.3-8.6% slower on the H200), and nothing grows: registers and
    stack as before. Triton 3.6: the value warpgroup's path 173 -> 53 (FP8 650 -> 529)."""
    rows = _softmax_paths()
    for (verify, fp8, _, grew), row in rows.items():
        if not grew:
            continue
        registers, stack, soft, _, _, soft_fmul, values, _, _, values_fmul = row
        t_registers, t_stack, t_soft, _, _, t_soft_fmul, t_values, _, _, t_values_fmul = rows[verify, fp8, True, False]
        assert registers <= t_registers and stack <= t_stack, rows
        assert (soft, soft_fmul) == (t_soft, t_soft_fmul), rows
        # the skipped multiplications, less the vote and the four branches (a few instructions each)
        assert t_values_fmul - values_fmul == 128 and values <= t_values - 110, rows


_PROBE_COMPILE = """
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource
from tests.racecheck_probe import ROUNDS, hand_over_kernel
from triton_impl.bench import cuobjdump
signature = {"out_ptr": "*fp32", "ROUNDS": "constexpr", "EARLY_FREE": "constexpr"}
for early in (False, True):
    source = GluonASTSource(hand_over_kernel, signature, {(1,): ROUNDS, (2,): early}, {(0,): [["tt.divisibility", 16]]})
    kernel = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    sass = [line for line in cuobjdump(kernel.asm["cubin"], "--dump-sass").splitlines() if "/*0" in line]
    ops = ["load" if re.search(r"\\bLDS\\s", s) else "wait" if "SYNCS.PHASECHK" in s else "arrive" if "SYNCS.ARRIVE"
           in s else "" for s in sass]
    first_load = ops.index("load")
    wait = max(i for i in range(first_load) if ops[i] == "wait")
    print(json.dumps([early, "arrive" in ops[wait:first_load], ops.count("wait"), ops.count("arrive")]))
"""


def test_racecheck_probe_compiles_for_hopper_with_its_two_orders() -> None:
    """``tests/racecheck_probe.py`` (run under racecheck on the H200: the MLA stage 1's mbarrier hand-over in a
    kernel of its own) compiles for sm_90, and its SASS keeps the two orders it claims: the reader frees the buffer
    after its load (``SYNCS.ARRIVE`` after the ``LDS`` that follows its wait), and with ``EARLY_FREE`` before it
    (between the wait and the load). Both hold the mbarrier waits and arrivals of each side."""
    rows = compiled_rows(_PROBE_COMPILE, timeout=300)
    assert [(early, freed_first) for early, freed_first, _, _ in rows] == [(False, False), (True, True)], rows
    assert all(waits >= 2 and arrivals >= 2 for _, _, waits, arrivals in rows), rows


# -- invariances -----------------------------------------------------------------------------


def test_page_size_invariance_is_bit_exact_and_split_count_within_tolerance(device) -> None:
    """The same keys in pages of 1, 5 and 16 give the same bits (tiles do not follow pages); split
    counts 1, 2 and 7 agree with golden (the summation order changes, so within tolerance)."""
    gen = generator(11)
    lens = [29, 6, 0]
    keys = [torch.randn(n, 2, 40, generator=gen) for n in lens]
    q = torch.randn(len(lens), 4, 24, generator=gen).to(device)
    results = {}
    for page_size, splits in [(1, 1), (5, 1), (16, 1), (5, 2), (16, 7)]:
        cache, table = paginate(keys, page_size, generator(page_size))
        cache, table = cache.to(device), table.to(device)
        d = Decode(q, cache[..., :24], cache[..., 24:], table, torch.tensor(lens, device=device), 0.3, page_size,
                   is_mla=False, window=20)  # fmt: skip
        results[(page_size, splits)] = d.run(splits)[:2]
        ref_o, ref_lse = d.golden()
        assert_close(results[(page_size, splits)][0], ref_o, ("decode_attention", "o", "float32"))
        assert_close(results[(page_size, splits)][1], ref_lse, ("decode_attention", "lse", "float32"))
    for page_size in (5, 16):
        assert_bits_equal(results[(page_size, 1)][0], results[(1, 1)][0])
        assert_bits_equal(results[(page_size, 1)][1], results[(1, 1)][1])


def test_gqa_equals_mha_with_repeated_kv_heads(device) -> None:
    """H = 6 query heads on HKV = 2 KV heads == MHA on the KV heads repeated 3 times."""
    d = make_decode(device, 2, [13, 4], is_mla=False, num_heads=6, num_kv_heads=2, widths=(24, 16), page_size=4,
                    dtype=torch.float32, window=9, cap=4.0)  # fmt: skip
    o_gqa, lse_gqa, _ = d.run(2)
    mha = Decode(**{**d.__dict__, "k": d.k.repeat_interleave(3, dim=-2), "v": d.v.repeat_interleave(3, dim=-2)})
    o_mha, lse_mha, _ = mha.run(2)
    assert_close(o_gqa, o_mha.double(), ("decode_attention", "o", "float32"))
    assert_close(lse_gqa, lse_mha.double(), ("decode_attention", "lse", "float32"))


def test_batch_invariance_with_one_split(device) -> None:
    """With S = 1 a row's bits do not depend on the rest of the batch: each row alone, and the
    batch reversed, give exactly the bits of the full batch."""
    d = make_decode(device, 8, [17, 0, 40, 3], is_mla=True, num_heads=4, widths=(32, 16), page_size=4, window=24)
    o, lse, _ = d.run(1)
    for order in ([0], [2], [3, 2, 1, 0]):
        sub = Decode(**{**d.__dict__, "q": d.q[order], "table": d.table[order], "lens": d.lens[order]})
        o_sub, lse_sub, _ = sub.run(1)
        assert_bits_equal(o_sub, o[order])
        assert_bits_equal(lse_sub, lse[order])


def test_cache_layouts_are_bit_exact(device) -> None:
    """A 3-D token-major cache and a per-layer view into a cross-layer cache (page stride 3x) give
    the bits of the 4-D cache."""
    results = []
    for layout in ("4d", "3d", "cross_layer"):
        d = make_decode(device, 4, [9, 22], is_mla=True, num_heads=4, widths=(16, 16), page_size=4, layout=layout)
        results.append(d.run(2)[:2])
    for o, lse in results[1:]:
        assert_bits_equal(o, results[0][0])
        assert_bits_equal(lse, results[0][1])


def test_block_table_with_spare_rows_or_a_unit_dimension(device) -> None:
    """A block table sized for a larger batch (``[R + 2, pages]``, the extra rows garbage) or with a
    trailing unit dimension (``[R, pages, 1]``) gives the bits of the plain table, in the kernel and
    in the golden model."""
    d = make_decode(device, 14, [9, 22], is_mla=False, num_heads=4, num_kv_heads=2, widths=(16, 24), page_size=4)
    o, lse, _ = d.run(2)
    ref_o, ref_lse = d.golden()
    spare = torch.cat([d.table, torch.full_like(d.table, 2**30 + 7)])
    for table in (spare, d.table[:, :, None]):
        o_t, lse_t, _ = d.run(2, req_to_token=table)
        assert_bits_equal(o_t, o)
        assert_bits_equal(lse_t, lse)
        ref_o_t, ref_lse_t = Decode(**{**d.__dict__, "table": table}).golden()
        assert torch.equal(ref_o_t, ref_o) and torch.equal(ref_lse_t, ref_lse)


# -- the serving flatten and the split count ---------------------------------------------------

CONTEXT_LENS = [0, 1, 37, 512]


@pytest.mark.parametrize("query_len", [2, 3, 4, 5, 8])
def test_expand_decode_rows_hand_computed(query_len: int) -> None:
    """vLLM's forward_mqa flatten: context lengths 0, 1, 37, 512 plus a padding request (L = 0)."""
    seq_lens = torch.tensor([c + query_len for c in CONTEXT_LENS] + [0], dtype=torch.int32)
    table = torch.arange(len(seq_lens) * 64, dtype=torch.int32).reshape(len(seq_lens), 64)
    for causal in (True, False):
        rows_table, rows_lens = expand_decode_rows(table, seq_lens, query_len, causal)
        want_lens = []
        for b, length in enumerate(seq_lens.tolist()):
            assert torch.equal(rows_table[b * query_len : (b + 1) * query_len], table[b].expand(query_len, -1))
            if causal:  # row t sees the prefix plus block tokens 0..t
                want_lens += [max(length - (query_len - 1) + t, 0) for t in range(query_len)]
            else:
                want_lens += [length] * query_len
        assert rows_lens.tolist() == want_lens
        assert rows_lens.dtype == seq_lens.dtype and rows_table.dtype == table.dtype
        golden_table, golden_lens = golden_expand_decode_rows(table, seq_lens, query_len, causal)
        assert torch.equal(golden_table, rows_table) and torch.equal(golden_lens, rows_lens)
    causal_lens = expand_decode_rows(table, seq_lens, query_len, True)[1].reshape(-1, query_len)
    assert bool((causal_lens[:-1].diff(dim=1) == 1).all()) and causal_lens[:-1, -1].tolist() == seq_lens[:-1].tolist()
    assert causal_lens[-1].tolist() == [0] * query_len  # the padding request's rows are empty


def test_single_token_decode_is_untouched() -> None:
    seq_lens = torch.tensor([5, 0, 9])
    table = torch.arange(6).reshape(3, 2)
    for causal in (True, False):
        rows_table, rows_lens = expand_decode_rows(table, seq_lens, 1, causal)
        assert torch.equal(rows_table, table) and torch.equal(rows_lens, seq_lens)


def test_flattened_multi_token_decode_is_causal_attention(device) -> None:
    """Kernel on the flattened rows == per-token golden rows built by hand: request b's token t sees
    keys [0, L_b - Q + 1 + t) (context lengths 1 and 6, Q = 3, plus a padding request)."""
    query_len = 3
    d = make_decode(device, 6, [1 + query_len, 6 + query_len, 0], is_mla=True, num_heads=4, widths=(16, 16),
                    page_size=4)  # fmt: skip
    table, lens = expand_decode_rows(d.table, d.lens, query_len, causal=True)
    q = torch.randn(len(lens), 4, 32, generator=generator(7)).to(d.q.dtype).to(device)
    flat = Decode(**{**d.__dict__, "q": q, "table": table, "lens": lens})
    o, lse, _ = flat.run(2)
    hand_lens = torch.tensor([max(L - query_len + 1 + t, 0) for L in d.lens.tolist() for t in range(query_len)])
    ref = Decode(**{**flat.__dict__, "table": d.table.repeat_interleave(query_len, 0), "lens": hand_lens.to(device)})
    ref_o, ref_lse = ref.golden()
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


def test_compute_num_kv_splits() -> None:
    """``min(next_pow2(max(1, L // 512)), 2 * sm_count)`` with L clamped to the window first."""
    assert [_compute_num_kv_splits(n, 132) for n in (0, 1, 511, 1023, 1024, 5000, 131072)] == [1, 1, 1, 1, 2, 16, 256]
    assert _compute_num_kv_splits(131072, 66) == 132  # capped at 2 * sm_count, not a power of two
    assert _compute_num_kv_splits(5000, 132, sliding_window=1024) == 2
    assert _compute_num_kv_splits(5000, 132, sliding_window=0) == 16
    assert _compute_num_kv_splits(600, 132, sliding_window=4096) == 1


# -- negative controls: bugs planted on the kernel's path fail the tolerances ---------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_off_by_one_fails_every_tolerance(device, dtype: str) -> None:
    """The kernel launched with the window off by one (W - 1 or W + 1: one key too few or too many)
    fails against the golden window W, for o and for the LSE stored in the model dtype, while the
    right window passes: a negative control for every decode_attention tolerance entry (the fp32
    LSE entry is checked in the bf16 case)."""
    window = 4
    d = make_decode(device, 9, [window + 6, window + 1], is_mla=False, num_heads=2, num_kv_heads=1,
                    widths=(16, 16), page_size=4, dtype=DTYPES[dtype], window=window)  # fmt: skip
    ref_o, ref_lse = d.golden()
    lse_dtypes = [DTYPES[dtype]] + ([torch.float32] if dtype == "bfloat16" else [])
    for lse_dtype in lse_dtypes:
        o, lse, _ = d.run(2, lse_dtype)
        assert_close(o, ref_o, ("decode_attention", "o", dtype))
        assert_close(lse, ref_lse, ("decode_attention", "lse", lse_dtype))
        for wrong in (window - 1, window + 1):
            bad_o, bad_lse, _ = d.run(2, lse_dtype, sliding_window=wrong)
            assert fails_tolerance(bad_o, ref_o, ("decode_attention", "o", dtype))
            assert fails_tolerance(bad_lse, ref_lse, ("decode_attention", "lse", lse_dtype))


def _drop_one_split(d: Decode, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 as launched, then the real stage-2 merge with split 1's slot marked empty (a stage 1
    that skipped a live split, or a stage 2 that believed it empty)."""
    _, _, logits = d.run(splits)
    logits[:, :, 1, -1] = float("-inf")
    rows, heads, _, width = logits.shape
    o = nan_filled((rows, heads, width - 1), d.q.dtype, d.q.device)
    lse = nan_filled((rows, heads), torch.float32, d.q.device)
    merge_splits(logits, o, lse, bf16_values=bf16_partials(o.dtype))
    return o, lse


PLANTED_BUGS = {
    # The caller forgets to count the token being decoded: every extent one short.
    "extent one short": lambda d: d.run(4, b_seq_len=d.lens - 1)[:2],
    # Scale from the value width (Lv = 40) instead of the key width (Lk = 24).
    "sm_scale from Lv": lambda d: d.run(4, sm_scale=d.v.shape[-1] ** -0.5)[:2],
    # V dequantized with K's scale.
    "v_scale := k_scale": lambda d: d.run(4, v_scale=d.k_scale)[:2],
    # Two rows of equal length read each other's pages.
    "block-table rows swapped": lambda d: d.run(4, req_to_token=d.table[[1, 0, 2]])[:2],
    "one split dropped from the merge": lambda d: _drop_one_split(d, 4),
}


def test_planted_bugs_fail_the_tolerance(device) -> None:
    """The kernel (stage 1 and the stage-2 merge kernel) with one careless argument or one lost
    split fails the o tolerance against the golden model; launched correctly it passes. GQA with
    Lk != Lv, an FP8 cache with distinct K and V scales, rows long enough that all 4 splits hold keys."""
    d = make_decode(device, 10, [21, 21, 9], is_mla=False, num_heads=2, num_kv_heads=1, widths=(24, 40),
                    page_size=4, fp8=True)  # fmt: skip
    d.sm_scale = 24**-0.5
    ref_o, ref_lse = d.golden()
    o, lse, _ = d.run(4)
    assert_close(o, ref_o, ("decode_attention", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))
    for bug, launch in PLANTED_BUGS.items():
        bad_o, _ = launch(d)
        assert fails_tolerance(bad_o, ref_o, ("decode_attention", "o", "bfloat16")), bug


# -- bad input ---------------------------------------------------------------------------------


def _bad_input_cases(device):
    d = make_decode(device, 0, [5, 3], is_mla=False, num_heads=4, num_kv_heads=2, widths=(16, 16), page_size=4)
    rows, heads, lv = 2, 4, 16
    o = torch.empty(rows, heads, lv, dtype=d.q.dtype, device=device)
    lse = torch.empty(rows, heads, device=device)
    logits = torch.empty(rows, heads, 2, lv + 1, device=device)
    base = dict(q=d.q, k_buffer=d.k, v_buffer=d.v, o=o, lse=lse, req_to_token=d.table, b_seq_len=d.lens,
                attn_logits=logits, num_kv_splits=2, sm_scale=0.25, page_size=4)  # fmt: skip
    bad_table = d.table.clone()
    bad_table[1, 0] = 10**6
    one_past = d.table.clone()
    one_past[0, 1] = d.k.shape[0]  # the first page past the cache, in request 0's last (partial) page
    return base, [
        ({"q": d.q[0]}, ValueError, "q: expected rank 3"),
        ({"q": d.q.to(torch.float64)}, TypeError, "q: expected dtype"),
        ({"q": d.q[:, :3]}, ValueError, "3 query heads is not a multiple"),
        ({"k_buffer": d.k.to(torch.float16)}, TypeError, "k_buffer: expected dtype"),
        ({"v_buffer": d.v[..., :1, :]}, ValueError, "v_buffer: expected shape"),
        ({"o": o[:, :, :8]}, ValueError, r"o: expected shape \[2, 4, 16\]"),
        ({"lse": lse[:1]}, ValueError, r"lse: expected shape \[2, 4\]"),
        ({"attn_logits": None}, TypeError, "attn_logits: expected a torch.Tensor"),
        ({"attn_logits": logits[:, :, :1]}, ValueError, r"attn_logits: expected \[>= 2, 4, 2, 17\]"),
        ({"b_seq_len": d.lens.float()}, TypeError, "b_seq_len: expected dtype"),
        ({"req_to_token": d.table[:1]}, ValueError, "req_to_token: expected >= 2 rows"),
        ({"req_to_token": bad_table}, ValueError, r"req_to_token: entry \[1, 0\] = 1000000 is outside"),
        ({"req_to_token": one_past}, ValueError, rf"req_to_token: entry \[0, 1\] = {d.k.shape[0]} is outside"),
        ({"attn_logits": logits[:1]}, ValueError, r"attn_logits: expected \[>= 2, 4, 2, 17\]"),
        ({"b_seq_len": d.lens * 10}, ValueError, "req_to_token: a row needs"),
        ({"page_size": 3}, ValueError, "k_buffer: expected \\[num_pages, 3, HKV, D\\]"),
        ({"num_kv_splits": 0}, ValueError, "num_kv_splits: expected a positive int"),
        ({"logit_cap": -1.0}, ValueError, "logit_cap: expected a float >= 0"),
        ({"sliding_window": -2}, ValueError, "sliding_window: expected None, 0 or a positive int"),
        ({"config": {"BLOCK_N": 32}}, ValueError, r"config: missing keys \['BLOCK_H', 'num_stages', 'num_warps'\]"),
        ({"k_scale": 0.5}, TypeError, "k_scale: expected a one-element float tensor"),
        ({"is_mla": True}, ValueError, "k_buffer: MLA expects one latent KV head, got 2"),
        # Scalars that Python would take for valid ones (True is 1, "no" is truthy), or that fail far inside.
        ({"sm_scale": None}, ValueError, "sm_scale: expected a finite float, got None"),
        ({"logit_cap": float("inf")}, ValueError, r"logit_cap: expected a float >= 0, finite \(0: no cap\), got inf"),
        ({"sliding_window": True}, ValueError, "sliding_window: expected None, 0 or a positive int, got True"),
        ({"num_kv_splits": True}, ValueError, "num_kv_splits: expected a positive int, got True"),
        ({"is_mla": "no"}, ValueError, "is_mla: expected a bool, got 'no'"),
        ({"k_buffer": d.k[:, :, :0], "v_buffer": d.v[:, :, :0]}, ValueError, "k_buffer: expected at least one KV head"),
    ]


def test_bad_input_raises_named_errors(device, monkeypatch) -> None:
    """Named errors, block-table contents included (their host check is on for this test; serving on
    CUDA leaves it off)."""
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    base, cases = _bad_input_cases(device)
    for override, error, message in cases:
        with pytest.raises(error, match=message):
            decode_attention_fwd(**(base | override))


def test_mla_widths_must_be_powers_of_two(device) -> None:
    d = make_decode(device, 0, [4], is_mla=True, num_heads=2, widths=(16, 16), page_size=4)
    o = torch.empty(1, 2, 12, dtype=d.q.dtype, device=device)
    lse = torch.empty(1, 2, device=device)
    with pytest.raises(ValueError, match=r"v_buffer width \(MLA Lv\): expected a power of two, got 12"):
        decode_attention_fwd(d.q, d.k, d.k[..., :12], o, lse, d.table, d.lens, None, 1, 0.2, 4, is_mla=True)
    o = torch.empty(1, 2, 8, dtype=d.q.dtype, device=device)
    with pytest.raises(ValueError, match=r"rope width \(MLA Lk - Lv\): expected a power of two or 0, got 24"):
        decode_attention_fwd(d.q, d.k, d.k[..., :8], o, lse, d.table, d.lens, None, 1, 0.2, 4, is_mla=True)


def test_helpers_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="query_len: expected a positive int"):
        expand_decode_rows(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 0, True)
    with pytest.raises(ValueError, match=r"seq_lens: expected shape \[2\]"):
        expand_decode_rows(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 2, True)
    with pytest.raises(ValueError, match="sm_count: expected a positive int"):
        _compute_num_kv_splits(100, 0)
    with pytest.raises(ValueError, match="num_kv_splits: expected a positive int"):
        split_bounds(torch.tensor([3]), 0)
