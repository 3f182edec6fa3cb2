"""Benchmarks on a GPU: correctness first, then time against the measured roofline (``attnref bench``).

Each op may define ``bench_cases() -> list[BenchCase]`` in ``triton_impl/parity/<op>.py`` beside
its parity cases (``triton_impl.parity.registered_bench_cases`` collects them; this runner imports
nothing from the parity package, which sits above it). A case builds its inputs once and returns a
:class:`Bench`: the kernel launch, a check against golden (run before any timing: a wrong kernel
is never timed), the bytes and FLOPs it must move and do (from the op's ``Traffic:`` docstring
line), and baselines timed in the same run. Ceilings are measured in the same run:
device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul on random data.
Times (:func:`cold_ms`) are ``triton.testing.do_bench``'s method with one change: the L2 flush before
each call reads 256 MB instead of writing zeros over them, so a call starts on a cold L2 of clean
lines, not on 50 MB of dirty ones whose write-back it would pay (8-9 us of a memory-bound call on
the H200, ``benchmarks/kernel_times.py``).
Content checks (host reads of block tables) run for the correctness check and are off while
timing, as in serving (``ATTNREF_CHECK_CONTENTS=0``).

Peers: where FlashInfer imports, the MLA decode and verify, GQA decode and two-state merge cases
also run FlashInfer on their very tensors (:class:`Peer`, built by the ``flashinfer_*`` functions at
the end of this module, the only code that imports it). A peer is checked against the same golden
model as ours first (FlashInfer's LSE is base 2: :func:`lse_from_base2`), then timed like a
baseline; the table gives its time and ``peer ms / our ms`` (above 1: ours is faster). FlashInfer is
never a dependency (the optional extra ``peers``); without it the column says ``-``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from triton_impl.cases import Check, compare_check
from triton_impl.cases import device_paged_cache as device_paged_cache  # re-export for parity/turboquant.py
from triton_impl.validation import CONTENT_CHECKS_ENV


@dataclass
class Peer:
    """Another library's kernel on a case's own tensors: ``run`` launches it; ``check`` pairs its
    outputs (LSE in natural log) with the case's golden values, as :attr:`Bench.check` does for ours."""

    run: Callable[[], object]
    check: Callable[[], Sequence[Check]]


class PeerMismatch(Exception):
    """A peer's output disagrees with the golden model: it is reported, never timed."""


@dataclass
class Bench:
    run: Callable[[], object]
    check: Callable[[], Sequence[Check]]
    bytes: float
    flops: float
    baselines: dict[str, Callable[[], object]] = field(default_factory=dict)
    kernels: Sequence[str] = ()  # Triton kernel names whose SASS should show HGMMA
    # Peer name -> builder, called after ours is timed (a peer that fails to build loses only its
    # own cell). Filled only where the peer library imports.
    peers: dict[str, Callable[[], Peer]] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchCase:
    op: str
    name: str
    setup: Callable[[torch.device], Bench]


@dataclass
class Result:
    op: str
    case: str
    ms: float
    gbps: float
    tflops: float
    bound: str
    roofline_ms: float
    pct_roofline: float
    baselines_ms: dict[str, float]
    hgmma: str
    correct: bool
    detail: str = ""
    peers_ms: dict[str, float] = field(default_factory=dict)  # NaN where the peer was not timed
    peers_status: dict[str, str] = field(default_factory=dict)  # "ok", "WRONG: ..." or "failed: ..."


def l2_flush(dirty: bool = False) -> Callable[[], object]:
    """A call that evicts the L2 by touching 256 MB (``triton.testing.do_bench``'s size; the H200's L2 is 50 MB):
    by reading them, which leaves clean lines, or with ``dirty`` by writing zeros as ``do_bench`` does, which
    leaves the L2 full of dirty lines that the next kernel's own misses write back to DRAM."""
    buffer = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")
    if dirty:
        return buffer.zero_
    total = torch.empty((), dtype=torch.int64, device="cuda")
    return lambda: torch.sum(buffer, dim=0, out=total)


def cold_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn`` between CUDA events, each call after a reading L2 flush (:func:`l2_flush`).

    ``triton.testing.do_bench``'s method (five flushed calls to estimate the time, ``warmup_ms`` of calls, then
    ``rep_ms`` of flushed calls), except that its flush writes zeros: on the H200 the write-back of those dirty
    lines added 8-9 us to memory-bound calls (GQA decode B=128 L=1K 130.3 -> 139.5 us, MLA verify B=32 H=16 qlen=4
    L=32K 284.4 -> 292.4) and nothing to a compute-bound one (MLA decode B=32 H=128 L=32K 521.4 / 520.8).
    """
    flush = l2_flush()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(rep_ms / estimate_ms)))]  # fmt: skip
    for start, end in events:
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s), measured now."""
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = cold_ms(lambda: dst.copy_(src), warmup_ms=50, rep_ms=300)
    src = dst = None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = cold_ms(lambda: a @ b, warmup_ms=50, rep_ms=300)
    return {"copy_gbps": 2 * n / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


def bench_ms(fn: Callable[[], object]) -> float:
    """The bench's time of one call: :func:`cold_ms`, or below 50 us (launch-bound) a CUDA graph's replays."""
    import triton.testing

    ms = cold_ms(fn)
    if ms < 0.05:  # launch-bound: replay a CUDA graph to drop the launch gaps
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return ms


def us_per_call(step: Callable[[], object], calls: int, repeats: int, *, wait_for_gpu: bool) -> float:
    """Microseconds per call of ``step``: ``calls`` calls back to back, each loop started on an idle
    GPU and timed to the GPU's end (``wait_for_gpu``) or to the return of the last call (the host
    alone); the median of ``repeats`` loops."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        if wait_for_gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[repeats // 2]


def per_length_line(us_by_length: dict[int, float], from_length: int = 2048) -> tuple[float, float]:
    """``(us per 1K keys, us at L=0)``: the least-squares line through the times of the lengths from
    ``from_length`` (a kernel's time over request lengths; its value at 0 is what every call pays)."""
    lengths = [n for n in us_by_length if n >= from_length]
    design = torch.tensor([[n / 1024, 1.0] for n in lengths], dtype=torch.float64)
    times = torch.tensor([[us_by_length[n]] for n in lengths], dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(design, times).solution[:, 0].tolist()
    return slope, intercept


def eager_and_graph_us(run: Callable[[], object], iters: int = 200, repeats: int = 5) -> tuple[float, float]:
    """``(eager, graph)``: microseconds per call of ``run`` back to back, called from Python and
    replayed from one CUDA graph capture; each the median of ``repeats`` loops of ``iters`` calls.

    Eager minus graph is the host time per call that the GPU does not hide (argument checks,
    config look-ups, the launches themselves). ``run`` must be capturable (no host sync). One untimed
    loop of ``iters`` eager calls goes first: in a fresh process on the H200 the host measured 15-17 us a
    call slower (MLA decode B=8 H=16 L=4K: 46-47 us eager in the first timing test of two device calls,
    31 us in ``benchmarks/serving.py`` minutes later).
    """
    us_per_call(run, iters, 1, wait_for_gpu=True)  # ends with the GPU idle
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return (us_per_call(run, iters, repeats, wait_for_gpu=True),
            us_per_call(graph.replay, iters, repeats, wait_for_gpu=True))  # fmt: skip


def _cuobjdump() -> str:
    """The cuobjdump in the Triton wheel (it ships one beside ptxas), else the one on PATH."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else "cuobjdump"


def cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump <flag>`` of a cubin (``-sass``, ``-res-usage``, ...): its standard output."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True, timeout=120, check=True)
        return done.stdout


# A SASS instruction of ``cuobjdump -sass``: address, opcode and modifiers (a predicate skipped); a branch target.
SASS_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
SASS_BRANCH = re.compile(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
# A move of a uniform register into a per-thread one (``IMAD.U32 Rd, RZ, RZ, URs`` or ``MOV Rd, URs``).
SASS_UNIFORM_MOVE = re.compile(r"\b(?:IMAD\.U32 R\d+, RZ, RZ, UR\d+|MOV R\d+, UR\d+)\b")


def sass_code(cubin: bytes) -> tuple[list[tuple[int, str, str, str]], list[tuple[int, int]]]:
    """A cubin's SASS as ``(address, opcode, modifiers, line)`` and its loops as ``(head, tail)`` addresses (a
    backward branch to the head; self-branches excluded)."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3), line) for line in cuobjdump(cubin, "-sass").splitlines()
            if (m := SASS_INSTRUCTION.match(line))]  # fmt: skip
    loops = [(int(b.group(1), 16), address) for address, _, _, line in code
             if (b := SASS_BRANCH.search(line)) and int(b.group(1), 16) < address]  # fmt: skip
    return code, loops


def innermost_loop(code: list[tuple[int, str, str, str]], loops: list[tuple[int, int]],
                   opcodes: tuple[str, ...]) -> tuple[int, int] | None:  # fmt: skip
    """``(head, tail)`` of the innermost of ``loops`` that holds an instruction of ``opcodes`` (:func:`sass_code`'s
    forms), or ``None`` if none does."""
    holding = [(h, t) for h, t in loops if any(h <= address <= t and op in opcodes for address, op, _, _ in code)]
    return min(holding, key=lambda loop: loop[1] - loop[0]) if holding else None


def sass_loop(cubin: bytes, opcode: str) -> list[str]:
    """The SASS lines of the innermost loop that holds an ``opcode`` instruction (a kernel's tile loop: ``HMMA``)."""
    code, loops = sass_code(cubin)
    head, tail = innermost_loop(code, loops, (opcode,))
    return [line for address, _, _, line in code if head <= address <= tail]


# A predicated forward branch: what a trip that takes it skips (a second predicate may follow BRA).
SASS_SKIP = re.compile(r"@!?U?P[T0-9]+\s+BRA\s+(?:!?U?P[T0-9]+,\s*)?(?:`\(\S+\)\s*)?0x([0-9a-f]+)")


def sass_main_path(code: list[tuple[int, str, str, str]], head: int, tail: int) -> list[str]:
    """The lines of loop ``(head, tail)`` (:func:`sass_code`) that a trip runs whichever of the loop's predicated
    forward branches it takes: those outside every span a branch skips (from the branch to its target inside the
    loop; a branch out of the loop, to a block placed after it that jumps back, skips nothing here)."""
    skipped = [(address, int(m.group(1), 16)) for address, _, _, line in code
               if head <= address <= tail and (m := SASS_SKIP.search(line)) and address < int(m.group(1), 16) <= tail]
    return [line for address, _, _, line in code
            if head <= address <= tail and not any(start < address < end for start, end in skipped)]  # fmt: skip


def sass_resources(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` per thread of a cubin's (last) kernel, from ``cuobjdump -res-usage``."""
    line = [x for x in cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in x][-1]
    return int(re.search(r"REG:(\d+)", line).group(1)), int(re.search(r"STACK:(\d+)", line).group(1))


def sass_mma_counts(cubin: bytes) -> tuple[int, int]:
    """``(HGMMA, HMMA)``: Hopper warpgroup MMAs and warp-level MMAs in a cubin's SASS."""
    sass = cuobjdump(cubin, "--dump-sass")
    return sass.count("HGMMA"), sass.count("HMMA")  # "HGMMA" does not contain "HMMA"


@contextlib.contextmanager
def capture_launches():
    """Collect the compiled variants launched inside the block, keyed by ``id``.

    ``JITFunction.run`` returns the ``CompiledKernel`` it launched (``kernel[grid](...)`` calls it),
    so wrapping it (and ``triton_impl.launch.on_launch``, for launches that skip it) names exactly
    the variant a case runs, cached or freshly compiled (the newest cubin in the cache directory is
    not: a case that reuses a variant compiles nothing).
    """
    from triton.runtime.jit import JITFunction

    from triton_impl import launch

    launched: dict[int, object] = {}
    original = JITFunction.run

    def record(kernel: object) -> None:
        launched.setdefault(id(kernel), kernel)

    def run(self, *args, **kwargs):
        kernel = original(self, *args, **kwargs)
        if kernel is not None:
            record(kernel)
        return kernel

    JITFunction.run = run
    launch.on_launch = record  # launches that skip JITFunction.run (triton_impl.launch's cache)
    try:
        yield launched
    finally:
        JITFunction.run = original
        launch.on_launch = None


def _sass_report(launched: dict[int, object], kernels: Sequence[str]) -> str:
    """``name: N HGMMA, M HMMA`` for each launched variant of the named kernels."""
    if not kernels:
        return "-"
    counts = []
    for kernel in launched.values():
        name = getattr(kernel, "name", "?")
        if name not in kernels:
            continue
        try:
            hgmma, hmma = sass_mma_counts(kernel.asm["cubin"])
            counts.append(f"{name}: {hgmma} HGMMA, {hmma} HMMA")
        except (AttributeError, KeyError, OSError, subprocess.SubprocessError) as err:
            counts.append(f"{name}: SASS not read ({type(err).__name__})")
    return "; ".join(dict.fromkeys(counts)) or "not captured"


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"[:160]


def check_peer(name: str, peer: Peer) -> None:
    """Raise :class:`PeerMismatch` naming the output if any of the peer's checks fails."""
    for check in peer.check():
        cmp = compare_check(check)
        if not cmp.ok:
            raise PeerMismatch(
                f"{name} {check.output} disagrees with the golden model: {cmp.detail} (max abs {cmp.max_abs:.3g})"
            )


def _consume_cuda_error() -> None:
    """Take a launch error a failed peer left pending, so that it does not surface in the next case.

    A library that reports its kernel's failed launch without reading the error (``cudaPeekAtLastError``)
    leaves it for the next launch check: at 23b7894 FlashInfer's merge failed with "invalid argument" and
    our next case raised it. A non-sticky error is read (and reset) by the launch check of one small torch
    kernel; a sticky one (a fault) would fail every later case anyway."""
    if not torch.cuda.is_available():
        return
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:
        pass


def time_peers(
    peers: dict[str, Callable[[], Peer]], time_fn: Callable[[Callable[[], object]], float] = bench_ms
) -> tuple[dict[str, float], dict[str, str]]:
    """``(ms, status)`` per peer: built, run once, checked (:func:`check_peer`), then timed with
    ``time_fn`` (the baselines' timing, CUDA-graph rule included). A peer that disagrees is
    ``"WRONG: ..."``, one that raises ``"failed: ..."``; neither is timed (NaN)."""
    ms: dict[str, float] = {}
    status: dict[str, str] = {}
    for name, build in peers.items():
        ms[name] = math.nan
        try:
            peer = build()
            peer.run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            check_peer(name, peer)
            ms[name], status[name] = time_fn(peer.run), "ok"
        except PeerMismatch as err:
            status[name] = f"WRONG: {err}"
        except Exception as err:  # a peer that cannot run here costs its own cell only
            status[name] = f"failed: {_one_line(err)}"
            _consume_cuda_error()
        peer = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return ms, status


def run_bench(cases: Sequence[BenchCase], ceilings: dict[str, float], baselines: bool = True) -> list[Result]:
    peak_bw = ceilings["copy_gbps"] * 1e9
    peak_flops = ceilings["matmul_tflops"] * 1e12
    results = []
    for case in cases:
        print(f"  {case.op}: {case.name}", flush=True)
        try:
            bench = case.setup(torch.device("cuda"))
            with capture_launches() as launched:
                bench.run()
            torch.cuda.synchronize()
            checks = bench.check()
        except Exception as err:  # a case that raises is reported, not timed; the others still run
            results.append(Result(case.op, case.name, math.nan, 0, 0, "-", 0, 0, {}, "-", False, _one_line(err)))
            torch.cuda.empty_cache()
            continue
        detail, correct = "", True
        for check in checks:
            cmp = compare_check(check)
            if not cmp.ok:
                correct, detail = False, f"{check.output}: {cmp.detail} (max abs {cmp.max_abs:.3g})"
        if not correct:
            results.append(Result(case.op, case.name, math.nan, 0, 0, "-", 0, 0, {}, "-", False, detail))
            continue
        os.environ[CONTENT_CHECKS_ENV] = "0"  # time what serving runs: no host reads of the block table
        try:
            ms = bench_ms(bench.run)
            base_ms = {}
            for name, fn in bench.baselines.items() if baselines else ():
                try:
                    fn()
                    base_ms[name] = bench_ms(fn)
                except torch.cuda.OutOfMemoryError:
                    base_ms[name] = math.nan
                    torch.cuda.empty_cache()
        finally:
            os.environ.pop(CONTENT_CHECKS_ENV)
        peers_ms, peers_status = time_peers(bench.peers)
        t_bytes, t_flops = bench.bytes / peak_bw * 1e3, bench.flops / peak_flops * 1e3
        roofline_ms = max(t_bytes, t_flops)
        results.append(
            Result(
                case.op, case.name, ms, bench.bytes / ms / 1e6, bench.flops / ms / 1e9,
                "memory" if t_bytes >= t_flops else "compute", roofline_ms, 100 * roofline_ms / ms, base_ms,
                _sass_report(launched, bench.kernels), True, "", peers_ms, peers_status,
            )
        )  # fmt: skip
        del bench
        torch.cuda.empty_cache()
    return results


def _geomean(values: Sequence[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def _peer_cell(r: Result, name: str) -> str:
    """``ms (peer ms / our ms)x``; the reason where the peer was not timed; ``-`` where it did not run."""
    status = r.peers_status.get(name)
    if status is None:
        return "-"
    if status != "ok":
        return status.replace("|", "/")[:200]
    ms = r.peers_ms[name]
    return f"{ms:.4f} ({ms / r.ms:.2f}x)"


def table_lines(results: Sequence[Result]) -> list[str]:
    """The table of ``bench_h200.md``, a row per result in order, and the geomeans under it: everything from the
    table's header line to the end of the file (what :func:`merge_report` rewrites)."""
    lines = [
        "| op | case | ms | GB/s | TFLOP/s | bound | roofline ms | % of roofline | baselines (ms) | SASS | "
        + " | ".join(f"{name} (ms, ours/peer speed)" for name in PEERS)
        + " |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(PEERS),
    ]
    for r in results:
        if not r.correct:
            lines.append(f"| {r.op} | {r.case} | WRONG: not timed | | | | | | | {r.detail} |" + " - |" * len(PEERS))
            continue
        base = ", ".join(f"{k} {v:.3f} ({v / r.ms:.1f}x)" for k, v in r.baselines_ms.items()) or "-"
        lines.append(
            f"| {r.op} | {r.case} | {r.ms:.4f} | {r.gbps:.0f} | {r.tflops:.1f} | {r.bound} | {r.roofline_ms:.4f} | "
            f"{r.pct_roofline:.1f}% | {base} | {r.hgmma} | " + " | ".join(_peer_cell(r, name) for name in PEERS) + " |"
        )
    lines += ["", "Geomean % of roofline per op:", ""]
    for op in sorted({r.op for r in results}):
        lines.append(f"- {op}: {_geomean([r.pct_roofline for r in results if r.op == op and r.correct]):.1f}%")
    for name in PEERS:
        timed = [r for r in results if r.correct and r.peers_status.get(name) == "ok"]
        if timed:
            lines += ["", f"Geomean ours/{name} speed per op (cases where both ran):", ""]
            for op in sorted({r.op for r in timed}):
                ratios = [r.peers_ms[name] / r.ms for r in timed if r.op == op]
                lines.append(f"- {op}: {_geomean(ratios):.2f}x over {len(ratios)} cases")
    return lines


def write_report(results: Sequence[Result], ceilings: dict[str, float], out_dir: Path) -> Path:
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("ATTNREF_COMMIT") or _git_commit()
    gpu = torch.cuda.get_device_name()
    header = (
        f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__} | commit {commit} | "
        f"{time.strftime('%Y-%m-%d')}"
    )
    lines = [
        "# Benchmarks",
        "",
        header,
        "",
        f"Measured ceilings (same run): copy {ceilings['copy_gbps']:.0f} GB/s (read + write), "
        f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s. "
        "Roofline = max(bytes / copy BW, FLOPs / matmul rate).",
        "Times are medians over calls between CUDA events, each after an L2 flush that reads 256 MB (`bench_ms`: "
        "`triton.testing.do_bench` with a reading flush; CUDA-graph replays below 50 us); baselines timed in the "
        "same run.",
        f"Peers ({', '.join(PEERS)}, where installed) run on the same tensors, are checked against the same golden "
        "model first, then timed like baselines; (Nx) = peer ms / our ms, above 1 where ours is faster; "
        "`-`: no peer for the case or not installed.",
        "",
        *table_lines(results),
    ]
    table = out_dir / "bench_h200.md"
    table.write_text("\n".join(lines) + "\n")
    (out_dir / "bench_h200.json").write_text(
        json.dumps({"header": header, "ceilings": ceilings, "results": [asdict(r) for r in results]}, indent=1)
    )
    _plot(results, ceilings, f"Roofline on {gpu}", out_dir / "roofline_h200.png")
    return table


def _run_label(header: str, results: Sequence[Result]) -> str:
    """A run's name in a merged JSON's ``ceilings``: its ops and its commit, e.g. ``mla_verify, decode_attention
    (64a60c0)``."""
    commit = re.search(r"\bcommit (\S+)", header)
    ops = ", ".join(dict.fromkeys(r.op for r in results))
    return f"{ops} ({commit.group(1) if commit else 'unknown commit'})"


def merge_report(run_dir: Path, into_dir: Path) -> tuple[Path, int, int]:
    """Merge the rows of a bench run (``run_dir/bench_h200.json``, e.g. a GPU job's output for a few ops) into the
    table in ``into_dir``: each of the run's ``(op, case)`` replaces the row of the same ``(op, case)`` where it
    stands, or is appended; every other row stays as it was. Everything above the table in ``bench_h200.md`` (its
    header and notes, which say which commit each group of rows comes from) is kept: edit it by hand; the JSON's
    ``header`` becomes the markdown's ``GPU:`` line as it stands (merge again after editing it). Each row keeps
    the percentages its own run measured, so the JSON's ``ceilings`` becomes ``{run: ceilings}`` with the run's
    under :func:`_run_label`, and the geomeans are recomputed over the merged rows. Returns ``(the table, rows
    replaced, rows appended)``; no GPU needed."""
    run = json.loads((run_dir / "bench_h200.json").read_text())
    into = json.loads((into_dir / "bench_h200.json").read_text())
    if "copy_gbps" not in run["ceilings"]:
        raise ValueError(f"run_dir: {run_dir / 'bench_h200.json'} is a merged table, not one bench run")
    new = [Result(**r) for r in run["results"]]
    rows = [Result(**r) for r in into["results"]]
    ceilings = into["ceilings"]
    if "copy_gbps" in ceilings:  # one run's ceilings: name them before adding another's
        ceilings = {_run_label(into["header"], rows): ceilings}
    ceilings[_run_label(run["header"], new)] = run["ceilings"]
    index = {(r.op, r.case): i for i, r in enumerate(rows)}
    replaced = 0
    for r in new:
        if (r.op, r.case) in index:
            rows[index[(r.op, r.case)]] = r
            replaced += 1
        else:
            index[(r.op, r.case)] = len(rows)
            rows.append(r)
    table = into_dir / "bench_h200.md"
    text = table.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith("| op | case |")), len(text))
    table.write_text("\n".join([*text[:start], *table_lines(rows)]) + "\n")
    into["header"] = next((line for line in text[:start] if line.startswith("GPU: ")), into["header"])
    into["ceilings"], into["results"] = ceilings, [asdict(r) for r in rows]
    (into_dir / "bench_h200.json").write_text(json.dumps(into, indent=1))
    gpu = into["header"].split(" | ")[0].removeprefix("GPU: ")
    _plot(rows, run["ceilings"], f"Roofline on {gpu}", into_dir / "roofline_h200.png")
    return table, replaced, len(new) - replaced


def _plot(results: Sequence[Result], ceilings: dict[str, float], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    bw, peak = ceilings["copy_gbps"] * 1e9, ceilings["matmul_tflops"] * 1e12
    xs = [2.0**i for i in range(-4, 12)]
    ax.loglog(xs, [min(peak, bw * x) / 1e12 for x in xs], "k-", lw=1, label="measured roofline")
    for op in sorted({r.op for r in results}):
        pts = [(r.tflops * 1e12 / (r.gbps * 1e9), r.tflops) for r in results if r.op == op and r.correct and r.gbps > 0]
        if pts:
            ax.loglog(*zip(*pts), "o", label=op)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(cases: Sequence[BenchCase], out_dir: Path, baselines: bool) -> int:
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (timings on the interpreter mean nothing)")
        return 2
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    results = run_bench(cases, ceilings, baselines)
    table = write_report(results, ceilings, out_dir)
    print(table.read_text())
    peers_agree = not any(status.startswith("WRONG") for r in results for status in r.peers_status.values())
    return 0 if all(r.correct for r in results) and peers_agree else 1


# -- Peers: FlashInfer ------------------------------------------------------------------------------
# FlashInfer (flashinfer-ai/flashinfer) is a benchmark row, never a dependency: this section is the
# only code of the package that imports it, inside the builders below, when a case is set up. Each
# builder takes the case's tensors and its ``checks(o, lse)`` (the golden comparison it runs on our
# outputs, LSE in natural log) and returns ``{}`` where FlashInfer is not installed, else
# ``{"FlashInfer": build}``; ``build()`` plans FlashInfer (untimed) and returns the :class:`Peer`.
# API of flashinfer-python 0.7 (the canonical ``MLAPlanMetadata`` plan).

FLASHINFER = "FlashInfer"
PEERS = (FLASHINFER,)  # one table column each
LN2 = math.log(2.0)
_WORKSPACE_BYTES = 128 << 20  # FlashInfer's suggested float workspace


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's LSE, ``log2 sum_j 2^(s_j log2 e) = ln(sum_j e^(s_j)) / ln 2``, in natural log (ours)."""
    return lse2 * LN2


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Our natural-log LSE in FlashInfer's base 2 (the inverse of :func:`lse_from_base2`)."""
    return lse / LN2


def flashinfer_peers(build: Callable[[ModuleType], Peer]) -> dict[str, Callable[[], Peer]]:
    """``{"FlashInfer": build(flashinfer)}`` (deferred) where ``import flashinfer`` works; ``{}`` where it
    is not installed. An installed FlashInfer that fails to import shows the error in its cell."""
    try:
        import flashinfer
    except ModuleNotFoundError as err:
        if err.name == "flashinfer":
            return {}
        return {FLASHINFER: _raiser(err)}
    except Exception as err:
        return {FLASHINFER: _raiser(err)}
    return {FLASHINFER: lambda: build(flashinfer)}


def _raiser(err: Exception) -> Callable[[], Peer]:
    def build() -> Peer:
        raise RuntimeError(f"import flashinfer failed: {_one_line(err)}") from err

    return build


def _csr_pages(table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_indptr [B + 1], kv_indices [sum of pages])`` int32: request ``b``'s pages, in order,
    are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (a block table in CSR form)."""
    pages = (seq_lens.long() + page_size - 1) // page_size
    used = torch.arange(table.shape[1], device=table.device) < pages[:, None]
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = pages.cumsum(0)
    return indptr, table[used].to(torch.int32)  # boolean indexing is row-major: request order kept


def flashinfer_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    qlen: int,
    value_width: int,
    sm_scale: float,
    page_size: int,
    k_scale: torch.Tensor | None,
    checks: Callable[[torch.Tensor, torch.Tensor], Sequence[Check]],
) -> dict[str, Callable[[], Peer]]:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backend fa3) on an MLA decode (``qlen`` 1) or
    causal verify case: rows ``b*Q + t`` of ``q [R, H, Lk]``, latent cache ``[pages, page, 1, Lk]``
    read in place (its first ``Lv`` columns as ckv, the rest as the rope part), block table
    ``[B, pages]``, lengths ``[B]``. Its causal mask is bottom-right aligned, the same row limits as
    ours. An FP8 cache passes ``k_scale`` as both per-tensor scales."""

    def build(fi: ModuleType) -> Peer:
        rows, heads, key_width = q.shape
        kv_indptr, kv_indices = _csr_pages(table, seq_lens, page_size)
        qo_indptr = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=q.device) * qlen
        fp8 = cache.dtype == torch.float8_e4m3fn
        wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device), backend="fa3"
        )
        wrapper.plan(
            metadata=fi.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, seq_lens.to(torch.int32)),
            num_heads=heads, head_dim_ckv=value_width, head_dim_kpe=key_width - value_width,
            page_size=page_size, causal=qlen > 1, sm_scale=sm_scale, q_data_type=q.dtype,
            kv_data_type=cache.dtype, query_layout="split", kv_cache_layout="split", lse_mode="base2",
            scale_mode="kv-per-tensor" if fp8 else "default",
        )  # fmt: skip
        query = (q[..., :value_width].contiguous(), q[..., value_width:].contiguous())
        latent = cache[:, :, 0]
        kv_cache = (latent[..., :value_width], latent[..., value_width:])
        scales = {"ckv_scale": float(k_scale), "kpe_scale": float(k_scale)} if fp8 else {}
        out = torch.empty(rows, heads, value_width, dtype=q.dtype, device=q.device)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device)

        def run() -> None:
            wrapper.run(query=query, kv_cache=kv_cache, out=out, lse=lse, return_lse=True, **scales)

        return Peer(run, lambda: checks(out, lse_from_base2(lse)))

    return flashinfer_peers(build)


def flashinfer_gqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    checks: Callable[[torch.Tensor, torch.Tensor], Sequence[Check]],
) -> dict[str, Callable[[], Peer]]:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, CUDA-core decode, as vLLM runs group
    size 4) on a GQA decode case: ``q [B, H, D]``, caches ``[pages, page, HKV, D]`` read in place
    (views of one interleaved cache are fine), block table ``[B, pages]``, lengths ``[B]`` (>= 1)."""

    def build(fi: ModuleType) -> Peer:
        batch, heads, head_dim = q.shape
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        kv_indptr, kv_indices = _csr_pages(table, seq_lens, page_size)
        last_page_len = ((seq_lens.long() - 1) % page_size + 1).to(torch.int32)
        wrapper = fi.decode.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device), "NHD", use_tensor_cores=False
        )
        wrapper.plan(kv_indptr, kv_indices, last_page_len, heads, kv_heads, head_dim, page_size,
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=sm_scale)  # fmt: skip
        out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)

        def run() -> None:
            wrapper.run(q, (k_cache, v_cache), out=out, lse=lse, return_lse=True)

        return Peer(run, lambda: checks(out, lse_from_base2(lse)))

    return flashinfer_peers(build)


def flashinfer_merge_state(
    prefix_o: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_o: torch.Tensor,
    suffix_lse: torch.Tensor,
    *,
    checks: Callable[[torch.Tensor, torch.Tensor], Sequence[Check]],
) -> dict[str, Callable[[], Peer]]:
    """FlashInfer's ``merge_state`` on a two-state merge case: outputs ``[T, H, D]`` and our
    natural-log LSEs ``[H, T]``, handed to it as base-2 ``[T, H]`` (converted once, untimed: a
    FlashInfer pipeline produces them so). ``checks`` gets ``(o [T, H, D], lse [H, T])``."""

    def build(fi: ModuleType) -> Peer:
        prefix_lse2 = lse_to_base2(prefix_lse).t().contiguous()
        suffix_lse2 = lse_to_base2(suffix_lse).t().contiguous()
        merged: dict[str, torch.Tensor] = {}

        def run() -> None:
            merged["o"], merged["lse"] = fi.merge_state(prefix_o, prefix_lse2, suffix_o, suffix_lse2)

        return Peer(run, lambda: checks(merged["o"], lse_from_base2(merged["lse"]).t()))

    return flashinfer_peers(build)
