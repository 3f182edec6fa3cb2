"""LSE merge kernels: vLLM's two-state ``merge_attn_states`` and the N-way split merge.

Twin of ``golden/lse_merge.py``. ``merge_splits`` is stage 2 of every split-KV
kernel in this package (``mla_verify``, ``decode_attention``, ``turboquant``): their stage 1
writes every split slot of every row, an empty split as ``(0, -inf)``, so the merge needs no split
boundaries and cannot read stale scratch.

Split partials (``[R, H, S, D + 1]`` fp32 records: the normalized output, then the natural-log LSE) hold the output
in bf16 when the call's output is bf16 (:func:`bf16_partials`): two values a fp32 slot, in slots ``[0, D / 2)``, the
LSE still fp32 in slot ``D`` (value ``d`` is the record's ``d``-th bf16). That halves the bytes stage 1 writes and
the merge reads; the rounding it adds (at most ``2^-9`` of each value, the size of the output's own) is in the
tolerance table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from triton_impl.interpreter import cast_for_store, f32_to_e4m3_bits
from triton_impl.launch import Launch, Plans, current_target, launch, no_launch, select_config
from triton_impl.validation import cdiv, check_scale, check_tensor, next_pow2, tensor_facts

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_OUT = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# Launch configs as data, one entry for every architecture. The two-state merge is memory-bound: a
# program should move >= 4 KB so the grid is not launch/tail-bound, and load 16 B per thread; on the
# H200 it reaches 96.0-96.1% of the copy bandwidth (notebooks/results/bench_h200.md), no sweep run.
MERGE_CONFIGS: dict[str, dict[str, int]] = {
    "default": {"MAX_BLOCK_HEADS_D": 4096, "num_warps": 4},
}
# The split merge: a program's tile is [BLOCK_S, BLOCK_D] with BLOCK_S * BLOCK_D <= MAX_BLOCK_S_D.
# Each thread holds a column slice of every row, so it computes all BLOCK_S weights: that work is
# repeated per warp while the bytes are not, and one warp per (row, head) issues the fewest
# instructions. Compiled for sm_90 by Triton 3.6 (benchmarks/sass_sm90_lse_merge.py), warp
# instructions per program at S=16 D=128 / S=8 D=512: 453 / 575 (80 / 149 registers). The kernel
# before it issued 2488 / 2596 with 4 warps: at S=16 D=128, 993 programs per SM of the H200 need
# 0.31 ms at 4 warp instructions per cycle, above the 0.263 ms copy roofline; it ran 0.426 ms.
# On the H200 (sweep_memory_bound_h200.md, 0520727) one warp took S=16 D=128 from 0.426 to 0.286 ms
# (61.7 -> 92.3% of copy BW; 89.3% in the bench) and runs S=8 D=512 at copy BW; 2 warps are within
# 1%, 4 warps 3% slower. Splits of a (row, head) that do not fit one tile are merged in column blocks (halved
# down to MIN_BLOCK_D columns), each a program of its own, instead of one program looping over the tiles: MLA
# decode B=1 H=128 S=64 D=512 (128 (row, head) programs) took 9.4 us, 5.0 us in four blocks of 128 columns
# (benchmarks/kernel_times.py, H200). Column blocks of tiles that do fit are slower: four blocks at S=2 D=512
# took 11.6 us against 4.8, at S=8 D=512 (R=1024 H=128) 668 us against ~549.
SPLIT_MERGE_CONFIGS: dict[str, dict[str, int]] = {
    "default": {"MAX_BLOCK_S_D": 4096, "MIN_BLOCK_D": 128, "num_warps": 1},
}

# Plans by call key (``triton_impl.validation`` says what a key holds): the checked launch of each
# call layout seen, so a repeated layout skips the checks and the launch-argument derivation.
_MERGE_TWO_PLANS = Plans()  # (launch, whether the output is FP8)
_MERGE_SPLITS_PLANS = Plans()  # launches


# ----------------------------------------------------------------------------------------------
# Two-state merge: output = merge(prefix, suffix), LSEs head-major [H, T].
# ----------------------------------------------------------------------------------------------


@triton.jit
def _merge_two_kernel(
    out_ptr, out_lse_ptr, p_out_ptr, p_lse_ptr, s_out_ptr, s_lse_ptr, out_scale_ptr,
    num_heads, head_dim, tokens_with_context,
    stride_out_t, stride_out_h,
    stride_p_t, stride_p_h,
    stride_s_t, stride_s_h,
    stride_plse_h, stride_plse_t,
    stride_slse_h, stride_slse_t,
    stride_olse_h, stride_olse_t,
    HAS_OUT_LSE: tl.constexpr,
    HAS_OUT_SCALE: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FNUZ: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid ``(T, cdiv(H, BLOCK_H))``: a program owns ``BLOCK_H`` heads of one token.

    It reads the two LSEs of each head once, turns them into two weights in [0, 1] that sum to
    1, and streams the ``[BLOCK_H, D]`` outputs through. A side of weight 0 is never multiplied
    (its output may be NaN or garbage when its key set was empty). A token at or past
    ``tokens_with_context`` has no prefix: its suffix state is copied as it is. With an output
    scale the result is ``clamp(o * (1 / scale), -FP8_MAX, FP8_MAX)``, stored as e4m3 codes for
    an FP8 output (rounded to nearest even in both modes).
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    mask = head_ok[:, None] & (dims[None, :] < head_dim)

    p_lse = tl.load(p_lse_ptr + heads * stride_plse_h + token * stride_plse_t, mask=head_ok, other=float("-inf"))
    s_lse = tl.load(s_lse_ptr + heads * stride_slse_h + token * stride_slse_t, mask=head_ok, other=float("-inf"))
    s_lse_raw = s_lse
    # +inf marks an empty set for some backends (FlashAttention-2): treat it as -inf.
    p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse)
    s_lse = tl.where(s_lse == float("inf"), float("-inf"), s_lse)
    m = tl.maximum(p_lse, s_lse)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    p_w = tl.exp(p_lse - m_safe)
    s_w = tl.exp(s_lse - m_safe)
    total = p_w + s_w
    inv_total = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    no_prefix = token >= tokens_with_context
    p_scale = tl.where(no_prefix, 0.0, p_w * inv_total)
    s_scale = tl.where(no_prefix, 1.0, s_w * inv_total)

    p_out = tl.load(
        p_out_ptr + token * stride_p_t + heads[:, None] * stride_p_h + dims[None, :],
        mask=mask & (p_scale[:, None] > 0),
        other=0.0,
    ).to(tl.float32)
    s_out = tl.load(
        s_out_ptr + token * stride_s_t + heads[:, None] * stride_s_h + dims[None, :],
        mask=mask & (s_scale[:, None] > 0),
        other=0.0,
    ).to(tl.float32)
    merged = p_out * p_scale[:, None] + s_out * s_scale[:, None]
    out_ptrs = out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :]
    if HAS_OUT_SCALE:
        merged = merged * (1.0 / tl.load(out_scale_ptr).to(tl.float32))
        merged = tl.minimum(tl.maximum(merged, -FP8_MAX), FP8_MAX)
    if FP8_OUT:  # out_ptr holds the FP8 tensor's bytes
        tl.store(out_ptrs, f32_to_e4m3_bits(merged, FNUZ), mask=mask)
    else:
        tl.store(out_ptrs, cast_for_store(merged, out_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT_LSE:
        merged_lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
        merged_lse = tl.where(no_prefix, s_lse_raw, merged_lse)
        tl.store(out_lse_ptr + heads * stride_olse_h + token * stride_olse_t, merged_lse, mask=head_ok)


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: torch.Tensor | None = None,
) -> None:
    """Merge two attention states per (token, head) into ``output`` (vLLM's signature).

    ``M = max(p, s)``; ``o = o_p * e^(p-M)/W + o_s * e^(s-M)/W`` with ``W = e^(p-M) + e^(s-M)``;
    ``lse = M + ln W``. ``+inf`` LSEs count as ``-inf``; both sides empty gives ``(0, -inf)``
    (upstream's Triton kernel gives NaN there). Tokens ``t >= prefill_tokens_with_context`` have
    no prefix: the suffix output and LSE are copied unchanged (as upstream). With ``output_scale``
    the stored output is ``clamp(o * (1 / scale), -M8, M8)`` with ``M8`` the FP8 maximum (448 for
    ``float8_e4m3fn`` and for a 16/32-bit output, 240 for ``float8_e4m3fnuz``), rounded to nearest
    even. Golden: ``golden.lse_merge.merge_attn_states``.

    Args:
        output: ``[T, H, D]`` fp32/fp16/bf16, or ``float8_e4m3fn``/``float8_e4m3fnuz`` with
            ``output_scale``; written (any strides, unit last stride).
        prefix_output, suffix_output: ``[T, H, D]``, one dtype: ``output``'s, or fp32/fp16/bf16 for
            an FP8 output.
        prefix_lse, suffix_lse: ``[H, T]`` fp32 natural-log LSEs (head-major; strided views allowed).
        output_lse: ``[H, T]`` fp32 or None, written when given.
        prefill_tokens_with_context: tokens ``[0, P)`` are merged, the rest copied from the suffix;
            None merges every token.
        output_scale: one-element float tensor (FP8 static quantization of the output), or None.

    No host synchronization; CUDA graphs: every argument stays fixed across replays.

    Traffic: reads ``2*T*H*D`` outputs and ``2*T*H`` LSEs; writes ``T*H*D`` (+ ``T*H`` LSEs).
    """
    device_index, stream = current_target()
    try:
        key = (device_index, tensor_facts(output), tensor_facts(prefix_output), tensor_facts(prefix_lse),
               tensor_facts(suffix_output), tensor_facts(suffix_lse), tensor_facts(output_lse),
               prefill_tokens_with_context, type(prefill_tokens_with_context), tensor_facts(output_scale))  # fmt: skip
        plan = _MERGE_TWO_PLANS.get(key)
    except (AttributeError, TypeError, ValueError):  # a non-tensor or unhashable argument: the checks name it
        key, plan = None, None
    if plan is None:
        plan = _plan_merge_two(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                               prefill_tokens_with_context, output_scale)  # fmt: skip
        if key is not None:
            _MERGE_TWO_PLANS.add(key, plan)
    merge, fp8_out = plan
    merge(stream, output.view(torch.uint8) if fp8_out else output,
          output_lse if output_lse is not None else prefix_lse,  # a dummy pointer when absent
          prefix_output, prefix_lse, suffix_output, suffix_lse,
          prefix_lse if output_scale is None else output_scale)  # fmt: skip


def _plan_merge_two(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                    prefill_tokens_with_context, output_scale) -> tuple[Callable[..., None], bool]:  # fmt: skip
    """The argument checks of :func:`merge_attn_states`: its launch (``no_launch`` with no token or
    head), and whether the output is FP8 (launched as its bytes)."""
    check_tensor("output", output, ndim=3, dtypes=(*_OUT_DTYPES, *_FP8_OUT))
    num_tokens, num_heads, head_dim = output.shape
    fp8_out = output.dtype in _FP8_OUT
    if fp8_out and output_scale is None:
        raise ValueError(f"output_scale: required for an FP8 output ({output.dtype}), got None")
    input_dtypes = _OUT_DTYPES if fp8_out else (output.dtype,)
    check_tensor("prefix_output", prefix_output, shape=(num_tokens, num_heads, head_dim), dtypes=input_dtypes,
                 device=output.device)  # fmt: skip
    check_tensor("suffix_output", suffix_output, shape=(num_tokens, num_heads, head_dim),
                 dtypes=(prefix_output.dtype,), device=output.device)  # fmt: skip
    for name, t in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if t is not None or name != "output_lse":
            check_tensor(
                name,
                t,
                shape=(num_heads, num_tokens),
                dtypes=(torch.float32,),
                device=output.device,
                unit_last_stride=False,
            )
    if prefill_tokens_with_context is None:
        prefill_tokens_with_context = num_tokens
    elif not isinstance(prefill_tokens_with_context, int) or prefill_tokens_with_context < 0:
        raise ValueError(
            f"prefill_tokens_with_context: expected None or an int >= 0, got {prefill_tokens_with_context!r}"
        )
    if output_scale is not None:
        check_scale("output_scale", output_scale, output.device)
    if num_tokens == 0 or num_heads == 0:
        return no_launch, fp8_out
    config = select_config(MERGE_CONFIGS, output.device)
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(num_heads), config["MAX_BLOCK_HEADS_D"] // block_d))
    lse_out = output_lse if output_lse is not None else prefix_lse
    merge = Launch(_merge_two_kernel, (num_tokens, cdiv(num_heads, block_h)), (
        num_heads, head_dim, prefill_tokens_with_context,
        *output.stride()[:2],
        *prefix_output.stride()[:2],
        *suffix_output.stride()[:2],
        *prefix_lse.stride(),
        *suffix_lse.stride(),
        *lse_out.stride(),
    ), dict(
        HAS_OUT_LSE=output_lse is not None,
        HAS_OUT_SCALE=output_scale is not None,
        FP8_OUT=fp8_out,
        FNUZ=output.dtype == torch.float8_e4m3fnuz,
        FP8_MAX=240.0 if output.dtype == torch.float8_e4m3fnuz else 448.0,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=config["num_warps"],
    ))  # fmt: skip
    return merge, fp8_out


# ----------------------------------------------------------------------------------------------
# N-way merge of split partials: stage 2 of split-KV attention.
# ----------------------------------------------------------------------------------------------


def bf16_partials(out_dtype: torch.dtype) -> bool:
    """Whether split-KV stage 1 stores its partial outputs in bf16 for an output of ``out_dtype`` (bf16): packed two a
    fp32 slot of each partial record, its LSE fp32 as before (:func:`partial_values`). fp16 and fp32 outputs keep fp32
    partials, whose rounding (``2^-24``) is below theirs. FlashInfer stores its partials in the output dtype too."""
    return out_dtype == torch.bfloat16


def split_outputs(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The partial outputs of split records ``partials[..., :D + 1]`` as stage 1 of a call with output dtype
    ``out_dtype`` stored them, as ``[..., D]``: fp32 slots, or (:func:`bf16_partials`) bf16 pairs widened to fp32."""
    width = partials.shape[-1] - 1
    if not bf16_partials(out_dtype):
        return partials[..., :width]
    return partials[..., : (width + 1) // 2].view(torch.bfloat16)[..., :width].float()


@triton.jit
def partial_values(records, BF16_PARTIALS: tl.constexpr):
    """Pointers to the partial output values of split records ``records`` (fp32 pointers to their first slot): the
    records themselves, or, with ``BF16_PARTIALS``, the same addresses as bf16, so that value ``d`` of a record is
    its ``d``-th bf16 (slots ``[0, D / 2)``), while its LSE stays the fp32 in slot ``D``."""
    if BF16_PARTIALS:
        values = records.to(tl.pointer_type(tl.bfloat16))
    else:
        values = records
    return values


@triton.jit
def _clean_lse(lse):
    """An LSE as a weight's exponent: ``+inf`` (an empty set for some backends) and NaN (a poisoned
    split, counted apart) give ``-inf``, weight 0."""
    return tl.where((lse == float("inf")) | (lse != lse), float("-inf"), lse)


@triton.jit
def _split_lses(base, start, num_splits, head_dim, stride_p_s, BLOCK_S: tl.constexpr, LSE_COLS: tl.constexpr):
    """The LSEs of splits ``[start, start + BLOCK_S)`` (column ``D`` of each), ``-inf`` past the last.

    Loaded as the last column of a ``[BLOCK_S, LSE_COLS]`` tile whose other columns are masked off
    (never read) and summed away. A load of fewer elements than the program has threads counts as
    cheap to Triton's layout pass, which then repeats it, and every weight computation after it, in
    every thread that needs a weight (each thread needs all ``BLOCK_S``); ``BLOCK_S * LSE_COLS`` at
    least the thread count keeps one LSE per thread and moves the weights through shared memory once.
    """
    s = start + tl.arange(0, BLOCK_S)
    col = tl.arange(0, LSE_COLS)
    is_lse = col[None, :] == LSE_COLS - 1
    tile = tl.load(
        base + s[:, None] * stride_p_s + (head_dim - (LSE_COLS - 1)) + col[None, :],
        mask=(s[:, None] < num_splits) & is_lse,
        other=float("-inf"),
    )
    return tl.sum(tl.where(is_lse, tile, 0.0), axis=1)  # x + 0 == x for every x, NaN and infinities too


@triton.jit
def _weighted_tile_sum(base, col0, start, w, head_dim, stride_p_s, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr, BF16_PARTIALS: tl.constexpr):  # fmt: skip
    """``sum_s w_s * partial_s`` in columns ``[col0, col0 + BLOCK_D)`` over splits ``[start, start + BLOCK_S)``, one
    ``[BLOCK_S, BLOCK_D]`` load: every row's loads are issued before the first is used. A split of weight 0 is not
    read."""
    s = start + tl.arange(0, BLOCK_S)
    dims = col0 + tl.arange(0, BLOCK_D)
    mask = w[:, None] > 0
    if not EVEN_D:
        mask &= dims[None, :] < head_dim
    values = partial_values(base + s * stride_p_s, BF16_PARTIALS)
    part = tl.load(values[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.sum(part * w[:, None], axis=0)


@triton.jit
def _merge_splits_kernel(
    partials_ptr, o_ptr, lse_ptr,
    num_heads, num_splits, head_dim,
    stride_p_r, stride_p_h, stride_p_s,
    stride_o_r, stride_o_h,
    stride_lse_r, stride_lse_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LSE_COLS: tl.constexpr,
    EVEN_D: tl.constexpr,
    MULTI_TILE: tl.constexpr,
    BF16_PARTIALS: tl.constexpr,
):  # fmt: skip
    """Grid ``(rows, H, cdiv(D, BLOCK_D))``: a program merges the ``S`` split states of one (row, head) in
    ``BLOCK_D`` of its columns (each column block reads the LSEs; the first stores the merged LSE).

    Pass 1 reads the ``S`` LSEs (stored at column ``D`` of each split) and takes their max; pass 2
    reads ``BLOCK_S`` splits at a time, weighting each normalized partial by ``exp(lse_s - max)``.
    Splits with ``lse = -inf`` are empty: their outputs are never loaded. A NaN LSE (stage 1
    poisons a split that met a block-table entry outside the cache) makes the whole (row, head)
    NaN, explicitly: a hardware max would drop the NaN.

    The first ``BLOCK_S`` LSEs are loaded once and kept for pass 2; with ``S <= BLOCK_S``
    (``MULTI_TILE`` false) there is no loop. ``EVEN_D``: ``D`` a multiple of ``BLOCK_D``, no column mask.
    ``BF16_PARTIALS``: the outputs are bf16, two a slot (:func:`partial_values`).
    """
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    col0 = tl.program_id(2) * BLOCK_D
    base = partials_ptr + row * stride_p_r + head * stride_p_h

    lse_first = _split_lses(base, 0, num_splits, head_dim, stride_p_s, BLOCK_S, LSE_COLS)
    poisoned = (lse_first != lse_first).to(tl.int32)
    m = _clean_lse(lse_first)
    if MULTI_TILE:
        for start in range(BLOCK_S, num_splits, BLOCK_S):
            lse_s = _split_lses(base, start, num_splits, head_dim, stride_p_s, BLOCK_S, LSE_COLS)
            poisoned |= (lse_s != lse_s).to(tl.int32)
            m = tl.maximum(m, _clean_lse(lse_s))
    m_all = tl.max(m, axis=0)
    poison = tl.max(poisoned, axis=0) > 0
    empty = m_all == float("-inf")
    m_safe = tl.where(empty, 0.0, m_all)

    w = tl.exp(_clean_lse(lse_first) - m_safe)
    total = w
    acc = _weighted_tile_sum(base, col0, 0, w, head_dim, stride_p_s, BLOCK_S, BLOCK_D, EVEN_D, BF16_PARTIALS)
    if MULTI_TILE:
        for start in range(BLOCK_S, num_splits, BLOCK_S):
            lse_s = _split_lses(base, start, num_splits, head_dim, stride_p_s, BLOCK_S, LSE_COLS)
            w = tl.exp(_clean_lse(lse_s) - m_safe)
            total += w
            acc += _weighted_tile_sum(base, col0, start, w, head_dim, stride_p_s, BLOCK_S, BLOCK_D, EVEN_D,
                                      BF16_PARTIALS)  # fmt: skip
    w_sum = tl.sum(total, axis=0)
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, w_sum))
    inv = tl.where(poison, float("nan"), inv)
    dims = col0 + tl.arange(0, BLOCK_D)
    tl.store(
        o_ptr + row * stride_o_r + head * stride_o_h + dims,
        cast_for_store(acc * inv, o_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )
    if tl.program_id(2) == 0:
        merged_lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, w_sum)))
        merged_lse = tl.where(poison, float("nan"), merged_lse)
        lse_out = lse_ptr + row * stride_lse_r + head * stride_lse_h
        tl.store(lse_out, cast_for_store(merged_lse, lse_ptr.dtype.element_ty))


def merge_splits(partials: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *, bf16_values: bool = False) -> None:
    """Merge the ``S`` split states of every (row, head): stage 2 of split-KV attention.

    ``partials[r, h, s, :D]`` is split ``s``'s normalized output and ``partials[r, h, s, D]`` its
    natural-log LSE (``-inf`` for an empty split, whose outputs are then never read). Result as
    ``golden.lse_merge.merge_states``: all splits empty gives ``(0, -inf)``.

    Args:
        partials: ``[R, H, S, D+1]`` fp32 (any strides, unit last stride).
        o: ``[R, H, D]`` fp32/fp16/bf16, written.
        lse: ``[R, H]`` fp32 (or the model dtype, as serving passes it), written.
        bf16_values: the outputs are bf16, value ``d`` the ``d``-th bf16 of the record (two a fp32 slot), as this
            package's stage 1 writes them for a bf16 output (:func:`bf16_partials`, :func:`split_outputs`).

    Traffic: reads ``R*H*S`` LSEs and at most ``R*H*S*D`` partials (empty splits are skipped);
    writes ``R*H*(D+1)``.
    """
    device_index, stream = current_target()
    try:
        key = (device_index, tensor_facts(partials), tensor_facts(o), tensor_facts(lse), bool(bf16_values))
        merge = _MERGE_SPLITS_PLANS.get(key)
    except (AttributeError, TypeError, ValueError):  # a non-tensor argument: the checks name it
        key, merge = None, None
    if merge is None:
        merge = _plan_merge_splits(partials, o, lse, bool(bf16_values))
        if key is not None:
            _MERGE_SPLITS_PLANS.add(key, merge)
    merge(stream, partials, o, lse)


def _plan_merge_splits(partials: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       bf16_values: bool) -> Callable[..., None]:  # fmt: skip
    """The argument checks of :func:`merge_splits` and its launch."""
    check_tensor("partials", partials, ndim=4, dtypes=(torch.float32,))
    rows, num_heads, num_splits, width = partials.shape
    head_dim = width - 1
    check_tensor("o", o, shape=(rows, num_heads, head_dim), dtypes=_OUT_DTYPES, device=partials.device)
    check_tensor(
        "lse", lse, shape=(rows, num_heads), dtypes=_OUT_DTYPES, device=partials.device, unit_last_stride=False
    )
    if num_splits < 1:
        raise ValueError(f"partials: expected at least one split, got shape {list(partials.shape)}")
    return merge_splits_launch(rows, partials, o, lse, bf16_values=bf16_values)


def _merge_splits_launch_args(
    rows: int, partials: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, bf16_values: bool
) -> tuple[tuple[int, int], tuple[int, ...], dict[str, int]]:
    """``(grid, runtime arguments after the three pointers, constexprs)`` of the split merge of the first ``rows``
    rows of ``[>= rows, H, S, D+1]`` partials (``bf16_values``: their outputs in bf16, :func:`bf16_partials`)."""
    _, num_heads, num_splits, width = partials.shape
    config = select_config(SPLIT_MERGE_CONFIGS, partials.device)
    block_d = next_pow2(width - 1)
    while block_d > config["MIN_BLOCK_D"] and next_pow2(num_splits) * block_d > config["MAX_BLOCK_S_D"]:
        block_d //= 2  # splits that do not fit one tile: column blocks, each a program of its own
    block_s = max(1, min(next_pow2(num_splits), config["MAX_BLOCK_S_D"] // block_d))
    threads = 32 * config["num_warps"]
    tail = (num_heads, num_splits, width - 1, *partials.stride()[:3], *o.stride()[:2], *lse.stride()[:2])
    constexprs = {
        "BLOCK_S": block_s,
        "BLOCK_D": block_d,
        "LSE_COLS": max(2, threads // block_s),
        "EVEN_D": (width - 1) % block_d == 0,
        "MULTI_TILE": num_splits > block_s,
        "BF16_PARTIALS": bf16_values,
        "num_warps": config["num_warps"],
    }
    return (rows, num_heads, cdiv(width - 1, block_d)), tail, constexprs


def merge_splits_launch(rows: int, partials: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *,
                        bf16_values: bool = False) -> Callable[..., None]:  # fmt: skip
    """The split merge of the first ``rows`` rows of checked ``partials`` into ``o``/``lse``, to be
    called with ``(stream, partials, o, lse)``: a :class:`~triton_impl.launch.Launch`, or
    ``no_launch`` when there is no row or head. Stage 2 of the plans of ``decode_attention``,
    ``mla_verify`` (``bf16_values`` for a bf16 output: :func:`bf16_partials`) and ``turboquant``."""
    if rows == 0 or partials.shape[1] == 0:
        return no_launch
    return Launch(_merge_splits_kernel, *_merge_splits_launch_args(rows, partials, o, lse, bf16_values))


def launch_merge_splits(partials: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`merge_splits` without the argument checks: stage 2 of the split-KV kernels
    (``turboquant``, ``decode_attention_dcp``), whose wrappers validated the scratch."""
    rows, num_heads = partials.shape[:2]
    if rows == 0 or num_heads == 0:
        return
    grid, tail, constexprs = _merge_splits_launch_args(rows, partials, o, lse, False)
    launch(_merge_splits_kernel, grid, partials, o, lse, *tail, **constexprs)
