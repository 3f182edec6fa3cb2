"""What the per-program timelines of ``benchmarks/mla_timeline.py`` and ``benchmarks/tq_timeline.py`` share.

A Gluon kernel is rebuilt from its module's source with ``%globaltimer`` stamps (nanoseconds, one clock for the whole
GPU): a list of edits, each ``(where, what)`` with ``where`` occurring exactly once in the source, adds the stamp
functions below and the calls to them, and a ``trace_ptr`` argument (int64, 8 slots a program). The stamped module
is written to a folder (Gluon reads a kernel's source from its file) and imported; while a case runs, the launches of
the named kernels go to their stamped twins with a fresh trace buffer. Slot 7 of each program holds its SM and its
first warp's slot there (:func:`placement`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from triton_impl import launch as launch_module
from triton_impl.validation import CONTENT_CHECKS_ENV

# The stamp functions, inserted into the kernel's module. One element a thread of the calling warps (a warp-specialized
# partition's own warps): reading the timer needs no reduction and no barrier.
STAMP_SOURCE = '''
@gluon.jit
def _stamp_lanes():
    """One element a thread of the warps that call it."""
    return gl.arange(0, 32 * gl.num_warps(), layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))


@gluon.jit
def _now():
    """``%globaltimer`` in every thread."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [_stamp_lanes()], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _put(trace_ptr, slot: gl.constexpr, value):
    """Store thread 0's ``value`` (from :func:`_now`'s layout) at ``trace_ptr[program * 8 + slot]``."""
    lane = _stamp_lanes()
    program = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    gl.store(trace_ptr + program * 8 + slot + lane * 0, value, mask=lane == 0)


@gluon.jit
def _stamp(trace_ptr, slot: gl.constexpr):
    """The time at ``slot``; with slot 0 the SM id and the warp's slot on it at slot 7 (:func:`placement`)."""
    _put(trace_ptr, slot, _now())
    if slot == 0:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [_stamp_lanes()], dtype=gl.int32,
                                       is_pure=False, pack=1)
        warp = gl.inline_asm_elementwise("mov.u32 $0, %warpid;", "=r,r", [_stamp_lanes()], dtype=gl.int32,
                                         is_pure=False, pack=1)
        _put(trace_ptr, 7, sm.to(gl.int64) + warp.to(gl.int64) * 65536)

'''


def after(where: str, slot: int, indent: str = "    ") -> tuple[str, str]:
    """An edit that stamps ``slot`` right after ``where`` (``indent``: what precedes the stamp on its line)."""
    return where, f"{where}{indent}_stamp(trace_ptr, {slot})\n"


def apply_edits(text: str, edits: Sequence[tuple[str, str]], tool: str) -> str:
    """``text`` with each edit's ``where`` replaced by its ``what``; a ``where`` that does not occur exactly once stops
    ``tool`` with its text (the kernel's source changed)."""
    for where, what in edits:
        if text.count(where) != 1:
            raise SystemExit(f"{tool}: the kernel's source changed, {where!r} occurs {text.count(where)} times")
        text = text.replace(where, what)
    return text


def load_module(source: str, folder: Path, name: str) -> ModuleType:
    """``source`` written to ``folder / name.py`` and imported from there."""
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def stamped_launches(stamped: ModuleType, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, a :class:`~triton_impl.launch.Launch` of a kernel named in ``names`` launches ``stamped``'s
    kernel of that name with ``trace_ptr``, a zeroed int64 buffer of 8 slots a program, which the yielded dict holds
    (key ``"t"``) after the launch; every other launch is unchanged."""
    trace: dict[str, torch.Tensor] = {}
    plain_call = launch_module.Launch.__call__

    def call(self, stream, *head):
        name = getattr(getattr(self._kernel, "fn", None), "__name__", "")
        if name not in names:
            return plain_call(self, stream, *head)
        programs = 1
        for size in self._grid:
            programs *= size
        trace["t"] = torch.zeros(programs * 8, dtype=torch.int64, device="cuda")
        getattr(stamped, name)[self._grid](*head, *self._tail, trace_ptr=trace["t"], **self._constexprs)
        return None

    launch_module.Launch.__call__ = call
    try:
        yield trace
    finally:
        launch_module.Launch.__call__ = plain_call


def placement(stamps: Sequence[int]) -> tuple[int, int, int]:
    """``(SM, scheduler, rank)`` of a program's first warp from its slot 7: the SM id; the warp's slot on the SM
    modulo 4, the SM sub-partition (warp scheduler) it issues from under the usual mapping of warp slots; and the
    slot divided by 4, its place among the warps of that scheduler (slots fill in the order programs arrive)."""
    return stamps[7] % 65536, stamps[7] // 65536 % 4, stamps[7] // 65536 // 4


def median_max(values: Sequence[float]) -> str:
    """``"median, max"`` with two decimals."""
    return f"{statistics.median(values):.2f}, {max(values):.2f}"


def print_timelines(specs: Sequence[str], stamped: ModuleType, names: Sequence[str], columns: Sequence[str],
                    cells: Callable[[list[list[int]]], list[str]], missing: str) -> None:  # fmt: skip
    """A markdown table: for each bench case the specs name (as ``benchmarks/kernel_times.py`` takes them), set up as
    the bench sets it up (content checks off), run 3 times, then twice with the kernels ``names`` launched from
    ``stamped`` (the second run's stamps count): the row ``op | case | cells(stamps)`` (``stamps``: 8 slots a
    program), or ``missing`` where none of them ran. ``columns`` are the header's cells after op and case."""
    from benchmarks.kernel_times import matching

    os.environ[CONTENT_CHECKS_ENV] = "0"
    with stamped_launches(stamped, names) as trace:
        print("| op | case | " + " | ".join(columns) + " |")
        print("| --- " * (2 + len(columns)) + "|")
        for spec in specs:
            for case in matching(spec):
                bench = case.setup(torch.device("cuda"))
                for _ in range(3):
                    bench.run()
                for _ in range(2):  # the first stamped run compiles and loads the stamped kernel: the second counts
                    trace.clear()
                    bench.run()
                    torch.cuda.synchronize()
                stamps = trace["t"].view(-1, 8).cpu().tolist() if "t" in trace else None
                if stamps and os.environ.get("TIMELINE_RAW"):  # a folder: every program's 8 slots, a file a case
                    name = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{case.op} {case.name}")
                    (Path(os.environ["TIMELINE_RAW"]) / f"{name}.json").write_text(json.dumps(stamps))
                row = cells(stamps) if stamps else [missing]
                print(f"| {case.op} | {case.name} | " + " | ".join(row) + " |", flush=True)
                del bench
                torch.cuda.empty_cache()
