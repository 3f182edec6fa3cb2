"""The benchmark: its cases are registered beside the parity cases, and its SASS column counts MMA
instructions in a real sm_90 cubin, compiled on this CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_impl.cli import main
from triton_impl.parity import registered_bench_cases

# Compiled (TRITON_INTERPRET=0) in a child process: here the kernels are interpreted. Triton
# compiles for a GPUTarget without a GPU, down to a cubin, with the ptxas in its wheel.
_COMPILE_AND_COUNT = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))


from triton_impl.bench import sass_mma_counts

signature = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "M": "constexpr", "N": "constexpr", "K": "constexpr"}
for rows in (64, 16):
    src = ASTSource(dot_kernel, signature, {(3,): rows, (4,): 64, (5,): 64})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": True})
    print(rows, *sass_mma_counts(kernel.asm["cubin"]))
"""


def test_sass_counts_tell_hgmma_from_hmma(tmp_path: Path) -> None:
    """A 64-row bf16 tl.dot with 4 warps is a Hopper warpgroup MMA (HGMMA); 16 rows fall back to HMMA."""
    script = tmp_path / "count_mma.py"  # a file: triton.jit reads the kernel's source
    script.write_text(_COMPILE_AND_COUNT)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=True
    ).stdout
    counts = {int(rows): (int(hgmma), int(hmma)) for rows, hgmma, hmma in (line.split() for line in out.splitlines())}
    assert counts[64][0] > 0 and counts[64][1] == 0, counts
    assert counts[16][0] == 0 and counts[16][1] > 0, counts


def test_bench_cases_are_registered_per_op() -> None:
    """Every op with a kernel worth timing has bench cases; sparse_indices keeps upstream's launch, untimed."""
    cases = registered_bench_cases()
    assert {c.op for c in cases} == {"decode_attention", "lse_merge", "mla_verify", "turboquant", "ue8m0_cache"}
    assert len({(c.op, c.name) for c in cases}) == len(cases), "two bench cases share a name"
    assert {c.op for c in registered_bench_cases(["lse_merge"])} == {"lse_merge"}
    with pytest.raises(ValueError, match="ops: unknown"):
        registered_bench_cases(["nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_to_time_the_interpreter(capsys) -> None:
    assert main(["bench", "--op", "lse_merge"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
