"""The shared argument checks (``triton_impl.validation``) at their edges: each bound one past where it holds, so
that a check one short (a page, a row, one int) fails here and not only where a caller happens to cross it."""

from __future__ import annotations

import pytest
import torch

from triton_impl.validation import (
    CONTENT_CHECKS_ENV,
    block_table_2d,
    check_block_table,
    check_int32_lengths,
    check_lengths,
)

I32 = (torch.int32, torch.int64)


def test_the_block_table_check_reads_a_rows_last_partial_page(monkeypatch) -> None:
    """5 keys on pages of 4 use two pages: a bad entry in the second (holding one key) is found, and one past the
    row's pages is not read."""
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    lens = torch.tensor([5])
    check_block_table("t", torch.tensor([[0, 1, 999]]), lens, 4, 2)  # column 2 holds no key of the row
    with pytest.raises(ValueError, match=r"t: entry \[0, 1\] = 999 is outside the cache's 2 pages"):
        check_block_table("t", torch.tensor([[0, 999]]), lens, 4, 2)
    with pytest.raises(ValueError, match=r"t: entry \[0, 1\] = 2 is outside the cache's 2 pages"):
        check_block_table("t", torch.tensor([[0, 2]]), lens, 4, 2)  # the page count itself is one past


@pytest.mark.parametrize(("length", "ok"), [(2**31 - 1, True), (2**31, False), (-(2**31), True), (-(2**31) - 1, False)])
def test_int64_lengths_must_fit_int32_exactly(length: int, ok: bool) -> None:
    lengths = torch.tensor([3, length], dtype=torch.int64)
    if ok:
        check_int32_lengths("n", lengths)
    else:
        with pytest.raises(ValueError, match=rf"n: entry 1 = {length} is outside int32"):
            check_int32_lengths("n", lengths)


def test_a_block_table_is_two_dimensional_or_has_a_unit_third_dimension(device: torch.device) -> None:
    table = torch.zeros(2, 3, 1, dtype=torch.int32, device=device)
    device = table.device  # a call's device is its query's, with an index ("cuda:0", not "cuda")
    assert block_table_2d("t", table, min_rows=2, device=device, dtypes=I32).shape == (2, 3)
    with pytest.raises(ValueError, match=r"t: expected \[rows, columns\] or \[rows, columns, 1\], got \[2, 3, 2\]"):
        block_table_2d("t", torch.zeros(2, 3, 2, dtype=torch.int32, device=device), min_rows=2, device=device,
                       dtypes=I32)  # fmt: skip
    with pytest.raises(ValueError, match=r"t: expected >= 3 rows"):
        block_table_2d("t", table, min_rows=3, device=device, dtypes=I32)


def test_a_length_vector_needs_an_entry_per_row(device: torch.device) -> None:
    device = torch.zeros(0, device=device).device  # a call's device is its query's, with an index ("cuda:0")
    check_lengths("n", torch.zeros(2, dtype=torch.int32, device=device), 2, device, I32)
    with pytest.raises(ValueError, match=r"n: expected >= 2 entries \(one per row\), got 1"):
        check_lengths("n", torch.zeros(1, dtype=torch.int32, device=device), 2, device, I32)
