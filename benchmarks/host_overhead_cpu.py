"""Host time per call of the public attention wrappers, measured on a CPU with the launches stubbed.

Run from the repository root (no GPU needed; any ``TRITON_INTERPRET`` setting is overridden)::

    PYTHONPATH=. .venv/bin/python benchmarks/host_overhead_cpu.py [--calls N] [--profile CASE]

It builds the calls of ``benchmarks/serving.py`` (same shapes, split counts for 132 SMs as on the
H200; CPU tensors, each cache holding 64 keys per request since no kernel runs) and times each
call back to back: the median over 5 loops of ``--calls`` calls (default 2000), in microseconds.
The wrappers run compiled mode's host path, not the interpreter's:

- ``TRITON_INTERPRET=0`` before anything imports Triton, so the kernels are ``JITFunction``s and
  ``triton_impl.launch.launch`` takes its cached path after the first call of each variant;
- the first launch of a variant (``JITFunction.run``, which would compile) returns a stand-in
  compiled kernel whose ``run`` does nothing: later launches go through ``launch``'s key and
  argument packing to that no-op, so the C launcher's own time is not counted;
- the CUDA device and stream queries return 0, and check_tensor's "must be a CUDA tensor" test
  accepts CPU tensors (``benchmarks/host_overhead_cpu.py`` patches what the code at hand uses);
- content checks off (``ATTNREF_CHECK_CONTENTS=0``), as they are by default on CUDA.

``--profile CASE`` (a substring of a case name) prints a cProfile top list of that case's calls.
It raises if a timed call launches through ``JITFunction.run`` (a missed plan or launch cache).

Results on the 2-core development CPU (Python 3.11, torch 2.13, Triton 3.9; the H200's host runs
this Python 2-3x slower), us per call, the fastest of three runs. Before: commit 9f8a585 (the
wrappers checked and derived everything on every call and launched through ``launch``), timed by
this script with ``torch.cuda.current_device``/``current_stream`` stubbed, which that code used.
After: each wrapper keys a plan on its arguments' layout and launches through ``Launch``.

| case | before | after |
| --- | --- | --- |
| MLA decode B=8 H=16 L=4K | 37.9 | 7.1 |
| MLA decode B=8 H=128 L=4K | 37.8 | 6.9 |
| MLA decode B=1 H=128 L=32K | 37.9 | 7.0 |
| MLA decode B=32 H=16 L=32K | 37.6 | 7.0 |
| MLA decode B=8 H=128 L=8K | 37.5 | 7.0 |
| MLA verify B=8 H=16 Q=4 L=4K | 37.7 | 7.1 |
| MLA verify B=8 H=128 Q=4 L=4K (one split: one launch) | 24.7 | 6.5 |
| GQA decode B=8 32/8 D=128 L=4K | 36.3 | 6.9 |
| TurboQuant 4bit decode B=8 32/8 D=128 L=4K (72.8 before 14d089e moved the rotation into a kernel) | 117.3 | 9.1 |
| merge_attn_states T=512 H=32 D=128 | 18.1 | 4.4 |

Where MLA decode's 7 us go (each part timed alone): the plan key 3.8 us (ten tensor arguments,
~0.4 us each for type, dtype, shape, strides, device and alignment), finding the plan 0.7 us (a
comparison with the previous call's key), the content-check switch 0.4 us (0.1 us with the
variable unset, as serving runs), the two launches' argument passing 0.9 + 0.6 us, the rest about
1 us.

Where TurboQuant decode's 72.8 us go (09cc3ec, its wrapper planned per call layout like the
others): ``(query.float() @ PiT).contiguous()`` 60.6 us timed alone, which here is the CPU doing
the [256, 128] x [128, 128] product (on the GPU: two asynchronous torch launches); the fp16
centroid table ``centroids.to(torch.float16)`` 2.0 us; the rest, ~10 us, is Python: the plan key
(ten tensor arguments and thirteen others, ~5 us), the content-check switch, the two launches.
Both torch ops derive from contents (the query, the centroids), so they ran on every call. Since
14d089e a first kernel rotates the query into the split slots of ``mid_o_buf`` and stage 1 rounds the
fp32 codebook itself: 9.1 us, three launches and the plan key.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before triton_impl (and Triton) are imported
os.environ["ATTNREF_CHECK_CONTENTS"] = "0"

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from benchmarks import serving
from triton_impl import launch, validation

H200_SMS = 132
CACHE_LENGTH = 64  # keys per request actually allocated (nothing reads them)


class _NoOpKernel:
    """Stands in for a ``CompiledKernel``: what ``launch`` reads, and a ``run`` that does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: object) -> None:
        return None

    def run(self, *args: object) -> None:
        return None


_NO_OP = _NoOpKernel()
first_launches = 0  # JITFunction.run calls: launches that did not take a cached path


def _first_launch(self: JITFunction, *args: object, **kwargs: object) -> _NoOpKernel:
    global first_launches
    first_launches += 1
    return _NO_OP


def stub_gpu() -> None:
    """Make compiled mode's host path run on CPU tensors with no GPU (see the module docstring)."""
    JITFunction.run = _first_launch
    knobs.runtime.launch_enter_hook = None  # as Triton 3.6 has it (3.9: an empty hook chain)
    launch._get_device = lambda: 0
    launch._get_stream = lambda index: 0
    validation.INTERPRETING = True  # its one use there: check_tensor's CUDA-tensor test


def cases() -> list[tuple[str, Callable[[], object]]]:
    cpu = torch.device("cpu")
    return [
        (name, serving.build(kind, *shape, device=cpu, sm_count=H200_SMS, cache_length=CACHE_LENGTH))
        for name, kind, *shape in serving.CASES
    ]


def per_call_us(run: Callable[[], object], calls: int, loops: int = 7) -> float:
    """The fastest of ``loops`` loops of ``calls`` calls, per call: other processes on the machine
    only ever add time."""
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def profile(name: str, run: Callable[[], object], calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return f"--- cProfile, {calls} calls: {name}\n{text.getvalue()}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", default=None, help="a substring of a case name")
    args = parser.parse_args(argv)
    stub_gpu()
    print("| case | us per call |\n| --- | --- |")
    for name, run in cases():
        run()  # the first launch of each variant: the stand-in "compile"
        before = first_launches
        print(f"| {name} | {per_call_us(run, args.calls):.1f} |", flush=True)
        if first_launches != before:
            raise RuntimeError(f"{name}: {first_launches - before} launches missed the cached path")
        if args.profile and args.profile in name:
            print(profile(name, run, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
