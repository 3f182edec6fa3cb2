"""The Triton TurboQuant store's bit-level twin: its fp32 and fixed-point arithmetic, on a CPU.

Not the definition: ``golden.turboquant`` defines the store in float64, and a kernel is held to it
within its rounding error (``compare_store`` in ``triton_impl/parity/turboquant.py``). This module
models what ``triton_impl/turboquant.py``'s store does today, operation for operation, so that one
test can check the kernel writes exactly these bytes on every device and with every tiling:

- every sum that feeds a code (``||k||^2``, each coordinate of ``k_hat Pi^T``, ``||c[idx]||^2``)
  is a fixed-point integer sum: each term scaled by ``2^F`` and truncated to int64, the exact int64
  sum rounded once to fp32. Integer addition is associative, so the result does not depend on the
  summation order (a CPU loop, a GPU reduction tree, any tile size);
- ``||k||`` scales the key by ``2^-e`` (``e`` the exponent of ``max |k_d|``) first, so the squares
  neither overflow nor underflow;
- divisions and square roots are correctly rounded fp32 (``div_rn``, ``sqrt_rn`` in the kernel).

If the kernel drops this arithmetic for plain fp32 sums, this module and its test go with it; the
float64 definition and ``compare_store`` stay. Private (hence the underscore): not an op.
"""

from __future__ import annotations

import torch

from golden import turboquant as tq

# Fractional bits of the fixed-point sums. Terms are scaled by 2^F and truncated to int64.
# Rotation: |term| <= 1 and |y_d| <= sqrt(D) <= 32 (PiT entries are <= 1), so the sum stays below
# 2^51. Squared norm: terms are pre-scaled into [0, 4), sum < 4D * 2^40 <= 2^52. Centroid norm:
# |c| <= 1, sum < D * 2^40 <= 2^50. D <= 1024 keeps each below 2^53 (exact in float64).
ROTATION_FRAC_BITS = 46
NORM_FRAC_BITS = 40


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


def key_norm_f32(key: torch.Tensor) -> torch.Tensor:
    """The kernel's ``||k||``: ``x = k 2^-e``, ``n = fp32(sqrt_rn(fixed_point_sum(x^2, F=40)) 2^e)``.

    ``e`` is the exponent of ``max |k_d|`` read from the fp32 bits (-126 for 0 and subnormals), so
    ``|x| < 2`` and ``x^2`` is exact in float64. Within about 1 ulp of the true norm; ``inf`` when
    the norm is past fp32's range.
    """
    k = key.to(torch.float32)
    exp_field = (k.abs().amax(dim=-1).view(torch.int32) >> 23) & 0xFF
    e = exp_field.clamp(min=1) - 127
    x = k.to(torch.float64) * pow2_f64(-e)[..., None]
    root = sqrt_f32(fixed_point_sum(x * x, dim=-1, frac_bits=NORM_FRAC_BITS))
    return (root.to(torch.float64) * pow2_f64(e)).to(torch.float32)


def rotate_keys_f32(key: torch.Tensor, PiT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(n, y)``: ``k_hat_d = div_rn(k_d, n + 1e-8)``, ``y_j = fixed_point_sum_d(fp32(k_hat_d
    PiT[d, j]), F=46)``; both float32."""
    n = key_norm_f32(key)
    k_hat = div_f32(key.to(torch.float32), (n + tq.KEY_NORM_EPS)[..., None])
    products = k_hat[..., :, None] * PiT.to(torch.float32)  # [T, HKV, D (summed), D]
    return n, fixed_point_sum(products, dim=-2, frac_bits=ROTATION_FRAC_BITS)


def _fp16_from_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 (one rounding, to nearest even) after a clamp to +-65504, as the kernel stores it."""
    return x.clamp(-tq.FP16_MAX, tq.FP16_MAX).to(torch.float16)


def quantize_keys_f32(
    key: torch.Tensor, PiT: torch.Tensor, boundaries: torch.Tensor, centroids: torch.Tensor, norm_correction: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's codes (fp32 ``y`` against fp32 midpoints) and fp16 norm (``div_rn(n, sqrt_rn(
    fixed_point_sum(c^2, F=40) + 1e-16))`` with norm correction)."""
    n, y = rotate_keys_f32(key, PiT)
    codes = (y[..., None] >= boundaries.to(torch.float32)).sum(dim=-1)
    stored = n
    if norm_correction:
        c = centroids.to(torch.float32)[codes]
        c_norm = sqrt_f32(fixed_point_sum(c * c, dim=-1, frac_bits=NORM_FRAC_BITS) + tq.NORM_CORRECTION_EPS)
        stored = div_f32(n, c_norm)
    return codes, _fp16_from_f32(stored)


def quantize_values_f32(value: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's min-max values: fp32 ``scale = max(div_rn(vmax - vmin, 2^b - 1), 1e-8)``,
    ``q = floor(div_rn(v - vmin, scale) + 0.5)`` clamped; fp16 scale and zero."""
    levels = 2**bits - 1
    v = value.to(torch.float32)
    vmin = v.amin(dim=-1).clamp(-tq.FP16_MAX, tq.FP16_MAX)
    vmax = v.amax(dim=-1).clamp(-tq.FP16_MAX, tq.FP16_MAX)
    scale = div_f32(vmax - vmin, torch.full_like(vmax, levels)).clamp(min=tq.MIN_VALUE_SCALE)
    q = torch.floor(div_f32(v - vmin[..., None], scale[..., None].expand_as(v)) + 0.5)
    return q.clamp(0, levels).to(torch.int64), _fp16_from_f32(scale), _fp16_from_f32(vmin)


def store_twin(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    config: tq.TurboQuantConfig,
) -> torch.Tensor:
    """The bytes ``triton_impl/turboquant.py``'s store writes: ``golden.turboquant.turboquant_store``'s
    layout, packing and FP8 cast with the fp32/fixed-point quantizers above. Arguments as there."""
    v_codes, v_scale, v_zero = quantize_values_f32(value, config.value_quant_bits)
    if config.key_fp8:
        key_bytes = tq.e4m3_bytes(key)
        fields = [v_scale, v_zero]
    else:
        codes, norm = quantize_keys_f32(key, PiT, boundaries, centroids, config.norm_correction)
        key_bytes = tq.pack_codes(codes, config.key_quant_bits)
        fields = [norm, v_scale, v_zero]
    value_bytes = tq.pack_codes(v_codes, config.value_quant_bits)
    return tq.write_slots(kv_cache, slot_mapping, key_bytes, value_bytes, torch.stack(fields, dim=-1), config)
