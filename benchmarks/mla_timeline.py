"""Where a program of the sm_90 Gluon MLA stage 1 spends its time: a timeline per program, for the GPU machine.

``PYTHONPATH=. python3 benchmarks/mla_timeline.py "op:name part" ...`` (specs as ``benchmarks/kernel_times.py``
takes them; cases that run ``triton_impl/decode_attention_sm90.py``). The kernel is rebuilt from its own source with
a ``%globaltimer`` stamp (nanoseconds, one clock for the whole GPU) written by each program at six points:

0. ``start``: the entry kernel begins;
1. ``bounds``: the split bounds are known (the loader and both warpgroups start next);
2. ``query``: the softmax warpgroup has the query in shared memory and the block table checked;
3. ``tile 0``: it has the first tile's scores;
4. ``loop``: it has finished the last tile (its own value products included);
5. ``stored``: the program has stored both output halves and the LSE;

and, summed over the tiles, how long the softmax warpgroup waited for each tile's bytes (and issued its score
MMAs, a few dozen cycles): with two stages a tile's load starts once both warpgroups have released the tile two
before it, so this says whether the loads keep up.

A case is set up as the bench sets it up (content checks off), run 3 times, then twice stamped (the second counts). The
table gives, per case, the kernel's span (first start to last store), the median and maximum over programs of each phase
and of the time spent waiting for tiles. The stamps cost a few instructions per program and two timer reads per tile;
nothing else changes. This is how the output halves' stores (8 rows a store, 13-23 us a program of fp32 partials) were
found, 2026-12-01 (``notebooks/results/perf_log.md``). """

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

import triton_impl.decode_attention_sm90 as fast
from benchmarks.timeline import STAMP_SOURCE, after, apply_edits, load_module, median_max, print_timelines

PHASES = ("start", "bounds", "query", "tile 0", "loop", "stored")

_SCORES_ARGS = "q_s0, q_s1, q_spe, k_s0, k_s1, k_spe, k_full, w_full, i, first_tile, start, tile_end, FP8)\n"
_SCORES_WAIT = "        s = warpgroup_mma_wait(0, deps=[s])\n"


# (where, what): each ``where`` occurs once in the kernel's source and becomes ``what`` (a stamp added, or the trace
# pointer passed down). A ``where`` that no longer matches stops the tool with its text.
_EDITS = (
    ("\n@gluon.jit\ndef _zero_rows(", "\n" + STAMP_SOURCE + "\n@gluon.jit\ndef _zero_rows("),
    ("stride_out_h,\n            request, row_block, QLEN: gl.constexpr,",
     "stride_out_h,\n            request, row_block, trace_ptr, QLEN: gl.constexpr,"),
    after("    poisoned = (limit > table_keys) | (row_end > first_bad)\n    async_copy.wait_group(0)\n"
           "    fence_async_shared()\n    _barrier()\n", 2),
    ("    acc = warpgroup_mma_wait(0, deps=[acc])\n\n",
     "    acc = warpgroup_mma_wait(0, deps=[acc])\n    _stamp(trace_ptr, 4)\n    _put(trace_ptr, 6, waited)\n\n"),
    ("    for i in range(num_tiles):\n        # The last tile's", "    waited = _now() * 0\n"
     "    for i in range(num_tiles):\n        # The last tile's"),
    ("        s = _issue_scores(" + _SCORES_ARGS + _SCORES_WAIT,
     "        before = _now()\n        s = _issue_scores(" + _SCORES_ARGS + "        waited += _now() - before\n"
     + _SCORES_WAIT + "        if i == 0:\n            _stamp(trace_ptr, 3)\n"),
    ("logit_cap, request, row_block, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr,",
     "logit_cap, request, row_block, trace_ptr, QLEN: gl.constexpr, NUM_HEADS: gl.constexpr,"),
    after("    first_tile = start // BLOCK_N * BLOCK_N\n", 1),
    ("request, row_block, QLEN, NUM_HEADS, PAGE_SIZE, HAS_CAP, OUT_VEC,\n",
     "request, row_block, trace_ptr, QLEN, NUM_HEADS, PAGE_SIZE, HAS_CAP, OUT_VEC,\n"),
    after("lse.to(lse_ptr.dtype.element_ty), mask=ok)\n", 5),
    ("    stride_t_r, stride_t_p, stride_sl,\n", "    stride_t_r, stride_t_p, stride_sl, trace_ptr,\n"),
    ("    row, head_block, split = _decode_program(",
     "    _stamp(trace_ptr, 0)\n    row, head_block, split = _decode_program("),
    ("row, head_block, 1, GROUP,", "row, head_block, trace_ptr, 1, GROUP,"),
    ("stride_o_r, stride_o_h, stride_lse_r, stride_lse_h,\n    QLEN: gl.constexpr,",
     "stride_o_r, stride_o_h, stride_lse_r, stride_lse_h, trace_ptr,\n    QLEN: gl.constexpr,"),
    ("    pid = gl.program_id(0)\n    row_block = pid % ROW_BLOCKS",
     "    _stamp(trace_ptr, 0)\n    pid = gl.program_id(0)\n    row_block = pid % ROW_BLOCKS"),
    ("0.0, b, row_block, QLEN, NUM_HEADS,", "0.0, b, row_block, trace_ptr, QLEN, NUM_HEADS,"),
    ('"v_scale_ptr": "*fp32"}', '"v_scale_ptr": "*fp32", "trace_ptr": "*i64"}'),
)


_FEW_ROWS_FROM, _FEW_ROWS_TO = "\nFEW_ROWS = ", "\ndef compile_for_sm90("


def stamped_source() -> str:
    """``decode_attention_sm90``'s source with the stamps (and ``trace_ptr``, the last runtime argument of both
    entry kernels and of ``compile_for_sm90``'s signature)."""
    text = Path(fast.__file__).read_text()
    # The few-rows kernel is not stamped: its text (which repeats some anchors) is set aside while the edits apply.
    few_start, few_end = text.index(_FEW_ROWS_FROM), text.index(_FEW_ROWS_TO)
    few, text = text[few_start:few_end], text[:few_start] + _FEW_ROWS_TO + text[few_end + len(_FEW_ROWS_TO) :]
    return apply_edits(text, _EDITS, "mla_timeline").replace(_FEW_ROWS_TO, few + _FEW_ROWS_TO, 1)


def load_stamped(folder: Path):
    """The stamped module, written to ``folder`` (Gluon reads a kernel's source from its file)."""
    return load_module(stamped_source(), folder, "mla_timeline_kernels")


def _cells(stamps: list[list[int]]) -> list[str]:
    """A case's row: programs, span, each phase and the waits for tiles (median, max over programs)."""
    zero = min(s[0] for s in stamps)
    span = (max(s[5] for s in stamps) - zero) / 1e3
    cells = [median_max([(s[k + 1] - s[k]) / 1e3 for s in stamps]) for k in range(len(PHASES) - 1)]
    return [str(len(stamps)), f"{span:.1f}", *cells, median_max([s[6] / 1e3 for s in stamps])]


def main(specs: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        phases = [f"{a} -> {b} us (median, max)" for a, b in itertools.pairwise(PHASES)]
        print_timelines(specs, load_stamped(Path(folder)), ("mla_decode_stage1_kernel", "mla_verify_stage1_kernel"),
                        ["programs", "span us", *phases, "waiting for tiles us (median, max)"], _cells,
                        "the Gluon stage 1 did not run")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
