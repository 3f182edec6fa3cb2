"""Where a kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

Nsight Compute samples each warp's program counter and why it did not issue (its stall reason). Its source page,
exported as CSV, gives the samples of every SASS instruction by reason. This script sums them: by reason over the
whole kernel and over its hottest loop (the innermost loop holding an MMA, ``HMMA`` or ``HGMMA``), by opcode, and the
instructions with the most samples. On the GPU machine, after ``benchmarks/profile_ncu.py`` has written a report
(``ncu ... --section SourceCounters -o report python3 benchmarks/profile_ncu.py <case>``)::

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    PYTHONPATH=. python3 benchmarks/ncu_stalls.py source.csv [more.csv ...]

A sample is one warp at one cycle; ``selected`` is a warp issuing. Samples per instruction over the loop's sum is
the share of the loop's warp time that instruction's wait took.
"""

from __future__ import annotations

import collections
import csv
import sys

from triton_impl.bench import SASS_BRANCH, innermost_loop


def load(path: str) -> tuple[str, list[dict[str, str]]]:
    """``(kernel name, rows)`` of one source-page CSV (the first kernel in it)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    kernel = lines[0][1]
    header = lines[1]
    rows = []
    for line in lines[2:]:
        if len(line) < len(header) or not line[0].startswith("0x"):
            break  # a second kernel's block starts
        rows.append(dict(zip(header, line)))
    return kernel, rows


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def hottest_loop(rows: list[dict[str, str]]) -> tuple[int, int]:
    """Row indices ``(head, tail)`` of the innermost backward branch's range that holds an MMA
    (``triton_impl.bench.innermost_loop`` on the rows, each row's index its address); with no MMA in a loop, the
    loop with the most samples an instruction (the Hadamard store's butterflies: of its two copies of the tile loop
    the one that ran, and of nested loops the hot inner one); with no loop, the whole kernel."""
    index = {int(r["Address"], 16): i for i, r in enumerate(rows)}
    code = [(i, opcode(r["Source"]), "", r["Source"]) for i, r in enumerate(rows)]
    loops = [(index[target], i) for i, r in enumerate(rows)
             if (b := SASS_BRANCH.search(r["Source"])) and index.get(target := int(b.group(1), 16), i) < i]  # fmt: skip
    found = innermost_loop(code, loops, ("HMMA", "HGMMA"))
    if found is None and loops:
        density = lambda loop: sum(reasons(rows[loop[0] : loop[1] + 1]).values()) / (loop[1] - loop[0] + 1)
        found = max(loops, key=density)
    return found or (0, len(rows) - 1)


def reasons(rows: list[dict[str, str]]) -> collections.Counter:
    total = collections.Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("stall_") and "(Not Issued)" not in key and value not in ("", "-"):
                total[key[len("stall_"):]] += int(value)
    return total


def summarize(path: str, top: int = 25) -> None:
    kernel, rows = load(path)
    head, tail = hottest_loop(rows)
    loop = rows[head : tail + 1]
    every, looped = reasons(rows), reasons(loop)
    executed = sum(int(r["Instructions Executed"] or 0) for r in loop)
    print(f"## {kernel} ({path})\n")
    print(f"loop: {len(loop)} instructions (rows {head}-{tail}), {sum(looped.values())} of "
          f"{sum(every.values())} samples; warp instructions executed in it: {executed}\n")  # fmt: skip
    print("| stall reason | kernel samples | share | loop samples | share |\n| --- | --- | --- | --- | --- |")
    for reason, n in every.most_common():
        print(f"| {reason} | {n} | {n / sum(every.values()):.1%} | {looped[reason]} | "
              f"{looped[reason] / max(1, sum(looped.values())):.1%} |")  # fmt: skip
    by_op = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for r in loop:
        entry = by_op[opcode(r["Source"])]
        entry[0] += 1
        entry[1] += int(r["Warp Stall Sampling (All Samples)"] or 0)
        entry[2] += reasons([r])
    print("\n| opcode (loop) | instructions | samples | share | top reasons |\n| --- | --- | --- | --- | --- |")
    for op, (count, samples, why) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        tops = ", ".join(f"{k} {v}" for k, v in why.most_common(3))
        print(f"| {op} | {count} | {samples} | {samples / max(1, sum(looped.values())):.1%} | {tops} |")
    print("\n| row | instruction (loop) | samples | top reasons |\n| --- | --- | --- | --- |")
    hot = sorted(range(head, tail + 1), key=lambda i: -int(rows[i]["Warp Stall Sampling (All Samples)"] or 0))
    for i in sorted(hot[:top]):
        r = rows[i]
        tops = ", ".join(f"{k} {v}" for k, v in reasons([r]).most_common(3))
        print(f"| {i} | `{r['Source'].strip()[:70]}` | {r['Warp Stall Sampling (All Samples)']} | {tops} |")
    print()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
