"""Seeded tensor factories and paged-cache builders shared by every op's tests.

Hypothesis draws shapes and an integer seed; tensors come from a seeded ``torch.Generator``
(hypothesis never generates float arrays).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from triton_impl.cases import block_table_for, exact
from triton_impl.tolerances import Tolerance, compare, tolerance

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def sm90_only(what: str) -> pytest.MarkDecorator:
    """A test of what runs on Hopper only: skipped unless a compute capability 9.x GPU is here."""
    here = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    return pytest.mark.skipif(not here, reason=f"{what} runs on compute capability 9.x only")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal values drawn on the CPU (reproducible everywhere), scaled, cast, then moved."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def nan_filled(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer whose every element fails a comparison until the kernel writes it."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, key: tuple[str, str, object] | Tolerance,
                 bound: torch.Tensor | None = None) -> None:  # fmt: skip
    """Assert against the tolerance table entry ``(op, output, dtype)`` (or an explicit Tolerance), widened by a
    derived per-element ``bound`` where one is given."""
    tol = key if isinstance(key, Tolerance) else tolerance(*key)
    cmp = compare(actual, expected, tol, bound)
    assert cmp.ok, (
        f"max abs {cmp.max_abs:.3e}, max rel {cmp.max_rel:.3e} vs atol {tol.atol:g} rtol {tol.rtol:g}: {cmp.detail}"
    )


def fails_tolerance(actual: torch.Tensor, expected: torch.Tensor, key: tuple[str, str, object] | Tolerance,
                    bound: torch.Tensor | None = None) -> bool:  # fmt: skip
    """For negative controls: True when ``actual`` is outside the tolerance (and ``bound``, as :func:`assert_close`)."""
    tol = key if isinstance(key, Tolerance) else tolerance(*key)
    return not compare(actual, expected, tol, bound).ok


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact comparison for codes, bytes, indices (and floats compared as bits)."""
    cmp = exact(actual, expected)
    assert cmp.ok, cmp.detail


@dataclass
class PagedCache:
    """A paged KV cache as serving lays it out, with the block table that addresses it.

    ``cache`` is the view a kernel gets: ``[num_pages, page_size, HKV, D]`` ("4d"),
    ``[num_pages * page_size, HKV, D]`` ("3d") or a per-layer view into a cross-layer cache
    ``[num_pages, num_layers, page_size, HKV, D][:, layer]`` whose page stride is ``num_layers``
    times larger ("cross_layer"). Pages are handed out in shuffled order; every page and slot that
    no request uses holds NaN (the moat), so a kernel that reads past a request's keys fails.
    """

    cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32; unused entries hold a large garbage id
    seq_lens: torch.Tensor  # [B] int32
    page_size: int


def paged_cache(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    *,
    layout: str = "4d",
    shuffle: bool = True,
    spare_pages: int = 2,
    extra_columns: int = 1,
    scale: float = 1.0,
    moat: bool = True,
) -> PagedCache:
    """Build a paged cache holding ``seq_lens[b]`` random tokens for each request ``b``.

    FP8 dtypes get values drawn in fp32 and rounded by torch; the moat uses NaN for float caches
    (0x7F, the e4m3fn NaN, for fp8). ``spare_pages`` unused pages and ``extra_columns`` unused
    block-table columns (filled with garbage page ids) are added so out-of-range reads show.
    """
    if layout not in ("4d", "3d", "cross_layer"):
        raise ValueError(f"layout: expected '4d', '3d' or 'cross_layer', got {layout!r}")
    table, num_pages = block_table_for(
        seq_lens, page_size, gen=gen, spare_pages=spare_pages, extra_columns=extra_columns, fill=2**30 + 7
    )
    if not shuffle:  # pages in order: request 0 first
        used = table < num_pages
        table[used] = torch.arange(int(used.sum()), dtype=torch.int32)

    store_dtype = torch.float32 if dtype in FP8_DTYPES else dtype
    values = torch.randn((num_pages, page_size, num_kv_heads, width), generator=gen, dtype=torch.float64) * scale
    values = values.to(store_dtype)
    if moat:
        used = torch.zeros((num_pages, page_size), dtype=torch.bool)
        for b, n in enumerate(seq_lens):
            j = torch.arange(n)
            used[table[b, j // page_size].long(), j % page_size] = True
        values[~used] = float("nan")
    values = values.to(dtype)

    num_layers = 3 if layout == "cross_layer" else 1
    full = torch.randn((num_pages, num_layers, page_size, num_kv_heads, width), generator=gen).to(dtype)
    full[:, num_layers // 2] = values
    full = full.to(device)
    cache = full[:, num_layers // 2]
    if layout == "3d":
        cache = cache.flatten(0, 1)
    return PagedCache(cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), page_size)


def paginate(tokens: list[torch.Tensor], page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay given dense per-row keys ``[n, HKV, D]`` out in shuffled pages; NaN in every unused slot.

    Returns ``(cache [pages, page_size, HKV, D], block_table [R, max_pages + 1] int32)``; unused
    table entries hold an out-of-range page id.
    """
    table, num_pages = block_table_for(
        [t.shape[0] for t in tokens], page_size, gen=gen, spare_pages=1, extra_columns=1, fill=2**30
    )
    cache = torch.full((num_pages, page_size, *tokens[0].shape[1:]), float("nan"), dtype=tokens[0].dtype)
    for r, t in enumerate(tokens):
        j = torch.arange(t.shape[0])
        cache[table[r, j // page_size].long(), j % page_size] = t
    return cache, table


def run_ptx(asm: str, inputs: list[int], outputs: int, laneid: int = 0, shared: dict[int, int] | None = None,
            symbols: dict[str, int] | None = None) -> list[int]:
    """A model of the b32 PTX our inline asm uses (the Gluon kernels' lookups and conversions run only compiled), on
    Python ints: ``mov`` (of ``%laneid`` or of a ``symbols`` address), ``and``, ``or``, ``shl``, ``shr``, ``add``,
    ``mul.lo``, ``mad.lo``, ``prmt`` (its default mode: 4 selector nibbles, the high bit replicating the byte's sign),
    ``lop3`` (bit ``4a + 2b + c`` of the immediate), ``ld.shared`` / ``st.shared`` of a word at a register's address
    in ``shared`` (a dict, written in place; reading an address never written fails), ``bar.warp.sync`` (nothing to
    do for one lane), and on two bf16 lanes ``mul.rn.bf16x2`` (round to nearest even) and ``set.eq.u32.bf16x2`` (all
    ones where equal); ``$k`` the operands, the ``outputs`` results first."""
    regs = {f"${k}": 0 for k in range(outputs)} | {f"${outputs + k}": v & 0xFFFFFFFF for k, v in enumerate(inputs)}
    shared = {} if shared is None else shared
    symbols = symbols or {}

    def value(token: str) -> int:
        token = token.strip().strip("[]")
        if token == "%laneid":
            return laneid
        if token in symbols:
            return symbols[token]
        return regs[token] if token in regs else int(token, 0)

    for line in asm.replace("{", ";").replace("}", ";").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        x = [value(a) for a in src]
        if op == "bar.warp.sync":
            continue
        if op == "st.shared.b32":
            shared[value(dst)] = x[0] & 0xFFFFFFFF
            continue
        if op in ("mov.b32", "mov.u32"):
            out = x[0]
        elif op == "ld.shared.b32":
            out = shared[x[0]]
        elif op == "add.u32":
            out = x[0] + x[1]
        elif op == "mad.lo.u32":
            out = x[0] * x[1] + x[2]
        elif op == "and.b32":
            out = x[0] & x[1]
        elif op == "or.b32":
            out = x[0] | x[1]
        elif op == "shl.b32":
            out = x[0] << x[1]
        elif op == "shr.b32":
            out = x[0] >> x[1]
        elif op == "mul.lo.u32":
            out = x[0] * x[1]
        elif op == "prmt.b32":
            source, out = x[0] | (x[1] << 32), 0
            for i in range(4):
                select = (x[2] >> (4 * i)) & 0xF
                byte = (source >> (8 * (select & 7))) & 0xFF
                if select & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
        elif op in ("mul.rn.bf16x2", "set.eq.u32.bf16x2"):
            a, b = (torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16) for v in x)
            a, b = (t.view(torch.bfloat16).float() for t in (a, b))
            if op == "mul.rn.bf16x2":
                lanes = (a * b).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF  # exact in fp32, then rounded
            else:
                lanes = torch.where(a == b, 0xFFFF, 0)
            out = int(lanes[0]) | int(lanes[1]) << 16
        elif op == "lop3.b32":
            out = sum((((x[3] >> ((((x[0] >> i) & 1) << 2) | (((x[1] >> i) & 1) << 1) | ((x[2] >> i) & 1))) & 1) << i)
                      for i in range(32))  # fmt: skip
        else:
            raise AssertionError(f"no model of {op}")
        regs[dst] = out & 0xFFFFFFFF
    return [regs[f"${k}"] for k in range(outputs)]


def run_compiled(script: str, *args: str, timeout: int = 900) -> str:
    """Run ``python -c script args`` in a fresh process where Triton compiles (``TRITON_INTERPRET=0``, the repository
    on ``PYTHONPATH``), e.g. to compile kernels for sm_90 on a CPU; its stdout. A non-zero exit fails the test with
    the end of its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def compiled_rows(script: str, *args: str, timeout: int = 900) -> list:
    """The JSON rows (its stdout lines that start with ``[``) of :func:`run_compiled`'s run of ``script``."""
    return [json.loads(line) for line in run_compiled(script, *args, timeout=timeout).splitlines()
            if line.startswith("[")]  # fmt: skip
