"""The serving path on a GPU: content-check cost, host overhead per call, and no host sync.

Run from the repository root on the GPU machine (``bash .ci/gpu_job serving`` does):
``PYTHONPATH=. python3 benchmarks/serving.py [out.md]`` (default
``notebooks/results/serving_h200.md``). For each case it

1. calls the op once under ``torch.cuda.set_sync_debug_mode("error")`` with the default content
   checks (off on CUDA): any device-to-host read raises;
2. times eager calls with ``triton.testing.do_bench`` (median), once with the content checks on
   (``ATTNREF_CHECK_CONTENTS=1``, a host sync per call) and once with the default;
3. times back-to-back eager calls and CUDA-graph replays of the same call
   (``triton_impl.bench.eager_and_graph_us``): eager minus graph is the host time per call that
   the GPU does not hide, to be compared with the 25 us budget;
4. times the host alone (:func:`host_us`: calls timed without waiting for the GPU), which tells a
   host-bound eager call from one the GPU runs slower eagerly than from a graph;
5. prints a ``cProfile`` of the eager wrapper of the first case of each op to standard output.

``benchmarks/host_overhead_cpu.py`` times the same calls' Python on a CPU, launches stubbed.

Shapes: DeepSeek MLA (Lk 576 = 512 + 64, bf16, page 64, ``sm_scale = 192^-0.5``), GQA 32/8
heads at D 128 (page 16), TurboQuant 4-bit at the GQA shape (block 16), and the two-state merge.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

from golden import turboquant as tq
from triton_impl import decode_attention as dec
from triton_impl import lse_merge, mla_verify, turboquant
from triton_impl.bench import eager_and_graph_us, us_per_call
from triton_impl.cases import block_table_for, device_paged_cache
from triton_impl.validation import CONTENT_CHECKS_ENV

BUDGET_US = 25.0
SM_SCALE = 192**-0.5
# (name, kind, batch, query heads, kv heads, key width, value width, length, page, qlen)
CASES = [
    ("MLA decode B=8 H=16 L=4K", "decode", 8, 16, 1, 576, 512, 4096, 64, 1),
    ("MLA decode B=8 H=128 L=4K", "decode", 8, 128, 1, 576, 512, 4096, 64, 1),
    ("MLA decode B=1 H=128 L=32K", "decode", 1, 128, 1, 576, 512, 32768, 64, 1),
    ("MLA decode B=32 H=16 L=32K", "decode", 32, 16, 1, 576, 512, 32768, 64, 1),
    ("MLA decode B=8 H=128 L=8K", "decode", 8, 128, 1, 576, 512, 8192, 64, 1),
    ("MLA verify B=8 H=16 Q=4 L=4K", "verify", 8, 16, 1, 576, 512, 4096, 64, 4),
    ("MLA verify B=8 H=128 Q=4 L=4K", "verify", 8, 128, 1, 576, 512, 4096, 64, 4),
    ("GQA decode B=8 32/8 D=128 L=4K", "decode", 8, 32, 8, 128, 128, 4096, 16, 1),
    ("TurboQuant 4bit decode B=8 32/8 D=128 L=4K", "turboquant", 8, 32, 8, 128, 128, 4096, 16, 1),
    ("merge_attn_states T=512 H=32 D=128", "merge", 512, 32, 32, 128, 128, 0, 1, 1),
]


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def build(kind: str, batch: int, heads: int, kv_heads: int, key_width: int, value_width: int, length: int,
          page: int, qlen: int, *, device: torch.device | None = None, sm_count: int | None = None,
          cache_length: int | None = None) -> Callable[[], object]:  # fmt: skip
    """One serving call with all its tensors made here (fixed addresses), as a closure.

    Defaults: the first CUDA device and its SM count, a cache holding ``length`` keys per request.
    ``benchmarks/host_overhead_cpu.py`` builds the same calls on the CPU with ``cache_length``
    keys per request (the split count and every shape but the cache's still follow ``length``).
    """
    device = torch.device("cuda") if device is None else device
    sm_count = _sm_count() if sm_count is None else sm_count
    cached = length if cache_length is None else cache_length
    if kind == "merge":
        outs = [torch.randn(batch, heads, key_width, device=device, dtype=torch.bfloat16) for _ in range(3)]
        lses = [torch.randn(heads, batch, device=device) for _ in range(3)]
        return lambda: lse_merge.merge_attn_states(outs[0], outs[1], lses[0], outs[2], lses[1], lses[2])
    if kind == "turboquant":
        config = tq.TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", key_width)
        centroids, _ = tq.solve_lloyd_max(key_width, config.centroid_bits)
        table, num_blocks = block_table_for([cached] * batch, page, device=device)
        cache = torch.randint(0, 256, (num_blocks, page, kv_heads, config.slot_size_aligned), dtype=torch.uint8,
                              device=device)  # fmt: skip
        query = torch.randn(batch, heads, key_width, device=device, dtype=torch.float16)
        lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        pit, cents = tq.hadamard_rotation(key_width).T.contiguous().to(device), centroids.to(device)
        splits = 32
        bufs = {"mid_o_buf": torch.empty(batch, heads, splits, key_width + 1, device=device),
                "output_buf": torch.empty(batch, heads, key_width, dtype=torch.float16, device=device),
                "lse_buf": torch.empty(batch, heads, device=device)}  # fmt: skip
        return lambda: turboquant.triton_turboquant_decode_attention_v2(
            query, cache, table, lens, None, cents, key_width**-0.5, config.key_mse_bits, config.key_packed_size,
            config.value_quant_bits, config.value_packed_size, PiT=pit, max_num_kv_splits=splits, **bufs,
        )  # fmt: skip
    cache, table = device_paged_cache([cached] * batch, page, kv_heads, key_width, torch.bfloat16, device)
    rows = batch * qlen
    q = torch.randn(rows, heads, key_width, device=device, dtype=torch.bfloat16)
    o = torch.empty(rows, heads, value_width, device=device, dtype=torch.bfloat16)
    lse = torch.empty(rows, heads, device=device)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    is_mla = kv_heads == 1
    v = cache[..., :value_width] if is_mla else torch.randn_like(cache[..., :value_width])
    if kind == "verify":
        block_h = mla_verify.select_verify_config(batch, qlen, heads)["BLOCK_H"]
        splits = mla_verify.verify_num_kv_splits(length, batch, qlen, heads, sm_count, block_h=block_h)
        logits = torch.empty(rows, heads, splits, value_width + 1, device=device)
        return lambda: mla_verify.decode_attention_fwd_verify(
            q, cache, v, o, lse, table, lens, None, qlen, logits, splits, SM_SCALE, page
        )
    splits = dec._compute_num_kv_splits(length, sm_count)
    logits = torch.empty(rows, heads, splits, value_width + 1, device=device)
    return lambda: dec.decode_attention_fwd(
        q, cache, v, o, lse, table, lens, logits, splits, SM_SCALE, page, is_mla=is_mla
    )


def host_us(run: Callable[[], object], calls: int = 100, repeats: int = 5) -> float:
    """Host microseconds per call: ``calls`` calls timed from the first to the return of the last,
    without waiting for the GPU; the median of ``repeats`` such loops, each started on an idle GPU.
    The host waits on the GPU only if CUDA's queue of pending launches fills (a few hundred
    launches here; a full queue would show as host time close to the eager time)."""
    return us_per_call(run, calls, repeats, wait_for_gpu=False)


def _no_sync(run: Callable[[], object]) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
        return "none"
    except RuntimeError as err:
        return f"SYNC: {err}".replace("|", "/")[:80]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _do_bench_ms(run: Callable[[], object], checks: str | None) -> float:
    if checks is None:
        os.environ.pop(CONTENT_CHECKS_ENV, None)
    else:
        os.environ[CONTENT_CHECKS_ENV] = checks
    try:
        return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    finally:
        os.environ.pop(CONTENT_CHECKS_ENV, None)


def _profile(name: str, run: Callable[[], object]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    print(f"--- cProfile, 300 eager calls: {name}\n{text.getvalue()}")


def main(out: Path) -> int:
    os.environ.pop(CONTENT_CHECKS_ENV, None)  # the default: off on CUDA
    commit = os.environ.get("ATTNREF_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip() or "unknown"  # fmt: skip
    lines = [
        "# Serving path on the GPU: content checks, host overhead, host syncs",
        "",
        f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"commit {commit}.",
        "Made by `PYTHONPATH=. python3 benchmarks/serving.py` (`bash .ci/gpu_job serving`); the method is in the",
        "script's docstring. do_bench columns: median ms of eager calls. Eager/graph: us per call back to back.",
        "Host only: us per call of the host alone (calls not waiting for the GPU).",
        "",
        "| case | checks on (do_bench ms) | default (do_bench ms) | eager us | graph us | host overhead us | "
        f"<= {BUDGET_US:.0f} us | host only us | host sync |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    profiled: set[str] = set()
    failures = 0
    for name, kind, *shape in CASES:
        run = build(kind, *shape)
        run()
        sync = _no_sync(run)
        on = _do_bench_ms(run, "1")
        default = _do_bench_ms(run, None)
        eager, graph = eager_and_graph_us(run)
        overhead = eager - graph
        ok = overhead <= BUDGET_US
        failures += (not ok) + (sync != "none")
        lines.append(f"| {name} | {on:.3f} | {default:.3f} | {eager:.1f} | {graph:.1f} | {overhead:.1f} | "
                     f"{'yes' if ok else 'no'} | {host_us(run):.1f} | {sync} |")  # fmt: skip
        print(lines[-1], flush=True)
        if kind not in profiled:
            profiled.add(kind)
            _profile(name, run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}; {failures} case(s) over budget or syncing")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("notebooks/results/serving_h200.md")))
