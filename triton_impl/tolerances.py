"""The one tolerance table: (op, output, dtype) -> (atol, rtol, reason).

Tests and the parity command both read it; ``tests/TOLERANCES.md`` is generated from it by
``python -m triton_impl tolerances`` (a test checks the file is current).

A value passes when ``|actual - expected| <= atol + rtol * |expected|`` elementwise (plus a derived per-element bound
where a check passes one), where
``expected`` is the golden model in float64 on the same (quantized) inputs. Infinities must match
exactly and NaN never passes. Bit-level outputs (cache bytes, scale codes, indices, lengths) are
compared exactly and have no entry here; TurboQuant's store is the exception, a code or fp16 field
falling either way of a decision boundary within the fp32 error bound derived in
``triton_impl/parity/turboquant.py`` (``compare_store``). Every entry has a negative control in the tests: a
deliberately wrong variant of the computation must fail it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    reason: str


# bf16 has 8 significant bits: one final rounding is at most 2^-8 relative (0.4%); fp16 has 11
# (2^-11). Attention outputs are convex combinations of values of magnitude ~1, so their error is
# absolute, not relative: atol is the bound that matters, rtol only covers large values.
TOLERANCES: dict[tuple[str, str, str], Tolerance] = {
    ("lse_merge", "o", "float32"): Tolerance(
        1e-5, 1e-5, "fp32 weights and sum over <= 64 states: a few fp32 ulps of O(1) values"
    ),
    ("lse_merge", "o", "float16"): Tolerance(
        2e-3, 2e-3, "inputs and output rounded to fp16 (2^-11 each); fp32 merge in between"
    ),
    ("lse_merge", "o", "bfloat16"): Tolerance(
        1.6e-2, 1.6e-2, "inputs and output rounded to bf16 (2^-8 each); fp32 merge in between"
    ),
    ("lse_merge", "lse", "float32"): Tolerance(
        1e-5, 1e-6, "max + log of a sum of <= 64 fp32 weights in [0, 1]: fp32 rounding"
    ),
    ("lse_merge", "lse", "bfloat16"): Tolerance(
        0.0, 4e-3, "LSE stored in the model dtype as serving passes it: one bf16 rounding, <= 2^-8 relative"
    ),
    # decode_attention: "o" is keyed by the query (model) dtype, which is also the output dtype in
    # serving; "lse" by the LSE's own dtype (fp32, or the model dtype as forward_mqa passes it).
    ("decode_attention", "o", "float32"): Tolerance(
        2e-5, 2e-5, "fp32 query and cache, IEEE fp32 dots, exp2 softmax, fp32 split merge: fp32 ulps of O(1) values"
    ),
    ("decode_attention", "o", "bfloat16"): Tolerance(
        1e-2, 8e-3, "output rounded to bf16 (2^-8 relative), with splits each partial output before it (2^-8); "
        "compiled, probabilities enter the PV dot as bf16 (2^-8)"
    ),
    ("decode_attention", "o", "float16"): Tolerance(
        2e-3, 2e-3, "output rounded to fp16 (2^-11 relative); compiled, probabilities enter the PV dot as fp16 (2^-11)"
    ),
    ("decode_attention", "lse", "float32"): Tolerance(
        2e-5, 1e-5, "scores from exact 16-bit/FP8 products (FP8 scale applied to fp32 scores), fp32 sums, exp2/log2"
    ),
    ("decode_attention", "lse", "bfloat16"): Tolerance(
        1e-5, 4e-3, "LSE stored in bf16 as serving passes it: one rounding (<= 2^-8 relative) of an fp32-accurate value"
    ),
    ("decode_attention", "lse", "float16"): Tolerance(
        1e-5, 1e-3, "LSE stored in fp16: one rounding (<= 2^-11 relative) of an fp32-accurate value"
    ),
    # mla_verify: "o" and "split_o" (stage-1 partials: bf16 for a bf16 output, else fp32) are keyed by the query
    # dtype, which sets the dot operands' precision; an FP8 cache dequantizes exactly to it (k_scale folds into fp32
    # results).
    ("mla_verify", "o", "bfloat16"): Tolerance(
        1e-2, 8e-3, "output rounded to bf16 (2^-8 relative), with splits each partial output before it (2^-8); "
        "compiled, probabilities enter the PV dot as bf16 (2^-8)"
    ),
    ("mla_verify", "o", "float16"): Tolerance(
        2e-3, 2e-3, "output rounded to fp16 (2^-11 relative); compiled, probabilities enter the PV dot as fp16 (2^-11)"
    ),
    ("mla_verify", "split_o", "bfloat16"): Tolerance(
        6e-3, 6e-3, "partial outputs rounded to bf16 (2^-8 relative); compiled, probabilities enter the PV dot as "
        "bf16 (2^-8 relative each)"
    ),
    ("mla_verify", "split_o", "float16"): Tolerance(
        1e-3, 1e-3, "fp32 partial outputs; compiled, probabilities enter the PV dot as fp16 (2^-11 relative each)"
    ),
    ("mla_verify", "lse", "float32"): Tolerance(
        2e-5, 1e-5, "scores from exact 16-bit/FP8 products summed in fp32 over Lk columns, exp2/log2 in fp32"
    ),
    ("turboquant", "out", "float16"): Tolerance(
        1e-4,
        5e-4,
        "output rounded to fp16 (<= 2^-11 relative); query and p*scale as fp16 hi+lo MMA operands "
        "(~2^-22), codes exact, fp32 sums; golden reads the kernel's fp16 centroids (exact: centroid_rounding_bound). "
        "FP16_OPERANDS (the sm90 entry): golden reads the kernel's fp16 query, plus weight_rounding_bound (with "
        "its SUBNORMAL_CODES term where the Gluon stage 1 feeds value codes to the MMA as fp16 subnormals)",
    ),
    ("turboquant", "out", "bfloat16"): Tolerance(
        1e-4,
        4e-3,
        "output rounded to bf16 (<= 2^-8 relative); query and p*scale as fp16 hi+lo MMA operands "
        "(~2^-22), codes exact, fp32 sums; golden reads the kernel's fp16 centroids. "
        "FP16_OPERANDS: golden reads the kernel's fp16 query, plus weight_rounding_bound (and SUBNORMAL_CODES)",
    ),
    ("turboquant", "split_o", "float32"): Tolerance(
        1e-4,
        2e-5,
        "fp32 stage-1 partials: fp16 hi+lo MMA operands (~2^-22 per product), fp32 sums of <= L terms; "
        "golden reads the kernel's fp16 centroids. FP16_OPERANDS: the fp16 query, plus each split's weight bound "
        "(and SUBNORMAL_CODES)",
    ),
    ("turboquant", "lse", "float32"): Tolerance(
        2e-5,
        2e-6,
        "scores: the query as fp16 hi+lo against fp16 centroids or exact e4m3 keys, exp2/log2 and the "
        "running max in fp32; golden reads the same fp16 centroids (centroid_rounding_bound: the exact codebook). "
        "FP16_OPERANDS: golden scores the kernel's own fp16 query",
    ),
}


def tolerance(op: str, output: str, dtype: torch.dtype | str) -> Tolerance:
    """Look up an entry; a missing entry is an error, never a silent default."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    try:
        return TOLERANCES[(op, output, name)]
    except KeyError:
        raise KeyError(f"no tolerance for op={op!r} output={output!r} dtype={name!r}") from None


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    max_rel: float
    ok: bool
    detail: str = ""


def compare(
    actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, bound: torch.Tensor | None = None
) -> Comparison:
    """Compare ``actual`` with the float64 ``expected`` under ``tol``; see the module docstring. ``bound`` (float64,
    ``expected``'s shape) widens each element's allowance by a derived error bound where the kernel rounds on
    purpose what golden does not (TurboQuant's ``FP16_OPERANDS``: ``weight_rounding_bound``)."""
    if actual.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), False, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if bool(torch.isnan(a).any()) or bool(torch.isnan(e).any()):
        return Comparison(float("nan"), float("nan"), False, "NaN present")
    inf = torch.isinf(a) | torch.isinf(e)
    if not torch.equal(a[inf], e[inf]):
        return Comparison(float("inf"), float("inf"), False, "infinities differ")
    finite = ~inf
    diff = (a[finite] - e[finite]).abs()
    if diff.numel() == 0:
        return Comparison(0.0, 0.0, True)
    ref = e[finite].abs()
    max_abs = float(diff.max())
    max_rel = float((diff / ref.clamp(min=1e-30)).max())
    allowed = tol.atol + tol.rtol * ref
    if bound is not None:
        allowed = allowed + bound.detach().to("cpu", torch.float64).expand(e.shape)[finite]
    excess = diff - allowed
    ok = bool((excess <= 0).all())
    detail = "" if ok else f"worst excess {float(excess.max()):.3g} at flat index {int(excess.argmax())}"
    return Comparison(max_abs, max_rel, ok, detail)


def markdown_table() -> str:
    """The table as markdown, for ``tests/TOLERANCES.md``."""
    lines = [
        "# Tolerances",
        "",
        "Generated by `python -m triton_impl tolerances` from `triton_impl/tolerances.py`; do not edit.",
        "",
        "A kernel output passes when `|actual - expected| <= atol + rtol * |expected|` elementwise,",
        "`expected` being the golden model in float64 on the same inputs; infinities must match and",
        "NaN never passes. Bit-level outputs (bytes, codes, indices, lengths) are compared exactly, except",
        "TurboQuant's store: its codes and fp16 fields may fall either way of a decision boundary within the",
        "fp32 error bound derived in `triton_impl/parity/turboquant.py` (`compare_store`), nowhere else.",
        "",
        "| op | output | dtype | atol | rtol | why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (op, output, dtype), t in sorted(TOLERANCES.items()):
        lines.append(f"| {op} | {output} | {dtype} | {t.atol:g} | {t.rtol:g} | {t.reason} |")
    return "\n".join(lines) + "\n"
