"""The DRAM bytes a bench case's call reads, kernel by kernel, against the bytes its roofline counts (GPU machine).

``PYTHONPATH=. python3 benchmarks/dram_bytes.py "op:name part" ...`` (specs as ``benchmarks/kernel_times.py`` takes
them). Each matching case's call runs once under Nsight Compute (``benchmarks/profile_ncu.py`` under ``ncu
--metrics``, content checks off, the call's kernels only), which counts the bytes each kernel read from and wrote to
DRAM. The bench's roofline assumes a call reads each byte it needs once; a line that two programs read (a KV head's
slot and the next one's sharing a 128-byte line) and that leaves L2 between their reads is read twice. A row: the
case, its roofline megabytes, each kernel's DRAM megabytes read (and its microseconds under the profiler), and the
call's DRAM reads over the roofline bytes. On an H100 at L=32K, Nsight's DRAM throughput times stage 1's duration
came to 1.02x the roofline bytes for 4bit_nc, 1.01x for 3bit_nc and 1.65x for k3v4 (``notebooks/results/perf_log.md``,
fiftieth session).
"""

from __future__ import annotations

import contextlib
import csv
import os
import subprocess
import sys

import torch

from benchmarks.kernel_times import matching
from triton_impl.validation import CONTENT_CHECKS_ENV

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def kernel_rows(report: str) -> list[tuple[str, dict[str, float]]]:
    """``(kernel name, {metric: value})`` for each kernel of ``ncu --csv --print-units base`` output, in launch
    order (the lines that are not CSV rows, the profiled program's own output among them, are skipped, and so are
    rows without a number)."""
    lines = [line for line in report.splitlines() if line.startswith('"')]
    kernels: dict[int, tuple[str, dict[str, float]]] = {}
    for row in csv.DictReader(lines):
        _, metrics = kernels.setdefault(int(row["ID"]), (row["Kernel Name"], {}))
        with contextlib.suppress(ValueError):  # a section's rule rows have no value, and some metrics "no data"
            metrics[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return list(kernels.values())


def profile(spec: str) -> list[tuple[str, dict[str, float]]]:
    """The kernels of one call of the case ``spec`` names, under ``ncu``."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_ncu.py")
    command = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--print-units", "base", "--csv",
               "--metrics", ",".join(METRICS), sys.executable, script, spec]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ncu on {spec!r} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return kernel_rows(done.stdout)


def main(specs: list[str]) -> None:
    os.environ[CONTENT_CHECKS_ENV] = "0"
    print("| op | case | roofline MB | kernels: DRAM MB read (us under ncu) | DRAM MB written | read / roofline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for spec in specs:
        for case in matching(spec):
            bench = case.setup(torch.device("cuda"))
            roofline_mb = bench.bytes / 1e6
            del bench
            torch.cuda.empty_cache()
            kernels = profile(f"{case.op}:{case.name}")
            read_mb = sum(m["dram__bytes_read.sum"] for _, m in kernels) / 1e6
            written_mb = sum(m["dram__bytes_write.sum"] for _, m in kernels) / 1e6
            parts = ", ".join(f"{name} {m['dram__bytes_read.sum'] / 1e6:.1f} ({m['gpu__time_duration.sum'] / 1e3:.1f})"
                              for name, m in kernels)  # fmt: skip
            print(f"| {case.op} | {case.name} | {roofline_mb:.1f} | {parts} | {written_mb:.1f} | "
                  f"{read_mb / roofline_mb:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
