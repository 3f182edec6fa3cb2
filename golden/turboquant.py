"""TurboQuant KV cache: rotate, Lloyd-Max-quantize, pack into vLLM's SoA block, decode.

TurboQuant (papers.md#turboquant) stores a key ``k`` as its norm ``n = ||k||`` and the codes of
its rotated direction ``y = (k / n) Pi^T``: after a random rotation every coordinate of a unit
vector follows one known distribution (``(y_d + 1) / 2 ~ Beta((D-1)/2, (D-1)/2)``, close to
``N(0, 1/D)``), so one scalar Lloyd-Max codebook quantizes every coordinate near-optimally.
Decode never un-rotates a key: it rotates the query once, ``<q, k> = n <q Pi^T, y>``, and scores
it against centroids. vLLM's variant (this module) uses a Sylvester-Hadamard rotation, the Gaussian
codebook, optional norm correction, uniform min-max values and a structure-of-arrays cache block.

The store is the paper's arithmetic in float64 (every fp16/bf16/fp32 input is exact there): the
norm, the rotation, the nearest-centroid cell, the min-max levels; then one correctly rounded cast
of each stored scalar to fp16. A kernel computes the same quantities in fp32, so its codes equal
these except where a coordinate lies within the kernel's rounding error of a decision boundary
(a midpoint, or the ``.5`` of a value level), where either neighbouring code is right. How close
is close enough is derived from the fp32 error bound in ``triton_impl/parity/turboquant.py``
(``compare_store``), which any correct store passes. The decode reads whatever bytes a store wrote.

The codebook solver lives in ``golden._lloyd_max``; ``solve_lloyd_max`` and
``codebook_distortion`` are re-exported here, where TurboQuant's callers look for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from einops import einsum, rearrange

from golden._lloyd_max import codebook_distortion as codebook_distortion
from golden._lloyd_max import solve_lloyd_max as solve_lloyd_max
from golden._paged import gather_tokens, masked_softmax_state
from golden.lse_merge import split_states

FP16_MAX = 65504.0
E4M3_MAX = 448.0  # FP8 keys saturate here (torch < 2.13 casts |x| >= 480 and inf to NaN instead)
KEY_NORM_EPS = 1e-8  # k_hat = k / (n + eps), as upstream
NORM_CORRECTION_EPS = 1e-16  # stored norm = n / sqrt(||c[idx]||^2 + eps), as upstream (a zero codebook stays finite)
MIN_VALUE_SCALE = 1e-8  # a constant value vector gets this scale instead of 0
MAX_HEAD_DIM = 1024  # the largest head the layout (and the kernels' register tiles) take

# preset -> (key bits (8 = FP8 keys), value bits, norm correction); vLLM's TQ_PRESETS.
PRESETS: dict[str, tuple[int, int, bool]] = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


# ----------------------------------------------------------------------------------------------
# Presets and the SoA block layout.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurboQuantConfig:
    """One preset at one head size, and every size the cache layout derives from it.

    Layout of one cache block (uint8 ``[block_size, HKV, padded_slot]``, only its byte offset
    ``block * stride(0)`` matters): a data region, position-major then head, of
    ``data_bytes_per_slot = key_data_bytes + value_data_bytes`` per (position, head), then at byte
    ``meta_region_offset(block_size, HKV)`` an fp16 region ``[HKV][fields][block_size]`` with
    fields ``(k_norm, v_scale, v_zero)`` for MSE keys or ``(v_scale, v_zero)`` for FP8 keys.
    """

    name: str
    head_dim: int
    key_quant_bits: int  # 8 for FP8 keys, else the MSE code width (3 or 4)
    value_quant_bits: int
    norm_correction: bool

    @classmethod
    def from_cache_dtype(cls, name: str, head_dim: int) -> TurboQuantConfig:
        """The config of a ``--kv-cache-dtype`` preset name; unknown names raise ``ValueError``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown TurboQuant cache dtype: {name!r}; expected one of {sorted(PRESETS)}")
        check_head_dim(head_dim)
        key_bits, value_bits, norm_correction = PRESETS[name]
        return cls(name, head_dim, key_bits, value_bits, norm_correction)

    @property
    def key_fp8(self) -> bool:
        return self.key_quant_bits == 8

    @property
    def key_mse_bits(self) -> int:
        """The key code width, 0 for FP8 keys (the ``mse_bits`` argument of the kernels)."""
        return 0 if self.key_fp8 else self.key_quant_bits

    @property
    def centroid_bits(self) -> int:
        """Bits of the codebook vLLM builds (value bits for FP8 keys, where it goes unused)."""
        return self.value_quant_bits if self.key_fp8 else self.key_quant_bits

    @property
    def n_centroids(self) -> int:
        return 2**self.centroid_bits

    @property
    def key_data_bytes(self) -> int:
        return self.head_dim if self.key_fp8 else math.ceil(self.head_dim * self.key_quant_bits / 8)

    @property
    def value_data_bytes(self) -> int:
        return math.ceil(self.head_dim * self.value_quant_bits / 8)

    @property
    def key_packed_size(self) -> int:
        """Key bytes per (token, head): codes plus the fp16 norm, or ``D`` FP8 bytes."""
        return self.head_dim if self.key_fp8 else self.key_data_bytes + 2

    @property
    def value_packed_size(self) -> int:
        """Value bytes per (token, head): codes plus fp16 scale and zero."""
        return self.value_data_bytes + 4

    @property
    def slot_size(self) -> int:
        return self.key_packed_size + self.value_packed_size

    @property
    def slot_size_aligned(self) -> int:
        """The cache's last dimension (``padded_slot``): the slot size rounded up to even."""
        return self.slot_size + self.slot_size % 2

    @property
    def data_bytes_per_slot(self) -> int:
        return self.key_data_bytes + self.value_data_bytes

    @property
    def num_meta_fields(self) -> int:
        return 2 if self.key_fp8 else 3

    def meta_region_offset(self, block_size: int, num_kv_heads: int) -> int:
        """Byte offset of the fp16 metadata region inside a block."""
        return block_size * num_kv_heads * self.data_bytes_per_slot


def check_head_dim(head_dim: int) -> None:
    """Head sizes the layout supports: a multiple of 16 up to 1024.

    Codes are packed in groups of 8 coordinates (3-bit codes: 8 per 3 bytes), and with ``D % 16
    == 0`` every data slot has an even size, so the fp16 metadata region is 2-byte aligned.
    """
    if not isinstance(head_dim, int) or head_dim < 16 or head_dim % 16 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim!r}")


# ----------------------------------------------------------------------------------------------
# Rotations.
# ----------------------------------------------------------------------------------------------


def hadamard_rotation(d: int, seed: int | None = None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard rotation ``Pi = H_d / sqrt(d)``, optionally sign-randomized.

    ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``. With a seed, ``Pi = H_d diag(s) / sqrt(d)``
    with signs ``s`` from ``torch.randint(0, 2)`` on a CPU generator seeded with ``seed`` (vLLM's
    earlier ``generate_wht_signs``; its ``PiT = s[:, None] * H``). Serving uses ``seed=None``, where
    ``Pi`` is symmetric and ``Pi = Pi^T``. Paper: papers.md#turboquant.

    Args:
        d: a power of two (upstream silently builds a non-orthonormal matrix otherwise).
        seed: None for the plain Hadamard matrix.

    Returns:
        ``Pi [d, d]`` float32; rows are keys' rotated coordinates' weights: ``y = x @ Pi^T``.

    Traffic: none (host construction).
    """
    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ValueError(f"d: the Hadamard rotation needs a power of two, got {d!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    h = h / math.sqrt(d)
    if seed is not None:
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).to(torch.float64) * 2 - 1
        h = h * signs[None, :]
    return h.to(torch.float32)


def haar_rotation(d: int, seed: int) -> torch.Tensor:
    """A seeded Haar-random orthogonal matrix: QR of a Gaussian matrix with the sign fix.

    ``G ~ N(0, 1)^{d x d}`` (float64, CPU generator seeded with ``seed``), ``G = QR``,
    ``Pi = Q diag(sign(diag R))`` (without the fix, QR's sign convention biases the distribution).
    This is the random rotation of the TurboQuant paper. Paper: papers.md#turboquant.

    Args:
        d: any positive size.
        seed: the generator seed.

    Returns:
        ``Pi [d, d]`` float32, orthogonal.

    Traffic: none (host construction).
    """
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"d: expected a positive int, got {d!r}")
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)


# ----------------------------------------------------------------------------------------------
# The quantizer, in float64.
# ----------------------------------------------------------------------------------------------


def key_norm(key: torch.Tensor) -> torch.Tensor:
    """``||k||_2`` per vector, float64 (the inputs are exact in float64; ~1e-16 relative).

    Args:
        key: ``[..., D]`` float16/bfloat16/float32.

    Returns:
        ``[...]`` float64.
    """
    return torch.linalg.vector_norm(key.to(torch.float64), dim=-1)


def rotate_keys(key: torch.Tensor, PiT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm and rotated direction of each key: ``n = ||k||``, ``y = (k / (n + 1e-8)) @ Pi^T``.

    float64 throughout; ``PiT`` enters with its float32 entries. Paper: papers.md#turboquant.

    Args:
        key: ``[T, HKV, D]`` float16/bfloat16/float32.
        PiT: ``[D, D]`` float32 (any orthogonal matrix).

    Returns:
        ``(n [T, HKV], y [T, HKV, D])`` float64.
    """
    n = key_norm(key)
    k_hat = key.to(torch.float64) / (n + KEY_NORM_EPS)[..., None]
    return n, einsum(k_hat, PiT.to(torch.float64), "... j, j d -> ... d")


def nearest_cell(y: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """``idx = #{m : boundary_m <= y}`` per element: the nearest centroid's index when the boundaries
    are the midpoints; a value exactly on a boundary belongs to the upper cell.

    Args:
        y: ``[...]`` float; boundaries: ``[N-1]`` ascending (compared in float64).

    Returns:
        ``[...]`` int64 in ``[0, N)``.
    """
    return (y.to(torch.float64)[..., None] >= boundaries.to(torch.float64)).sum(dim=-1)


def fp16_saturated(x: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to +-65504, then rounded once to the nearest fp16 (ties to even); NaN stays NaN.

    Upstream casts without the clamp, so anything past 65504 becomes inf. The cast goes through
    numpy, whose float64 -> float16 conversion rounds once; torch's rounds to float32 first, and
    that double rounding misplaces values just above an fp16 tie (``1 + 2^-11 + 2^-40 -> 1``).
    """
    clamped = x.to(torch.float64).clamp(-FP16_MAX, FP16_MAX).cpu().numpy()
    return torch.from_numpy(clamped.astype(np.float16)).to(x.device)


def corrected_norm(n: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``n / sqrt(||c[idx]||^2 + 1e-16)`` in float64: the reconstruction ``stored * c[idx]`` has norm ``n``.

    Args:
        n: ``[...]`` key norms; codes: ``[..., D]`` int; centroids: ``[N]`` float32.

    Returns:
        ``[...]`` float64.
    """
    c = centroids.to(torch.float64)[codes]
    return n.to(torch.float64) / torch.sqrt((c * c).sum(dim=-1) + NORM_CORRECTION_EPS)


def quantize_keys(
    key: torch.Tensor,
    PiT: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    norm_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant_mse: codes of the rotated direction and the norm that rescales them.

    ``idx_d = #{m : boundary_m <= y_d}`` (:func:`nearest_cell` of :func:`rotate_keys`'s ``y``).
    The stored norm is ``n``, or with norm correction :func:`corrected_norm` (vLLM's SoA store
    folds the correction in here), rounded once to fp16 after a clamp to +-65504. Paper:
    papers.md#turboquant.

    Args:
        key: ``[T, HKV, D]`` float16/bfloat16/float32.
        PiT: ``[D, D]`` float32; boundaries: ``[N-1]`` float32; centroids: ``[N]`` float32.
        norm_correction: fold ``1 / ||c[idx]||`` into the stored norm.

    Returns:
        ``(codes [T, HKV, D] int64 in [0, N), stored_norm [T, HKV] float16)``.
    """
    n, y = rotate_keys(key, PiT)
    codes = nearest_cell(y, boundaries)
    stored = corrected_norm(n, codes, centroids) if norm_correction else n
    return codes, fp16_saturated(stored)


def value_levels(value: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The min-max grid of each value vector, float64: ``(t, scale, vmin)`` with ``v = vmin + t * scale``.

    ``vmin, vmax`` clamped to +-65504, ``scale = max((vmax - vmin) / (2^b - 1), 1e-8)``, ``t =
    (v - vmin) / scale``; the code is ``t`` rounded half up (:func:`quantize_values`).

    Returns:
        ``(t [..., D], scale [...], vmin [...])`` float64.
    """
    v = value.to(torch.float64)
    vmin = v.amin(dim=-1).clamp(-FP16_MAX, FP16_MAX)
    vmax = v.amax(dim=-1).clamp(-FP16_MAX, FP16_MAX)
    scale = ((vmax - vmin) / (2**bits - 1)).clamp(min=MIN_VALUE_SCALE)
    return (v - vmin[..., None]) / scale[..., None], scale, vmin


def round_levels(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(floor(t + 0.5), 0, 2^b - 1)`` as int64: the nearest level, a half rounding up."""
    return torch.floor(t + 0.5).clamp(0, 2**bits - 1).to(torch.int64)


def quantize_values(value: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-vector asymmetric min-max quantization of values (not rotated).

    ``q = clamp(floor((v - vmin) / scale + 0.5), 0, 2^b - 1)`` on :func:`value_levels`' grid, in
    float64; ``scale`` and ``zero = vmin`` are stored as fp16 (reconstruction ``q * scale + zero``
    uses the fp16 ones). The clamp of ``vmin, vmax`` keeps an outlier beyond fp16's range from
    turning the scale into inf and the whole vector into NaN, as upstream's unclamped store does.
    Paper: papers.md#turboquant.

    Args:
        value: ``[..., D]`` float16/bfloat16/float32.
        bits: 3 or 4.

    Returns:
        ``(codes [..., D] int64, scale [...] float16, zero [...] float16)``.
    """
    t, scale, vmin = value_levels(value, bits)
    return round_levels(t, bits), fp16_saturated(scale), fp16_saturated(vmin)


def e4m3_bytes(key: torch.Tensor) -> torch.Tensor:
    """FP8 keys: ``k`` as OCP e4m3fn bytes, rounded once to nearest even, saturating at +-448 (NaN stays NaN).

    No rotation and no scale. The input is fp16/bf16/fp32; its fp32 value is exact, so the cast
    from fp32 is the single rounding.
    """
    saturated = key.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    return saturated.to(torch.float8_e4m3fn).view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Packing and the SoA block.
# ----------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes -> an LSB-first bit stream: coordinate ``d`` occupies bits ``[b*d, b*d + b)``.

    4-bit: byte ``j = idx[2j] | idx[2j+1] << 4``; 3-bit: 8 codes per 3 bytes. Written per group
    of 8 codes (``8*b`` bits = ``b`` bytes), so ``D % 8 == 0``.

    Args:
        codes: ``[..., D]`` int in ``[0, 2^bits)``; bits: 1..8.

    Returns:
        ``[..., D * bits / 8]`` uint8.
    """
    groups = rearrange(codes.to(torch.int64), "... (g p) -> ... g p", p=8)
    word = (groups << (bits * torch.arange(8, device=codes.device))).sum(dim=-1)  # disjoint fields
    packed = (word[..., None] >> (8 * torch.arange(bits, device=codes.device))) & 0xFF
    return rearrange(packed, "... g i -> ... (g i)").to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: ``[..., D * bits / 8]`` uint8 -> ``[..., D]`` int64."""
    groups = rearrange(packed.to(torch.int64), "... (g i) -> ... g i", i=bits)
    word = (groups << (8 * torch.arange(bits, device=packed.device))).sum(dim=-1)
    codes = (word[..., None] >> (bits * torch.arange(8, device=packed.device))) & (2**bits - 1)
    return rearrange(codes, "... g p -> ... (g p)")


def check_cache(kv_cache: torch.Tensor, config: TurboQuantConfig) -> None:
    """A cache the layout fits: uint8 ``[blocks, block_size, HKV, padded_slot]``, inner dims dense."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        raise ValueError(f"kv_cache: expected uint8 [blocks, block_size, HKV, slot], got {kv_cache.dtype} "
                         f"{list(kv_cache.shape)}")  # fmt: skip
    num_kv_heads, padded_slot = kv_cache.shape[2:]
    if padded_slot < config.slot_size or padded_slot % 2:
        raise ValueError(f"kv_cache: last dim {padded_slot} must be even and >= the slot size {config.slot_size}")
    if kv_cache.stride()[1:] != (num_kv_heads * padded_slot, padded_slot, 1):
        raise ValueError(f"kv_cache: a block's interior must be contiguous, got strides {kv_cache.stride()}")


def cache_regions(kv_cache: torch.Tensor, config: TurboQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two regions of every block (writing through them writes ``kv_cache``).

    Returns:
        ``(data [blocks, block_size, HKV, data_bytes_per_slot] uint8,
        meta [blocks, HKV, fields, block_size, 2] uint8)`` where ``meta[..., :]`` are the two
        little-endian bytes of an fp16 (see :func:`read_meta`).
    """
    check_cache(kv_cache, config)
    _, block_size, num_kv_heads, _ = kv_cache.shape
    blocks = kv_cache.flatten(1)
    data_end = config.meta_region_offset(block_size, num_kv_heads)
    meta_end = data_end + num_kv_heads * config.num_meta_fields * block_size * 2
    data = blocks[:, :data_end].unflatten(1, (block_size, num_kv_heads, config.data_bytes_per_slot))
    meta = blocks[:, data_end:meta_end].unflatten(1, (num_kv_heads, config.num_meta_fields, block_size, 2))
    return data, meta


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., F]`` float16 -> ``[..., F, 2]`` little-endian byte pairs."""
    return x.to(torch.float16).contiguous().view(torch.uint8).unflatten(-1, (-1, 2))


def read_meta(meta: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian byte pairs -> ``[...]`` float16."""
    return meta.contiguous().view(torch.float16).squeeze(-1)


def write_slots(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_bytes: torch.Tensor,
    value_bytes: torch.Tensor,
    fields: torch.Tensor,
    config: TurboQuantConfig,
) -> torch.Tensor:
    """A copy of ``kv_cache`` with each kept token's record and fp16 fields written to its slot.

    Token ``t`` goes to block ``slot // block_size``, position ``slot % block_size``; a negative
    slot is skipped. Layout: :class:`TurboQuantConfig`.

    Args:
        kv_cache: uint8 ``[blocks, block_size, HKV, padded_slot]``.
        slot_mapping: ``[T]`` int.
        key_bytes, value_bytes: ``[T, HKV, key_data_bytes]``, ``[T, HKV, value_data_bytes]`` uint8.
        fields: ``[T, HKV, fields]`` float16 (``k_norm, v_scale, v_zero`` or ``v_scale, v_zero``).

    Returns:
        The new cache.
    """
    out = kv_cache.clone()
    data, meta = cache_regions(out, config)
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    blk, pos = slots // block_size, slots % block_size
    data[blk, pos] = torch.cat([key_bytes[keep], value_bytes[keep]], dim=-1)
    meta[blk, :, :, pos] = _fp16_bytes(fields[keep])  # [T', HKV, fields, 2]
    return out


def turboquant_store(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    config: TurboQuantConfig,
) -> torch.Tensor:
    """Quantize tokens into their cache slots; the cache with those slots written (pure).

    Per (token, head): MSE keys -> packed codes (:func:`quantize_keys`, LSB-first
    :func:`pack_codes`) and an fp16 norm; FP8 keys -> :func:`e4m3_bytes`; values -> packed
    min-max codes, fp16 scale and zero (:func:`quantize_values`). Slots and layout:
    :func:`write_slots`. Paper: papers.md#turboquant.

    Args:
        kv_cache: uint8 ``[blocks, block_size, HKV, padded_slot]``.
        key, value: ``[T, HKV, D]`` float16/bfloat16/float32.
        slot_mapping: ``[T]`` int.
        PiT: ``[D, D]`` float32; boundaries: ``[N-1]``; centroids: ``[N]`` float32 (MSE keys).
        config: the preset at this ``D``.

    Returns:
        A new uint8 cache, equal to ``kv_cache`` outside the written slots.

    Traffic: reads ``T*HKV*D`` keys and values (plus ``D*D*4`` bytes of ``PiT``); writes
    ``T*HKV*slot_size`` bytes.
    """
    v_codes, v_scale, v_zero = quantize_values(value, config.value_quant_bits)
    if config.key_fp8:
        key_bytes = e4m3_bytes(key)
        fields = [v_scale, v_zero]
    else:
        codes, norm = quantize_keys(key, PiT, boundaries, centroids, config.norm_correction)
        key_bytes = pack_codes(codes, config.key_quant_bits)
        fields = [norm, v_scale, v_zero]
    value_bytes = pack_codes(v_codes, config.value_quant_bits)
    return write_slots(kv_cache, slot_mapping, key_bytes, value_bytes, torch.stack(fields, dim=-1), config)


# ----------------------------------------------------------------------------------------------
# Reading the cache and decode attention.
# ----------------------------------------------------------------------------------------------


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """OCP e4m3fn byte codes -> float64 values (0x7F/0xFF are NaN)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def read_tokens(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int, config: TurboQuantConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``0 .. num_tokens-1`` of one request: key bytes, dequantized values and meta fields.

    Key ``j`` lives at block ``block_table_row[j // block_size]``, position ``j % block_size``.
    Values are ``q * scale + zero`` with the fp16 scale and zero.

    Returns:
        ``(key_bytes [L, HKV, key_data_bytes] uint8, values [L, HKV, D] float64,
        fields [L, HKV, fields] float64)``: the stored norm is field 0 for MSE keys.
    """
    data, meta = cache_regions(kv_cache, config)
    block_size = kv_cache.shape[1]
    records = gather_tokens(data, block_table_row, num_tokens, block_size)  # [L, HKV, bytes]
    meta_by_position = rearrange(meta, "n h f p two -> n p h (f two)")
    meta_bytes = gather_tokens(meta_by_position, block_table_row, num_tokens, block_size)
    fields = read_meta(meta_bytes.unflatten(-1, (-1, 2))).to(torch.float64)
    key_bytes, value_bytes = records[..., : config.key_data_bytes], records[..., config.key_data_bytes :]
    v_codes = unpack_codes(value_bytes, config.value_quant_bits).to(torch.float64)
    values = v_codes * fields[..., -2, None] + fields[..., -1, None]
    return key_bytes, values, fields


def reconstruct_rotated_keys(
    key_bytes: torch.Tensor, stored_norm: torch.Tensor, centroids: torch.Tensor, bits: int
) -> torch.Tensor:
    """MSE keys rebuilt from their codes and stored norms, in the rotated basis: ``n * c[idx]``.

    ``k~ = n c[idx]`` approximates ``k Pi^T``; multiply by ``Pi`` (``@ PiT.T``) for the key itself.
    Decode scores the rotated query against ``k~`` and never un-rotates.

    Args:
        key_bytes: ``[..., key_data_bytes]`` uint8 packed codes; stored_norm: ``[...]`` (fp16 read
            as float64); centroids: ``[2^bits]`` float32; bits: 3 or 4.

    Returns:
        ``[..., D]`` float64.
    """
    codes = unpack_codes(key_bytes, bits)
    return stored_norm[..., None] * centroids.to(torch.float64)[codes]


def _request_keys_values(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int, centroids: torch.Tensor,
    config: TurboQuantConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Keys in the basis the query is scored in (rotated for MSE keys) and values, float64."""
    key_bytes, values, fields = read_tokens(kv_cache, block_table_row, num_tokens, config)
    return score_basis_keys(key_bytes, fields, centroids, config), values


def score_basis_keys(
    key_bytes: torch.Tensor, fields: torch.Tensor, centroids: torch.Tensor, config: TurboQuantConfig
) -> torch.Tensor:
    """Keys from :func:`read_tokens`' bytes and fields, in the basis the query is scored in: MSE keys ``n c[idx]``
    in the rotated basis (:func:`reconstruct_rotated_keys`), FP8 keys decoded. ``[..., D]`` float64."""
    if config.key_fp8:
        return e4m3_to_float(key_bytes)
    return reconstruct_rotated_keys(key_bytes, fields[..., 0], centroids, config.key_quant_bits)


def _query_basis(query: torch.Tensor, PiT: torch.Tensor, config: TurboQuantConfig) -> torch.Tensor:
    """The query in the keys' basis: ``q @ Pi^T`` for MSE keys, ``q`` for FP8 keys (float64)."""
    q = query.to(torch.float64)
    return q if config.key_fp8 else q @ PiT.to(torch.float64)


def turboquant_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    PiT: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    config: TurboQuantConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token decode attention over a TurboQuant cache, as the paper's equations.

    ``q~ = q Pi^T`` once per query; MSE keys ``s_j = scale * n_j <q~, c[idx_j]>`` (``n_j`` the
    stored, possibly norm-corrected norm; ``<q, k> = <q Pi^T, k Pi^T>`` for orthogonal ``Pi``);
    FP8 keys ``s_j = scale * <q, k_j>``. ``p = softmax(s)`` over ``j < seq_lens[b]``, ``out =
    sum_j p_j (q_j * v_scale_j + v_zero_j)``. GQA: query head ``h`` reads KV head ``h // (H /
    HKV)``. ``lse = ln sum_j exp(s_j)``; an empty request gives ``out = 0``, ``lse = -inf``.
    Paper: papers.md#turboquant.

    Args:
        query: ``[B, H, D]`` float16/bfloat16/float32.
        kv_cache: uint8 ``[blocks, block_size, HKV, padded_slot]`` written by :func:`turboquant_store`.
        block_table: ``[B, max_blocks]`` int; seq_lens: ``[B]`` int.
        PiT: ``[D, D]`` float32 (unused for FP8 keys); centroids: ``[N]`` float32.
        scale: the softmax scale.
        config: the preset at this ``D``.

    Returns:
        ``(out [B, H, D], lse [B, H])`` float64.

    Traffic: reads ``sum_b L_b * HKV * (data_bytes_per_slot + 2 * fields)`` cache bytes plus the
    query and block table; writes ``B*H*D`` outputs and ``B*H`` LSEs.
    """
    num_kv_heads = kv_cache.shape[2]
    q = rearrange(_query_basis(query, PiT, config), "b (hkv g) d -> b hkv g d", hkv=num_kv_heads)
    outs, lses = [], []
    for b in range(query.shape[0]):
        keys, values = _request_keys_values(kv_cache, block_table[b], int(seq_lens[b]), centroids, config)
        scores = scale * einsum(q[b], keys, "hkv g d, l hkv d -> hkv g l")
        p, lse = masked_softmax_state(scores, torch.ones_like(scores, dtype=torch.bool))
        outs.append(einsum(p, values, "hkv g l, l hkv d -> hkv g d"))
        lses.append(lse)
    out = rearrange(torch.stack(outs), "b hkv g d -> b (hkv g) d")
    return out, rearrange(torch.stack(lses), "b hkv g -> b (hkv g)")


def split_ranges(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """The kernel's split-KV partition: ``c = cdiv(L, S)``, split ``s`` covers ``[s*c, min((s+1)*c, L))``.

    Splits past the end are empty (``lo == hi``); every split has a slot in the stage-1 buffer.
    """
    chunk = -(-seq_len // num_splits)
    return [(min(s * chunk, seq_len), min((s + 1) * chunk, seq_len)) for s in range(num_splits)]


def request_splits(seq_len: int, num_splits: int, ranges: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """A request's ``num_splits`` key ranges: :func:`split_ranges`, or the given ``ranges`` (e.g. a stream-K
    division) then empty ones."""
    if ranges is None:
        return split_ranges(seq_len, num_splits)
    return list(ranges) + [(seq_len, seq_len)] * (num_splits - len(ranges))


def turboquant_decode_split_states(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    PiT: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    config: TurboQuantConfig,
    num_splits: int,
    ranges: list[list[tuple[int, int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of the split-KV decode: each split's attention state (:func:`split_ranges`, or ``ranges``).

    ``merge_states`` of these equals :func:`turboquant_decode_attention`. An empty split is the
    neutral state ``(0, -inf)``. Paper: papers.md#turboquant.

    Args:
        as :func:`turboquant_decode_attention`, plus num_splits: ``S``; ranges: each request's splits as key ranges
            ``[lo, hi)`` instead of :func:`split_ranges` (at most ``S``; the slots after them empty), e.g. a
            stream-K division of the keys.

    Returns:
        ``(o [B, H, S, D], lse [B, H, S])`` float64.

    Traffic: as :func:`turboquant_decode_attention`, writing ``B*H*S*(D+1)`` values.
    """
    num_kv_heads = kv_cache.shape[2]
    q = rearrange(_query_basis(query, PiT, config), "b (hkv g) d -> b hkv g d", hkv=num_kv_heads)
    outs, lses = [], []
    for b in range(query.shape[0]):
        seq_len = int(seq_lens[b])
        keys, values = _request_keys_values(kv_cache, block_table[b], seq_len, centroids, config)
        cuts = request_splits(seq_len, num_splits, None if ranges is None else ranges[b])
        parts = [torch.arange(lo, hi, device=kv_cache.device) for lo, hi in cuts]
        states = [split_states(q[b, h], keys[:, h], values[:, h], scale, parts) for h in range(num_kv_heads)]
        outs.append(torch.stack([o for o, _ in states]))  # [HKV, G, S, D]
        lses.append(torch.stack([lse for _, lse in states]))
    o = rearrange(torch.stack(outs), "b hkv g s d -> b (hkv g) s d")
    return o, rearrange(torch.stack(lses), "b hkv g s -> b (hkv g) s")
