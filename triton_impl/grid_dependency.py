"""Programmatic dependent launch (PDL, compute capability 9.0 and later): a kernel's successor on the stream starts
before the kernel ends.

A split-KV call is two or three kernels in a row (the TurboQuant decode: the query's rotation, stage 1, the split
merge), each reading what the one before wrote. Launched plainly, each waits for the one before to finish and then
for its own launch: a gap of 1-2 us on the H200 at each boundary, beside kernels of 5-150 us. Launched with the
``launch_pdl`` option, a kernel (the *dependent*) may start once every program of the kernel before it (the
*primary*) has executed ``griddepcontrol.launch_dependents`` (:func:`launch_dependents`) or exited; it must then
execute ``griddepcontrol.wait`` (:func:`wait_for_primary`), which returns when the primary has finished and its
writes are visible, before it reads anything the primary writes, or writes anything the primary reads. What it
does before the wait (its set-up, reads of tensors written earlier) runs under the primary's last programs.

The rules this package keeps:

- A primary triggers its dependents at its start. The dependent's programs then take the SM slots the primary's
  last wave frees; the primary has no programs left to launch by then (all of them had to start to trigger).
- A dependent reads before its wait only tensors that no kernel still running can write: it is launched after a
  primary that was itself launched plainly (so every kernel before that primary has finished) and that writes none
  of them. The split merge waits before anything.
- Both instructions are no-ops in a kernel launched plainly, so a kernel carries them whether or not a call
  launches it with PDL. CUDA graphs capture PDL launches as programmatic edges: a replay keeps the overlap.

:func:`supported` says where the launches ask for it; the interpreter never does.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from triton_impl.launch import device_arch


def supported(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA device of compute capability 9.0 or later, compiled."""
    arch = device_arch(device)
    return arch.startswith("sm") and int(arch[2:]) >= 90


@gluon.jit
def launch_dependents():
    """Let the kernel after this one (launched with PDL) start its programs (a no-op otherwise)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)  # fmt: skip


@gluon.jit
def wait_for_primary():
    """Wait until the kernel before this one has finished and its writes are visible (a no-op without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
