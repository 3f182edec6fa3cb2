"""How much more coarsely an ``mma.sync`` step sums value codes fed as fp16 subnormals, for the GPU machine.

``PYTHONPATH=. python3 benchmarks/mma_subnormal_codes.py`` runs 400 ``k16`` steps (two a probe call) of the one-warp
decode's value product on random codes 0-15 (a word's unshifted code, ``turboquant_sm90._field_codes``: the furthest
below the subnormal exponent ``2^-14``) and weights ``randn * 2^[-8, 3]`` in fp16; in three quarters of them one
weight a step is large (``2^7-2^8`` on a key whose codes are all 0, or ``2^14-2^15`` on codes 0 or 1). Each step runs
twice, its codes as the subnormals ``c 2^-24`` (times ``2^24`` after) and as normal fp16, against the exact sum. A row:
the kind of step, the codes' form, the largest error over the step's largest weight (code units), and the same beyond
an fp32 allowance (``2^-22`` of the sum of the products' magnitudes), which ``parity.turboquant.SUBNORMAL_CODES``
must cover with room. On an H100: ``2^-12.8`` at most for subnormal codes, none beyond the allowance for normal ones
(``notebooks/results/perf_log.md``, fifty-first session).
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from triton_impl import turboquant_sm90
from triton_impl.parity.turboquant import SUBNORMAL_CODES

KINDS = ("random", "2^7 weight on codes 0", "2^14 weight on codes 0", "2^14 weight on codes 1")


@gluon.jit
def _mma_probe(a_ptr, b_ptr, out_ptr):
    """``out = a @ b`` (``a [16, 32]``, ``b [32, 8]`` fp16, row-major; ``out`` fp32) by one warp's ``mma_v2``, the
    ``mma.sync.m16n8k16`` of the one-warp decode's value product, in its layouts: two ``k16`` steps."""
    mma: gl.constexpr = turboquant_sm90._operand_layouts(False, 1)[0]
    dot_b: gl.constexpr = turboquant_sm90._operand_layouts(False, 1)[1]
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    m = gl.arange(0, 16, layout=gl.SliceLayout(1, dot_a))
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, dot_a))
    a = gl.load(a_ptr + m[:, None] * 32 + k[None, :])
    kb = gl.arange(0, 32, layout=gl.SliceLayout(1, dot_b))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, dot_b))
    b = gl.load(b_ptr + kb[:, None] * 8 + n[None, :])
    out = mma_v2(a, b, gl.zeros([16, 8], gl.float32, mma))
    mo = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + mo[:, None] * 8 + no[None, :], out)


def mma(a: torch.Tensor, w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``a [16, 32] @ w [32, 8]`` (fp16) by :func:`_mma_probe` on ``device``, as float64 on the CPU."""
    out = torch.empty(16, 8, device=device)
    _mma_probe[(1,)](a.to(device), w.to(device), out, num_warps=1)
    return out.cpu().double()


def draw_step(gen: torch.Generator, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``k16`` steps' codes ``[16, 32]`` (int16, 0-15) and fp16 weights ``[32, 8]`` of :data:`KINDS` ``kind``:
    random, or each step's largest weight planted on one key."""
    codes = torch.randint(0, 16, (16, 32), generator=gen, dtype=torch.int16)
    w = torch.randn(32, 8, generator=gen) * 2.0 ** torch.randint(-8, 4, (32, 8), generator=gen)
    for step in (0, 16) if kind else ():
        big = step + int(torch.randint(0, 16, (), generator=gen))
        codes[:, big] = int(kind == 3)
        size = (1 + torch.rand(8, generator=gen)) * 2.0 ** (7 if kind == 1 else 14)
        w[big] = size * torch.sign(torch.randn(8, generator=gen))
    return codes, w.half()


def step_errors(codes: torch.Tensor, w: torch.Tensor, device: torch.device,
                subnormal: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(error, fp32, steps)``: the MMA's error against the exact sum in code units (``[16, 8]``, the codes as fp16
    subnormals ``c 2^-24`` or as normal fp16), an fp32 allowance (``2^-22`` of the sum of the products' magnitudes),
    and each output column's two steps' largest weights summed (``[8]``)."""
    a, unit = (codes.view(torch.float16), 2.0**24) if subnormal else (codes.half(), 1.0)
    error = (mma(a, w, device) * unit - codes.double() @ w.double()).abs()
    fp32 = 2.0**-22 * (codes.double().abs() @ w.double().abs())
    steps = w[:16].double().abs().amax(dim=0) + w[16:].double().abs().amax(dim=0)
    return error, fp32, steps


def main(trials: int = 400) -> None:
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(5)
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for trial in range(trials):
        kind = trial % 4
        codes, w = draw_step(gen, kind)
        for form in ("subnormal", "normal"):
            error, fp32, steps = step_errors(codes, w, device, form == "subnormal")
            raw, beyond = float((error / steps).max()), float(((error - fp32) / steps).max())
            old = worst.get((KINDS[kind], form), (0.0, -math.inf))
            worst[KINDS[kind], form] = max(old[0], raw), max(old[1], beyond)
    print(f"| step | codes | largest error / the step's largest weight | beyond fp32 (bound: {SUBNORMAL_CODES:g}) |")
    print("| --- | --- | --- | --- |")
    for (kind, form), (raw, beyond) in worst.items():
        print(f"| {kind} | {form} | {raw:.3g} (2^{math.log2(raw):.1f}) | {beyond:.3g} |")


if __name__ == "__main__":
    main()
