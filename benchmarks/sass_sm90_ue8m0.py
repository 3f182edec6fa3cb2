"""Registers, stack and SASS instructions per value of the UE8M0 K-cache kernels, compiled for sm_90 on a CPU.

No GPU needed: the insert and gather kernels are compiled by Triton for ``GPUTarget("cuda", 90, 32)``
with the sm90 launch config (or the variants named below), specialized as ``attnref bench`` launches
them (1M tokens, block 64, padded block stride 37440, int64 slots, int32 block table: every pointer
16-byte aligned and every integer argument a multiple of 16), and ``cuobjdump`` (from the Triton
wheel) reports registers and stack per thread. Counted SASS (see ``_path``): what one thread issues on
the common path (live tokens, finite groups), per insert program (no loop: ``TOKENS`` tokens) or per
gather loop iteration (``TOKENS`` tokens), next to the static count of the whole kernel. Divided by the
values one thread handles (``TOKENS * 512 / (32 * num_warps)`` bf16 values in or out) it is
instructions per value, and times ``num_warps / TOKENS`` it is warp instructions per token, printed
with the time that many would take at the H200's full issue rate (a floor, not a prediction) next to
the copy time of the bench's bytes. Run::

    TRITON_INTERPRET=0 PYTHONPATH=. /tmp/t36/bin/python benchmarks/sass_sm90_ue8m0.py [variant ...]

with Triton 3.6 (the H200's; the repository's venv has 3.9)::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy einops

Each line also gives shared memory, the 4-warp blocks that fit an SM (registers and shared memory), and
per token the global loads and stores on that path (warp instructions, and the bytes their lanes move if every
lane is on; each opcode with its width: ``LDG.E.128``, ``STG.E.U8``, ``LDGSTS`` for cp.async, ``LDL`` / ``STL``
for spills).

A variant is ``name=value,...`` over the sm90 entry's ``LaunchConfig`` fields (``decode=int,rope_words=0``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before triton_impl decorates its kernels: compile, don't interpret

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from triton_impl import ue8m0_cache as ue8m0
from triton_impl.bench import SASS_BRANCH, SASS_INSTRUCTION, cuobjdump
from triton_impl.launch import register_cap

TARGET = GPUTarget("cuda", 90, 32)
BLOCK_SIZE = 64
INSERT_POINTERS = {"k_ptr": "*i16", "slot_mapping_ptr": "*i64", "cache_ptr": "*u8"}
GATHER_POINTERS = {"out_ptr": "*i16", "cache_ptr": "*u8", "seq_lens_ptr": "*i32", "gather_lens_ptr": "*i32",
                   "block_table_ptr": "*i32", "table_ptr": "*u8"}  # fmt: skip
MEMORY = ("LDG", "STG", "LDS", "STS", "LDL", "STL")  # LDL / STL: spills
# Bytes one thread moves per global access, by the width modifier (none: 32 bits).
WIDTH_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
# sm_90: 64K registers (allocated per warp in units of 256) and 228 KB of shared memory (1 KB of it
# reserved per block) per SM, at most 32 blocks and 64 warps.
SM_REGISTERS, SM_SHARED, SM_BLOCKS, SM_WARPS = 65536, 228 * 1024, 32, 64
# H200 SXM: 132 SMs x 4 schedulers issuing one warp instruction per clock at up to 1.98 GHz.
WARP_ISSUE_PER_S = 132 * 4 * 1.98e9
COPY_BYTES_PER_S = 4.221e12
TOKENS_TIMED = 1 << 20
BYTES_PER_TOKEN = 584 + 1024


def _compile(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, max_registers: int = 0):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    values = {(names.index(n),): v for n, v in constexprs.items()}
    # Every pointer 16-byte aligned and every integer argument a multiple of 16, as in the bench.
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in constexprs}
    return triton_compile(ASTSource(fn, signature, values, aligned), target=TARGET,
                          options={"enable_fp_fusion": True, "num_warps": num_warps,
                                   **register_cap(max_registers)})  # fmt: skip


def _resources(cubin: bytes) -> tuple[int, int]:
    line = [x for x in cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in x][-1]
    return int(re.search(r"REG:(\d+)", line).group(1)), int(re.search(r"STACK:(\d+)", line).group(1))


def _code(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, line); global and shared memory opcodes keep their modifiers (``LDG.E.128``)."""
    return [(int(m.group(1), 16), m.group(2) + m.group(3) * m.group(2).startswith(MEMORY), line)
            for line in cuobjdump(cubin, "-sass").splitlines() if (m := SASS_INSTRUCTION.match(line))]  # fmt: skip


def _path(code: list[tuple[int, str, str]], loop: bool) -> list[str]:
    """Opcodes issued on the common path: every conditional branch falls through, unconditional
    ones are followed, predicated instructions (EXIT too) count as issued. Each kernel's
    conditional branches skip work that a live token with finite groups does: ptxas turns a masked
    store into a branch around the code that only feeds it, and the insert jumps to its exact
    encoder only for a tile with a non-finite group.
    ``loop``: one iteration of the widest loop (its head to its backward branch); else from the
    entry to an unconditional EXIT."""
    index = {address: i for i, (address, _, _) in enumerate(code)}
    if loop:
        loops = [(int(b.group(1), 16), address) for address, _, line in code
                 if (b := SASS_BRANCH.search(line)) and int(b.group(1), 16) < address]  # fmt: skip
        head, tail = max(loops, key=lambda span: span[1] - span[0])
        i, stop = index[head], index[tail]
    else:
        i, stop = 0, len(code) - 1
    ops = []
    while i <= stop:
        address, op, line = code[i]
        ops.append(op)
        if op == "EXIT" and "@" not in line:
            break
        branch = SASS_BRANCH.search(line)
        if op == "BRA" and branch and "@" not in line and int(branch.group(1), 16) > address:
            i = index[int(branch.group(1), 16)]
            continue
        i += 1
    return ops


def _static(code: list[tuple[int, str, str]]) -> int:
    last_exit = max(address for address, op, _ in code if op == "EXIT")
    return sum(1 for address, op, _ in code if address <= last_exit and op != "NOP")


def _report(name: str, kernel, config: ue8m0.LaunchConfig, loop: bool, tokens: int) -> dict:
    cubin = kernel.asm["cubin"]
    registers, stack = _resources(cubin)
    code = _code(cubin)
    body = _path(code, loop)
    per_thread_values = tokens * 512 / (32 * config.num_warps)
    warp_per_token = len(body) * config.num_warps / tokens
    issue_ms = warp_per_token * TOKENS_TIMED / WARP_ISSUE_PER_S * 1e3
    memory_ms = BYTES_PER_TOKEN * TOKENS_TIMED / COPY_BYTES_PER_S * 1e3
    mix = collections.Counter(body)
    memory_ops = {op: n for op, n in sorted(mix.items()) if op.startswith(MEMORY)}
    mix = collections.Counter(op.split(".")[0] for op in body)
    # Global accesses per token (warp instructions, as issued: predicated-off lanes count) and the bytes
    # their lanes would move, by direction; LDGSTS (cp.async) counts as a load.
    per_token = config.num_warps / tokens
    moved = {"LD": [0, 0], "ST": [0, 0]}
    for op, n in memory_ops.items():
        if op.startswith(("LDG", "STG")):
            width = WIDTH_BYTES.get(op.rsplit(".", 1)[-1], 4)
            moved[op[:2]][0] += n * per_token
            moved[op[:2]][1] += n * per_token * 32 * width
    shared = kernel.metadata.shared
    warps_by_registers = SM_REGISTERS // (-(-registers * 32 // 256) * 256)
    blocks = min(SM_BLOCKS, SM_WARPS // config.num_warps, warps_by_registers // config.num_warps,
                 SM_SHARED // (shared + 1024))  # fmt: skip
    print(f"{name:<12} REG {registers:3d} STACK {stack:3d} SMEM {shared:6d} -> {blocks:2d} blocks "
          f"({blocks * config.num_warps:2d} warps) per SM | static {_static(code):4d} | {len(body):4d} per "
          f"{'iteration' if loop else 'program'} = {len(body) / per_thread_values:5.1f} per value, "
          f"{warp_per_token:5.0f} warp instructions per token (issue {issue_ms:.3f} ms vs copy {memory_ms:.3f} ms "
          f"for 1M tokens) | per token: {moved['LD'][0]:.1f} global loads of {moved['LD'][1]:.0f} B, "
          f"{moved['ST'][0]:.1f} stores of {moved['ST'][1]:.0f} B | memory ops {memory_ops} | "
          f"top {mix.most_common(8)}")  # fmt: skip
    return {"registers": registers, "stack": stack, "count": len(body), "blocks": blocks}


def insert(config: ue8m0.LaunchConfig, use_fnuz: bool) -> dict:
    max_exp_field, max_mantissa, min_exponent = ue8m0._exponent_constants(use_fnuz)
    constexprs = dict(BLOCK_SIZE=BLOCK_SIZE, TOKENS=config.tokens_per_program, FNUZ=use_fnuz,
                      FP8_MAX=ue8m0._fp8_max(use_fnuz), MAX_EXP_FIELD=max_exp_field, MAX_MANTISSA=max_mantissa,
                      MIN_EXPONENT=min_exponent, FNUZ_CVT=config.fnuz_encode == "cvt",
                      ROPE_WORDS=config.rope_words, LOOP=config.insert_programs > 0,
                      STAGES=config.stages, STREAM="evict_first" if config.evict else "",
                      KEEP="evict_last" if config.evict else "")  # fmt: skip
    constexprs = {n: v for n, v in constexprs.items() if n in ue8m0._quantize_and_insert_k_kernel.arg_names}
    kernel = _compile(ue8m0._quantize_and_insert_k_kernel, INSERT_POINTERS, constexprs, config.num_warps,
                      config.insert_registers(use_fnuz))
    return _report(f"insert {'FNUZ' if use_fnuz else 'OCP'}", kernel, config, loop=config.insert_programs > 0,
                   tokens=config.tokens_per_program)


def gather(config: ue8m0.LaunchConfig, use_fnuz: bool) -> dict:
    tokens = config.gather_tokens or config.tokens_per_program
    constexprs = dict(HAS_GATHER_LENS=False, BLOCK_SIZE=BLOCK_SIZE, TOKENS=tokens,
                      FNUZ=use_fnuz, DECODE=config.decode, ROPE_WORDS=config.rope_words,
                      PREFETCH_TABLE=config.prefetch_table, STAGES=config.stages,
                      STREAM="evict_first" if config.evict else "")  # fmt: skip
    constexprs = {n: v for n, v in constexprs.items() if n in ue8m0._dequantize_and_gather_k_kernel.arg_names}
    kernel = _compile(ue8m0._dequantize_and_gather_k_kernel, GATHER_POINTERS, constexprs, config.num_warps,
                      config.gather_max_registers)
    return _report(f"gather {'FNUZ' if use_fnuz else 'OCP'}", kernel, config, loop=True, tokens=tokens)


def _parse(variant: str) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(ue8m0.LaunchConfig)}
    changes = {}
    for item in filter(None, variant.split(",")):
        name, value = item.split("=")
        kind = fields[name]
        changes[name] = int(value) if kind in ("int", int) else bool(int(value)) if kind in ("bool", bool) else value
    return changes


if __name__ == "__main__":
    base = ue8m0.LAUNCH_CONFIGS["sm90"]
    for variant in sys.argv[1:] or [""]:
        config = dataclasses.replace(base, **_parse(variant))
        print(f"-- {config}")
        for use_fnuz in (False, True):
            insert(config, use_fnuz)
        for use_fnuz in (False, True):
            gather(config, use_fnuz)
