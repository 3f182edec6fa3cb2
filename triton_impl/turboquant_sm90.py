"""TurboQuant on NVIDIA Hopper, in Gluon: the sm_90 fast paths of the decode's stage 1
(:func:`triton_impl.turboquant.triton_turboquant_decode_attention_v2`) and of the store of MSE keys
(:func:`triton_impl.turboquant.triton_turboquant_store`; the last two sections of this file).

The portable Triton kernels (``turboquant._decode_stage1_kernel``, ``turboquant._store_kernel``) compute the same
results and stay the readable twins: they run under the interpreter, these do not. What these kernels do that
Triton's layouts do not let the portable ones do: every tensor-core operand is built in the registers the MMA
instruction reads it from, by choosing which codes each thread loads. A dot product does not care in which order it
visits the dimensions, so the query, the codes and the output are all visited in permuted orders that make this
possible (:func:`_score_dim`, :func:`_value_dim`, :func:`_rotation_dim`, :func:`_code_dim`).

**Decode stage 1.** A program attends one KV head's group of query heads over a run of keys and writes a partial
``(o, lse)``; the second stage (``triton_impl.lse_merge.merge_splits``) merges them. Which kernel serves a call:

- one warp a program (:func:`decode_stage1_stream_k_kernel` for 3- and 4-bit keys, :func:`decode_stage1_warp_kernel`
  for FP8 keys; groups of at most 8 heads, a 16-byte aligned cache: :func:`streams_supports`). The run's 16-key
  chunks are copied by TMA (the slots' bytes and their metadata) into a ring of ``STAGES`` shared-memory buffers, and
  each iteration takes ``STEP`` (2) of them through one online softmax step; 3-bit values are loaded into registers a
  step ahead instead. 16 programs a SM at 128 registers (3-bit values: 12 at 168). Stream-K runs one round of
  programs and divides each KV head's keys over the whole batch evenly among them, a piece of a request a partial
  slot (the section "Stream-K" says how, and why 3-bit values weigh the programs by their rank on their scheduler);
  the grid kernel runs fixed splits ``(B, HKV, S)``.
- 4 warps a program on 64-key tiles (:func:`decode_stage1_kernel`, grid ``(B, HKV, S)``): the calls the one-warp
  kernels do not take (groups of 9-16 heads, the operands as fp16 hi + lo pairs, a cache not 16-byte aligned). With
  4-bit values its tiles are copied ``STAGES - 1`` tiles ahead by ``cp.async`` (the section "Staged tiles").
- 4 one-warp streams a program (:func:`decode_stage1_streams_kernel`): only where a config asks for it. It runs the
  one-warp kernel's stream in four partitions, four copies of the loop in the instruction cache where one-warp
  programs share one.

Every kernel computes a chunk the same way:

- scores as ``S^T = K q^T``: the keys are the MMA's M (``mma.sync.m16n8k16``, 16 keys), the group's heads its N. Each
  thread reads the contiguous key bytes of its dimensions and turns each pair of codes into the A-operand register
  that holds their two fp16 centroids: for 4-bit codes by ``prmt`` from 8 registers holding the 16 centroids' bytes
  (:func:`_nibble_pairs`, :func:`_symmetric_pairs`: no memory access), for 3-bit codes from 4 (:func:`_triple_pairs`),
  for FP8 keys by the hardware e4m3x2 conversion; in the one-warp kernels with ``SHARED_PAIRS``, by one ``ld.shared``
  from a table of the pairs (:func:`_shared_pair_table`; the sm90 entry's for 3-bit keys with 4-bit values). The
  query is loaded in the same permuted order, from the rotation's output or, for serving's ``PiT = c H_128`` and
  4-bit values, rotated by the program itself (``HADAMARD_QUERY``, :func:`_hadamard_query`);
- the online softmax in base 2, per head;
- values as ``O^T += V^T P^T``: each value code becomes an exact fp16 with one integer op, no lookup: a code masked
  in place in a 16-bit half is the fp16 subnormal ``c 2^-24``, one ``lop3`` makes two (:func:`_code_halves`), and the
  output rows take the ``2^24`` back at the end; values are affine in their codes, so each key's scale multiplies
  its weight and the zeros add up, weighted, in one sum a head (``z_i``). 3-bit values of a lane quad come as a
  6-byte span of a key (:func:`_span_operand`).

Numerics are the portable kernel's: centroids rounded to fp16 once, codes exact, fp32 sums, and the query and the
weights ``p * scale`` either as fp16 hi + lo pairs (two MMAs each) or, with ``FP16_OPERANDS`` (the sm90 entry's
choice; the one-warp kernels have no other form), rounded once to fp16 as upstream rounds its query. Served
(:func:`supports`): ``HEAD_DIM = 128``, 3- or 4-bit MSE keys or FP8 keys, 3- or 4-bit values, a group of at most 16
query heads, a block size a multiple of 16, 16-byte aligned slots.

**Store** (bf16 keys at ``D = 128``, 3- or 4-bit MSE codes; :func:`store_supports`): persistent programs over tiles of
(token, KV head) rows, each row rotated (``k @ PiT``), normalized, bucketized to its nearest centroid by a grid table
(:func:`grid_table`, shared with the portable store, a binary search where the table cannot separate two midpoints),
packed and stored with its norm and the values' min-max scale and zero. For serving's rotation, ``PiT = H_128 /
sqrt(128)`` (:func:`is_hadamard_rotation`), :func:`store_hadamard_kernel` rotates by the fast Walsh-Hadamard
transform in fp32 (five butterfly stages in each thread's registers, two across a lane quad; for 4-bit keys the
``H_32`` factor on warp MMAs, ``MMA_H32``), looks its codes up by warp shuffles (:func:`_lookup`), takes each value's
level by one saturating product (:func:`_store_values`), and keeps the slots' 2-byte fields in L2 while the rows
leave first. For any other ``PiT``, :func:`store_kernel` rotates on warpgroup MMAs (``wgmma.m64n128k16``, ``PiT``
rounded once into bf16 hi + lo parts held in shared memory).

**On the H200** (``notebooks/results/bench_h200.md``, the whole call; B=32 Hq=32 Hk=8 D=128, block 16): decode at L=8K /
32K, FP8 keys 0.124 / 0.472 ms (78% / 82% of the copy roofline over the bytes read), 4-bit 0.109 / 0.367 (61% / 72%),
3-bit keys 0.104 / 0.340 (56% / 68%), 3-bit keys and values 0.121 / 0.387 (42% / 52%), against 0.253-0.254 / 0.959-0.961
ms for the bf16 decode of the same shape; the store of 1M tokens x 8 KV heads at random slots 1.72-1.80 ms (70% of the
copy roofline, where a scatter of the same bytes with no arithmetic reaches 76-84%). The decode's loop is bound by its
ALU-pipe instructions, most of them the keys' lookups; ``notebooks/results/perf_log.md`` has every change with its
prediction and measurement, and the variants that lost.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from triton_impl.launch import device_arch, register_cap

HEAD_DIM = gl.constexpr(128)
BLOCK_N = gl.constexpr(64)  # keys per tile: 16 per warp for the scores
NUM_WARPS = gl.constexpr(4)
_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
# Gluon names that changed after Triton 3.6 (the H200's): a CTA-wide barrier (``thread_barrier``, later ``barrier``),
# cp.async from global to shared memory (``async_copy_global_to_shared``, later ``async_load``) and a shared memory
# view as another dtype (``_reinterpret``, later ``reinterpret``).
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def _hopper(device: torch.device) -> bool:
    """Compiled (not interpreted) for a device of compute capability 9.x (H100, H200); the architecture lookup is
    cached, so a call pays no driver query."""
    return device_arch(device).startswith("sm9")


def supports(*, device: torch.device, head_dim: int, key_bits: int, value_bits: int, group: int, block_size: int,
             stride_block: int, slot_bytes: int, key_bytes: int) -> bool:  # fmt: skip
    """Whether a decode call is one this kernel serves (else the portable kernel runs): compiled (not
    interpreted) for compute capability 9.x (H100, H200), and a layout it reads with aligned vector loads."""
    aligned = block_size % 16 == 0 and stride_block % 16 == 0 and slot_bytes % 16 == 0 and key_bytes % 16 == 0
    served = head_dim == HEAD_DIM and key_bits in (3, 4, 8) and value_bits in (3, 4) and group <= 16 and aligned
    return served and _hopper(device)


def stages(requested: int, key_bits: int, value_bits: int) -> int:
    """The shared-memory stages a launch runs (``decode_stage1_kernel``'s ``STAGES``): ``requested`` (at least 2)
    for 4-bit values (any keys), else 0 (each tile loaded into registers). 3-bit values staged as 4-byte copies,
    each lane quad's first word (16 copies a thread and tile) were 1.5-1.6x slower than loaded into registers on the
    H200 (``notebooks/results/perf_log.md``)."""
    del key_bits  # every key width is staged
    return requested if requested >= 2 and value_bits == 4 else 0


def launch_options(group: int, maxnreg: int | None, warps: int = int(NUM_WARPS)) -> dict[str, int]:
    """``BLOCK_H`` (the group's heads, padded to an MMA N of 8 or 16), ``num_warps`` (``warps``) and the register
    cap: ``maxnreg`` holds the 8-head tile at four programs per SM (a 16-head tile spills 288 B at 128)."""
    block_h = max(8, 1 << (group - 1).bit_length())
    return {"BLOCK_H": block_h, "num_warps": warps, **register_cap(maxnreg if block_h == 8 else None)}


def compile_for_sm90(*, key_bits: int, value_bits: int = 4, group: int = 4, block_size: int = 16,
                     maxnreg: int | None = None, stages: int = 0, fp16_operands: bool = False,
                     streams: bool = False, warp: bool = False, step: int = 1,
                     stream_k: bool = False, ranks: int = 1, tilt: int = 0,
                     hadamard_query: bool = False, shared_pairs: int = 0) -> Any:  # fmt: skip
    """Stage 1 compiled for sm_90 on any machine (no GPU needed), specialized as a launch of the bench's
    shapes is (16-byte aligned pointers, the integer arguments that are multiples of 16 marked so, the
    block table's unit column stride a constant): the ``CompiledKernel``, with ``asm["cubin"]``.
    ``streams``: :func:`decode_stage1_streams_kernel` (``stages`` chunk buffers a stream); ``warp``:
    :func:`decode_stage1_warp_kernel` (``step`` chunks an iteration; with ``stream_k``,
    :func:`decode_stage1_stream_k_kernel`, its places weighted by ``ranks`` and ``tilt``; either rotating the query
    itself with ``hadamard_query``); else :func:`decode_stage1_kernel`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = decode_stage1_streams_kernel if streams else decode_stage1_kernel
    if warp:
        fn = decode_stage1_stream_k_kernel if stream_k else decode_stage1_warp_kernel
    names = fn.arg_names
    key_bytes = 16 * key_bits  # D = 128 codes of key_bits bits (FP8 keys: 8)
    pointers = {"q_ptr": "*bf16", "cache_ptr": "*u8", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                "centroid_ptr": "*fp32", "partials_ptr": "*fp32", "pit_ptr": "*fp32",
                "data_desc": f"tensordesc<u8[1, 16, {data_row(key_bytes)}],{_data_smem(data_row(key_bytes))!r}>",
                "value_desc": f"tensordesc<u8[1, 16, 64],{_data_smem(64)!r}>",
                "meta_desc": f"tensordesc<fp16[1, {int(TMA_META_ROWS)}, 16],{_META_SMEM!r}>"}  # fmt: skip
    divisible = ("num_splits", "num_blocks", "table_keys", "stride_block", "stride_qb", "stride_qh", "stride_bt",
                 "stride_pb", "stride_ph")  # fmt: skip
    constexprs = dict(KV_GROUP=group, KEY_BITS=key_bits, KEY_DATA_BYTES=key_bytes, VALUE_BITS=value_bits,
                      SLOT_BYTES=key_bytes + 16 * value_bits,
                      NUM_KV_HEADS=8, BLOCK_SIZE=block_size, STAGES=stages, FP16_OPERANDS=int(fp16_operands),
                      stride_btc=1)  # fmt: skip
    if warp:
        constexprs |= {"STEP": step, "HADAMARD_QUERY": int(hadamard_query), "SHARED_PAIRS": shared_pairs}
    if warp and stream_k:
        constexprs |= {"RANKS": ranks, "TILT": tilt}
    options = launch_options(group, maxnreg, warps=1 if warp else int(NUM_WARPS))
    constexprs["BLOCK_H"] = options.pop("BLOCK_H")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "sm_scale" else "i32")
                 for n in names}  # fmt: skip
    values = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *divisible) if n in names
             and not n.endswith("_desc")}  # fmt: skip
    return triton_compile(GluonASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)  # fmt: skip


def compile_store_for_sm90(*, key_bits: int = 4, value_bits: int = 4, norm_correction: bool = True,
                           block_size: int = 16, maxnreg: int | None = None, warps: int = 4,
                           early_values: bool = True, prefetch: bool = True, hadamard: bool = False,
                           knobs: dict[str, bool] | None = None) -> Any:
    """:func:`store_kernel` (``hadamard``: :func:`store_hadamard_kernel`, its switches ``knobs`` as
    ``turboquant.hadamard_store_knobs`` reads them from an entry, each off where absent) compiled for sm_90 on any
    machine, specialized as the bench's launch is (8 KV heads, 16-byte aligned pointers, the strides multiples of
    16): the ``CompiledKernel``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = store_hadamard_kernel if hadamard else store_kernel
    names = fn.arg_names
    pointers = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*u8", "slot_ptr": "*i64",
                "pit_ptr": "*fp32", "midpoint_ptr": "*fp32", "centroid_ptr": "*fp32"}  # fmt: skip
    divisible = ("num_slots", "stride_block", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_pit")
    slot_bytes = 128 * (key_bits + value_bits) // 8
    constexprs = dict(NUM_KV_HEADS=8, KEY_BITS=key_bits, VALUE_BITS=value_bits, NORM_CORRECTION=norm_correction,
                      SLOT_BYTES=slot_bytes, BLOCK_SIZE=block_size, WIDE_SLOTS=False, WARPS=warps)  # fmt: skip
    constexprs |= dict.fromkeys(HADAMARD_KNOBS, False) | (knobs or {}) if hadamard else \
        dict(EARLY_VALUES=early_values, PREFETCH=prefetch)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    values = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *divisible) if n in names}
    return triton_compile(GluonASTSource(fn, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": int(warps), **register_cap(maxnreg)})  # fmt: skip


@gluon.constexpr_function
def _axis_layout(layout, rank, dim):
    """The layout of an index along ``dim`` of a rank-``rank`` tensor: ``layout`` sliced along every other dim."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def _iota(N: gl.constexpr, DIM: gl.constexpr, RANK: gl.constexpr, LAYOUT: gl.constexpr):
    """``0 .. N-1`` along ``DIM`` of a rank-``RANK`` tensor in ``LAYOUT`` (size 1 along every other dim)."""
    x = gl.arange(0, N, layout=_axis_layout(LAYOUT, RANK, DIM))
    for d in gl.static_range(RANK):
        if d != DIM:
            x = gl.expand_dims(x, d)
    return x


@gluon.jit
def _score_dim(k):
    """The head dimension the scores' MMA reads at its K index ``k``: thread ``t`` (lane % 4) of an
    A-operand quad holds K indices ``16c + 8j + 2t + e`` (chunk ``c``, half ``j``, pair element
    ``e``); those are dimensions ``32t + 4c + 2j + e``, so each thread's 32 are contiguous (16 bytes of
    4-bit codes, 32 of FP8)."""
    return ((k >> 1) & 3) * 32 + (k >> 4) * 4 + ((k >> 3) & 1) * 2 + (k & 1)


@gluon.jit
def _value_dim(d):
    """The head dimension the value MMA computes in its output row ``d``: warp ``w`` owns rows ``64m +
    16w + 8h + g`` (M tile ``m``, half ``h``, lane quad ``g``); they are dimensions ``32w + 4g + 2m + h``,
    so each thread's four are the 4 codes of one 16-bit word."""
    return ((d >> 4) & 3) * 32 + (d & 7) * 4 + (d >> 6) * 2 + ((d >> 3) & 1)


@gluon.jit
def _f16_halves(x):
    """uint32 -> its two fp16 halves (low, high): a register reinterpretation, no instruction."""
    return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)  # fmt: skip


# The value codes reach the MMA as fp16 subnormals: a 16-bit half whose exponent bits are zero and whose mantissa
# bits are ``x < 1024`` is the fp16 ``x * 2^-24``, exactly, and the tensor cores multiply subnormal fp16 operands
# exactly (``tests/test_turboquant.py::test_mma_multiplies_fp16_subnormals_exactly``). So masking two codes in place is
# the whole conversion: the product ``O^T += V^T P^T`` comes out times ``2^-24`` (far above fp32's least normal,
# ``2^-126``), and :func:`_value_row_scale` and :func:`_span_row_scale` take the ``2^24`` back with the rows' other
# powers of two. Before it, each half was made the
# fp16 ``1024 + x`` (the mask and ``| 0x6400`` in one ``lop3``) and one packed ``sub.f16x2`` took the 1024 back.
# Triton 3.6, a two-chunk step: 4-bit keys 805 -> 744 instructions, k3v4 787 -> 730, 3bit_nc 924 -> 860, FP8 keys 566
# -> 515 (no ALU-pipe instruction less). Stage 1 on the H200 in one call against the bias (us, L=8K / 32K): 4-bit 99.6
# -> 97.0 / 360.3 -> 342.9, k3v4 94.5 -> 92.0 / 331.5 -> 324.2, 3bit_nc 106.6 -> 105.8 / 372.9 -> 370.5, FP8 keys
# 117.1 -> 117.3 / 481.7 -> 483.0; on an H100, within 1% either way. The price: the products are exact, but the MMA
# sums them more coarsely than codes as normal fp16 (``parity.turboquant.SUBNORMAL_CODES`` bounds it).


CODE_SCALE = gl.constexpr(16777216.0)  # 2^24: what the output rows are multiplied by to undo the codes' unit 2^-24


@gluon.jit
def _code_halves(x, MASK: gl.constexpr):
    """uint32 ``x`` -> the two fp16 halves of ``x & MASK`` (``MASK``'s bits below bit 10 of each half), each ``c *
    2^-24`` for its masked bits ``c``, exactly: one ``lop3``, no conversion."""
    return _f16_halves(x & MASK)


# The inline PTX of the 4-bit keys' lookup, module-level so that a test runs it through a model of its instructions
# (tests/test_turboquant.py), as the interpreter cannot: an identity ``prmt`` whose selector carries the lane id in the
# 16 bits ``prmt`` ignores (:func:`_byte_table`), and the byte-table lookup of 8 codes (:func:`_nibble_pairs`).
PER_THREAD_ASM = gl.constexpr(
    "{ .reg .b32 s; mov.b32 s, %laneid; shl.b32 s, s, 16; or.b32 s, s, 0x3210; prmt.b32 $0, $1, 0, s; }")
# Both lookups end alike: the low bytes (l0, l1) and high bytes (h0, h1) of 8 centroids interleaved into 4 fp16 pairs.
_INTERLEAVE_PAIRS = """
        prmt.b32 $0, l0, h0, 0x5140;
        prmt.b32 $1, l0, h0, 0x7362;
        prmt.b32 $2, l1, h1, 0x5140;
        prmt.b32 $3, l1, h1, 0x7362;
        }"""
# Both 4-bit lookups begin alike: from the selectors of codes 0-3 (s0), those of codes 4-7 (s1), and each code's bit 3
# spread over its byte (``prmt``'s sign-replicate mode on the codes' bytes, shifted so that each code's bit 3 is a
# byte's top bit): the byte masks m0 (codes 0-3) and m1 (codes 4-7).
_SECOND_SELECTORS_AND_MASKS = """
        shr.b32 s1, s0, 16;
        shl.b32 y, $4, 4;
        prmt.b32 m0, $4, y, 0x9D8C;
        prmt.b32 m1, $4, y, 0xBFAE;"""
NIBBLE_PAIRS_ASM = gl.constexpr("""{
        .reg .b32 s0, s1, y, m0, m1, a, b, l0, h0, l1, h1;
        and.b32 s0, $4, 0x77777777;""" + _SECOND_SELECTORS_AND_MASKS + """
        prmt.b32 a, $5, $6, s0;
        prmt.b32 b, $7, $8, s0;
        lop3.b32 l0, a, b, m0, 0xD8;
        prmt.b32 a, $9, $10, s0;
        prmt.b32 b, $11, $12, s0;
        lop3.b32 h0, a, b, m0, 0xD8;
        prmt.b32 a, $5, $6, s1;
        prmt.b32 b, $7, $8, s1;
        lop3.b32 l1, a, b, m1, 0xD8;
        prmt.b32 a, $9, $10, s1;
        prmt.b32 b, $11, $12, s1;
        lop3.b32 h1, a, b, m1, 0xD8;""" + _INTERLEAVE_PAIRS)


# The 4-bit lookup of a symmetric codebook (``c[15 - k] = -c[k]`` bit for bit: :func:`_centroid_tables` checks it),
# checked like the others: code ``k``'s centroid is ``c[8 + (k & 7)]`` where its bit 3 is set, else ``c[8 + 7 - (k &
# 7)]`` with the sign flipped. The selectors are ``(k & 7) ^ 7`` where bit 3 is clear (``shr``, ``lop3``, ``mul`` by 7,
# ``lop3``), one ``prmt`` per 4 codes and byte plane from the 2 table registers of centroids 8-15, the high bytes'
# sign bit flipped where bit 3 is clear (the same byte masks as the general lookup), and the interleave: 18
# instructions for 8 codes where the general lookup takes 21.
SYMMETRIC_PAIRS_ASM = gl.constexpr("""{
        .reg .b32 t, s0, s1, y, m0, m1, l0, h0, l1, h1;
        shr.b32 t, $4, 3;
        lop3.b32 t, t, 0x11111111, 0, 0x0C;
        mul.lo.u32 t, t, 7;
        lop3.b32 s0, $4, 0x77777777, t, 0x6A;""" + _SECOND_SELECTORS_AND_MASKS + """
        prmt.b32 l0, $5, $6, s0;
        prmt.b32 h0, $7, $8, s0;
        prmt.b32 l1, $5, $6, s1;
        prmt.b32 h1, $7, $8, s1;
        lop3.b32 h0, h0, m0, 0x80808080, 0xD2;
        lop3.b32 h1, h1, m1, 0x80808080, 0xD2;""" + _INTERLEAVE_PAIRS)


@gluon.jit
def _symmetric_pairs(w, tables):
    """:func:`_nibble_pairs` for a symmetric codebook, from the 4 table registers of centroids 8-15 (``tables[2:4]``
    and ``tables[6:8]``: their low and high bytes) (:data:`SYMMETRIC_PAIRS_ASM`)."""
    return gl.inline_asm_elementwise(
        SYMMETRIC_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r", [w, tables[2], tables[3], tables[6], tables[7]],
        dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def _byte_table(centroid_ptr, FIRST: gl.constexpr, SHIFT: gl.constexpr):
    """Byte ``SHIFT // 8`` of the fp16 centroids ``FIRST .. FIRST + 3``, packed: byte ``i`` is centroid
    ``FIRST + i``'s, in a per-thread register. The same value in every thread would live in a uniform register,
    and ``prmt`` reads at most one: ptxas then copies a table into a per-thread register at each use (68 moves a
    4-bit tile). So the table passes through an identity ``prmt`` whose selector carries the lane id in its upper
    16 bits, which ``prmt`` ignores (:data:`PER_THREAD_ASM`): the result is the table, bit for bit, and no longer
    uniform to ptxas (618 -> 565 instructions a tile, Triton 3.6)."""
    table = gl.to_tensor(0).to(gl.uint32)
    for i in gl.static_range(4):
        bits = gl.load(centroid_ptr + FIRST + i).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        table |= ((bits >> SHIFT) & 0xFF) << (8 * i)
    return gl.inline_asm_elementwise(PER_THREAD_ASM, "=r,r", [table], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _nibble_pairs(w, tables):
    """uint32 of 8 4-bit codes -> 4 uint32, register ``j`` the fp16 centroids of codes ``2j`` (low half) and ``2j + 1``
    (high half), by ``prmt`` from 8 table registers: the low 3 bits of 4 codes pick among centroids 0-7
    (``tables[0:2]``, low bytes) and 8-15 (``tables[2:4]``); a byte mask from each code's bit 3 (``prmt``'s
    sign-replicate mode) chooses; the same for the high bytes (``tables[4:8]``); two ``prmt`` interleave them
    (:data:`NIBBLE_PAIRS_ASM`)."""
    return gl.inline_asm_elementwise(
        NIBBLE_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
        [w, tables[0], tables[1], tables[2], tables[3], tables[4], tables[5], tables[6], tables[7]],
        dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1)  # fmt: skip


# The pair table in shared memory (:func:`_shared_pair_table`, one-warp programs; ``SHARED_PAIRS``): entry ``e``, the
# bits of two codes (the first code in the low ``b`` bits), holds the fp16 centroids of codes ``e & (2^b - 1)`` (low
# half) and ``e >> b`` (high half), the registers :func:`_nibble_pairs` and :func:`_triple_pairs` assemble by ``prmt``
# (256 entries for 4-bit codes, 64 for 3-bit). A lookup there is one ``ld.shared`` a pair of codes and one or two ALU
# instructions for its address, against about four ALU instructions by ``prmt``: the ALU pipe binds the MSE decode's
# loop, the shared-memory pipe is nearly idle (``notebooks/results/perf_log.md``, forty-first session: the counts).
# Gluon has no per-lane gather from shared memory, so the inline PTX declares the table as a ``.shared`` array and
# writes and reads it by name; the declaration may appear once in a kernel (ptxas rejects a second).
PAIR_TABLE = "tq_pair_table"


# Inline PTX declaring the pair table: 1 KiB, a 4-byte word an entry, whatever the width (3-bit codes use its first 64
# words). ptxas places it after the 1 KiB sm_90 reserves and before the dynamic shared memory that holds Triton's
# buffers, which must stay 1024-byte aligned for TMA's swizzled copies into them (the chunk buffers); a 256-byte table
# put it at 0x500.
PAIR_TABLE_DECLARATION = gl.constexpr(f".shared .align 16 .b32 {PAIR_TABLE}[256]; mov.b32 $0, 0;")


# Entry $1 of the pair table := $2.
PAIR_TABLE_STORE_ASM = gl.constexpr(
    f"{{ .reg .b32 a; mov.u32 a, {PAIR_TABLE}; mad.lo.u32 a, $1, 4, a; st.shared.b32 [a], $2; mov.b32 $0, 0; }}")
# The warp's table writes made visible to its lanes (a one-warp program's barrier), then the table's shared-memory
# address: as it is (uniform: ptxas folds it into each ld.shared's address, 3-bit codes), or passed through an identity
# prmt whose selector carries the lane id in the bits prmt ignores (not uniform to ptxas, which then forms a 4-bit
# lookup's address by one IMAD, on the FMA pipe, where a uniform base took an LEA, on the ALU pipe).
PAIR_TABLE_BASE_ASM = gl.constexpr(f"{{ bar.warp.sync -1; mov.u32 $0, {PAIR_TABLE}; }}")
PAIR_TABLE_LANE_BASE_ASM = gl.constexpr(
    f"{{ .reg .b32 s; bar.warp.sync -1; mov.u32 s, %laneid; shl.b32 s, s, 16; or.b32 s, s, 0x3210; "
    f"mov.u32 $0, {PAIR_TABLE}; prmt.b32 $0, $0, 0, s; }}")
# The 4-bit lookup of a word's 4 bytes (pairs of codes) in the pair table at $5: each byte zero-extended (``and``, two
# ``prmt``, ``shr``: the ALU pipe), times 4 plus the base (``mad``: the FMA pipe), loaded.
SHARED_NIBBLE_PAIRS_ASM = gl.constexpr("""{
        .reg .b32 a0, a1, a2, a3;
        and.b32 a0, $4, 0xFF;
        prmt.b32 a1, $4, 0, 0x4441;
        prmt.b32 a2, $4, 0, 0x4442;
        shr.b32 a3, $4, 24;
        mad.lo.u32 a0, a0, 4, $5;
        mad.lo.u32 a1, a1, 4, $5;
        mad.lo.u32 a2, a2, 4, $5;
        mad.lo.u32 a3, a3, 4, $5;
        ld.shared.b32 $0, [a0];
        ld.shared.b32 $1, [a1];
        ld.shared.b32 $2, [a2];
        ld.shared.b32 $3, [a3];
        }""")
# The 3-bit lookup of a 24-bit group's 4 pairs of codes (6 bits each; the bits above 24 ignored) in the pair table at
# $5: each pair's bits shifted to bits 2-7 and masked (the byte offset of its entry), plus the base, loaded.
SHARED_TRIPLE_PAIRS_ASM = gl.constexpr("""{
        .reg .b32 a0, a1, a2, a3;
        shl.b32 a0, $4, 2;
        shr.b32 a1, $4, 4;
        shr.b32 a2, $4, 10;
        shr.b32 a3, $4, 16;
        and.b32 a0, a0, 0xFC;
        and.b32 a1, a1, 0xFC;
        and.b32 a2, a2, 0xFC;
        and.b32 a3, a3, 0xFC;
        add.u32 a0, a0, $5;
        add.u32 a1, a1, $5;
        add.u32 a2, a2, $5;
        add.u32 a3, a3, $5;
        ld.shared.b32 $0, [a0];
        ld.shared.b32 $1, [a1];
        ld.shared.b32 $2, [a2];
        ld.shared.b32 $3, [a3];
        }""")


@gluon.jit
def _shared_pair_table(centroid_ptr, KEY_BITS: gl.constexpr):
    """Writes the pair table (:data:`PAIR_TABLE`) from the fp32 centroids, rounded to fp16 as :func:`_byte_table`
    rounds them, and returns its address (:data:`PAIR_TABLE_LANE_BASE_ASM` for 4-bit codes). One-warp programs only:
    ``bar.warp.sync`` orders the writes before every lane's reads."""
    gl.static_assert(gl.num_warps() == 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(PAIR_TABLE_DECLARATION, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    entry = gl.arange(0, 1 << (2 * KEY_BITS), layout)
    low = gl.load(centroid_ptr + (entry & ((1 << KEY_BITS) - 1))).to(gl.float16).to(gl.uint16, bitcast=True)
    high = gl.load(centroid_ptr + (entry >> KEY_BITS)).to(gl.float16).to(gl.uint16, bitcast=True)
    gl.inline_asm_elementwise(PAIR_TABLE_STORE_ASM, "=r,r,r", [entry, low.to(gl.uint32) | (high.to(gl.uint32) << 16)],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    if KEY_BITS == 4:
        base = gl.inline_asm_elementwise(PAIR_TABLE_LANE_BASE_ASM, "=r", [], dtype=gl.uint32, is_pure=False, pack=1)
    else:
        base = gl.inline_asm_elementwise(PAIR_TABLE_BASE_ASM, "=r", [], dtype=gl.uint32, is_pure=False, pack=1)
    return base


@gluon.jit
def _shared_pairs(groups, base, KEY_BITS: gl.constexpr):
    """:func:`_nibble_pairs` (a word of 8 4-bit codes) or :func:`_triple_pairs` (a 24-bit group of 8 3-bit codes) from
    the pair table at ``base`` (:func:`_shared_pair_table`): register ``j`` the entry of codes ``2j, 2j + 1``."""
    if KEY_BITS == 4:
        asm: gl.constexpr = SHARED_NIBBLE_PAIRS_ASM
    else:
        asm: gl.constexpr = SHARED_TRIPLE_PAIRS_ASM
    return gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [groups, gl.full_like(groups, 0) + base],
                                     dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True,
                                     pack=1)  # fmt: skip


# The 3-bit keys' lookup (:func:`_triple_pairs`), checked like the 4-bit one: a 24-bit group of 8 codes spread so
# that code ``i`` is nibble ``i`` of a prmt selector (its sign-replicate bit clear), then one prmt per 4 bytes from
# the 2 table registers of a byte of the 8 centroids, and two prmt interleave low and high bytes into fp16 pairs.
# The spread moves code ``i`` up by ``i`` bits in three halvings, each one shift and one ``lop3`` selecting, under a
# mask, the bits that stay from the value and the rest from it shifted: codes 4-7 up by 4 (bits 0-11 stay), then codes
# 2, 3, 6, 7 by 2 (0-5 and 16-21 stay), then the odd codes by 1 (each nibble's low 3 bits stay). A select fills the
# bits that no code lands on with neighbours' bits, so one ``and`` clears each nibble's top (sign-replicate) bit at
# the end; the other bits of the gaps, and the group's top 8 bits, are never read. 8 instructions for 8 codes (with
# an ``and`` and ``or`` under each shift: 10).
TRIPLE_PAIRS_ASM = gl.constexpr("""{
        .reg .b32 b, y, t, z, zs, l0, l1, h0, h1;
        shl.b32 b, $4, 4;
        lop3.b32 y, $4, b, 0xFFF, 0xE4;
        shl.b32 t, y, 2;
        lop3.b32 z, y, t, 0x3F003F, 0xE4;
        shl.b32 t, z, 1;
        lop3.b32 z, z, t, 0x7070707, 0xE4;
        and.b32 z, z, 0x77777777;
        shr.b32 zs, z, 16;
        prmt.b32 l0, $5, $6, z;
        prmt.b32 h0, $7, $8, z;
        prmt.b32 l1, $5, $6, zs;
        prmt.b32 h1, $7, $8, zs;""" + _INTERLEAVE_PAIRS)


@gluon.jit
def _triple_pairs(g, tables):
    """uint32 of 8 3-bit codes (bits ``3i ..``; the top 8 bits ignored) -> 4 uint32, register ``j`` the fp16
    centroids of codes ``2j`` (low half) and ``2j + 1`` (high half), by ``prmt`` from 4 table registers: the low
    bytes of centroids 0-3 and 4-7 (``tables[0:2]``), then their high bytes (``tables[2:4]``)
    (:data:`TRIPLE_PAIRS_ASM`)."""
    return gl.inline_asm_elementwise(TRIPLE_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r",
                                     [g, tables[0], tables[1], tables[2], tables[3]],
                                     dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.jit
def _e4m3_pairs(x):
    """uint16 (two e4m3 bytes) -> uint32 holding both as fp16 (low byte in the low half): the
    hardware conversion, exact (every e4m3 value is an fp16 value; NaN codes give NaN)."""
    return gl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x], dtype=gl.uint32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.jit
def _bad_pages(row_ptr, stride_btc, p0, last, num_blocks):
    """Whether each of the 128 table entries ``p0 ..`` before ``last`` lies outside ``[0, num_blocks)``
    (``triton_impl.block_table.first_bad_key``'s test, its loads apart from its reduction)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    p = p0 + gl.arange(0, 128, layout=layout)
    entry = gl.load(row_ptr + p * stride_btc, mask=p < last, other=0)
    return (p < last) & ((entry < 0) | (entry >= num_blocks))


@gluon.jit
def _page(row_ptr, stride_btc, token, end, num_blocks, BLOCK_SIZE: gl.constexpr):
    """The cache block holding ``token`` (``>= 0``), from the block table. The entry is read only for
    ``token < end`` (else block 0) and clamped into the cache, so no address outside the cache is ever
    formed; a request with a bad entry is poisoned (:func:`_bad_pages`)."""
    column = (token.to(gl.uint32) // BLOCK_SIZE).to(gl.int32)
    page = gl.load(row_ptr + column * stride_btc, mask=token < end, other=0)
    return gl.minimum(gl.maximum(page, 0), num_blocks - 1)


@gluon.jit
def _chunk_slot(page, chunk_start, kv_head, stride_block, num_kv_heads, slot_bytes, BLOCK_SIZE: gl.constexpr):
    """Byte offset of the slot of key ``chunk_start`` (a multiple of 16) for ``kv_head`` in block ``page``:
    the chunk's 16 keys lie in one block (16 divides ``BLOCK_SIZE``), key ``chunk_start + i`` ``i *
    num_kv_heads * slot_bytes`` further."""
    position = (chunk_start.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
    return page.to(gl.int64) * stride_block + (position * num_kv_heads + kv_head) * slot_bytes


@gluon.jit
def _key_words(cache_ptr, page, tile_start, go, kv_head, num_kv_heads, stride_block, slot_bytes,
               KEY_BITS: gl.constexpr, BLOCK_SIZE: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    """The tile's packed keys as 32-bit words ``[warp, half, quad, t, w]``: key ``16 warp + 8 half + quad``
    (a 16-key chunk per warp, in block ``page``), word ``w`` of the thread's key bytes from ``4 KEY_BITS t``:
    ``16t`` (4-bit, 4 words), ``12t`` (3-bit, 4 words, of which the fourth is the next thread's first: the last
    thread's reaches 4 bytes into the slot's values) or ``32t`` (FP8, 8 words). Read only where ``go``; a dead
    key reads its own block or block 0, never past the cache."""
    WORDS: gl.constexpr = 8 if KEY_BITS == 8 else 4
    warp = _iota(4, 0, 5, LAYOUT)
    half = _iota(2, 1, 5, LAYOUT)
    quad = _iota(8, 2, 5, LAYOUT)
    t = _iota(4, 3, 5, LAYOUT)
    w = _iota(WORDS, 4, 5, LAYOUT)
    slot = _chunk_slot(page, tile_start + warp * 16, kv_head, stride_block, num_kv_heads, slot_bytes, BLOCK_SIZE)
    slot += (half * 8 + quad) * (num_kv_heads * slot_bytes)
    words = (cache_ptr + slot + t * (4 * KEY_BITS)).to(gl.pointer_type(gl.uint32))  # byte offsets: no division
    return gl.load(words + w, mask=go, other=0)


@gluon.jit
def _register_pairs(groups, pair_lut, KEY_BITS: gl.constexpr, SYMMETRIC: gl.constexpr):
    """The lookup by ``prmt`` from the byte tables in registers: :func:`_symmetric_pairs` or :func:`_nibble_pairs`
    (4-bit codes), :func:`_triple_pairs` (3-bit)."""
    if KEY_BITS == 4:
        if SYMMETRIC:
            pairs = _symmetric_pairs(groups, pair_lut)
        else:
            pairs = _nibble_pairs(groups, pair_lut)
    else:
        pairs = _triple_pairs(groups, pair_lut)
    return pairs


@gluon.jit
def _mixed_pairs(groups, pair_lut, KEY_BITS: gl.constexpr, SYMMETRIC: gl.constexpr, SHARED: gl.constexpr):
    """:func:`_shared_pairs` where ``SHARED``, else :func:`_register_pairs`."""
    if SHARED:
        pairs = _shared_pairs(groups, _table_base(pair_lut), KEY_BITS)
    else:
        pairs = _register_pairs(groups, pair_lut, KEY_BITS, SYMMETRIC)
    return pairs


@gluon.jit
def _words_again(r0, r1, r2, r3, LAYOUT: gl.constexpr):
    """Words (or groups) 0-3's lookups, each ``[CHUNKS, 2, 8, 4]``, as one ``[CHUNKS, 2, 8, 4, 4]`` in ``LAYOUT``: the
    inverse of :func:`_key_operand`'s two splits."""
    joined = gl.join(gl.join(r0, r2), gl.join(r1, r3))  # [..., a, b]: word 2a + b
    return gl.convert_layout(gl.reshape(joined, [r0.shape[0], r0.shape[1], r0.shape[2], r0.shape[3], 4]), LAYOUT)


@gluon.jit
def _table_base(pair_lut):
    """The shared pair table's address, the last of :func:`_centroid_tables`' tuple (0 where the kernel has none)."""
    return pair_lut[len(pair_lut) - 1]


@gluon.jit
def _key_operand(words, pair_lut, KEY_BITS: gl.constexpr, BYTES_LAYOUT: gl.constexpr, SYMMETRIC: gl.constexpr = 0,
                 SHARED: gl.constexpr = 0):
    """Packed keys (:func:`_key_words`, ``CHUNKS`` 16-key chunks) -> ``[16 CHUNKS, HEAD_DIM]`` fp16, K index ``k``
    holding dimension ``_score_dim(k)``: each pair of codes (4-bit: a byte, its two centroids by ``prmt`` from the 8
    byte tables in ``pair_lut``; 3-bit: 6 bits of a 24-bit group, by ``prmt`` from the 4 byte tables; ``SHARED`` of
    each thread's 4 words or groups from the shared pair table instead, :func:`_shared_pairs`) or 16-bit half word
    (FP8: the hardware e4m3x2 conversion) becomes one A-operand register of the scores' MMA. ``words`` is in
    ``BYTES_LAYOUT`` sliced along its last dim."""
    CHUNKS: gl.constexpr = words.shape[0]
    if KEY_BITS == 8:
        halves = gl.join(words.to(gl.uint16), (words >> 16).to(gl.uint16))  # [..., w, 2]: u = 2w + half
        pairs = _e4m3_pairs(gl.reshape(halves, [CHUNKS, 2, 8, 4, 16]))
    else:
        if KEY_BITS == 4:
            groups = words  # pair u = 4w + j of word w in p_j
        else:
            # A thread's 32 codes are the 96 bits of its words 0-2: codes 8g .. 8g + 7 are the 24-bit group g at bits
            # 24g (parts of one or two words); pair u = 4g + j (codes 2u, 2u + 1) comes from group g's register j.
            w02, w13 = gl.split(gl.reshape(words, [CHUNKS, 2, 8, 4, 2, 2]))  # word 2a + b: split by b, then by a
            w0, w2 = gl.split(w02)
            w1, _ = gl.split(w13)
            g01 = gl.join(w0, (w0 >> 24) | (w1 << 8))  # (the bits above a group's 24 are ignored)
            g23 = gl.join((w1 >> 16) | (w2 << 16), w2 >> 8)
            groups = gl.reshape(gl.permute(gl.join(g01, g23), (0, 1, 2, 3, 5, 4)), [CHUNKS, 2, 8, 4, 4])
            groups = gl.convert_layout(groups, words.type.layout)
        if SHARED == 4:  # (the split path below gives the same lookups, at 6 more instructions a step for 4-bit keys)
            p0, p1, p2, p3 = _shared_pairs(groups, _table_base(pair_lut), KEY_BITS)
        elif SHARED:  # a thread's first SHARED words or groups from the shared table, the others by prmt
            even, odd = gl.split(gl.reshape(groups, [CHUNKS, 2, 8, 4, 2, 2]))  # word 2a + b: split by b, then by a
            w0, w2 = gl.split(even)
            w1, w3 = gl.split(odd)
            r0 = _mixed_pairs(w0, pair_lut, KEY_BITS, SYMMETRIC, SHARED > 0)
            r1 = _mixed_pairs(w1, pair_lut, KEY_BITS, SYMMETRIC, SHARED > 1)
            r2 = _mixed_pairs(w2, pair_lut, KEY_BITS, SYMMETRIC, SHARED > 2)
            r3 = _mixed_pairs(w3, pair_lut, KEY_BITS, SYMMETRIC, SHARED > 3)
            layout: gl.constexpr = groups.type.layout
            p0 = _words_again(r0[0], r1[0], r2[0], r3[0], layout)
            p1 = _words_again(r0[1], r1[1], r2[1], r3[1], layout)
            p2 = _words_again(r0[2], r1[2], r2[2], r3[2], layout)
            p3 = _words_again(r0[3], r1[3], r2[3], r3[3], layout)
        else:
            p0, p1, p2, p3 = _register_pairs(groups, pair_lut, KEY_BITS, SYMMETRIC)
        pairs = gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [CHUNKS, 2, 8, 4, 16])
    lo, hi = _f16_halves(pairs)
    k = gl.join(lo, hi)  # [warp, half, quad, t, u, e]: dimension 32t + 2u + e
    k = gl.reshape(k, [CHUNKS, 2, 8, 4, 8, 2, 2])  # u = 2c + j
    k = gl.permute(k, (0, 1, 2, 4, 5, 3, 6))  # [key: warp, half, quad | K: c, j, t, e]
    return gl.reshape(k, [CHUNKS * 16, HEAD_DIM])


@gluon.jit
def _value_words(cache_ptr, page, tile_start, go, kv_head, num_kv_heads, stride_block, slot_bytes,
                 KEY_DATA_BYTES: gl.constexpr, VALUE_BITS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                 LAYOUT: gl.constexpr, CHUNKS: gl.constexpr = 4, SPANS: gl.constexpr = 0):  # fmt: skip
    """The tile's value codes as ``[warp, quad, t, c, j, e]``: the ``4 VALUE_BITS`` bits (4 codes, dimensions
    ``32 warp + 4 quad ..``) from value bit ``4 VALUE_BITS (8 warp + quad)`` of key ``16c + 8j + 2t + e`` (chunk
    ``c`` in block ``page``). 4-bit values: the aligned 16-bit word at value byte ``16 warp + 2 quad``, a uint16.
    3-bit values: 12 bits at bit ``12 quad`` of the warp's 12 bytes, which no aligned 16-bit load holds for ``quad`` =
    1, 2, 5, 6: the 32-bit word holding the first bit, a uint32, which :func:`_held_fields` turns into the field (its
    shuffle waits for the load). ``SPANS`` (3-bit values in one warp): ``[word, quad, t, c, j, e]``, lane quad
    ``quad``'s span of 6 bytes (dimensions ``16 quad ..``, :func:`_span_operand`) as the two aligned 32-bit words that
    hold it, from value byte ``6 quad - 2 (quad & 1)``. Read only where ``go``, as :func:`_key_words`, or (``go``
    None) everywhere, where every ``page`` is in the cache."""
    warp = _iota(2 if SPANS else 4, 0, 6, LAYOUT)
    quad = _iota(8, 1, 6, LAYOUT)
    t = _iota(4, 2, 6, LAYOUT)
    c = _iota(CHUNKS, 3, 6, LAYOUT)
    j = _iota(2, 4, 6, LAYOUT)
    e = _iota(2, 5, 6, LAYOUT)
    slot = _chunk_slot(page, tile_start + c * 16, kv_head, stride_block, num_kv_heads, slot_bytes, BLOCK_SIZE)
    slot += (j * 8 + t * 2 + e) * (num_kv_heads * slot_bytes)
    bit = quad * 12
    if VALUE_BITS == 4:
        word = (cache_ptr + slot + KEY_DATA_BYTES + warp * 16 + quad * 2).to(gl.pointer_type(gl.uint16))
    elif SPANS:  # warp: the word of the two
        word = (cache_ptr + slot + KEY_DATA_BYTES + quad * 6 - (quad & 1) * 2 + warp * 4).to(gl.pointer_type(gl.uint32))
    else:
        word = (cache_ptr + slot + KEY_DATA_BYTES + warp * 12 + (bit >> 5) * 4).to(gl.pointer_type(gl.uint32))
    if go is None:
        words = gl.load(word)
    else:
        words = gl.load(word, mask=go, other=0)
    return words


@gluon.jit
def _three_bit_fields(low):
    """3-bit values' words (:func:`_value_words`) -> each thread's 12-bit fields, in the low bits of a uint32 (the bits
    above them are the next codes': :func:`_value_operand` masks them off). Lane quad ``quad`` wants the 12 bits at
    bit ``12 quad`` of its 96, which cross into the next word for ``quad`` = 2 and 5 only (bits 24-35 and 60-71); that
    word is lane quad ``quad + 1``'s first of the same keys: a warp shuffle, not a second load (a load per key and 716
    -> 624 instructions a tile; the H200 at L=8K: 0.2576 -> 0.2127 ms), then one funnel shift (``shf.r.wrap``)."""
    layout: gl.constexpr = low.type.layout
    quad = _iota(8, 1, 6, layout)
    high = gl.inline_asm_elementwise("shfl.sync.down.b32 $0, $1, 4, 0x1f, 0xffffffff;", "=r,r", [low],
                                     dtype=gl.uint32, is_pure=False, pack=1)  # fmt: skip
    return gl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     [low, high, (quad * 12).to(gl.uint32)], dtype=gl.uint32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.jit
def _held_fields(low):
    """:func:`_three_bit_fields` as masked 12-bit uint16, for a kernel that makes the fields as soon as the words are
    loaded and holds them until the value product: unmasked, or as uint32, the one-warp grid kernel's loop spills
    (Triton 3.6)."""
    return _three_bit_fields(low).to(gl.uint16) & 0xFFF


@gluon.jit
def _value_operand(w, VALUE_BITS: gl.constexpr, FIELDS: gl.constexpr = 0):
    """Value words (:func:`_value_words`) -> codes ``[HEAD_DIM, keys]`` fp16 (exact), the A operand of
    ``O^T += V^T P^T``, output row ``d`` holding dimension ``_value_dim(d)``: the words of keys ``e = 0, 1``
    are paired (low and high halves), and each of their 4 codes becomes one register holding both keys'
    code at one dimension, as the fp16 subnormal ``c 2^-24`` (:func:`_code_halves`). Codes 1 and 3 are not shifted
    down, only masked in place: they come out as ``2^VALUE_BITS c 2^-24``, one shift a word instead of three, and
    :func:`_store_partials` multiplies the output rows by ``2^24``, those of codes 1 and 3 by ``2^(24 - VALUE_BITS)``
    (:func:`_value_row_scale`: exact).
    3-bit values: ``w`` (``FIELDS``) :func:`_held_fields`, or a one-warp kernel's spans (:func:`_span_operand`)."""
    if (VALUE_BITS == 3) and not FIELDS:
        v = _span_operand(w)
    else:
        w0, w1 = gl.split(w)  # keys e = 0, 1
        v = _field_codes(w0.to(gl.uint32) | (w1.to(gl.uint32) << 16), VALUE_BITS, 0)  # [warp, quad, t, c, j, e, h, m]
        v = gl.permute(v, (7, 0, 6, 1, 3, 4, 2, 5))  # [row: m, warp, h, quad | key: c, j, t, e]
        v = gl.reshape(v, [HEAD_DIM, 16 * w.shape[3]])
    return v


@gluon.jit
def _field_codes(pair, VALUE_BITS: gl.constexpr, OFFSET: gl.constexpr):
    """Two keys' fields of 4 codes at bit ``OFFSET`` of each 16-bit half of ``pair`` (the bits outside them ignored)
    -> ``[..., e, h, m]`` fp16, code ``r = h + 2m`` of key ``e``, exact, each ``2^-24`` times its masked bits
    (:func:`_code_halves`): codes 0 and 1 masked in place (``2^OFFSET`` and ``2^(OFFSET + VALUE_BITS)`` times the
    code, at most ``2^10 - 2^7``: below bit 10, as a subnormal needs), codes 2 and 3 after one shift down (1 and
    ``2^VALUE_BITS`` times the code); :func:`_value_row_scale` and :func:`_span_row_scale` undo the factors."""
    low: gl.constexpr = ((1 << VALUE_BITS) - 1) * 0x10001
    high: gl.constexpr = low << VALUE_BITS
    rest = pair >> (2 * VALUE_BITS + OFFSET)
    c0lo, c0hi = _code_halves(pair, low << OFFSET)
    c1lo, c1hi = _code_halves(pair, high << OFFSET)
    c2lo, c2hi = _code_halves(rest, low)
    c3lo, c3hi = _code_halves(rest, high)
    r0 = gl.join(gl.join(c0lo, c0hi), gl.join(c1lo, c1hi))  # [..., e, h]
    r1 = gl.join(gl.join(c2lo, c2hi), gl.join(c3lo, c3hi))
    return gl.join(r0, r1)


@gluon.jit
def _span_selectors(odd):
    """The ``prmt`` selectors of :func:`_span_operand` that depend on the lane quad's parity ``odd`` (its span starts
    at byte 0 of its first word, or at byte 2): ``(one key's span bytes 1-4 from its two words, two keys' span bytes
    0-1 from their first words or 4-5 from their second)``."""
    return 0x4321 + odd * 0x2222, 0x5410 + odd * 0x2222


@gluon.constexpr_function
def prmt_asm(selector):
    """Inline PTX of ``prmt`` with the selector ``selector`` (an immediate), or (None) a register: ``$3``."""
    return f"prmt.b32 $0, $1, $2, {'$3' if selector is None else hex(int(selector))};"


@gluon.jit
def _prmt(a, b, selector):
    """``prmt.b32`` of ``a, b`` by a uint32 tensor of selectors."""
    return gl.inline_asm_elementwise(prmt_asm(None), "=r,r,r,r", [a, b, selector], dtype=gl.uint32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.jit
def _halves(a, b, SELECTOR: gl.constexpr):
    """``prmt.b32`` of ``a, b`` by the immediate ``SELECTOR``."""
    return gl.inline_asm_elementwise(prmt_asm(SELECTOR), "=r,r,r", [a, b], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _span_operand(w):
    """3-bit value spans (:func:`_value_words` with ``SPANS``: ``[word, quad, t, c, j, e]``) -> codes ``[HEAD_DIM,
    keys]`` fp16, row ``d`` holding dimension :func:`_span_dim` times :func:`_span_row_scale`'s inverse. Lane quad
    ``quad``'s 16 codes of a key are the 48 bits at value byte ``6 quad``: 4 fields of 12 bits, each inside 16 bits
    at a byte boundary (bytes 0-1, 1-2, 3-4, 4-5: the field at bit 0, 4, 0, 4). One ``prmt`` takes those 16 bits of
    keys ``e = 0, 1`` into one register, the middle two fields' from the span's bytes 1-4 (one ``prmt`` a key): 6
    instructions for 8 fields, then :func:`_field_codes`. No shuffle and no funnel shift: a field never leaves the
    lane's two words."""
    first, second = gl.split(gl.permute(w, (1, 2, 3, 4, 5, 0)))  # [quad, t, c, j, e]
    layout: gl.constexpr = first.type.layout
    middle_selector, pair_selector = _span_selectors((_iota(8, 0, 5, layout) & 1).to(gl.uint32))
    pair_selector, _ = gl.split(gl.zeros_like(first) + pair_selector)  # in the layout of one key's words, as a0's
    middle = _prmt(first, second, middle_selector)  # the span's bytes 1-4
    a0, a1 = gl.split(first)  # keys e = 0, 1
    b0, b1 = gl.split(middle)
    c0, c1 = gl.split(second)
    f0 = _field_codes(_prmt(a0, a1, pair_selector), 3, 0)  # span bits 0-11 ([quad, t, c, j, e, h, m])
    f1 = _field_codes(_halves(b0, b1, 0x5410), 3, 4)  # bits 12-23
    f2 = _field_codes(_halves(b0, b1, 0x7632), 3, 0)  # bits 24-35
    f3 = _field_codes(_prmt(c0, c1, pair_selector), 3, 4)  # bits 36-47
    v = gl.join(gl.join(f0, f1), gl.join(f2, f3))  # [.., fa, fb]: field fa + 2 fb
    v = gl.permute(v, (6, 8, 7, 5, 0, 2, 3, 1, 4))  # [row: m, fb, fa, h, quad | key: c, j, t, e]
    return gl.reshape(v, [HEAD_DIM, 16 * w.shape[3]])


@gluon.jit
def _span_dim(d):
    """The head dimension :func:`_span_operand`'s output row ``d`` holds: rows ``64m + 16f + 8h + g`` (M tile ``4m +
    f``, half ``h``, lane quad ``g``) are code ``h + 2m`` of field ``f`` of the quad's span, dimension ``16g + 4f + 2m +
    h``."""
    return (d & 7) * 16 + ((d >> 4) & 3) * 4 + (d >> 6) * 2 + ((d >> 3) & 1)


@gluon.jit
def _span_row_scale(d):
    """What :func:`_span_operand`'s output row ``d`` is multiplied by: :data:`CODE_SCALE` (``2^24``, the codes' unit
    undone: :func:`_code_halves`), ``1/8`` of it on codes 1 and 3 of a field (``h`` = 1), and ``1/16`` more on codes 0
    and 1 (``m`` = 0) of the fields held at bit 4 (``f`` odd)."""
    shifted = ((d >> 4) & 1) & (1 - (d >> 6))  # code 0 or 1 of a field held at bit 4
    return CODE_SCALE / ((1 + 7 * ((d >> 3) & 1)) * (1 + 15 * shifted))


@gluon.jit
def _value_row_scale(d, VALUE_BITS: gl.constexpr):
    """What output row ``d`` of ``O^T`` is multiplied by to undo :func:`_value_operand`'s factors: :data:`CODE_SCALE`
    (``2^24``, the codes' unit undone: :func:`_code_halves`), and ``2^(24 - bits)`` on the rows of the unshifted codes
    1 and 3 of a word (``r = 2m + h`` of :func:`_value_dim`: ``h`` = 1)."""
    return gl.where(((d >> 3) & 1) == 1, CODE_SCALE / (1 << VALUE_BITS), CODE_SCALE)


@gluon.jit
def _metadata(cache_ptr, page, token, live, kv_head, stride_block, meta_offset, NUM_FIELDS: gl.constexpr,
              BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """Each token's fp16 metadata fields as fp32 ``(key norm or 1, value scale, value zero)``; 0 where not
    ``live`` (a dead key's probability is 0, and its fields must not turn that into NaN). A block holds
    them after its data, field-major per KV head: ``[HKV, NUM_FIELDS, BLOCK_SIZE]``."""
    position = (token.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
    at = (cache_ptr + page.to(gl.int64) * stride_block + meta_offset).to(gl.pointer_type(gl.uint16))
    at += kv_head * (NUM_FIELDS * BLOCK_SIZE) + position
    scale = gl.load(at + (NUM_FIELDS - 2) * BLOCK_SIZE, mask=live, other=0).to(gl.float16, bitcast=True)
    zero = gl.load(at + (NUM_FIELDS - 1) * BLOCK_SIZE, mask=live, other=0).to(gl.float16, bitcast=True)
    if NUM_FIELDS == 3:
        norm = gl.load(at, mask=live, other=0).to(gl.float16, bitcast=True).to(gl.float32)
    else:
        norm = gl.full(token.shape, 1.0, gl.float32, token.type.layout)
    return norm, scale.to(gl.float32), zero.to(gl.float32)


@gluon.jit
def _tile_pages(row_ptr, stride_btc, tile_start, end, num_blocks, key_rows, BLOCK_SIZE: gl.constexpr,
                KEY_LAYOUT: gl.constexpr, VALUE_LAYOUT: gl.constexpr):  # fmt: skip
    """The cache blocks of tile ``[tile_start, tile_start + BLOCK_N)``'s 16-key chunks, one tensor per
    layout that reads them: the keys' (chunk per warp), the values' (4 chunks per thread) and the metadata's
    (each thread's key rows). Block 0 past ``end``."""
    k_page = _page(row_ptr, stride_btc, tile_start + _iota(4, 0, 5, KEY_LAYOUT) * 16, end, num_blocks, BLOCK_SIZE)
    v_page = _page(row_ptr, stride_btc, tile_start + _iota(4, 3, 6, VALUE_LAYOUT) * 16, end, num_blocks,
                   BLOCK_SIZE)  # fmt: skip
    m_page = _page(row_ptr, stride_btc, tile_start + key_rows, end, num_blocks, BLOCK_SIZE)
    return k_page, v_page, m_page


@gluon.jit
def _tile_loads(cache_ptr, pages, tile_start, start, end, kv_head, num_kv_heads, stride_block, slot_bytes,
                meta_offset, key_rows, KEY_BITS: gl.constexpr, KEY_DATA_BYTES: gl.constexpr,
                VALUE_BITS: gl.constexpr, NUM_FIELDS: gl.constexpr, BLOCK_SIZE: gl.constexpr, KEY_LAYOUT: gl.constexpr,
                VALUE_LAYOUT: gl.constexpr):  # fmt: skip
    """Everything tile ``[tile_start, tile_start + BLOCK_N)`` reads from its blocks ``pages``
    (:func:`_tile_pages`): ``(key words, value words (3-bit: :func:`_held_fields`), norm, value scale, value zero)``,
    and which of its keys (``key_rows``) lie in ``[start, end)``. A tile at or past ``end`` reads nothing."""
    k_page, v_page, m_page = pages
    go = tile_start < end
    k_words = _key_words(cache_ptr, k_page, tile_start, go, kv_head, num_kv_heads, stride_block, slot_bytes, KEY_BITS,
                         BLOCK_SIZE, KEY_LAYOUT)  # fmt: skip
    v_words = _value_words(cache_ptr, v_page, tile_start, go, kv_head, num_kv_heads, stride_block, slot_bytes,
                           KEY_DATA_BYTES, VALUE_BITS, BLOCK_SIZE, VALUE_LAYOUT)  # fmt: skip
    if VALUE_BITS == 3:
        v_words = _held_fields(v_words)
    token = tile_start + key_rows
    live = (token >= start) & (token < end)
    norm, v_scale, v_zero = _metadata(cache_ptr, m_page, token, live, kv_head, stride_block, meta_offset, NUM_FIELDS,
                                      BLOCK_SIZE)  # fmt: skip
    return k_words, v_words, norm, v_scale, v_zero, live


@gluon.jit
def _scores(k, q_hi, q_lo, zero, FP16_OPERANDS: gl.constexpr):
    """``K q^T`` on the MMA (``zero``'s layout): the key operand ``k`` against the query, rounded once to fp16
    (``FP16_OPERANDS``) or as hi + lo parts (two independent MMA chains)."""
    k = gl.convert_layout(k, gl.DotOperandLayout(operand_index=0, parent=zero.type.layout, k_width=2))
    if FP16_OPERANDS:
        return mma_v2(k, q_hi, zero)
    return mma_v2(k, q_hi, zero) + mma_v2(k, q_lo, zero)


@gluon.jit
def _tile_step(k_words, v_words, norm, v_scale, v_zero, live, pair_lut, q_hi, q_lo, score_scale, m_i, l_part, z_part,
               acc, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, KEY_BYTES: gl.constexpr,
               FP16_OPERANDS: gl.constexpr = 0, RESCALE_IF_GREW: gl.constexpr = 0,
               SYMMETRIC: gl.constexpr = 0, VALUE_FIELDS: gl.constexpr = 0, SHARED: gl.constexpr = 0):  # fmt: skip
    """One tile of the online softmax: scores ``K q^T``, the running max, ``(l, z)`` partial sums and ``O^T += V^T
    P^T`` (the module docstring says how each operand is built). Returns ``(m_i, l_part, z_part, acc)``.
    ``RESCALE_IF_GREW``: the sums and ``O^T`` are rescaled only when some head's running max grew (else every factor
    is exactly 1: the same result), a branch on a reduction within the warp (per-warp streams: their ``O^T`` is 32
    registers a thread, 4 times a 4-warp tile's). ``VALUE_FIELDS``: 3-bit ``v_words`` are fields already
    (:func:`_value_operand`)."""
    mma: gl.constexpr = acc.type.layout
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    BLOCK_H: gl.constexpr = q_hi.shape[1]
    KEYS: gl.constexpr = norm.shape[0]
    zero = gl.zeros([KEYS, BLOCK_H], gl.float32, mma)
    s = _scores(_key_operand(k_words, pair_lut, KEY_BITS, KEY_BYTES, SYMMETRIC, SHARED), q_hi, q_lo, zero,
                FP16_OPERANDS)
    if KEY_BITS != 8:
        s = s * norm[:, None]
    s = gl.where(live[:, None], s * score_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))  # finite: a tile has a live key
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    if RESCALE_IF_GREW:
        if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
            l_part = l_part * alpha[None, :]
            z_part = z_part * alpha[None, :]
            acc = acc * gl.convert_layout(alpha[None, :], mma)
        l_part = l_part + p
        z_part = z_part + p * v_zero[:, None]
    else:
        l_part = l_part * alpha[None, :] + p
        z_part = z_part * alpha[None, :] + p * v_zero[:, None]
    w = p * v_scale[:, None]
    w_hi = w.to(gl.float16)
    if FP16_OPERANDS:
        v = gl.convert_layout(_value_operand(v_words, VALUE_BITS, VALUE_FIELDS), dot_a)
        if not RESCALE_IF_GREW:
            acc = acc * gl.convert_layout(alpha[None, :], mma)
        acc = mma_v2(v, gl.convert_layout(w_hi, dot_b), acc)
    else:
        w_lo = (w - w_hi.to(gl.float32)).to(gl.float16)
        # One B operand [BLOCK_N, 2 BLOCK_H] = [hi | lo]: one trip through shared memory, not two.
        w2 = gl.reshape(gl.permute(gl.join(w_hi, w_lo), (0, 2, 1)), [KEYS, 2 * BLOCK_H])
        alpha2 = gl.reshape(gl.permute(gl.join(alpha[None, :], alpha[None, :]), (0, 2, 1)), [1, 2 * BLOCK_H])
        v = gl.convert_layout(_value_operand(v_words, VALUE_BITS, VALUE_FIELDS), dot_a)
        acc = mma_v2(v, gl.convert_layout(w2, dot_b), acc * gl.convert_layout(alpha2, mma))
    return m_new, l_part, z_part, acc


# Staged tiles (STAGES > 0): each tile's key bytes, value bytes and metadata are copied into a ring of shared memory
# stages by cp.async, STAGES - 1 tiles ahead of the tile being computed, then read back in the layouts the direct
# loads above give (keys [64 keys][16 or 32 words]; values [warp q][64 keys][16 bytes]: warp q's codes of each key;
# metadata [field][64 keys]). A thread reads what other threads copied: a barrier after each wait.


@gluon.constexpr_function
def _plain(rank):
    """A row-major shared layout of ``rank`` dims, no swizzle."""
    return gl.SwizzledSharedLayout(1, 1, 1, list(reversed(range(rank))))


@gluon.constexpr_function
def _copy_layout(what, key_bits, meta_fields):
    """The layout a stage's copies are issued in (4 warps): ``what`` = "keys" ``[4 chunks, 16 keys, key words]``,
    "values" ``[4 chunks, 4 warps q, 16 keys, 4 words]`` (warps along the 16-key chunks: one block-table entry a
    thread, and the rest of each address a constant offset) or "meta" ``[meta_fields, 4 chunks, 2 halves, 4 words]``
    (replicated across lanes and warps: fewer copies than threads). 16 bytes a thread and copy, except for the
    12-byte spans of 3-bit keys (4 bytes)."""
    if what == "keys":
        vector = 1 if key_bits == 3 else 4
        lanes = (32 if key_bits == 8 else 16) // vector  # along a key's words
        return gl.BlockedLayout([1, 1, vector], [1, 32 // lanes, lanes], [NUM_WARPS, 1, 1], [2, 1, 0])
    if what == "values":
        return gl.BlockedLayout([1, 1, 1, 4], [1, 2, 16, 1], [NUM_WARPS, 1, 1, 1], [3, 2, 1, 0])
    return gl.BlockedLayout([1, 1, 1, 4], [meta_fields, 4, 2, 32 // (8 * meta_fields)], [1, 1, 1, NUM_WARPS],
                            [3, 2, 1, 0])  # fmt: skip


@gluon.jit
def _copy_pages(row_ptr, stride_btc, tile_start, end, num_blocks, BLOCK_SIZE: gl.constexpr, KEY_COPY: gl.constexpr,
                VALUE_COPY: gl.constexpr, META_COPY: gl.constexpr):  # fmt: skip
    """The cache blocks of tile ``tile_start``'s 16-key chunks, in each copy layout (as :func:`_tile_pages`)."""
    k_page = _page(row_ptr, stride_btc, tile_start + _iota(4, 0, 3, KEY_COPY) * 16, end, num_blocks, BLOCK_SIZE)
    v_page = _page(row_ptr, stride_btc, tile_start + _iota(4, 0, 4, VALUE_COPY) * 16, end, num_blocks, BLOCK_SIZE)
    m_page = _page(row_ptr, stride_btc, tile_start + _iota(4, 1, 4, META_COPY) * 16, end, num_blocks, BLOCK_SIZE)
    return k_page, v_page, m_page


@gluon.jit
def _issue_copies(cache_ptr, key_stage, value_stage, meta_stage, pages, tile_start, end, kv_head, num_kv_heads,
                  stride_block, slot_bytes, meta_offset, KEY_DATA_BYTES: gl.constexpr, NUM_FIELDS: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, KEY_COPY: gl.constexpr, VALUE_COPY: gl.constexpr,
                  META_COPY: gl.constexpr):  # fmt: skip
    """cp.async of tile ``tile_start``'s keys, values and metadata into one stage (zeros for a tile at or past
    ``end``); the caller commits the group. Key word ``4t + w`` of a 3-bit key is word ``w`` of thread ``t``'s 12
    bytes (``w < 3``; word 3 is not copied, and :func:`_key_operand` ignores it), as the 4-bit layout, so both are
    read alike."""
    k_page, v_page, m_page = pages
    go = tile_start < end
    key_words: gl.constexpr = key_stage.shape[1]
    chunk = _iota(4, 0, 3, KEY_COPY) * 16
    key = _iota(16, 1, 3, KEY_COPY)
    word = _iota(key_words, 2, 3, KEY_COPY)
    slot = _chunk_slot(k_page, tile_start + chunk, kv_head, stride_block, num_kv_heads, slot_bytes, BLOCK_SIZE)
    words = (cache_ptr + slot + key * (num_kv_heads * slot_bytes)).to(gl.pointer_type(gl.uint32))
    stage = key_stage.reshape([4, 16, key_words])
    if KEY_DATA_BYTES == 48:  # 3-bit keys
        _async_load(stage, words + (word >> 2) * 3 + (word & 3), mask=go & ((word & 3) < 3))
    else:
        _async_load(stage, words + word, mask=go & (word >= 0))  # (word >= 0: the mask as a tensor)
    chunk = _iota(4, 0, 4, VALUE_COPY) * 16
    warp = _iota(4, 1, 4, VALUE_COPY)
    key = _iota(16, 2, 4, VALUE_COPY)
    word = _iota(4, 3, 4, VALUE_COPY)
    slot = _chunk_slot(v_page, tile_start + chunk, kv_head, stride_block, num_kv_heads, slot_bytes, BLOCK_SIZE)
    slot += key * (num_kv_heads * slot_bytes) + KEY_DATA_BYTES + warp * 16
    words = (cache_ptr + slot).to(gl.pointer_type(gl.uint32))
    stage = value_stage.reshape([4, 4, 16, 4]).permute((1, 0, 2, 3))  # [chunk, warp q, key, word]
    _async_load(stage, words + word, mask=go & (word >= 0))
    field = _iota(meta_stage.shape[0], 0, 4, META_COPY)
    position = ((tile_start + _iota(4, 1, 4, META_COPY) * 16).to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
    at = m_page.to(gl.int64) * stride_block + meta_offset
    at += ((kv_head * NUM_FIELDS + field) * BLOCK_SIZE + position + _iota(2, 2, 4, META_COPY) * 8) * 2
    src = (cache_ptr + at).to(gl.pointer_type(gl.uint32)) + _iota(4, 3, 4, META_COPY)
    _async_load(meta_stage, src, mask=go & (field < NUM_FIELDS))


@gluon.jit
def _stage_reads(key_stage, value_stage, meta_stage, tile_start, start, end, key_rows, KEY_BITS: gl.constexpr,
                 NUM_FIELDS: gl.constexpr, KEY_LAYOUT: gl.constexpr, VALUE_LAYOUT: gl.constexpr):  # fmt: skip
    """A stage's tile in the layouts :func:`_tile_loads` returns (the metadata 0 where a key is not ``live``)."""
    WORDS: gl.constexpr = 8 if KEY_BITS == 8 else 4
    k_words = key_stage.reshape([4, 2, 8, 4, WORDS]).load(KEY_LAYOUT)
    if _PUBLIC_REINTERPRET:
        codes = value_stage.reinterpret(gl.uint16, [4, 64, 8], _plain(3))  # [warp q, key, lane quad]
        meta = meta_stage.reinterpret(gl.uint16, [meta_stage.shape[0], 64], _plain(1))  # indexed by field
    else:
        codes = value_stage._reinterpret(gl.uint16, [4, 64, 8], _plain(3))
        meta = meta_stage._reinterpret(gl.uint16, [meta_stage.shape[0], 64], _plain(1))
    codes = codes.reshape([4, 4, 2, 4, 2, 8]).permute((0, 5, 3, 1, 2, 4))  # key 16c + 8j + 2t + e
    v_words = codes.load(VALUE_LAYOUT)
    token = tile_start + key_rows
    live = (token >= start) & (token < end)
    scale = meta.index(NUM_FIELDS - 2).load(key_rows.type.layout).to(gl.float16, bitcast=True).to(gl.float32)
    zero = meta.index(NUM_FIELDS - 1).load(key_rows.type.layout).to(gl.float16, bitcast=True).to(gl.float32)
    if NUM_FIELDS == 3:
        norm = meta.index(0).load(key_rows.type.layout).to(gl.float16, bitcast=True).to(gl.float32)
        norm = gl.where(live, norm, 0.0)
    else:
        norm = gl.full(token.shape, 1.0, gl.float32, token.type.layout)
    return k_words, v_words, norm, gl.where(live, scale, 0.0), gl.where(live, zero, 0.0), live


@gluon.jit
def _split(seq_lens_ptr, block_table_ptr, num_splits, num_blocks, table_keys, stride_bt, stride_btc,
           BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """This program's keys ``[start, end)`` (its split of its request), the request's block-table row, whether
    the request needs more keys than its table holds, and the bad-entry check of the first 128 blocks of the
    split with the range of its blocks: ``(start, end, row_ptr, too_long, bad_pages, first_page, last_page)``."""
    b = gl.program_id(0)
    split = gl.program_id(2)
    seq_len = gl.maximum(gl.load(seq_lens_ptr + b).to(gl.int32), 0)
    split_len = (seq_len + num_splits - 1) // num_splits
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    return _key_range(block_table_ptr, b, start, end, seq_len, num_blocks, table_keys, stride_bt, stride_btc,
                      BLOCK_SIZE)  # fmt: skip


@gluon.jit
def _key_range(block_table_ptr, b, start, end, seq_len, num_blocks, table_keys, stride_bt, stride_btc,
               BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """:func:`_split`'s tuple for keys ``[start, end)`` of request ``b`` (``seq_len`` keys): ``end`` cut at the table's
    keys, and the request's table row, whether it is too long, and the check of its blocks."""
    too_long = seq_len > table_keys
    end = gl.minimum(end, table_keys)
    row_ptr = block_table_ptr + b.to(gl.int64) * stride_bt
    # Memory safety without host checks: a request whose keys need a table column past the table or a
    # block outside the cache is poisoned (out = lse = NaN), and no such address is read. The blocks of
    # [start, end) are checked here (the first 128 entries' loads overlap the loop; their reduction waits
    # for after it, :func:`_store_partials`); the loop clamps each entry it reads.
    first_page = start // BLOCK_SIZE
    last_page = gl.maximum((end + BLOCK_SIZE - 1) // BLOCK_SIZE, first_page)
    bad_pages = _bad_pages(row_ptr, stride_btc, first_page, last_page, num_blocks)
    return start, end, row_ptr, too_long, bad_pages, first_page, last_page


@gluon.jit
def _query_operand(q_ptr, partials_ptr, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, b, kv_head, slot,
                   KV_GROUP: gl.constexpr, KEY_FP8: gl.constexpr, BLOCK_H: gl.constexpr,
                   DOT_B: gl.constexpr, pit_ptr=None, HADAMARD_QUERY: gl.constexpr = 0):  # fmt: skip
    """The query as the B operand ``[HEAD_DIM, BLOCK_H]`` of the scores, K index ``k`` holding dimension
    ``_score_dim(k)``, as fp16 ``(hi, lo)`` parts (``lo`` unused with ``FP16_OPERANDS``). MSE keys read the
    rotated query from partials slot ``slot`` (the program's own split, or the one slot past the splits), or with
    ``HADAMARD_QUERY`` rotate it here (:func:`_hadamard_query`); FP8 keys take the query itself, of request ``b``'s
    heads of KV head ``kv_head``."""
    if HADAMARD_QUERY:
        q_hi = _hadamard_query(q_ptr, pit_ptr, stride_qb, stride_qh, b, kv_head, KV_GROUP, BLOCK_H, DOT_B)
        return q_hi, gl.zeros_like(q_hi)
    qk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, DOT_B))
    qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, DOT_B))
    q_heads = kv_head * KV_GROUP + qh
    if KEY_FP8:
        q_at = q_ptr + b.to(gl.int64) * stride_qb + q_heads * stride_qh
    else:  # the rotated query, in this program's partials slot
        q_at = partials_ptr + b.to(gl.int64) * stride_pb + q_heads * stride_ph + slot * stride_ps
    q = gl.load(q_at[None, :] + _score_dim(qk)[:, None], mask=(qh < KV_GROUP)[None, :], other=0.0).to(gl.float32)
    q_hi = q.to(gl.float16)
    return q_hi, (q - q_hi.to(gl.float32)).to(gl.float16)


@gluon.jit
def _hadamard_query(q_ptr, pit_ptr, stride_qb, stride_qh, b, kv_head, KV_GROUP: gl.constexpr, BLOCK_H: gl.constexpr,
                    DOT_B: gl.constexpr):  # fmt: skip
    """``fp16(q @ PiT)`` for ``PiT = c H_128`` (``c = PiT[0, 0]``, :func:`is_hadamard_rotation`) as
    :func:`_query_operand`'s operand, from the query itself: no rotation launch. A one-warp program holds its heads as
    the rows of :func:`_hadamard_rows` (8 heads, a lane quad each), each thread 32 of them loaded in K order (K index
    ``32 t + i`` holds dimension ``_score_dim(32 t + i)``): ``H`` is ``(-1)^popcount(j & n)``, unchanged when the
    bits of ``j`` and ``n`` are permuted alike, so the transform over K indices is the rotation over dimensions. fp32
    butterflies over K-index bits 0, 1, .., 6, then one product by ``c``: ``parity.turboquant.hadamard_query`` is
    this arithmetic on the CPU."""
    gl.static_assert((gl.num_warps() == 1) and (BLOCK_H == STORE_QUAD_ROWS))
    layout: gl.constexpr = _quad_layout(1)
    head = _iota(BLOCK_H, 0, 3, layout)
    t = _iota(4, 1, 3, layout)
    k = t * 32 + _iota(32, 2, 3, layout)
    at = q_ptr + b.to(gl.int64) * stride_qb + (kv_head * KV_GROUP + head) * stride_qh + _score_dim(k)
    x = gl.load(at, mask=head < KV_GROUP, other=0.0).to(gl.float32)
    y = (_hadamard_rows(x, t) * gl.load(pit_ptr)).to(gl.float16)
    return gl.convert_layout(gl.permute(gl.reshape(y, [BLOCK_H, HEAD_DIM]), (1, 0)), DOT_B)


@gluon.jit
def _centroid_tables(centroid_ptr, KEY_BITS: gl.constexpr, SHARED_TABLE: gl.constexpr = 0):
    """What :func:`_key_operand` looks centroids up in: the fp16 centroids' bytes in registers, for 4-bit keys 8
    tables (:func:`_nibble_pairs`), for 3-bit keys 4 (:func:`_triple_pairs`), then (``SHARED_TABLE``) the shared pair
    table's address (:func:`_shared_pair_table`; else 0); nothing (0) for FP8 keys."""
    pair_lut = 0
    base = 0
    if SHARED_TABLE and KEY_BITS != 8:
        base = _shared_pair_table(centroid_ptr, KEY_BITS)
    if KEY_BITS == 4:
        # Whether the fp16 codebook is symmetric bit for bit (c[15 - k] = -c[k]), as this package's codebooks are:
        # then the shorter lookup serves (:data:`SYMMETRIC_PAIRS_ASM`).
        symmetric = True
        for k in gl.static_range(8):
            low = gl.load(centroid_ptr + k).to(gl.float16).to(gl.uint16, bitcast=True)
            high = gl.load(centroid_ptr + 15 - k).to(gl.float16).to(gl.uint16, bitcast=True)
            symmetric = symmetric & (low == (high ^ 0x8000))
        pair_lut = (_byte_table(centroid_ptr, 0, 0), _byte_table(centroid_ptr, 4, 0), _byte_table(centroid_ptr, 8, 0),
                    _byte_table(centroid_ptr, 12, 0), _byte_table(centroid_ptr, 0, 8), _byte_table(centroid_ptr, 4, 8),
                    _byte_table(centroid_ptr, 8, 8), _byte_table(centroid_ptr, 12, 8), symmetric, base)  # fmt: skip
    elif KEY_BITS == 3:
        pair_lut = (_byte_table(centroid_ptr, 0, 0), _byte_table(centroid_ptr, 4, 0), _byte_table(centroid_ptr, 0, 8),
                    _byte_table(centroid_ptr, 4, 8), base)  # fmt: skip
    return pair_lut


@gluon.jit
def _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks):
    """Whether the request is poisoned (:func:`_split`): its keys need a column past its table, or a block of the
    split (the first 128 checked by :func:`_split`, the rest here) lies outside the cache."""
    for p0 in range(first_page + 128, last_page, 128):  # splits of more than 128 blocks
        bad_pages |= _bad_pages(row_ptr, stride_btc, p0, last_page, num_blocks)
    return too_long | (gl.max(bad_pages.to(gl.int32), axis=0) > 0)


@gluon.jit
def _store_partials(acc, m_i, l_i, z_i, start, end, poisoned, partials_ptr, stride_pb, stride_ph, stride_ps, b, kv_head,
                    split, KV_GROUP: gl.constexpr, VALUE_BITS: gl.constexpr, SPANS: gl.constexpr = 0):  # fmt: skip
    """The split's partial ``(o, lse)`` from the loop's state (``acc`` ``[HEAD_DIM, BLOCK_H]``, row ``d`` holding
    dimension ``_value_dim(d)`` times :func:`_value_row_scale`'s inverse, or (``SPANS``: 3-bit values in one warp)
    :func:`_span_dim` and :func:`_span_row_scale`; ``m_i``, ``l_i``, ``z_i`` per head in base 2), stored in slot
    ``split`` of request ``b``'s heads of KV head ``kv_head``: ``(0, -inf)`` without keys, NaN where the request is
    ``poisoned``."""
    layout: gl.constexpr = acc.type.layout
    BLOCK_H: gl.constexpr = acc.shape[1]
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, layout))
    if SPANS:
        acc = acc * _span_row_scale(d)[:, None]
        dim = _span_dim(d)
    else:
        acc = acc * _value_row_scale(d, VALUE_BITS)[:, None]
        dim = _value_dim(d)
    has_keys = end > start
    l_safe = gl.where(l_i == 0, 1.0, l_i)
    out = gl.where(has_keys, (acc + z_i[None, :]) / l_safe[None, :], 0.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * _LN2, float("-inf"))
    out = gl.where(poisoned, float("nan"), out)
    lse = gl.where(poisoned, float("nan"), lse)
    slot = partials_ptr + b.to(gl.int64) * stride_pb + (kv_head * KV_GROUP + h) * stride_ph + split * stride_ps
    _barrier()  # every thread's load of the slot (MSE keys: the rotated query) before any store to it
    gl.store(slot[None, :] + dim[:, None], out, mask=(h < KV_GROUP)[None, :])
    gl.store(slot + HEAD_DIM, lse, mask=h < KV_GROUP)


@gluon.jit
def _finish(acc, m_i, l_part, z_part, start, end, too_long, bad_pages, row_ptr, stride_btc, first_page, last_page,
            num_blocks, partials_ptr, stride_pb, stride_ph, stride_ps, KV_GROUP: gl.constexpr,
            FP16_OPERANDS: gl.constexpr, VALUE_BITS: gl.constexpr):  # fmt: skip
    """:func:`_store_partials` from a 4-warp loop's state (per-thread partial sums, hi | lo halves of ``acc``)."""
    mma: gl.constexpr = l_part.type.layout
    BLOCK_H: gl.constexpr = l_part.shape[1]
    if not FP16_OPERANDS:
        acc = gl.convert_layout(gl.sum(gl.reshape(acc, [HEAD_DIM, 2, BLOCK_H]), axis=1), mma)
    poisoned = _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)
    _store_partials(acc, m_i, gl.sum(l_part, axis=0), gl.sum(z_part, axis=0), start, end, poisoned, partials_ptr,
                    stride_pb, stride_ph, stride_ps, gl.program_id(0), gl.program_id(1), gl.program_id(2), KV_GROUP,
                    VALUE_BITS)  # fmt: skip


@gluon.constexpr_function
def _operand_layouts(key_fp8, warps=NUM_WARPS):
    """``(mma, dot_b, key_bytes, key words, value words)`` for a tile of ``warps`` 16-key chunks on ``warps`` warps:
    the score and value MMAs' accumulator layout (the warps along M), the B operand's, and the register layouts of a
    tile's packed keys (:func:`_key_words`; ``key_bytes`` is theirs with the 4 bytes of a word as a last dim) and
    value codes (:func:`_value_words`: each warp a quarter of the output dimensions, or with one warp all four in
    registers)."""
    warps = int(warps)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    dot_b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    key_bytes = gl.BlockedLayout([1, 2, 1, 1, 8 if key_fp8 else 4, 4], [1, 1, 8, 4, 1, 1], [warps, 1, 1, 1, 1, 1],
                                 [5, 4, 3, 2, 1, 0])  # fmt: skip
    value_words = gl.BlockedLayout([4 // warps, 1, 1, warps, 2, 2], [1, 8, 4, 1, 1, 1], [warps, 1, 1, 1, 1, 1],
                                   [5, 4, 3, 2, 1, 0])  # fmt: skip
    return mma, dot_b, key_bytes, gl.SliceLayout(5, key_bytes), value_words


@gluon.jit
def decode_stage1_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, centroid_ptr, partials_ptr,
    sm_scale, num_splits, num_blocks, table_keys, stride_block,
    stride_qb, stride_qh, stride_bt, stride_btc, stride_pb, stride_ph, stride_ps,
    KV_GROUP: gl.constexpr,
    KEY_BITS: gl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    KEY_DATA_BYTES: gl.constexpr,
    VALUE_BITS: gl.constexpr,  # 3 or 4
    SLOT_BYTES: gl.constexpr,  # data bytes per (token, KV head) slot
    NUM_KV_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    STAGES: gl.constexpr = 0,  # 0: each tile loaded into registers; else a ring of STAGES shared-memory stages
    FP16_OPERANDS: gl.constexpr = 0,  # 1: the query and p * v_scale rounded once to fp16 (one MMA each), not hi + lo
):  # fmt: skip
    """Grid ``(B, HKV, S)``, 4 warps: the partial ``(o, lse)`` of one split of one request for one KV
    head's group, as ``turboquant._decode_stage1_kernel`` writes it (the module docstring says how)."""
    gl.static_assert(gl.num_warps() == NUM_WARPS)
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    mma: gl.constexpr = _operand_layouts(KEY_FP8)[0]
    dot_b: gl.constexpr = _operand_layouts(KEY_FP8)[1]
    key_bytes: gl.constexpr = _operand_layouts(KEY_FP8)[2]
    key_layout: gl.constexpr = _operand_layouts(KEY_FP8)[3]
    value_layout: gl.constexpr = _operand_layouts(KEY_FP8)[4]
    NUM_FIELDS: gl.constexpr = 2 if KEY_FP8 else 3
    meta_offset: gl.constexpr = BLOCK_SIZE * NUM_KV_HEADS * SLOT_BYTES  # a block's metadata follows its data

    kv_head = gl.program_id(1)
    start, end, row_ptr, too_long, bad_pages, first_page, last_page = _split(
        seq_lens_ptr, block_table_ptr, num_splits, num_blocks, table_keys, stride_bt, stride_btc, BLOCK_SIZE)
    q_hi, q_lo = _query_operand(q_ptr, partials_ptr, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps,
                                gl.program_id(0), kv_head, gl.program_id(2), KV_GROUP, KEY_FP8, BLOCK_H,
                                dot_b)  # fmt: skip
    pair_lut = _centroid_tables(centroid_ptr, KEY_BITS)

    score_scale = sm_scale * _LOG2E
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)  # per-thread partial sums, reduced once at the end
    z_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)
    acc = gl.zeros([HEAD_DIM, BLOCK_H if FP16_OPERANDS else 2 * BLOCK_H], gl.float32, mma)  # hi | lo parts, summed
    key_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    tile = (start // 16) * 16  # tiles of 16-key chunks: one table entry each
    if STAGES == 0:
        # Each tile's table entries are read a tile ahead: its data loads need not wait for them.
        pages = _tile_pages(row_ptr, stride_btc, tile, end, num_blocks, key_rows, BLOCK_SIZE, key_layout, value_layout)
        for tile_start in range(tile, end, BLOCK_N):
            k_words, v_words, norm, v_scale, v_zero, live = _tile_loads(
                cache_ptr, pages, tile_start, start, end, kv_head, NUM_KV_HEADS, stride_block, SLOT_BYTES, meta_offset,
                key_rows, KEY_BITS, KEY_DATA_BYTES, VALUE_BITS, NUM_FIELDS, BLOCK_SIZE, key_layout,
                value_layout)  # fmt: skip
            pages = _tile_pages(row_ptr, stride_btc, tile_start + BLOCK_N, end, num_blocks, key_rows, BLOCK_SIZE,
                                key_layout, value_layout)  # fmt: skip
            m_i, l_part, z_part, acc = _tile_step(k_words, v_words, norm, v_scale, v_zero, live, pair_lut, q_hi, q_lo,
                                                  score_scale, m_i, l_part, z_part, acc, KEY_BITS, VALUE_BITS,
                                                  key_bytes, FP16_OPERANDS, 0, 0, 1)  # fmt: skip
    else:
        fields: gl.constexpr = 4 if NUM_FIELDS == 3 else 2
        key_copy: gl.constexpr = _copy_layout("keys", KEY_BITS, fields)
        value_copy: gl.constexpr = _copy_layout("values", KEY_BITS, fields)
        meta_copy: gl.constexpr = _copy_layout("meta", KEY_BITS, fields)
        # (The layout of a ring of stages has the rank of one stage.) A key's row: its 16 words of 4-bit codes, 32
        # of FP8 or 4 x 4 of 3-bit codes (thread t's 12 bytes, then a word not copied); a value row: a warp's 16 bytes.
        gl.static_assert(VALUE_BITS == 4)
        keys = gl.allocate_shared_memory(gl.uint32, [STAGES, BLOCK_N, 32 if KEY_FP8 else 16], _plain(2))
        values = gl.allocate_shared_memory(gl.uint32, [STAGES, 4, BLOCK_N, 4], _plain(3))
        meta = gl.allocate_shared_memory(gl.uint32, [STAGES, fields, 4, 2, 4], _plain(4))
        for ahead in gl.static_range(STAGES - 1):
            pages = _copy_pages(row_ptr, stride_btc, tile + ahead * BLOCK_N, end, num_blocks, BLOCK_SIZE, key_copy,
                                value_copy, meta_copy)  # fmt: skip
            _issue_copies(cache_ptr, keys.index(ahead), values.index(ahead), meta.index(ahead), pages,
                          tile + ahead * BLOCK_N, end, kv_head, NUM_KV_HEADS, stride_block, SLOT_BYTES, meta_offset,
                          KEY_DATA_BYTES, NUM_FIELDS, BLOCK_SIZE, key_copy, value_copy, meta_copy)  # fmt: skip
            async_copy.commit_group()
        pages = _copy_pages(row_ptr, stride_btc, tile + (STAGES - 1) * BLOCK_N, end, num_blocks, BLOCK_SIZE, key_copy,
                            value_copy, meta_copy)  # fmt: skip
        stage = 0
        for tile_start in range(tile, end, BLOCK_N):
            # This tile's copies are done (each thread's own), and every thread is past the reads of the stage
            # that the copies issued next overwrite (read one tile ago): one barrier for both.
            async_copy.wait_group(STAGES - 2)
            _barrier()
            refill = (stage + STAGES - 1) % STAGES
            _issue_copies(cache_ptr, keys.index(refill), values.index(refill), meta.index(refill), pages,
                          tile_start + (STAGES - 1) * BLOCK_N, end, kv_head, NUM_KV_HEADS, stride_block, SLOT_BYTES,
                          meta_offset, KEY_DATA_BYTES, NUM_FIELDS, BLOCK_SIZE, key_copy, value_copy,
                          meta_copy)  # fmt: skip
            async_copy.commit_group()
            pages = _copy_pages(row_ptr, stride_btc, tile_start + STAGES * BLOCK_N, end, num_blocks, BLOCK_SIZE,
                                key_copy, value_copy, meta_copy)  # fmt: skip
            k_words, v_words, norm, v_scale, v_zero, live = _stage_reads(
                keys.index(stage), values.index(stage), meta.index(stage), tile_start, start, end, key_rows, KEY_BITS,
                NUM_FIELDS, key_layout, value_layout)  # fmt: skip
            m_i, l_part, z_part, acc = _tile_step(k_words, v_words, norm, v_scale, v_zero, live, pair_lut, q_hi, q_lo,
                                                  score_scale, m_i, l_part, z_part, acc, KEY_BITS, VALUE_BITS,
                                                  key_bytes, FP16_OPERANDS)  # fmt: skip
            stage = (stage + 1) % STAGES
        async_copy.wait_group(0)  # no copy outlives the program

    _finish(acc, m_i, l_part, z_part, start, end, too_long, bad_pages, row_ptr, stride_btc, first_page,
            last_page, num_blocks, partials_ptr, stride_pb, stride_ph, stride_ps, KV_GROUP, FP16_OPERANDS, VALUE_BITS)


# Chunks by TMA (``decode_stage1_streams_kernel``, below): each 16-key chunk's key bytes, value bytes and metadata
# arrive by one tensor-memory-access copy each, read back in the register layouts above. No thread computes a byte
# address or waits at a CTA barrier for a chunk: an mbarrier per chunk buffer says its copies landed (their bytes).

TMA_FIELDS_BYTES = gl.constexpr(2)  # each metadata field is fp16


# Metadata rows a chunk's box copies: 4 rows of 16 fp16, 128 bytes, for 2 fields (FP8 keys) as for 3. A TMA copy's
# shared destination must be 128-byte aligned and a stage's chunk buffers lie back to back, so a buffer is a multiple
# of 128 bytes (2 rows, 64 bytes, put every other FP8 buffer off by 64: a misaligned-address fault on the H200). The
# rows past a KV head's own fields are the next head's, or past the last head zeros (TMA fills what lies outside).
TMA_META_ROWS = gl.constexpr(4)


@gluon.constexpr_function
def data_row(key_bytes):
    """Bytes of a token's data box: its 4-bit slot (keys and values, 128), its FP8 key bytes (128), or its 3-bit key
    bytes and the 16 bytes after them (64: a 48-byte box is no power of two)."""
    return 64 if int(key_bytes) == 48 else 128


@gluon.constexpr_function
def separate_values(key_bytes, slot_bytes, value_bits=4):
    """Whether a token's 64 value bytes come as a box of their own (4-bit values after FP8 and 3-bit keys): they are
    not at a 64-byte offset inside the data box, and a slice of a swizzled row must start on a swizzle tile. 3-bit
    values have no box (they are loaded into registers)."""
    return int(value_bits) == 4 and (int(key_bytes) + 64 > data_row(key_bytes) or int(slot_bytes) > 128)


@gluon.constexpr_function
def _box_bytes(key_bytes, slot_bytes, value_bits=4):
    """Bytes a chunk's boxes bring a token: its data box, its value box if separate, and its metadata rows."""
    values = 64 if separate_values(key_bytes, slot_bytes, value_bits) else 0
    return data_row(key_bytes) + values + int(TMA_META_ROWS) * int(TMA_FIELDS_BYTES)


def streams_supports(*, key_bits: int, value_bits: int, group: int, fp16_operands: bool, cache_address: int,
                     one_warp: bool = False) -> bool:  # fmt: skip
    """Whether the TMA kernels (:func:`decode_stage1_warp_kernel`, :func:`decode_stage1_streams_kernel`: one stream a
    warp) serve a call :func:`supports` takes: 3-bit, 4-bit or FP8 keys (a 64- or 128-byte data box a token, and for
    3-bit and FP8 keys a 64-byte value box) with 4-bit values, a group of at most 8 query heads (one MMA N; a stream's
    output of 16 heads takes 64 registers more and spills), the operands rounded once to fp16 (the only form they are
    written for), and a 16-byte aligned cache (a descriptor's base). ``one_warp``: the one-warp kernel, which also
    takes 3-bit values (loaded into registers a chunk ahead, not copied by TMA)."""
    values = value_bits == 4 or (one_warp and value_bits == 3)
    boxes = key_bits in (3, 4, 8) and values and cache_address % 16 == 0
    return boxes and group <= 8 and bool(fp16_operands)


def _data_smem(row_bytes: int) -> gl.NVMMASharedLayout:
    """The shared layout of a chunk's ``[1, 16, row_bytes]`` key or value box: rows swizzled by ``row_bytes`` (64 or
    128), so that the 16-byte reads of 8 tokens' rows (keys) and ``ldmatrix``'s 8 rows (values) are conflict-free."""
    return gl.NVMMASharedLayout(swizzle_byte_width=row_bytes, element_bitwidth=8, rank=3)


_META_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


class _Address:
    """A tensor descriptor's base that is no tensor: an address and a dtype (what the descriptor reads)."""

    __slots__ = ("_address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self._address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self._address


def tma_geometry(*, num_blocks: int, block_size: int, num_kv_heads: int, slot_bytes: int, key_bytes: int,
                 stride_block: int, meta_offset: int, num_fields: int) -> tuple:  # fmt: skip
    """What :func:`descriptors` needs of a cache, fixed by a plan (the address aside)."""
    return num_blocks, block_size, num_kv_heads, slot_bytes, key_bytes, stride_block, meta_offset, num_fields


def descriptors(cache: Any, geometry: tuple) -> tuple[Any, Any, Any]:
    """``(data, values, metadata)`` tensor descriptors of a TurboQuant cache (``cache``: the tensor, or its address
    and dtype; ``geometry``: :func:`tma_geometry`). A block's data is ``[block_size, num_kv_heads * slot_bytes]``
    bytes, ``stride_block`` apart: boxes of one chunk's 16 tokens of one KV head, 128 bytes of each (a 4-bit slot, or
    an FP8 slot's key bytes) and 64 (an FP8 slot's values); a block's metadata ``[num_kv_heads * num_fields,
    block_size]`` fp16 from ``meta_offset``: boxes ``[1, TMA_META_ROWS, 16]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, block_size, num_kv_heads, slot_bytes, key_bytes, stride_block, meta_offset, num_fields = geometry
    row = data_row(key_bytes)
    shape = [num_blocks, block_size, num_kv_heads * slot_bytes]
    strides = [stride_block, num_kv_heads * slot_bytes, 1]
    meta = _Address(cache.data_ptr() + meta_offset, torch.float16)
    return (TensorDescriptor(cache, shape, strides, [1, 16, row], _data_smem(row)),
            TensorDescriptor(cache, shape, strides, [1, 16, 64], _data_smem(64)),
            TensorDescriptor(meta, [num_blocks, num_kv_heads * num_fields, block_size],
                             [stride_block // int(TMA_FIELDS_BYTES), block_size, 1], [1, int(TMA_META_ROWS), 16],
                             _META_SMEM))  # fmt: skip


@gluon.constexpr_function
def _span_layout():
    """The registers of a one-warp kernel's 3-bit value spans (:func:`_value_words` with ``SPANS``)."""
    return gl.BlockedLayout([2, 1, 1, 1, 2, 2], [1, 8, 4, 1, 1, 1], [1, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])


@gluon.constexpr_function
def _chunk_bases(chunks, rank, dim=0, unit=1):
    """The register bases of ``chunks`` consecutive chunk buffers (a power of 2) along ``dim``, ``unit`` apart, in a
    layout of ``rank`` dims: each thread holds every chunk's share."""
    return [[unit << i if d == int(dim) else 0 for d in range(int(rank))] for i in range(int(chunks).bit_length() - 1)]


@gluon.constexpr_function
def _tma_key_layout(words, chunks=1):
    """``[16 * chunks, 4 * words]`` words of chunk buffers read by one warp as :func:`_key_words` holds them: key ``16c
    + 8 half + quad``, thread ``t``'s words ``words t ..`` (``words`` 4 for 4-bit keys, 8 for FP8)."""
    words = int(words)
    reg = [*([0, 1 << i] for i in range(words.bit_length() - 1)), [8, 0], *_chunk_bases(chunks, 2, 0, 16)]
    lane = [[0, words], [0, 2 * words], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [16 * int(chunks), 4 * words])


@gluon.constexpr_function
def _tma_value_layout(chunks=1):
    """``[16 * chunks, 32]`` halfwords of 4-bit value codes read by one warp as :func:`_value_words` holds them:
    halfword ``8 q + quad`` of key ``16c + 8j + 2t + e`` (``ldmatrix.trans``-shaped: a thread's two keys ``e``
    adjacent), each quarter ``q`` of the output dimensions in registers."""
    reg = [[1, 0], [8, 0], [0, 8], [0, 16], *_chunk_bases(chunks, 2, 0, 16)]  # [0, 8], [0, 16]: the quarters
    lane = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
    return gl.DistributedLinearLayout(reg, lane, [], [], [16 * int(chunks), 32])


@gluon.constexpr_function
def _tma_meta_layout(chunks=1):
    """``[chunks, 1, 16 keys]`` of one metadata field read by one warp as the score rows hold them (key ``16c + 8h +
    g`` of chunk ``c`` by lane quad ``g``, registers ``h, c``; the quad's 4 threads alike)."""
    lane = [[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
    return gl.DistributedLinearLayout([[0, 0, 8], *_chunk_bases(chunks, 3)], lane, [], [], [int(chunks), 1, 16])


@gluon.jit
def _shuffle_up(x):
    """Each lane gets lane ``lane - 1``'s ``x`` (lane 0 its own)."""
    return gl.inline_asm_elementwise("shfl.sync.up.b32 $0, $1, 1, 0, 0xffffffff;", "=r,r", [x], dtype=gl.uint32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _three_bit_words(words):
    """Key words ``[chunk, half, quad, t, w]`` read as 4-bit keys' (thread ``t``'s words ``4t + w``, 16-byte reads)
    -> as 3-bit keys' (:func:`_key_words`: words ``3t + w`` of thread ``t``'s 12 bytes, ``w < 3``; word 3 is not
    read). Word ``3t + w`` is the thread's own word ``w - t`` where ``w >= t``, else its left neighbour's (lane ``t -
    1`` of the same keys) word ``w - t + 4``. So thread ``t``'s three words are ``S[s], S[s + 1], S[s + 2]`` of
    ``S = [p1, p2, p3, a0, a1, a2]`` (``p``: the neighbour's words, three shuffles) at ``s = 3 - t``: a window
    shifted by 2 where ``s``'s bit 1 is set (4 selects), then by 1 where its bit 0 is (3 selects)."""
    w02, w13 = gl.split(gl.reshape(words, [words.shape[0], 2, 8, 4, 2, 2]))  # word 2a + b: split by b, then by a
    a0, a2 = gl.split(w02)
    a1, a3 = gl.split(w13)
    p1 = _shuffle_up(a1)
    p2 = _shuffle_up(a2)
    p3 = _shuffle_up(a3)
    layout: gl.constexpr = a0.type.layout
    t = _iota(4, 3, 4, layout)
    by_two = t < 2  # s = 3 - t has bit 1 set
    by_one = (t & 1) == 0  # ... and bit 0
    s0 = gl.where(by_two, p3, p1)  # S[s], S[s + 1], .. after the shift by 2
    s1 = gl.where(by_two, a0, p2)
    s2 = gl.where(by_two, a1, p3)
    s3 = gl.where(by_two, a2, a0)
    b0 = gl.where(by_one, s1, s0)
    b1 = gl.where(by_one, s2, s1)
    b2 = gl.where(by_one, s3, s2)
    out = gl.join(gl.join(b0, b2), gl.join(b1, b2))  # word 2c + d at [c, d]; word 3 is not read: b2 again
    words_layout: gl.constexpr = words.type.layout
    return gl.convert_layout(gl.reshape(out, words.shape), words_layout)


@gluon.jit
def _tma_stage_reads(data, values, meta, group, tile_start, start, end, key_rows, KEY_BITS: gl.constexpr,
                     KEY_DATA_BYTES: gl.constexpr, NUM_FIELDS: gl.constexpr, KEY_LAYOUT: gl.constexpr,
                     VALUE_LAYOUT: gl.constexpr, VALUE_BITS: gl.constexpr = 4):  # fmt: skip
    """The ``C = len(key_rows) // 16`` chunk buffers of group ``group``: their ``16 C`` keys, read by one warp, in the
    layouts :func:`_tile_loads` returns for a ``C``-chunk tile (the metadata 0 where a key is not ``live``); 3-bit
    values are not in the buffer (their words: 0)."""
    gl.static_assert(gl.num_warps() == 1)
    C: gl.constexpr = key_rows.shape[0] // 16
    WORDS: gl.constexpr = 8 if KEY_BITS == 8 else 4
    GROUPS: gl.constexpr = data.shape[0] // C  # a group's buffers lie back to back: one tile of 16 C rows
    ROW: gl.constexpr = data.shape[3]  # bytes of a token's row in ``data``: its slot, or (FP8 keys) its key bytes
    key_words = _reinterpret(data, gl.uint32, [GROUPS, 16 * C, ROW // 4],
                             gl.NVMMASharedLayout(swizzle_byte_width=ROW, element_bitwidth=32, rank=2))
    k_words = key_words.index(group).slice(0, 4 * WORDS, 1).load(_tma_key_layout(WORDS, C))
    k_words = gl.convert_layout(gl.reshape(k_words, [C, 2, 8, 4, WORDS]), KEY_LAYOUT)
    if KEY_BITS == 3:
        k_words = _three_bit_words(k_words)
    v_words = 0
    if VALUE_BITS == 4:
        if KEY_DATA_BYTES + 64 <= ROW:  # the values are in the slot's row after the key bytes
            v_first: gl.constexpr = KEY_DATA_BYTES // 2
            codes = _reinterpret(data, gl.uint16, [GROUPS, 16 * C, ROW // 2],
                                 gl.NVMMASharedLayout(swizzle_byte_width=ROW, element_bitwidth=16, rank=2))
        else:
            codes = _reinterpret(values, gl.uint16, [GROUPS, 16 * C, 32],
                                 gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
            v_first: gl.constexpr = 0
        v_words = codes.index(group).slice(v_first, 32, 1).load(_tma_value_layout(C))
        v_words = gl.reshape(v_words, [C, 2, 4, 2, 4, 8])  # [c, j, t, e, q, quad]
        v_words = gl.convert_layout(gl.permute(v_words, (4, 5, 2, 0, 1, 3)), VALUE_LAYOUT)
    fields = _reinterpret(meta, gl.float16, [GROUPS, C, meta.shape[2], 16], meta.type.layout).index(group)
    token = tile_start + key_rows
    live = (token >= start) & (token < end)
    rows: gl.constexpr = key_rows.type.layout
    meta_layout: gl.constexpr = _tma_meta_layout(C)
    scale = gl.convert_layout(gl.reshape(fields.slice(NUM_FIELDS - 2, 1, 1).load(meta_layout), [16 * C]), rows)
    zero = gl.convert_layout(gl.reshape(fields.slice(NUM_FIELDS - 1, 1, 1).load(meta_layout), [16 * C]), rows)
    if NUM_FIELDS == 3:
        norm = gl.convert_layout(gl.reshape(fields.slice(0, 1, 1).load(meta_layout), [16 * C]), rows)
        norm = gl.where(live, norm.to(gl.float32), 0.0)
    else:
        norm = gl.full(token.shape, 1.0, gl.float32, rows)
    scale = gl.where(live, scale.to(gl.float32), 0.0)
    zero = gl.where(live, zero.to(gl.float32), 0.0)
    return k_words, v_words, norm, scale, zero, live


# Per-warp streams (``decode_stage1_streams_kernel``): each of 4 warps is a partition of its own
# (``gl.warp_specialize``) that runs a whole online softmax over every fourth 16-key chunk of the split: it copies
# its chunks by TMA into its own ring of stages, waits on its own mbarriers, and keeps its own row max, sums and
# output. Nothing crosses warps inside the loop (no row max, no probabilities through shared memory, no CTA
# barrier); the four states are merged once, after the loop, by the 4 warps of the default partition, which check
# the block table meanwhile.

STREAMS = gl.constexpr(4)
STREAM_REGS = gl.constexpr(104)  # registers per thread of a stream warp (setmaxnreg)
# The launch's register cap: 8 warps a program (4 default, 4 streams) at 64 fit four programs a SM, and setmaxnreg
# moves the default warps' spare registers to the streams.
STREAMS_LAUNCH_REGS = 64


@gluon.jit
def _issue_chunk(data_desc, value_desc, meta_desc, data, values, meta, bar, buffer, page, chunk_start, kv_head,
                 SLOT_BYTES: gl.constexpr, KEY_DATA_BYTES: gl.constexpr, NUM_FIELDS: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr, VALUE_BITS: gl.constexpr = 4):  # fmt: skip
    """The TMA copies of the 16-key chunk at ``chunk_start`` (in block ``page``) into chunk buffer ``buffer``: its
    slots (or, FP8 keys, their key bytes and their values) and its metadata, completing on ``bar``."""
    position = (chunk_start.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
    column = kv_head * SLOT_BYTES
    _tma_load(data_desc, [page, position, column], bar, data.index(buffer))
    if separate_values(KEY_DATA_BYTES, SLOT_BYTES, VALUE_BITS):
        _tma_load(value_desc, [page, position, column + KEY_DATA_BYTES], bar, values.index(buffer))
    _tma_load(meta_desc, [page, kv_head * NUM_FIELDS, position], bar, meta.index(buffer))


@gluon.jit
def _chunk_ring(BUFFERS: gl.constexpr, data_desc, value_desc, meta_desc, KEY_DATA_BYTES: gl.constexpr,
                SLOT_BYTES: gl.constexpr, VALUE_BITS: gl.constexpr = 4):  # fmt: skip
    """``BUFFERS`` chunk buffers for the TMA copies (:func:`_issue_chunk`) and their mbarriers, initialized: ``(data,
    values, meta, full)``, ``values`` the data buffers themselves where a token's values lie in its data box or are
    not copied (3-bit values)."""
    data = gl.allocate_shared_memory(gl.uint8, [BUFFERS, 1, 16, data_row(KEY_DATA_BYTES)], data_desc.layout)
    values = data
    if separate_values(KEY_DATA_BYTES, SLOT_BYTES, VALUE_BITS):
        values = gl.allocate_shared_memory(gl.uint8, [BUFFERS, 1, 16, 64], value_desc.layout)
    meta = gl.allocate_shared_memory(gl.float16, [BUFFERS, 1, TMA_META_ROWS, 16], meta_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(BUFFERS):
        mbarrier.init(full.index(b), count=1)
    fence_async_shared()
    return data, values, meta, full


@gluon.jit
def _step_pages(row_ptr, stride_btc, chunk_start, end, num_blocks, BLOCK_SIZE: gl.constexpr, STEP: gl.constexpr):
    """The blocks of chunks ``chunk_start``, ``chunk_start + 16``, .. (``STEP`` of them, 1 or 2) as scalars, the second
    0 for ``STEP`` 1 (:func:`_page`)."""
    first = _page(row_ptr, stride_btc, chunk_start, end, num_blocks, BLOCK_SIZE)
    second = 0
    if STEP == 2:
        second = _page(row_ptr, stride_btc, chunk_start + 16, end, num_blocks, BLOCK_SIZE)
    return first, second


@gluon.jit
def _step_value_words(cache_ptr, row_ptr, stride_btc, chunk_start, end, num_blocks, kv_head, stride_block,
                      shape: gl.constexpr):  # fmt: skip
    """3-bit values' words of the ``STEP`` chunks from ``chunk_start`` (their blocks from the table,
    :func:`_step_pages`; :func:`_value_words`, its chunk dim the step's chunks). Unmasked: a chunk past the split's
    reads block 0 or a block clamped into the cache (:func:`_page`), and its words go unused; a mask cost a predicate
    move a load (16 of 619 instructions a chunk, Triton 3.6). ``shape``: :func:`_chunks`'."""
    STEP: gl.constexpr = shape[11]
    pages = _step_pages(row_ptr, stride_btc, chunk_start, end, num_blocks, shape[5], STEP)
    LAYOUT: gl.constexpr = _span_layout()
    c = _iota(STEP, 3, 6, LAYOUT)
    page = gl.where(c == 0, pages[0], pages[1])
    # shape: KEY_DATA_BYTES 2, SLOT_BYTES 3, BLOCK_SIZE 5, VALUE_BITS 9, NUM_KV_HEADS 10
    return _value_words(cache_ptr, page, chunk_start, None, kv_head, shape[10], stride_block, shape[3], shape[2],
                        shape[9], shape[5], LAYOUT, STEP, 1)  # fmt: skip


@gluon.jit
def _chunk_loop(stream, ring, descs, cache_ptr, split_state, operands, state, shape: gl.constexpr,
                SYMMETRIC: gl.constexpr):  # fmt: skip
    """:func:`_chunks`'s loop over the stream's chunks, from ``state`` (``m, l, z, acc``, the blocks of the first
    refills and, 3-bit values, the first chunks' value words) to the same after the last chunk; ``SYMMETRIC``: 4-bit
    keys of a symmetric codebook (:data:`SYMMETRIC_PAIRS_ASM`)."""
    data, values, meta, full = ring
    data_desc, value_desc, meta_desc = descs
    row_ptr, stride_btc, num_blocks, tile, start, end, count, first, kv_head, stride_block = split_state
    q_hi, q_lo, pair_lut, score_scale, key_rows = operands
    m_i, l_part, z_part, acc, ahead, v_next = state
    KEY_BITS: gl.constexpr = shape[1]
    KEY_DATA_BYTES: gl.constexpr = shape[2]
    SLOT_BYTES: gl.constexpr = shape[3]
    NUM_FIELDS: gl.constexpr = shape[4]
    BLOCK_SIZE: gl.constexpr = shape[5]
    STAGES: gl.constexpr = shape[7]
    STRIDE: gl.constexpr = shape[8]
    VALUE_BITS: gl.constexpr = shape[9]
    STEP: gl.constexpr = shape[11]
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    key_bytes: gl.constexpr = _operand_layouts(KEY_FP8, 1)[2]
    key_layout: gl.constexpr = _operand_layouts(KEY_FP8, 1)[3]
    value_layout: gl.constexpr = _operand_layouts(KEY_FP8, 1)[4]
    CHUNK_BYTES: gl.constexpr = 16 * _box_bytes(KEY_DATA_BYTES, SLOT_BYTES, VALUE_BITS)
    for i in range(count // STEP):
        n = STEP * i  # the iteration's first chunk (of this stream's)
        buffer = first + n % STAGES
        pages = ahead
        ahead = _step_pages(row_ptr, stride_btc, tile + 16 * (stream + STRIDE * (n + STEP + STAGES)), end, num_blocks,
                            BLOCK_SIZE, STEP)  # fmt: skip
        v_words = v_next
        mbarrier.wait(full.index(buffer), (n // STAGES) & 1)
        if STEP == 2:  # (count is a multiple of STEP: a chunk past the split is copied too, its keys not live)
            mbarrier.wait(full.index(buffer + 1), (n // STAGES) & 1)
        k_words, staged_values, norm, v_scale, v_zero, live = _tma_stage_reads(
            data, values, meta, buffer // STEP, tile + 16 * (stream + STRIDE * n), start, end, key_rows, KEY_BITS,
            KEY_DATA_BYTES, NUM_FIELDS, key_layout, value_layout, VALUE_BITS)  # fmt: skip
        if VALUE_BITS == 4:
            v_words = staged_values
        m_i, l_part, z_part, acc = _tile_step(k_words, v_words, norm, v_scale, v_zero, live, pair_lut, q_hi, q_lo,
                                              score_scale, m_i, l_part, z_part, acc, KEY_BITS, VALUE_BITS, key_bytes,
                                              1, 1, SYMMETRIC, 0, shape[13])  # fmt: skip
        if VALUE_BITS == 3:  # the next iteration's value words, loaded once this iteration's are used
            following = tile + 16 * (stream + STRIDE * (n + STEP))
            v_next = _step_value_words(cache_ptr, row_ptr, stride_btc, following, end, num_blocks, kv_head,
                                       stride_block, shape)  # fmt: skip
        # This warp's reads of the buffers are done: refill them.
        if n + STAGES < count:
            fence_async_shared()
            for j in gl.static_range(STEP):
                if n + j + STAGES < count:
                    mbarrier.expect(full.index(buffer + j), CHUNK_BYTES)
                    _issue_chunk(data_desc, value_desc, meta_desc, data, values, meta, full.index(buffer + j),
                                 buffer + j, pages[j], tile + 16 * (stream + STRIDE * (n + j + STAGES)), kv_head,
                                 SLOT_BYTES, KEY_DATA_BYTES, NUM_FIELDS, BLOCK_SIZE, VALUE_BITS)  # fmt: skip
    return m_i, l_part, z_part, acc, ahead, v_next


@gluon.jit
def _chunks(stream, ring, descs, pointers, split, strides, pair_lut, shape: gl.constexpr):
    """One warp's online softmax over chunks ``stream, stream + STRIDE, ...`` of the split (16 keys from ``tile`` each),
    copied by TMA through its chunk buffers ``STAGES stream ..`` of ``ring`` (``data, values, meta, full``): ``(acc, m,
    l, z)``, ``acc`` ``[HEAD_DIM, BLOCK_H]`` in the MMA layout, the rest per head. ``shape`` is ``(KV_GROUP, KEY_BITS,
    KEY_DATA_BYTES, SLOT_BYTES, NUM_FIELDS, BLOCK_SIZE, BLOCK_H, STAGES, STRIDE, VALUE_BITS, NUM_KV_HEADS, STEP,
    HADAMARD_QUERY, SHARED_PAIRS)``; the other arguments are the kernels' in tuples (``pointers`` ends with
    ``pit_ptr``). Each iteration takes ``STEP`` consecutive chunks (1, or 2 with ``STRIDE`` 1: one softmax step and one
    row max over 32 keys, which halves what an iteration costs besides its keys), a group of ``STEP`` buffers; a
    split's last group is copied whole, past its keys if need be. 3-bit values are loaded a step ahead as each lane
    quad's spans (:func:`_step_value_words`), made codes at the value product (:func:`_span_operand`). ``split`` ends
    with the request and the KV head; the ring's mbarriers are at their first phase (a program that runs several splits
    through the same buffers initializes them again between, :func:`decode_stage1_stream_k_kernel`). ``pair_lut``:
    :func:`_centroid_tables`."""
    data, values, meta, full = ring
    data_desc, value_desc, meta_desc = descs
    q_ptr, partials_ptr, _, cache_ptr, pit_ptr = pointers
    row_ptr, stride_btc, num_blocks, tile, start, end, sm_scale, query_slot, b, kv_head = split
    stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_block = strides
    KV_GROUP: gl.constexpr = shape[0]
    KEY_BITS: gl.constexpr = shape[1]
    KEY_DATA_BYTES: gl.constexpr = shape[2]
    SLOT_BYTES: gl.constexpr = shape[3]
    NUM_FIELDS: gl.constexpr = shape[4]
    BLOCK_SIZE: gl.constexpr = shape[5]
    BLOCK_H: gl.constexpr = shape[6]
    STAGES: gl.constexpr = shape[7]
    STRIDE: gl.constexpr = shape[8]
    VALUE_BITS: gl.constexpr = shape[9]
    STEP: gl.constexpr = shape[11]
    HADAMARD_QUERY: gl.constexpr = shape[12]
    gl.static_assert((STEP == 1) or ((STEP == 2) and (STRIDE == 1)))
    gl.static_assert(STAGES % STEP == 0)
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    mma: gl.constexpr = _operand_layouts(KEY_FP8, 1)[0]
    dot_b: gl.constexpr = _operand_layouts(KEY_FP8, 1)[1]
    CHUNK_BYTES: gl.constexpr = 16 * _box_bytes(KEY_DATA_BYTES, SLOT_BYTES, VALUE_BITS)
    q_hi, q_lo = _query_operand(q_ptr, partials_ptr, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, b,
                                kv_head, query_slot, KV_GROUP, KEY_FP8, BLOCK_H, dot_b, pit_ptr,
                                HADAMARD_QUERY)  # fmt: skip
    num_chunks = gl.where(end > start, gl.cdiv(end - tile, 16), 0)
    count = gl.maximum(num_chunks - stream + STRIDE - 1, 0) // STRIDE  # this stream's chunks
    count = gl.cdiv(count, STEP) * STEP  # whole iterations: the second wait needs no test of its own
    first = stream * STAGES  # its chunk buffers and mbarriers
    for st in gl.static_range(STAGES):
        if st < count:
            chunk_start = tile + 16 * (stream + STRIDE * st)
            page = _page(row_ptr, stride_btc, chunk_start, end, num_blocks, BLOCK_SIZE)
            mbarrier.expect(full.index(first + st), CHUNK_BYTES)
            _issue_chunk(data_desc, value_desc, meta_desc, data, values, meta, full.index(first + st), first + st,
                         page, chunk_start, kv_head, SLOT_BYTES, KEY_DATA_BYTES, NUM_FIELDS, BLOCK_SIZE,
                         VALUE_BITS)  # fmt: skip
    # The blocks of the chunks each iteration refills its buffers with are read an iteration ahead.
    ahead = _step_pages(row_ptr, stride_btc, tile + 16 * (stream + STRIDE * STAGES), end, num_blocks, BLOCK_SIZE,
                        STEP)  # fmt: skip

    score_scale = sm_scale * _LOG2E
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_part = gl.zeros([16 * STEP, BLOCK_H], gl.float32, mma)
    z_part = gl.zeros([16 * STEP, BLOCK_H], gl.float32, mma)
    acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, mma)
    key_rows = gl.arange(0, 16 * STEP, layout=gl.SliceLayout(1, mma))
    # 3-bit values are not copied by TMA (the quads' spans start at words 0, 1, 3, 4, 6, .., which no linear layout
    # of a shared buffer gives): each iteration's spans are loaded into registers an iteration ahead
    # (:func:`_value_words`), at the end of the iteration before (loaded at its top, they held more registers through
    # its keys' work).
    v_next = 0
    if VALUE_BITS == 3:
        v_next = _step_value_words(cache_ptr, row_ptr, stride_btc, tile + 16 * stream, end, num_blocks, kv_head,
                                   stride_block, shape)  # fmt: skip
    split_state = (row_ptr, stride_btc, num_blocks, tile, start, end, count, first, kv_head, stride_block)
    operands = (q_hi, q_lo, pair_lut, score_scale, key_rows)
    state = (m_i, l_part, z_part, acc, ahead, v_next)
    if KEY_BITS == 4:
        # A codebook symmetric bit for bit (:func:`_centroid_tables`) takes the shorter lookup: the branch is around
        # the whole loop, so that each loop holds only its own lookup's registers (inside it, 56 bytes spilled).
        if pair_lut[8]:
            state = _chunk_loop(stream, ring, descs, cache_ptr, split_state, operands, state, shape, 1)
        else:
            state = _chunk_loop(stream, ring, descs, cache_ptr, split_state, operands, state, shape, 0)
    else:
        state = _chunk_loop(stream, ring, descs, cache_ptr, split_state, operands, state, shape, 0)
    m_i, l_part, z_part, acc, _, _ = state
    return acc, m_i, gl.sum(l_part, axis=0), gl.sum(z_part, axis=0)


@gluon.jit
def _stream(stream: gl.constexpr, shared, descs, pointers, split, strides, shape: gl.constexpr):
    """Stream ``stream`` (a one-warp partition of :func:`decode_stage1_streams_kernel`): :func:`_chunks` over every
    ``STREAMS``-th chunk from chunk ``stream``; leaves its ``acc`` in ``states[stream]``, its ``(m, l, z)`` in
    ``sums[stream]``."""
    data, values, meta, full, states, sums = shared
    pair_lut = _centroid_tables(pointers[2], shape[1])
    acc, m_i, l_i, z_i = _chunks(stream, (data, values, meta, full), descs, pointers, split, strides, pair_lut, shape)
    states.index(stream).store(acc)
    mine = sums.index(stream)
    mine.slice(0, 1, 0).store(m_i[None, :])
    mine.slice(1, 1, 0).store(l_i[None, :])
    mine.slice(2, 1, 0).store(z_i[None, :])


@gluon.jit
def _streams_guard(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks):
    """The default partition while the streams run (a default partition has 4 warps, a stream one): the rest of the
    split's block-table check (:func:`_poisoned`)."""
    return (_poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks),)


@gluon.jit
def decode_stage1_streams_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, centroid_ptr, partials_ptr, pit_ptr, data_desc, value_desc,
    meta_desc,
    sm_scale, num_splits, num_blocks, table_keys, query_slot, stride_block,
    stride_qb, stride_qh, stride_bt, stride_btc, stride_pb, stride_ph, stride_ps,
    KV_GROUP: gl.constexpr,
    KEY_BITS: gl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    KEY_DATA_BYTES: gl.constexpr,
    VALUE_BITS: gl.constexpr,  # 4
    SLOT_BYTES: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    STAGES: gl.constexpr = 3,
    FP16_OPERANDS: gl.constexpr = 1,
):  # fmt: skip
    """:func:`decode_stage1_kernel`'s partials by per-warp streams (the section above): grid ``(B, HKV, S)``, 4
    warps for the table check and the merge, 4 stream warps. The operands rounded once to fp16 (``FP16_OPERANDS``).
    MSE keys read the rotated query from partials slot ``query_slot``, past the splits (with one split, its own slot,
    read before its partial overwrites it)."""
    gl.static_assert(gl.num_warps() == NUM_WARPS)
    gl.static_assert(VALUE_BITS == 4)
    gl.static_assert(FP16_OPERANDS == 1)
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    NUM_FIELDS: gl.constexpr = 2 if KEY_FP8 else 3
    start, end, row_ptr, too_long, bad_pages, first_page, last_page = _split(
        seq_lens_ptr, block_table_ptr, num_splits, num_blocks, table_keys, stride_bt, stride_btc, BLOCK_SIZE)
    data, values, meta, full = _chunk_ring(STREAMS * STAGES, data_desc, value_desc, meta_desc, KEY_DATA_BYTES,
                                           SLOT_BYTES)  # fmt: skip
    # Each stream's acc [HEAD_DIM, BLOCK_H], and its (m, l, z) as rows 0-2 of a [4, BLOCK_H] block.
    states = gl.allocate_shared_memory(gl.float32, [STREAMS, HEAD_DIM, BLOCK_H], _plain(2))
    sums = gl.allocate_shared_memory(gl.float32, [STREAMS, 4, BLOCK_H], _plain(2))

    tile = (start // 16) * 16
    shared = (data, values, meta, full, states, sums)
    descs = (data_desc, value_desc, meta_desc)
    pointers = (q_ptr, partials_ptr, centroid_ptr, cache_ptr, pit_ptr)
    split = (row_ptr, stride_btc, num_blocks, tile, start, end, sm_scale, query_slot, gl.program_id(0),
             gl.program_id(1))
    strides = (stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_block)
    shape: gl.constexpr = (KV_GROUP, KEY_BITS, KEY_DATA_BYTES, SLOT_BYTES, NUM_FIELDS, BLOCK_SIZE, BLOCK_H, STAGES,
                           STREAMS, VALUE_BITS, NUM_KV_HEADS, 1, 0, 0)  # fmt: skip
    (poisoned,) = gl.warp_specialize([
        (_streams_guard, (too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)),
        (_stream, (gl.constexpr(0), shared, descs, pointers, split, strides, shape)),
        (_stream, (gl.constexpr(1), shared, descs, pointers, split, strides, shape)),
        (_stream, (gl.constexpr(2), shared, descs, pointers, split, strides, shape)),
        (_stream, (gl.constexpr(3), shared, descs, pointers, split, strides, shape)),
    ], [1, 1, 1, 1], [STREAM_REGS, STREAM_REGS, STREAM_REGS, STREAM_REGS])  # fmt: skip

    # The merge: the streams' maxima to one, each state scaled to it.
    layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_H], [32, 1], [NUM_WARPS, 1], [1, 0])
    heads: gl.constexpr = gl.SliceLayout(0, layout)
    m_all = gl.full([BLOCK_H], float("-inf"), gl.float32, heads)
    for st in gl.static_range(STREAMS):
        m_all = gl.maximum(m_all, gl.max(sums.index(st).slice(0, 1, 0).load(layout), axis=0))
    acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, layout)
    l_i = gl.zeros([BLOCK_H], gl.float32, heads)
    z_i = gl.zeros([BLOCK_H], gl.float32, heads)
    for st in gl.static_range(STREAMS):
        theirs = sums.index(st)
        m_s = gl.max(theirs.slice(0, 1, 0).load(layout), axis=0)  # a row's one element, per head
        weight = gl.where(m_s == float("-inf"), 0.0, gl.exp2(m_s - m_all))
        acc += states.index(st).load(layout) * weight[None, :]
        l_i += gl.max(theirs.slice(1, 1, 0).load(layout), axis=0) * weight
        z_i += gl.max(theirs.slice(2, 1, 0).load(layout), axis=0) * weight
    _store_partials(acc, m_all, l_i, z_i, start, end, poisoned, partials_ptr, stride_pb, stride_ph, stride_ps,
                    gl.program_id(0), gl.program_id(1), gl.program_id(2), KV_GROUP, VALUE_BITS)  # fmt: skip


# One warp a program (``decode_stage1_warp_kernel``): the stream above as a whole program. Four stream partitions are
# four copies of the loop in the instruction cache (Nsight Compute, 4-bit keys at L=8K: 40% of the stream warps'
# samples waiting for instructions); one-warp programs share one copy, and a CTA of one warp has no barrier that
# another warp can hold up. A program's split is one stream; the splits' merge is the decode's second stage, as for
# the other kernels, with more splits (more programs fit a SM).

@gluon.jit
def decode_stage1_warp_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, centroid_ptr, partials_ptr, pit_ptr, data_desc, value_desc,
    meta_desc,
    sm_scale, num_splits, num_blocks, table_keys, query_slot, stride_block,
    stride_qb, stride_qh, stride_bt, stride_btc, stride_pb, stride_ph, stride_ps,
    KV_GROUP: gl.constexpr,
    KEY_BITS: gl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    KEY_DATA_BYTES: gl.constexpr,
    VALUE_BITS: gl.constexpr,  # 3 or 4 (3-bit: loaded into registers a chunk ahead, not by TMA)
    SLOT_BYTES: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    STAGES: gl.constexpr = 3,
    FP16_OPERANDS: gl.constexpr = 1,
    STEP: gl.constexpr = 1,  # chunks an iteration (1 or 2; STAGES a multiple of it)
    HADAMARD_QUERY: gl.constexpr = 0,  # MSE keys, PiT = c H_128: rotate the query here (pit_ptr), not read it
    SHARED_PAIRS: gl.constexpr = 0,  # MSE keys: of each thread's 4 words or groups of codes, how many (0-4) are looked
    # up in the shared pair table, the rest by prmt (_key_operand)
):  # fmt: skip
    """:func:`decode_stage1_kernel`'s partials, grid ``(B, HKV, S)``, one warp a program: the split's chunks by TMA
    through ``STAGES`` buffers, ``STEP`` an iteration, one online softmax (:func:`_chunks`). The operands rounded once
    to fp16. MSE keys read the rotated query from partials slot ``query_slot``, past the splits (with one split, its
    own slot, read before its partial overwrites it), or with ``HADAMARD_QUERY`` rotate the query themselves
    (:func:`_hadamard_query`); ``pit_ptr`` is read there only."""
    gl.static_assert(gl.num_warps() == 1)
    gl.static_assert((VALUE_BITS == 3) or (VALUE_BITS == 4))
    gl.static_assert(FP16_OPERANDS == 1)
    NUM_FIELDS: gl.constexpr = 2 if KEY_BITS == 8 else 3
    start, end, row_ptr, too_long, bad_pages, first_page, last_page = _split(
        seq_lens_ptr, block_table_ptr, num_splits, num_blocks, table_keys, stride_bt, stride_btc, BLOCK_SIZE)
    data, values, meta, full = _chunk_ring(STAGES, data_desc, value_desc, meta_desc, KEY_DATA_BYTES, SLOT_BYTES,
                                           VALUE_BITS)  # fmt: skip
    b = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = (row_ptr, stride_btc, num_blocks, (start // 16) * 16, start, end, sm_scale, query_slot, b, kv_head)
    shape: gl.constexpr = (KV_GROUP, KEY_BITS, KEY_DATA_BYTES, SLOT_BYTES, NUM_FIELDS, BLOCK_SIZE, BLOCK_H, STAGES, 1,
                           VALUE_BITS, NUM_KV_HEADS, STEP, HADAMARD_QUERY, SHARED_PAIRS)  # fmt: skip
    acc, m_i, l_i, z_i = _chunks(0, (data, values, meta, full), (data_desc, value_desc, meta_desc),
                                 (q_ptr, partials_ptr, centroid_ptr, cache_ptr, pit_ptr), split,
                                 (stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_block),
                                 _centroid_tables(centroid_ptr, KEY_BITS, SHARED_PAIRS), shape)  # fmt: skip
    poisoned = _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)
    _store_partials(acc, m_i, l_i, z_i, start, end, poisoned, partials_ptr, stride_pb, stride_ph, stride_ps, b,
                    kv_head, gl.program_id(2), KV_GROUP, VALUE_BITS, VALUE_BITS == 3)  # fmt: skip


# Stream-K (``decode_stage1_stream_k_kernel``): the same one-warp programs, as many as fit the GPU at once, the keys of
# the whole call divided evenly among them. Per KV head, concatenate the requests' chunks of 16 STEP keys ("steps"):
# T steps; each KV head gets P / HKV programs (program p: KV head p % HKV, q = p // HKV), program q taking steps [q T /
# P', (q + 1) T / P') of its head's, which may cross requests: each piece is a split of its own, its partial written
# to slot (q - the program of the piece's first step). The programs of the HKV heads of one q read the same tokens at
# once, as the grid's programs of one (request, split) do: a token's slots of all heads are adjacent in the cache, and
# sectors and metadata boxes that two heads share are then read from DRAM once (a request-major order over (request,
# head) lost that: k3v4 28% slower, 4-bit 5%, on the H200). The grid's splits run in rounds, the last of which leaves
# SMs idle (B=32 HKV=8, 16 splits: 4096 programs for 2112 places), and a request's splits are as many for 300 keys as
# for 32K; here every SM gets the same work in one round, and a batch of long and short requests is split where its
# keys are. The pieces of a (request, KV head) number at most S (its partial slots) because P' is cut to T // ceil(most
# steps / (S - 1)) where a request is that long. Slots no piece takes get LSE -inf (the merge skips them) from the
# program of the last piece; a request without keys gets them in every slot (NaN where it is too long for its table)
# from program b % P. A walk of the empty requests by their place in the steps (from the program that holds it)
# spilled the chunk loop, wherever it stood (Triton 3.6, 4-bit keys: 14-19 local loads an iteration, 88-120 bytes of
# stack); the stride over requests does not.
# Even steps do not end together: a warp scheduler issues its older warps first, so with 3 or 4 programs a scheduler
# they end by their rank there (the order they arrived in; B=32 L=8K on the H200, 3-bit values: ranks 0 / 1 / 2 end
# at 94 / 110 / 128 us, median, benchmarks/tq_timeline.py), the youngest alone. With RANKS (PROGRAMS_PER_SM / 4) a
# program reads its warp slot, takes a place of its rank (_stream_k_claim), and places of older ranks get more steps
# (TILT); the places' first steps and the owner of a step follow the weights (_stream_k_bound, _stream_k_owner).

STREAM_K_REQUESTS = gl.constexpr(32)  # requests a block of the scans over seq_lens: one register a thread each


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _stream_k_steps(seq_lens_ptr, batch, table_keys, b0, before, STEP_KEYS: gl.constexpr):
    """Requests ``b0 .. b0 + 31``, after ``before`` steps: their indices, lengths (0 past ``batch``), steps of
    ``STEP_KEYS`` keys (over the keys their table holds), and the steps up to and including theirs."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    index = b0 + gl.arange(0, STREAM_K_REQUESTS, layout=layout)
    seq_len = gl.maximum(gl.load(seq_lens_ptr + index, mask=index < batch, other=0).to(gl.int32), 0)
    steps = (gl.minimum(seq_len, table_keys) + STEP_KEYS - 1) // STEP_KEYS
    return index, seq_len, steps, before + gl.associative_scan(steps, 0, _add)


@gluon.jit
def _stream_k_rank_start(r, launched, RANKS: gl.constexpr):
    """The first of a KV head's ``launched`` places in rank ``r``: ``ceil(r * launched / RANKS)`` (place ``p`` is in
    rank ``p * RANKS // launched``)."""
    return (r * launched + RANKS - 1) // RANKS


@gluon.jit
def _stream_k_weight_before(q, launched, tilt, RANKS: gl.constexpr):
    """The summed weights of a KV head's places ``0 .. q - 1`` (int64): a place of rank ``r`` (0 the oldest programs
    on their warp schedulers) weighs ``100 + tilt * (RANKS - 1 - r)``."""
    weight = q.to(gl.int64) * 100
    for r in gl.static_range(RANKS - 1):  # the youngest rank adds nothing to 100
        lo = _stream_k_rank_start(r, launched, RANKS)
        hi = _stream_k_rank_start(r + 1, launched, RANKS)
        weight += (tilt * (RANKS - 1 - r)) * gl.minimum(gl.maximum(q - lo, 0), hi - lo).to(gl.int64)
    return weight


@gluon.jit
def _stream_k_bound(q, total, programs, launched, tilt, RANKS: gl.constexpr):
    """The first step of place ``q`` (``0 <= q <= programs``; ``total`` at ``programs``): the steps divided in
    proportion to the places' weights."""
    if RANKS == 1:
        return ((q.to(gl.int64) * total) // programs).to(gl.int32)
    return (_stream_k_weight_before(q, launched, tilt, RANKS) * total
            // _stream_k_weight_before(programs, launched, tilt, RANKS)).to(gl.int32)  # fmt: skip


@gluon.jit
def _stream_k_owner(x, total, programs, launched, tilt, RANKS: gl.constexpr):
    """The place (of a KV head's ``programs``) whose steps hold step ``x`` (``0 <= x < total``): the last place ``q``
    whose first step is at most ``x``, that is whose weights before it are at most ``K = ((x + 1) W - 1) // total``;
    within a rank the weights before a place grow by the rank's weight a place."""
    if RANKS == 1:
        return (((x.to(gl.int64) + 1) * programs - 1) // total).to(gl.int32)
    most = ((x.to(gl.int64) + 1) * _stream_k_weight_before(programs, launched, tilt, RANKS) - 1) // total
    owner = (most // (100 + tilt * (RANKS - 1))).to(gl.int32)  # in rank 0
    for r in gl.static_range(1, RANKS):
        first = _stream_k_rank_start(r, launched, RANKS)
        before = _stream_k_weight_before(first, launched, tilt, RANKS)
        owner = gl.where(before <= most, first + ((most - before) // (100 + tilt * (RANKS - 1 - r))).to(gl.int32),
                         owner)  # fmt: skip
    return owner


@gluon.jit
def _stream_k_claim(partials_ptr, query_slot, stride_pb, stride_ph, stride_ps, num_heads, launched,
                    NUM_KV_HEADS: gl.constexpr, RANKS: gl.constexpr):  # fmt: skip
    """This program's ``(KV head, place)``. With one rank, from its id. With ``RANKS``, it takes a place of its
    rank on its warp scheduler (its warp slot on the SM divided by 4: programs arrive in slot order, and the
    scheduler issues the older warps first): one int32 count a rank, in the LSE column of the rotated query's slot
    of (request, head) ``r // H, r % H``, which the rotation zeroes on every call, hands out that rank's places
    one each (``HKV`` a place). A full rank sends the program on to the next: every program gets one place
    whatever the warps' placement (all ranks full would mean more programs than places); only its speed depends on
    the placement."""
    pid = gl.program_id(0)
    if RANKS == 1:
        return pid % NUM_KV_HEADS, pid // NUM_KV_HEADS
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    slot = gl.inline_asm_elementwise("mov.u32 $0, %warpid;", "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    rank = gl.minimum(gl.max(slot, axis=0) // 4, RANKS - 1)
    kv_head = pid * 0
    place = -1
    for step in gl.static_range(RANKS):
        if place < 0:
            r = (rank + step) % RANKS
            count = (partials_ptr + (r // num_heads).to(gl.int64) * stride_pb + (r % num_heads) * stride_ph
                     + query_slot * stride_ps + HEAD_DIM).to(gl.pointer_type(gl.int32), bitcast=True)  # fmt: skip
            taken = gl.atomic_add(count + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0,
                                  sem="relaxed", scope="gpu")  # fmt: skip
            index = gl.max(gl.where(lane == 0, taken, -1), axis=0)
            first = _stream_k_rank_start(r, launched, RANKS)
            size = _stream_k_rank_start(r + 1, launched, RANKS) - first
            if index < size * NUM_KV_HEADS:
                kv_head = index % NUM_KV_HEADS
                place = first + index // NUM_KV_HEADS
    return kv_head, place


@gluon.jit
def _stream_k_locate(seq_lens_ptr, batch, table_keys, pos, STEP_KEYS: gl.constexpr):
    """The request holding step ``pos`` (one there is): ``(b, its first step, its steps, its length)``. The first
    request whose steps end past ``pos`` has some."""
    b = 0
    first = 0
    n = 1
    seq_len = 0
    found = False
    before = 0
    for b0 in range(0, batch, STREAM_K_REQUESTS):
        index, lens, steps, ends = _stream_k_steps(seq_lens_ptr, batch, table_keys, b0, before, STEP_KEYS)
        hit = gl.min(gl.where((ends > pos) & (index < batch), index, batch), axis=0)
        mine = index == hit
        take = (not found) & (hit < batch)
        b = gl.where(take, hit, b)
        first = gl.where(take, gl.sum(gl.where(mine, ends - steps, 0), axis=0), first)
        n = gl.where(take, gl.sum(gl.where(mine, steps, 0), axis=0), n)
        seq_len = gl.where(take, gl.sum(gl.where(mine, lens, 0), axis=0), seq_len)
        found = found | take
        before += gl.sum(steps, axis=0)
    return b, first, n, seq_len


@gluon.jit
def _empty_slots(partials_ptr, b, kv_head, first, num_splits, lse, stride_pb, stride_ph, stride_ps,
                 KV_GROUP: gl.constexpr, BLOCK_H: gl.constexpr):  # fmt: skip
    """LSE ``lse`` (-inf: no keys; NaN: poisoned) in slots ``first ..`` below ``num_splits`` of request ``b``'s heads of
    KV head ``kv_head``, the merge's signal to skip them (or to return NaN)."""
    ROWS: gl.constexpr = 32 // BLOCK_H
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [ROWS, BLOCK_H], [1, 1], [1, 0])
    slot = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, layout))
    base = partials_ptr + b.to(gl.int64) * stride_pb + (kv_head * KV_GROUP + h) * stride_ph + HEAD_DIM
    for s0 in range(0, gl.maximum(num_splits - first, 0), ROWS):
        at = slot[:, None] + s0
        gl.store(base[None, :] + at * stride_ps, gl.full([ROWS, BLOCK_H], lse, gl.float32, layout),
                 mask=(at < num_splits) & (h < KV_GROUP)[None, :])  # fmt: skip


@gluon.jit
def decode_stage1_stream_k_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, centroid_ptr, partials_ptr, pit_ptr, data_desc, value_desc,
    meta_desc,
    sm_scale, num_splits, num_blocks, table_keys, query_slot, stride_block,
    stride_qb, stride_qh, stride_bt, stride_btc, stride_pb, stride_ph, stride_ps, batch,
    KV_GROUP: gl.constexpr,
    KEY_BITS: gl.constexpr,  # 3 or 4 (MSE codes) or 8 (FP8 keys)
    KEY_DATA_BYTES: gl.constexpr,
    VALUE_BITS: gl.constexpr,  # 3 or 4
    SLOT_BYTES: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    STAGES: gl.constexpr = 3,
    FP16_OPERANDS: gl.constexpr = 1,
    STEP: gl.constexpr = 1,
    RANKS: gl.constexpr = 1,
    TILT: gl.constexpr = 0,
    HADAMARD_QUERY: gl.constexpr = 0,  # as decode_stage1_warp_kernel's
    SHARED_PAIRS: gl.constexpr = 0,  # as decode_stage1_warp_kernel's
):  # fmt: skip
    """:func:`decode_stage1_warp_kernel`'s partials by stream-K (the section above): grid ``(P,)``, ``P`` a multiple
    of ``HKV``, one warp a program, ``num_splits`` (at least 2) partial slots a (request, KV head). With ``RANKS``
    above 1 the programs take their places by their rank on their warp scheduler (:func:`_stream_k_claim`), and a
    place of rank ``r`` gets ``100 + TILT * (RANKS - 1 - r)`` parts of the steps to the youngest rank's 100, where
    every place still gets the fewest steps that keep a request within its slots (else the even division)."""
    gl.static_assert(gl.num_warps() == 1)
    gl.static_assert((VALUE_BITS == 3) or (VALUE_BITS == 4))
    gl.static_assert(FP16_OPERANDS == 1)
    # The counts need the rotation launch (MSE keys) to zero them.
    gl.static_assert((RANKS == 1) or ((KEY_BITS != 8) and not HADAMARD_QUERY))
    NUM_FIELDS: gl.constexpr = 2 if KEY_BITS == 8 else 3
    STEP_KEYS: gl.constexpr = 16 * STEP
    pid = gl.program_id(0)
    launched = gl.num_programs(0) // NUM_KV_HEADS
    kv_head, mine = _stream_k_claim(partials_ptr, query_slot, stride_pb, stride_ph, stride_ps,
                                    NUM_KV_HEADS * KV_GROUP, launched, NUM_KV_HEADS, RANKS)  # fmt: skip
    # The steps of a KV head, and the most of one request.
    total = 0
    longest = 0
    for b0 in range(0, batch, STREAM_K_REQUESTS):
        _, _, steps, ends = _stream_k_steps(seq_lens_ptr, batch, table_keys, b0, 0, STEP_KEYS)
        total += gl.max(ends, axis=0)
        longest = gl.maximum(longest, gl.max(steps, axis=0))
    least = gl.maximum(gl.cdiv(longest, num_splits - 1), 1)  # a program's fewest steps: S pieces at most
    programs = gl.maximum(gl.minimum(launched, total // least), 1)
    # The ranks weighed where every place still gets at least `least` steps (the lightest gets 100 / heaviest of the
    # mean; a batch of even lengths); else (a long request among short ones) the even division.
    tilt = gl.where((total * 100) // (least * (100 + TILT * (RANKS - 1))) >= launched, TILT, 0)
    # The requests without keys: every slot of theirs empty (NaN if too long for the table), request b by program b % P.
    for b in range(pid, batch, gl.num_programs(0)):
        seq_len = gl.maximum(gl.load(seq_lens_ptr + b).to(gl.int32), 0)
        if gl.minimum(seq_len, table_keys) == 0:
            for head in range(NUM_KV_HEADS):
                _empty_slots(partials_ptr, b, head, 0, num_splits,
                             gl.where(seq_len > table_keys, float("nan"), float("-inf")), stride_pb, stride_ph,
                             stride_ps, KV_GROUP, BLOCK_H)  # fmt: skip
    if mine < programs:
        data, values, meta, full = _chunk_ring(STAGES, data_desc, value_desc, meta_desc, KEY_DATA_BYTES, SLOT_BYTES,
                                               VALUE_BITS)  # fmt: skip
        pair_lut = _centroid_tables(centroid_ptr, KEY_BITS, SHARED_PAIRS)
        shape: gl.constexpr = (KV_GROUP, KEY_BITS, KEY_DATA_BYTES, SLOT_BYTES, NUM_FIELDS, BLOCK_SIZE, BLOCK_H, STAGES,
                               1, VALUE_BITS, NUM_KV_HEADS, STEP, HADAMARD_QUERY, SHARED_PAIRS)  # fmt: skip
        hi = _stream_k_bound(mine + 1, total, programs, launched, tilt, RANKS)
        pos = _stream_k_bound(mine, total, programs, launched, tilt, RANKS)
        while pos < hi:  # a piece: the steps from pos in one request
            b, first, n, seq_len = _stream_k_locate(seq_lens_ptr, batch, table_keys, pos, STEP_KEYS)
            piece_end = gl.minimum(hi, first + n)
            owner = _stream_k_owner(first, total, programs, launched, tilt, RANKS)
            # Its last piece empties the slots past the request's pieces.
            empty_from = gl.where(piece_end == first + n,
                                  _stream_k_owner(first + n - 1, total, programs, launched, tilt, RANKS) - owner + 1,
                                  num_splits)  # fmt: skip
            # (The last step may reach past the request's keys, and its blocks past the request's: cut first.)
            start, end, row_ptr, too_long, bad_pages, first_page, last_page = _key_range(
                block_table_ptr, b, (pos - first) * STEP_KEYS, gl.minimum((piece_end - first) * STEP_KEYS, seq_len),
                seq_len, num_blocks, table_keys, stride_bt, stride_btc, BLOCK_SIZE)  # fmt: skip
            # The block-table check before the loop: four registers a thread fewer held through it.
            poisoned = _poisoned(too_long, bad_pages, row_ptr, stride_btc, first_page, last_page, num_blocks)
            split = (row_ptr, stride_btc, num_blocks, start, start, end, sm_scale, query_slot, b, kv_head)
            acc, m_i, l_i, z_i = _chunks(0, (data, values, meta, full), (data_desc, value_desc, meta_desc),
                                         (q_ptr, partials_ptr, centroid_ptr, cache_ptr, pit_ptr), split,
                                         (stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_block),
                                         pair_lut, shape)  # fmt: skip
            # Every copy of the piece has landed and been read: the next piece starts the ring at its first phase (a
            # ring carried across pieces took 6 more instructions an iteration, 4-bit keys, Triton 3.6).
            for st in gl.static_range(STAGES):
                mbarrier.invalidate(full.index(st))
                mbarrier.init(full.index(st), count=1)
            fence_async_shared()
            _store_partials(acc, m_i, l_i, z_i, start, end, poisoned, partials_ptr, stride_pb, stride_ph, stride_ps, b,
                            kv_head, mine - owner, KV_GROUP, VALUE_BITS, VALUE_BITS == 3)  # fmt: skip
            _empty_slots(partials_ptr, b, kv_head, empty_from, num_splits, float("-inf"), stride_pb, stride_ph,
                         stride_ps, KV_GROUP, BLOCK_H)  # fmt: skip
            pos = piece_end


# ----------------------------------------------------------------------------------------------
# Store: bf16 keys to 3- or 4-bit MSE codes, the rotation on warpgroup MMAs.
# ----------------------------------------------------------------------------------------------

STORE_WARP_ROWS = 16  # (token, KV head) rows per warp and tile: a warpgroup MMA's M is 64
_KEY_NORM_EPS = gl.constexpr(1e-8)
_NORM_CORRECTION_EPS = gl.constexpr(1e-16)
_MIN_VALUE_SCALE = gl.constexpr(1e-8)
_ROUND_MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2^23: x + it has x rounded to an integer in its low mantissa bits
_FP16_MAX = gl.constexpr(65504.0)


def store_supports(*, device: torch.device, key_dtype: torch.dtype, head_dim: int, key_bits: int, num_rows: int,
                   stride_block: int, slot_bytes: int) -> bool:  # fmt: skip
    """Whether a store call is one :func:`store_kernel` serves (else the portable kernel runs): bf16 keys, D = 128,
    3- or 4-bit MSE codes, 16-byte aligned slots, compiled for compute capability 9.x."""
    served = key_dtype == torch.bfloat16 and head_dim == HEAD_DIM and key_bits in (3, 4) and num_rows < 2**31
    aligned = stride_block % 16 == 0 and slot_bytes % 16 == 0
    return served and aligned and _hopper(device)


# PiT tensors checked for the Sylvester-Hadamard rotation (:func:`is_hadamard_rotation`): id -> (in-place version,
# answer); an entry leaves with its tensor (``weakref.finalize``), before its id can name another.
_HADAMARD_CHECKED: dict[int, tuple[int, bool]] = {}


def is_hadamard_rotation(PiT: torch.Tensor) -> bool:
    """Whether ``PiT`` is ``c H_D`` (``c = PiT[0, 0]`` positive and finite, ``H_D[j, n] = (-1)^popcount(j & n)``),
    the rotation :func:`store_hadamard_kernel` serves: ``golden.turboquant.hadamard_rotation(D)`` without a seed,
    what vLLM serves. Decided on ``PiT``'s device once per tensor and in-place version, and read back then (one host
    sync on the first call with a ``PiT``, as a serving engine makes before it captures graphs); during a CUDA graph
    capture an unknown ``PiT`` answers False (the general kernel), since nothing may be read back there."""
    known = _HADAMARD_CHECKED.get(id(PiT))
    if known is not None and known[0] == PiT._version:
        return known[1]
    if PiT.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    j = torch.arange(PiT.shape[0], device=PiT.device)
    parity = j[:, None] & j[None, :]
    for shift in (16, 8, 4, 2, 1):
        parity = parity ^ (parity >> shift)
    c = PiT[0, 0]
    answer = bool(((PiT == torch.where(parity & 1 == 1, -c, c)).all() & (c > 0) & (c < float("inf"))).item())
    if known is None:
        weakref.finalize(PiT, _HADAMARD_CHECKED.pop, id(PiT), None)
    _HADAMARD_CHECKED[id(PiT)] = (PiT._version, answer)
    return answer


@gluon.jit
def _rotation_dim(k):
    """The key dimension the rotation's A operand holds at K index ``k``: thread ``t`` of a quad holds K indices
    ``16c + 8h + 2t + e``; they are dimensions ``32 (c >> 1) + 8t + 4 (c & 1) + 2h + e``, so for each pair of
    chunks a quad's four threads read 64 contiguous bytes of the row, 16 each."""
    c = k >> 4
    return (c >> 1) * 32 + ((k >> 1) & 3) * 8 + (c & 1) * 4 + ((k >> 3) & 1) * 2 + (k & 1)


@gluon.jit
def _code_dim(n):
    """The rotated dimension the rotation's accumulator holds in column ``n``: thread ``t`` of a quad holds
    columns ``8b + 2t + e``; they are dimensions ``32t + 2b + e``, so a thread's 32 codes are contiguous."""
    return ((n >> 1) & 3) * 32 + (n >> 3) * 2 + (n & 1)


# L2 eviction hints of the stores: keys and values are read once and each slot's data is written whole by one tile, so
# both leave L2 first (STORE_STREAM_EVICTION); a slot's fp16 fields are 2 bytes of a 32-byte sector the other 15
# positions of its block fill, in a decode step's order at other times, so they stay (STORE_FIELDS_EVICTION): a sector
# evicted before it is whole costs DRAM a read of it as well as the write. On the H200 (1M tokens x 8 KV heads at
# random slots) -6 to -8% (perf_log.md, thirty-fourth session). Written with triton.language constants, so that the
# bench's scatter baseline (triton_impl.parity.turboquant.scatter_slots) takes the same hints.
STORE_STREAM_EVICTION = tl.constexpr("evict_first")
STORE_FIELDS_EVICTION = tl.constexpr("evict_last")


@gluon.jit
def _slots(slot_ptr, row, num_rows, NUM_KV_HEADS: gl.constexpr):
    """The slot of each (token, KV head) row ``row`` (-1 past ``num_rows``: nothing to write)."""
    return gl.load(slot_ptr + row // NUM_KV_HEADS, mask=row < num_rows, other=-1)


@gluon.jit
def _slot_offsets(slot, row, num_slots, stride_block, NUM_KV_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                  SLOT_BYTES: gl.constexpr, WIDE_SLOTS: gl.constexpr):  # fmt: skip
    """``(ok, data, meta)`` for rows ``row`` with slots ``slot``: whether the slot lies in the cache (padding and
    bad slots write nothing) and the byte offsets of its data and of its metadata field 0 (slot 0's for a bad
    slot, never used)."""
    ok = (slot >= 0) & (slot < num_slots)
    slot = gl.where(ok, slot, 0)
    if not WIDE_SLOTS:
        slot = slot.to(gl.uint32)  # 0 <= slot < 2^31: unsigned 32-bit division
    block = slot // BLOCK_SIZE
    position = (slot - block * BLOCK_SIZE).to(gl.int32)
    head = row % NUM_KV_HEADS
    base = block.to(gl.int64) * stride_block
    data = base + (position * NUM_KV_HEADS + head) * SLOT_BYTES
    META_FIELDS: gl.constexpr = 3  # key norm, value scale, value zero (fp16 each), field-major per KV head
    meta = base + BLOCK_SIZE * NUM_KV_HEADS * SLOT_BYTES + (head * (META_FIELDS * BLOCK_SIZE) + position) * 2
    return ok, data, meta


# A prefetch into L2 of the 128-byte line holding address ``$1``, none where ``$2`` is 0: a hint that holds no register
# and no shared memory and changes no value. (The bulk form, ``cp.async.bulk.prefetch.L2``, takes its address in
# uniform registers: from per-thread addresses ptxas builds a loop over the warp's distinct values, 32 trips.)
L2_PREFETCH_ASM = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")


@gluon.jit
def _prefetch_tile(key_ptr, value_ptr, tile, num_rows, stride_kt, stride_kh, stride_vt, stride_vh,
                   NUM_KV_HEADS: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Tile ``tile``'s key and value rows (:func:`_tile_rows`) prefetched into L2, a row a thread (the first ``16
    WARPS`` threads a key row each, the others a value row), a line at a time; nothing past ``num_rows``."""
    ROWS: gl.constexpr = 16 * WARPS
    KEY_LINES: gl.constexpr = HEAD_DIM * key_ptr.dtype.element_ty.primitive_bitwidth // 1024
    VALUE_LINES: gl.constexpr = HEAD_DIM * value_ptr.dtype.element_ty.primitive_bitwidth // 1024
    i = gl.arange(0, 2 * ROWS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    is_value = i >= ROWS
    row = tile * ROWS + gl.where(is_value, i - ROWS, i)
    key_row = _row_start(key_ptr, row, stride_kt, stride_kh, NUM_KV_HEADS).to(gl.pointer_type(gl.uint8))
    value_row = _row_start(value_ptr, row, stride_vt, stride_vh, NUM_KV_HEADS).to(gl.pointer_type(gl.uint8))
    at = gl.where(is_value, value_row, key_row)
    lines = gl.where(row < num_rows, gl.where(is_value, VALUE_LINES, KEY_LINES), 0)
    for line in gl.static_range(max(KEY_LINES, VALUE_LINES)):
        gl.inline_asm_elementwise(L2_PREFETCH_ASM, "=r,l,r", [at + 128 * line, (line < lines).to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _row_start(ptr, row, stride_t, stride_h, NUM_KV_HEADS: gl.constexpr):
    """The first element of each (token, KV head) row ``row`` of ``ptr``: token ``row // HKV``, KV head ``row %
    HKV``."""
    token = row // NUM_KV_HEADS
    head = row - token * NUM_KV_HEADS
    return ptr + token.to(gl.int64) * stride_t + head * stride_h


@gluon.jit
def _row_loads(ptr, row, num_rows, dim, stride_t, stride_h, NUM_KV_HEADS: gl.constexpr):
    """``ptr``'s elements ``dim`` of rows ``row`` (:func:`_row_start`); 0 past the rows. Read once: first out of L2
    (:data:`STORE_STREAM_EVICTION`)."""
    return gl.load(_row_start(ptr, row, stride_t, stride_h, NUM_KV_HEADS) + dim, mask=row < num_rows, other=0.0,
                   eviction_policy=STORE_STREAM_EVICTION)


@gluon.constexpr_function
def _pairs_shape(shape):
    """``[..., 4]`` -> ``[..., 2, 2]``."""
    return [*shape[:-1], 2, 2]


@gluon.constexpr_function
def _groups_shape(shape):
    """``[..., 32]`` -> ``[..., 4, 8]``."""
    return [*shape[:-1], 4, 8]


@gluon.jit
def _store_codes(cache_ptr, at, groups, ok, BITS: gl.constexpr):
    """Write ``groups [..., 4]`` (group ``q`` of 8 ``BITS``-bit codes, LSB first) as the thread's ``4 BITS``
    bytes at byte offset ``at`` where ``ok`` (both ``[..., 1]``, in the layout of ``groups``): 4-bit groups are
    whole words (one 16-byte store); 3-bit groups of 24 bits are stitched into three words."""
    if BITS == 4:
        RANK: gl.constexpr = len(groups.shape)
        LAYOUT: gl.constexpr = groups.type.layout
        q = _iota(4, RANK - 1, RANK, LAYOUT)  # a word pointer plus q, not a byte pointer plus 4 q: one 16-byte store
        gl.store((cache_ptr + at).to(gl.pointer_type(gl.uint32)) + q, groups, mask=ok,
                 eviction_policy=STORE_STREAM_EVICTION)
    else:
        even, odd = gl.split(gl.reshape(groups, _pairs_shape(groups.shape)))  # q = 2a + b: [..., a] each
        g0, g2 = gl.split(even)
        g1, g3 = gl.split(odd)
        LAYOUT3: gl.constexpr = g0.type.layout
        at = gl.convert_layout(gl.reshape(at, g0.shape), LAYOUT3)
        ok = gl.convert_layout(gl.reshape(ok, g0.shape), LAYOUT3)
        words = (cache_ptr + at).to(gl.pointer_type(gl.uint32))
        gl.store(words, g0 | (g1 << 24), mask=ok, eviction_policy=STORE_STREAM_EVICTION)
        gl.store(words + 1, (g1 >> 8) | (g2 << 16), mask=ok, eviction_policy=STORE_STREAM_EVICTION)
        gl.store(words + 2, (g2 >> 16) | (g3 << 8), mask=ok, eviction_policy=STORE_STREAM_EVICTION)


# Bucketize by a uniform grid, shared by this store and the portable one (``turboquant._store_kernel``): written
# with triton.language ops, which Gluon compiles too (the caller gives the table's index tensor its layout). 32 slots:
# a warp holds the table with an entry a lane, so the Hadamard store looks a code up by a warp shuffle.
GRID_SLOTS = tl.constexpr(32)  # table entries: 31 grid cells, and slot 31 for NaN and everything below the grid
GRID_SPAN = tl.constexpr(28.0)  # cells from the first midpoint (cell 1) to the last (cell 29)


@triton.jit
def grid_slot(y, scale, offset):
    """The table slot of each fp32 ``y``: ``min(bits(min(fma(y, scale, offset), 30 u)), 31)`` (unsigned), with
    ``u = 2^-149`` the least subnormal and ``scale``, ``offset`` multiples of it (:func:`grid_table`).

    The fma rounds once, to a multiple of ``u`` whose bit pattern is that integer, ``round(y S + C)`` (``S =
    scale / u``, ``C = offset / u``; to nearest even): slots ``0 .. 30`` are the grid's cells, clamped above by a
    float min that keeps NaN. A result with the sign bit set (negative, or -0) and NaN have bits above 31: slot
    31. In the order ``31 < 0 < 1 < .. < 30`` the slot is a nondecreasing function of ``y``'s value (``offset``
    is never -0, so -0 and +0 share a slot). Subnormals must not be flushed: ``fma.rn.f32`` and ``min.NaN.f32``
    have no ``.ftz`` in the PTX Triton emits."""
    top = tl.cast(GRID_SLOTS - 2, tl.uint32).to(tl.float32, bitcast=True)  # 30 u
    t = tl.minimum(tl.fma(y, scale, offset), top, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(t.to(tl.uint32, bitcast=True), GRID_SLOTS - 1).to(tl.int32)


@triton.jit
def saturated_grid_slot(y, scale, offset):
    """:func:`grid_slot` in two instructions (the Hadamard store's, and the MMA store's for 3-bit keys; inline PTX, so
    not under the interpreter): the fma saturated (``fma.rn.sat.f32``: a negative result and NaN become +0), then the
    float min with ``30 u``. A ``y`` that :func:`grid_slot` puts in slot 31 lands in slot 0 instead, and both slots
    give it code 0 from the same table (:func:`grid_table`): nothing is below slot 0, and such a ``y`` is below any
    midpoint there (the fma is monotone and a midpoint's is never negative) or NaN, which compares false."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; fma.rn.sat.f32 t, $1, $2, $3; min.f32 $0, t, 0f0000001E; }", "=r,f,f,f", [y, scale, offset],
        dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def grid_table(midpoint_ptr, slot, BITS: tl.constexpr):
    """The grid's table for the ``2^BITS - 1`` ascending midpoints ``m``: ``(table, scale, offset, ok)``; ``slot``
    is ``0 .. 31`` (any layout: the table's).

    ``scale = 28 / (m_last - m_0)`` and ``offset = 1 - m_0 scale``, in units of ``u`` and rounded
    (:func:`grid_slot`): ``y``'s cell is ``round(1 + 28 (y - m_0) / (m_last - m_0))`` up to that rounding, so
    ``m_0`` is in cell 0, 1 or 2 and no midpoint is in slot 31. Entry ``k`` packs ``below_k = #{m : slot(m) <
    k}`` (high word; 0 for slot 31) and ``mid_k``, the midpoint in slot ``k`` (NaN if none), and
    :func:`grid_code` gives ``#{m : m <= y} = below_k + (y >= mid_k)`` for ``k = slot(y)``, exactly for every fp32
    ``y``: the midpoints get their slots from the same nondecreasing :func:`grid_slot`, so a midpoint in an
    earlier slot than ``y``'s is below ``y`` and one in a later slot above it; only the one sharing ``y``'s slot
    is in doubt, and it is compared. NaN ``y`` is in slot 31: ``below = 0`` and the compare is false, code 0.
    ``ok``: the scale is positive and finite and the midpoints' slots increase strictly from below 31 (no two
    share one, none is NaN or in slot 31); else the caller takes the binary search. The 4-bit Lloyd-Max
    midpoints' closest pair is 1/19 of their span apart, 1.5 cells."""
    NUM: tl.constexpr = (1 << BITS) - 1
    m_first = tl.load(midpoint_ptr)
    unit = tl.cast(1, tl.uint32).to(tl.float32, bitcast=True)  # u = 2^-149
    scale = (GRID_SPAN / (tl.load(midpoint_ptr + NUM - 1) - m_first)) * unit
    offset = -m_first * scale + unit
    offset = tl.where(offset == 0, 0.0, offset)  # +0, never -0 (a fused multiply-add could round to -0)
    ok = (scale > 0) & (scale < float("inf"))
    limit = tl.where(slot == GRID_SLOTS - 1, 0, slot)  # slot 31 comes first: no midpoint is before it
    below = slot * 0
    mid = tl.where(slot < 0, 0.0, float("nan"))
    previous = GRID_SLOTS - 1  # m_0 must not be in slot 31 either
    for j in tl.static_range(NUM):
        m = tl.load(midpoint_ptr + j)
        m_slot = grid_slot(m, scale, offset)
        below += (m_slot < limit).to(tl.int32)
        mid = tl.where(m_slot == slot, m, mid)
        if j == 0:
            ok = ok & (m_slot < previous)
        else:
            ok = ok & (m_slot > previous)
        previous = m_slot
    table = (below.to(tl.int64) << 32) | mid.to(tl.uint32, bitcast=True).to(tl.int64)
    return table, scale, offset, ok


@triton.jit
def grid_split(entry):
    """``(below, mid)`` of table entries (:func:`grid_table`): int32 and fp32."""
    return (entry >> 32).to(tl.int32), (entry & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def grid_code(y, entry):
    """``below + (y >= mid)`` from ``y``'s table entry (:func:`grid_table`)."""
    below, mid = grid_split(entry)
    return below + (y >= mid).to(tl.int32)


@gluon.jit
def _bucketize(y, midpoint_ptr, BITS: gl.constexpr):
    """``#{m : midpoint_m <= y}`` by binary search over the sorted midpoints, as the portable store's
    ``turboquant._bucketize`` (NaN gets code 0)."""
    m = midpoint_ptr
    if BITS == 3:
        b4 = y >= gl.load(m + 3)
        b2 = y >= gl.where(b4, gl.load(m + 5), gl.load(m + 1))
        b1 = y >= gl.where(b4, gl.where(b2, gl.load(m + 6), gl.load(m + 4)), gl.where(b2, gl.load(m + 2), gl.load(m)))
        return b4.to(gl.int32) * 4 + b2.to(gl.int32) * 2 + b1.to(gl.int32)
    else:
        b8 = y >= gl.load(m + 7)
        b4 = y >= gl.where(b8, gl.load(m + 11), gl.load(m + 3))
        b2 = y >= gl.where(b8, gl.where(b4, gl.load(m + 13), gl.load(m + 9)),
                           gl.where(b4, gl.load(m + 5), gl.load(m + 1)))  # fmt: skip
        t8 = gl.where(b4, gl.where(b2, gl.load(m + 14), gl.load(m + 12)), gl.where(b2, gl.load(m + 10), gl.load(m + 8)))
        t0 = gl.where(b4, gl.where(b2, gl.load(m + 6), gl.load(m + 4)), gl.where(b2, gl.load(m + 2), gl.load(m)))
        b1 = y >= gl.where(b8, t8, t0)
        return b8.to(gl.int32) * 8 + b4.to(gl.int32) * 4 + b2.to(gl.int32) * 2 + b1.to(gl.int32)


@gluon.jit
def _fp16_bits(x):
    """fp32 -> fp16 (round to nearest even) clamped to +-65504, as the uint16 to store; NaN stays NaN."""
    x = gl.where(x == x, gl.minimum(gl.maximum(x, -_FP16_MAX), _FP16_MAX), x)
    return x.to(gl.float16).to(gl.uint16, bitcast=True)


@gluon.constexpr_function
def _value_layout(warps):
    """Values ``[warp, half, quad, t, i]``: row ``16 warp + 8 half + quad``, dimension ``32t + i`` (each thread
    owns 32 contiguous dimensions of two rows)."""
    return gl.BlockedLayout([1, 2, 1, 1, 32], [1, 1, 8, 4, 1], [int(warps), 1, 1, 1, 1], [4, 3, 2, 1, 0])


@gluon.jit
def _tile_rows(tile, RANK: gl.constexpr, LAYOUT: gl.constexpr, WARPS: gl.constexpr):
    """Rows ``16 WARPS tile + 16 warp + 8 half + quad`` along dims 0-2 of a rank-``RANK`` tensor in ``LAYOUT``."""
    return tile * (16 * WARPS) + _iota(WARPS, 0, RANK, LAYOUT) * 16 + _iota(2, 1, RANK, LAYOUT) * 8 + \
        _iota(8, 2, RANK, LAYOUT)


@gluon.jit
def _store_values(v, slot, row, cache_ptr, num_slots, stride_block, NUM_KV_HEADS: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, SLOT_BYTES: gl.constexpr, KEY_DATA_BYTES: gl.constexpr,
                  VALUE_BITS: gl.constexpr, WIDE_SLOTS: gl.constexpr, key_words=0, KEY_BITS: gl.constexpr = 0,
                  key_norm=0):  # fmt: skip
    """One tile's values ``v`` (``[..., 4, 32]``, dimension ``32 t + i`` of the row the leading dims name; each
    thread owns 32 contiguous dimensions of a row: :func:`_value_layout`, :func:`_quad_layout`) min-max quantized as
    the portable store does it, into slots ``slot`` of rows ``row`` (both ``[..., 1, 1]``). ``v`` is fp32, or bf16
    as loaded: then each row's min and max start on packed pairs (:func:`_bf16x2`), which pick the same values.
    With ``KEY_BITS``, the rows' key codes ``key_words`` (``[..., 4, 4]``: thread ``t``'s groups of 8 codes, in the
    layout of the value codes' groups) and key norms ``key_norm`` (the layout of the value fields) are written in the
    same place, each row's code stores back to back and its three fields likewise (:func:`_store_quad_tiles` says
    why)."""
    RANK: gl.constexpr = len(v.shape)
    layout: gl.constexpr = v.type.layout
    t = _iota(4, RANK - 2, RANK, layout)
    ok, data, meta = _slot_offsets(slot, row, num_slots, stride_block, NUM_KV_HEADS, BLOCK_SIZE, SLOT_BYTES,
                                   WIDE_SLOTS)  # fmt: skip
    LEVELS: gl.constexpr = (1 << VALUE_BITS) - 1
    if v.dtype == gl.bfloat16:
        # Each thread's 32 values halved four times by packed bf16 min and max (two values an instruction; exact), the
        # last pair and the row's four threads in fp32.
        v_lo = v
        v_hi = v
        for _ in gl.static_range(4):
            a, b = _split_in_half(v_lo)
            v_lo = _bf16x2(a, b, "min")
            a, b = _split_in_half(v_hi)
            v_hi = _bf16x2(a, b, "max")
        rows: gl.constexpr = gl.SliceLayout(RANK - 2, gl.SliceLayout(RANK - 1, layout))  # (no data moves)
        v_min = gl.convert_layout(gl.min(gl.min(v_lo.to(gl.float32), axis=RANK - 1), axis=RANK - 2), rows)
        v_max = gl.convert_layout(gl.max(gl.max(v_hi.to(gl.float32), axis=RANK - 1), axis=RANK - 2), rows)
        v = v.to(gl.float32)
    else:
        v_min = gl.min(gl.min(v, axis=RANK - 1), axis=RANK - 2)
        v_max = gl.max(gl.max(v, axis=RANK - 1), axis=RANK - 2)
    v_min = gl.minimum(gl.maximum(v_min, -_FP16_MAX), _FP16_MAX)
    v_max = gl.minimum(gl.maximum(v_max, -_FP16_MAX), _FP16_MAX)
    scale = gl.maximum((v_max - v_min) / LEVELS, _MIN_VALUE_SCALE)
    # A value's level is (v - v_min) / scale, LEVELS times its share of the row's range (v_max - v_min, or LEVELS
    # times the least scale): that share taken by one saturating product (:func:`_saturated_product`) is the clamp of
    # the value to [v_min, v_max], NaN to v_min, at no instruction; one fma then scales and rounds it. Its rounding
    # (the range, its reciprocal, the difference, the product: 3 u + u_op) is inside the band the store tests allow a
    # value (parity.turboquant.value_tolerance). With the Hadamard store's saturated grid slot (saturated_grid_slot),
    # Triton 3.6: 1242 -> 1214 instructions a tile for 3-bit keys, 1233 -> 1205 for k3v4, 1043 -> 1012 for 4-bit keys;
    # on the H200 (benchmarks/kernel_times.py, us, random / consecutive slots, twice in one call) 3-bit 1719 -> 1694 /
    # 1709 -> 1681, k3v4 1772 -> 1751 / 1702 -> 1670, 4-bit 1802 -> 1797 / 1600 -> 1570 (perf_log.md, fortieth session).
    inv_range = 1.0 / gl.maximum(v_max - v_min, LEVELS * _MIN_VALUE_SCALE)
    lo = gl.expand_dims(gl.expand_dims(v_min, RANK - 2), RANK - 1)
    inv = gl.expand_dims(gl.expand_dims(inv_range, RANK - 2), RANK - 1)
    share = _saturated_product(v - lo, inv)
    biased = (share * LEVELS + _ROUND_MAGIC).to(gl.uint32, bitcast=True)
    groups = gl.reshape(biased, _groups_shape(v.shape))  # [..., t, q, p]: dimension 32t + 8q + p
    glayout: gl.constexpr = groups.type.layout
    shift = (_iota(8, RANK, RANK + 1, glayout) * VALUE_BITS).to(gl.uint32)
    SPREAD: gl.constexpr = 0x11111111 if VALUE_BITS == 4 else 0x249249  # sum_p 2^(BITS p)
    words = gl.sum(groups << shift, axis=RANK) - (0x4B400000 * SPREAD % 2**32)
    words_layout: gl.constexpr = words.type.layout
    at = gl.convert_layout(data + KEY_DATA_BYTES + t * (4 * VALUE_BITS), words_layout)
    data_ok = gl.convert_layout(ok & (t < 4), words_layout)
    if KEY_BITS != 0:
        key_at = gl.convert_layout(data + t * (4 * KEY_BITS), words_layout)
        _store_codes(cache_ptr, key_at, key_words, data_ok, KEY_BITS)
    _store_codes(cache_ptr, at, words, data_ok, VALUE_BITS)
    # Each row's two fields stored from the layout its scale was reduced to (a row's lanes store it once): the rows go
    # to scattered slots, so a layout of one row a thread would buy no coalescing, and its four conversions cost two
    # CTA barriers each. ``ok`` and ``meta`` reduced over their two unit dimensions (no data moves) to that layout.
    fields = (cache_ptr + gl.max(gl.max(meta, axis=RANK - 1), axis=RANK - 2)).to(gl.pointer_type(gl.uint16))
    row_ok = gl.max(gl.max(ok.to(gl.int32), axis=RANK - 1), axis=RANK - 2) != 0
    if KEY_BITS != 0:
        gl.store(fields, _fp16_bits(key_norm), mask=row_ok, eviction_policy=STORE_FIELDS_EVICTION)
    gl.store(fields + BLOCK_SIZE, _fp16_bits(scale), mask=row_ok, eviction_policy=STORE_FIELDS_EVICTION)
    gl.store(fields + 2 * BLOCK_SIZE, _fp16_bits(v_min), mask=row_ok, eviction_policy=STORE_FIELDS_EVICTION)


@gluon.jit
def _saturated_product(a, b):
    """fp32 ``a * b`` rounded once, then clamped to ``[0, 1]``; NaN gives 0 (``mul.rn.sat.f32``: one instruction)."""
    return gl.inline_asm_elementwise("mul.rn.sat.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=gl.float32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.constexpr_function
def _halves_shape(shape):
    """``[..., 2n]`` -> ``[..., 2, n]``."""
    return [*shape[:-1], 2, shape[-1] // 2]


@gluon.jit
def _split_in_half(x):
    """``[a, b, 2n]`` -> its first and second halves along the last dimension, ``[a, b, n]`` each."""
    return gl.split(gl.permute(gl.reshape(x, _halves_shape(x.shape)), (0, 1, 3, 2)))


@gluon.jit
def _bf16x2(a, b, OP: gl.constexpr):
    """Elementwise ``min`` or ``max`` (``OP``) of two bf16 tensors, two elements an instruction (``min.bf16x2``).
    Exact, and like fp32 ``min`` / ``max`` (no ``.NaN``) a NaN loses to a number."""
    return gl.inline_asm_elementwise(f"{OP}.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.bfloat16, is_pure=True,
                                     pack=2)  # fmt: skip


@gluon.jit
def _code_words(codes, BITS: gl.constexpr):
    """Codes ``[ROWS, HEAD_DIM]`` in the rotation's accumulator layout (column ``8b + 2t + e``: dimension ``32t + 2b
    + e``) -> ``[ROWS, t, q]``: thread ``t``'s group ``q`` of 8 codes (dimensions ``32t + 8q ..``), LSB first."""
    ROWS: gl.constexpr = codes.shape[0]
    groups = gl.reshape(codes.to(gl.uint32), [ROWS, HEAD_DIM // 8, 4, 2])  # [row, b, t, e]
    groups = gl.reshape(gl.permute(groups, (0, 2, 1, 3)), [ROWS, 4, 4, 4, 2])  # [row, t, q, b', e]
    LAYOUT: gl.constexpr = groups.type.layout
    shift = (_iota(4, 3, 5, LAYOUT) * 2 + _iota(2, 4, 5, LAYOUT)) * BITS
    return gl.sum(gl.sum(groups << shift.to(gl.uint32), axis=4), axis=3)


@gluon.jit
def store_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, pit_ptr, midpoint_ptr, centroid_ptr,
    num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt, stride_vh, stride_pit,
    NUM_KV_HEADS: gl.constexpr,
    KEY_BITS: gl.constexpr,
    VALUE_BITS: gl.constexpr,
    NORM_CORRECTION: gl.constexpr,
    SLOT_BYTES: gl.constexpr,  # data bytes per (token, KV head) slot
    BLOCK_SIZE: gl.constexpr,
    WIDE_SLOTS: gl.constexpr,  # slot numbers past int32
    WARPS: gl.constexpr = 4,  # warpgroups x 4: tiles of 16 WARPS rows, one PiT a program
    EARLY_VALUES: gl.constexpr = True,  # a tile's values loaded at its start (else where they are quantized)
    PREFETCH: gl.constexpr = False,  # the next tile's rows prefetched into L2
):  # fmt: skip
    """Persistent programs over tiles of ``16 WARPS`` (token, KV head) rows, ``WARPS`` warps (one warpgroup per 64
    rows, all of them reading the program's one copy of ``PiT``: 4 warps and 64 rows by default). Each program cuts
    ``PiT`` once into two bf16 parts in shared memory (rows and columns permuted: :func:`_rotation_dim`,
    :func:`_code_dim`); per tile, ``k @ PiT`` is two warpgroup MMAs on the keys as loaded (bf16, exact), then
    the row's ``1 / (||k|| + eps)``, the bucketize (one lookup in the grid's table per code, :func:`grid_table`,
    or where the grid cannot separate the midpoints the binary search) and the packing of each thread's 32
    contiguous codes; the values as the portable store quantizes them."""
    gl.static_assert(gl.num_warps() == WARPS)
    pit_layout: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [WARPS, 1], [1, 0])
    part_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    # PiT = hi + lo, each rounded to bf16 (to nearest): |PiT - hi - lo| <= 2^-16 |PiT|, and products of bf16 keys
    # with bf16 parts are exact in the MMA's fp32 accumulator.
    pk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, pit_layout))
    pn = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, pit_layout))
    pit = gl.load(pit_ptr + _rotation_dim(pk)[:, None] * stride_pit + _code_dim(pn)[None, :])
    hi = pit.to(gl.bfloat16)
    lo = (pit - hi.to(gl.float32)).to(gl.bfloat16)
    pit_hi = gl.allocate_shared_memory(gl.bfloat16, [HEAD_DIM, HEAD_DIM], part_layout, hi)
    pit_lo = gl.allocate_shared_memory(gl.bfloat16, [HEAD_DIM, HEAD_DIM], part_layout, lo)
    fence_async_shared()
    _barrier()

    # Where the grid cannot separate the midpoints, every tile of the program takes the binary search (a second copy
    # of the tile loop: no branch in it).
    centroid_sq, table, grid_scale, grid_offset, grid_ok = _store_tables(midpoint_ptr, centroid_ptr, KEY_BITS,
                                                                         NORM_CORRECTION, WARPS)  # fmt: skip
    if grid_ok:
        _store_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, pit_hi, pit_lo, centroid_sq, table,
                     grid_scale, grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt,
                     stride_vh, NUM_KV_HEADS, KEY_BITS, VALUE_BITS, NORM_CORRECTION, SLOT_BYTES, BLOCK_SIZE,
                     WIDE_SLOTS, True, WARPS, EARLY_VALUES, PREFETCH)  # fmt: skip
    else:
        _store_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, pit_hi, pit_lo, centroid_sq, table,
                     grid_scale, grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt,
                     stride_vh, NUM_KV_HEADS, KEY_BITS, VALUE_BITS, NORM_CORRECTION, SLOT_BYTES, BLOCK_SIZE,
                     WIDE_SLOTS, False, WARPS, EARLY_VALUES, PREFETCH)  # fmt: skip


@gluon.jit
def _store_tables(midpoint_ptr, centroid_ptr, KEY_BITS: gl.constexpr, NORM_CORRECTION: gl.constexpr,
                  WARPS: gl.constexpr, BY_WARP: gl.constexpr = False):  # fmt: skip
    """A store program's lookup tables, built once: ``(centroid_sq, table, grid_scale, grid_offset, grid_ok)``, the
    codebook's squares (0 without norm correction) and the grid's table (:func:`grid_table`), an entry a thread;
    ``BY_WARP``: ``[WARPS, n]``, a whole copy in each warp, an entry a lane (:func:`_lookup`)."""
    if BY_WARP:
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
        warp = _iota(WARPS, 0, 2, layout) * 0
        slot = warp + _iota(GRID_SLOTS, 1, 2, layout)
        code = warp + _iota(1 << KEY_BITS, 1, 2, layout)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        slot = gl.arange(0, GRID_SLOTS, layout=layout)
        code = gl.arange(0, 1 << KEY_BITS, layout=layout)
    centroid_sq = 0
    if NORM_CORRECTION:
        centroid = gl.load(centroid_ptr + code)
        centroid_sq = centroid * centroid
    table, grid_scale, grid_offset, grid_ok = grid_table(midpoint_ptr, slot, KEY_BITS)
    return centroid_sq, table, grid_scale, grid_offset, grid_ok


@gluon.jit
def _store_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, pit_hi, pit_lo, centroid_sq, table,
                 grid_scale, grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt,
                 stride_vh, NUM_KV_HEADS: gl.constexpr, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr,
                 NORM_CORRECTION: gl.constexpr, SLOT_BYTES: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                 WIDE_SLOTS: gl.constexpr, GRID: gl.constexpr, WARPS: gl.constexpr,
                 EARLY_VALUES: gl.constexpr, PREFETCH: gl.constexpr):  # fmt: skip
    """:func:`store_kernel`'s loop over its tiles; the key codes by the grid's table (``GRID``) or by binary
    search."""
    ROWS: gl.constexpr = 16 * WARPS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # Keys [warp, half, quad, t, j, i]: row 16 warp + 8 half + quad, dimension 32j + 8t + i.
    key_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4, 8], [1, 1, 8, 4, 1, 1], [WARPS, 1, 1, 1, 1, 1],
                                                [5, 4, 3, 2, 1, 0])  # fmt: skip
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    value_layout: gl.constexpr = _value_layout(WARPS)
    key_dim = _iota(4, 4, 6, key_layout) * 32 + _iota(4, 3, 6, key_layout) * 8 + _iota(8, 5, 6, key_layout)
    value_dim = _iota(4, 3, 5, value_layout) * 32 + _iota(32, 4, 5, value_layout)
    words_layout: gl.constexpr = _code_words(gl.zeros([ROWS, HEAD_DIM], gl.int32, mma), KEY_BITS).type.layout

    # A tile's values are read first (EARLY_VALUES), so that they arrive while its keys are quantized. On the H200
    # (1M tokens x 8 KV heads, 4-bit, 4 warps, two programs a SM): values read first 3.53 ms; read after the keys'
    # MMAs and norms 3.89; read where they are quantized 3.95. Read where they are quantized, they are not held
    # through the keys' work: at 8 warps and 128 registers (Triton 3.6, 4-bit) 48 bytes of stack and 9 reloads or
    # spills a tile, against 504 and 71 read first.
    # A tile's keys are read during the tile before it, once that tile's norms are stored and its key codes are no
    # longer held: the first use of a tile's keys waited on their loads in 16% of the store's Nsight samples even with
    # the L2 prefetch. On the H200 (three programs a SM, Triton 3.6), keys read at the tile's start -> read a tile
    # ahead: 4-bit 2741 -> 2709 us, k3v4 2677 -> 2607, 3-bit 2530 -> 2440 (perf_log.md, twenty-seventh session). Read
    # a tile ahead at the tile's start (two programs a SM then, 255 registers) it was 24% slower: 3.53 -> 4.39 ms.
    k_next = _row_loads(key_ptr, _tile_rows(gl.program_id(0), 6, key_layout, WARPS), num_rows, key_dim, stride_kt,
                        stride_kh, NUM_KV_HEADS)  # fmt: skip
    for tile in range(gl.program_id(0), gl.cdiv(num_rows, ROWS), gl.num_programs(0)):
        following = tile + gl.num_programs(0)  # the program's next tile
        value_rows = _tile_rows(tile, 5, value_layout, WARPS)
        if EARLY_VALUES:
            v = _row_loads(value_ptr, value_rows, num_rows, value_dim, stride_vt, stride_vh, NUM_KV_HEADS)
        k = k_next
        # The tile's slots in each layout that writes (key codes, metadata, values): three loads from L1, not
        # two layout conversions through shared memory.
        slot_k = _slots(slot_ptr, tile * ROWS + _iota(ROWS, 0, 3, words_layout), num_rows, NUM_KV_HEADS)
        slot_m = _slots(slot_ptr, tile * ROWS + gl.arange(0, ROWS, layout=rows), num_rows, NUM_KV_HEADS)
        slot_v = _slots(slot_ptr, value_rows, num_rows, NUM_KV_HEADS)
        k = gl.reshape(k, [WARPS, 2, 8, 4, 4, 2, 2, 2])  # i = 4 c2 + 2 h + e, chunk c = 2j + c2
        k = gl.permute(k, (0, 1, 2, 4, 5, 6, 3, 7))  # [row: warp, half, quad | K: j, c2, h, t, e]
        k = gl.convert_layout(gl.reshape(k, [ROWS, HEAD_DIM]), dot_a)
        acc = warpgroup_mma(k, pit_lo, gl.zeros([ROWS, HEAD_DIM], gl.float32, mma))
        acc = warpgroup_mma(k, pit_hi, acc)

        # ||k|| in plain fp32: a bf16 square overflows only for ||k|| >= 2^64, where codes are not compared with
        # golden's and the stored norm saturates (inf -> 65504) as it must; squares below fp32's normal range
        # belong to norms so far below the 1e-8 in 1 / (||k|| + 1e-8) that their error cannot reach the codes.
        kf = k.to(gl.float32)
        norm = gl.convert_layout(gl.sqrt(gl.sum(kf * kf, axis=1)), rows)
        y = acc * (1.0 / (norm + _KEY_NORM_EPS))[:, None]
        if GRID:
            flat = gl.reshape(y, [ROWS * HEAD_DIM])
            # The saturated slot, one instruction a code fewer, for 3-bit keys only: on the H200 (one call,
            # kernel_times, us, random slots, twice each) 3-bit 2417 -> 2371, k3v4 2538 -> 2497, but 4-bit 2376 -> 2410
            # (perf_log.md, fortieth session).
            if KEY_BITS == 3:
                at = saturated_grid_slot(flat, grid_scale, grid_offset)
            else:
                at = grid_slot(flat, grid_scale, grid_offset)
            entry = gl.gather(table, at, 0)
            codes = gl.reshape(grid_code(flat, entry), [ROWS, HEAD_DIM])
        else:
            codes = _bucketize(y, midpoint_ptr, KEY_BITS)
        if PREFETCH:  # the next tile: from DRAM into L2 while this one computes
            _prefetch_tile(key_ptr, value_ptr, following, num_rows, stride_kt, stride_kh, stride_vt, stride_vh,
                           NUM_KV_HEADS, WARPS)  # fmt: skip
        words = _code_words(codes, KEY_BITS)
        w_row = tile * ROWS + _iota(ROWS, 0, 3, words_layout)
        w_t = _iota(4, 1, 3, words_layout)
        w_ok, w_data, _ = _slot_offsets(slot_k, w_row, num_slots, stride_block, NUM_KV_HEADS, BLOCK_SIZE,
                                        SLOT_BYTES, WIDE_SLOTS)  # fmt: skip
        _store_codes(cache_ptr, w_data + w_t * (4 * KEY_BITS), words, w_ok & (w_t < 4), KEY_BITS)

        m_row = tile * ROWS + gl.arange(0, ROWS, layout=rows)
        m_ok, _, m_at = _slot_offsets(slot_m, m_row, num_slots, stride_block, NUM_KV_HEADS, BLOCK_SIZE, SLOT_BYTES,
                                      WIDE_SLOTS)  # fmt: skip
        if NORM_CORRECTION:
            flat = gl.reshape(codes, [ROWS * HEAD_DIM])
            code_sq = gl.sum(gl.reshape(gl.gather(centroid_sq, flat, 0), [ROWS, HEAD_DIM]), axis=1)
            norm = norm / gl.sqrt(gl.convert_layout(code_sq, rows) + _NORM_CORRECTION_EPS)
        gl.store((cache_ptr + m_at).to(gl.pointer_type(gl.uint16)), _fp16_bits(norm), mask=m_ok,
                 eviction_policy=STORE_FIELDS_EVICTION)
        k_next = _row_loads(key_ptr, _tile_rows(following, 6, key_layout, WARPS), num_rows, key_dim, stride_kt,
                            stride_kh, NUM_KV_HEADS)  # fmt: skip

        if not EARLY_VALUES:
            v = _row_loads(value_ptr, value_rows, num_rows, value_dim, stride_vt, stride_vh, NUM_KV_HEADS)
        _store_values(v.to(gl.float32), slot_v, value_rows, cache_ptr, num_slots, stride_block, NUM_KV_HEADS,
                      BLOCK_SIZE, SLOT_BYTES, HEAD_DIM * KEY_BITS // 8, VALUE_BITS, WIDE_SLOTS)  # fmt: skip


# The store for the Sylvester-Hadamard rotation (``PiT = H_128 / sqrt(128)``, ``golden.turboquant.hadamard_rotation``
# without a seed: what vLLM serves). ``k @ PiT`` is then ``c * (k @ H)`` with ``c = PiT[0, 0]``, and ``k @ H`` is seven
# butterfly stages of fp32 additions (the fast Walsh-Hadamard transform), or five of them as warp MMAs on a 32 x 32
# +-1 operand held in registers: no rotation operand in shared memory, so a program holds a tile of 8 rows a warp (a
# lane quad a row, 32 contiguous dimensions a thread) and more programs fit a SM.
STORE_QUAD_ROWS = gl.constexpr(8)  # (token, KV head) rows per warp and tile of store_hadamard_kernel
HADAMARD_KNOBS = ("MMA_H32", "PACKED_EXTREMA", "JOINT_STORES")  # store_hadamard_kernel's switches, off by default


@gluon.constexpr_function
def _quad_layout(warps):
    """Rows ``[row, t, i]``: row ``8 warp + lane // 4``, dimension ``32 t + i`` with ``t = lane % 4`` (each thread
    owns 32 contiguous dimensions of one row)."""
    return gl.BlockedLayout([1, 1, 32], [8, 4, 1], [int(warps), 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _butterfly_asm(lanes):
    """Inline PTX: the value of the same element in lane ``lane ^ lanes``."""
    return f"shfl.sync.bfly.b32 $0, $1, {int(lanes)}, 0x1f, -1;"


@gluon.jit
def _hadamard_rows(x, t):
    """``x @ H_128`` (Sylvester, entries +-1) of each row of ``x`` (fp32, :func:`_quad_layout`; ``t`` the lane's
    ``[1, 4, 1]`` quarter): ``H_128 = H_4 (x) H_32`` over dimension ``32 t + i``, so five butterfly stages over
    ``i`` run in each thread's registers and two over ``t`` across the lane quad (a shuffle and an fma each)."""
    R: gl.constexpr = x.shape[0]
    for k in gl.static_range(5):  # stage k pairs i with i + 2^k: i = 2^(k+1) hi + 2^k bit + lo
        pairs = gl.permute(gl.reshape(x, [R, 4, 16 >> k, 2, 1 << k]), (0, 1, 2, 4, 3))
        a, b = gl.split(pairs)
        x = gl.reshape(gl.permute(gl.join(a + b, a - b), (0, 1, 2, 4, 3)), [R, 4, 32])
    for k in gl.static_range(2):
        partner = gl.inline_asm_elementwise(_butterfly_asm(1 << k), "=f,f", [x], dtype=gl.float32, is_pure=True,
                                            pack=1)  # fmt: skip
        x = gl.fma(gl.where((t & (1 << k)) != 0, -1.0, 1.0), x, partner)  # low lane a + b, high lane a - b
    return x


@gluon.constexpr_function
def _h32_layout(warps, operand):
    """Warp MMAs (``mma.sync`` m16n8k16) on ``[32 warps, 32]`` tiles, the warps along M: the accumulator's layout
    (``operand`` None) or operand ``operand``'s (0: A, 1: B)."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[int(warps), 1], instr_shape=[16, 8])
    return mma if operand is None else gl.DotOperandLayout(operand_index=int(operand), parent=mma, k_width=2)


@gluon.jit
def _h32_operand(WARPS: gl.constexpr):
    """``H_32`` as the B operand of :func:`_hadamard_rows_mma` (+-1 in bf16, exact), its rows and columns permuted
    so that the MMA's fragments line up with :func:`_quad_layout`: K index ``k`` (thread ``t = (k >> 1) & 3`` of a
    quad holds it) is input index ``8t + 4 (k >> 4) + 2 ((k >> 3) & 1) + (k & 1)``, N index ``n`` output index ``8t +
    2 (n >> 3) + (n & 1)`` with ``t = (n >> 1) & 3``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])
    k = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    n = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
    i = ((k >> 1) & 3) * 8 + (k >> 4) * 4 + ((k >> 3) & 1) * 2 + (k & 1)
    o = ((n >> 1) & 3) * 8 + (n >> 3) * 2 + (n & 1)
    parity = i[:, None] & o[None, :]
    parity = parity ^ (parity >> 4)
    parity = parity ^ (parity >> 2)
    parity = parity ^ (parity >> 1)
    return gl.convert_layout(gl.where((parity & 1) != 0, -1.0, 1.0).to(gl.bfloat16), _h32_layout(WARPS, 1))


@gluon.jit
def _hadamard_rows_mma(k, h32):
    """``k @ H_128`` (fp32) of each row of ``k`` (bf16, :func:`_quad_layout`), as :func:`_hadamard_rows` gives it,
    with ``H_128 = H_32 (x) H_4`` over dimension ``4 i + c``: ``H_32`` over ``i`` by warp MMAs (``h32``,
    :func:`_h32_operand`; a row's four residues ``c`` are four MMA rows, held by the thread that loaded them), then
    ``H_4`` over ``c`` in each thread's registers. Thread ``(g, t)`` of warp ``w`` holds row ``8w + g``, dimensions
    ``32t + 16 ks + 8 j + 4 e + 2 mt + h``, which are K index ``16 ks + 8 j + 2 t + e`` of MMA row ``16 WARPS mt +
    16 w + 8 h + g``: the A fragment of ``mma.sync`` as loaded, and its accumulator's columns the same way."""
    R: gl.constexpr = k.shape[0]
    WARPS: gl.constexpr = R // 8
    mma: gl.constexpr = _h32_layout(WARPS, None)
    a = gl.reshape(k, [WARPS, 8, 4, 2, 2, 2, 2, 2])  # [w, g, t, ks, j, e, mt, h]
    a = gl.reshape(gl.permute(a, (6, 0, 7, 1, 3, 4, 2, 5)), [32 * WARPS, 32])  # [mt w h g | ks j t e]
    z = mma_v2(gl.convert_layout(a, _h32_layout(WARPS, 0)), h32, gl.zeros([32 * WARPS, 32], gl.float32, mma))
    z = gl.reshape(z, [2, WARPS, 2, 8, 4, 4, 2])  # [mt, w, h, g | nt, t, e]: output 8t + 2 nt + e of residue 2mt + h
    a, b = gl.split(gl.permute(z, (1, 2, 3, 4, 5, 6, 0)))  # the butterflies over mt, then over h
    z = gl.permute(gl.join(a + b, a - b), (6, 0, 1, 2, 3, 4, 5))
    a, b = gl.split(gl.permute(z, (0, 1, 3, 4, 5, 6, 2)))
    z = gl.permute(gl.join(a + b, a - b), (0, 1, 6, 2, 3, 4, 5))
    y = gl.reshape(gl.permute(z, (1, 3, 5, 4, 6, 0, 2)), [R, 4, 32])  # [w, g, t, nt, e, mt, h]: 32t + 8nt + 4e + c
    return gl.convert_layout(y, k.type.layout)


@gluon.jit
def _lookup(table, index):
    """``table[index]`` for ``index [8 WARPS, 4, 32]`` (:func:`_quad_layout`) and a table ``[WARPS, n]`` whose warps
    each hold a copy, an entry a lane (:func:`_store_tables`): viewed as ``[WARPS, 1024]``, each warp's indices
    along the gather axis (no data moves), the gather stays in the warp, one ``shfl.idx`` an element, no shared
    memory and no barrier."""
    by_warp = gl.reshape(index, [table.shape[0], index.numel // table.shape[0]])
    return gl.reshape(gl.gather(table, by_warp, 1), index.shape)


@gluon.jit
def _corrected_norm(norm, centroid_sq, codes):
    """``norm / sqrt(||c[codes]||^2 + eps)`` of each row: the norm correction (``centroid_sq``: :func:`_lookup`'s
    table of the centroids' squares)."""
    code_sq = _lookup(centroid_sq, codes)
    return norm / gl.sqrt(gl.sum(gl.sum(code_sq, axis=2), axis=1) + _NORM_CORRECTION_EPS)


@gluon.jit
def store_hadamard_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, pit_ptr, midpoint_ptr, centroid_ptr,
    num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: gl.constexpr,
    KEY_BITS: gl.constexpr,
    VALUE_BITS: gl.constexpr,
    NORM_CORRECTION: gl.constexpr,
    SLOT_BYTES: gl.constexpr,  # data bytes per (token, KV head) slot
    BLOCK_SIZE: gl.constexpr,
    WIDE_SLOTS: gl.constexpr,  # slot numbers past int32
    WARPS: gl.constexpr = 4,
    MMA_H32: gl.constexpr = False,  # H_32 by warp MMAs (_hadamard_rows_mma), else butterflies (_hadamard_rows)
    PACKED_EXTREMA: gl.constexpr = False,  # each row's value min and max by packed bf16 min / max (_store_values)
    JOINT_STORES: gl.constexpr = False,  # each row's code stores back to back, and its fields (_store_quad_tiles)
):  # fmt: skip
    """Persistent programs over tiles of ``8 WARPS`` (token, KV head) rows for ``PiT = c H_128``: per tile the
    rows' norms, ``y = (k @ H) c / (||k|| + eps)`` (:func:`_hadamard_rows`, or with ``MMA_H32``
    :func:`_hadamard_rows_mma`), the bucketize by the grid's table
    (:func:`grid_table`; the binary search where it cannot separate the midpoints), the packing of each thread's
    32 contiguous codes, the norm correction, and the values as the portable store quantizes them."""
    gl.static_assert(gl.num_warps() == WARPS)
    centroid_sq, table, grid_scale, grid_offset, grid_ok = _store_tables(midpoint_ptr, centroid_ptr, KEY_BITS,
                                                                         NORM_CORRECTION, WARPS,
                                                                         BY_WARP=True)  # fmt: skip
    c = gl.load(pit_ptr)
    if grid_ok:
        _store_quad_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, c, centroid_sq, table, grid_scale,
                          grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt, stride_vh,
                          NUM_KV_HEADS, KEY_BITS, VALUE_BITS, NORM_CORRECTION, SLOT_BYTES, BLOCK_SIZE, WIDE_SLOTS,
                          True, WARPS, MMA_H32, PACKED_EXTREMA, JOINT_STORES)  # fmt: skip
    else:
        _store_quad_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, c, centroid_sq, table, grid_scale,
                          grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt, stride_vh,
                          NUM_KV_HEADS, KEY_BITS, VALUE_BITS, NORM_CORRECTION, SLOT_BYTES, BLOCK_SIZE, WIDE_SLOTS,
                          False, WARPS, MMA_H32, PACKED_EXTREMA, JOINT_STORES)  # fmt: skip


# Stores back to back. A row's 3-bit codes are 12 bytes a thread, three 4-byte stores at 12t, 12t + 4, 12t + 8, so a
# sector of a slot is written by several store instructions. Stores of a warp to one line that issue back to back reach
# L2 as fewer requests and sectors than the same stores apart (on the H200, Nsight Compute, 1M tokens x 8 KV heads at
# random slots: the 3-bit store with its three key-code stores 21 instructions apart made 39.1M write requests and 79.5M
# write sectors in L2 against 28.5M and 65.3M back to back, and took 8% longer). L2 traffic is what these stores are
# short of: the fabric between L2's two halves, which carries every sector an SM reads or writes in the far half, was
# 79-84% busy in every variant measured, DRAM 62-67% (3-bit). So each row's key codes are stored with its value codes
# and its key norm with its value fields (:func:`_store_values`), and the next tile's keys are read after them (read
# before, the key codes held through the values' quantization spill at 3-bit keys' 64 registers). 3-bit keys take their
# values' extrema by packed bf16 min / max too (``HADAMARD_PACKED_EXTREMA``), which left them 1242 instructions a tile
# (1293 before; 1214 since the saturating value shares of :func:`_store_values` and :func:`saturated_grid_slot`). Write
# requests / write sectors / us (Nsight): 3-bit 28.5M / 65.3M / 1850 -> 19.7M / 60.5M / 1718, k3v4 30.1M / 66.8M / 1931
# -> 22.6M / 64.1M / 1783, 4-bit 30.5M / 58.7M / 1799 -> 17.0M / 58.7M / 1774 (its codes were whole 16-byte stores
# already, and at consecutive slots it lost 2-5%: 4-bit keys keep the stores apart). L2's sectors alone do not set the
# time: the 3-bit codes moved across each lane quad so that each of a row's three 32-byte sectors is one 8-byte store a
# thread (benchmarks/variants/hadamard_sector_stores.patch: six shuffles and 22 selects a tile) took the write sectors
# to the floor, 66.3M -> 50.3M (six a row: three of data, three fields), and the fabric's sectors 100.8M -> 92.6M, yet
# 35 more instructions a tile made the store 4.5% slower.


@gluon.jit
def _store_quad_tiles(key_ptr, value_ptr, cache_ptr, slot_ptr, midpoint_ptr, c, centroid_sq, table, grid_scale,
                      grid_offset, num_rows, num_slots, stride_block, stride_kt, stride_kh, stride_vt, stride_vh,
                      NUM_KV_HEADS: gl.constexpr, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr,
                      NORM_CORRECTION: gl.constexpr, SLOT_BYTES: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                      WIDE_SLOTS: gl.constexpr, GRID: gl.constexpr, WARPS: gl.constexpr,
                      MMA_H32: gl.constexpr, PACKED_EXTREMA: gl.constexpr, JOINT_STORES: gl.constexpr):  # fmt: skip
    """:func:`store_hadamard_kernel`'s loop over its tiles."""
    ROWS: gl.constexpr = STORE_QUAD_ROWS * WARPS
    layout: gl.constexpr = _quad_layout(WARPS)
    t = _iota(4, 1, 3, layout)
    dim = t * 32 + _iota(32, 2, 3, layout)
    h32 = _h32_operand(WARPS) if MMA_H32 else 0
    below, mid = grid_split(table)
    tile_rows = _iota(ROWS, 0, 3, layout)
    k_next = _row_loads(key_ptr, gl.program_id(0) * ROWS + tile_rows, num_rows, dim, stride_kt, stride_kh,
                        NUM_KV_HEADS)  # fmt: skip
    for tile in range(gl.program_id(0), gl.cdiv(num_rows, ROWS), gl.num_programs(0)):
        row = tile * ROWS + tile_rows
        v = _row_loads(value_ptr, row, num_rows, dim, stride_vt, stride_vh, NUM_KV_HEADS)
        slot = _slots(slot_ptr, row, num_rows, NUM_KV_HEADS)
        k = k_next.to(gl.float32)
        norm = gl.sqrt(gl.sum(gl.sum(k * k, axis=2), axis=1))
        if MMA_H32:
            h = _hadamard_rows_mma(k_next, h32)
        else:
            h = _hadamard_rows(k, t)
        y = h * gl.expand_dims(gl.expand_dims(c / (norm + _KEY_NORM_EPS), 1), 2)
        if GRID:
            slot_y = saturated_grid_slot(y, grid_scale, grid_offset)
            codes = _lookup(below, slot_y) + (y >= _lookup(mid, slot_y)).to(gl.int32)
        else:
            codes = _bucketize(y, midpoint_ptr, KEY_BITS)
        groups = gl.reshape(codes.to(gl.uint32), [ROWS, 4, 4, 8])  # [row, t, q, p]: dimension 32t + 8q + p
        groups_layout: gl.constexpr = groups.type.layout
        words = gl.sum(groups << (_iota(8, 3, 4, groups_layout) * KEY_BITS).to(gl.uint32), axis=3)
        if JOINT_STORES:  # the key codes and norms written with the values', then the next tile's keys read
            if NORM_CORRECTION:
                norm = _corrected_norm(norm, centroid_sq, codes)
            v = v if PACKED_EXTREMA else v.to(gl.float32)
            following = row + gl.num_programs(0) * ROWS
            _store_values(v, slot, row, cache_ptr, num_slots, stride_block, NUM_KV_HEADS, BLOCK_SIZE, SLOT_BYTES,
                          HEAD_DIM * KEY_BITS // 8, VALUE_BITS, WIDE_SLOTS, words, KEY_BITS, norm)  # fmt: skip
            k_next = _row_loads(key_ptr, following, num_rows, dim, stride_kt, stride_kh, NUM_KV_HEADS)
        else:  # the key codes and norm written first, the next tile's keys read, then the values
            ok, data, meta = _slot_offsets(slot, row, num_slots, stride_block, NUM_KV_HEADS, BLOCK_SIZE, SLOT_BYTES,
                                           WIDE_SLOTS)  # fmt: skip
            words_layout: gl.constexpr = words.type.layout
            at = gl.convert_layout(data + t * (4 * KEY_BITS), words_layout)
            _store_codes(cache_ptr, at, words, gl.convert_layout(ok & (t < 4), words_layout), KEY_BITS)
            if NORM_CORRECTION:
                norm = _corrected_norm(norm, centroid_sq, codes)
            fields = (cache_ptr + gl.max(gl.max(meta, axis=2), axis=1)).to(gl.pointer_type(gl.uint16))
            row_ok = gl.max(gl.max(ok.to(gl.int32), axis=2), axis=1) != 0
            gl.store(fields, _fp16_bits(norm), mask=row_ok, eviction_policy=STORE_FIELDS_EVICTION)
            k_next = _row_loads(key_ptr, row + gl.num_programs(0) * ROWS, num_rows, dim, stride_kt, stride_kh,
                                NUM_KV_HEADS)  # fmt: skip
            _store_values(v if PACKED_EXTREMA else v.to(gl.float32), slot, row, cache_ptr, num_slots, stride_block,
                          NUM_KV_HEADS, BLOCK_SIZE, SLOT_BYTES, HEAD_DIM * KEY_BITS // 8, VALUE_BITS,
                          WIDE_SLOTS)  # fmt: skip
