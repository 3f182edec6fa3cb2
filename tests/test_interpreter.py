"""Each interpreter defect numbered in ``triton_impl/interpreter.py`` is real; each workaround is right in both modes.

A "defect" test runs the plain Triton op and shows it is wrong under the interpreter (skipped when
compiled, where the plain op is right). A "workaround" test checks the helper of
``triton_impl/interpreter.py`` against torch bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from triton_impl import interpreter
from triton_impl.interpreter import (
    cast_for_store,
    dot_dtype,
    e4m3_bits_to_f16,
    e4m3_bits_to_f32,
    e4m3_bits_to_f32_cvt,
    f32_to_bf16_rne,
    f32_to_e4m3_bits,
    f32_to_e4m3fn_bits_not_nan,
    f32_to_e4m3fnuz_bits_cvt,
)

interpreted_only = pytest.mark.skipif(not bool(interpreter.INTERPRET), reason="defect of the interpreter only")

BLOCK = 1024


@triton.jit
def _add_self_kernel(x_ptr, y_ptr, n, UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if UPCAST:
        x = x.to(tl.float32)
    tl.store(y_ptr + offs, (x + x).to(tl.float32), mask=offs < n)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, DOT_DTYPE: tl.constexpr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :]).to(DOT_DTYPE)
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :]).to(DOT_DTYPE)
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))


@triton.jit
def _encode_kernel(x_ptr, fn_ptr, fnuz_ptr, bf16_ptr, plain_fp8_ptr, plain_bf16_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(fn_ptr + offs, f32_to_e4m3_bits(x, False), mask=mask)
    tl.store(fnuz_ptr + offs, f32_to_e4m3_bits(x, True), mask=mask)
    tl.store(bf16_ptr + offs, cast_for_store(x, bf16_ptr.dtype.element_ty), mask=mask)
    tl.store(plain_fp8_ptr + offs, x.to(tl.float8e4nv), mask=mask)
    tl.store(plain_bf16_ptr + offs, x.to(tl.bfloat16), mask=mask)


@triton.jit
def _bf16_rne_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, f32_to_bf16_rne(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _fp32_sweep() -> torch.Tensor:
    """fp32 values around every bf16 value: the value itself, one fp32 ulp either side of it, the
    exact midpoint to the next bf16 (a tie for bf16 and, in the e4m3 range, for e4m3 too), and one
    ulp either side of that midpoint. Covers ties, +-0, subnormals, saturation, +-inf and NaN."""
    base = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bits = base.view(torch.int32)
    offsets = (0, 1, -1, 0x8000, 0x7FFF, 0x8001)
    sweep = torch.cat([(bits + o).view(torch.float32) for o in offsets])
    extra = torch.tensor([448.0, 464.0, 465.0, 480.0, 240.0, 244.0, 248.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1e-30])
    return torch.cat([sweep, extra, -extra])


def _encode_all(x: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    x = x.to(device)
    n = x.numel()
    out = {
        "fn": torch.empty(n, dtype=torch.uint8, device=device),
        "fnuz": torch.empty(n, dtype=torch.uint8, device=device),
        "bf16": torch.empty(n, dtype=torch.bfloat16, device=device),
        "plain_fp8": torch.empty(n, dtype=torch.float8_e4m3fn, device=device),
        "plain_bf16": torch.empty(n, dtype=torch.bfloat16, device=device),
    }
    _encode_kernel[_grid(n)](
        x, out["fn"], out["fnuz"], out["bf16"], out["plain_fp8"], out["plain_bf16"], n, BLOCK=BLOCK
    )
    return {k: v.cpu() for k, v in out.items()}


@pytest.fixture(scope="module")
def encoded(device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = _fp32_sweep()
    return x, _encode_all(x, device)


# -- defect 1: bf16 arithmetic on raw bits ------------------------------------------------------


@pytest.mark.parametrize("upcast", [False, True])
def test_bf16_arithmetic(device: torch.device, upcast: bool) -> None:
    x = torch.tensor([1.5, -2.25, 3.0, 100.0], dtype=torch.bfloat16, device=device)
    y = torch.empty(4, device=device)
    _add_self_kernel[(1,)](x, y, 4, UPCAST=upcast, BLOCK=4)
    right = torch.equal(y.cpu(), (x.float() * 2).cpu())
    if upcast:
        assert right, "the workaround (upcast to fp32 before arithmetic) must be exact"
    elif bool(interpreter.INTERPRET):
        assert not right, "defect 1 is gone: bf16 + bf16 is right under this interpreter"


# -- defect 2: tl.dot on bf16 bit patterns ------------------------------------------------------


def _dot_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    return a.to(device), b.to(device), (a.double() @ b.double())


@interpreted_only
def test_dot_on_bf16_is_wrong_under_interpreter(device: torch.device) -> None:
    a, b, ref = _dot_inputs(device)
    c = torch.empty(16, 16, device=device)
    _dot_kernel[(1,)](a, b, c, DOT_DTYPE=tl.bfloat16)
    assert (c.double().cpu() - ref).abs().max() > 1.0


def test_dot_dtype_workaround(device: torch.device) -> None:
    a, b, ref = _dot_inputs(device)
    c = torch.empty(16, 16, device=device)
    _dot_kernel[(1,)](a, b, c, DOT_DTYPE=dot_dtype(torch.bfloat16))
    # Products of bf16 values are exact in fp32; only the fp32 sum of 16 terms rounds.
    assert (c.double().cpu() - ref).abs().max() < 1e-5
    assert dot_dtype(torch.bfloat16) == (tl.float32 if bool(interpreter.INTERPRET) else tl.bfloat16)


def test_dot_dtype_rejects_fp8() -> None:
    if bool(interpreter.INTERPRET):
        assert dot_dtype(torch.float8_e4m3fn) == tl.float32
    else:
        with pytest.raises(TypeError, match="dot operands"):
            dot_dtype(torch.float8_e4m3fn)


# -- defect 3: fp32 -> e4m3 ---------------------------------------------------------------------


@interpreted_only
def test_plain_fp8_cast_is_wrong_under_interpreter(device: torch.device) -> None:
    x = torch.tensor([31.6, 126.0, 1.0 + 2**-4])  # mantissa carry (twice), a tie
    out = _encode_all(x, device)["plain_fp8"]
    assert not torch.equal(out.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize(
    ("name", "dtype", "max_finite"), [("fn", torch.float8_e4m3fn, 448.0), ("fnuz", torch.float8_e4m3fnuz, 240.0)]
)
def test_e4m3_encoder_matches_torch(encoded, name: str, dtype: torch.dtype, max_finite: float) -> None:
    """In range, every code equals torch's. Out of range torch changed its mind between versions
    (2.11 maps e4m3fn overflow to NaN, 2.13 saturates), so there the encoder is held to its own
    documented rule: e4m3fn saturates to +-448 (satfinite, as compiled Triton and CUDA's
    ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`` do); e4m3fnuz gives its NaN 0x80."""
    x, out = encoded
    in_range = x.abs() <= max_finite
    ref = x[in_range].to(dtype).view(torch.uint8)
    got = out[name][in_range]
    bad = (got != ref).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {ref.numel()} differ, e.g. x={x[in_range][bad[:4]].tolist()} "
        f"got {got[bad[:4]].tolist()} want {ref[bad[:4]].tolist()}"
    )
    beyond = ~in_range & ~torch.isnan(x)
    rounds_to_max = beyond & (x.abs() < max_finite + (8.0 if name == "fn" else 4.0) * 2.0)  # below the half-ulp tie
    sign = (x.view(torch.int32) < 0).to(torch.uint8) << 7  # the sign bit, also of -0 and NaN
    if name == "fn":
        expected_beyond = 0x7E | sign[beyond]
    else:
        expected_beyond = torch.where(rounds_to_max[beyond], 0x7F | sign[beyond], torch.tensor(0x80, dtype=torch.uint8))
    assert torch.equal(out[name][beyond], expected_beyond.to(torch.uint8))
    nan_code = (0x7F | sign[torch.isnan(x)]) if name == "fn" else torch.full_like(sign[torch.isnan(x)], 0x80)
    assert torch.equal(out[name][torch.isnan(x)], nan_code)


def test_e4m3_encoder_known_values(device: torch.device) -> None:
    """Hand-checked codes: RNE ties to even, the mantissa carry, saturation, subnormals."""
    cases = {
        31.6: 0x60,
        126.0: 0x70,
        1.0 + 2**-4: 0x38,
        1.0 + 3 * 2**-4: 0x3A,
        464.0: 0x7E,
        1e9: 0x7E,
        2.0**-9: 0x01,
        2.0**-10: 0x00,
        3 * 2.0**-10: 0x02,
        -0.0: 0x80,
    }
    x = torch.tensor(list(cases))
    assert _encode_all(x, device)["fn"].tolist() == list(cases.values())


# -- defect 6: e4m3 -> fp32 ----------------------------------------------------------------------


@triton.jit
def _decode_e4m3_kernel(codes_ptr, soft_ptr, plain_ptr, FNUZ: tl.constexpr):
    offs = tl.arange(0, 256)
    codes = tl.load(codes_ptr + offs)
    tl.store(soft_ptr + offs, e4m3_bits_to_f32(codes, FNUZ))
    tl.store(plain_ptr + offs, tl.load(codes_ptr.to(tl.pointer_type(tl.float8e4nv)) + offs).to(tl.float32))


def _decode_all(device: torch.device, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    soft, plain = torch.empty(256, device=device), torch.empty(256, device=device)
    _decode_e4m3_kernel[(1,)](codes, soft, plain, FNUZ=fnuz)
    return soft.cpu(), plain.cpu()


@interpreted_only
def test_plain_fp8_decode_is_wrong_under_interpreter(device: torch.device) -> None:
    _, plain = _decode_all(device, fnuz=False)
    assert not torch.isnan(plain[0x7F]), "defect 6 is gone: the interpreter decodes 0x7F as NaN"


@pytest.mark.parametrize(("fnuz", "dtype"), [(False, torch.float8_e4m3fn), (True, torch.float8_e4m3fnuz)])
def test_e4m3_decoder_matches_torch_on_every_code(device: torch.device, fnuz: bool, dtype: torch.dtype) -> None:
    soft, _ = _decode_all(device, fnuz)
    expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    assert torch.equal(soft.isnan(), expected.isnan())
    assert torch.equal(soft[~soft.isnan()].view(torch.int32), expected[~expected.isnan()].view(torch.int32))  # -0 too


@triton.jit
def _decode_e4m3_f16_kernel(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, e4m3_bits_to_f16(tl.load(codes_ptr + offs)))


def test_e4m3_to_f16_matches_torch_on_every_code(device: torch.device) -> None:
    """The dot-operand decode (hardware compiled, the integer decode interpreted): every OCP code,
    -0 included, to torch's fp16 bit for bit; the NaN codes to NaN (payload free)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _decode_e4m3_f16_kernel[(1,)](codes, out)
    expected = codes.cpu().view(torch.float8_e4m3fn).to(torch.float16)
    out = out.cpu()
    assert torch.equal(out.isnan(), expected.isnan()) and int(expected.isnan().sum()) == 2
    assert torch.equal(out[~out.isnan()].view(torch.int16), expected[~expected.isnan()].view(torch.int16))


# -- defect 4: fp32 -> bf16 ---------------------------------------------------------------------


@interpreted_only
def test_plain_bf16_cast_is_wrong_under_interpreter(encoded) -> None:
    x, out = encoded
    finite = torch.isfinite(x)
    ref = x.to(torch.bfloat16).view(torch.int16)
    wrong = (out["plain_bf16"].view(torch.int16) != ref) & finite
    assert wrong.float().mean() > 0.1, "defect 4 is gone: the interpreter's bf16 cast rounds to nearest even"


def test_bf16_workaround_matches_torch(encoded) -> None:
    x, out = encoded
    got, ref = out["bf16"], x.to(torch.bfloat16)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def test_bf16_rne_helper_on_every_bf16_value(device: torch.device) -> None:
    """All 2^16 bf16 values survive fp32 -> bf16 unchanged (NaNs stay NaN)."""
    ref = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = ref.float().to(device)
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    _bf16_rne_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=BLOCK)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y.cpu()), nan)
    assert torch.equal(y.cpu().view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


# -- defect 5: run-time loop bounds with Triton 3.6 + NumPy >= 2.4 ------------------------------


@triton.jit
def _runtime_bound_kernel(x_ptr, n_ptr, y_ptr):
    acc = 0.0
    for i in range(0, tl.load(n_ptr)):
        acc += tl.load(x_ptr + i)
    tl.store(y_ptr, acc)


def test_runtime_loop_bound(device: torch.device) -> None:
    """The toolchain pin (triton 3.9 on CPU, see pyproject.toml) keeps this working."""
    x = torch.arange(5.0, device=device)
    y = torch.empty(1, device=device)
    _runtime_bound_kernel[(1,)](x, torch.tensor([3], dtype=torch.int32, device=device), y)
    assert y.item() == 3.0


# -- the conversions through the hardware's OCP e4m3 instructions --------------------------------
# Under the interpreter these check the fix-ups around the OCP conversion (there the integer one);
# compiled, they check them with the hardware conversion inside.


@triton.jit
def _encode_cvt_kernel(x_ptr, general_ptr, small_ptr, ocp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(general_ptr + offs, f32_to_e4m3fnuz_bits_cvt(x, False), mask=mask)
    tl.store(small_ptr + offs, f32_to_e4m3fnuz_bits_cvt(x, True), mask=mask)
    tl.store(ocp_ptr + offs, f32_to_e4m3fn_bits_not_nan(x), mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 2x of the largest values: inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 2x of signalling NaNs
def test_cvt_encoders_match_the_integer_encoder(encoded, device: torch.device) -> None:
    """On the whole fp32 sweep (every bf16 value, its fp32 neighbours, the midpoints: ties,
    subnormals, 232 and 248, +-0, +-inf, NaN) the FNUZ encoder through the OCP conversion gives
    the integer encoder's code; with SMALL on ``|x| <= 232`` and NaN; the OCP one without its NaN
    fix-up on every non-NaN value."""
    x, out = encoded
    n = x.numel()
    codes = {name: torch.empty(n, dtype=torch.uint8, device=device) for name in ("general", "small", "ocp")}
    _encode_cvt_kernel[_grid(n)](x.to(device), codes["general"], codes["small"], codes["ocp"], n, BLOCK=BLOCK)
    codes = {name: c.cpu() for name, c in codes.items()}
    assert torch.equal(codes["general"], out["fnuz"])
    small = (x.abs() <= 232.0) | torch.isnan(x)
    assert int(small.sum()) > n // 3 and int((x.abs() == 232.0).sum()) == 2
    assert torch.equal(codes["small"][small], out["fnuz"][small])
    not_nan = ~torch.isnan(x)
    assert torch.equal(codes["ocp"][not_nan], out["fn"][not_nan])


@triton.jit
def _decode_cvt_kernel(codes_ptr, out_ptr, FNUZ: tl.constexpr, EXACT_NAN: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, e4m3_bits_to_f32_cvt(tl.load(codes_ptr + offs), FNUZ, EXACT_NAN))


@pytest.mark.parametrize("exact_nan", [True, False])
@pytest.mark.parametrize("fnuz", [False, True])
def test_cvt_decoder_matches_the_integer_decoder_on_every_code(device: torch.device, fnuz, exact_nan) -> None:
    """All 256 codes decode to the integer decoder's fp32 bits, -0 and +-240 (FNUZ) included; the
    NaN codes to ``0x7FC00000`` (with EXACT_NAN=False, OCP's to some NaN)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, device=device)
    _decode_cvt_kernel[(1,)](codes, out, FNUZ=fnuz, EXACT_NAN=exact_nan)
    soft, _ = _decode_all(device, fnuz)
    out = out.cpu()
    nan = soft.isnan()
    assert torch.equal(out.isnan(), nan) and int(nan.sum()) == (1 if fnuz else 2)
    if exact_nan or fnuz:
        assert torch.equal(out.view(torch.int32), soft.view(torch.int32))
    else:
        assert torch.equal(out[~nan].view(torch.int32), soft[~nan].view(torch.int32))
