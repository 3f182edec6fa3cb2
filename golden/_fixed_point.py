"""Order-independent fp32 arithmetic: fixed-point sums and correctly rounded fp32 division and root.

A float sum depends on the order of its terms, so two programs that add the same terms in a
different order (a CPU loop, a GPU reduction tree) may round differently. Where a result feeds a
discrete decision (a quantization code flips when its input crosses a boundary) the golden model
and the kernels instead add the terms as integers: each term scaled by ``2^F`` and truncated to
int64, the exact int64 sum rounded once to fp32. Integer addition is associative, so every
device gets the same bits. Division and square root are rounded once, from float64.

Used by :mod:`golden.turboquant`; not an op of its own (hence the underscore).
"""

from __future__ import annotations

import torch


def fixed_point_sum(terms: torch.Tensor, dim: int, frac_bits: int) -> torch.Tensor:
    """``sum(terms)`` computed as ``RNE_fp32(sum_i trunc(terms_i * 2^F)) * 2^-F``.

    The int64 sum is exact, hence independent of order; callers keep it below ``2^53`` so that
    the float64 detour before the fp32 rounding is exact too (one rounding, as ``int64 -> fp32``
    in a kernel). Each term loses less than ``2^-F`` to truncation.

    Args:
        terms: float32 or float64 tensor; dim: the summed axis; frac_bits: ``F``.

    Returns:
        float32 tensor without ``dim``.
    """
    fixed = (terms * 2.0**frac_bits).to(torch.int64).sum(dim)
    return fixed.to(torch.float64).to(torch.float32) * 2.0**-frac_bits


def div_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``a / b`` (via float64, which is exact to one final rounding)."""
    return (a.to(torch.float64) / b.to(torch.float64)).to(torch.float32)


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (torch's CPU fp32 ``sqrt`` is not: about 1 in 6 is 1 ulp off)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` for int ``e`` in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
