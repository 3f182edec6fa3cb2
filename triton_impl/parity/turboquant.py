"""Parity cases for TurboQuant: the SoA store (against golden within its rounding bands) and the
split-KV decode, every preset; :func:`compare_store`, the store check the tests use too;
:func:`decode_expected`, the decode check the tests use too; :func:`centroid_rounding_bound`, how far the
decode may move because it reads its centroids as fp16; and :func:`weight_rounding_bound`, how far where it
rounds its value weights once to fp16 (the config key ``FP16_OPERANDS``, on in the sm90 entry).

Each case stores the same tokens with the Triton kernel, checks the bytes with
:func:`compare_store` (golden's float64 store, codes and fp16 fields allowed to fall either way
only inside a tie band derived from the fp32 error bound), then decodes with the Triton kernel and
with golden on the kernel's bytes (float64, :func:`decode_expected`). Llama-3-8B style GQA (32 query heads, 8 KV heads,
D = 128) on a GPU; fewer heads and tokens on a CPU.

The error bound. ``u = 2^-24`` is fp32's unit roundoff, ``u_op = 2^-22`` covers one elementary
operation rounded within 2 ulp (IEEE division and square root round within 1/2 ulp; GPUs'
approximate ``div.full``, ``sqrt.approx`` and ``rcp.approx`` within 2), ``gamma_D = D u / (1 - D
u)``. A store in fp32 computes ``n' = n (1 + eta)`` with ``|eta| <= gamma_D / 2 + u_op`` (a sum of
``D`` squares in any order is within ``gamma_D`` relative, the root halves that and rounds once);
``k_hat'_j = k_j / fl(n' + 1e-8) (1 + beta_j) = k_hat_j (1 + theta_j)`` with ``|beta_j| <= 2 u_op``
(a division, or a reciprocal and a product) and ``|theta_j| <= gamma_D / 2 + u + 3 u_op`` (the
norm's error enters scaled by ``n / (n + 1e-8) <= 1``, plus the addition and the division);
then a dot product over ``D`` terms in any order, fused or not, is within ``gamma_D sum_j
|k_hat'_j PiT[j, d]|`` of its exact value (Higham, Accuracy and Stability of Numerical Algorithms,
section 3.1). With ``A_d = sum_j |k_hat_j PiT[j, d]|`` (float64, from the inputs):

    |y'_d - y_d| <= 1.01 (1.5 gamma_D + u + 3 u_op + (2D + 4) 2^-53) A_d = tau_d.

The 1.01 absorbs the second-order terms of the ``(1 + delta)`` products (their first-order sum is
below ``2^-8`` for ``D <= 1024``, TF32 operands included); ``(2D + 4) 2^-53`` is golden's own
float64 error. ``A_d <= ||k_hat|| ||PiT[:, d]|| <= 1``, about 0.8 for a Hadamard ``PiT``, so at
``D = 128`` the band is about ``1e-5`` wide against boundaries ~``0.02`` apart (about 0.05% of the
codes fall in it; the errors measured are 30 to 1000 times smaller than this worst case).

Tensor-core rotations (:class:`GemmRounding`, ``compare_store(..., gemm=...)``). A GEMM on TF32
operands rounds each to 10 mantissa bits, ``operand_unit = 2^-10``, which adds ``2 * operand_unit
* A_d`` (:data:`TF32_GEMM`). The 3xTF32 GEMM (Triton's ``input_precision="tf32x3"``, the sm_90
store) splits ``a = big + small`` with ``big`` = ``a`` rounded to TF32 and ``small = a - big``
(exact, ``|small| <= 2^-11 |a|``), and sums ``big*big + big*small + small*big``: ``small`` loses
at most ``2^-10`` of itself to TF32 (``2^-21 |a|``) and the dropped ``small*small`` is at most
``2^-22 |a b|``, so each product is within ``1.25 * 2^-20 |a b|`` (:data:`TF32X3_GEMM` takes
``operand_unit = 2^-19``, twice that). Its fp32 accumulator sees ``3D`` addends, and a tensor
core aligns the addends of a step to the largest exponent and keeps few extra bits (Fasi et al.,
2021, report truncation; Valpey et al., 2025, a limited carry and no round-to-zero; ``papers.md``):
each addition within ``2u`` of the largest magnitude, which is at most ``A_d``, covers both. So
the dot's ``gamma_D`` becomes ``gamma(3D, 2u)``: at ``D = 128`` the band is about 5 times the
fp32 one, still far below the narrowest code gap
(``tests/test_turboquant.py::test_tie_bands_are_narrower_than_one_step``). For 16-bit keys the
sm_90 store uses two TF32 products instead: ``k 2^-e`` (``2^e <= max |k|``) is exact and already
TF32, ``PiT = hi + lo`` with ``hi`` truncated to TF32 and ``lo`` losing at most ``2^-10`` of itself
in the MMA, so each product is within ``2^-20 |k_j PiT[j, d]|`` of itself, with ``2D`` addends and
the normalization ``2^e / (n + 1e-8)`` applied to the sum (one reciprocal and one product, which the
bound already counts): :data:`TF32X3_GEMM` covers it too. The sm_90 fast path
(``triton_impl/turboquant_sm90.py``, bf16 keys at ``D = 128``) sums ``k @ hi + k @ lo`` on bf16 tensor
cores, ``hi`` = ``PiT`` rounded to bf16 (to nearest, ``|PiT - hi| <= 2^-8 |PiT|``) and ``lo`` = the
rest rounded to bf16 (``|rest - lo| <= 2^-8 |rest|``), so each product is within ``2^-16 |k_j
PiT[j, d]|`` of itself, with ``2D`` addends: :data:`BF16X2_GEMM`. At ``D = 128`` its band is inside
:data:`TF32X3_GEMM`'s (``tests/test_turboquant.py::test_bf16x2_band_lies_inside_the_tf32x3_band``), so
a check with the latter holds either kernel to a bound it must meet. The bound needs
``n < 2^64`` (every square finite in fp32); a key past it is outside the fp32 model, and its codes
are not checked (its stored norm still is: it must saturate at 65504).

The other bands, by the same count: stored norm ``x = n`` within ``gamma_D / 2 + u_op`` relative,
``x = n / sqrt(||c[idx]||^2 + 1e-16)`` (on the store's own codes) within ``gamma_D + u + 4 u_op``;
value scale ``(vmax - vmin) / (2^b - 1)`` within ``u + 2 u_op``; value level ``t = (v - vmin) /
scale`` plus the 0.5 within ``(3 u + 3 u_op)(|t| + 0.5)``; each times 1.01, plus golden's float64
error. ``vmin`` is an exact minimum, so the zero field must equal golden's; FP8 key bytes are one
rounding of an exact input, so they must be equal too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from einops import einsum, rearrange

from golden import turboquant as tq
from golden.turboquant import TurboQuantConfig, hadamard_rotation, solve_lloyd_max, turboquant_decode_attention
from triton_impl.launch import current_target
from triton_impl.parity import Case, Check
from triton_impl.tolerances import tolerance
from triton_impl.turboquant import (
    gluon_stage1,
    hadamard_query_in_stage1,
    rotate_query_launch,
    select_decode_config,
    select_store_config,
    triton_turboquant_decode_attention_v2,
    triton_turboquant_store,
)
from triton_impl.turboquant_sm90 import STORE_FIELDS_EVICTION, STORE_STREAM_EVICTION

U = 2.0**-24  # fp32 unit roundoff
U_OP = 2.0**-22  # one fp32 operation rounded within 2 ulp
U64 = 2.0**-53  # float64 unit roundoff (golden's own error)
SECOND_ORDER = 1.01
FP32_MODEL_MAX_NORM = 2.0**64  # the bound's precondition: every k_d^2 finite in fp32


def _gamma(n: int, unit: float = U) -> float:
    return n * unit / (1 - n * unit)


@dataclass(frozen=True)
class GemmRounding:
    """How a store's rotation GEMM ``k_hat @ PiT`` rounds (module docstring).

    ``operand_unit``: relative error of each product from rounding its operands (0: exact fp32
    products); ``passes``: the accumulator sums ``passes * D`` addends; ``accumulation_unit``: each
    addition's error relative to the largest magnitude summed so far.
    """

    operand_unit: float = 0.0
    passes: int = 1
    accumulation_unit: float = U


FP32_GEMM = GemmRounding()
TF32_GEMM = GemmRounding(operand_unit=2.0**-10)
TF32X3_GEMM = GemmRounding(operand_unit=2.0**-19, passes=3, accumulation_unit=2 * U)
BF16X2_GEMM = GemmRounding(operand_unit=2.0**-17, passes=2, accumulation_unit=2 * U)


def kernel_store_gemm(device: torch.device) -> GemmRounding:
    """The rounding of ``triton_turboquant_store``'s rotation on ``device`` (its launch config)."""
    return TF32X3_GEMM if select_store_config(device)["TF32X3"] else FP32_GEMM


def rotation_tolerance(key: torch.Tensor, PiT: torch.Tensor, gemm: GemmRounding = FP32_GEMM) -> torch.Tensor:
    """``tau [T, HKV, D]`` float64: a bound on ``|y'_d - y_d|`` for any fp32 store whose rotation GEMM
    rounds as ``gemm`` says (module docstring)."""
    head_dim = key.shape[-1]
    k = key.to("cpu", torch.float64)
    n = torch.linalg.vector_norm(k, dim=-1)
    a = (k.abs() / (n + tq.KEY_NORM_EPS)[..., None]) @ PiT.to("cpu", torch.float64).abs()
    coeff = SECOND_ORDER * (_gamma(head_dim) / 2 + dot_unit(gemm, head_dim) + U + 3 * U_OP + (2 * head_dim + 4) * U64)
    return coeff * a


def dot_unit(gemm: GemmRounding, head_dim: int) -> float:
    """A ``head_dim``-term dot product that rounds as ``gemm`` says is within this times ``sum_j |a_j b_j|`` of
    its exact value (the module docstring)."""
    return _gamma(gemm.passes * head_dim, gemm.accumulation_unit) + 2 * gemm.operand_unit


def norm_tolerance(head_dim: int, norm_correction: bool) -> float:
    """Relative band of the stored key norm before its fp16 rounding."""
    if norm_correction:
        return SECOND_ORDER * (_gamma(head_dim) + U + 4 * U_OP + (2 * head_dim + 4) * U64)
    return SECOND_ORDER * (_gamma(head_dim) / 2 + U_OP + (head_dim + 2) * U64)


SCALE_TOLERANCE = SECOND_ORDER * (U + 2 * U_OP + 2 * U64)


def value_tolerance(t: torch.Tensor) -> torch.Tensor:
    """Absolute band of ``t + 0.5`` (``t`` the exact level of a value, float64)."""
    return SECOND_ORDER * (3 * U + 3 * U_OP + 4 * U64) * (t.abs() + 0.5)


def fp16_band(x: torch.Tensor, rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 values a store may write for ``x`` known to ``rel`` relative: ``fp16(clamp(x -+ rel |x|))``.

    Clamping and rounding are monotone, so a correct store's value lies between the two; far from
    an fp16 tie they are equal (the value must be golden's), near one they are adjacent (one ulp).
    """
    width = torch.where(x.isfinite(), rel * x.abs(), 0.0)  # an infinite x saturates: its band is the one value
    return tq.fp16_saturated(x - width).to(torch.float64), tq.fp16_saturated(x + width).to(torch.float64)


@dataclass
class Tally:
    """One stored quantity: how many were compared, lay in a tie band (either neighbour allowed),
    differ from golden, and break the check."""

    compared: int = 0
    ties: int = 0
    differ: int = 0
    violations: int = 0

    def add(self, actual: torch.Tensor, golden: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Count ``actual`` against ``golden`` and its band ``[lo, hi]`` where ``mask``; the violations."""
        mask = torch.ones_like(actual, dtype=torch.bool) if mask is None else mask.expand_as(actual)
        both_nan = golden.isnan() & actual.isnan()  # a NaN input's field must stay NaN
        bad = ~((lo <= actual) & (actual <= hi) | both_nan) & mask
        self.compared += int(mask.sum())
        self.ties += int(((lo != hi) & mask).sum())
        self.differ += int(((actual != golden) & ~both_nan & mask).sum())
        self.violations += int(bad.sum())
        return bad


@dataclass
class StoreComparison:
    """The result of :func:`compare_store`: ``ok`` and a tally per stored quantity."""

    tallies: dict[str, Tally] = field(default_factory=dict)
    outside_fp32_model: int = 0  # keys with n >= 2^64: codes not checked
    violation_flags: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))

    @property
    def ok(self) -> bool:
        return all(t.violations == 0 for t in self.tallies.values())

    def ties(self, name: str) -> int:
        return self.tallies[name].ties if name in self.tallies else 0

    def summary(self) -> str:
        parts = [f"{name}: {t.violations} wrong, {t.ties} in the tie band, {t.differ} differ from golden, of "
                 f"{t.compared}" for name, t in self.tallies.items()]  # fmt: skip
        if self.outside_fp32_model:
            parts.append(f"{self.outside_fp32_model} keys with a norm past 2^64 (codes not checked)")
        return "; ".join(parts)


def compare_store(
    actual: torch.Tensor,
    before: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    config: TurboQuantConfig,
    gemm: GemmRounding = FP32_GEMM,
) -> StoreComparison:
    """Check a store's cache ``actual`` (written over ``before``) against golden's float64 store.

    Every byte outside the written slots' records and fp16 fields equals ``before``. In each
    written slot: a key code equals golden's unless its ``y_d`` lies within ``tau_d`` of a
    boundary, where it is either neighbouring cell (``code(y - tau) <= code <= code(y + tau)``,
    and at most one step from golden's); a value code likewise around the ``.5`` of its level;
    the norm (checked against the store's own codes when norm correction is on) and the scale lie
    in :func:`fp16_band`; the zero and FP8 key bytes are golden's exactly. The bands come from the
    fp32 error bound in the module docstring, so any correct fp32 store passes, whatever its
    summation order or division. A negative slot is skipped, as by the stores.

    Args:
        actual, before: uint8 caches ``[blocks, block_size, HKV, padded_slot]``, any device.
        key, value, slot_mapping, PiT, boundaries, centroids, config: the store's arguments.
        gemm: how the store's rotation GEMM rounds (:func:`kernel_store_gemm` for this package's kernel).

    Returns:
        A :class:`StoreComparison`; ``violation_flags`` has one uint8 per compared quantity and
        byte (1 = wrong), for an exact comparison against zeros.
    """
    actual, before = actual.cpu(), before.cpu()
    keep = slot_mapping.cpu() >= 0
    slots = slot_mapping.cpu()[keep].to(torch.int64)
    key, value = key.cpu()[keep], value.cpu()[keep]
    block_size = before.shape[1]
    blk, pos = slots // block_size, slots % block_size
    result = StoreComparison()
    flags = []

    written = torch.zeros_like(before)
    data_mark, meta_mark = tq.cache_regions(written, config)
    data_mark[blk, pos] = 1
    meta_mark[blk, :, :, pos] = 1
    outside = written == 0
    other = result.tallies.setdefault("other bytes", Tally())
    flags.append(other.add(actual[outside], before[outside], before[outside], before[outside]))

    data, meta = tq.cache_regions(actual, config)
    records = data[blk, pos]  # [T', HKV, data bytes]
    fields = tq.read_meta(meta[blk, :, :, pos]).to(torch.float64)  # [T', HKV, fields]
    key_bytes, value_bytes = records[..., : config.key_data_bytes], records[..., config.key_data_bytes :]

    if config.key_fp8:
        expected = tq.e4m3_bytes(key)
        flags.append(result.tallies.setdefault("fp8 key bytes", Tally()).add(key_bytes, expected, expected, expected))
    else:
        n, y = tq.rotate_keys(key, PiT.cpu())
        boundaries = boundaries.cpu()
        tau = rotation_tolerance(key, PiT, gemm)
        codes = tq.unpack_codes(key_bytes, config.key_quant_bits)
        golden = tq.nearest_cell(y, boundaries)
        lo = torch.maximum(tq.nearest_cell(y - tau, boundaries), golden - 1)
        hi = torch.minimum(tq.nearest_cell(y + tau, boundaries), golden + 1)
        in_model = (n < FP32_MODEL_MAX_NORM)[..., None]
        result.outside_fp32_model = int((~in_model).sum())
        flags.append(result.tallies.setdefault("key codes", Tally()).add(codes, golden, lo, hi, in_model))
        x = tq.corrected_norm(n, codes, centroids.cpu()) if config.norm_correction else n
        lo16, hi16 = fp16_band(x, norm_tolerance(config.head_dim, config.norm_correction))
        golden16 = tq.fp16_saturated(x).to(torch.float64)
        flags.append(result.tallies.setdefault("key norms", Tally()).add(fields[..., 0], golden16, lo16, hi16))

    bits = config.value_quant_bits
    t, scale, vmin = tq.value_levels(value, bits)
    codes = tq.unpack_codes(value_bytes, bits)
    tau = value_tolerance(t)
    golden = tq.round_levels(t, bits)
    lo = torch.maximum(tq.round_levels(t - tau, bits), golden - 1)
    hi = torch.minimum(tq.round_levels(t + tau, bits), golden + 1)
    flags.append(result.tallies.setdefault("value codes", Tally()).add(codes, golden, lo, hi))
    lo16, hi16 = fp16_band(scale, SCALE_TOLERANCE)
    flags.append(result.tallies.setdefault("value scales", Tally()).add(
        fields[..., -2], tq.fp16_saturated(scale).to(torch.float64), lo16, hi16))  # fmt: skip
    zero = tq.fp16_saturated(vmin).to(torch.float64)
    flags.append(result.tallies.setdefault("value zeros", Tally()).add(fields[..., -1], zero, zero, zero))
    result.violation_flags = torch.cat([f.flatten() for f in flags]).to(torch.uint8)
    return result


def _case(name: str, preset: str, head_dim: int, heads: int, kv_heads: int, block_size: int = 16) -> Case:
    def run(device: torch.device) -> list[Check]:
        gpu = device.type == "cuda"
        lens = [1, 17, 129, 1000] if gpu else [1, 19]
        splits = 32 if gpu else 2  # upstream's default max_num_kv_splits on a GPU
        num_q_heads, num_kv_heads = (heads, kv_heads) if gpu else (heads // 2, kv_heads // 2 or 1)
        gen = torch.Generator().manual_seed(len(name))
        config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
        centroids, midpoints = solve_lloyd_max(head_dim, config.centroid_bits)
        pit = hadamard_rotation(head_dim).T.contiguous()

        pages = [-(-n // block_size) for n in lens]
        num_blocks = sum(pages) + 1
        order = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        slots, used = [], 0
        for b, n in enumerate(lens):
            table[b, : pages[b]] = order[used : used + pages[b]].to(torch.int32)
            used += pages[b]
            slots += [int(table[b, j // block_size]) * block_size + j % block_size for j in range(n)]
        tokens = len(slots)
        key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        query = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(torch.bfloat16)
        cache = torch.randint(0, 256, (num_blocks, block_size, num_kv_heads, config.slot_size_aligned),
                              dtype=torch.uint8, generator=gen)  # fmt: skip
        key, value, query, cache, table, pit, centroids, midpoints = (
            t.to(device) for t in (key, value, query, cache, table, pit, centroids, midpoints)
        )
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)

        before = cache.clone()
        triton_turboquant_store(key, value, cache, slot_mapping, pit, midpoints, config.key_mse_bits,
                                config.key_packed_size, config.value_quant_bits, config.key_fp8, centroids,
                                config.norm_correction)  # fmt: skip
        lse = torch.full((len(lens), num_q_heads), float("nan"), device=device)
        out = triton_turboquant_decode_attention_v2(
            query, cache, table, seq_lens, pit.T.contiguous(), centroids, head_dim**-0.5, config.key_mse_bits,
            config.key_packed_size, config.value_quant_bits, config.value_packed_size, key_fp8=config.key_fp8,
            norm_correction=config.norm_correction, lse_buf=lse, max_num_kv_splits=splits,
        )  # fmt: skip
        expected = decode_expected(query, cache, table, seq_lens, pit, centroids, head_dim**-0.5, config)
        store = compare_store(cache, before, key, value, slot_mapping, pit, midpoints, centroids, config,
                              kernel_store_gemm(device))
        ties = f"{store.ties('key codes')} key and {store.ties('value codes')} value codes in tie bands"
        return [
            Check(f"kv_cache ({ties})", store.violation_flags, torch.zeros_like(store.violation_flags), None),
            Check("out", out, expected.out, tolerance("turboquant", "out", query.dtype), expected.out_bound),
            Check("lse", lse, expected.lse, tolerance("turboquant", "lse", "float32")),
        ]

    return Case("turboquant", name, run)


def cases() -> list[Case]:
    return [
        _case("k8v4 D128 GQA 32/8", "turboquant_k8v4", 128, 32, 8),
        _case("4bit_nc D128 GQA 32/8", "turboquant_4bit_nc", 128, 32, 8),
        _case("k3v4_nc D128 GQA 32/8", "turboquant_k3v4_nc", 128, 32, 8),
        _case("3bit_nc D128 GQA 32/8", "turboquant_3bit_nc", 128, 32, 8),
        _case("4bit_nc D256 GQA 8/1", "turboquant_4bit_nc", 256, 8, 1),
        _case("3bit_nc D64 MHA 8/8 block 32", "turboquant_3bit_nc", 64, 8, 8, block_size=32),
    ]


def decode_bench_case(preset: str, length: int, batch: int = 32, heads: int = 32, kv_heads: int = 8,
                      mixed: bool = False):  # fmt: skip
    """The bench's TurboQuant decode case: ``batch`` requests of ``length`` keys (``mixed``: 1 .. ``length`` each,
    drawn once with seed 0, every table ``length`` keys long) at D=128, block 16, a random bf16 cache stored by the
    Triton store into shuffled blocks, timed against a bf16 GQA decode of the same shape."""
    from triton_impl.bench import Bench, BenchCase, device_paged_cache
    from triton_impl.decode_attention import _compute_num_kv_splits, decode_attention_fwd

    head_dim, block_size = 128, 16
    lengths = [length] * batch
    if mixed:  # each request 1 .. length keys, its table still length keys long
        lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()

    def setup(device: torch.device) -> Bench:
        config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
        centroids, midpoints = (t.to(device) for t in solve_lloyd_max(head_dim, config.centroid_bits))
        pit = hadamard_rotation(head_dim).T.contiguous().to(device)
        blocks = batch * length // block_size
        cache = torch.zeros(
            blocks, block_size, kv_heads, config.slot_size_aligned, dtype=torch.uint8, device=device
        )
        table = torch.randperm(blocks, device=device).to(torch.int32).view(batch, -1)
        positions = torch.arange(block_size, device=device)
        slots = (table.to(torch.int64)[:, :, None] * block_size + positions).flatten()
        key = torch.randn(slots.numel(), kv_heads, head_dim, device=device).to(torch.bfloat16)
        value = torch.randn_like(key)
        triton_turboquant_store(key, value, cache, slots, pit, midpoints, config.key_mse_bits,
                                config.key_packed_size, config.value_quant_bits, config.key_fp8, centroids,
                                config.norm_correction)  # fmt: skip
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        query = torch.randn(batch, heads, head_dim, device=device).to(torch.bfloat16)
        lse = torch.empty(batch, heads, device=device)
        sizes = (config.key_mse_bits, config.key_packed_size, config.value_quant_bits, config.value_packed_size)
        args = (query, cache, table, seq_lens, pit.T.contiguous(), centroids, head_dim**-0.5, *sizes)
        holder = type("Buffers", (), {})()  # buffers allocated once, reused by every call

        def run() -> torch.Tensor:
            return triton_turboquant_decode_attention_v2(*args, key_fp8=config.key_fp8,
                                                         norm_correction=config.norm_correction, lse_buf=lse,
                                                         buf_holder=holder)  # fmt: skip

        def check() -> list[Check]:
            out = run()
            expected = decode_expected(query[:1], cache, table[:1], seq_lens[:1], pit, centroids,
                                       head_dim**-0.5, config)  # fmt: skip
            out_tol = tolerance("turboquant", "out", query.dtype)
            return [
                Check("out", out[:1], expected.out, out_tol, expected.out_bound),
                Check("lse", lse[:1], expected.lse, tolerance("turboquant", "lse", "float32")),
            ]

        # bf16 GQA decode of the same shape: the baseline the compressed cache must beat.
        kv, kv_table = device_paged_cache(lengths, block_size, kv_heads, 2 * head_dim, torch.bfloat16,
                                          device)  # fmt: skip
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = _compute_num_kv_splits(length, sms)
        o_bf16 = torch.empty(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
        lse_bf16 = torch.empty(batch, heads, device=device)
        logits = torch.empty(batch, heads, splits, head_dim + 1, device=device)

        def bf16_decode() -> None:
            decode_attention_fwd(query, kv[..., :head_dim], kv[..., head_dim:], o_bf16, lse_bf16, kv_table,
                                 seq_lens, logits, splits, head_dim**-0.5, block_size)  # fmt: skip

        read = sum(-(-n // block_size) for n in lengths)  # the blocks the call reads
        nbytes = read * cache.stride(0) + query.numel() * 2 * 2 + table.numel() * 4
        flops = 2 * heads * sum(lengths) * 2 * head_dim
        return Bench(run, check, nbytes, flops, {"bf16 GQA decode": bf16_decode},
                     kernels=("_decode_stage1_kernel", "decode_stage1_kernel", "decode_stage1_streams_kernel",
                              "decode_stage1_warp_kernel", "decode_stage1_stream_k_kernel"))  # fmt: skip

    span = f"L=1-{length // 1024}K mixed" if mixed else f"L={length}"
    return BenchCase("turboquant", f"{preset} decode B={batch} Hq={heads} Hk={kv_heads} D=128 {span}", setup)


def bench_cases() -> list:
    """Decode per preset at B=32, Hq=32, Hk=8, D=128 (block 16), against a bf16 GQA decode of the same shape; and
    4-bit keys over a batch of mixed lengths (1 to 32K keys, drawn once with seed 0: 16.6K on average)."""
    presets = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
    decodes = [decode_bench_case(p, length) for length in (8192, 32768) for p in presets]
    decodes.append(decode_bench_case("turboquant_4bit_nc", 32768, mixed=True))
    stores = [store_case(p, 32 * 32768) for p in presets]
    return decodes + stores + [store_case(p, 32 * 32768, consecutive=True) for p in presets[1:]]


@triton.jit
def _scatter_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, num_rows, block_words, NUM_KV_HEADS: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, SLOT_WORDS: tl.constexpr, NUM_FIELDS: tl.constexpr,
                    ROW_WORDS: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Per (token, KV head) row: its key and value rows read whole (``ROW_WORDS`` 4-byte words each, contiguous
    ``[T, HKV, D]`` tensors) and folded by XOR into 32 words, which (and past them the unfolded words, for a slot of
    more than 32 words) are written to the row's slot data, and the first half-word to each of its ``NUM_FIELDS``
    fp16 fields: the store's traffic, to the store's addresses, with no arithmetic to speak of. A negative slot
    writes nothing. With the L2 eviction hints of the MSE presets' Gluon stores (``turboquant_sm90``'s
    ``STORE_STREAM_EVICTION`` and ``STORE_FIELDS_EVICTION``; the FP8 keys' portable store takes none: its
    baseline 1.616 ms without them, 1.666 with, perf_log.md's thirty-fourth session)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < num_rows
    slot = tl.load(slot_ptr + row // NUM_KV_HEADS, mask=live, other=-1).to(tl.int64)
    live = live & (slot >= 0)
    head = row % NUM_KV_HEADS
    block, position = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    words = tl.arange(0, ROW_WORDS)
    at = row[:, None].to(tl.int64) * ROW_WORDS + words[None, :]
    both = (tl.load(key_ptr + at, mask=live[:, None], other=0, eviction_policy=STORE_STREAM_EVICTION)
            ^ tl.load(value_ptr + at, mask=live[:, None], other=0, eviction_policy=STORE_STREAM_EVICTION))
    folded = tl.xor_sum(tl.reshape(both, [ROWS, ROW_WORDS // 32, 32]), axis=1)  # every word read is used
    half = tl.arange(0, 32)
    data = block * block_words + (position * NUM_KV_HEADS + head) * SLOT_WORDS
    tl.store(cache_ptr + data[:, None] + half[None, :], folded, mask=live[:, None] & (half[None, :] < SLOT_WORDS),
             eviction_policy=STORE_STREAM_EVICTION)
    if SLOT_WORDS > 32:  # FP8 keys: 48 words
        upper = live[:, None] & (words[None, :] >= 32) & (words[None, :] < SLOT_WORDS)
        tl.store(cache_ptr + data[:, None] + words[None, :], both, mask=upper, eviction_policy=STORE_STREAM_EVICTION)
    # fp16 fields [HKV][fields][block] after the block's data, in 2-byte units
    meta = 2 * (block * block_words + BLOCK_SIZE * NUM_KV_HEADS * SLOT_WORDS) + (head * NUM_FIELDS * BLOCK_SIZE
                                                                                 + position)  # fmt: skip
    first = tl.sum(tl.where(half[None, :] == 0, folded, 0), axis=1).to(tl.int16)
    for f in tl.static_range(NUM_FIELDS):
        tl.store(cache_ptr.to(tl.pointer_type(tl.int16)) + meta + f * BLOCK_SIZE, first, mask=live,
                 eviction_policy=STORE_FIELDS_EVICTION)


def scatter_slots(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  config: TurboQuantConfig) -> None:  # fmt: skip
    """The store's memory traffic with no arithmetic (:func:`_scatter_kernel`): each (token, KV head) row's key and
    value read whole, its slot's data bytes and fp16 fields written where the store writes them. For contiguous
    bf16 ``[T, HKV, D]`` keys and values with ``D = 128`` and slots in the cache (no checks: a benchmark's baseline,
    the ceiling of the access pattern)."""
    num_tokens, heads, head_dim = key.shape
    assert head_dim == 128 and key.is_contiguous() and value.is_contiguous() and kv_cache.stride(0) % 4 == 0
    rows = num_tokens * heads
    _scatter_kernel[(triton.cdiv(rows, 16),)](
        key.view(torch.int32), value.view(torch.int32), kv_cache.view(-1).view(torch.int32), slots, rows,
        kv_cache.stride(0) // 4, NUM_KV_HEADS=heads, BLOCK_SIZE=kv_cache.shape[1],
        SLOT_WORDS=config.data_bytes_per_slot // 4, NUM_FIELDS=config.num_meta_fields, ROW_WORDS=head_dim // 2,
        ROWS=16, num_warps=4,
    )  # fmt: skip


def store_case(preset: str, tokens: int, kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
               consecutive: bool = False):
    """The store of ``tokens`` bf16 keys and values (B=32 x L=32K at the defaults) into shuffled slots (a decode
    step's pattern) or consecutive ones (``consecutive``: a prefill's), timed against the copy roofline: it reads
    ``2 * 2`` bytes per key and value element and writes the slots' bytes; its baseline, :func:`scatter_slots`,
    moves the same bytes to the same addresses with no arithmetic: the ceiling of the access pattern. Checked
    first: the same kernel on the first 256 tokens, into a small cache, against the golden store
    (:func:`compare_store`)."""
    from triton_impl.bench import Bench, BenchCase

    def setup(device: torch.device) -> Bench:
        config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
        centroids, midpoints = (t.to(device) for t in solve_lloyd_max(head_dim, config.centroid_bits))
        pit = hadamard_rotation(head_dim).T.contiguous().to(device)
        shape = (tokens // block_size, block_size, kv_heads, config.slot_size_aligned)
        cache = torch.zeros(shape, dtype=torch.uint8, device=device)
        slots = torch.arange(tokens, device=device) if consecutive else torch.randperm(tokens, device=device)
        key = torch.randn(tokens, kv_heads, head_dim, device=device).to(torch.bfloat16)
        value = torch.randn_like(key)
        quant = (pit, midpoints, config.key_mse_bits, config.key_packed_size, config.value_quant_bits,
                 config.key_fp8, centroids, config.norm_correction)  # fmt: skip

        def run() -> None:
            triton_turboquant_store(key, value, cache, slots, *quant)

        def check() -> list[Check]:
            few = 256
            small = torch.zeros((few // block_size, *shape[1:]), dtype=torch.uint8, device=device)
            few_slots = torch.randperm(few, device=device)
            triton_turboquant_store(key[:few], value[:few], small, few_slots, *quant)
            store = compare_store(small.cpu(), torch.zeros_like(small).cpu(), key[:few].cpu(), value[:few].cpu(),
                                  few_slots.cpu(), pit.cpu(), midpoints.cpu(), centroids.cpu(), config,
                                  kernel_store_gemm(device))  # fmt: skip
            flags = store.violation_flags
            ties = f"{store.ties('key codes')} key and {store.ties('value codes')} value codes in tie bands"
            return [Check(f"kv_cache, first {few} tokens ({ties})", flags, torch.zeros_like(flags), None)]

        nbytes = key.numel() * 2 * 2 + (tokens // block_size) * cache.stride(0) + slots.numel() * 8
        scratch = torch.empty_like(cache)
        scatter = lambda: scatter_slots(key, value, scratch, slots, config)
        return Bench(run, check, nbytes, 0.0, {"scatter, no arithmetic": scatter})

    order = " consecutive slots" if consecutive else ""
    return BenchCase("turboquant", f"{preset} store Hk={kv_heads} D={head_dim} {tokens // 1024}K tokens{order}", setup)


def centroid_rounding_bound(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    PiT: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    config: TurboQuantConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on how far golden's decode moves when its centroids ``c`` become ``c' = fp16(c)``,
    the table the Triton decode reads (upstream's kernel rounds them the same way).

    Scores move by ``|s'_j - s_j| <= E_j = scale * n_j * sum_d |q~_d| |c'[idx_jd] - c[idx_jd]|``.
    ``lse`` is 1-Lipschitz in the scores' max norm, so ``|lse' - lse| <= E = max_j E_j``. Each
    softmax weight moves by a factor within ``e^(+-2E)``, and ``sum_j (p'_j - p_j) = 0``, so
    ``|out'_d - out_d| = |sum_j (p'_j - p_j)(v_jd - out_d)| <= (e^(2E) - 1) sum_j p_j |v_jd - out_d|``.
    FP8 keys read no centroids: both bounds are 0.

    Args:
        as :func:`golden.turboquant.turboquant_decode_attention`.

    Returns:
        ``(out_bound [B, H, D], lse_bound [B, H])`` float64 on the CPU; 0 for an empty request.
    """
    query, kv_cache, block_table, seq_lens, PiT, centroids = (
        t.cpu() for t in (query, kv_cache, block_table, seq_lens, PiT, centroids)
    )
    batch, num_heads, head_dim = query.shape
    out_bound = torch.zeros(batch, num_heads, head_dim, dtype=torch.float64)
    lse_bound = torch.zeros(batch, num_heads, dtype=torch.float64)
    if config.key_fp8:
        return out_bound, lse_bound
    num_kv_heads = kv_cache.shape[2]
    q = rearrange(query.to(torch.float64) @ PiT.to(torch.float64), "b (hkv g) d -> b hkv g d", hkv=num_kv_heads)
    error = (centroids.half().to(torch.float64) - centroids.to(torch.float64)).abs()
    for b in range(batch):
        length = int(seq_lens[b])
        if length == 0:
            continue
        key_bytes, values, fields = tq.read_tokens(kv_cache, block_table[b], length, config)
        moved = tq.reconstruct_rotated_keys(key_bytes, fields[..., 0].abs(), error, config.key_quant_bits)
        e = scale * einsum(q[b].abs(), moved, "hkv g d, l hkv d -> hkv g l").amax(dim=-1)  # E per row
        scores = scale * einsum(q[b], tq.reconstruct_rotated_keys(key_bytes, fields[..., 0], centroids,
                                                                    config.key_quant_bits),
                                "hkv g d, l hkv d -> hkv g l")  # fmt: skip
        p = torch.softmax(scores, dim=-1)
        o = einsum(p, values, "hkv g l, l hkv d -> hkv g d")  # golden's output of this request
        spread = (rearrange(values, "l hkv d -> hkv 1 l d") - o[:, :, None, :]).abs()
        spread = einsum(p, spread, "hkv g l, hkv g l d -> hkv g d")  # sum_j p_j |v_j - out|
        lse_bound[b] = rearrange(e, "hkv g -> (hkv g)")
        out_bound[b] = rearrange(torch.expm1(2 * e)[..., None] * spread, "hkv g d -> (hkv g) d")
    return out_bound, lse_bound


FP16_UNIT = 2.0**-11  # |fp16(x) - x| <= 2^-11 |x| + 2^-25 for |x| <= 65504 (to nearest; 2^-25: half the subnormal step)
FP16_SUBNORMAL = 2.0**-25
# sm_90's Gluon stage 1 feeds its value codes to the P V MMA as fp16 subnormals (``turboquant_sm90._code_halves``: a
# code's bits masked in place are the fp16 ``c 2^-24``). The products are exact, but a step's sum rounds more coarsely
# than with the same codes as normal fp16 (likely as the tensor cores align a step's products to an exponent read off
# the operands, a subnormal's ``2^-14`` whatever its bits). Measured on an H100 (the H200's tensor cores;
# ``benchmarks/mma_subnormal_codes.py``, and ``tests/test_turboquant.py::test_mma_multiplies_fp16_subnormals_exactly``
# on every GPU run): over 400 random ``k16`` steps of codes 0-15 (a word's unshifted code: the furthest below
# ``2^-14``), a step moved its outputs, in code units, by at most ``2^-12.8 max_k |w_k|`` beyond fp32's own rounding,
# where the same codes as normal fp16 stayed within it; the bound takes ``2^-10``, 7 times that.
SUBNORMAL_CODES = 2.0**-10


def weight_rounding_bound(
    query_basis: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    config: TurboQuantConfig,
    num_splits: int | None = None,
    ranges: list[list[tuple[int, int]]] | None = None,
    subnormal_codes: bool = False,
) -> torch.Tensor:
    """A bound on how far a decode that rounds each value weight ``w_j = p_j * v_scale_j`` to fp16 before its ``P V``
    product (not as an fp16 hi + lo pair) moves from golden scored with the same query and centroids.

    For a kernel that rounds its query to fp16 once too (``FP16_OPERANDS``), ``query_basis`` is that query in the
    keys' basis (for MSE keys, the kernel's own rotated query rounded to fp16: :func:`kernel_rotated_query`) and
    golden is run on it with ``PiT`` the identity and the kernel's fp16 centroids: then the scores agree but for fp32
    sums (the tolerance table's part) and only the weights differ. Per split the output is ``(sum_j fp16(w_j)
    code_jd + sum_j p_j zero_j) / l`` with ``p_j <= 1`` against the split's running max and ``l >= 1``, and the
    splits merge with weights summing to 1, so ``|fp16(w) - w| <= 2^-11 w + 2^-25`` moves it by at most ``2^-11
    sum_j pi_j |v_jd - zero_j| + 2^-25 sum_j |code_jd|`` (``pi`` golden's softmax over the keys summed, ``|code_jd|
    = |v_jd - zero_j| / v_scale_j``; a zero scale makes ``w_j = 0`` exactly). ``lse`` does not see the weights.
    With ``subnormal_codes`` (sm_90's Gluon stage 1, :data:`SUBNORMAL_CODES`), each MMA step moves the sum by at most
    ``SUBNORMAL_CODES max_k w_k`` in code units (a row's codes multiplied by ``2^f`` in the operand only shrink it
    there), and the steps' largest weights sum to at most ``sum_j w_j``: ``SUBNORMAL_CODES sum_j pi_j v_scale_j`` more.

    Args:
        query_basis: ``[B, H, D]`` the query as the kernel scores it (float64 values); the rest as
            :func:`golden.turboquant.turboquant_decode_attention` (``centroids``: the ones the kernel reads).
        num_splits: the bound of each split's state (:func:`golden.turboquant.split_ranges`, the sums over that
            split's keys) instead of the merged output's; ranges: the splits' key ranges instead
            (:func:`golden.turboquant.turboquant_decode_split_states`).

    Returns:
        ``[B, H, D]`` (``[B, H, S, D]`` with ``num_splits``) float64 on the CPU; 0 for an empty request or split.
    """
    query_basis, kv_cache, block_table, seq_lens, centroids = (
        t.cpu() for t in (query_basis, kv_cache, block_table, seq_lens, centroids)
    )
    num_kv_heads = kv_cache.shape[2]
    q = rearrange(query_basis.to(torch.float64), "b (hkv g) d -> b hkv g d", hkv=num_kv_heads)
    batch, num_heads, head_dim = query_basis.shape
    out_bound = torch.zeros(batch, num_heads, num_splits or 1, head_dim, dtype=torch.float64)
    for b in range(batch):
        length = int(seq_lens[b])
        if length == 0:
            continue
        key_bytes, values, fields = tq.read_tokens(kv_cache, block_table[b], length, config)
        keys = tq.score_basis_keys(key_bytes, fields, centroids, config)
        scores = scale * einsum(q[b], keys, "hkv g d, l hkv d -> hkv g l")
        v_scale, v_zero = fields[..., -2, None], fields[..., -1, None]  # [L, HKV, 1]
        levels = (values - v_zero).abs()  # |code * v_scale|
        codes = torch.where(v_scale != 0, levels / v_scale.abs(), 0.0)  # [L, HKV, D]
        cuts = tq.request_splits(length, num_splits, None if ranges is None else ranges[b]) if num_splits else [
            (0, length)]  # fmt: skip
        for split, (lo, hi) in enumerate(cuts):
            if hi <= lo:
                continue
            p = torch.softmax(scores[..., lo:hi], dim=-1)
            bound = FP16_UNIT * einsum(p, levels[lo:hi], "hkv g l, l hkv d -> hkv g d")
            bound += FP16_SUBNORMAL * codes[lo:hi].sum(dim=0)[:, None, :]
            if subnormal_codes:
                bound += SUBNORMAL_CODES * einsum(p, v_scale[lo:hi, :, 0].abs(), "hkv g l, l hkv -> hkv g")[..., None]
            out_bound[b, :, split] = rearrange(bound, "hkv g d -> (hkv g) d")
    return out_bound if num_splits else out_bound[:, :, 0]


def kernel_rotated_query(query: torch.Tensor, PiT: torch.Tensor, precision: str, num_splits: int = 1) -> torch.Tensor:
    """The decode's first launch alone (``turboquant.rotate_query_launch``, as the decode plan builds it): ``query @
    PiT`` in fp32 (``precision``: ``"ieee"`` or ``"tf32x3"``) into each split slot of a partials buffer on the
    query's device, read back as ``[B, H, S, D]``. The rotation's value does not depend on ``PiT``'s strides. Of the
    LSE column it writes the first slot's alone, with zeros (stream-K's counts)."""
    batch, heads, head_dim = query.shape
    partials = torch.full((batch, heads, num_splits, head_dim + 1), float("nan"), device=query.device)
    launch = rotate_query_launch(query, PiT.stride(), partials, precision)
    launch(current_target()[1], query, PiT, partials)
    if not bool((partials[:, :, 0, head_dim] == 0).all() and partials[:, :, 1:, head_dim].isnan().all()):
        raise AssertionError("the query rotation's LSE column: expected zeros in the first slot, nothing in the rest")
    return partials[..., :head_dim]


def score_dim(k: torch.Tensor) -> torch.Tensor:
    """The head dimension sm_90's decode holds at K index ``k`` of its scores' query operand
    (``turboquant_sm90._score_dim``): ``32 ((k >> 1) & 3) + 4 (k >> 4) + 2 ((k >> 3) & 1) + (k & 1)``."""
    return ((k >> 1) & 3) * 32 + (k >> 4) * 4 + ((k >> 3) & 1) * 2 + (k & 1)


def hadamard_query(query: torch.Tensor, c: float) -> torch.Tensor:
    """``query @ PiT`` for ``PiT = c H_128`` in the fp32 operations sm_90's one-warp stage 1 rotates it with
    (``turboquant_sm90._hadamard_query``, where ``turboquant.hadamard_query_in_stage1``): the query in K order
    (:func:`score_dim`), the butterflies ``(a + b, a - b)`` over K-index bits 0 to 6, then one product by ``c``;
    back in dimension order, ``[B, H, D]`` float32 on the CPU (the kernel scores it rounded to fp16)."""
    head_dim = query.shape[-1]
    order = score_dim(torch.arange(head_dim))
    x = query.cpu().float()[..., order]
    for bit in range(head_dim.bit_length() - 1):
        pairs = x.reshape(*x.shape[:-1], head_dim >> (bit + 1), 2, 1 << bit)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(x.shape)
    out = torch.empty_like(x)
    out[..., order] = x * torch.tensor(c, dtype=torch.float32)
    return out


@dataclass(frozen=True)
class DecodeExpected:
    """What a decode call is checked against (:func:`decode_expected`): golden's ``out`` and ``lse`` (float64, on the
    CPU) and ``out_bound``, the per-element allowance beyond the tolerance table (``None``: the table alone)."""

    out: torch.Tensor
    lse: torch.Tensor
    out_bound: torch.Tensor | None


def decode_expected(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    PiT: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    config: TurboQuantConfig,
    num_splits: int | None = None,
    ranges: list[list[tuple[int, int]]] | None = None,
) -> DecodeExpected:
    """Golden's decode as a call of ``triton_turboquant_decode_attention_v2`` on ``kv_cache``'s device is checked
    against, under the decode config that device selects now (``select_decode_config``).

    Both ways golden reads the kernel's fp16 centroids (:func:`centroid_rounding_bound` bounds that against the
    exact codebook). With the config's ``FP16_OPERANDS`` off, golden scores the exact ``query @ PiT`` and the table
    alone applies. With it on, the kernel scores ``fp16(q~)``, its own fp32 rotation rounded once to fp16 (FP8
    keys: ``fp16(query)``), and rounds each value weight once to fp16: golden is fed that query (read back by
    :func:`kernel_rotated_query`, or where stage 1 rotates it, :func:`hadamard_query`; ``PiT`` then the identity), so
    the scores agree, and :func:`weight_rounding_bound` covers the weights (and, where sm_90's Gluon stage 1 serves
    the call, its value codes as fp16 subnormals: :data:`SUBNORMAL_CODES`). With ``num_splits``: stage 1's split
    states (``turboquant_decode_split_states``, over ``ranges`` where given: a stream-K division), ``out`` as ``[B,
    H, S, D]`` and ``lse`` as ``[B, H, S]``.
    """
    device = kv_cache.device
    key_bits = 8 if config.key_fp8 else config.key_mse_bits
    entry = select_decode_config(device, key_bits, config.value_quant_bits)
    read = centroids.cpu().half().float()
    host = [t.cpu() for t in (kv_cache, block_table, seq_lens)]
    if entry.get("FP16_OPERANDS"):
        if config.key_fp8:
            basis = query.cpu().half().double()
        elif hadamard_query_in_stage1(query, kv_cache, PiT, config.key_mse_bits, config.value_quant_bits):
            basis = hadamard_query(query, float(PiT[0, 0])).half().double()
        else:
            precision = "tf32x3" if entry.get("ROTATE_TF32X3") else "ieee"
            rotated = kernel_rotated_query(query.to(device), PiT.to(device), precision)
            basis = rotated[:, :, 0].cpu().half().double()
        rotation = torch.eye(query.shape[-1], dtype=torch.float64)
        subnormal = gluon_stage1(query, kv_cache, key_bits, config.value_quant_bits)
        bound = weight_rounding_bound(basis, *host, read, scale, config, num_splits, ranges, subnormal)
    else:
        basis, rotation, bound = query.cpu(), PiT.cpu(), None
    if num_splits:
        out, lse = tq.turboquant_decode_split_states(basis, *host, rotation, read, scale, config, num_splits, ranges)
    else:
        out, lse = turboquant_decode_attention(basis, *host, rotation, read, scale, config)
    return DecodeExpected(out, lse, bound)
