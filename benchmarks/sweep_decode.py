"""Sweep stage-1 launch configs of ``decode_attention``; results go in ``notebooks/results/sweep_decode_h200.md``.

Run from the repository root on the GPU machine:
``PYTHONPATH=. python3 benchmarks/sweep_decode.py [seconds] [MLA|GQA|splits|tma|h16]``. Each line: shape, split count
(vLLM's ``_compute_num_kv_splits``), config, time (median CUDA-graph replay, stages 1 and 2), TFLOP/s,
and % of the roofline max(FLOPs / 680 TFLOP/s, bytes / 4.24 TB/s), the H200 ceilings ``attnref bench``
measured (bf16 matmul, device copy). ``splits`` times the sm90 config of every bench shape at split counts
from vLLM's down to 1 (powers of two), and at the counts that fill 1, 2, 4 and 8 rounds of programs; ``tma``
times the sm90 MLA entry at vLLM's split count with and without tensor-descriptor tiles and without the split cap;
``h16`` times the 16-head MLA tile's variants (``H16_GRID``) at the H=16 bench shapes.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.testing

from triton_impl.decode_attention import DECODE_CONFIGS, _compute_num_kv_splits, decode_attention_fwd, tile_config

os.environ["ATTNREF_CHECK_CONTENTS"] = "0"
PEAK_FLOPS, PEAK_BW = 680e12, 4.24e12
# (name, batch, heads, kv_heads, key width, value width, length, page)
SHAPES = [  # the H=16 shape first: its register cap (MLA_GRID) is the open question
    ("MLA", 32, 16, 1, 576, 512, 32768, 64),
    ("MLA", 32, 128, 1, 576, 512, 32768, 64),
    ("MLA", 8, 128, 1, 576, 512, 8192, 64),
    ("GQA", 128, 32, 8, 128, 128, 1024, 16),
    ("GQA", 32, 32, 8, 128, 128, 32768, 16),
    ("GQA", 32, 32, 8, 128, 128, 8192, 16),
]
# The rest of the bench's decode shapes, for the split sweep.
SPLIT_SHAPES = [*SHAPES, ("MLA", 128, 16, 1, 576, 512, 8192, 64), ("MLA", 1, 128, 1, 576, 512, 32768, 64),
                ("MLA", 128, 128, 1, 576, 512, 1024, 64)]  # fmt: skip
# The split sweep counts rounds of resident stage-1 programs with the sm90 entries' PROGRAMS_PER_SM (Triton 3.6,
# Nsight Compute's occupancy): the 64-head MLA tile 1 (255 registers, 221 KB shared memory), the 16-head MLA tile 2
# (128 registers), GQA 4 (108 registers).
# (BLOCK_H, BLOCK_N, num_warps, num_stages, SPLIT_LATENT[, maxnreg]). The sm90 entry (64, 64, 8, 2, 1) caps the
# 16-head tile at 128 registers (maxnreg_h16): uncapped, Triton 3.6 gives that tile 150 registers per thread, so
# one 8-warp program fits an SM where two fit at 128 (94 KiB of shared memory each): 543 -> 385 us at H=16
# (sweep_decode_h200.md). The next entries ask what else the 16-head tile gains under the cap: 4 warps, a
# 128-key tile, 3 stages, a 32-key tile with 4 programs per SM by shared memory.
MLA_GRID = [(64, 64, 8, 2, 1, 128), (64, 64, 4, 2, 1, 128), (64, 128, 8, 2, 1, 128), (64, 64, 8, 3, 1, 128),
            (64, 32, 4, 2, 1, 128), (64, 64, 8, 2, 1), (16, 32, 4, 2, 1), (64, 32, 8, 2, 1)]  # fmt: skip
# GQA: the sm90 entry (16, 32, 4, 2, 0) first; B=128 L=1K ran at 80.0% of the copy roofline (bench at 62cb554).
GQA_GRID = [(16, 32, 4, 2, 0), (16, 64, 4, 2, 0), (16, 64, 4, 3, 0), (16, 32, 4, 3, 0), (16, 128, 4, 2, 0),
            (16, 64, 8, 2, 0), (16, 32, 2, 2, 0), (16, 16, 4, 3, 0)]  # fmt: skip

# The 16-head MLA tile (memory-bound, 83% of the copy roofline at 580e9fc): overrides of the sm90 entry. Descriptor
# tiles at 64 keys cost it its second program per SM (114 KiB of shared memory); 32-key descriptor tiles, or 64-key
# ones in one stage, would keep two (all slower, at 4f3d426). Then smaller gathered tiles: a 32-key tile on 4 warps
# at 128 registers fits four programs per SM (by registers and by shared memory), so its split cap counts four
# (PROGRAMS_PER_SM_H16); at vLLM's 64 splits it ran 374 us against the entry's 387 (sweep at 8f5b45e).
H16_GRID = [{}, {"TMA_H16": 1, "BLOCK_N_h16": 32}, {"TMA_H16": 1, "BLOCK_N_h16": 32, "num_warps_h16": 4},
            {"TMA_H16": 1, "BLOCK_N_h16": 32, "num_stages_h16": 3}, {"TMA_H16": 1, "num_stages_h16": 1},
            {"TMA_H16": 1, "BLOCK_N_h16": 32, "num_stages_h16": 4, "num_warps_h16": 4},
            {"BLOCK_N_h16": 32, "num_warps_h16": 4}, {"TMA_H16": 1, "BLOCK_N_h16": 32, "maxnreg_h16": 96},
            {"BLOCK_N_h16": 32, "num_warps_h16": 4, "PROGRAMS_PER_SM_H16": 4},
            {"BLOCK_N_h16": 32, "num_warps_h16": 4, "PROGRAMS_PER_SM_H16": 8},
            {"BLOCK_N_h16": 32, "num_warps_h16": 4, "num_stages_h16": 3, "PROGRAMS_PER_SM_H16": 4},
            {"PROGRAMS_PER_SM_H16": 4}, {"PROGRAMS_PER_SM_H16": 1}]


def problem(name, batch, heads, kv_heads, key_width, value_width, length, page, device):
    is_mla = name == "MLA"
    pages = batch * triton.cdiv(length, page)
    width = key_width if is_mla else key_width + value_width
    cache = (torch.randn(pages, page, kv_heads, width, device=device) * 0.5).to(torch.bfloat16)
    k, v = (cache, cache[..., :value_width]) if is_mla else (cache[..., :key_width], cache[..., key_width:])
    table = torch.randperm(pages, device=device).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    q = (torch.randn(batch, heads, key_width, device=device) * 0.5).to(torch.bfloat16)
    o = torch.empty(batch, heads, value_width, device=device, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, device=device)
    flops = 2 * batch * heads * length * (key_width + value_width)
    nbytes = batch * length * kv_heads * width * 2 + q.numel() * 2 + o.numel() * 2 + lse.numel() * 4
    return (q, k, v, o, lse, table, seq_lens), is_mla, flops, nbytes


def sweep_shape(shape: tuple, sms: int, deadline: float) -> None:
    name, batch, heads, kv_heads, key_width, value_width, length, page = shape
    device = torch.device("cuda")
    (q, k, v, o, lse, table, seq_lens), is_mla, flops, nbytes = problem(*shape, device)
    splits = _compute_num_kv_splits(length, sms)
    logits = torch.empty(batch, heads, splits, value_width + 1, device=device)
    sm_scale = 192**-0.5 if is_mla else key_width**-0.5
    roofline_ms = max(flops / PEAK_FLOPS, nbytes / PEAK_BW) * 1e3
    for bh, bn, warps, stages, split_latent, *maxnreg in MLA_GRID if is_mla else GQA_GRID:
        if time.time() > deadline:
            return
        cfg = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_LATENT": split_latent,
               "maxnreg": maxnreg[0] if maxnreg else 0}  # fmt: skip

        def run() -> None:
            decode_attention_fwd(q, k, v, o, lse, table, seq_lens, logits, splits, sm_scale, page, is_mla=is_mla,
                                 config=cfg)  # noqa: B023  # fmt: skip

        registers = f" r{maxnreg[0]}" if maxnreg else ""
        label = (f"{name} B={batch} H={heads}/{kv_heads} L={length} S={splits:3d} "
                 f"BH{bh} BN{bn} w{warps} s{stages} sl{split_latent}{registers}")  # fmt: skip
        try:
            run()
            ms = triton.testing.do_bench_cudagraph(run, rep=50)
        except Exception as err:  # a config that does not compile (shared memory) is a result too
            print(f"{label}: {type(err).__name__}", flush=True)
            continue
        print(f"{label} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TF/s {nbytes / ms / 1e6:6.0f} GB/s "
              f"roofline {100 * roofline_ms / ms:5.1f}%", flush=True)  # fmt: skip


def sweep_splits(shape: tuple, sms: int, deadline: float) -> None:
    name, batch, heads, kv_heads, key_width, value_width, length, page = shape
    device = torch.device("cuda")
    (q, k, v, o, lse, table, seq_lens), is_mla, flops, nbytes = problem(*shape, device)
    vllm = _compute_num_kv_splits(length, sms)
    tile, config = tile_config(DECODE_CONFIGS["sm90"]["mla" if is_mla else "gqa"], heads // kv_heads)
    per_sm = config["PROGRAMS_PER_SM"]
    programs_per_split = batch * kv_heads * triton.cdiv(heads // kv_heads, tile)
    fills = {max(1, rounds * per_sm * sms // programs_per_split) for rounds in (1, 2, 4, 8)}
    counts = sorted({vllm >> i for i in range(vllm.bit_length())} | {n for n in fills if n <= vllm}, reverse=True)
    sm_scale = 192**-0.5 if is_mla else key_width**-0.5
    roofline_ms = max(flops / PEAK_FLOPS, nbytes / PEAK_BW) * 1e3
    for splits in counts:
        logits = torch.empty(batch, heads, splits, value_width + 1, device=device)
        if time.time() > deadline:
            return

        def run(splits: int = splits, logits: torch.Tensor = logits) -> None:
            decode_attention_fwd(q, k, v, o, lse, table, seq_lens, logits, splits, sm_scale, page, is_mla=is_mla)

        run()
        torch.cuda.synchronize()  # do_bench_cudagraph's first call runs on a new stream, unordered with this one
        ms = triton.testing.do_bench_cudagraph(run, rep=50)
        rounds = splits * programs_per_split / (per_sm * sms)
        print(f"{name} B={batch} H={heads}/{kv_heads} L={length} S={splits:3d} (vLLM {vllm:3d}, {rounds:5.2f} rounds) "
              f"{ms * 1e3:8.1f} us roofline {100 * roofline_ms / ms:5.1f}%", flush=True)  # fmt: skip


def sweep_variants(shape: tuple, sms: int, deadline: float, variants: list[tuple[str, dict]]) -> None:
    """Each ``(label, config)`` at the shape, at vLLM's split count (the config's cap applies)."""
    name, batch, heads, _, _, value_width, length, page = shape
    device = torch.device("cuda")
    (q, k, v, o, lse, table, seq_lens), _, flops, nbytes = problem(*shape, device)
    splits = _compute_num_kv_splits(length, sms)
    logits = torch.empty(batch, heads, splits, value_width + 1, device=device)
    roofline_ms = max(flops / PEAK_FLOPS, nbytes / PEAK_BW) * 1e3
    for label, cfg in variants:
        if time.time() > deadline:
            return

        def run(cfg: dict = cfg) -> None:
            decode_attention_fwd(q, k, v, o, lse, table, seq_lens, logits, splits, 192**-0.5, page, is_mla=True,
                                 config=cfg)  # fmt: skip

        try:
            run()
            torch.cuda.synchronize()  # do_bench_cudagraph's first call runs on a new stream
            ms = triton.testing.do_bench_cudagraph(run, rep=50)
        except Exception as err:  # a config that does not fit is a result too
            print(f"{name} B={batch} H={heads} L={length} S={splits:3d} {label}: {type(err).__name__}", flush=True)
            continue
        print(f"{name} B={batch} H={heads} L={length} S={splits:3d} {label:13s} {ms * 1e3:8.1f} us "
              f"roofline {100 * roofline_ms / ms:5.1f}%", flush=True)  # fmt: skip


def tma_variants() -> list[tuple[str, dict]]:
    """The sm90 MLA entry (split cap included) with and without tensor-descriptor tiles, and with the cap off."""
    entry = DECODE_CONFIGS["sm90"]["mla"]
    return [("TMA, cap", entry), ("gathers, cap", {**entry, "TMA": 0}), ("TMA, no cap", {**entry, "SPLIT_ROUNDS": 0})]


def h16_variants() -> list[tuple[str, dict]]:
    """The sm90 MLA entry with each ``H16_GRID`` override."""
    entry = DECODE_CONFIGS["sm90"]["mla"]
    return [(" ".join(f"{key}={value}" for key, value in override.items()) or "sm90 entry", {**entry, **override})
            for override in H16_GRID]  # fmt: skip


def main(budget_s: float, only: str | None = None) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    deadline = time.time() + budget_s
    if only in ("tma", "h16"):
        for shape in SPLIT_SHAPES:
            if shape[0] == "MLA" and (only == "tma" or shape[2] == 16):
                sweep_variants(shape, sms, deadline, tma_variants() if only == "tma" else h16_variants())
                torch.cuda.empty_cache()
        return
    if only == "splits":
        for shape in SPLIT_SHAPES:
            sweep_splits(shape, sms, deadline)
            torch.cuda.empty_cache()
        return
    for shape in SHAPES:
        if only is not None and shape[0] != only:
            continue
        sweep_shape(shape, sms, deadline)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 300.0, sys.argv[2] if len(sys.argv) > 2 else None)
