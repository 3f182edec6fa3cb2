"""Decode context parallelism with NCCL on GPUs: the gloo test's check, compiled, one GPU per rank.

Run on a machine with 2 (or more) GPUs, from the repository root:

    PYTHONPATH=. torchrun --nproc-per-node 2 tests/dcp_nccl_check.py

Every rank builds the same global problem, keeps its striped or sliced part of each request's
keys, runs ``triton_impl.decode_attention.decode_attention_dcp`` over NCCL and compares the merged
``(o, lse)`` with the single-process float64 golden model (``tests/test_decode_attention_dcp.py``).
Rank 0 prints ``DCP NCCL check passed on N ranks``; a mismatch raises on the failing rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.test_decode_attention_dcp import CASES, run_dcp_check


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", local_rank)
        run_dcp_check(rank, world_size, device, CASES)
        run_dcp_check(rank, world_size, device, CASES, lens=(0, 1, 700, 4097, 64))
        dist.barrier()
        if rank == 0:
            print(f"DCP NCCL check passed on {world_size} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
