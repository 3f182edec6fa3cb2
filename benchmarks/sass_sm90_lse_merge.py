"""Registers, stack and the load widths of the split merge (``merge_splits``), compiled for sm_90 on a CPU.

No GPU needed: ``_merge_splits_kernel`` is compiled by Triton for ``GPUTarget("cuda", 90, 32)`` with the
launch arguments ``merge_splits`` derives for the sm90 entry of ``SPLIT_MERGE_CONFIGS`` at the ``attnref bench``
shapes (dense fp32 partials, bf16 output, fp32 LSE), specialized as Triton specializes such a launch:
16-byte aligned pointers, integer arguments that are multiples of 16 marked so, arguments equal to 1 as
constants. ``cuobjdump`` (from the Triton wheel) reports registers and stack per thread; the SASS is
counted by opcode: the global loads by width (``LDG.E`` 4 bytes, ``.64`` 8, ``.128`` 16) and all
instructions but NOPs. The counts are static; the script prints how many loops the SASS has (a
backward branch each). At both shapes every split fits one tile (``MULTI_TILE`` false): no loop, so
a warp executes each instruction once (predicated-off ones included) and a program issues the count
times ``num_warps``. Run::

    TRITON_INTERPRET=0 PYTHONPATH=. /tmp/t36/bin/python benchmarks/sass_sm90_lse_merge.py

(``/tmp/t36``: a venv with the H200's Triton 3.6, see ``benchmarks/sass_sm90_turboquant.py``.)
"""

from __future__ import annotations

import collections
import os
import re

os.environ["TRITON_INTERPRET"] = "0"  # before triton_impl decorates its kernels: compile, don't interpret

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from triton_impl import lse_merge
from triton_impl.bench import cuobjdump

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
ADDRESS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
BRANCH = re.compile(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
# (rows, heads, splits, head dim): the two ``merge_splits`` cases of ``attnref bench``.
SHAPES = [(4096, 32, 16, 128), (1024, 128, 8, 512)]


def _resources(cubin: bytes) -> str:
    line = [x for x in cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in x][-1]
    return " ".join(re.findall(r"(?:REG|STACK|SHARED):\d+", line))


def _compile(rows: int, heads: int, splits: int, head_dim: int):
    """The sm90 launch of ``merge_splits`` at this shape, compiled: ``(kernel, grid, constexprs)``."""
    partials = torch.empty(rows, heads, splits, head_dim + 1)
    o = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(rows, heads)
    original = lse_merge.select_config  # the table's sm90 entry, as on the H200
    lse_merge.select_config = lambda table, device: table.get("sm90", table["default"])
    try:
        grid, tail, constexprs = lse_merge._merge_splits_launch_args(rows, partials, o, lse)
    finally:
        lse_merge.select_config = original
    fn = lse_merge._merge_splits_kernel
    names = fn.arg_names
    values = dict(zip(names, (partials, o, lse, *tail), strict=False))
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values.get(name, constexprs.get(name))
        if name in constexprs:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:  # Triton makes an integer argument equal to 1 a constant
            signature[name], constants[(i,)] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: constexprs[k] for k in ("num_warps", "num_stages") if k in constexprs}
    kernel = triton_compile(ASTSource(fn, signature, constants, attrs), target=TARGET,
                            options={"enable_fp_fusion": True, **options})  # fmt: skip
    return kernel, grid, constexprs


def report(rows: int, heads: int, splits: int, head_dim: int) -> None:
    kernel, grid, constexprs = _compile(rows, heads, splits, head_dim)
    cubin = kernel.asm["cubin"]
    code = [(int(m.group(1), 16), m.group(2), line) for line in cuobjdump(cubin, "-sass").splitlines()
            if (m := ADDRESS.match(line))]  # fmt: skip
    opcodes = collections.Counter(op for _, op, _ in code if op != "NOP")
    loops = sum(1 for address, _, line in code if (b := BRANCH.search(line)) and int(b.group(1), 16) < address)
    loads = {op: n for op, n in sorted(opcodes.items()) if op.startswith(("LDG", "LDS", "STG", "STS", "SHFL"))}
    warps = constexprs["num_warps"]
    total = sum(opcodes.values())
    bytes_per_program = splits * (head_dim + 1) * 4
    print(f"merge_splits R={rows} H={heads} S={splits} D={head_dim}: grid {grid}, {constexprs}")
    print(f"  {_resources(cubin)}; {total} instructions per warp (static, {loops} loops), "
          f"x {warps} warps = {total * warps} warp instructions per program, "
          f"{bytes_per_program} bytes read per (row, head)")  # fmt: skip
    print(f"  memory: {loads}")


if __name__ == "__main__":
    for shape in SHAPES:
        report(*shape)
