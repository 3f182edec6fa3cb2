"""Benchmarks on a GPU: correctness first, then time against the measured roofline (``attnref bench``).

Each op may define ``bench_cases() -> list[BenchCase]`` in ``triton_impl/parity/<op>.py`` beside
its parity cases (``triton_impl.parity.registered_bench_cases`` collects them; this runner imports
nothing from the parity package, which sits above it). A case builds its inputs once and returns a
:class:`Bench`: the kernel launch, a check against golden (run before any timing: a wrong kernel
is never timed), the bytes and FLOPs it must move and do (from the op's ``Traffic:`` docstring
line), and baselines timed in the same run. Ceilings are measured in the same run:
device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul on random data.
Content checks (host reads of block tables) run for the correctness check and are off while
timing, as in serving (``ATTNREF_CHECK_CONTENTS=0``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from triton_impl.cases import Check, compare_check
from triton_impl.cases import device_paged_cache as device_paged_cache  # re-export for parity/turboquant.py
from triton_impl.validation import CONTENT_CHECKS_ENV


@dataclass
class Bench:
    run: Callable[[], object]
    check: Callable[[], Sequence[Check]]
    bytes: float
    flops: float
    baselines: dict[str, Callable[[], object]] = field(default_factory=dict)
    kernels: Sequence[str] = ()  # Triton kernel names whose SASS should show HGMMA


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


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s), measured now."""
    import triton.testing

    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    src = dst = None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_gbps": 2 * n / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


def _time(fn: Callable[[], object]) -> float:
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    if ms < 0.05:  # launch-bound: replay a CUDA graph to drop the launch gaps
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return ms


def eager_and_graph_us(run: Callable[[], object], iters: int = 200, repeats: int = 5) -> tuple[float, float]:
    """``(eager, graph)``: microseconds per call of ``run`` back to back, called from Python and
    replayed from one CUDA graph capture; each the median of ``repeats`` loops of ``iters`` calls.

    Eager minus graph is the host time per call that the GPU does not hide (argument checks,
    config look-ups, the launches themselves). ``run`` must be capturable (no host sync).
    """
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def per_call(step: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / iters * 1e6)
        return sorted(times)[repeats // 2]

    return per_call(run), per_call(graph.replay)


def _cuobjdump() -> str:
    """The cuobjdump in the Triton wheel (it ships one beside ptxas), else the one on PATH."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else "cuobjdump"


def sass_mma_counts(cubin: bytes) -> tuple[int, int]:
    """``(HGMMA, HMMA)``: Hopper warpgroup MMAs and warp-level MMAs in a cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [_cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True, timeout=120, check=True
        ).stdout
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
            detail = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:160]
            results.append(Result(case.op, case.name, math.nan, 0, 0, "-", 0, 0, {}, "-", False, detail))
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
            ms = _time(bench.run)
            base_ms = {}
            for name, fn in bench.baselines.items() if baselines else ():
                try:
                    fn()
                    base_ms[name] = _time(fn)
                except torch.cuda.OutOfMemoryError:
                    base_ms[name] = math.nan
                    torch.cuda.empty_cache()
        finally:
            os.environ.pop(CONTENT_CHECKS_ENV)
        t_bytes, t_flops = bench.bytes / peak_bw * 1e3, bench.flops / peak_flops * 1e3
        roofline_ms = max(t_bytes, t_flops)
        results.append(
            Result(
                case.op, case.name, ms, bench.bytes / ms / 1e6, bench.flops / ms / 1e9,
                "memory" if t_bytes >= t_flops else "compute", roofline_ms, 100 * roofline_ms / ms, base_ms,
                _sass_report(launched, bench.kernels), True,
            )
        )  # fmt: skip
        del bench
        torch.cuda.empty_cache()
    return results


def _geomean(values: Sequence[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def write_report(results: Sequence[Result], ceilings: dict[str, float], out_dir: Path) -> Path:
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("ATTNREF_COMMIT") or _git_commit()
    header = (
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"commit {commit} | {time.strftime('%Y-%m-%d')}"
    )
    lines = [
        "# Benchmarks",
        "",
        header,
        "",
        f"Measured ceilings (same run): copy {ceilings['copy_gbps']:.0f} GB/s (read + write), "
        f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s. "
        "Roofline = max(bytes / copy BW, FLOPs / matmul rate).",
        "Times are medians of `triton.testing.do_bench` (CUDA graphs below 50 us); baselines timed in the same run.",
        "",
        "| op | case | ms | GB/s | TFLOP/s | bound | roofline ms | % of roofline | baselines (ms) | SASS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if not r.correct:
            lines.append(f"| {r.op} | {r.case} | WRONG: not timed | | | | | | | {r.detail} |")
            continue
        base = ", ".join(f"{k} {v:.3f} ({v / r.ms:.1f}x)" for k, v in r.baselines_ms.items()) or "-"
        lines.append(
            f"| {r.op} | {r.case} | {r.ms:.4f} | {r.gbps:.0f} | {r.tflops:.1f} | {r.bound} | {r.roofline_ms:.4f} | "
            f"{r.pct_roofline:.1f}% | {base} | {r.hgmma} |"
        )
    lines += ["", "Geomean % of roofline per op:", ""]
    for op in sorted({r.op for r in results}):
        lines.append(f"- {op}: {_geomean([r.pct_roofline for r in results if r.op == op and r.correct]):.1f}%")
    table = out_dir / "bench_h200.md"
    table.write_text("\n".join(lines) + "\n")
    (out_dir / "bench_h200.json").write_text(
        json.dumps({"header": header, "ceilings": ceilings, "results": [asdict(r) for r in results]}, indent=1)
    )
    _plot(results, ceilings, out_dir / "roofline_h200.png")
    return table


def _plot(results: Sequence[Result], ceilings: dict[str, float], path: Path) -> None:
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
    ax.set_title(f"Roofline on {torch.cuda.get_device_name()}")
    fig.savefig(path, dpi=120, bbox_inches="tight")


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
    return 0 if all(r.correct for r in results) else 1
