"""What ``compute-sanitizer --tool racecheck`` reports for a hand-over it cannot follow (sm_90, a GPU only).

The MLA stage 1 (``triton_impl/decode_attention_sm90.py``) passes each tile's rescale factors from its softmax
warpgroup to its value warpgroup through shared memory, ordered by two mbarriers (``_hand_over``: wait until the
reader freed the buffer, store, fence, arrive; the reader waits, loads, and arrives on the other barrier). On the
H200 racecheck reports read-after-write and write-after-read hazards on exactly those loads and stores. This script
runs the same protocol, with the kernel's own ``_hand_over``, in a kernel that does nothing else: a default
partition hands ``ROUNDS`` vectors to a worker partition, which sums them. The sums are checked; run under
racecheck, the script shows whether the tool reports this protocol, which is correct, as a race::

    compute-sanitizer --tool racecheck --print-limit 10 python3 tests/racecheck_probe.py

It prints ``sums exact`` (or raises) and, where racecheck reports the hand-over, its summary counts hazards on
``_hand_over``'s store and this file's load. The same kernel with the reader's ``mbarrier.arrive`` before its
load (``--early-free``: the writer may then overwrite a vector still being read, a real race) is the
negative control: racecheck must report it too, and its sums may differ.
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from triton_impl.decode_attention_sm90 import _ROWS, _VEC_SMEM, BLOCK_H, _barrier, _hand_over

ROUNDS = 64


@gluon.jit
def _writer(vec_s, full, free, ROUNDS: gl.constexpr):
    """Hand over ``rows + i`` for ``i < ROUNDS`` (the default partition: the softmax warpgroup's role)."""
    rows = gl.arange(0, BLOCK_H, layout=_ROWS).to(gl.float32)
    for i in range(ROUNDS):
        _hand_over(None, rows + i, None, vec_s, full, free, i)
    return ()


@gluon.jit
def _reader(vec_s, full, free, out_ptr, ROUNDS: gl.constexpr, EARLY_FREE: gl.constexpr):
    """Sum the vectors handed over (a worker: the value warpgroup's role) and store the sums."""
    total = gl.zeros([BLOCK_H], gl.float32, layout=_ROWS)
    for i in range(ROUNDS):
        mbarrier.wait(full, i & 1)
        if EARLY_FREE:
            _barrier()
            mbarrier.arrive(free, count=1)
        total += vec_s.load(_ROWS)
        if not EARLY_FREE:
            _barrier()
            mbarrier.arrive(free, count=1)
    gl.store(out_ptr + gl.arange(0, BLOCK_H, layout=_ROWS), total)


@gluon.jit
def hand_over_kernel(out_ptr, ROUNDS: gl.constexpr, EARLY_FREE: gl.constexpr):
    """One program: the two partitions of ``_writer`` and ``_reader`` over a ``[64]`` fp32 buffer."""
    vec_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], _VEC_SMEM)
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(free, count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_writer, (vec_s, full, free, ROUNDS)),
        (_reader, (vec_s, full, free, out_ptr, ROUNDS, EARLY_FREE)),
    ], [4], [128])  # fmt: skip


def main(early_free: bool) -> None:
    out = torch.zeros(int(BLOCK_H), device="cuda")
    hand_over_kernel[(1,)](out, ROUNDS, early_free, num_warps=4)
    rows = torch.arange(int(BLOCK_H), device="cuda", dtype=torch.float32)
    expected = ROUNDS * rows + ROUNDS * (ROUNDS - 1) / 2
    if early_free:
        print(f"early free: sums {'exact' if torch.equal(out, expected) else 'differ'} (a real race)")
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        print("sums exact")


if __name__ == "__main__":
    main("--early-free" in sys.argv[1:])
