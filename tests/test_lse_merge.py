"""LSE merge: Triton == golden, the merge's algebra, and the split-KV identity (``golden/lse_merge.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from golden.lse_merge import attention_state, lse_base2_to_e, merge_states, merge_two, split_states
from tests.support import assert_close, fails_tolerance, generator, nan_filled
from triton_impl.lse_merge import merge_attn_states, merge_splits, split_outputs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NEG_INF, POS_INF = float("-inf"), float("inf")


def _lse_pattern(shape: tuple[int, ...], gen: torch.Generator, p_empty: float, p_posinf: float) -> torch.Tensor:
    """LSEs of magnitude ~ +-20 with a fraction of empty states (-inf) and of +inf-marked ones."""
    lse = torch.randn(shape, generator=gen) * 8
    u = torch.rand(shape, generator=gen)
    lse[u < p_empty] = NEG_INF
    lse[(u >= p_empty) & (u < p_empty + p_posinf)] = POS_INF
    return lse


def _poison_empty(o: torch.Tensor, lse: torch.Tensor) -> None:
    """An empty state's output is never read: make it NaN so a kernel that reads it fails."""
    o[~torch.isfinite(lse)] = float("nan")


# -- merge_attn_states (two states, head-major LSEs) ---------------------------------------------


@given(
    tokens=st.integers(1, 40),
    heads=st.integers(1, 9),
    head_dim=st.sampled_from([1, 8, 24, 64, 96, 128]),
    dtype=st.sampled_from(list(DTYPES)),
    p_empty=st.sampled_from([0.0, 0.3, 1.0]),
    with_out_lse=st.booleans(),
    strided_lse=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(tokens=3, heads=2, head_dim=8, dtype="bfloat16", p_empty=1.0, with_out_lse=True, strided_lse=False, seed=0)
def test_merge_attn_states_matches_golden(
    device, tokens, heads, head_dim, dtype, p_empty, with_out_lse, strided_lse, seed
) -> None:
    gen = generator(seed)
    dt = DTYPES[dtype]
    p_out = torch.randn(tokens, heads, head_dim, generator=gen).to(dt)
    s_out = torch.randn(tokens, heads, head_dim, generator=gen).to(dt)
    p_lse = _lse_pattern((heads, tokens), gen, p_empty, 0.1)
    s_lse = _lse_pattern((heads, tokens), gen, p_empty / 2, 0.1)
    _poison_empty(p_out.transpose(0, 1), p_lse)
    _poison_empty(s_out.transpose(0, 1), s_lse)
    if strided_lse:  # [H, T] views with a token stride of 2 (as sliced from a larger buffer)
        p_lse = torch.stack([p_lse, torch.full_like(p_lse, float("nan"))], -1)[..., 0]
        s_lse = torch.stack([s_lse, torch.full_like(s_lse, float("nan"))], -1)[..., 0]
    out = nan_filled((tokens, heads, head_dim), dt, device)
    out_lse = nan_filled((heads, tokens), torch.float32, device) if with_out_lse else None

    merge_attn_states(out, p_out.to(device), p_lse.to(device), s_out.to(device), s_lse.to(device), out_lse)

    ref_o, ref_lse = merge_two(
        p_out.double().transpose(0, 1), p_lse.double(), s_out.double().transpose(0, 1), s_lse.double()
    )
    assert_close(out.transpose(0, 1), ref_o, ("lse_merge", "o", dtype))
    if with_out_lse:
        assert_close(out_lse, ref_lse, ("lse_merge", "lse", "float32"))


def test_merge_attn_states_edge_cases_exact(device) -> None:
    """Token 0: suffix empty -> prefix exactly. Token 1: prefix empty (NaN output, never read) ->
    suffix exactly. Token 2: prefix +inf-marked, suffix -inf -> (0, -inf), where upstream gives NaN."""
    o_a = torch.tensor([[[1.0, -2.0]], [[float("nan"), float("nan")]], [[5.0, 6.0]]])
    o_b = torch.tensor([[[float("nan"), 7.0]], [[8.0, 9.0]], [[float("nan"), float("nan")]]])
    lse_a = torch.tensor([[0.5, NEG_INF, POS_INF]])
    lse_b = torch.tensor([[NEG_INF, 1.5, NEG_INF]])
    out, out_lse = nan_filled((3, 1, 2), torch.float32, device), nan_filled((1, 3), torch.float32, device)
    merge_attn_states(out, o_a.to(device), lse_a.to(device), o_b.to(device), lse_b.to(device), out_lse)
    assert out.cpu().tolist() == [[[1.0, -2.0]], [[8.0, 9.0]], [[0.0, 0.0]]]
    assert out_lse.cpu().tolist() == [[0.5, 1.5, NEG_INF]]


def test_merge_attn_states_nan_lse_poisons_its_token_as_golden_does(device) -> None:
    """A NaN LSE on either side (a poisoned state) gives that token ``(NaN, NaN)``, in the kernel and in the golden
    model (which gave ``o = 0`` for it until the weights' NaN was kept); the clean token merges as usual."""
    o_a = torch.tensor([[[1.0, -2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    o_b = torch.tensor([[[7.0, 8.0]], [[9.0, 1.0]], [[2.0, 3.0]]])
    lse_a = torch.tensor([[float("nan"), 0.5, 0.25]])
    lse_b = torch.tensor([[0.5, float("nan"), 1.0]])
    out, out_lse = nan_filled((3, 1, 2), torch.float32, device), torch.zeros(1, 3, device=device)
    merge_attn_states(out, o_a.to(device), lse_a.to(device), o_b.to(device), lse_b.to(device), out_lse)
    ref_o, ref_lse = merge_two(o_a.double(), lse_a.t().double(), o_b.double(), lse_b.t().double())
    for o, lse in ((out.cpu(), out_lse.cpu().t()), (ref_o, ref_lse)):
        assert o[:2].isnan().all() and lse[:2].isnan().all()
        assert not o[2].isnan().any() and not lse[2].isnan().any()
    assert_close(out.cpu()[2], ref_o[2], ("lse_merge", "o", "float32"))


# -- merge_splits (N states, stage-1 layout) -----------------------------------------------------


@given(
    rows=st.integers(1, 12),
    heads=st.integers(1, 5),
    splits=st.integers(1, 40),
    head_dim=st.sampled_from([1, 16, 40, 64, 128, 200, 512]),  # past 128: column blocks, the last partial at 200
    o_dtype=st.sampled_from(list(DTYPES)),
    lse_dtype=st.sampled_from(["float32", "bfloat16"]),
    p_empty=st.sampled_from([0.0, 0.5, 1.0]),
    bf16_values=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=2, heads=1, splits=1, head_dim=16, o_dtype="float32", lse_dtype="float32", p_empty=1.0,
         bf16_values=False, seed=1)  # fmt: skip
@example(rows=2, heads=2, splits=33, head_dim=64, o_dtype="bfloat16", lse_dtype="float32", p_empty=0.5,
         bf16_values=True, seed=2)  # fmt: skip
@example(rows=3, heads=2, splits=5, head_dim=1, o_dtype="bfloat16", lse_dtype="float32", p_empty=0.0,
         bf16_values=True, seed=3)  # fmt: skip
@example(rows=1, heads=3, splits=7, head_dim=200, o_dtype="float32", lse_dtype="bfloat16", p_empty=0.5,
         bf16_values=True, seed=4)  # fmt: skip
def test_merge_splits_matches_golden(device, rows, heads, splits, head_dim, o_dtype, lse_dtype, p_empty, bf16_values,
                                     seed) -> None:  # fmt: skip
    """fp32 partials, or (``bf16_values``) their outputs as bf16, two a slot, as stage 1 writes them for a bf16
    output (an odd width leaves half a slot); the golden model merges the values the kernel reads."""
    gen = generator(seed)
    partials = torch.randn(rows, heads, splits, head_dim + 1, generator=gen)
    partials[..., head_dim] = _lse_pattern((rows, heads, splits), gen, p_empty, 0.0)
    _poison_empty(partials[..., :head_dim], partials[..., head_dim])
    if bf16_values:  # the slots past the values stay as they were: the merge must not read them
        # As 2-D rows of bf16 pairs: with an even width the pad is the strided view itself, whose strides (kept
        # by .to and, for size-1 dims, by .contiguous) need not be even in bf16 elements
        packed = torch.nn.functional.pad(partials[..., :head_dim], (0, head_dim % 2)).to(torch.bfloat16)
        pairs = packed.reshape(-1, packed.shape[-1]).view(torch.float32)
        partials[..., : (head_dim + 1) // 2] = pairs.reshape(*packed.shape[:-1], -1)
    values = split_outputs(partials, torch.bfloat16 if bf16_values else torch.float32)
    o = nan_filled((rows, heads, head_dim), DTYPES[o_dtype], device)
    lse = nan_filled((rows, heads), DTYPES[lse_dtype], device)

    merge_splits(partials.to(device), o, lse, bf16_values=bf16_values)

    ref_o, ref_lse = merge_states(values.double(), partials[..., head_dim].double())
    assert_close(o, ref_o, ("lse_merge", "o", o_dtype))
    assert_close(lse, ref_lse, ("lse_merge", "lse", lse_dtype))


def test_merge_splits_all_empty_is_neutral(device) -> None:
    partials = torch.full((3, 2, 4, 9), float("nan"))
    partials[..., 8] = NEG_INF
    o, lse = nan_filled((3, 2, 8), torch.float32, device), nan_filled((3, 2), torch.float32, device)
    merge_splits(partials.to(device), o, lse)
    assert torch.equal(o.cpu(), torch.zeros(3, 2, 8))
    assert torch.isneginf(lse.cpu()).all()


# one tile; two tiles of 32 splits; the same in three column blocks (the last 64 wide)
@pytest.mark.parametrize(("splits", "head_dim"), [(5, 16), (40, 128), (40, 320)])
def test_merge_splits_poisoned_split(device, splits, head_dim) -> None:
    """A NaN LSE makes its whole (row, head) NaN, output and LSE, wherever the split lies (a second
    tile too); +inf LSEs are empty; every other (row, head) merges as the golden does."""
    gen = generator(11)
    partials = torch.randn(3, 2, splits, head_dim + 1, generator=gen)
    partials[..., head_dim] = _lse_pattern((3, 2, splits), gen, 0.3, 0.1)
    partials[0, 1, splits - 1, head_dim] = float("nan")  # poisoned, in the last tile
    partials[2, 0, 0, head_dim] = float("nan")  # poisoned, in the first tile
    partials[1, 1, :, head_dim] = POS_INF  # every split empty (+inf-marked)
    _poison_empty(partials[..., :head_dim], partials[..., head_dim])
    o, lse = nan_filled((3, 2, head_dim), torch.float32, device), nan_filled((3, 2), torch.float32, device)
    merge_splits(partials.to(device), o, lse)
    o, lse = o.cpu(), lse.cpu()
    poisoned = torch.zeros(3, 2, dtype=torch.bool)
    poisoned[0, 1] = poisoned[2, 0] = True
    assert o[poisoned].isnan().all() and lse[poisoned].isnan().all()
    assert not o[~poisoned].isnan().any() and not lse[~poisoned].isnan().any()
    assert torch.equal(o[1, 1], torch.zeros(head_dim)) and lse[1, 1].item() == NEG_INF
    ref_o, ref_lse = merge_states(partials[..., :head_dim].double(), partials[..., head_dim].double())
    assert ref_o[poisoned].isnan().all() and ref_lse[poisoned].isnan().all()  # the golden model poisons them too
    assert_close(o[~poisoned], ref_o[~poisoned], ("lse_merge", "o", "float32"))
    assert_close(lse[~poisoned], ref_lse[~poisoned], ("lse_merge", "lse", "float32"))


def test_merge_splits_max_spans_every_tile_of_splits(device) -> None:
    """More splits (40) than one tile of the merge holds (32): the max is taken over every tile. Row 0's first 32
    splits are empty and row 1 has one later split 200 above the rest; a max over the first tile only gives row 0
    ``(0, -inf)`` and row 1 inf / NaN, and passes every test of random LSEs."""
    gen = generator(12)
    partials = torch.randn(2, 2, 40, 129, generator=gen)
    partials[..., 128] = torch.randn(2, 2, 40, generator=gen) * 8
    partials[0, :, :32, 128] = NEG_INF
    partials[1, :, 35, 128] = 200.0
    _poison_empty(partials[..., :128], partials[..., 128])
    o, lse = nan_filled((2, 2, 128), torch.float32, device), nan_filled((2, 2), torch.float32, device)
    merge_splits(partials.to(device), o, lse)
    ref_o, ref_lse = merge_states(partials[..., :128].double(), partials[..., 128].double())
    assert_close(o.cpu(), ref_o, ("lse_merge", "o", "float32"))
    assert_close(lse.cpu(), ref_lse, ("lse_merge", "lse", "float32"))


def test_merge_splits_strided_partials(device) -> None:
    """A scratch view with padded strides (as carved from a workspace) merges like a dense one."""
    gen = generator(7)
    big = torch.randn(4, 3, 6, 20, generator=gen)
    partials = big[:, :, 1:5, :17]  # [R, H, S=4, D+1=17], strides of the big buffer
    o, lse = nan_filled((4, 3, 16), torch.float32, device), nan_filled((4, 3), torch.float32, device)
    merge_splits(partials.to(device), o, lse)
    ref_o, ref_lse = merge_states(partials[..., :16].double(), partials[..., 16].double())
    assert_close(o, ref_o, ("lse_merge", "o", "float32"))
    assert_close(lse, ref_lse, ("lse_merge", "lse", "float32"))


# -- the algebra of the merge (golden) -----------------------------------------------------------


def _states(gen: torch.Generator, n: int, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.randn(n, d, generator=gen, dtype=torch.float64)
    lse = torch.randn(n, generator=gen, dtype=torch.float64) * 5
    return o, lse


@given(seed=st.integers(0, 2**31 - 1))
def test_merge_is_associative_and_commutative(seed) -> None:
    o, lse = _states(generator(seed), 3)
    ab = merge_two(o[0], lse[0], o[1], lse[1])
    left = merge_two(*ab, o[2], lse[2])
    bc = merge_two(o[1], lse[1], o[2], lse[2])
    right = merge_two(o[0], lse[0], *bc)
    swapped = merge_two(o[1], lse[1], o[0], lse[0])
    torch.testing.assert_close(left, right, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ab, swapped, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(left, merge_states(o, lse), rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 2**31 - 1))
def test_neutral_state_is_identity(seed) -> None:
    o, lse = _states(generator(seed), 1)
    neutral_o = torch.full_like(o[0], float("nan"))  # never read: weight 0
    for neutral_lse in (NEG_INF, POS_INF):
        merged = merge_two(o[0], lse[0], neutral_o, torch.tensor(neutral_lse, dtype=torch.float64))
        assert torch.equal(merged[0], o[0]) and torch.equal(merged[1], lse[0])


@given(keys=st.integers(1, 50), splits=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
@example(keys=1, splits=8, seed=0)
def test_split_kv_identity(keys, splits, seed) -> None:
    """Attention over a key set == the merge of attention over any partition of it (empty parts too)."""
    gen = generator(seed)
    q = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, 8, generator=gen, dtype=torch.float64)
    owner = torch.randint(0, splits, (keys,), generator=gen)  # random partition, parts may be empty
    parts = [torch.nonzero(owner == s).flatten() for s in range(splits)]
    full_o, full_lse = attention_state(q, k, v, 0.25)
    part_o, part_lse = split_states(q, k, v, 0.25, parts)
    merged_o, merged_lse = merge_states(part_o, part_lse)
    torch.testing.assert_close(merged_o, full_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-12, atol=1e-12)


def test_attention_state_over_a_mask_is_the_state_of_the_visible_keys() -> None:
    """``attention_state`` with ``visible``: a row that sees some keys is the state over those keys alone, and a
    row that sees none is the neutral state ``(0, -inf)``, not NaN (the masked softmax takes its exponent against 0
    there, since ``-inf - (-inf)`` is NaN)."""
    gen = generator(13)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, 8), (5, 8), (5, 4)))
    visible = torch.tensor([[True, False, True, True, False], [False] * 5, [True] * 5])
    o, lse = attention_state(q, k, v, 0.5, visible)
    for row in (0, 2):
        keys = visible[row]
        o_row, lse_row = attention_state(q[row : row + 1], k[keys], v[keys], 0.5)
        torch.testing.assert_close(o[row], o_row[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(lse[row], lse_row[0], rtol=0, atol=1e-14)
    assert torch.equal(o[1], torch.zeros(4, dtype=torch.float64)) and lse[1].item() == NEG_INF


def test_base2_lse_conversion() -> None:
    """FlashInfer's base-2 LSE (log2 sum 2^(s log2 e)) converts to the natural-log LSE."""
    scores = torch.randn(5, 7, generator=generator(0), dtype=torch.float64) * 4
    lse2 = torch.log2(torch.exp2(scores / math.log(2.0)).sum(-1))
    torch.testing.assert_close(lse_base2_to_e(lse2), torch.logsumexp(scores, -1), rtol=1e-13, atol=1e-13)


# -- negative control: the tolerance catches a merge that forgets to rescale ---------------------


def test_negative_control_unrescaled_merge_fails(device) -> None:
    """Summing the split outputs weighted by raw exp(lse) without normalizing (or averaging them
    without weights) is outside the tolerance: the table is tight enough to catch either bug."""
    gen = generator(3)
    partials = torch.randn(8, 4, 4, 65, generator=gen)
    ref_o, _ = merge_states(partials[..., :64].double(), partials[..., 64].double())
    w = torch.exp(partials[..., 64:].double())
    not_normalized = (w * partials[..., :64].double()).sum(-2)
    unweighted = partials[..., :64].double().mean(-2)
    for wrong in (not_normalized, unweighted):
        for dtype in DTYPES:
            assert fails_tolerance(wrong.to(DTYPES[dtype]), ref_o, ("lse_merge", "o", dtype))


# -- bad input -----------------------------------------------------------------------------------


def _two_state_args(device, t=4, h=2, d=8, dtype=torch.float32):
    o = torch.zeros(t, h, d, dtype=dtype, device=device)
    lse = torch.zeros(h, t, device=device)
    return [o, o.clone(), lse, o.clone(), lse.clone()]


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda a: a.__setitem__(2, a[2].t().contiguous()), ValueError, "prefix_lse: expected shape"),
        (lambda a: a.__setitem__(4, a[4].double()), TypeError, "suffix_lse: expected dtype"),
        (lambda a: a.__setitem__(1, a[1].half()), TypeError, "prefix_output: expected dtype"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), ValueError, "suffix_output: expected shape"),
        (lambda a: a.__setitem__(0, a[0].int()), TypeError, "output: expected dtype"),
        (
            lambda a: a.__setitem__(1, a[1].transpose(1, 2).contiguous().transpose(1, 2)),
            ValueError,
            "prefix_output: the last",
        ),
    ],
)
def test_merge_attn_states_bad_input(device, mutate, error, match) -> None:
    args = _two_state_args(device)
    mutate(args)
    with pytest.raises(error, match=match):
        merge_attn_states(*args)


def test_merge_splits_bad_input(device) -> None:
    partials = torch.zeros(2, 3, 4, 9, device=device)
    with pytest.raises(TypeError, match="partials: expected dtype"):
        merge_splits(partials.double(), torch.zeros(2, 3, 8, device=device), torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match="o: expected shape"):
        merge_splits(partials, torch.zeros(2, 3, 9, device=device), torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match="lse: expected shape"):
        merge_splits(partials, torch.zeros(2, 3, 8, device=device), torch.zeros(3, 2, device=device))
    with pytest.raises(ValueError, match="partials: expected at least one split"):
        merge_splits(partials[:, :, :0], torch.zeros(2, 3, 8, device=device), torch.zeros(2, 3, device=device))
