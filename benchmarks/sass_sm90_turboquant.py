"""Registers, spills and the loop's instruction mix of the TurboQuant kernels, compiled for sm_90 on a CPU.

No GPU needed: the kernels are compiled by Triton for ``GPUTarget("cuda", 90, 32)`` with the sm90 launch
configs (or the ones given), as ``attnref bench`` launches them at D = 128, and ``cuobjdump`` (from the
Triton wheel) reports registers and stack per thread. For the decode (the sm_90 Gluon stage 1 where the bench
runs it, and the portable kernel), the SASS between the loop's first and last branch is counted by opcode: what
one ``BLOCK_N``-key tile costs one warp; for the sm_90 Gluon store, what one 64-row tile costs each thread. The
stores keep two copies of their key loop (the grid's table lookup, and the binary search for midpoints the grid
cannot separate): each copy is counted as the path a program takes. For the store of a Hadamard ``PiT``, each global
load of its tile loop is printed with its lead, the instructions from it to the first use of its result
(``ncu_stalls.load_leads``): under a register cap ptxas moves loads toward their use. Run::

    TRITON_INTERPRET=0 PYTHONPATH=. .venv/bin/python benchmarks/sass_sm90_turboquant.py
    TRITON_INTERPRET=0 PYTHONPATH=. .venv/bin/python benchmarks/sass_sm90_turboquant.py --loop turboquant_3bit_nc

(the second prints the Gluon stage 1's loop, the SASS the first counts, an instruction a line). The numbers
quoted in ``notebooks/results/perf_log.md`` come from this script. The repository's venv
has Triton 3.9; the H200 runs 3.6, whose code differs a lot for these kernels (k8v4 decode at BLOCK_N
128: 255 registers, 2288 bytes of stack and 213 warp instructions per key with 3.6, no stack and 96
with 3.9). For the H200's compiler, run the script from a separate venv::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy einops
    TRITON_INTERPRET=0 PYTHONPATH=. /tmp/t36/bin/python benchmarks/sass_sm90_turboquant.py
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before triton_impl decorates its kernels: compile, don't interpret

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from benchmarks import ncu_stalls
from golden.turboquant import TurboQuantConfig
from triton_impl import turboquant as ttq
from triton_impl import turboquant_sm90
from triton_impl.bench import SASS_UNIFORM_MOVE, cuobjdump, innermost_loop, sass_code
from triton_impl.launch import register_cap, with_overrides

TARGET = GPUTarget("cuda", 90, 32)
DECODE_POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*u8", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "centroid_ptr": "*fp32", "partials_ptr": "*fp32"}  # fmt: skip
STORE_POINTERS = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*u8", "cache_u16_ptr": "*u16",
                  "slot_ptr": "*i64", "pit_ptr": "*fp32", "midpoint_ptr": "*fp32", "centroid_ptr": "*fp32"}  # fmt: skip
# The bench's decode launch (B=32, H=32, HKV=8, D=128, block 16, 32 splits): Triton specializes every integer
# argument that is a multiple of 16 (these) and the block table's unit column stride (a constant 1).
DECODE_DIVISIBLE = ("num_splits", "block_size", "num_blocks", "table_keys", "stride_block", "data_bytes_per_slot",
                    "meta_offset", "stride_qb", "stride_qh", "stride_bt", "stride_pb", "stride_ph")  # fmt: skip
MEMORY_OPS = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "STSM", "BAR", "SHFL", "LDL", "STL")
# Opcodes that issue to the ALU pipe (bit manipulation, logic, compares, selects, min/max, integer adds; not IMAD,
# which takes the FMA pipe): 64 lanes a cycle per SM on sm_90, so a warp instruction holds its scheduler's ALU pipe
# for 2 cycles, against 1 issue cycle. In the 4-bit decode's loop (805 instructions a step, 402 of them ALU), 128 more
# ALU instructions a step made stage 1 20% slower on the H200 and 113 more IMAD 1.6% (perf_log.md, twenty-eighth
# session): there the ALU count is the one to watch, not the total.
ALU_OPS = ("PRMT", "LOP3", "SHF", "SEL", "FSEL", "ISETP", "FSETP", "IADD3", "LEA", "FMNMX", "IMNMX", "VIMNMX", "PLOP3",
           "SGXT", "MOV", "F2FP")


def _compile(fn, pointers: dict[str, str], constexprs: dict[str, int], options: dict[str, int],
             divisible: tuple[str, ...] = ()):  # fmt: skip
    """Compile for sm_90 with every pointer 16-byte aligned and the integer arguments in
    ``divisible`` multiples of 16, as Triton specializes a launch whose values are."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    values = {(names.index(n),): v for n, v in constexprs.items()}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *divisible)}
    return triton_compile(ASTSource(fn, signature, values, aligned), target=TARGET,
                          options={"enable_fp_fusion": True, **options})  # fmt: skip


def _resources(cubin: bytes) -> str:
    line = [x for x in cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in x][-1]
    return " ".join(re.findall(r"(?:REG|STACK):\d+", line))


def _loop_mix(cubin: bytes, holding: str | None = None) -> tuple[int, list[tuple[str, int]], dict[str, int], int,
                                                                  int]:
    """Instructions of the widest loop (a backward branch to its head, self-branches excluded), or with ``holding``
    the innermost loop holding that opcode: the decode's tile loop (the one-warp kernel's rescale branch makes a
    wider loop around it). Returns the count, the 12 commonest opcodes, the memory and barrier
    instructions by opcode with their width (``LDG.E.128``, ``STS.U16``, ...), the moves of a uniform
    register into a per-thread one, and the instructions on the ALU pipe (:data:`ALU_OPS`)."""
    code, loops = sass_code(cubin)
    if holding:
        head, tail = innermost_loop(code, loops, (holding,))
    else:
        head, tail = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [(opcode, opcode + suffix, line) for address, opcode, suffix, line in code if head <= address <= tail]
    memory = collections.Counter(full for opcode, full, _ in body if opcode in MEMORY_OPS)
    moves = sum(bool(SASS_UNIFORM_MOVE.search(line)) for _, _, line in body)
    alu = sum(opcode in ALU_OPS for opcode, _, _ in body)
    return (len(body), collections.Counter(opcode for opcode, _, _ in body).most_common(12),
            dict(sorted(memory.items())), moves, alu)  # fmt: skip


def decode(preset: str, config: dict[str, int]) -> None:
    layout = TurboQuantConfig.from_cache_dtype(preset, 128)
    key_bits = 8 if layout.key_fp8 else layout.key_mse_bits
    config = ttq.decode_entry(config, key_bits, layout.value_quant_bits)  # as select_decode_config resolves it
    aligned = key_bits == 4
    constexprs = dict(KV_GROUP=4, HEAD_DIM=128, KEY_BITS=key_bits, VALUE_BITS=layout.value_quant_bits,
                      KEY_DATA_BYTES=layout.key_data_bytes, NUM_FIELDS=2 if layout.key_fp8 else 3,
                      USE_PAIR_LUT=int(config["PAIR_LUT"] and key_bits == 4),
                      SMEM_CODEBOOK=int(config["SMEM_CODEBOOK"]), WORD_ALIGNED_KEYS=int(aligned),
                      WORD_ALIGNED_VALUES=int(layout.value_quant_bits == 4), BLOCK_M=16, BLOCK_N=config["BLOCK_N"],
                      BLOCK_D=128, JOIN_UNPACK=int(config["JOIN_UNPACK"]), GATHER_WORDS=int(config["GATHER_WORDS"]),
                      PREFETCH=config["PREFETCH"])  # fmt: skip
    constexprs["stride_btc"] = 1
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"],
               **register_cap(config.get("maxnreg"))}  # fmt: skip
    kernel = _compile(ttq._decode_stage1_kernel, DECODE_POINTERS, constexprs, options, DECODE_DIVISIBLE)
    count, mix, memory, _, _ = _loop_mix(kernel.asm["cubin"])
    per_key = config["num_warps"] / config["BLOCK_N"]
    shared = sum(n for op, n in memory.items() if op.startswith(("LDS", "STS")))
    print(f"decode {preset} {config}: {_resources(kernel.asm['cubin'])}, {kernel.metadata.shared} B shared; loop "
          f"{count} instructions per warp per tile = {count * per_key:.1f} warp instructions per key and KV head, "
          f"{shared * per_key:.2f} of them shared-memory loads and stores; {mix}; "
          f"memory and barriers {memory}")  # fmt: skip


def _gluon_decode_kernel(preset: str, shared_pairs: int | None = None) -> tuple[Any, dict[str, int], bool, int,
                                                                              dict[str, int]]:
    """The sm_90 Gluon stage 1 as the bench launches it (:func:`gluon_decode` says how), compiled: ``(kernel, config,
    warp, step, ranks)``, ``ranks`` stream-K's ``RANKS`` and ``TILT`` where it runs (else empty)."""
    quantizer = TurboQuantConfig.from_cache_dtype(preset, 128)
    key_bits, value_bits = 8 if quantizer.key_fp8 else quantizer.key_mse_bits, quantizer.value_quant_bits
    config = ttq.decode_entry(ttq.DECODE_CONFIGS["sm90"], key_bits, value_bits)
    if shared_pairs is not None:
        config["WARP_SHARED_PAIRS"] = shared_pairs
    fp16_operands = bool(config.get("FP16_OPERANDS"))
    warp = bool(config.get("GLUON_WARP")) and turboquant_sm90.streams_supports(
        key_bits=key_bits, value_bits=value_bits, group=4, fp16_operands=fp16_operands, cache_address=0, one_warp=True)
    step = ttq.warp_stages(config)["STEP"] if warp else 1
    ranks = ttq.stream_k_ranks(config, 32, 32, key_bits) if warp and config.get("STREAM_K") else {}  # B=32 Hq=32
    if warp:
        kernel = turboquant_sm90.compile_for_sm90(key_bits=key_bits, value_bits=value_bits,
                                                  maxnreg=config["WARP_MAXNREG"], fp16_operands=fp16_operands,
                                                  warp=True, stream_k=bool(config.get("STREAM_K")),
                                                  **{k.lower(): v for k, v in (ttq.warp_stages(config)
                                                                               | ranks).items()})  # fmt: skip
    else:
        kernel = turboquant_sm90.compile_for_sm90(key_bits=key_bits, value_bits=value_bits,
                                                  maxnreg=config.get("GLUON_MAXNREG"),
                                                  stages=turboquant_sm90.stages(config.get("GLUON_STAGES", 0),
                                                                                key_bits, value_bits),
                                                  fp16_operands=fp16_operands)  # fmt: skip
    return kernel, config, warp, step, ranks


def gluon_decode(preset: str, shared_pairs: int | None = None) -> None:
    """The sm_90 Gluon stage 1 (triton_impl/turboquant_sm90.py) as the bench launches it: one warp a program over
    16-key chunks where the entry selects that kernel (``GLUON_WARP``; by stream-K where it selects that, ``STREAM_K``,
    its places weighted as at the bench's B=32 Hq=32),
    else 64-key tiles on 4 warps; the sm90 entry's register cap, shared-memory stages and operand rounding
    (``FP16_OPERANDS``); ``shared_pairs`` in place of the entry's ``WARP_SHARED_PAIRS`` where given."""
    kernel, config, warp, step, ranks = _gluon_decode_kernel(preset, shared_pairs)
    key_fp8 = TurboQuantConfig.from_cache_dtype(preset, 128).key_fp8
    count, mix, memory, moves, alu = _loop_mix(kernel.asm["cubin"], "HMMA")
    per_key = 1 / (16 * step) if warp else int(turboquant_sm90.NUM_WARPS) / int(turboquant_sm90.BLOCK_N)
    shape = f"one warp, {step} 16-key chunks an iteration" if warp else "4 warps, 64-key tiles"
    shape += f", stream-K (ranks {ranks['RANKS']}, tilt {ranks['TILT']})" if ranks else ""
    shape += f", {config['WARP_SHARED_PAIRS']} words of 4 by the shared pair table" if warp and not key_fp8 else ""
    print(f"decode {preset} Gluon stage 1 ({shape}): "
          f"{_resources(kernel.asm['cubin'])}, {kernel.metadata.shared} B shared; loop "
          f"{count} instructions per warp per iteration = {count * per_key:.1f} warp instructions per key and KV head, "
          f"{moves} of them moves of a uniform register, {alu} on the ALU pipe ({2 * alu} of its cycles); {mix}; "
          f"memory and barriers {memory}")  # fmt: skip


def gluon_decode_loop(preset: str) -> None:
    """Prints the SASS of the loop that :func:`gluon_decode` counts, one instruction a line (``--loop PRESET``): to
    count an instruction by its operands, e.g. the 3-bit keys' lookups by their ``LOP3`` and ``PRMT`` immediates."""
    code, loops = sass_code(_gluon_decode_kernel(preset)[0].asm["cubin"])
    head, tail = innermost_loop(code, loops, ("HMMA",))
    for address, _, _, line in code:
        if head <= address <= tail:
            print(line.strip())


def _outer_loops(loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loops no other loop contains, in address order."""
    return sorted({(h, t) for h, t in loops if not any(h2 <= h and t <= t2 and (h2, t2) != (h, t) for h2, t2 in loops)})


# The grid bucketize's one instruction that nothing else in the stores emits (``min.NaN.f32``): it tells the loop
# (nest) of the grid's lookup from the binary-search copy of the same loop.
GRID_MARK = "FMNMX.NAN"


def _grid_paths(code, loops) -> dict[str, list[tuple[int, int]]]:
    """The stores' two copies of their key loop: ``{"grid": nests to skip, "search": nests to skip}`` for the run
    of each path (a program runs one copy); one path ``"all"`` (nothing skipped) where no loop has the mark."""
    nests = _outer_loops(loops)
    grid = [n for n in nests if any(n[0] <= a <= n[1] and op + sfx == GRID_MARK for a, op, sfx, _ in code)]
    if not grid:
        return {"all": []}
    search = [n for n in nests if n not in grid and sum(n[0] <= a <= n[1] for a, _, _, _ in code) > 200]
    return {"grid": search, "search": grid}


def _weighted_mix(cubin: bytes, trips: int) -> dict[str, collections.Counter]:
    """Instructions by opcode, each counted ``trips`` times per loop around it (the store's column and
    row-chunk loops both run ``HEAD_DIM / D_CHUNK`` times), padding NOPs left out: an estimate of what
    one program executes per warp. A software-pipelined loop's prologue counts once. One count per path
    (:func:`_grid_paths`: the grid's lookup or the binary search), each without the other path's loop nest."""
    code, loops = sass_code(cubin)
    mixes = {}
    for path, skip in _grid_paths(code, loops).items():
        mix: collections.Counter = collections.Counter()
        for address, opcode, _, _ in code:
            if opcode != "NOP" and not any(h <= address <= t for h, t in skip):
                mix[opcode] += trips ** sum(head <= address <= tail for head, tail in loops)
        mixes[path] = mix
    return mixes


def store(preset: str, config: dict[str, int]) -> None:
    """Registers, stack and shared memory per program, and warp instructions per stored row (a (token, KV
    head) pair): the whole kernel per program, loops weighted by their trip counts, times the warps, over
    ``BLOCK_T`` rows."""
    layout = TurboQuantConfig.from_cache_dtype(preset, 128)
    key_bits = 8 if layout.key_fp8 else layout.key_mse_bits
    constexprs = dict(HEAD_DIM=128, KEY_BITS=key_bits, VALUE_BITS=layout.value_quant_bits,
                      NORM_CORRECTION=int(layout.norm_correction), KEY_DATA_BYTES=layout.key_data_bytes,
                      NUM_FIELDS=2 if layout.key_fp8 else 3, BLOCK_T=config["BLOCK_T"], BLOCK_D=128,
                      D_CHUNK=config["D_CHUNK"],
                      ROTATION_PRECISION=("ieee", "tf32x3", "bf16x3")[config["TF32X3"]], BLOCK_SIZE=16,
                      WIDE_SLOTS=0)  # fmt: skip
    # The bench's store (1M tokens, 8 KV heads, block 16, D = 128): every integer argument but the
    # KV head count is a multiple of 16, and Triton specializes on that (without it the sm90 entry spills).
    divisible = tuple(n for n in ttq._store_kernel.arg_names if n not in STORE_POINTERS and n not in constexprs
                      and n != "num_kv_heads")  # fmt: skip
    options = {"num_warps": config["num_warps"], "num_stages": config.get("num_stages", 3),
               **register_cap(config.get("maxnreg"))}  # fmt: skip
    kernel = _compile(ttq._store_kernel, STORE_POINTERS, constexprs, options, divisible)
    mixes = _weighted_mix(kernel.asm["cubin"], 1 if layout.key_fp8 else 128 // min(config["D_CHUNK"], 128))
    per_row = config["num_warps"] / config["BLOCK_T"]
    for path, mix in mixes.items():
        total, lds, sts = (per_row * sum(mix[op] for op in ops) for ops in (mix, ("LDS", "LDSM"), ("STS",)))
        top = [(op, round(n * per_row, 1)) for op, n in mix.most_common(12)]
        print(f"store {preset} {config}: {_resources(kernel.asm['cubin'])} SMEM:{kernel.metadata.shared}; "
              f"{path} path {total:.0f} warp instructions per row (LDS {lds:.1f}, STS {sts:.1f}); {top}")  # fmt: skip


def gluon_store(preset: str) -> None:
    """The sm_90 Gluon store (triton_impl/turboquant_sm90.py), uncapped at 4 warps a program and at 8 warps capped at
    128 registers (``GLUON_WARPS``), its values loaded at the tile's start or (late) where they are quantized:
    registers, stack and, for each copy of its tile loop (the grid's lookup, the binary search: :func:`_grid_paths`),
    the loop's SASS between its first and last branch, what one tile of 16 rows a warp costs each thread."""
    layout = TurboQuantConfig.from_cache_dtype(preset, 128)
    for warps, maxnreg, early in ((4, None, True), (8, 128, True), (8, 128, False)):
        kernel = turboquant_sm90.compile_store_for_sm90(key_bits=layout.key_mse_bits,
                                                        value_bits=layout.value_quant_bits,
                                                        norm_correction=layout.norm_correction, warps=warps,
                                                        maxnreg=maxnreg, early_values=early)  # fmt: skip
        cubin = kernel.asm["cubin"]
        code, loops = sass_code(cubin)
        nests = _outer_loops(loops)
        for path, skip in _grid_paths(code, loops).items():
            head, tail = max((n for n in nests if n not in skip), key=lambda n: n[1] - n[0])
            body = [op for address, op, _, _ in code if head <= address <= tail]
            mix = collections.Counter(body).most_common(12)
            print(f"store {preset} Gluon {warps} warps{'' if early else ', late values'}: {_resources(cubin)}, "
                  f"{kernel.metadata.shared} B shared; "
                  f"{path} path loop {len(body)} instructions per thread per {16 * warps}-row tile = "
                  f"{len(body) / 16:.1f} warp instructions per row; {mix}")  # fmt: skip


def hadamard_store(preset: str, maxnreg: int | None = None) -> None:
    """The sm_90 store for a Hadamard ``PiT`` (``store_hadamard_kernel``) as the sm90 entry launches it for the
    preset's keys (or at ``maxnreg`` registers): registers, stack, its tile loop's instructions and local loads and
    stores, and each global load's lead, the instructions from it to the first that reads its result (through the
    loop's back edge: the next tile's keys): how far ahead of their use ptxas issued the rows' loads."""
    layout = TurboQuantConfig.from_cache_dtype(preset, 128)
    entry = with_overrides(ttq.STORE_CONFIGS["sm90"], f"_k{layout.key_mse_bits}")
    cap = maxnreg or entry["HADAMARD_MAXNREG"]
    knobs = ttq.hadamard_store_knobs(entry, layout.norm_correction)
    kernel = turboquant_sm90.compile_store_for_sm90(key_bits=layout.key_mse_bits, value_bits=layout.value_quant_bits,
                                                    norm_correction=layout.norm_correction, hadamard=True,
                                                    maxnreg=cap, knobs=knobs)
    code, loops = sass_code(kernel.asm["cubin"])
    head, tail = innermost_loop(code, loops, ("STG",))
    loop = [re.search(r"\*/\s*(.*?)\s*;", line).group(1) for address, _, _, line in code if head <= address <= tail]
    mix = collections.Counter(ncu_stalls.opcode(x) for x in loop)
    print(f"store {preset} Hadamard at {cap} registers: {_resources(kernel.asm['cubin'])}; tile loop {len(loop)} "
          f"instructions, LDL {mix['LDL']}, STL {mix['STL']}; global loads (index, lead): "
          f"{ncu_stalls.load_leads(loop)}")  # fmt: skip


# The store variants of benchmarks/sweep_memory_bound.py's grids, after the sm90 entries.
STORE_VARIANTS = {
    "mse": [{"BLOCK_T": t, "D_CHUNK": c, "num_warps": w, "TF32X3": x, "num_stages": 1, **({"maxnreg": r} if r else {})}
            for t, c, w, x, r in ((64, 32, 4, 2, 0), (128, 32, 8, 2, 0), (64, 64, 4, 2, 0), (64, 32, 4, 1, 128),
                                  (64, 64, 4, 1, 0), (64, 32, 4, 2, 96))],
    "fp8": [{"BLOCK_T": t, "D_CHUNK": 32, "num_warps": w, "TF32X3": 0} for t, w in ((32, 4), (64, 4), (16, 2))],
}  # fmt: skip


# Decode variants beside the sm90 entry (the TURBOQUANT_GRID of benchmarks/sweep_memory_bound.py ranks them by time).
DECODE_VARIANTS = ({"PREFETCH": 1, "PREFETCH_k4": 1, "maxnreg": 0}, {"PREFETCH": 0, "PREFETCH_k4": 0},
                   {"JOIN_UNPACK": 0})  # fmt: skip

if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"]:
        gluon_decode_loop(sys.argv[2])
        sys.exit()
    for preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
        gluon_decode(preset)
        if not TurboQuantConfig.from_cache_dtype(preset, 128).key_fp8:  # the shared pair table's counts (untimed)
            for shared_pairs in (1, 2, 3, 4):
                gluon_decode(preset, shared_pairs)
        decode(preset, ttq.DECODE_CONFIGS["sm90"] | {"GLUON": 0})
        for variant in DECODE_VARIANTS:
            decode(preset, ttq.DECODE_CONFIGS["sm90"] | variant)
        key_fp8 = TurboQuantConfig.from_cache_dtype(preset, 128).key_fp8
        if not key_fp8:
            gluon_store(preset)
            hadamard_store(preset)
        for config in [(ttq.FP8_KEY_STORE_CONFIGS if key_fp8 else ttq.STORE_CONFIGS)["sm90"],
                       *STORE_VARIANTS["fp8" if key_fp8 else "mse"]]:  # fmt: skip
            store(preset, config)
