"""Device-side checks of block-table entries, shared by the paged attention kernels.

Memory safety may not depend on host checks (they are off on CUDA by default), so each kernel
bounds the entries it uses against the cache it was given. The check runs as a short pass over
the entries of a program's key range before its key loop; the key loop then only clamps each
entry into the cache, so the table load feeds K/V addresses alone. With a second use of the entry
inside the loop (a NaN score per bad page) Triton staged the table through shared memory, and on
the H200 the kernels were 3-14% slower than with this pass (``notebooks/results/perf_log.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_bad_key(table_row_ptr, stride_t_p, start, end, num_pages, page_size):
    """The first key position in ``[start, end)`` whose table entry (``table_row_ptr[(key //
    page_size) * stride_t_p]``) lies outside ``[0, num_pages)``; ``end`` when there is none or the
    range is empty. A causal row that sees keys ``[start, e)`` meets a bad page iff ``e`` exceeds it.
    ``page_size`` may be a constexpr or a run-time value.
    """
    PAGE_BLOCK: tl.constexpr = 16
    first = start // page_size
    last = tl.where(end > start, tl.cdiv(end, page_size), first)
    found = tl.zeros([PAGE_BLOCK], tl.int32) + end
    for p0 in range(first, last, PAGE_BLOCK):
        p = p0 + tl.arange(0, PAGE_BLOCK)
        live = p < last
        entry = tl.load(table_row_ptr + p * stride_t_p, mask=live, other=0)
        bad = live & ((entry < 0) | (entry >= num_pages))
        found = tl.minimum(found, tl.where(bad, tl.maximum(p * page_size, start), end))
    return tl.min(found, axis=0)
