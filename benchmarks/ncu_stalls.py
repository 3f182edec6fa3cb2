"""Where a kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

Nsight Compute samples each warp's program counter and why it did not issue (its stall reason). Its source page,
exported as CSV, gives the samples of every SASS instruction by reason. This script sums them: by reason over the
whole kernel and over its hottest loop (the innermost loop holding an MMA, ``HMMA`` or ``HGMMA``), by opcode, and the
instructions with the most samples. On the GPU machine, after ``benchmarks/profile_ncu.py`` has written a report
(``ncu ... --section SourceCounters -o report python3 benchmarks/profile_ncu.py <case>``)::

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    PYTHONPATH=. python3 benchmarks/ncu_stalls.py source.csv [more.csv ...]

A sample is one warp at one cycle; ``selected`` is a warp issuing. Samples per instruction over the loop's sum is
the share of the loop's warp time that instruction's wait took. For the hottest instructions that wait on the long
scoreboard (a global or local memory result), the table names the load that last wrote one of their source registers,
walking back through the loop (past its head to its tail: a load of the iteration before) and how many instructions
before it sits: a load too close to its use is one the compiler moved there.
"""

from __future__ import annotations

import collections
import csv
import re
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


_REGISTER = re.compile(r"\bR(\d+)\b")
_LOADS = ("LDG", "LDL", "LD", "ATOMG", "ATOM")  # results the long scoreboard tracks (shared memory's: the short one)


def _operands(source: str) -> list[str]:
    """An instruction's operands, its predicate and opcode left out."""
    text = source.strip().rstrip(";")
    skip = 2 if text.startswith("@") else 1  # the predicate, the opcode
    words = text.split(None, skip)
    return [x.strip() for x in words[-1].split(",")] if len(words) > skip else []


def _width(source: str) -> int:
    """The 32-bit registers a load writes (its ``.64``/``.128`` suffix)."""
    return 4 if ".128" in source else 2 if ".64" in source else 1


def writes(source: str) -> set[int]:
    """The registers an instruction writes: its first operand (a load's ``.64``/``.128`` result its 2 or 4); stores
    write none."""
    ops = _operands(source)
    if not ops or opcode(source).startswith("ST") or not (m := _REGISTER.fullmatch(ops[0].split(".")[0])):
        return set()
    first = int(m.group(1))
    return set(range(first, first + (_width(source) if opcode(source) in _LOADS else 1)))


def reads(source: str) -> set[int]:
    """The registers an instruction reads: every operand after the first (a store's all of them; an address
    ``[R4.64]`` its pair)."""
    ops = _operands(source)
    taken = ops if opcode(source).startswith("ST") else ops[1:]
    regs = set()
    for op in taken:
        for m in _REGISTER.finditer(op):
            regs |= {int(m.group(1)), int(m.group(1)) + 1} if ".64" in op else {int(m.group(1))}
    return regs


def waited_load(rows: list[dict[str, str]], i: int, head: int, tail: int) -> tuple[int, int] | None:
    """``(row, instructions before)`` of the load row ``i`` waits on: of the last writers of its source registers,
    found walking back from ``i`` through the loop ``head .. tail`` (past the head to the tail), the nearest that is
    a load; ``None`` if none is."""
    span = tail - head + 1
    found = []
    for register in reads(rows[i]["Source"]):
        for back in range(1, span):
            j = head + (i - head - back) % span
            if register in writes(rows[j]["Source"]):
                if opcode(rows[j]["Source"]) in _LOADS:
                    found.append((back, j))
                break
    return (min(found)[1], min(found)[0]) if found else None


def load_leads(loop: list[str]) -> list[tuple[int, int]]:
    """``(index, lead)`` of each global load in a loop's SASS (its instructions in order, the back edge last): the
    instructions from the load to the first that reads a register it writes, walking past the loop's tail to its
    head, without a profile: how far ahead of its use the compiler put it (a load whose result no instruction reads
    is left out)."""
    leads = []
    for i, source in enumerate(loop):
        if opcode(source) == "LDG":
            written = writes(source)
            lead = next((d for d in range(1, len(loop) + 1) if reads(loop[(i + d) % len(loop)]) & written), None)
            if lead is not None:
                leads.append((i, lead))
    return leads


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
    print("\n| row | instruction (loop) | samples | top reasons | waits on |\n| --- | --- | --- | --- | --- |")
    hot = sorted(range(head, tail + 1), key=lambda i: -int(rows[i]["Warp Stall Sampling (All Samples)"] or 0))
    for i in sorted(hot[:top]):
        r = rows[i]
        why = reasons([r])
        tops = ", ".join(f"{k} {v}" for k, v in why.most_common(3))
        waited = waited_load(rows, i, head, tail) if why and why.most_common(1)[0][0] == "long_sb" else None
        source = f"row {waited[0]} `{opcode(rows[waited[0]]['Source'])}`, {waited[1]} before" if waited else ""
        print(f"| {i} | `{r['Source'].strip()[:70]}` | {r['Warp Stall Sampling (All Samples)']} | {tops} | {source} |")
    print()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
