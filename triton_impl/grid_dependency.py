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
- Only while a CUDA graph is being captured (:class:`WhenCaptured`). Eager calls launched with PDL on the H200
  (driver of CUDA 13, Triton 3.6's launcher) stopped overlapping the host's launches with the GPU's work: back to
  back, a call took the host's time plus the GPU's (MLA decode B=8 H=16 L=4K 48-50 us, its graph replay 19.7;
  TurboQuant 4-bit decode B=8 L=4K 64-69 us, replay 31.3), where plain launches take the longer of the two.

:func:`supported` says where the launches ask for it; the interpreter never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from triton_impl.launch import device_arch


class WhenCaptured:
    """A launch taken plainly (``plain``) or, while the current stream is capturing a CUDA graph, with PDL
    (``overlapped``: the same kernel, arguments and grid), called as either: ``(stream, *arguments)``."""

    __slots__ = ("overlapped", "plain")

    def __init__(self, plain: Callable[..., None], overlapped: Callable[..., None]) -> None:
        self.plain, self.overlapped = plain, overlapped

    def __call__(self, stream: int | None, *args: Any) -> None:
        (self.overlapped if torch.cuda.is_current_stream_capturing() else self.plain)(stream, *args)


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
