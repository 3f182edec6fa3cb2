"""Argument checks shared by every public wrapper (SPEC section 8).

Shape, dtype and stride checks are free and always run. Checks of tensor *contents* (block-table
entries, slots) need a device-to-host read: they run by default, are skipped while a CUDA graph is
being captured, and serving switches them off with ``ATTNREF_CHECK_CONTENTS=0``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from triton_impl.interpreter import INTERPRET

CONTENT_CHECKS_ENV = "ATTNREF_CHECK_CONTENTS"


def content_checks_enabled() -> bool:
    """True unless ``ATTNREF_CHECK_CONTENTS=0`` or a CUDA graph is being captured."""
    if os.environ.get(CONTENT_CHECKS_ENV, "1") == "0":
        return False
    # is_initialized first: a process that never touched CUDA (or a forked child) cannot be capturing,
    # and asking would initialize CUDA there.
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def check_tensor(
    name: str,
    t: torch.Tensor | None,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    unit_last_stride: bool = True,
    kernel_arg: bool = True,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries in ``shape`` match any size.

    ``kernel_arg``: the kernel reads it, so compiled Triton needs it on a CUDA device (under the
    interpreter any device works: the interpreter copies to host).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if kernel_arg and not bool(INTERPRET) and t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor (Triton runs compiled here), got device {t.device}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name}: expected rank {' or '.join(map(str, allowed))}, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtypes is not None:
        allowed_dtypes = tuple(dtypes)
        if t.dtype not in allowed_dtypes:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in allowed_dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must have stride 1, got strides {t.stride()}")
    return t


def check_power_of_two(name: str, value: int, *, allow_zero: bool = False) -> None:
    """Widths that the kernels tile without masking must be powers of two."""
    if value == 0 and allow_zero:
        return
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two{' or 0' if allow_zero else ''}, got {value}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_block_table(
    name: str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
) -> None:
    """Entries that cover keys ``[0, seq_lens[b])`` of row ``b`` must address a page of the cache.

    Entries past a row's length are never read and may hold anything (serving pads with garbage).
    """
    if not content_checks_enabled() or block_table.numel() == 0:
        return
    used_pages = (seq_lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size
    if int(used_pages.max().item()) > block_table.shape[1]:
        raise ValueError(
            f"{name}: a row needs {int(used_pages.max().item())} pages but the table has {block_table.shape[1]} columns"
        )
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    read = cols[None, :] < used_pages[:, None].to(block_table.device)
    entries = block_table.to(torch.int64)
    bad = read & ((entries < 0) | (entries >= num_pages))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}: entry [{row}, {col}] = {int(entries[row, col])} is outside the cache's {num_pages} pages"
        )
