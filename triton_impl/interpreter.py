"""Everything that differs between compiled Triton and ``TRITON_INTERPRET=1``, in one place.

The interpreter (Triton 3.6 to 3.9 at least) runs kernels with NumPy and has defects that make a
naive kernel silently wrong on a CPU. Each workaround below is named for what it
does and is right in both modes, so a kernel calls it unconditionally:

1. bf16 is held as raw 16-bit patterns, so arithmetic, comparisons and reductions on bf16 values
   operate on the bits. ``x.to(tl.float32)`` is correct, so kernels upcast every loaded bf16
   value before arithmetic (``.to(tl.float32)``, or ``.to(dot_dtype(...))`` for a dot operand).
2. ``tl.dot`` of bf16 operands multiplies the bit patterns (triton-lang/triton#11584).
   :func:`dot_dtype` gives the operand dtype: fp32 under the interpreter, the 16-bit type compiled.
3. fp32 -> fp8 e4m3 drops the mantissa carry (31.6 -> 16) and rounds ties away from zero
   (#8322, #11897). :func:`f32_to_e4m3_bits` is a software round-to-nearest-even encoder under
   the interpreter and for FNUZ; compiled OCP takes the (correct) hardware conversion.
4. fp32 -> bf16 is not round-to-nearest-even. :func:`f32_to_bf16_rne` rounds in software, and
   :func:`cast_for_store` uses it for bf16 outputs under the interpreter only.
6. e4m3 -> fp32 reads the NaN code 0x7F as 480. :func:`e4m3_bits_to_f32` decodes bytes in integer
   arithmetic (OCP and FNUZ), so an fp8 cache is loaded as uint8 and decoded the same way in both
   modes (and FNUZ bytes decode on GPUs without FNUZ support). :func:`e4m3_bits_to_f16`, for
   dot operands that need no bit-exact NaN payloads, takes the hardware conversion when compiled
   and this decode under the interpreter.
7. A scalar bool ``&`` a block of bools gives an int32 block, which ``tl.load``/``tl.store`` reject
   as a mask ("mask has unsupported dtype"): write ``tl.where(scalar, block, False)`` instead.

(Defect 5, run-time loop bounds with Triton 3.6 and NumPy >= 2.4, is avoided by the CPU toolchain
pin in ``.ci/run``.)

``tests/test_interpreter.py`` shows each defect (skipped when compiled) and checks each workaround
against torch bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Decided once, at import: triton.jit reads TRITON_INTERPRET when a kernel is decorated, and
# triton_impl/__init__.py sets it on a machine without CUDA before any kernel module is imported.
INTERPRETING: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"  # for host code: a plain bool is free to test
INTERPRET: tl.constexpr = tl.constexpr(INTERPRETING)  # for kernels

_DOT_DTYPES = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype for ``tl.dot`` on data of ``dtype``: fp32 under the interpreter (defect 2).

    Compiled, bf16/fp16 operands feed the tensor cores (fp32 accumulation); an fp8 cache is
    dequantized to the query's 16-bit type first, as upstream does, so pass the query dtype.
    """
    if INTERPRETING:
        return tl.float32
    if dtype not in _DOT_DTYPES:
        raise TypeError(f"dot operands: expected one of {list(_DOT_DTYPES)}, got {dtype}")
    return _DOT_DTYPES[dtype]


@triton.jit
def f32_to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even (overflow to +-inf), any NaN -> quiet NaN 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = tl.where(is_nan, 0x7FC0, rounded)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(x, FNUZ: tl.constexpr):
    """fp32 -> fp8 e4m3 code (uint8), round to nearest even; equal to torch's cast in range.

    OCP ``float8_e4m3fn`` (bias 7, max 448): out-of-range values and +-inf saturate to +-448
    (satfinite, as compiled Triton and CUDA do; torch 2.13 agrees, torch 2.11 gives NaN), NaN ->
    0x7F with its sign, -0 keeps its sign. FNUZ ``float8_e4m3fnuz`` (bias 8, max 240): anything
    that rounds past 240, +-inf and NaN -> 0x80 (the only NaN), and -0 -> 0.

    Under the interpreter (and for FNUZ, which NVIDIA hardware lacks) it is integer arithmetic
    only, exact in both modes; compiled OCP uses the hardware conversion, which
    ``tests/test_interpreter.py`` holds to the same bits on the GPU. The significand is
    shifted down to the target ulp (which is 2^(e-3) for normals and 2^(1-bias-3) for
    subnormals) and rounded half to even; a carry out of the mantissa lands in the exponent field
    because the code is ``(biased_exponent - 1) * 8 + significand``.
    """
    if not INTERPRET and not FNUZ:
        # Compiled OCP: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_89+; one
        # instruction per two values instead of ~35 integer ops) rounds to nearest even and
        # saturates exactly as the integer path below; NaN is put back with its sign (0x7F | s).
        nan_bits = x.to(tl.uint32, bitcast=True)
        hw = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        is_nan_hw = (nan_bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(is_nan_hw, (0x7F | ((nan_bits >> 24) & 0x80)).to(tl.uint8), hw)
    BIAS: tl.constexpr = 8 if FNUZ else 7
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.int32)
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    exp_field = (magnitude >> 23).to(tl.int32)
    significand = (magnitude & 0x7FFFFF) | tl.where(exp_field > 0, 0x800000, 0).to(tl.uint32)
    target_exp = exp_field - 127 + BIAS  # biased e4m3 exponent if x were normal there
    shift = 20 + tl.maximum(1 - target_exp, 0)
    shift = tl.minimum(shift, 31).to(tl.uint32)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = (1 << (shift - 1)).to(tl.uint32)
    round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    kept = kept + round_up.to(tl.uint32)
    code = (tl.maximum(target_exp, 1) - 1) * 8 + kept.to(tl.int32)
    if FNUZ:
        code = tl.where(code > 0x7F, 0x80, code)
        code = tl.where(is_nan, 0x80, code)
        code = tl.where((code != 0) & (code != 0x80), code | (sign << 7), code)
    else:
        code = tl.minimum(code, 0x7E)
        code = tl.where(is_nan, 0x7F, code)
        code = code | (sign << 7)
    return code.to(tl.uint8)


@triton.jit
def cast_for_store(x, OUT_DTYPE: tl.constexpr):
    """Cast fp32 ``x`` to an output element type with round-to-nearest-even in both modes."""
    if INTERPRET and tl.bfloat16 == OUT_DTYPE:
        return f32_to_bf16_rne(x)
    return x.to(OUT_DTYPE)


@triton.jit
def e4m3_bits_to_f32(code, FNUZ: tl.constexpr):
    """e4m3 byte -> fp32, exactly: ``(8 + mantissa) * 2^(exponent - bias - 3)`` (subnormal:
    ``mantissa * 2^(1 - bias - 3)``), the sign put back as a bit (so OCP 0x80 is -0). NaN: OCP
    ``S.1111.111``; FNUZ 0x80, which is also why FNUZ has no -0. Bias 7 (OCP) or 8 (FNUZ)."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    c = code.to(tl.int32)
    exp_field = (c >> 3) & 0xF
    mantissa = c & 0x7
    significand = tl.where(exp_field > 0, mantissa + 8, mantissa)
    pow2 = ((tl.maximum(exp_field, 1) - BIAS - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = significand.to(tl.float32) * pow2  # <= 4 significant bits times a power of two: exact
    f32 = magnitude.to(tl.int32, bitcast=True) | ((c >> 7) << 31)
    is_nan = (c == 0x80) if FNUZ else ((c & 0x7F) == 0x7F)
    return tl.where(is_nan, 0x7FC00000, f32).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_to_f16(code):
    """OCP e4m3 byte -> fp16 (exact: every e4m3 value is an fp16 value; NaN codes give NaN).

    Compiled: the hardware conversion (``cvt.rn.f16x2.e4m3x2`` on sm_89+, about one instruction per
    two values instead of :func:`e4m3_bits_to_f32`'s dozen integer ops); its NaN payload may differ
    from torch's. Interpreted: the integer decode (defect 6).
    """
    if INTERPRET:
        return e4m3_bits_to_f32(code, False).to(tl.float16)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)


# -- conversions through the hardware's OCP e4m3 instructions, with integer fix-ups ---------------
#
# The helpers below give bit for bit the results of the integer helpers above (the tests hold them
# to those on every code, and on every value of ``tests/test_interpreter.py``'s fp32 sweep), with
# fewer instructions per value when compiled for sm_89+: there the e4m3 conversion is one
# instruction per two values. Under the interpreter (defects 3 and 6) the OCP conversion inside
# them is the integer one, so the fix-ups around it are what the CPU tests check; the compiled
# hardware conversion is held to the integer one by the GPU run of the same tests.


@triton.jit
def f32_to_e4m3fn_bits_not_nan(x):
    """fp32 -> OCP e4m3 code for ``x`` that is not NaN: ``f32_to_e4m3_bits(x, False)`` without its
    NaN fix-up (round to nearest even, +-inf and out-of-range values saturate to +-448, -0 keeps
    its sign). Compiled: the hardware conversion alone; interpreted: the integer encoder."""
    if INTERPRET:
        return f32_to_e4m3_bits(x, False)
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def f32_to_e4m3fnuz_bits_cvt(x, SMALL: tl.constexpr):
    """fp32 -> FNUZ e4m3 code, equal to ``f32_to_e4m3_bits(x, True)`` for every ``x``, through the
    OCP conversion of ``2x`` (one instruction per two values compiled, instead of ~35 integer ops).

    FNUZ is OCP's bit layout with exponent bias 8 instead of 7, so a code's FNUZ value is half its
    OCP value, subnormals included (``2^-10`` vs ``2^-9`` per mantissa step). Doubling is exact,
    and round-to-nearest-even on a grid scaled by 2 picks the same code, so for ``|x| <= 232`` the
    FNUZ code of ``x`` is the OCP code of ``2x``, except where FNUZ differs from OCP:

    - a result of zero is ``+0`` (FNUZ has no -0): ``|x| <= 2^-11`` (at most half the smallest
      subnormal, a tie going to the even 0) is converted as ``+0``;
    - NaN gives 0x80, which is OCP's -0: a NaN is converted as ``-0``;
    - ``|x|`` in ``(232, 248)`` rounds to 240 (``0x7F | sign``), an OCP NaN code; the saturating
      conversion gives ``0x7E | sign`` there, so the low bit is set; ``|x| >= 248`` and +-inf round
      past 240, to 0x80.

    ``SMALL``: the caller guarantees ``|x| <= 232`` or NaN (the UE8M0 insert clamps to 224), which
    drops the last fix-up (two compares and two selects per value).
    """
    bits = x.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    doubled = (x * 2.0).to(tl.uint32, bitcast=True)
    doubled = tl.where(magnitude > 0x3A000000, doubled, 0)  # 2^-11
    doubled = tl.where(magnitude > 0x7F800000, 0x80000000, doubled)  # NaN -> -0 -> 0x80
    code = f32_to_e4m3fn_bits_not_nan(doubled.to(tl.float32, bitcast=True)).to(tl.int32)
    if not SMALL:
        code = tl.where(magnitude > 0x43680000, code | 1, code)  # (232, 248) -> 240
        code = tl.where(magnitude >= 0x43780000, 0x80, code)  # >= 248, inf, NaN
    return code.to(tl.uint8)


@triton.jit
def e4m3_bits_to_f32_cvt(code, FNUZ: tl.constexpr, EXACT_NAN: tl.constexpr):
    """e4m3 byte -> fp32, equal to :func:`e4m3_bits_to_f32` on every code (NaN: ``0x7FC00000``).

    Compiled: the hardware OCP conversion (``cvt.rn.f16x2.e4m3x2``, one instruction per two
    values, then fp16 -> fp32), its NaN codes ``S.1111.111`` put back as ``0x7FC00000``.
    Interpreted: the integer decode (defect 6), its NaN codes given another payload (as the
    hardware's may be), so that the fix-ups are tested on a CPU too. FNUZ: half the OCP value
    (bias 8), except 0x80 (NaN; OCP -0) and ``S.1111.111`` (+-240; OCP NaN).

    ``EXACT_NAN=False`` leaves OCP's NaN codes as the hardware decodes them: NaN, with the
    hardware's payload (saves ~4 integer ops per value), for a caller whose output needs only NaN
    to stay NaN (a bf16 result whose NaNs compare as NaN). Every other code keeps its exact bits.
    """
    c = code.to(tl.int32)
    if INTERPRET:  # NaN codes as fp16's canonical NaN 0x7FFF widened, not 0x7FC00000: the fix-ups show on a CPU
        ocp = e4m3_bits_to_f32(code, False).to(tl.int32, bitcast=True)
        ocp = tl.where((c & 0x7F) == 0x7F, 0x7FFFE000, ocp).to(tl.float32, bitcast=True)
    else:
        ocp = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if not FNUZ and not EXACT_NAN:
        return ocp
    top = (c & 0x7F) == 0x7F
    if FNUZ:
        f32 = (ocp * 0.5).to(tl.int32, bitcast=True)
        f32 = tl.where(top, 0x43700000 | ((c >> 7) << 31), f32)  # +-240
        is_nan = c == 0x80
    else:
        f32 = ocp.to(tl.int32, bitcast=True)
        is_nan = top
    return tl.where(is_nan, 0x7FC00000, f32).to(tl.float32, bitcast=True)
