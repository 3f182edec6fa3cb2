"""Causal MLA verify: Triton == golden (o, lse, stage-1 partials), the golden's split view,
invariances, edge cases, negative controls on the kernel's path, bad input.

The kernel's outputs are pre-filled with NaN, its split scratch too, so a slot it should write and
does not fails; pages and slots no request uses hold NaN (``tests.support``), so a read past a
request's keys fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from golden._paged import gather_tokens
from golden.decode_attention import decode_attention, expand_decode_rows
from golden.lse_merge import merge_states
from golden.mla_verify import mla_verify, mla_verify_split_partials, row_limits, split_bounds
from tests.support import (
    FP8_DTYPES,
    assert_bits_equal,
    assert_close,
    fails_tolerance,
    generator,
    nan_filled,
    sm90_only,
)
from tests.support import paged_cache as build_paged_cache
from triton_impl import decode_attention_sm90
from triton_impl import mla_verify as tv
from triton_impl.decode_attention import tma_layout
from triton_impl.lse_merge import bf16_partials, merge_splits, split_outputs
from triton_impl.mla_verify import (
    _VERIFY_SMALL_MAX_ROWS,
    VERIFY_CONFIGS,
    VERIFY_DEFAULT_CONFIG,
    _page_stride,
    _storage_view,
    decode_attention_fwd_verify,
    select_verify_config,
    verify_arch,
    verify_num_kv_splits,
    verify_row_blocks,
    warmup_decode_attention_fwd_verify,
)
from triton_impl.validation import CONTENT_CHECKS_ENV

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WIDTHS = [(16, 0), (16, 8), (16, 16), (32, 16), (64, 0), (64, 16)]  # (Lv, P), small enough for the interpreter


def _config(size: str, short_splits: bool = False, arch: str | None = None) -> dict:
    """An architecture's small or large config (tests run both, whatever the row count); by default
    the current architecture's, and any of ``VERIFY_CONFIGS`` runs on any device.

    ``short_splits``: 8-key split chunks instead of the config's (up to 256 on a GPU), so the short
    test sequences really use many splits on every architecture.
    """
    cfg = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS[arch or verify_arch()][size]}
    return {**cfg, "SPLIT_ALIGN": 8, "MIN_SPLIT_LEN": 8} if short_splits else cfg


@dataclass
class Problem:
    q: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    real_seq_lens: torch.Tensor | None
    qlen: int
    value_width: int
    page_size: int
    sm_scale: float
    k_scale: torch.Tensor | None

    def golden(self, **kw):
        return mla_verify(
            self.q, self.cache, self.block_table, self.seq_lens, self.real_seq_lens, self.qlen, self.value_width,
            self.sm_scale, self.page_size, k_scale=self.k_scale, dtype=torch.float64, **kw,
        )  # fmt: skip

    def golden_partials(self, num_kv_splits: int, config: dict) -> torch.Tensor:
        return mla_verify_split_partials(
            self.q, self.cache, self.block_table, self.seq_lens, self.real_seq_lens, self.qlen, self.value_width,
            self.sm_scale, self.page_size, num_kv_splits, config["SPLIT_ALIGN"], config["MIN_SPLIT_LEN"],
            k_scale=self.k_scale, dtype=torch.float64,
        )  # fmt: skip

    def run(self, num_kv_splits: int, config: dict | None = None, o_dtype: torch.dtype | None = None, **override):
        """Triton's ``(o, lse, attn_logits)``, every output pre-filled with NaN; ``override``
        replaces any argument of ``decode_attention_fwd_verify`` (negative controls plant bugs with it)."""
        rows, heads = self.q.shape[:2]
        device = self.q.device
        o = nan_filled((rows, heads, self.value_width), o_dtype or self.q.dtype, device)
        lse = nan_filled((rows, heads), torch.float32, device)
        logits = nan_filled((rows, heads, num_kv_splits, self.value_width + 1), torch.float32, device)
        args = dict(
            q=self.q, k_buffer=self.cache, v_buffer=self.cache[..., : self.value_width], o=o, lse=lse,
            req_to_token=self.block_table, seq_lens=self.seq_lens, real_seq_lens=self.real_seq_lens, qlen=self.qlen,
            attn_logits=logits if num_kv_splits > 1 else None, num_kv_splits=num_kv_splits, sm_scale=self.sm_scale,
            page_size=self.page_size, k_scale=self.k_scale, config=config,
        )  # fmt: skip
        decode_attention_fwd_verify(**(args | override))
        return o, lse, logits


def make_problem(
    seq_lens: list[int],
    qlen: int,
    heads: int,
    value_width: int,
    rope_width: int,
    page_size: int,
    device: torch.device,
    seed: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    real_seq_lens: list[int] | None = None,
    layout: str = "4d",
    shuffle: bool = True,
) -> Problem:
    gen = generator(seed)
    cache_dtype = cache_dtype or dtype
    width = value_width + rope_width
    k_scale, stored_scale = None, 1.0
    if cache_dtype in FP8_DTYPES:  # a random k_scale; stored values 1/k_scale so keys dequantize to ~N(0, 1)
        k_scale = torch.tensor(float(torch.empty(()).uniform_(0.1, 4.0, generator=gen)), device=device)
        stored_scale = 1.0 / float(k_scale)
    paged = build_paged_cache(
        seq_lens, page_size, 1, width, cache_dtype, device, gen, layout=layout, shuffle=shuffle, scale=stored_scale
    )
    q = (torch.randn(len(seq_lens) * qlen, heads, width, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    real = None if real_seq_lens is None else torch.tensor(real_seq_lens, dtype=torch.int32, device=device)
    # Scores of a few units: peaked enough that a wrong key weight shows, flat enough to mix many keys.
    sm_scale = 2.0 / math.sqrt(width)
    return Problem(q, paged.cache, paged.block_table, paged.seq_lens, real, qlen, value_width, page_size, sm_scale,
                   k_scale)  # fmt: skip


def _dtype_name(problem: Problem) -> str:
    return str(problem.q.dtype).removeprefix("torch.")


def check_against_golden(problem: Problem, num_kv_splits: int, config: dict | None = None) -> tuple:
    o, lse, logits = problem.run(num_kv_splits, config)
    ref_o, ref_lse = problem.golden()
    name = _dtype_name(problem)
    assert_close(o, ref_o, ("mla_verify", "o", name))
    assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))
    if num_kv_splits > 1:
        rows, heads = problem.q.shape[:2]
        cfg = config or select_verify_config(rows // problem.qlen, problem.qlen, heads)
        ref = problem.golden_partials(num_kv_splits, cfg)
        assert_close(split_outputs(logits, o.dtype), ref[..., :-1], ("mla_verify", "split_o", name))
        assert_close(logits[..., -1], ref[..., -1], ("mla_verify", "lse", "float32"))
    return o, lse, logits


# -- Triton == golden ------------------------------------------------------------------------------


# Lengths around the awkward values: empty, 1, below qlen, one past a key tile (16/32/64/128), up to 300.
SEQ_LENS = st.lists(
    st.one_of(st.sampled_from([0, 1, 2, 3, 7, 16, 17, 33, 65, 129]), st.integers(0, 300)), min_size=1, max_size=3
)


@given(
    seq_lens=SEQ_LENS,
    qlen=st.integers(1, 8),
    heads=st.integers(1, 4),
    widths=st.sampled_from(WIDTHS),
    page_size=st.one_of(st.sampled_from([1, 16, 128]), st.integers(1, 40)),
    num_kv_splits=st.one_of(st.just(1), st.integers(2, 16)),
    dtype=st.sampled_from(list(DTYPES)),
    fp8=st.booleans(),
    layout=st.sampled_from(["4d", "3d", "cross_layer"]),
    real_mode=st.sampled_from(["none", "equal", "below", "zero"]),
    size=st.sampled_from(["small", "large"]),
    arch=st.sampled_from([None, *sorted(VERIFY_CONFIGS)]),
    short_splits=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(seq_lens=[1, 3, 0, 17], qlen=4, heads=2, widths=(16, 16), page_size=1, num_kv_splits=1, dtype="bfloat16",
         fp8=False, layout="4d", real_mode="none", size="small", arch=None, short_splits=False, seed=0)  # fmt: skip
@example(seq_lens=[33, 2], qlen=3, heads=3, widths=(16, 8), page_size=5, num_kv_splits=5, dtype="float16",
         fp8=True, layout="3d", real_mode="below", size="large", arch=None, short_splits=True, seed=1)  # fmt: skip
# Hopper's large config: 64-row head tiles split in two, a 129-key request crossing two 64-key tiles in
# one split (MIN_SPLIT_LEN 256), pages of 64.
@example(seq_lens=[129, 65, 0], qlen=4, heads=4, widths=(32, 16), page_size=64, num_kv_splits=3, dtype="bfloat16",
         fp8=True, layout="4d", real_mode="none", size="large", arch="sm90", short_splits=False, seed=2)  # fmt: skip
# Failed compiled on the H200 (Triton 3.6) with a multiply-add fallback for rope widths below 16 (LSE off 6.5%);
# the kernel now pads such a tile to 16 masked columns and always uses tl.dot.
@example(seq_lens=[1], qlen=1, heads=1, widths=(16, 8), page_size=1, num_kv_splits=1, dtype="bfloat16",
         fp8=True, layout="4d", real_mode="none", size="small", arch=None, short_splits=False, seed=0)  # fmt: skip
def test_verify_matches_golden(
    device, seq_lens, qlen, heads, widths, page_size, num_kv_splits, dtype, fp8, layout, real_mode, size, arch,
    short_splits, seed,
) -> None:  # fmt: skip
    """Output, LSE and stage-1 partials against the float64 golden model, under the small or large
    config of this device (``arch=None``) or of any architecture (Hopper's 64-key tiles and 64-row
    head tiles run on the interpreter too)."""
    gen = generator(seed + 1)
    real = {
        "none": None,
        "equal": list(seq_lens),
        "below": [int(torch.randint(0, n + 1, (), generator=gen)) for n in seq_lens],
        "zero": [0] * len(seq_lens),
    }[real_mode]
    problem = make_problem(
        seq_lens, qlen, heads, *widths, page_size, device, seed, dtype=DTYPES[dtype],
        cache_dtype=torch.float8_e4m3fn if fp8 else None, real_seq_lens=real, layout=layout,
    )  # fmt: skip
    check_against_golden(problem, num_kv_splits, _config(size, short_splits, arch))


@pytest.mark.parametrize(
    ("qlen", "num_kv_splits", "size", "fp8"), [(1, 1, "small", False), (2, 3, "large", False), (4, 2, "small", True)]
)
def test_verify_deepseek_widths(device, qlen, num_kv_splits, size, fp8) -> None:
    """The real latent widths (Lv 512, P 64, 16 heads) at short lengths, both configs, an FP8 cache."""
    cache_dtype = torch.float8_e4m3fn if fp8 else None
    problem = make_problem([qlen + 1, 0, 21], qlen, 16, 512, 64, 16, device, seed=qlen, cache_dtype=cache_dtype)
    check_against_golden(problem, num_kv_splits, _config(size))


@pytest.mark.parametrize(
    ("page_size", "layout", "fp8"), [(64, "4d", False), (128, "3d", True), (64, "cross_layer", False)]
)
def test_verify_tma_tiles_and_the_cut_last_tile(device, page_size, layout, fp8) -> None:
    """Hopper's large config loads whole tiles by tensor descriptors and gathers the tile cut at the
    split's end, with the NaN moat around every request: both paths match golden (a descriptor row
    off by one key fails the descriptor cases: tried by hand). Pages not back to back (a cross-layer
    view) fall back to the gathers."""
    cache_dtype = torch.float8_e4m3fn if fp8 else None
    problem = make_problem([300, 129, 64, 1, 0], 4, 16, 512, 64, page_size, device, seed=7, cache_dtype=cache_dtype,
                           layout=layout)  # fmt: skip
    config = _config("large", arch="sm90")
    assert config["TMA"]
    cache = problem.cache
    pages = cache.numel() // (page_size * 576)
    layout_ok = tma_layout(cache, page_size, _page_stride(cache, page_size), cache.stride(-3), pages, 64, 512, 64)
    assert (layout_ok is not None) == (layout != "cross_layer")
    for tma in (True, False):  # the portable kernel's two paths (on an H100/H200 the Gluon kernel takes 16-bit caches)
        check_against_golden(problem, 2, {**config, "TMA": tma, "GLUON": False})


@sm90_only("the Gluon stage 1")
@pytest.mark.parametrize(
    ("qlen", "heads", "num_kv_splits", "real", "page_size", "layout", "fp8", "lean"),
    [(4, 16, 2, False, 64, "4d", False, False), (4, 128, 1, False, 64, "4d", False, False),
     (3, 32, 3, True, 128, "3d", False, False), (1, 64, 4, True, 64, "4d", False, False),
     (2, 16, 3, True, 64, "4d", False, False), (3, 16, 2, False, 128, "3d", False, False),
     (2, 128, 2, False, 64, "4d", True, False), (4, 16, 1, True, 64, "4d", True, False),
     (3, 32, 3, True, 128, "3d", True, False),
     (4, 16, 2, False, 64, "4d", False, True), (4, 128, 1, False, 64, "4d", False, True),
     (3, 32, 3, True, 128, "3d", False, True), (2, 128, 2, False, 64, "4d", True, True)],
)  # fmt: skip
def test_sm90_verify_fast_path_matches_golden(device, qlen, heads, num_kv_splits, real, page_size, layout,
                                              fp8, lean) -> None:  # fmt: skip
    """The Gluon stage 1 (DeepSeek's widths, 32 rows or more per request, pages of 64k keys) against golden,
    partials included: one row block of 4 tokens x 16 heads (per-row causal limits in one tile), 8 blocks of one
    token each, 96 rows (a token cut across two blocks, the second half empty), 32 and 48 rows (one block, partly
    empty), real lengths below the kernel's, the NaN moat around every request, the cut last tile of each split;
    a 16-bit and an FP8 cache (its codes widened in shared memory, the moat's NaN codes zeroed there). ``lean``:
    ``LEAN_SOFTMAX`` (masks on a split's edge tiles only, the scale in the exponents' fma; an FP8 cache only the
    former), over causal limits that differ by row, splits that start inside a tile, and blocks with empty rows."""
    lens = [300, 129, 64, 1, 0, 700]
    problem = make_problem(lens, qlen, heads, 512, 64, page_size, device, seed=11, layout=layout,
                           cache_dtype=torch.float8_e4m3fn if fp8 else None,
                           real_seq_lens=[250, 129, 10, 1, 0, 700] if real else None)  # fmt: skip
    config = {**_config("large", arch="sm90"), "LEAN_SOFTMAX": lean}
    rows = len(lens) * qlen
    o, lse = torch.empty(rows, heads, 512, device=device), torch.empty(rows, heads, device=device)
    plan = tv._plan_verify(problem.q, problem.cache, problem.cache[..., :512], o, lse, problem.block_table,
                           problem.seq_lens, problem.real_seq_lens, qlen,
                           torch.empty(rows, heads, num_kv_splits, 513, device=device), num_kv_splits,
                           problem.sm_scale, page_size, problem.k_scale, config)  # fmt: skip
    assert plan.stage1._kernel is decode_attention_sm90.mla_verify_stage1_kernel
    assert plan.stage1._constexprs["LEAN_SOFTMAX"] == lean
    check_against_golden(problem, num_kv_splits, config)


@sm90_only("the Gluon stage 1")
@pytest.mark.parametrize(("qlen", "heads", "num_kv_splits", "fp8"), [(4, 128, 1, False), (3, 32, 3, False),
                                                                     (2, 128, 2, True)])  # fmt: skip
def test_sm90_verify_rescale_if_grew_changes_no_bit(device, qlen, heads, num_kv_splits, fp8) -> None:
    """``RESCALE_IF_GREW`` in the verify kernel: outputs, LSE and partials bit for bit those of the rescale on every
    tile, over causal limits that differ by row, requests of 1-63 tiles, blocks with empty rows (96 rows) and an
    FP8 cache."""
    problem = make_problem([4000, 1500, 129, 1, 0], qlen, heads, 512, 64, 64, device, seed=13,
                           cache_dtype=torch.float8_e4m3fn if fp8 else None)  # fmt: skip
    rescaling, skipping = ({**_config("large", arch="sm90"), "RESCALE_IF_GREW": grew} for grew in (False, True))
    runs = [problem.run(num_kv_splits, config) for config in (rescaling, skipping)]
    rows = 5 * qlen
    plan = tv._plan_verify(problem.q, problem.cache, problem.cache[..., :512], *runs[1][:2], problem.block_table,
                           problem.seq_lens, None, qlen, torch.empty(rows, heads, num_kv_splits, 513, device=device),
                           num_kv_splits, problem.sm_scale, 64, problem.k_scale, skipping)  # fmt: skip
    assert plan.stage1._kernel is decode_attention_sm90.mla_verify_stage1_kernel
    assert plan.stage1._constexprs["RESCALE_IF_GREW"]
    for rescaled, skipped in zip(*runs):  # one split writes no partials: both stay NaN
        torch.testing.assert_close(skipped, rescaled, rtol=0, atol=0, equal_nan=True)


@sm90_only("the Gluon few-rows kernel")
@pytest.mark.parametrize(("heads", "num_kv_splits", "page_size"), [(16, 3, 64), (8, 1, 128), (1, 5, 64)])
def test_sm90_one_draft_token_at_few_heads_matches_golden_as_a_decode(device, heads, num_kv_splits, page_size) -> None:
    """qlen 1 at 16 heads or fewer runs decode's few-rows Gluon kernel (decode's split rule, so only the merged
    outputs are compared): empty and one-key requests, a request shorter than a tile, one split and several."""
    lens = [300, 129, 64, 1, 0, 700]
    problem = make_problem(lens, 1, heads, 512, 64, page_size, device, seed=12)
    config = _config("large", arch="sm90")
    rows = len(lens)
    plan = tv._plan_verify(problem.q, problem.cache, problem.cache[..., :512], torch.empty(rows, heads, 512,
                           device=device), torch.empty(rows, heads, device=device), problem.block_table,
                           problem.seq_lens, None, 1, torch.empty(rows, heads, num_kv_splits, 513, device=device),
                           num_kv_splits, problem.sm_scale, page_size, None, config)  # fmt: skip
    assert plan.descriptors.make is decode_attention_sm90.descriptors and not hasattr(plan.stage1, "kernel")
    o, lse, _ = problem.run(num_kv_splits, config)
    ref_o, ref_lse = problem.golden()
    assert_close(o, ref_o, ("mla_verify", "o", _dtype_name(problem)))
    assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))


@pytest.mark.parametrize(
    ("qlen", "heads", "cache_dtype", "real", "page_size", "served"),
    [(4, 16, None, False, 64, "gluon"), (1, 64, None, False, 64, "gluon"), (2, 16, None, False, 64, "gluon"),
     (1, 16, None, False, 64, "few rows"), (1, 8, None, False, 64, "few rows"), (1, 16, None, True, 64, "verify"),
     (4, 128, torch.float8_e4m3fn, False, 64, "gluon"), (2, 64, torch.float8_e4m3fn, False, 64, "gluon"),
     (4, 16, torch.float8_e4m3fn, False, 64, "gluon"), (1, 16, torch.float8_e4m3fn, False, 64, "verify"),
     (4, 128, torch.float8_e4m3fn, False, 16, "decode"), (4, 16, torch.float8_e4m3fn, False, 16, "verify")],
)  # fmt: skip
def test_the_sm90_verify_path_takes_exactly_the_calls_it_serves(device, monkeypatch, qlen, heads, cache_dtype, real,
                                                                page_size, served) -> None:  # fmt: skip
    """With the device taken for an H100/H200, the plan launches the Gluon stage 1 for 32 or more (token, head)
    rows per request, a 16-bit or an FP8 cache in pages of 64k keys; decode's few-rows Gluon kernel for one draft
    token at 16 heads or fewer (a decode call, a 16-bit cache) unless real lengths cap it; where no Gluon kernel
    serves (pages of 16), decode's portable stage 1 for an FP8 cache whose verify tiles hold one draft token each
    (64 heads or a multiple); the portable verify kernel otherwise (16 rows with real lengths; one FP8 draft token
    at 16 heads; FP8 at 16 heads in pages of 16, where a tile holds 4 tokens that share each key fetch). Nothing is
    launched: only the plan is built (on the CPU in CI)."""
    monkeypatch.setattr(decode_attention_sm90, "device_arch", lambda device: "sm90")
    problem = make_problem([70, 0], qlen, heads, 512, 64, page_size, device, seed=5, cache_dtype=cache_dtype,
                           real_seq_lens=[60, 0] if real else None)  # fmt: skip
    rows = 2 * qlen
    plan = tv._plan_verify(problem.q, problem.cache, problem.cache[..., :512], torch.empty(rows, heads, 512,
                           device=device), torch.empty(rows, heads, device=device), problem.block_table,
                           problem.seq_lens, problem.real_seq_lens, qlen, torch.empty(rows, heads, 2, 513,
                           device=device), 2, problem.sm_scale, page_size, problem.k_scale,
                           _config("large", arch="sm90"))  # fmt: skip
    kernel = getattr(plan.stage1, "kernel", None)  # decode's stage 1 runs through an argument adapter (no kernel)
    gluon_descriptors = plan.descriptors.make is decode_attention_sm90.descriptors
    assert served == ("gluon" if kernel is decode_attention_sm90.mla_verify_stage1_kernel else
                      "verify" if kernel is tv._fwd_verify_kernel_stage1 else
                      "few rows" if gluon_descriptors else "decode")  # fmt: skip


@pytest.mark.parametrize(
    ("qlen", "heads", "splits", "real", "page_size", "layout"),
    [(2, 32, 1, False, 16, "4d"), (3, 64, 3, True, 8, "3d"), (1, 32, 2, False, 16, "4d"), (4, 32, 5, True, 16, "4d")],
)  # fmt: skip
def test_fp8_verify_through_decodes_stage_1_matches_golden(device, qlen, heads, splits, real, page_size,
                                                          layout) -> None:  # fmt: skip
    """FP8_VIA_DECODE: an FP8 verify call run by decode's stage 1, its ``B * qlen`` rows over the ``B`` table rows
    (row ``r`` is draft token ``r % qlen`` of request ``r // qlen`` and sees its causal prefix, capped by
    ``real_seq_lens``), against golden: one and several splits (decode's split rule), 3-d and 4-d caches, an empty
    request, rows with no visible key."""
    lens = [40, 3, 0, 71]
    problem = make_problem(lens, qlen, heads, 32, 16, page_size, device, seed=21, layout=layout,
                           cache_dtype=torch.float8_e4m3fn, real_seq_lens=[35, 3, 0, 20] if real else None)  # fmt: skip
    config = {**_config("large"), "FP8_VIA_DECODE": True, "BLOCK_H": 32}
    rows = len(lens) * qlen
    plan = tv._plan_verify(problem.q, problem.cache, problem.cache[..., :32], torch.empty(rows, heads, 32,
                           device=device), torch.empty(rows, heads, device=device), problem.block_table,
                           problem.seq_lens, problem.real_seq_lens, qlen,
                           torch.empty(rows, heads, splits, 33, device=device), splits, problem.sm_scale, page_size,
                           problem.k_scale, config)  # fmt: skip
    assert getattr(plan.stage1, "_kernel", None) is None  # the adapter around decode's launch
    o, lse, _ = problem.run(splits, config)
    ref_o, ref_lse = problem.golden()
    assert_close(o, ref_o, ("mla_verify", "o", _dtype_name(problem)))
    assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))


def test_verify_writes_fp32_output(device) -> None:
    """``o`` may be fp32 (a caller merging further): the same golden result, the fp32 LSE tolerance."""
    problem = make_problem([20, 3], 3, 2, 32, 16, 8, device, seed=3)
    o, _, _ = problem.run(2, _config("small"), o_dtype=torch.float32)
    assert_close(o, problem.golden()[0], ("mla_verify", "split_o", "bfloat16"))


# -- Invariances -----------------------------------------------------------------------------------


def _repaged(problem: Problem, page_size: int, seed: int) -> Problem:
    """The same keys of every request in a cache of another page size, pages in another order."""
    gen = generator(seed)
    lens = problem.seq_lens.tolist()
    keys = [_request_keys(problem, b, n) for b, n in enumerate(lens)]
    pages_per = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(pages_per) + 1, generator=gen)
    width = problem.cache.shape[-1]
    cache = torch.full((sum(pages_per) + 1, page_size, 1, width), float("nan"), dtype=torch.float64)
    table = torch.full((len(lens), max([*pages_per, 1])), 2**30, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(lens):
        table[b, : pages_per[b]] = order[nxt : nxt + pages_per[b]].to(torch.int32)
        nxt += pages_per[b]
        j = torch.arange(n)
        cache[table[b, j // page_size].long(), j % page_size, 0] = keys[b].double()
    device = problem.q.device
    return Problem(problem.q, cache.to(problem.cache.dtype).to(device), table.to(device), problem.seq_lens,
                   problem.real_seq_lens, problem.qlen, problem.value_width, page_size, problem.sm_scale,
                   problem.k_scale)  # fmt: skip


def _request_keys(problem: Problem, b: int, n: int) -> torch.Tensor:
    """Request ``b``'s first ``n`` keys as stored (no dequant), ``[n, Lk]`` on the CPU."""
    return gather_tokens(problem.cache, problem.block_table[b], n, problem.page_size)[:, 0].cpu()


@given(
    split_pairs=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    page_pairs=st.tuples(st.integers(1, 33), st.integers(1, 33)),
    seed=st.integers(0, 2**31 - 1),
)
def test_result_independent_of_splits_and_page_size(device, split_pairs, page_pairs, seed) -> None:
    problem = make_problem([40, 5, 17], 3, 2, 16, 16, page_pairs[0], device, seed, dtype=torch.float16)
    other = _repaged(problem, page_pairs[1], seed + 1)
    cfg = _config("small", short_splits=True)
    o_a, lse_a, _ = problem.run(split_pairs[0], cfg)
    o_b, lse_b, _ = other.run(split_pairs[1], cfg)
    assert_close(o_b, o_a.double(), ("mla_verify", "o", "float16"))
    assert_close(lse_b, lse_a.double(), ("mla_verify", "lse", "float32"))


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_page_order_and_layout_are_bit_exact(device, num_kv_splits) -> None:
    """Page order, 3-D vs 4-D and a cross-layer view change only addresses: identical bits."""
    cfg = _config("small", short_splits=True)
    problem = make_problem([45, 17, 2], 4, 3, 32, 16, 8, device, seed=5)
    o, lse, _ = problem.run(num_kv_splits, cfg)
    for variant in (
        _repaged(problem, problem.page_size, seed=11),
        _with_cache(problem, problem.cache.flatten(0, 1)),
        _with_cache(problem, _cross_layer_view(problem.cache)),
    ):
        o_v, lse_v, _ = variant.run(num_kv_splits, cfg)
        assert_bits_equal(o_v, o)
        assert_bits_equal(lse_v, lse)


def _with_cache(problem: Problem, cache: torch.Tensor) -> Problem:
    return Problem(problem.q, cache, problem.block_table, problem.seq_lens, problem.real_seq_lens, problem.qlen,
                   problem.value_width, problem.page_size, problem.sm_scale, problem.k_scale)  # fmt: skip


def _cross_layer_view(cache: torch.Tensor, num_layers: int = 3, layer: int = 1) -> torch.Tensor:
    """``cache`` as layer ``layer`` of a ``[pages, layers, page_size, 1, Lk]`` cache (neighbours NaN)."""
    full = torch.full((cache.shape[0], num_layers, *cache.shape[1:]), float("nan"), dtype=torch.float32)
    full = full.to(cache.dtype).to(cache.device)
    full[:, layer] = cache
    view = full[:, layer]
    assert view.stride(0) == num_layers * cache[0].numel()
    return view


def test_block_table_with_spare_rows_or_a_unit_dimension(device) -> None:
    """A block table sized for a larger batch (``[B + 2, pages]``, the extra rows garbage) or with a
    trailing unit dimension (``[B, pages, 1]``) gives the bits of the plain table, in the kernel and
    in the golden model."""
    problem = make_problem([21, 6], 3, 2, 16, 16, 4, device, seed=18)
    cfg = _config("small", short_splits=True)
    o, lse, _ = problem.run(2, cfg)
    ref_o, ref_lse = problem.golden()
    table = problem.block_table
    for variant in (torch.cat([table, torch.full_like(table, 2**30 + 7)]), table[:, :, None]):
        o_t, lse_t, _ = problem.run(2, cfg, req_to_token=variant)
        assert_bits_equal(o_t, o)
        assert_bits_equal(lse_t, lse)
        ref_o_t, ref_lse_t = replace(problem, block_table=variant).golden()
        assert torch.equal(ref_o_t, ref_o) and torch.equal(ref_lse_t, ref_lse)


def _every_other(t: torch.Tensor) -> torch.Tensor:
    """``t``'s entries as a view with stride 2, the gaps between them holding 7 (a read past a gap shows)."""
    buffer = torch.full((2 * t.shape[0],), 7, dtype=t.dtype, device=t.device)
    buffer[::2] = t
    return buffer[::2]


@pytest.mark.parametrize("lengths", ["strided", "int64"])
@pytest.mark.parametrize("path", ["small", "large", pytest.param("sm90", marks=sm90_only("the Gluon stage 1"))])
def test_strided_or_int64_lengths_give_the_bits_of_contiguous_int32_ones(device, path, lengths) -> None:
    """``seq_lens`` and ``real_seq_lens`` as views with stride 2, or in int64, give the bits of contiguous int32 ones:
    the portable kernel's configs and (on sm_90) the Gluon stage 1 read each length through its stride and take it as
    an int32. Before they did, the second request read the gap after the first as its length, and the Gluon stage 1
    did not compile for int64 lengths (its stage indices came out int64)."""
    if path == "sm90":
        problem = make_problem([300, 129, 64], 2, 16, 512, 64, 64, device, seed=20, real_seq_lens=[250, 129, 10])
        cfg = _config("large", arch="sm90")
    else:
        problem = make_problem([21, 6, 40], 3, 2, 16, 16, 4, device, seed=19, real_seq_lens=[20, 6, 33])
        cfg = _config(path, short_splits=True)
    assert problem.seq_lens.dtype == problem.real_seq_lens.dtype == torch.int32
    o, lse, logits = problem.run(2, cfg)
    if lengths == "strided":
        seq_lens, real_seq_lens = _every_other(problem.seq_lens), _every_other(problem.real_seq_lens)
    else:
        seq_lens, real_seq_lens = problem.seq_lens.long(), problem.real_seq_lens.long()
    for contiguous, view in zip((o, lse, logits), problem.run(2, cfg, seq_lens=seq_lens, real_seq_lens=real_seq_lens)):
        assert_bits_equal(view, contiguous)


def test_one_split_result_independent_of_batch(device) -> None:
    """With one split and a fixed config, a request's rows do not depend on the rest of the batch."""
    cfg = _config("large")
    problem = make_problem([40, 9, 66], 2, 4, 64, 16, 16, device, seed=2)
    o, lse, _ = problem.run(1, cfg)
    rows = slice(2 * problem.qlen, 3 * problem.qlen)
    alone = Problem(problem.q[rows].contiguous(), problem.cache, problem.block_table[2:], problem.seq_lens[2:], None,
                    problem.qlen, problem.value_width, problem.page_size, problem.sm_scale, None)  # fmt: skip
    o_alone, lse_alone, _ = alone.run(1, cfg)
    assert_bits_equal(o_alone, o[rows])
    assert_bits_equal(lse_alone, lse[rows])


def test_k_scale_is_ignored_for_a_16bit_cache(device) -> None:
    problem = make_problem([30, 4], 2, 2, 16, 16, 4, device, seed=4)
    o, lse, _ = problem.run(2)
    problem.k_scale = torch.tensor(3.0, device=device)
    o_scaled, lse_scaled, _ = problem.run(2)
    assert_bits_equal(o_scaled, o)
    assert_bits_equal(lse_scaled, lse)


# -- Edge cases and golden-only properties ---------------------------------------------------------


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_empty_rows_are_exactly_neutral(device, num_kv_splits) -> None:
    """L == 0, L < qlen (first rows empty), R = 0 (padding): o == 0 and lse == -inf exactly; and
    every split slot that is empty for its row holds exactly (0, -inf) in the scratch."""
    qlen = 4
    problem = make_problem([0, 2, 30, 40], qlen, 3, 16, 16, 8, device, seed=6, real_seq_lens=[5, 2, 0, 40])
    cfg = _config("small", short_splits=True)
    o, lse, logits = problem.run(num_kv_splits, cfg)
    empty = (row_limits(problem.seq_lens, problem.real_seq_lens, qlen) == 0).flatten().to(device)
    assert 0 < int(empty.sum()) < empty.numel()
    assert bool((o[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    assert bool(torch.isfinite(o).all()) and not bool(torch.isnan(lse).any())
    if num_kv_splits > 1:
        empty_slot = torch.isneginf(problem.golden_partials(num_kv_splits, cfg)[..., -1]).to(device)
        assert bool(empty_slot.any()) and bool((~empty_slot).any())
        assert bool((split_outputs(logits, o.dtype)[empty_slot] == 0).all()) and bool(
            torch.isneginf(logits[..., -1][empty_slot]).all()
        )


def test_row_limits_by_hand() -> None:
    lens = torch.tensor([10, 2, 0, 7])
    assert row_limits(lens, None, 3).tolist() == [[8, 9, 10], [0, 1, 2], [0, 0, 0], [5, 6, 7]]
    real = torch.tensor([9, 1, 0, 0])
    assert row_limits(lens, real, 3).tolist() == [[8, 9, 9], [0, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_last_row_sees_every_key(device) -> None:
    """Row ``t = qlen - 1`` is plain attention over all ``L`` keys, computed densely in float64."""
    qlen, lv = 3, 32
    problem = make_problem([50, 3], qlen, 2, lv, 16, 8, device, seed=8)
    o, lse, _ = problem.run(3, _config("small", short_splits=True))
    for b, n in enumerate(problem.seq_lens.tolist()):
        keys = _request_keys(problem, b, n).double()
        q_last = problem.q[b * qlen + qlen - 1].cpu().double()
        scores = problem.sm_scale * q_last @ keys.T
        expected_o = torch.softmax(scores, -1) @ keys[:, :lv]
        assert_close(o[b * qlen + qlen - 1], expected_o, ("mla_verify", "o", "bfloat16"))
        assert_close(lse[b * qlen + qlen - 1], torch.logsumexp(scores, -1), ("mla_verify", "lse", "float32"))


# (SPLIT_ALIGN, MIN_SPLIT_LEN) of every config, plus single-key and odd alignments.
SPLIT_RULES = sorted(
    {(1, 1), (5, 10), (8, 8)}
    | {
        (cfg["SPLIT_ALIGN"], cfg["MIN_SPLIT_LEN"])
        for arch in VERIFY_CONFIGS.values()
        for cfg in ({**VERIFY_DEFAULT_CONFIG, **entry} for entry in arch.values())
    }
)


@given(
    seq_lens=st.lists(st.integers(0, 80), min_size=1, max_size=3),
    qlen=st.integers(1, 5),
    real_mode=st.sampled_from(["none", "below", "zero"]),
    splits=st.sampled_from([1, 3, 16]),
    split_rule=st.sampled_from(SPLIT_RULES),
    fp8=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(seq_lens=[77, 0, 13, 2], qlen=3, real_mode="below", splits=16, split_rule=(1, 1), fp8=False, seed=9)
def test_golden_split_states_merge_to_golden(seq_lens, qlen, real_mode, splits, split_rule, fp8, seed) -> None:
    """Golden only, float64: each request's split ranges partition ``[0, L)``, and merging a row's
    split states (``merge_states``) gives the direct definition to rounding, for empty rows
    (``L < qlen``, ``R = 0``), more splits than keys, and every config's split rule."""
    gen = generator(seed + 1)
    real = {
        "none": None,
        "below": [int(torch.randint(0, n + 1, (), generator=gen)) for n in seq_lens],
        "zero": [0] * len(seq_lens),
    }[real_mode]
    problem = make_problem(seq_lens, qlen, 2, 16, 8, 5, torch.device("cpu"), seed, real_seq_lens=real,
                           cache_dtype=torch.float8_e4m3fn if fp8 else None)  # fmt: skip
    align, min_len = split_rule
    starts, ends = split_bounds(problem.seq_lens, splits, align, min_len)
    assert bool((starts[:, 0] == 0).all()) and torch.equal(ends[:, -1], problem.seq_lens.long())
    assert torch.equal(starts[:, 1:], ends[:, :-1]) and bool((ends >= starts).all())
    ref_o, ref_lse = problem.golden()
    part = problem.golden_partials(splits, {"SPLIT_ALIGN": align, "MIN_SPLIT_LEN": min_len})
    o, lse = merge_states(part[..., :-1], part[..., -1])
    assert torch.allclose(o, ref_o, rtol=0, atol=1e-12)
    empty = (row_limits(problem.seq_lens, problem.real_seq_lens, qlen) == 0).flatten()
    assert bool((ref_o[empty] == 0).all()) and bool(torch.isneginf(ref_lse[empty]).all())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and not bool(torch.isnan(lse).any())
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-12)


def test_verify_equals_flattened_causal_decode(device) -> None:
    """With ``real_seq_lens=None`` verify is multi-token decode: the block table repeated per row
    and per-row extents ``L - (qlen-1) + t`` (golden decode, float64)."""
    for qlen in (1, 3, 5):
        problem = make_problem([40, 2, 0, 17], qlen, 3, 32, 16, 8, device, seed=qlen)
        table_rows, lens_rows = expand_decode_rows(problem.block_table, problem.seq_lens, qlen, causal=True)
        ref_o, ref_lse = decode_attention(
            problem.q, problem.cache, problem.cache[..., : problem.value_width], table_rows, lens_rows,
            problem.sm_scale, problem.page_size, is_mla=True, dtype=torch.float64,
        )  # fmt: skip
        gold_o, gold_lse = problem.golden()
        assert torch.allclose(gold_o, ref_o, rtol=0, atol=1e-12)
        assert torch.equal(torch.isinf(gold_lse), torch.isinf(ref_lse))
        o, lse, _ = problem.run(2, _config("small", short_splits=True))
        assert_close(o, ref_o, ("mla_verify", "o", "bfloat16"))
        assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))


# -- Split heuristics and configs ------------------------------------------------------------------


def test_split_bounds_by_hand() -> None:
    start, end = split_bounds(torch.tensor([100, 10, 0, 64]), 4, 16, 32)
    # L=100: cdiv(100, 4) = 25 -> 32: [0,32) [32,64) [64,96) [96,100).
    assert start[0].tolist() == [0, 32, 64, 96] and end[0].tolist() == [32, 64, 96, 100]
    # L=10: one chunk of MIN_SPLIT_LEN covers it; the other three splits are empty.
    assert start[1].tolist() == [0, 10, 10, 10] and end[1].tolist() == [10, 10, 10, 10]
    assert start[2].tolist() == [0, 0, 0, 0] and end[2].tolist() == [0, 0, 0, 0]
    # L=64: cdiv(64, 4) = 16 -> 16, raised to MIN_SPLIT_LEN 32: two splits used.
    assert end[3].tolist() == [32, 64, 64, 64]
    with pytest.raises(ValueError, match="min_split_len"):
        split_bounds(torch.tensor([5]), 2, 16, 24)


def test_verify_num_kv_splits_by_hand() -> None:
    # One request of 16 heads: 1 program per split fits 132 SMs; ideal = cdiv(4096, 64) = 64 caps it.
    assert verify_num_kv_splits(4096, 1, 1, 16, 132, block_h=32) == 64
    # 64 requests x cdiv(4*16, 32) = 128 programs <= 132 slots: 132 // 128 = 1 split.
    assert verify_num_kv_splits(4096, 64, 4, 16, 132, block_h=32) == 1
    # 100 x 2 = 200 programs > 132: rounds(n)/n = 2, 2, 1.67, 1.75, 1.6, 1.67, 1.57, 1.63 for n = 1..8;
    # best 1.57 (n = 7); the fewest within 5% (<= 1.65) is n = 5.
    assert verify_num_kv_splits(4096, 100, 4, 16, 132, block_h=32) == 5
    # Short sequences: ideal = cdiv(100, 64) = 2; empty batch counts as one request.
    assert verify_num_kv_splits(100, 1, 1, 16, 132, block_h=32) == 2
    assert verify_num_kv_splits(0, 0, 1, 16, 132, block_h=32) == 1
    # Twice the occupancy: 264 slots // 128 programs = 2.
    assert verify_num_kv_splits(4096, 64, 4, 16, 132, block_h=32, occupancy=2.0) == 2
    # The max_splits cap applies only when one round does not fit: 64 // 1 = 64 > 8 here.
    assert verify_num_kv_splits(8192, 1, 1, 16, 32, block_h=32, max_splits=8) == 32


def test_row_blocks_and_config_rule() -> None:
    assert verify_row_blocks(4, 16, 32) == 2
    assert verify_row_blocks(3, 5, 16) == 1
    assert verify_row_blocks(8, 128, 64) == 16
    for arch, small_max_rows in _VERIFY_SMALL_MAX_ROWS.items():
        small = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS[arch]["small"]}
        large = {**VERIFY_DEFAULT_CONFIG, **VERIFY_CONFIGS[arch]["large"]}
        assert select_verify_config(small_max_rows + 1, 1, 1, arch=arch) == large
        if small_max_rows:
            assert select_verify_config(1, 1, small_max_rows, arch=arch) == small
        assert select_verify_config(1, 1, 1, arch=arch) == (small if small_max_rows else large)
    assert _VERIFY_SMALL_MAX_ROWS["default"] == 640  # the seed's rule: 640 rows (B=10 qlen=4 H=16) still small
    assert _VERIFY_SMALL_MAX_ROWS["sm90"] == 0  # the 64-row tile at every batch (see mla_verify.py)
    assert set(_VERIFY_SMALL_MAX_ROWS) == set(VERIFY_CONFIGS)
    for arch in VERIFY_CONFIGS.values():
        for cfg in arch.values():
            full = {**VERIFY_DEFAULT_CONFIG, **cfg}
            assert full["MIN_SPLIT_LEN"] % full["SPLIT_ALIGN"] == 0
            assert full["BLOCK_H"] >= 16 and full["BLOCK_N"] >= 16  # tl.dot's minimum


# -- Negative controls: bugs planted on the kernel's path fail the tolerances -----------------------


def test_negative_control_row_limits_off_by_one(device) -> None:
    """Launched with every row's limit one short (``seq_lens - 1``: the row's own token excluded), or
    with ``real_seq_lens`` one short (the last row loses its last key), the kernel fails the o and
    lse tolerances; launched right it passes."""
    problem = make_problem([6, 40], 4, 2, 32, 16, 8, device, seed=12)
    cfg = _config("small")
    ref_o, ref_lse = problem.golden()
    o, lse, _ = problem.run(1, cfg)
    assert_close(o, ref_o, ("mla_verify", "o", "bfloat16"))
    assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))
    for changes in ({"seq_lens": problem.seq_lens - 1}, {"real_seq_lens": problem.seq_lens - 1}):
        bad_o, bad_lse, _ = problem.run(1, cfg, **changes)
        assert fails_tolerance(bad_o, ref_o, ("mla_verify", "o", "bfloat16"))
        assert fails_tolerance(bad_lse, ref_lse, ("mla_verify", "lse", "float32"))


def test_negative_control_split_outputs(device) -> None:
    """Stage 1's split outputs (bf16, two a slot, for this bf16 output) pass the ``split_o`` tolerance against the
    golden stage 1; launched with every row's limit one short they fail it."""
    problem = make_problem([90, 50], 2, 2, 32, 16, 8, device, seed=14)
    assert problem.q.dtype == torch.bfloat16
    cfg = _config("small", short_splits=True)
    ref = problem.golden_partials(4, cfg)[..., :-1]
    _, _, logits = problem.run(4, cfg)
    assert_close(split_outputs(logits, problem.q.dtype), ref, ("mla_verify", "split_o", "bfloat16"))
    _, _, bad = problem.run(4, cfg, seq_lens=problem.seq_lens - 1)
    assert fails_tolerance(split_outputs(bad, problem.q.dtype), ref, ("mla_verify", "split_o", "bfloat16"))


def test_negative_control_dropped_split(device) -> None:
    """The kernel's stage-1 partials merged by the stage-2 merge kernel (``merge_splits``) give the
    golden result; with one live split's slot marked empty (a stage 1 that skipped it, or a stage 2
    that believed it empty) they fail."""
    problem = make_problem([90, 50], 2, 2, 32, 16, 8, device, seed=13)
    cfg = _config("small", short_splits=True)
    _, _, logits = problem.run(4, cfg)
    assert bool(torch.isfinite(logits[..., :2, -1]).all()), "splits 0 and 1 hold keys for every row"
    ref_o, ref_lse = problem.golden()

    def merged(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = nan_filled((*partials.shape[:2], problem.value_width), problem.q.dtype, device)
        lse = nan_filled(partials.shape[:2], torch.float32, device)
        merge_splits(partials, o, lse, bf16_values=bf16_partials(o.dtype))
        return o, lse

    o, lse = merged(logits)
    assert_close(o, ref_o, ("mla_verify", "o", "bfloat16"))  # the control itself passes
    assert_close(lse, ref_lse, ("mla_verify", "lse", "float32"))
    for dropped in range(2):
        partials = logits.clone()
        partials[..., dropped, -1] = float("-inf")
        bad_o, bad_lse = merged(partials)
        assert fails_tolerance(bad_o, ref_o, ("mla_verify", "o", "bfloat16"))
        assert fails_tolerance(bad_lse, ref_lse, ("mla_verify", "lse", "float32"))


# -- Bad input ---------------------------------------------------------------------------------------


def _args(problem: Problem, num_kv_splits: int = 1) -> dict:
    rows, heads = problem.q.shape[:2]
    device = problem.q.device
    return dict(
        q=problem.q, k_buffer=problem.cache, v_buffer=problem.cache[..., : problem.value_width],
        o=torch.empty(rows, heads, problem.value_width, dtype=problem.q.dtype, device=device),
        lse=torch.empty(rows, heads, device=device), req_to_token=problem.block_table, seq_lens=problem.seq_lens,
        real_seq_lens=None, qlen=problem.qlen,
        attn_logits=torch.empty(rows, heads, num_kv_splits, problem.value_width + 1, device=device),
        num_kv_splits=num_kv_splits, sm_scale=0.1, page_size=problem.page_size,
    )  # fmt: skip


def test_bad_input_raises_named_errors(device, monkeypatch) -> None:
    """Named errors, block-table contents included (their host check is on for this test; serving on
    CUDA leaves it off)."""
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    problem = make_problem([20, 7], 2, 2, 16, 16, 4, device, seed=14)
    rows = problem.q.shape[0]

    def raises(error, match, **changes):
        args = _args(problem, changes.pop("num_kv_splits", 1))
        args.update(changes)
        with pytest.raises(error, match=match):
            decode_attention_fwd_verify(**args)

    raises(ValueError, "qlen", qlen=3)  # 4 rows is not a multiple of 3
    raises(ValueError, "qlen", qlen=0)
    raises(ValueError, "qlen: expected a positive int, got True", qlen=True)
    raises(ValueError, "sm_scale: expected a finite float, got None", sm_scale=None)
    odd = torch.zeros(8, 4, 1, 24, dtype=torch.bfloat16, device=device)  # Lv = 12: not a power of two
    raises(ValueError, "Lv", q=torch.zeros(rows, 2, 24, dtype=torch.bfloat16, device=device), k_buffer=odd,
           v_buffer=odd[..., :12], o=torch.empty(rows, 2, 12, dtype=torch.bfloat16, device=device))  # fmt: skip
    narrow = torch.zeros(8, 4, 1, 24, dtype=torch.bfloat16, device=device)  # Lv = 8: below tl.dot's 16
    raises(ValueError, "Lv must be >= 16", q=torch.zeros(rows, 2, 24, dtype=torch.bfloat16, device=device),
           k_buffer=narrow, v_buffer=narrow[..., :8],
           o=torch.empty(rows, 2, 8, dtype=torch.bfloat16, device=device))  # fmt: skip
    rope12 = torch.zeros(8, 4, 1, 28, dtype=torch.bfloat16, device=device)  # P = 12
    raises(ValueError, "rope width", q=torch.zeros(rows, 2, 28, dtype=torch.bfloat16, device=device),
           k_buffer=rope12, v_buffer=rope12[..., :16])  # fmt: skip
    past = problem.block_table.clone()
    past[0, 0] = problem.cache.shape[0]  # one past the last page
    raises(ValueError, "req_to_token", req_to_token=past)
    raises(ValueError, "req_to_token", req_to_token=problem.block_table[:, :1])  # too few columns for L = 20
    raises(ValueError, "attn_logits", num_kv_splits=2,
           attn_logits=torch.empty(rows - 1, 2, 2, 17, device=device))  # fmt: skip
    raises(ValueError, "attn_logits", num_kv_splits=4, attn_logits=torch.empty(rows, 2, 2, 17, device=device))
    raises(TypeError, "attn_logits", num_kv_splits=2, attn_logits=None)
    raises(TypeError, "lse", lse=torch.empty(rows, 2, dtype=torch.bfloat16, device=device))
    raises(TypeError, "k_buffer", k_buffer=problem.cache.half(), v_buffer=problem.cache.half()[..., :16])
    raises(TypeError, "q", q=problem.q.float())
    raises(ValueError, "v_buffer", v_buffer=problem.cache[..., :16].clone())
    raises(ValueError, "k_buffer", page_size=8)  # a 4-D cache of 4-token pages
    two_heads = problem.cache.expand(-1, -1, 2, -1)
    raises(ValueError, "k_buffer", k_buffer=two_heads, v_buffer=two_heads[..., :16])
    raises(ValueError, "o", o=torch.empty(rows, 2, 32, dtype=torch.bfloat16, device=device))
    raises(ValueError, "seq_lens", seq_lens=problem.seq_lens[:1])
    raises(ValueError, "last dimension", q=torch.zeros(rows, 2, 64, dtype=torch.bfloat16, device=device)[..., ::2])


def test_content_checks_can_be_switched_off(device, monkeypatch) -> None:
    """Serving skips the device-to-host block-table check (ATTNREF_CHECK_CONTENTS=0); shapes are
    still checked. The kernel is not run: a table pointing past the cache would read out of bounds."""
    problem = make_problem([20], 1, 1, 16, 16, 4, device, seed=15)
    args = _args(problem)
    args["req_to_token"] = problem.block_table.clone().fill_(10**6)
    args.pop("sm_scale")
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "0")
    tv._check_verify_args(**args, k_scale=None)
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    with pytest.raises(ValueError, match="req_to_token"):
        tv._check_verify_args(**args, k_scale=None)


# -- Warmup and workspace views ----------------------------------------------------------------------


def test_storage_view_reuses_storage_or_allocates() -> None:
    buf = torch.zeros(100)
    view = _storage_view(buf, (3, 4, 5))
    assert view.data_ptr() == buf.data_ptr() and view.is_contiguous() and view.shape == (3, 4, 5)
    fresh = _storage_view(buf, (101,))
    assert fresh.data_ptr() != buf.data_ptr() and fresh.shape == (101,)


def test_warmup_runs_every_variant_and_leaves_outputs_alone(device, monkeypatch) -> None:
    """Each qlen, every config the device can take, one and two splits; the real outputs are untouched. On a CPU the
    small/large threshold is lowered so the large-config batch stays small for the interpreter."""
    if not torch.cuda.is_available():
        monkeypatch.setitem(tv._VERIFY_SMALL_MAX_ROWS, "interpreter", 8)
    problem = make_problem([9], 1, 4, 16, 16, 4, device, seed=16)
    args = _args(problem, 2)
    args["o"].fill_(7)
    args["lse"].fill_(7)
    warmup_decode_attention_fwd_verify(
        problem.q, problem.cache, args["o"], args["lse"], problem.block_table, True, [1, 2], args["attn_logits"],
        0.1, problem.page_size,
    )  # fmt: skip
    assert bool((args["o"] == 7).all()) and bool((args["lse"] == 7).all())


# -- GPU only ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_page_offsets_past_2_to_31_elements(device) -> None:
    """Page ids whose element offset exceeds 2^31 (a 4.3 GiB cache): widened to 64 bits."""
    lv, rope, page_size = 512, 64, 64
    page_elems = page_size * (lv + rope)
    far_page = 2**31 // page_elems + 10
    cache = torch.empty(far_page + 1, page_size, 1, lv + rope, dtype=torch.bfloat16, device=device)
    gen = generator(17)
    near = torch.randn(2, page_size, 1, lv + rope, generator=gen).to(torch.bfloat16)
    cache[0], cache[far_page] = near[0].to(device), near[1].to(device)
    table = torch.tensor([[0, far_page]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([2 * page_size], dtype=torch.int32, device=device)
    q = torch.randn(2, 16, lv + rope, generator=gen).to(torch.bfloat16).to(device)
    problem = Problem(q, cache, table, seq_lens, None, 2, lv, page_size, 0.06, None)
    check_against_golden(problem, 2)
