"""How kernels are launched: the launch-config table entry for a device, and launches without
Triton's per-call binding once a variant has been compiled.

``kernel[grid](*args, **constexprs)`` re-derives on every call what it needs to find the compiled
variant: it binds the arguments, specializes each one (dtype, 16-byte alignment of pointers,
divisibility of integers by 16, integers equal to 1), builds a string cache key, checks the
globals the kernel used and asks the driver for the current stream. On the H200's host that is
tens of microseconds per launch, more than many decode kernels take on the GPU
(``notebooks/results/serving_h200.md``).

:func:`launch` does the first call for each key the usual way and keeps the ``CompiledKernel``
it returns. The key holds, per tensor argument, its dtype and whether its address is a multiple of
16 (what Triton specializes a pointer on), every other runtime argument by its exact value (finer
than Triton's facts about an integer: equal to 1, a multiple of 16, fits 32 bits), and the
constexpr parameters and launch options. Later calls with the same key go straight to the
compiled launcher on the current stream. A call whose facts differ (a misaligned view, another
stride) makes a new key, so it never runs a variant compiled for other facts. The key costs about
3 us for a 47-argument kernel on a 2-core CPU, against the binding, specialization, string key and
driver queries of a plain launch. Under the interpreter :func:`launch` is ``kernel[grid](...)``.

:class:`Launch` goes further for a wrapper that has already keyed its call (the attention
wrappers key a plan on every argument's layout, ``triton_impl.validation``, and keep their plans
in a :class:`Plans`): it holds the grid, the launch arguments that follow the tensors and the
constexprs, so a call passes only its tensors to the compiled launcher: 0.6-0.8 us of Python per
launch on the 2-core CPU (``benchmarks/host_overhead_cpu.py``). Both ask for the device and
stream with :func:`current_target`.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import triton
from triton import knobs

from triton_impl.interpreter import INTERPRETING

Config = TypeVar("Config")


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device: torch.device) -> str:
    """The key launch-config tables use for ``device``: ``"interpreter"`` under
    ``TRITON_INTERPRET=1``, ``"sm<major><minor>"`` for a CUDA device (``"sm90"``: H100/H200),
    ``"default"`` otherwise."""
    if INTERPRETING:
        return "interpreter"
    if device.type != "cuda":
        return "default"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def select_config(configs: Mapping[str, Config], device: torch.device) -> Config:
    """``configs[device_arch(device)]``, or ``configs["default"]`` when the table has no entry for it.

    Every op's launch configs are such a table: data keyed by where the kernel runs, each entry
    with the measurement that chose it written beside it. The choice never depends on the batch.
    """
    return configs.get(device_arch(device), configs["default"])


def with_overrides(config: Config, suffix: str) -> dict:
    """``config`` with every key ending in ``suffix`` (any case) put in place of its base key: an entry's
    exceptions for one kind of launch, kept beside the rule (``maxnreg_h16`` -> ``maxnreg`` where the head
    tile is 16 heads; ``PREFETCH_k4`` -> ``PREFETCH`` for 4-bit keys)."""
    n = len(suffix)
    return {**config, **{k[:-n]: v for k, v in config.items() if k.lower().endswith(suffix.lower())}}


def register_cap(maxnreg: int | None) -> dict[str, int]:
    """The launch option capping registers per thread: ``{"maxnreg": maxnreg}``, or none for 0/None
    (the compiler's choice). Spread into a launch's keyword arguments."""
    return {"maxnreg": maxnreg} if maxnreg else {}


_MAX_ENTRIES = 4096  # variants (and wrapper plans) kept; a serving process uses a few dozen

# ``(id(kernel), device, key) -> (CompiledKernel, names of the constexpr parameters in signature order)``.
_COMPILED: dict[tuple, tuple[Any, tuple[str, ...]]] = {}

# Called with each CompiledKernel launched through :func:`launch` or a :class:`Launch` (for
# ``bench.capture_launches``).
on_launch: Callable[[Any], None] | None = None

# The current CUDA device and the raw handle of its current stream, as Triton's own launcher asks
# for them: C calls (``torch.cuda.current_stream()`` builds a Python ``Stream``: microseconds).
# Absent from a CPU build of torch, where only the interpreter runs.
_get_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
_get_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_target() -> tuple[int, int | None]:
    """``(index of the current CUDA device, raw handle of its current stream)``: where a launch
    runs. ``(0, None)`` under the interpreter."""
    if INTERPRETING:
        return 0, None
    index = _get_device()
    return index, _get_stream(index)


def _remember(entries: dict, key: Any, value: Any) -> None:
    """``entries[key] = value``, emptying ``entries`` first once it holds ``_MAX_ENTRIES``."""
    if len(entries) >= _MAX_ENTRIES:
        entries.clear()
    entries[key] = value


_ALL_PLANS: weakref.WeakSet = weakref.WeakSet()


def forget_plans() -> None:
    """Empty every wrapper's plans. A plan holds the launch config the table gave when it was made;
    a process that edits a config table (a sweep) calls this after each edit."""
    for plans in list(_ALL_PLANS):
        plans.clear()


class Plans:
    """A wrapper's plans by call key, the last one found kept aside: a call with its previous
    call's layout (every layer of a model step) compares its key with that one instead of hashing
    it (a decode key: 0.65 us instead of 1.3 us for the dictionary on the 2-core CPU). At most
    ``_MAX_ENTRIES`` plans (emptied when full)."""

    __slots__ = ("__weakref__", "_by_key", "_last")

    def __init__(self) -> None:
        self._by_key: dict = {}
        self._last: tuple = (None, None)  # (key, plan), replaced as one object
        _ALL_PLANS.add(self)

    def clear(self) -> None:
        self._by_key.clear()
        self._last = (None, None)

    def get(self, key: tuple) -> Any:
        """The plan of ``key``, or None. Raises TypeError for an unhashable key (and whatever an
        element's comparison raises)."""
        last_key, plan = self._last
        if key == last_key:
            return plan
        plan = self._by_key.get(key)
        if plan is not None:
            self._last = (key, plan)
        return plan

    def add(self, key: tuple, plan: Any) -> None:
        _remember(self._by_key, key, plan)
        self._last = (key, plan)


class _CacheAddress:
    """What a tensor descriptor keeps of its tensor, without the tensor: the address (the launcher reads
    ``data_ptr()``) and the dtype (the first launch specializes on it)."""

    __slots__ = ("_address", "dtype")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._address, self.dtype = tensor.data_ptr(), tensor.dtype

    def data_ptr(self) -> int:
        return self._address


class DescriptorsByAddress:
    """A plan's ``(cache, layout) -> descriptors`` (``make``: ``decode_attention.tma_descriptors`` or the sm_90
    kernels' ``descriptors``), remembered by the cache's address. A plan fixes the cache's dtype, shape and strides,
    so the address is all that changes from call to call (each layer of a model has its own cache). The remembered
    descriptors hold the address, not the tensor: a cache the caller frees is freed, and a new cache at that address
    with the plan's layout gets the very same descriptors. Building two descriptors is 2.5-3 us of host time on the
    2-core CPU (Triton's checks in ``TensorDescriptor``), a lookup ~0.2 us. At most ``_MAX_ENTRIES`` addresses
    (emptied when full). Under the interpreter, which reads the cache through the descriptor, every call builds them
    on the tensor itself."""

    __slots__ = ("_by_address", "_make")

    def __init__(self, make: Callable[[Any, Any], tuple]) -> None:
        self._make = make
        self._by_address: dict[int, tuple] = {}

    @property
    def make(self) -> Callable[[Any, Any], tuple]:
        """What builds the descriptors."""
        return self._make

    def __call__(self, cache: torch.Tensor, layout: Any) -> tuple:
        if layout is None or INTERPRETING:
            return self._make(cache, layout)
        address = cache.data_ptr()
        found = self._by_address.get(address)
        if found is None:
            found = self._make(_CacheAddress(cache), layout)
            _remember(self._by_address, address, found)
        return found


def no_launch(stream: int | None, *head: Any) -> None:
    """Called like a :class:`Launch`, launches nothing: a plan's launch when there is no work
    (no rows or heads)."""


def _hook_active(hook: Any) -> bool:
    """Whether a launch hook would do anything: not None and, for Triton's ``HookChain`` (Triton
    3.6's default hooks are empty chains, never None), holding a call. An inactive pair skips
    ``launch_metadata`` and both hook calls: about 3 us of host time per launch on the H200."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _DescriptorLauncher:
    """Triton 3.6's launcher of a kernel with tensor-descriptor parameters, without the per-call encoding of each
    descriptor. Triton wraps the C launcher in a Python function that, on every call, walks the arguments and
    encodes each descriptor into a ``CUtensorMap`` (``make_tensordesc_arg``: a ``cuTensorMapEncodeTiled``) followed
    by its shape and strides. A descriptor that a :class:`DescriptorsByAddress` hands out again encodes to the same
    bytes, so its encoding is kept here, by the descriptor object (held, so its id stays its own), and the C launcher
    is called directly. :meth:`of` returns None where the launcher is not the one this mirrors (another Triton, a
    kernel with scratch memory, no descriptor among the varying arguments): those launches keep Triton's path."""

    __slots__ = ("_base", "_encode", "_encoded", "_launch", "_meta_at")

    def __init__(self, launch: Callable, base: tuple, meta_at: dict[int, Any], encode: Callable) -> None:
        self._launch, self._base, self._meta_at, self._encode = launch, base, meta_at, encode
        self._encoded: dict[int, tuple[Any, list]] = {}

    @classmethod
    def of(cls, run: Any, heads: int) -> _DescriptorLauncher | None:
        """The launcher of ``run`` (a ``CompiledKernel.run``) whose descriptors are among its first ``heads``
        arguments, or None."""
        try:
            from triton.backends.nvidia import driver as nvidia

            free = inspect.getclosurevars(run.launch).nonlocals
        except (ImportError, AttributeError, TypeError):
            return None
        launch, indices, metas = free.get("launcher"), free.get("tensordesc_indices"), free.get("tensordesc_meta")
        encode = getattr(nvidia, "make_tensordesc_arg", None)
        if launch is None or not indices or not metas or encode is None:
            return None
        if getattr(nvidia, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" or max(indices) >= heads:
            return None
        if run.global_scratch_size or run.profile_scratch_size or any(meta is None for meta in metas):
            return None
        return cls(launch, (run.launch_cooperative_grid, run.launch_pdl, None, None), dict(zip(sorted(indices), metas)),
                   encode)  # fmt: skip

    def __call__(self, gx: int, gy: int, gz: int, stream: int | None, function: Any, packed: Any, head: tuple,
                 params: tuple) -> None:  # fmt: skip
        args = []
        for position, arg in enumerate(head):
            meta = self._meta_at.get(position)
            if meta is None:
                args.append(arg)
                continue
            found = self._encoded.get(id(arg))
            if found is None:
                found = (arg, self._encode(arg, meta))
                _remember(self._encoded, id(arg), found)
            args.extend(found[1])
        self._launch(gx, gy, gz, stream, function, *self._base, packed, None, None, None, *args, *params)


@functools.cache
def cluster_launches() -> bool:
    """Whether this Triton's NVIDIA launcher can launch a compiled kernel in thread-block clusters: its packed
    metadata is ``(num_warps, num_ctas, shared)``, and a launch with ``num_ctas`` > 1 runs ``grid x * num_ctas``
    programs in clusters of ``num_ctas`` consecutive ones along x (Triton 3.6 to 3.9)."""
    try:
        from types import SimpleNamespace

        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        return False
    try:
        packed = CUDABackend.pack_metadata(None, SimpleNamespace(num_warps=3, num_ctas=5, shared=7))
    except Exception:  # another layout of the metadata
        return False
    return packed == (3, 5, 7)


@triton.jit
def _empty_kernel():
    """Nothing: a compiled function to ask the driver about occupancy (:func:`cluster_capacity`)."""


@functools.cache
def cluster_capacity(index: int, cluster: int) -> int:
    """How many thread-block clusters of ``cluster`` programs of 4 warps, each program holding an SM's shared memory
    to itself, CUDA device ``index`` runs at once (``cuOccupancyMaxActiveClusters``): a cluster's programs share one
    GPC, so this is below ``SMs // cluster`` wherever a GPC's SMs are not a multiple of ``cluster``. 0 where the
    driver cannot tell."""
    if not cluster_launches():
        return 0
    try:
        from triton.runtime import driver

        with torch.cuda.device(index):
            compiled = _empty_kernel.warmup(grid=(1,), num_warps=4)
            compiled._init_handles()
            shared = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
            return int(driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, cluster))
    except Exception:  # no such query in this Triton or driver
        return 0


class Launch:
    """``kernel[grid](*head, *tail, **constexprs)`` with ``grid``, ``tail`` and ``constexprs`` fixed.

    ``Launch(kernel, grid, tail, constexprs)(stream, *head)`` launches on ``stream`` (from
    :func:`current_target`); ``head`` holds the arguments that change from call to call (tensors).
    The first call launches the usual way and keeps the ``CompiledKernel`` Triton returns; later
    calls go straight to its launcher. So every fact Triton specializes ``head`` on (dtype and
    16-byte alignment of each tensor, the value of anything else) and the current device must be
    those of the first call: the public wrappers keep one ``Launch`` per such key (their plans).
    Under the interpreter every call is ``kernel[grid](...)``. A kernel with tensor descriptors among ``head``
    launches through a :class:`_DescriptorLauncher` where Triton's launcher allows it (each descriptor encoded once).

    ``cluster`` > 1 (sm_90 and later, where :func:`cluster_launches`; not under the interpreter) launches the
    ``grid[0]`` programs in thread-block clusters of ``cluster`` consecutive program ids, which the GPU runs at
    the same time on one GPC: a kernel compiled as usual may then wait for the rest of its cluster
    (``barrier.cluster``). ``grid[0]`` must be a multiple of ``cluster``; the first call compiles without
    launching and every call, the first included, launches through the compiled launcher.
    """

    __slots__ = ("_cluster", "_compiled", "_constexprs", "_described", "_grid", "_kernel", "_launcher", "_params",
                 "_tail")  # fmt: skip

    def __init__(self, kernel: Any, grid: tuple[int, ...], tail: tuple, constexprs: dict[str, Any],
                 cluster: int = 1) -> None:  # fmt: skip
        if cluster > 1 and (grid[0] % cluster or len(grid) > 1 or not cluster_launches()):
            raise ValueError(f"cluster: {cluster} programs a cluster cannot launch grid {grid} here")
        self._kernel, self._grid, self._tail, self._constexprs = kernel, grid, tail, constexprs
        self._cluster = cluster
        self._compiled: Any = None
        self._launcher: tuple = ()  # (run, grid x, y, z, function, packed metadata), once compiled
        self._described: _DescriptorLauncher | None = None
        self._params: tuple = ()  # tail, then the constexpr values in signature order

    @property
    def kernel(self) -> Any:
        """The kernel it launches."""
        return self._kernel

    def __call__(self, stream: int | None, *head: Any) -> None:
        if not self._launcher:
            self._first(stream, head)
            return
        run, gx, gy, gz, function, packed = self._launcher
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if not (_hook_active(enter) or _hook_active(leave)):  # no launch hook: no metadata for one
            if self._described is not None:
                self._described(gx, gy, gz, stream, function, packed, head, self._params)
            else:
                run(gx, gy, gz, stream, function, packed, None, None, None, *head, *self._params)
        else:
            params = (*head, *self._params)
            metadata = self._compiled.launch_metadata((gx, gy, gz), stream, *params)
            run(gx, gy, gz, stream, function, packed, metadata, enter, leave, *params)
        if on_launch is not None:
            on_launch(self._compiled)

    def _first(self, stream: int | None, head: tuple) -> None:
        kernel, constexprs = self._kernel, self._constexprs
        names = kernel.arg_names[len(head) + len(self._tail) :]
        if self._cluster > 1:  # compiled here, launched below in clusters
            if INTERPRETING or not all(name in constexprs for name in names):
                raise ValueError("cluster: a clustered launch needs a GPU and every constexpr given")
            compiled = kernel.warmup(*head, *self._tail, grid=self._grid, **constexprs)
            compiled._init_handles()  # loads the module: the launcher and the function handle
        else:
            compiled = kernel[self._grid](*head, *self._tail, **constexprs)
        if INTERPRETING or compiled is None:
            return
        if all(name in constexprs for name in names):  # else a defaulted constexpr: stay on kernel[grid]
            self._params = (*self._tail, *(constexprs[name] for name in names))
            self._compiled = compiled
            # Loaded by the launch (or the load) above: the launcher, and the function handle it launches.
            packed, gx = compiled.packed_metadata, self._grid[0]
            if self._cluster > 1:  # gx clusters of `cluster` programs each (cluster_launches)
                packed, gx = (packed[0], self._cluster, packed[2]), gx // self._cluster
            self._launcher = (compiled.run, gx, *(*self._grid[1:], 1, 1)[:2], compiled.function, packed)
            self._described = _DescriptorLauncher.of(compiled.run, len(head))
        if self._cluster > 1:
            self(stream, *head)  # the first clustered launch (and its on_launch)
        elif on_launch is not None:
            on_launch(compiled)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """``kernel[grid](*args, **constexprs)``, with the runtime arguments positional and every
    constexpr parameter and launch option (``num_warps``, ...) by keyword."""
    if INTERPRETING:
        kernel[grid](*args, **constexprs)
        return
    facts = [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args]
    device, stream = current_target()
    key = (id(kernel), device, *facts, *constexprs.items())
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constexprs)
        names = tuple(kernel.arg_names[len(args) :])
        if compiled is not None and all(name in constexprs for name in names):
            _remember(_COMPILED, key, (compiled, names))
        if on_launch is not None and compiled is not None:
            on_launch(compiled)
        return
    compiled, names = entry
    grid3 = (*grid, 1, 1)[:3]
    params = (*args, *(constexprs[name] for name in names))
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not (_hook_active(enter) or _hook_active(leave)):
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *params)
    else:
        metadata = compiled.launch_metadata(grid3, stream, *params)
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *params)
    if on_launch is not None:
        on_launch(compiled)
