"""What parity and benchmark cases are built from and checked with.

The layer below both runners: ``triton_impl.parity`` (cases and the parity table) and
``triton_impl.bench`` (timing) import this module and never each other's builders, so neither
runner depends on the other. Tests build their paged caches on :func:`block_table_for` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triton_impl.tolerances import Comparison, Tolerance, compare


@dataclass(frozen=True)
class Check:
    """One output of one case. ``tol=None`` means bit-exact (bytes, codes, indices); ``bound`` adds a derived
    per-element allowance to ``tol`` (:func:`triton_impl.tolerances.compare`)."""

    output: str
    actual: torch.Tensor
    expected: torch.Tensor
    tol: Tolerance | None
    bound: torch.Tensor | None = None


def exact(actual: torch.Tensor, expected: torch.Tensor) -> Comparison:
    """Bit-exact comparison (for floats: same bits, so -0 != +0 and NaN == same NaN)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Comparison(float("inf"), float("inf"), False, "shape or dtype differs")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.view(int_type), e.view(int_type)
    mismatches = int((a != e).sum())
    return Comparison(float(mismatches), 0.0, mismatches == 0, f"{mismatches} elements differ" if mismatches else "")


def compare_check(check: Check) -> Comparison:
    """The check's output against its expected value: bit-exact without a tolerance, else within it."""
    if check.tol is None:
        return exact(check.actual, check.expected)
    return compare(check.actual, check.expected, check.tol, check.bound)


def block_table_for(
    seq_lens: Sequence[int],
    page_size: int,
    *,
    gen: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    spare_pages: int = 0,
    extra_columns: int = 0,
    fill: int = 0,
) -> tuple[torch.Tensor, int]:
    """A block table giving request ``b`` its ``cdiv(seq_lens[b], page_size)`` pages in random order.

    Pages are a random permutation of ``[0, num_pages)`` (drawn with ``gen`` on the CPU, or on
    ``device`` without one), ``spare_pages`` of them unused; ``extra_columns`` unused columns and
    every entry past a request's pages hold ``fill`` (serving pads with garbage; tests use an
    out-of-range id). Returns ``(table [B, max_pages + extra_columns] int32, num_pages)``.
    """
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages) + spare_pages
    order = torch.randperm(num_pages, generator=gen) if gen is not None else torch.randperm(num_pages, device=device)
    table = torch.full((len(seq_lens), max([*pages, 0]) + extra_columns), fill, dtype=torch.int32, device=order.device)
    start = 0
    for b, n_pages in enumerate(pages):
        table[b, :n_pages] = order[start : start + n_pages].to(torch.int32)
        start += n_pages
    return table.to(device), num_pages


def device_paged_cache(
    seq_lens: Sequence[int], page_size: int, kv_heads: int, width: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[pages, page_size, kv_heads, width]`` cache of random values drawn on the device (fast at
    GB sizes), pages handed out in a random order, and its ``[B, max_pages]`` int32 block table."""
    table, num_pages = block_table_for(seq_lens, page_size, device=device)
    return torch.randn(num_pages, page_size, kv_heads, width, device=device).to(dtype), table
