"""Decode context parallelism: ranks hold parts of each request's keys; merged == single process.

The gloo test forks 2 and 3 CPU processes (fork, not spawn: a spawned child re-imports torch and
Triton, seconds per process). ``tests/dcp_nccl_check.py`` runs the same check with NCCL on GPUs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from golden.decode_attention import dcp_local_positions, decode_attention
from tests.support import assert_close, fails_tolerance, generator, nan_filled, paginate
from triton_impl.decode_attention import decode_attention_dcp, decode_attention_fwd
from triton_impl.lse_merge import merge_splits

LAYOUTS = [("striped", 1), ("striped", 2), ("sliced", 1)]
CASES = [("mla", "striped", 1), ("gqa", "sliced", 1), ("gqa", "striped", 2)]


def _paged(tokens: list[torch.Tensor], page_size: int, gen: torch.Generator, device: torch.device):
    """Rows' dense keys in shuffled pages (``tests.support.paginate``), their table and lengths."""
    cache, table = paginate(tokens, page_size, gen)
    lens = torch.tensor([t.shape[0] for t in tokens], dtype=torch.int32)
    return cache.to(device), table.to(device), lens.to(device)


def _split_kv(cache: torch.Tensor, is_mla: bool, key_width: int, value_width: int):
    """K and V views of a cache: MLA's V is K's first columns; GQA's K and V sit side by side."""
    return (cache, cache[..., :value_width]) if is_mla else (cache[..., :key_width], cache[..., key_width:])


def _problem(kind: str, lens: list[int]):
    """Global keys and queries, identical on every rank (fixed seeds): MLA or GQA with a cap."""
    gen = generator(2024 if kind == "mla" else 2025)
    if kind == "mla":
        heads, kv_heads, key_width, value_width, dtype, cap = 2, 1, 32, 16, torch.bfloat16, 0.0
        keys = [torch.randn(n, kv_heads, key_width, generator=gen).to(dtype) for n in lens]
        values = [k[..., :value_width] for k in keys]
    else:
        heads, kv_heads, key_width, value_width, dtype, cap = 4, 2, 24, 16, torch.float32, 5.0
        keys = [torch.randn(n, kv_heads, key_width, generator=gen) for n in lens]
        values = [torch.randn(n, kv_heads, value_width, generator=gen) for n in lens]
    q = (torch.randn(len(lens), heads, key_width, generator=gen) * 0.7).to(dtype)
    return q, keys, values, cap


def run_dcp_check(rank: int, world_size: int, device: torch.device, cases=CASES, lens=(0, 1, 23)) -> None:
    """This rank's part of the check: for each ``(kind, layout, interleave)`` build the local cache
    from ``dcp_local_positions``, run ``decode_attention_dcp`` and compare with the golden model over
    all keys. Row lengths 0 and 1 leave some ranks without a key (their state is (0, -inf)). The
    local decode uses 2 splits for the sliced layout and 1 otherwise (both stage-1 paths)."""
    page_size = 4
    for kind, layout, interleave in cases:
        q, keys, values, cap = _problem(kind, list(lens))
        q = q.to(device)
        is_mla = kind == "mla"
        key_width, value_width = keys[0].shape[-1], values[0].shape[-1]
        kv = keys if is_mla else [torch.cat([k, v], dim=-1) for k, v in zip(keys, values)]
        widths = (is_mla, key_width, value_width)
        cache, table, seq_lens = _paged(kv, page_size, generator(0), device)
        ref_o, ref_lse = decode_attention(
            q, *_split_kv(cache, *widths), table, seq_lens, 0.2, page_size,
            logit_cap=cap, is_mla=is_mla, dtype=torch.float64,
        )  # fmt: skip
        local = [t[dcp_local_positions(t.shape[0], world_size, rank, layout, interleave)] for t in kv]
        local_cache, local_table, local_lens = _paged(local, page_size, generator(100 + rank), device)
        rows, heads = q.shape[:2]
        splits = 2 if layout == "sliced" else 1
        o = nan_filled((rows, heads, value_width), q.dtype, device)
        lse = nan_filled((rows, heads), torch.float32, device)
        logits = nan_filled((rows, heads, splits, value_width + 1), torch.float32, device) if splits > 1 else None
        decode_attention_dcp(
            q, *_split_kv(local_cache, *widths), o, lse, local_table, local_lens, logits, splits, 0.2, page_size,
            logit_cap=cap, is_mla=is_mla,
        )  # fmt: skip
        assert_close(o, ref_o, ("decode_attention", "o", str(q.dtype).removeprefix("torch.")))
        assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))


def _gloo_worker(rank: int, world_size: int, store_file: str, cases) -> None:
    # One intra-op thread: a forked child must not enter the parent's OpenMP pool.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        run_dcp_check(rank, world_size, torch.device("cpu"), cases)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the gloo ranks run the kernel on CPU tensors under the interpreter; on GPUs run tests/dcp_nccl_check.py",
)
@pytest.mark.parametrize(("world_size", "cases"), [(2, CASES[:2]), (3, CASES[2:])])
def test_dcp_gloo_matches_single_process_golden(tmp_path, world_size: int, cases) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is required for the DCP test")
    mp.start_processes(
        _gloo_worker, args=(world_size, str(tmp_path / "store"), cases), nprocs=world_size, start_method="fork"
    )


@pytest.mark.parametrize(("layout", "interleave"), [*LAYOUTS, ("striped", 16)])
def test_dcp_positions_partition_the_keys(layout: str, interleave: int) -> None:
    for seq_len in (0, 1, 7, 33):
        for world_size in (1, 2, 3, 4):
            parts = [dcp_local_positions(seq_len, world_size, r, layout, interleave) for r in range(world_size)]
            assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq_len))


def test_dcp_positions_by_hand() -> None:
    """Each layout's own positions, not only a partition (any partition merges to the same attention, so the merge
    tests cannot tell layouts apart): sliced ranks hold ``cdiv(L, N)`` contiguous keys, the last the rest; striped
    ranks every ``N``-th key, or every ``N``-th group of ``I``."""
    def positions(seq_len, world_size, layout, interleave=1):
        return [dcp_local_positions(seq_len, world_size, r, layout, interleave).tolist() for r in range(world_size)]

    assert positions(8, 2, "sliced") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert positions(9, 3, "sliced") == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert positions(7, 3, "sliced") == [[0, 1, 2], [3, 4, 5], [6]]
    assert positions(7, 3, "striped") == [[0, 3, 6], [1, 4], [2, 5]]
    assert positions(9, 2, "striped", 2) == [[0, 1, 4, 5, 8], [2, 3, 6, 7]]


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_dcp_states_merged_in_one_process_and_a_layout_mismatch_fails(device, kind: str) -> None:
    """The DCP data path without the collective: each rank's ``decode_attention_fwd`` over its striped
    keys, packed as ``decode_attention_dcp`` packs them, merged by the stage-2 kernel
    (``merge_splits``), equals the golden model over all keys. Negative control: one rank lays its
    cache out with interleave 2 while the other uses 1 (mismatched interleave sizes), so some keys
    are held twice and others by no rank, and the merged result fails the tolerance."""
    lens, world_size, page_size = [0, 1, 23], 2, 4
    q, keys, values, cap = _problem(kind, lens)
    is_mla = kind == "mla"
    key_width, value_width = keys[0].shape[-1], values[0].shape[-1]
    kv = keys if is_mla else [torch.cat([k, v], dim=-1) for k, v in zip(keys, values)]
    widths = (is_mla, key_width, value_width)
    q = q.to(device)
    cache, table, seq_lens = _paged(kv, page_size, generator(0), device)
    ref_o, ref_lse = decode_attention(
        q, *_split_kv(cache, *widths), table, seq_lens, 0.2, page_size, logit_cap=cap, is_mla=is_mla,
        dtype=torch.float64,
    )  # fmt: skip
    rows, heads = q.shape[:2]

    def merged(interleaves: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        packed = nan_filled((world_size, rows, heads, value_width + 1), torch.float32, device)
        for rank, interleave in enumerate(interleaves):
            local = [t[dcp_local_positions(t.shape[0], world_size, rank, "striped", interleave)] for t in kv]
            local_cache, local_table, local_lens = _paged(local, page_size, generator(100 + rank), device)
            decode_attention_fwd(
                q, *_split_kv(local_cache, *widths), packed[rank, ..., :value_width], packed[rank, ..., value_width],
                local_table, local_lens, None, 1, 0.2, page_size, logit_cap=cap, is_mla=is_mla,
            )  # fmt: skip
        o = nan_filled((rows, heads, value_width), q.dtype, device)
        lse = nan_filled((rows, heads), torch.float32, device)
        merge_splits(packed.permute(1, 2, 0, 3), o, lse)
        return o, lse

    dtype = str(q.dtype).removeprefix("torch.")
    o, lse = merged([1, 1])
    assert_close(o, ref_o, ("decode_attention", "o", dtype))
    assert_close(lse, ref_lse, ("decode_attention", "lse", "float32"))
    bad_o, bad_lse = merged([1, 2])
    assert fails_tolerance(bad_o, ref_o, ("decode_attention", "o", dtype))
    assert fails_tolerance(bad_lse, ref_lse, ("decode_attention", "lse", "float32"))


def test_dcp_requires_an_initialized_group() -> None:
    if dist.is_initialized():
        pytest.fail("a process group leaked into the test process")
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        decode_attention_dcp(None, None, None, None, None, None, None, None, 1, 1.0, 1)


def test_dcp_names_a_group_that_is_not_one(tmp_path) -> None:
    """A ``group`` that is not a process group is a named error, not torch.distributed's failure inside."""
    if dist.is_initialized():
        pytest.fail("a process group leaked into the test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match=r"group: expected a torch\.distributed ProcessGroup or None, got str"):
            decode_attention_dcp(None, None, None, None, None, None, None, None, 1, 1.0, 1, group="x")
    finally:
        dist.destroy_process_group()
