"""DeepSeek-V4 ``fp8_ds_mla`` K cache: UE8M0-scaled FP8 token records in paged blocks.

A K vector has 512 bf16 values: 448 "NoPE" dimensions, quantized to FP8 e4m3 in 7 groups of 64
that each share a power-of-two scale, and 64 RoPE dimensions kept as bf16. A scale ``2^e`` is
stored as its UE8M0 (E8M0) exponent code ``e + 127``. One token takes 584 bytes, split over two
regions of its cache block (``p`` = the token's position in the block, ``bs`` = block size):

    [p*576,        p*576 + 448)   448 e4m3 bytes, dimensions 0..447
    [p*576 + 448,  p*576 + 576)   64 bf16 values, little-endian, dimensions 448..511
    [bs*576 + p*8, bs*576 + p*8 + 7)   7 UE8M0 codes, group g = dimensions 64g..64g+63
    bs*576 + p*8 + 7              0 (pad)

Blocks start ``k_cache.stride(0)`` bytes apart (serving pads ``bs*584`` to a multiple of 576).
The scale rounds *up* (``e = ceil(log2(amax / fp8_max))``), so ``|x / 2^e| <= fp8_max`` and
nothing is clipped; the OCP MX rule (:func:`quantize_mx`) rounds down and saturates instead.
Paper: papers.md#ue8m0-cache.
"""

from __future__ import annotations

import torch
from einops import rearrange

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
GROUP_SIZE = 64
NUM_GROUPS = NOPE_DIM // GROUP_SIZE
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 NoPE, then bf16 RoPE
SCALE_BYTES = NUM_GROUPS + 1  # 7 codes and one zero byte
RECORD_BYTES = TOKEN_DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGNMENT = 576  # serving pads a block to a multiple of this many bytes

AMAX_FLOOR = 1e-4
E8M0_BIAS = 127
E8M0_NAN = 255
MX_E4M3_EMAX = 8  # OCP MX: exponent of the largest e4m3 power of two (256)


def fp8_max(use_fnuz: bool) -> float:
    """The clamp bound: 448 for OCP ``e4m3fn``; 224 for ``e4m3fnuz``, as vLLM uses (not its 240)."""
    return 224.0 if use_fnuz else 448.0


def fp8_dtype(use_fnuz: bool) -> torch.dtype:
    return torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn


def block_bytes(block_size: int, padded: bool = True) -> int:
    """Bytes per cache block: ``block_size * 584``, rounded up to a multiple of 576 when ``padded``.

    bs = 64 -> 37376 unpadded, 37440 padded; 256 -> 149504 / 149760; 16 -> 9344 / 9792.
    """
    raw = block_size * RECORD_BYTES
    return -(-raw // PAGE_ALIGNMENT) * PAGE_ALIGNMENT if padded else raw


def ue8m0_exponent(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``e = ceil(log2(amax / fp8_max))``, exactly, for positive finite ``amax``.

    Computed from the binary exponent, not from a floating-point log2 (whose rounding at exact
    powers of two varies between libraries): with ``amax / fp8_max = m * 2^k``, ``m`` in
    ``[0.5, 1)`` (``frexp``), ``ceil(log2) = k - 1`` when ``m == 0.5`` (an exact power of two) and
    ``k`` otherwise. The float64 quotient of a bf16 ``amax`` by 448 or 224 is a power of two only
    when the true quotient is one (a bf16 neighbour of ``fp8_max * 2^k`` is 0.4% away from it).

    Args:
        amax: ``[...]`` float, positive and finite.
        fp8_max: 448.0 or 224.0.

    Returns:
        ``[...]`` int64.
    """
    mantissa, exponent = torch.frexp(amax.to(torch.float64) / fp8_max)
    return exponent.to(torch.int64) - (mantissa == 0.5).to(torch.int64)


def _to_e4m3_bits(y: torch.Tensor, use_fnuz: bool) -> torch.Tensor:
    """Round to nearest even into e4m3 (torch's cast) and return the raw bytes."""
    return y.to(torch.float32).to(fp8_dtype(use_fnuz)).view(torch.uint8)


def quantize_ue8m0(x: torch.Tensor, use_fnuz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize groups of 64 values to e4m3 with a shared UE8M0 scale, as DeepSeek does.

    Per group: ``amax = max(max|x|, 1e-4)``, ``e = ceil(log2(amax / fp8_max))``,
    ``y = clamp(x * 2^-e, -fp8_max, fp8_max)`` rounded to nearest even into e4m3,
    ``code = clamp(e + 127, 0, 255)``. For bf16 input ``e`` lies in ``[-22, 121]``, so the clamp of
    the code never acts: an all-zero group gets code 105 (OCP; 106 FNUZ), the largest bf16 code 247
    (OCP; 248 FNUZ). ``x * 2^-e`` is exact (a power of two) except for values so far below the
    group's amax that they round to 0 in e4m3 anyway.

    A group holding inf or NaN has no finite scale: it gets the E8M0 NaN code 255 and its values
    are encoded unscaled (``clamp(x, -fp8_max, fp8_max)``; NaN stays NaN), so it gathers as NaN.

    Args:
        x: ``[..., 64*G]`` float (bf16 in serving).
        use_fnuz: e4m3fnuz bytes with ``fp8_max = 224`` instead of OCP e4m3fn with 448.

    Returns:
        ``(fp8 [..., 64*G] uint8, codes [..., G] uint8)``.

    Paper: papers.md#ue8m0-cache. Traffic: reads ``2*64*G`` bytes (bf16); writes ``65*G``.
    """
    groups = rearrange(x.to(torch.float64), "... (g d) -> ... g d", d=GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    safe_amax = torch.where(finite, amax.clamp(min=AMAX_FLOOR), 1.0)
    e = torch.where(finite, ue8m0_exponent(safe_amax, fp8_max(use_fnuz)), 0)
    y = torch.ldexp(groups, -e.unsqueeze(-1).to(torch.float64)).clamp(-fp8_max(use_fnuz), fp8_max(use_fnuz))
    codes = torch.where(finite, (e + E8M0_BIAS).clamp(0, 255), E8M0_NAN).to(torch.uint8)
    return rearrange(_to_e4m3_bits(y, use_fnuz), "... g d -> ... (g d)"), codes


def quantize_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX rule on the same groups of 64 (OCP e4m3 only), for comparison with :func:`quantize_ue8m0`.

    ``e = floor(log2(amax)) - 8`` (8 = the exponent of e4m3's largest power of two), clamped to
    ``>= -127`` (an all-zero group gets ``-127``); ``y = clamp(x * 2^-e, -448, 448)`` rounded to
    nearest even. Rounding the exponent down puts ``amax * 2^-e`` in ``[256, 512)``, so values
    in ``(448, 512) * 2^e`` saturate: amax = 500 gets ``e = 0`` and is stored as 448 (-10.4%),
    where the UE8M0 rule picks ``e = 1``, scales it to 250 and stores the nearest e4m3, 256
    (500 -> 512, +2.4%). Finite input only.

    Args:
        x: ``[..., 64*G]`` float, finite.

    Returns:
        ``(fp8 [..., 64*G] uint8, codes [..., G] uint8)``, codes ``e + 127``.

    Paper: papers.md#ue8m0-cache. Traffic: reads ``2*64*G`` bytes (bf16); writes ``65*G``.
    """
    groups = rearrange(x.to(torch.float64), "... (g d) -> ... g d", d=GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
    e = torch.where(amax > 0, exponent.to(torch.int64) - 1 - MX_E4M3_EMAX, -E8M0_BIAS).clamp(min=-E8M0_BIAS)
    y = torch.ldexp(groups, -e.unsqueeze(-1).to(torch.float64)).clamp(-448.0, 448.0)
    codes = (e + E8M0_BIAS).to(torch.uint8)
    return rearrange(_to_e4m3_bits(y, False), "... g d -> ... (g d)"), codes


def dequantize_ue8m0(fp8: torch.Tensor, codes: torch.Tensor, use_fnuz: bool = False) -> torch.Tensor:
    """``x = e4m3(fp8) * 2^(code - 127)`` per group of 64, in float64 (exact); code 255 (E8M0 NaN) gives NaN.

    Args:
        fp8: ``[..., 64*G]`` uint8 e4m3 bytes (OCP, or FNUZ with ``use_fnuz``).
        codes: ``[..., G]`` uint8 UE8M0 codes.

    Returns:
        ``[..., 64*G]`` float64.

    Traffic: reads ``65*G`` bytes; writes ``8*64*G``.
    """
    values = rearrange(fp8.view(fp8_dtype(use_fnuz)).to(torch.float64), "... (g d) -> ... g d", d=GROUP_SIZE)
    exponent = codes.to(torch.float64) - E8M0_BIAS
    scale = torch.where(codes == E8M0_NAN, torch.nan, torch.exp2(exponent))
    return rearrange(values * scale.unsqueeze(-1), "... g d -> ... (g d)")


def encode_records(k: torch.Tensor, use_fnuz: bool = False) -> torch.Tensor:
    """The 584-byte records of K vectors: 448 e4m3 bytes, 128 RoPE bytes, 7 UE8M0 codes, one 0 byte.

    Args:
        k: ``[T, 512]`` bf16.

    Returns:
        ``[T, 584]`` uint8. The first 576 bytes go to the token's data slot, the last 8 to its
        scale slot (see the module docstring).

    Traffic: reads ``1024*T`` bytes; writes ``584*T``.
    """
    fp8, codes = quantize_ue8m0(k[:, :NOPE_DIM], use_fnuz)
    rope_bytes = k[:, NOPE_DIM:].contiguous().view(torch.uint8)  # bit for bit, little-endian
    pad = torch.zeros((k.shape[0], 1), dtype=torch.uint8, device=k.device)
    return torch.cat([fp8, rope_bytes, codes, pad], dim=1)


def decode_records(records: torch.Tensor, use_fnuz: bool = False) -> torch.Tensor:
    """K vectors back from their 584-byte records: NoPE ``e4m3 * 2^(code - 127)`` rounded to bf16, RoPE bits.

    The product has at most 4 significant bits, so the rounding to bf16 is exact unless it
    overflows (the largest bf16 quantizes to 256 at code 247: ``2^128``, gathered as inf).

    Args:
        records: ``[T, 584]`` uint8.

    Returns:
        ``[T, 512]`` bf16.

    Traffic: reads ``584*T`` bytes; writes ``1024*T``.
    """
    fp8 = records[:, :NOPE_DIM]
    rope = records[:, NOPE_DIM:TOKEN_DATA_BYTES].contiguous().view(torch.bfloat16)
    codes = records[:, TOKEN_DATA_BYTES : TOKEN_DATA_BYTES + NUM_GROUPS]
    nope = dequantize_ue8m0(fp8, codes, use_fnuz).to(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def _record_columns(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Byte offsets inside a block of each token's record: ``[n, 584]`` (576 data bytes, then 8 scale bytes)."""
    p = positions.to(torch.int64).unsqueeze(1)
    data = p * TOKEN_DATA_BYTES + torch.arange(TOKEN_DATA_BYTES, device=p.device)
    scale = block_size * TOKEN_DATA_BYTES + p * SCALE_BYTES + torch.arange(SCALE_BYTES, device=p.device)
    return torch.cat([data, scale], dim=1)


def _blocks(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``[num_blocks, bytes per block]`` (a view: only ``stride(0)`` may be padded)."""
    return k_cache.view(k_cache.shape[0], -1)


def insert_k_cache(
    k: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int = 64,
    use_fnuz: bool = False,
) -> torch.Tensor:
    """Quantize ``k[:N]`` and write token ``i``'s record at slot ``slot_mapping[i]`` (``N = len(slot_mapping)``).

    Slot ``s`` is position ``s % bs`` of block ``s // bs``; a negative slot is skipped. The pure
    twin of ``triton_impl.ue8m0_cache.quantize_and_insert_k_cache``.

    Args:
        k: ``[N', 512]`` bf16, ``N' >= N`` (rows past ``N`` are DP padding and ignored).
        k_cache: uint8 ``[num_blocks, ...]``, each block's bytes contiguous.
        slot_mapping: ``[N]`` int, distinct non-negative slots.
        block_size: tokens per block.
        use_fnuz: e4m3fnuz bytes (``fp8_max = 224``) instead of OCP e4m3fn (448).

    Returns:
        A new cache tensor like ``k_cache``; bytes of other tokens (and the padding) unchanged.

    Paper: papers.md#ue8m0-cache.

    Traffic: reads ``1024*N + 8*N`` bytes; writes ``584*N``.
    """
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    records = encode_records(k[: slots.shape[0]][keep], use_fnuz)
    out = k_cache.clone()
    blocks = _blocks(out)
    kept = slots[keep]
    blocks[(kept // block_size).unsqueeze(1), _record_columns(kept % block_size, block_size)] = records
    return out


def read_records(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The 584-byte records at the given slots: ``[n, 584]`` uint8.

    Traffic: reads ``584*n`` bytes; writes ``584*n``.
    """
    slots = slots.to(torch.int64)
    blocks = _blocks(k_cache)
    return blocks[(slots // block_size).unsqueeze(1), _record_columns(slots % block_size, block_size)]


def gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
) -> torch.Tensor:
    """Dequantize each request's last ``gl`` tokens into ``out[r, offset : offset + gl]``.

    ``gl = gather_lens[r]`` (``seq_lens[r]`` when None); token ``i`` of the gather is position
    ``seq_lens[r] - gl + i``, at block ``block_table[r, pos // bs]``, slot ``pos % bs``; it comes
    out as :func:`decode_records` gives it. The pure twin of
    ``triton_impl.ue8m0_cache.dequantize_and_gather_k_cache``.

    Args:
        out: ``[R, T, 512]`` bf16; rows outside ``[offset, offset + gl)`` are kept.
        k_cache: uint8 ``[num_blocks, ...]``, blocks as :func:`insert_k_cache` writes them.
        seq_lens: ``[R]`` int; gather_lens: ``[R]`` int or None; block_table: ``[R', Bmax]`` int.

    Returns:
        A new tensor like ``out``.

    Paper: papers.md#ue8m0-cache.

    Traffic: reads ``584*G + 4*G/bs`` bytes (``G = sum gl``); writes ``1024*G``.
    """
    result = out.clone()
    lens = seq_lens if gather_lens is None else gather_lens
    for r in range(seq_lens.shape[0]):
        seq_len, gl = int(seq_lens[r]), int(lens[r])
        positions = torch.arange(seq_len - gl, seq_len, device=k_cache.device)
        slots = block_table[r].to(torch.int64)[positions // block_size] * block_size + positions % block_size
        result[r, offset : offset + gl] = decode_records(read_records(k_cache, slots, block_size), use_fnuz)
    return result
