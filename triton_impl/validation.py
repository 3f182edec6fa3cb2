"""Argument checks shared by every public wrapper.

Shape, dtype and stride checks read only metadata: they are free and always run. Checks of tensor
*contents* (block-table entries, slots, lengths) need a device-to-host read, a synchronization that
costs several times the kernel on the serving path. So they are opt-in on CUDA
(``ATTNREF_CHECK_CONTENTS=1``) and on by default under the interpreter (``ATTNREF_CHECK_CONTENTS=0``
turns them off); the variable is read at each call, and they are always skipped while a CUDA graph
is being captured. The test suite turns them on.

Memory safety never depends on them: every kernel bounds each table entry and slot it uses against
the tensors it was given, on the device. A row whose keys would come from a page outside the cache
gets ``o = NaN, lse = NaN``; a write to a slot outside the cache is skipped, like a ``-1`` slot.
The kernels read lengths as int32, so an int64 length outside int32 (``2**32 + 3`` read as 3) is
caught by the content checks only (:func:`check_int32_lengths`); what the kernel then reads is
still bounded by the table.

The attention wrappers (decode, verify, both merges) run their metadata checks once per distinct
call layout: they key a plan on :func:`tensor_facts` of every tensor and on every other argument
(with its type where a check looks at the type), and a call whose key has a plan passed the same
checks, which read nothing but what the key holds.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Sequence

import torch

from triton_impl.interpreter import INTERPRETING

CONTENT_CHECKS_ENV = "ATTNREF_CHECK_CONTENTS"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` is a constexpr function: microseconds a call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), for host code."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# CPython's os.environ keeps the encoded variables in a dict: asking it whether the variable is
# set skips the KeyError that os.environ.get raises and catches for an unset one (0.7 us -> 0.04 us
# on the 2-core CPU; unset is the serving default).
try:
    _ENVIRON_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(CONTENT_CHECKS_ENV)
except AttributeError:
    _ENVIRON_DATA, _ENV_KEY = None, None


def _content_checks_setting() -> str | None:
    """``os.environ.get(CONTENT_CHECKS_ENV)``, read at each call."""
    if _ENVIRON_DATA is not None and _ENV_KEY not in _ENVIRON_DATA:
        return None
    return os.environ.get(CONTENT_CHECKS_ENV)


def content_checks_enabled(device: torch.device) -> bool:
    """Whether this call may read tensor contents on the host (``device``: where they live).

    ``ATTNREF_CHECK_CONTENTS=1`` or ``0`` decides; unset, they run only off CUDA (the interpreter),
    where reading costs no synchronization. Never while a CUDA graph is being captured.
    """
    return content_checks_on(device.type == "cuda")


def content_checks_on(on_cuda: bool) -> bool:
    """:func:`content_checks_enabled` for tensors that live (``on_cuda``) or do not live on a CUDA
    device: a wrapper keeps the bool in its plan (``torch.device.type`` costs 0.25 us a read)."""
    setting = _content_checks_setting()
    if setting == "0" or (setting is None and on_cuda):
        return False
    # is_initialized first: a process that never touched CUDA (or a forked child) cannot be capturing,
    # and asking would initialize CUDA there.
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def tensor_facts(t: torch.Tensor | None) -> tuple | None:
    """What a wrapper's checks and the compiled kernel variant depend on, for a plan key: type,
    dtype, shape, strides, device and whether the address is a multiple of 16 (Triton specializes
    a pointer on it). None for None; most non-tensors raise AttributeError (the caller then runs
    the checks, which name the argument). About 0.45 us a tensor on the 2-core CPU."""
    if t is None:
        return None
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16 == 0)


def check_tensor(
    name: str,
    t: torch.Tensor | None,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    unit_last_stride: bool = True,
    kernel_arg: bool = True,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries in ``shape`` match any size.

    ``kernel_arg``: the kernel reads it, so compiled Triton needs it on a CUDA device (under the
    interpreter any device works: the interpreter copies to host).
    """
    # On the serving path of every call: each tensor attribute is read once (a torch attribute
    # read costs about a microsecond on the host).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if kernel_arg and not INTERPRETING and not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor (Triton runs compiled here), got device {t.device}")
    sizes = t.shape
    rank = len(sizes)
    if ndim is not None and rank != ndim and (isinstance(ndim, int) or rank not in ndim):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        raise ValueError(f"{name}: expected rank {' or '.join(map(str, allowed))}, got shape {tuple(sizes)}")
    if shape is not None and (rank != len(shape) or any(e is not None and e != a for e, a in zip(shape, sizes))):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(sizes)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if unit_last_stride and rank > 0 and sizes[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must have stride 1, got strides {t.stride()}")
    return t


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def check_scale(name: str, scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A dequantization scale: a one-element float tensor on ``device``, or None for 1.0.

    The 1.0 tensor is made once per device (no allocation or copy per call, none inside a CUDA
    graph capture once a call has run eagerly).
    """
    if scale is None:
        return _unit_scale(device)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
        raise TypeError(f"{name}: expected a one-element float tensor or None, got {scale!r}")
    if scale.device != device:
        raise ValueError(f"{name}: expected device {device}, got {scale.device}")
    return scale


def check_lengths(
    name: str, t: torch.Tensor, min_rows: int, device: torch.device, dtypes: Iterable[torch.dtype]
) -> None:
    """A vector of per-row lengths with at least ``min_rows`` entries (a worst-case buffer serves a
    smaller batch; entries past ``min_rows`` are never read), any stride."""
    check_tensor(name, t, ndim=1, dtypes=tuple(dtypes), device=device, unit_last_stride=False)
    if t.shape[0] < min_rows:
        raise ValueError(f"{name}: expected >= {min_rows} entries (one per row), got {t.shape[0]}")


def check_split_workspace(
    t: torch.Tensor | None, rows: int, num_heads: int, num_splits: int, value_width: int, device: torch.device
) -> torch.Tensor:
    """``attn_logits``, the split-KV scratch ``[>= rows, H, S, Lv + 1]`` fp32 (a worst-case
    workspace serves a smaller batch); returns its first ``rows`` rows."""
    check_tensor("attn_logits", t, ndim=4, dtypes=(torch.float32,), device=device)
    want = (num_heads, num_splits, value_width + 1)
    if tuple(t.shape[1:]) != want or t.shape[0] < rows:
        raise ValueError(
            f"attn_logits: expected [>= {rows}, {', '.join(map(str, want))}] (rows, H, splits, Lv + 1), "
            f"got {list(t.shape)}"
        )
    return t[:rows]


def check_power_of_two(name: str, value: int, *, allow_zero: bool = False) -> None:
    """Widths that the kernels tile without masking must be powers of two."""
    if value == 0 and allow_zero:
        return
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two{' or 0' if allow_zero else ''}, got {value}")


def is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an ``int`` to Python, and would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_int_at_least(name: str, value: int, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def check_int_choice(name: str, value: int, choices: Sequence[int], when: str = "") -> None:
    """One of ``choices``, as an int (``4.0`` equals 4 but is not one; nor is ``True``); ``when`` says under which
    other argument's value, in the message."""
    if not is_int(value) or value not in choices:
        raise ValueError(f"{name}: expected {' or '.join(map(str, choices))}{when and ' ' + when}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """A bool (or the int 0 or 1): a string or a float is not a flag, however truthy."""
    if not isinstance(value, int) or value not in (0, 1):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_float(name: str, value: object) -> float:
    """A finite scalar the kernels take as an fp32 argument: anything ``float()`` takes (a Python or NumPy number,
    a one-element tensor) but a bool or a string; returns it as a float."""
    try:
        converted = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, RuntimeError):
        converted = math.nan
    if not math.isfinite(converted):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    return converted


def block_table_2d(
    name: str, table: torch.Tensor, *, min_rows: int, device: torch.device, dtypes: Iterable[torch.dtype]
) -> torch.Tensor:
    """A block table as ``[rows, columns]``: ``[rows, columns]`` or ``[rows, columns, 1]`` (a trailing
    unit dimension, as some callers build it; the kernels index it by its first two strides), at
    least ``min_rows`` rows (a table sized for the largest batch serves a smaller one), any strides.
    """
    check_tensor(name, table, ndim=(2, 3), dtypes=dtypes, device=device, unit_last_stride=False)
    if table.dim() == 3:
        if table.shape[2] != 1:
            raise ValueError(f"{name}: expected [rows, columns] or [rows, columns, 1], got {list(table.shape)}")
        table = table[:, :, 0]
    if table.shape[0] < min_rows:
        raise ValueError(f"{name}: expected >= {min_rows} rows, got {list(table.shape)}")
    return table


def check_int32_lengths(name: str, lengths: torch.Tensor) -> None:
    """A content check: every entry of an int64 vector of lengths fits int32, as the kernels read it (an entry of
    ``2**32 + 3`` would be read as 3, ``-2**32 + 3`` as 3 where the check below clamps it to 0)."""
    if lengths.dtype != torch.int64 or lengths.numel() == 0:
        return
    outside = (lengths < -(2**31)) | (lengths >= 2**31)
    if bool(outside.any()):
        i = int(outside.nonzero()[0, 0])
        raise ValueError(f"{name}: entry {i} = {int(lengths[i])} is outside int32 (the kernels read lengths as int32)")


def check_block_table(
    name: str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
    lens_name: str = "seq_lens",
) -> None:
    """Lengths that fit int32 (:func:`check_int32_lengths`, the lengths named ``lens_name``); entries that cover
    keys ``[0, seq_lens[b])`` of row ``b`` must address a page of the cache.

    A content check (see :func:`content_checks_enabled`). Entries past a row's length are never
    read and may hold anything (serving pads with garbage). The kernels bound every entry they
    read on the device whether or not this runs.
    """
    if not content_checks_enabled(block_table.device) or block_table.numel() == 0 or seq_lens.numel() == 0:
        return
    check_int32_lengths(lens_name, seq_lens)
    block_table = block_table[: seq_lens.shape[0]]
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
