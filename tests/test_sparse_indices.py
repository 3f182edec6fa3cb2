"""Sparse-attention index preparation: Triton == golden exactly, and vLLM's hand cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import triton_impl.sparse_indices as kernels
from golden.sparse_indices import (
    build_flashinfer_mixed_sparse_indices as golden_flashinfer,
)
from golden.sparse_indices import (
    combine_topk_swa_indices as golden_combine,
)
from golden.sparse_indices import (
    compute_global_topk_indices_and_lens as golden_global_topk,
)
from golden.sparse_indices import image_visibility
from tests.support import assert_bits_equal, generator
from triton_impl.sparse_indices import (
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
)

I32 = torch.int32


def _i32(values, device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=device)


def _to(device, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def _on_device(device, args: dict) -> dict:
    """``args`` with every tensor (also inside a tuple, like ``out=``) moved to ``device``: compiled
    Triton reads no CPU tensor, and the wrappers would reject one before the check under test."""

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, tuple):
            return tuple(move(v) for v in value)
        return value

    return {name: move(value) for name, value in args.items()}


def _assert_equal_pair(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert_bits_equal(actual[0].cpu(), expected[0].cpu())
    assert_bits_equal(actual[1].cpu(), expected[1].cpu())


def _window_reference(pos: int, left: int, right: int, window: int) -> list[int]:
    """Positions a query token at ``pos`` sees through the SWA branch, written out per token."""
    start = max(pos - (window - 1) - max(left - (window - 1), 0), 0)
    return list(range(start, pos + right + 1))


# -- compute_global_topk_indices_and_lens ---------------------------------------------------------


def _global_case(device, topk, token_to_req, table, is_valid=None, block_size=64):
    topk_t = _i32(topk, device)
    valid = torch.tensor(is_valid or [True] * len(topk), device=device)
    args = (topk_t, _i32(token_to_req, device), table.to(device), block_size, valid)
    actual = compute_global_topk_indices_and_lens(*args)
    expected = golden_global_topk(*args)
    _assert_equal_pair(actual, expected)
    return actual[0].cpu().tolist(), actual[1].cpu().tolist()


TABLE_2x4 = _i32([[10, 11, 12, 13], [90, 91, 92, 93]])


@pytest.mark.parametrize(
    ("case", "topk", "token_to_req", "table", "expected_rows", "expected_lens"),
    [
        ("valid entries", [[0, 64, -1, -1]], [0], TABLE_2x4[:1], [[640, 704, -1, -1]], [2]),
        ("request == rows", [[0, 64]], [1], TABLE_2x4[:1], [[-1, -1]], [0]),
        ("request > rows", [[0, 64]], [5], TABLE_2x4[:1], [[-1, -1]], [0]),
        ("request < 0", [[0, 64]], [-1], TABLE_2x4[:1], [[-1, -1]], [0]),
        ("column == cols, > cols, negative local", [[128, 200, -5]], [0], TABLE_2x4[:, :2], [[-1, -1, -1]], [0]),
        ("no aliasing of row 1 onto row 0", [[0, 65], [0, 65]], [0, 1], TABLE_2x4, [[640, 705], [5760, 5825]], [2, 2]),
        ("out-of-bounds column next to a valid one", [[128, 5]], [0], TABLE_2x4[:, :2], [[645, -1]], [1]),
        (
            "left compaction keeps the order",
            [[128, 64, -1, 3, 70]],
            [0],
            TABLE_2x4[:, :2],
            [[704, 643, 710, -1, -1]],
            [3],
        ),
        ("CUDA-graph padded rows", [[0], [64]], [0, 1], TABLE_2x4, [[640], [91 * 64]], [1, 1]),
    ],
)
def test_global_topk_hand_cases(device, case, topk, token_to_req, table, expected_rows, expected_lens) -> None:
    """vLLM's test_compute_global_topk_bounds cases (bs = 64), worked by hand."""
    rows, lens = _global_case(device, topk, token_to_req, table)
    assert (rows, lens) == (expected_rows, expected_lens)


def test_global_topk_logical_columns_not_the_stride(device) -> None:
    """A column slice of a wider table (row stride 3, 2 columns): local 128 is column 2, which the
    storage has but the table does not -> -1."""
    backing = _i32([[10, 11, 99], [20, 21, 99]])
    rows, lens = _global_case(device, [[128, 64]], [0], backing[:, :2])
    assert (rows, lens) == ([[704, -1]], [1])


def test_global_topk_invalid_tokens_and_multi_request_prefill(device) -> None:
    """Padding tokens get lens 0 and -1 rows; three prefill tokens of two requests map independently."""
    topk = [[0, 1, 70], [63, -1, 64], [5, 6, 7], [0, 64, 128]]
    rows, lens = _global_case(device, topk, [0, 0, 1, 1], TABLE_2x4, is_valid=[True, True, True, False])
    assert rows == [[640, 641, 710], [703, 704, -1], [5765, 5766, 5767], [-1, -1, -1]]
    assert lens == [3, 2, 3, 0]


@given(
    num_tokens=st.integers(1, 10),
    topk=st.integers(1, 64),
    num_reqs=st.integers(1, 4),
    num_cols=st.integers(1, 6),
    block_size=st.sampled_from([16, 64, 256]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(num_tokens=1, topk=1, num_reqs=1, num_cols=1, block_size=16, strided=False, seed=0)
def test_global_topk_matches_golden(device, num_tokens, topk, num_reqs, num_cols, block_size, strided, seed) -> None:
    """Random local indices (negative, past the table), requests out of range, padding tokens,
    strided views of the index and table tensors."""
    gen = generator(seed)
    local = torch.randint(-3, (num_cols + 1) * block_size, (num_tokens, topk + 2), generator=gen, dtype=I32)
    local = local[:, :topk] if strided else local[:, :topk].contiguous()
    backing = torch.randint(0, 10_000, (num_reqs, num_cols + 3), generator=gen, dtype=I32)
    table = backing[:, :num_cols] if strided else backing[:, :num_cols].contiguous()
    token_to_req = torch.randint(-1, num_reqs + 1, (num_tokens,), generator=gen, dtype=I32)
    is_valid = torch.rand(num_tokens, generator=gen) < 0.8
    args = (*_to(device, local, token_to_req, table), block_size, is_valid.to(device))
    _assert_equal_pair(compute_global_topk_indices_and_lens(*args), golden_global_topk(*args))


def test_global_topk_compacts_across_tiles(device) -> None:
    """K = 1100 spans two 1024-wide tiles: the count carried from the first tile places the second's entries."""
    gen = generator(3)
    local = torch.randint(-40, 200, (3, 1100), generator=gen, dtype=I32)
    table = torch.randint(0, 100, (2, 4), generator=gen, dtype=I32)
    args = (*_to(device, local, _i32([0, 1, 0]), table), 64, torch.tensor([True, True, False], device=device))
    actual = compute_global_topk_indices_and_lens(*args)
    _assert_equal_pair(actual, golden_global_topk(*args))
    assert int(actual[1][0]) > 1024 * 0.5


# -- combine_topk_swa_indices ---------------------------------------------------------------------


def _combine_reference(topk, qsl, seq_lens, gather_lens, window, ratio, k, M, N, left=None, right=None):
    """vLLM's per-token reference of the combine formula, as plain lists (top-k entries are >= 0 here)."""
    rows, lens = [], []
    base = qsl[0]
    for b in range(len(seq_lens)):
        query_len = qsl[b + 1] - qsl[b]
        gather_start = seq_lens[b] - gather_lens[b]
        for i in range(query_len):
            t = qsl[b] - base + i
            pos = seq_lens[b] - query_len + i
            topk_len = min((pos + 1) // ratio, k)
            window_rows = [
                M * b + N + p - gather_start
                for p in _window_reference(pos, left[t] if left else 0, right[t] if right else 0, window)
            ]
            rows.append([v + M * b for v in topk[t][:topk_len]] + window_rows)
            lens.append(topk_len + len(window_rows))
    return rows, lens


# vLLM test_deepseek_v4_swa_visible: (seq_lens, query_lens, image spans per request); WINDOW 8, MAX_IMG 6.
SWA_VISIBLE_CASES = [
    ([30, 12], [30, 12], [[(4, 12), (20, 24)], []]),
    ([26], [26], [[(2, 17)]]),
    ([40, 9], [16, 9], [[(30, 38)], []]),
    ([7, 15], [7, 15], [[(0, 6)], [(10, 14)]]),
]


def _visible(seq_lens, query_lens, spans, max_image_tokens):
    left, right = [], []
    for seq_len, query_len, request_spans in zip(seq_lens, query_lens, spans):
        positions = torch.arange(seq_len - query_len, seq_len)
        lv, rv = image_visibility(positions, request_spans, max_image_tokens)
        left += lv.tolist()
        right += rv.tolist()
    return left, right


@pytest.mark.parametrize(("ratio", "k"), [(1, 0), (4, 16)])
@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.parametrize(("seq_lens", "query_lens", "spans"), SWA_VISIBLE_CASES)
def test_combine_vllm_swa_visible_cases(device, seq_lens, query_lens, spans, with_image, ratio, k) -> None:
    """Width ceil((topk + 14) / 128) * 128 with images (14 = window 8 + 6 image columns), and every row
    equal to the per-token reference followed by -1."""
    window, max_image = 8, 6
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    gather_lens = [q + min(s - q, window - 1) for s, q in zip(seq_lens, query_lens)]
    N = max(s // ratio for s in seq_lens)
    M = N + max(gather_lens) + 8
    topk = torch.randint(0, 4096, (qsl[-1], max(k, 1)), generator=generator(0), dtype=I32)[:, : max(k, 1)]
    left, right = _visible(seq_lens, query_lens, spans, max_image) if with_image else (None, None)
    args = (topk, _i32(qsl), _i32(seq_lens), _i32(gather_lens), window, ratio, k, M, N)
    image = (
        {}
        if not with_image
        else {"left_visible": _i32(left), "right_visible": _i32(right), "max_image_tokens": max_image}
    )
    combined, lens = combine_topk_swa_indices(
        *_to(device, *args[:4]),
        *args[4:],
        **{n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in image.items()},
    )
    _assert_equal_pair((combined, lens), golden_combine(*args, **image))

    width = -(-(k + window + (max_image if with_image else 0)) // 128) * 128
    assert combined.shape == (qsl[-1], width)
    rows, ref_lens = _combine_reference(topk.tolist(), qsl, seq_lens, gather_lens, window, ratio, k, M, N, left, right)
    assert lens.cpu().tolist() == ref_lens
    assert combined.cpu().tolist() == [row + [-1] * (width - len(row)) for row in rows]


def test_image_visibility_by_hand() -> None:
    """vLLM's rule by hand: inside a span ``[s, e]`` a token sees ``min(pos - s, IMG - 1)`` back and ``min(e - pos,
    IMG)`` ahead (the limits differ by one), outside every span nothing. Both the kernels' inputs and the golden
    model's expected rows come from this function, so only hand values test it."""
    positions = torch.tensor([0, 3, 10, 18, 20, 21, 31])
    left, right = image_visibility(positions, [(0, 20), (30, 32)], 6)
    assert left.tolist() == [0, 3, 5, 5, 5, 0, 1]
    assert right.tolist() == [6, 6, 6, 2, 0, 0, 1]


def test_combine_resets_stale_tails_and_keeps_negative_topk(device) -> None:
    """An out= buffer full of stale values comes back with -1 past each row's entries, and a -1
    inside topk_len stays -1 (upstream: -1 + M*b, a row of the previous request)."""
    topk = _i32([[3, -1, 5, 6], [7, 8, -1, 1]])
    qsl, seq_lens, gather_lens = _i32([4, 5, 6]), _i32([20, 30]), _i32([8, 8])
    stale = (torch.full((2, 128), 777, dtype=I32), torch.full((2,), 777, dtype=I32))
    args = (topk, qsl, seq_lens, gather_lens, 8, 4, 4, 100, 40)
    combined, lens = combine_topk_swa_indices(*_to(device, *args[:4]), *args[4:], out=_to(device, *stale))
    _assert_equal_pair((combined, lens), golden_combine(*args, out=stale))
    assert combined[0, :4].cpu().tolist() == [3, -1, 5, 6]  # request 0: pos 19, topk_len 4
    assert combined[1, :4].cpu().tolist() == [107, 108, -1, 101]  # request 1: + M
    assert lens.cpu().tolist() == [12, 12]
    assert bool((combined[:, 12:] == -1).all())


def _prefill_batch(gen, query_lens, prefix_lens, spans_on, max_image):
    """Positions of a prefill batch, and visibility from random image spans of <= max_image tokens."""
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    spans = []
    for seq_len in seq_lens:
        request_spans = []
        if spans_on and seq_len:
            start = int(torch.randint(0, seq_len, (1,), generator=gen))
            length = int(torch.randint(1, max_image + 1, (1,), generator=gen))
            request_spans.append((start, min(start + length, seq_len) - 1))
        spans.append(request_spans)
    left, right = _visible(seq_lens, query_lens, spans, max_image)
    return seq_lens, left, right


def _covering_gather_lens(seq_lens, query_lens, left, window):
    """Upstream's builder, ``query_len + min(prefix_len, window - 1)``, widened where an image lets a token see further
    back than its window (``left > window - 1``, possible when ``window <= max_image_tokens``): the content check
    rejects a tail that misses a position some token's window sees."""
    lens, token = [], 0
    for seq_len, query_len in zip(seq_lens, query_lens):
        first_seen = seq_len - query_len - min(seq_len - query_len, window - 1)
        for pos in range(seq_len - query_len, seq_len):
            reach = window - 1 + max((left[token] if left else 0) - (window - 1), 0)
            first_seen = min(first_seen, max(pos - reach, 0))
            token += 1
        lens.append(seq_len - first_seen)
    return lens


@given(
    query_lens=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    prefix_lens=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    window=st.sampled_from([1, 3, 8, 128]),
    ratio=st.sampled_from([1, 4, 128]),
    k=st.sampled_from([0, 4, 16, 64]),
    extra_topk_columns=st.sampled_from([0, 5]),
    with_image=st.booleans(),
    with_out=st.booleans(),
    base=st.integers(0, 5),
    extra_rows=st.sampled_from([0, 2]),
    seed=st.integers(0, 2**31 - 1),
)
@example(
    query_lens=[1], prefix_lens=[0, 0, 0, 0], window=1, ratio=1, k=0, extra_topk_columns=0, with_image=False,
    with_out=True, base=0, extra_rows=0, seed=0,
)  # fmt: skip
@example(
    query_lens=[6, 0, 3], prefix_lens=[40, 7, 0, 0], window=128, ratio=4, k=64, extra_topk_columns=5, with_image=True,
    with_out=True, base=3, extra_rows=2, seed=1,
)  # fmt: skip
# An image reaching past a one-token window (the GPU profile's find): the gathered tail must cover it.
@example(
    query_lens=[0, 1], prefix_lens=[0, 2, 0, 0], window=1, ratio=1, k=0, extra_topk_columns=0, with_image=True,
    with_out=False, base=0, extra_rows=0, seed=1,
)  # fmt: skip
def test_combine_matches_golden(
    device, query_lens, prefix_lens, window, ratio, k, extra_topk_columns, with_image, with_out, base, extra_rows, seed
) -> None:
    gen = generator(seed)
    max_image = 6
    seq_lens, left, right = _prefill_batch(gen, query_lens, prefix_lens, with_image, max_image)
    qsl = [base]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1] - base + extra_rows
    gather_lens = _covering_gather_lens(seq_lens, query_lens, left if with_image else None, window)
    N = max(s // ratio for s in seq_lens) + 1
    M = N + max(gather_lens) + 8
    topk = torch.randint(-1, N, (num_tokens, k + extra_topk_columns), generator=gen, dtype=I32)
    image = {}
    if with_image:
        pad = [0] * extra_rows
        image = {"left_visible": _i32(left + pad), "right_visible": _i32(right + pad), "max_image_tokens": max_image}
    width = -(-(k + window + (max_image if with_image else 0)) // 128) * 128
    out = None
    if with_out:
        out = (
            torch.randint(-9, 9, (num_tokens, width), generator=gen, dtype=I32),
            torch.full((num_tokens,), 5, dtype=I32),
        )
    args = (topk, _i32(qsl), _i32(seq_lens), _i32(gather_lens), window, ratio, k, M, N)
    expected = golden_combine(*args, out=out, **image)

    device_image = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in image.items()}
    device_out = None if out is None else _to(device, out[0].clone(), out[1].clone())
    actual = combine_topk_swa_indices(*_to(device, *args[:4]), *args[4:], out=device_out, **device_image)
    _assert_equal_pair(actual, expected)


def test_combine_does_not_depend_on_the_worker_count(device, monkeypatch) -> None:
    gen = generator(4)
    topk = torch.randint(0, 50, (9, 16), generator=gen, dtype=I32)
    args = (*_to(device, topk, _i32([0, 4, 9]), _i32([30, 5]), _i32([11, 5])), 8, 4, 16, 60, 20)
    first = combine_topk_swa_indices(*args)
    monkeypatch.setattr(
        kernels, "select_launch_config", lambda _d: kernels.LaunchConfig(combine_workers=3, num_warps=1)
    )
    _assert_equal_pair(combine_topk_swa_indices(*args), first)


# -- build_flashinfer_mixed_sparse_indices --------------------------------------------------------


def test_flashinfer_separates_window_and_padded_width(device) -> None:
    """vLLM: SWA width 8, logical window 4, one prefill token at seq_len 4, topk 0 ->
    [0, 1, 2, 3, -1, -1, -1, -1], lens [8] (the whole SWA region counts)."""
    args = (
        torch.zeros(0, 8, dtype=I32), None, None, torch.zeros(1, 0, dtype=I32),
        _i32([0, 1]), _i32([4]), _i32([0]), _i32([[0]]), 64, None, 64, 4, 4, 0,
    )  # fmt: skip
    indices, lens = build_flashinfer_mixed_sparse_indices(*_to(device, *args[:8]), *args[8:])
    _assert_equal_pair((indices, lens), golden_flashinfer(*args))
    assert indices.cpu().tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]]
    assert lens.cpu().tolist() == [8]


def test_flashinfer_images_one_decode_two_prefills(device) -> None:
    """vLLM: one decode row and two image prefill requests, window 8, 6 image columns: shape (40, 14),
    lens all 14, the decode row copied then padded with six -1; prefill rows = the window's slots."""
    window, max_image, block_size = 8, 6, 64
    seq_lens, query_lens, spans = [50, 30, 12], [1, 30, 9], [[], [(4, 12), (20, 24)], []]
    qsl = [0, 1, 31, 40]
    token_to_req = [0] + [1] * 30 + [2] * 9
    table = torch.arange(3 * 4, dtype=I32).view(3, 4)
    decode_swa = _i32([[100, 101, 102, 103, 104, 105, 106, 107]])
    left, right = _visible(seq_lens, query_lens, spans, max_image)
    args = (
        decode_swa, None, None, torch.zeros(39, 0, dtype=I32), _i32(qsl), _i32(seq_lens), _i32(token_to_req),
        table, block_size, None, block_size, window, 4, 0,
    )  # fmt: skip
    image = {"prefill_left_visible": _i32(left), "prefill_right_visible": _i32(right), "max_image_tokens": max_image}
    indices, lens = build_flashinfer_mixed_sparse_indices(
        *_to(device, *args[:8]),
        *args[8:],
        **{n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in image.items()},
    )
    _assert_equal_pair((indices, lens), golden_flashinfer(*args, **image))
    assert indices.shape == (40, 14) and lens.cpu().tolist() == [14] * 40
    assert indices[0].cpu().tolist() == list(range(100, 108)) + [-1] * 6
    for t in range(1, 40):
        req = token_to_req[t]
        pos = seq_lens[req] - query_lens[req] + (t - qsl[req])
        slots = [
            int(table[req, p // block_size]) * block_size + p % block_size
            for p in _window_reference(pos, left[t], right[t], window)
        ]
        assert indices[t].cpu().tolist() == slots + [-1] * (14 - len(slots))


@given(
    num_decode=st.integers(0, 4),
    prefill_query_lens=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    prefix_lens=st.lists(st.integers(0, 30), min_size=7, max_size=7),
    window=st.sampled_from([1, 4, 8]),
    extra_swa_columns=st.sampled_from([0, 3]),
    ratio=st.sampled_from([1, 4, 128]),
    k=st.sampled_from([0, 4, 6]),
    decode_topk=st.sampled_from([0, 3, 8]),
    local=st.booleans(),
    with_lens=st.booleans(),
    with_image=st.booleans(),
    block_sizes=st.sampled_from([(16, 4), (64, 16)]),
    with_spans=st.booleans(),
    short_tables=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(
    num_decode=2, prefill_query_lens=[3, 1], prefix_lens=[5, 0, 30, 2, 0, 0, 0], window=4, extra_swa_columns=3,
    ratio=4, k=6, decode_topk=8, local=True, with_lens=False, with_image=True, block_sizes=(16, 4), with_spans=True,
    short_tables=True, seed=0,
)  # fmt: skip
@example(
    num_decode=3, prefill_query_lens=[2], prefix_lens=[0, 9, 3, 12, 0, 0, 0], window=8, extra_swa_columns=0,
    ratio=1, k=4, decode_topk=3, local=False, with_lens=True, with_image=False, block_sizes=(64, 16), with_spans=False,
    short_tables=False, seed=2,
)  # fmt: skip
def test_flashinfer_matches_golden(
    device, num_decode, prefill_query_lens, prefix_lens, window, extra_swa_columns, ratio, k, decode_topk, local,
    with_lens, with_image, block_sizes, with_spans, short_tables, seed,
) -> None:  # fmt: skip
    """Decode/prefill mixes, local or global decode entries, lens given or not, images, block spans,
    tables too short for some positions (-> -1)."""
    if num_decode + len(prefill_query_lens) == 0:
        num_decode = 1
    gen = generator(seed)
    max_image = 6
    swa_bs, comp_bs = block_sizes
    query_lens = [1] * num_decode + prefill_query_lens
    num_reqs = len(query_lens)
    seq_lens, left, right = _prefill_batch(
        gen, query_lens, [p + 1 for p in prefix_lens[:num_reqs]], with_image, max_image
    )
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    token_to_req = [r for r, q in enumerate(query_lens) for _ in range(q)]
    decode_valid = torch.rand(num_decode, generator=gen) < 0.75
    for t in range(num_decode):  # a padding decode token may name no request at all
        if not decode_valid[t] and bool(torch.rand(1, generator=gen) < 0.5):
            token_to_req[t] = num_reqs + 2
    swa_cols = -(-max(seq_lens) // swa_bs) - (1 if short_tables else 0)
    comp_cols = max(1, -(-(max(seq_lens) // ratio + 1) // comp_bs) - (1 if short_tables else 0))
    swa_table = torch.randint(0, 500, (num_reqs, max(swa_cols, 1)), generator=gen, dtype=I32)
    comp_table = torch.randint(0, 500, (num_reqs, comp_cols + 2), generator=gen, dtype=I32)[:, :comp_cols]
    swa_width = window + extra_swa_columns
    decode_swa = torch.randint(-1, 5000, (num_decode, swa_width), generator=gen, dtype=I32)
    decode_comp = None
    if decode_topk:
        high = comp_cols * comp_bs + 3 if local else 5000
        decode_comp = torch.randint(-1, high, (num_decode, decode_topk), generator=gen, dtype=I32)
    decode_lens = torch.randint(0, decode_topk + 1, (num_decode + 1,), generator=gen, dtype=I32) if with_lens else None
    prefill_topk = torch.randint(
        -1, comp_cols * comp_bs + 3, (num_tokens - num_decode, k + 1), generator=gen, dtype=I32
    )
    args = (
        decode_swa, decode_comp, decode_lens, prefill_topk, _i32(qsl), _i32(seq_lens), _i32(token_to_req),
        swa_table, swa_bs, comp_table, comp_bs, window, ratio, k,
    )  # fmt: skip
    options = {
        "decode_compressed_indices_are_local": local,
        "decode_is_valid_token": decode_valid,
        "swa_block_span": swa_bs + 3 if with_spans else None,
        "compressed_block_span": comp_bs + 1 if with_spans else None,
    }
    if with_image:
        options |= {
            "prefill_left_visible": _i32(left),
            "prefill_right_visible": _i32(right),
            "max_image_tokens": max_image,
        }
    expected = golden_flashinfer(*args, **options)

    device_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    device_options = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in options.items()}
    _assert_equal_pair(build_flashinfer_mixed_sparse_indices(*device_args, **device_options), expected)


# -- bad input ------------------------------------------------------------------------------------


def _global_args(device, **change):
    args = dict(
        topk_indices=_i32([[0, 1]]), token_to_req_indices=_i32([0]), block_table=_i32([[3]]), block_size=64,
        is_valid_token=torch.tensor([True]),
    )  # fmt: skip
    args.update(change)
    return _on_device(device, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"topk_indices": torch.tensor([[0, 1]])}, TypeError, r"topk_indices: expected dtype"),
        ({"topk_indices": _i32([0, 1])}, ValueError, r"topk_indices: expected rank 2"),
        ({"token_to_req_indices": _i32([0, 0])}, ValueError, r"token_to_req_indices: expected shape \[1\]"),
        ({"block_table": _i32([3])}, ValueError, r"block_table: expected rank 2"),
        ({"is_valid_token": _i32([1])}, TypeError, r"is_valid_token: expected dtype"),
        ({"block_size": 0}, ValueError, r"block_size: expected a positive int"),
    ],
)
def test_global_topk_rejects_bad_input(device, change, error, match) -> None:
    compute_global_topk_indices_and_lens(**_global_args(device))  # the unchanged arguments are fine
    with pytest.raises(error, match=match):
        compute_global_topk_indices_and_lens(**_global_args(device, **change))


def _combine_args(device, **change):
    args = dict(
        topk_indices=torch.zeros(3, 4, dtype=I32), query_start_loc=_i32([0, 3]), seq_lens=_i32([10]),
        gather_lens=_i32([10]), window_size=8, compress_ratio=4, topk=4, M=30, N=10,
    )  # fmt: skip
    args.update(change)
    return _on_device(device, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"topk": 5}, ValueError, r"topk: expected <= topk_indices.shape\[1\] = 4, got 5"),
        ({"topk_indices": torch.zeros(3, 4, dtype=torch.int64)}, TypeError, r"topk_indices: expected dtype"),
        ({"query_start_loc": _i32([0, 3, 3])}, ValueError, r"query_start_loc: expected shape \[2\]"),
        ({"gather_lens": _i32([10, 1])}, ValueError, r"gather_lens: expected shape \[1\]"),
        ({"window_size": 0}, ValueError, r"window_size: expected an int >= 1"),
        ({"left_visible": _i32([0, 0, 0])}, ValueError, r"left_visible, right_visible: give both or neither"),
        (
            {"out": (torch.zeros(3, 256, dtype=I32), torch.zeros(3, dtype=I32))},
            ValueError,
            r"out\[0\]: expected \[>= 3, 128\]",
        ),
        (
            {"out": (torch.zeros(3, 128, dtype=I32), torch.zeros(2, dtype=I32))},
            ValueError,
            r"out\[1\]: expected >= 3 entries",
        ),
        ({"query_start_loc": _i32([0, 4])}, ValueError, r"query_start_loc: expected non-decreasing, spanning <= 3"),
        ({"seq_lens": _i32([2])}, ValueError, r"seq_lens: expected >= the query lengths"),
        (
            {"left_visible": _i32([0, 0, 9]), "right_visible": _i32([0, 0, 9]), "max_image_tokens": 6},
            ValueError,
            r"token 2's window has 19 positions, more than the 14 SWA columns",
        ),
        ({"left_visible": _i32([0, -1, 0]), "right_visible": _i32([0, 0, 0])}, ValueError, r"expected >= 0"),
        # The first token (position 7) sees positions 0-7: a tail of 9 puts position 0 in the compressed rows.
        (
            {"gather_lens": _i32([9])},
            ValueError,
            r"gather_lens: request 0 gathers its last 9 tokens, but its token at position 7 sees position 0",
        ),
        # An image lets the first token see 2 positions past its window of 2 (left 3): upstream's tail of
        # q + min(prefix, window - 1) = 4 tokens misses positions 4 and 5.
        (
            {
                "window_size": 2,
                "gather_lens": _i32([4]),
                "left_visible": _i32([3, 0, 0]),
                "right_visible": _i32([0, 0, 0]),
                "max_image_tokens": 6,
            },
            ValueError,
            r"gather_lens: request 0 gathers its last 4 tokens, but its token at position 7 sees position 4",
        ),
        ({"gather_lens": _i32([11])}, ValueError, r"gather_lens: expected 0 <= gather_len <= seq_len"),
        ({"M": 15}, ValueError, r"gather_lens: expected .* <= M - N = 5"),
        ({"M": 5}, ValueError, r"M: expected an int >= 10, got 5"),
        ({"M": 30.0}, ValueError, r"M: expected an int >= 10, got 30.0"),
        ({"N": None}, ValueError, r"N: expected an int >= 0, got None"),
        ({"topk": True}, ValueError, r"topk: expected an int >= 0, got True"),
        (
            {"out": (torch.zeros(3, 128, dtype=I32), torch.zeros(3, dtype=I32), None)},
            TypeError,
            r"out: expected a pair \(combined, lens\) of tensors or None, got tuple of 3",
        ),
    ],
)
def test_combine_rejects_bad_input(device, change, error, match) -> None:
    combine_topk_swa_indices(**_combine_args(device))  # the unchanged arguments are fine
    with pytest.raises(error, match=match):
        combine_topk_swa_indices(**_combine_args(device, **change))


def _flashinfer_args(device, **change):
    args = dict(
        decode_swa_indices=_i32([[0, 1, 2, 3]]), decode_compressed_indices=_i32([[1, 2]]),
        decode_compressed_topk_lens=None, prefill_topk_indices=_i32([[0, 1], [2, 3]]),
        query_start_loc=_i32([0, 1, 3]), seq_lens=_i32([5, 9]), token_to_req_indices=_i32([0, 1, 1]),
        swa_block_table=_i32([[0], [1]]), swa_block_size=16, compressed_block_table=None, compressed_block_size=16,
        window_size=4, compress_ratio=4, topk=2,
    )  # fmt: skip
    args.update(change)
    return _on_device(device, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"window_size": 5}, ValueError, r"decode_swa_indices: expected >= window_size = 5 columns, got 4"),
        (
            {"decode_swa_indices": torch.zeros(1, 4, dtype=torch.int64)},
            TypeError,
            r"decode_swa_indices: expected dtype",
        ),
        (
            {"decode_compressed_indices": _i32([[1, 2], [3, 4]])},
            ValueError,
            r"decode_compressed_indices: expected 1 rows",
        ),
        ({"decode_compressed_indices_are_local": True}, ValueError, r"decode_is_valid_token: required"),
        ({"token_to_req_indices": _i32([0, 1])}, ValueError, r"token_to_req_indices: expected >= 3 entries"),
        ({"query_start_loc": _i32([0, 3])}, ValueError, r"query_start_loc: expected shape \[3\]"),
        ({"prefill_left_visible": _i32([0, 0, 0])}, ValueError, r"give both or neither"),
        (
            {"token_to_req_indices": _i32([0, 1, 2])},
            ValueError,
            r"token_to_req_indices: prefill rows must name one of the 2",
        ),
        (
            {"token_to_req_indices": _i32([0, 0, 1])},
            ValueError,
            r"a prefill row lies outside its request's query range",
        ),
        ({"seq_lens": _i32([5, 1])}, ValueError, r"seq_lens: expected >= the query length"),
        ({"compressed_block_size": 0}, ValueError, r"compressed_block_size: expected a positive int"),
        ({"swa_block_span": 0}, ValueError, r"swa_block_span: expected a positive int"),
        # One row for two requests: the second request's SWA slots would be read past the table.
        ({"swa_block_table": _i32([[0]])}, ValueError, r"swa_block_table: expected >= 2 rows \(one per request\)"),
    ],
)
def test_flashinfer_rejects_bad_input(device, change, error, match) -> None:
    build_flashinfer_mixed_sparse_indices(**_flashinfer_args(device))  # the unchanged arguments are fine
    with pytest.raises(error, match=match):
        build_flashinfer_mixed_sparse_indices(**_flashinfer_args(device, **change))
