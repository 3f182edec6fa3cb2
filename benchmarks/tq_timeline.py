"""Where a program of the TurboQuant decode's stream-K stage 1 spends its time: a timeline per program, for the GPU
machine.

``PYTHONPATH=. python3 benchmarks/tq_timeline.py "op:name part" ...`` (specs as ``benchmarks/kernel_times.py`` takes
them; cases that run ``turboquant_sm90.decode_stage1_stream_k_kernel``: 3- and 4-bit keys on sm_90). The kernel is
rebuilt from its own source with ``%globaltimer`` stamps (``benchmarks/timeline.py``). Each program records:

0. ``start``: the kernel begins (slot 0);
1. ``ready``: its place taken (by its rank on its warp scheduler where the kernel weighs the ranks), its chunk ring
   and centroid tables made, its first piece next (slot 1; idle programs, past the ones a KV head's keys need,
   record 0);
2. ``prologue``: summed over its pieces, the time from a piece's start to its first copy (the scan of the sequence
   lengths for the piece's request, the block-table check);
3. ``chunks``: summed over its pieces, :func:`_chunks` (the first copies asked for, the query, the chunk loop);
4. ``store``: summed over its pieces, the ring's reset and the partial's store;
5. ``end``: the kernel's last instruction (slot 5), and its pieces (slot 6).

A case is set up as the bench sets it up (content checks off), run 3 times, then twice stamped (the second counts). The
table gives, per case, the kernel's span (first start to last end), how far apart the programs start (last start minus
first), the median and maximum over the working programs of each phase, and when they end (from the first start): the
median and the last, for the programs with one piece and with more; and the end (median, last) by the program's rank on
its warp scheduler (``benchmarks.timeline.placement``: its warp slot on the SM divided by 4). The stamps add four int64
values carried through the pieces' loop (a few registers) and twelve timer reads a piece; the chunk loop is not stamped.

What it found (``notebooks/results/perf_log.md``, twenty-second session): the ~15 us of stage 1 that does not grow
with L is mostly the programs' ends spreading by their rank on their warp scheduler. With the same steps each, the
warps that arrived first on a scheduler are issued first and end first (3bit_nc L=8K: ranks 0 / 1 / 2 end at
93.9 / 110.3 / 128.1 us, median), and the youngest rank runs alone at the end.
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
from pathlib import Path

import triton_impl.turboquant_sm90 as fast
from benchmarks.timeline import STAMP_SOURCE, apply_edits, load_module, median_max, placement, print_timelines

KERNEL = "decode_stage1_stream_k_kernel"
_ENTRY = "@gluon.jit\ndef decode_stage1_stream_k_kernel("
_PIECE_LOOP = "        while pos < hi:  # a piece: the steps from pos in one request\n"
_LAST_LINE = "            pos = piece_end\n"
_SUMS = ("spent_prologue", "spent_chunks", "spent_store", "pieces_run")  # carried through the pieces' loop

# (where, what): each ``where`` occurs once in the module's source.
_EDITS = (
    (_ENTRY, STAMP_SOURCE + "\n" + _ENTRY),
    ("stride_pb, stride_ph, stride_ps, batch,\n", "stride_pb, stride_ph, stride_ps, batch, trace_ptr,\n"),
    ("    pid = gl.program_id(0)\n    launched = gl.num_programs(0) // NUM_KV_HEADS\n",
     "    _stamp(trace_ptr, 0)\n    pid = gl.program_id(0)\n    launched = gl.num_programs(0) // NUM_KV_HEADS\n"),
    (_PIECE_LOOP, "        _stamp(trace_ptr, 1)\n" + "".join(f"        {name} = _now() * 0\n" for name in _SUMS)
                  + _PIECE_LOOP + "            piece_start = _now()\n"),
    ("            poisoned = _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)\n",
     "            poisoned = _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)\n"
     "            chunks_start = _now()\n            spent_prologue += chunks_start - piece_start\n"),
    ("                                         pair_lut, shape)  # fmt: skip\n",
     "                                         pair_lut, shape)  # fmt: skip\n"
     "            store_start = _now()\n            spent_chunks += store_start - chunks_start\n"),
    (_LAST_LINE + "\n\n",
     "            spent_store += _now() - store_start\n            pieces_run += 1\n" + _LAST_LINE
     + "        _put(trace_ptr, 2, spent_prologue)\n        _put(trace_ptr, 3, spent_chunks)\n"
       "        _put(trace_ptr, 4, spent_store)\n        _put(trace_ptr, 6, pieces_run)\n"
       "    _stamp(trace_ptr, 5)\n\n\n"),
    ('"centroid_ptr": "*fp32", "partials_ptr": "*fp32",', '"centroid_ptr": "*fp32", "partials_ptr": "*fp32", '
                                                         '"trace_ptr": "*i64",'),
)


def load_stamped(folder: Path):
    """The stamped ``triton_impl.turboquant_sm90``, written to ``folder`` (Gluon reads a kernel's source from its
    file); its ``compile_for_sm90`` compiles the stamped kernels."""
    return load_module(apply_edits(Path(fast.__file__).read_text(), _EDITS, "tq_timeline"), folder,
                       "tq_timeline_kernels")  # fmt: skip


def _ends(stamps: list[list[int]], zero: int, pieces) -> str:
    """``"median, last"`` end (us from ``zero``) of the working programs whose pieces ``pieces`` accepts, or ``-``."""
    ends = [(s[5] - zero) / 1e3 for s in stamps if s[6] and pieces(s[6])]
    return f"{statistics.median(ends):.1f}, {max(ends):.1f}" if ends else "-"


def _cells(stamps: list[list[int]]) -> list[str]:
    """A case's row: programs (working), span, start spread, each phase (median, max over the working programs) and
    the end times by pieces a program."""
    working = [s for s in stamps if s[6]]
    zero = min(s[0] for s in stamps)
    return [f"{len(stamps)} ({len(working)})", f"{(max(s[5] for s in stamps) - zero) / 1e3:.1f}",
            f"{(max(s[0] for s in stamps) - zero) / 1e3:.1f}", median_max([(s[1] - s[0]) / 1e3 for s in working]),
            *(median_max([s[k] / 1e3 for s in working]) for k in (2, 3, 4)),
            _ends(stamps, zero, lambda n: n == 1), _ends(stamps, zero, lambda n: n > 1),
            _by_rank(stamps, zero)]  # fmt: skip


def _by_rank(stamps: list[list[int]], zero: int) -> str:
    """The working programs' end (us from ``zero``: median, last) grouped by their rank on their warp scheduler
    (:func:`benchmarks.timeline.placement`): ``"rank: programs, median, last"`` for each rank."""
    groups = collections.defaultdict(list)
    for s in stamps:
        if s[6]:
            groups[placement(s)[2]].append((s[5] - zero) / 1e3)
    return "; ".join(f"{rank}: {len(ends)}, {statistics.median(ends):.1f}, {max(ends):.1f}"
                     for rank, ends in sorted(groups.items()))  # fmt: skip


def main(specs: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        columns = ["programs (working)", "span us", "starts apart us", "start -> ready", "prologue", "chunks",
                   "store", "end, one piece (median, last)", "end, more pieces (median, last)",
                   "end by rank on its scheduler (rank: programs, median, last)"]  # fmt: skip
        print_timelines(specs, load_stamped(Path(folder)), (KERNEL,), columns, _cells,
                        "the stream-K stage 1 did not run")


if __name__ == "__main__":
    main(sys.argv[1:])
