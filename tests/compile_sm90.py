"""Check on a CPU that every kernel variant the tests launch also compiles for Hopper (sm_90).

A pytest plugin, off unless ``ATTNREF_COMPILE_SM90=1``::

    ATTNREF_COMPILE_SM90=1 PYTHONPATH=. .venv/bin/python -m pytest -p tests.compile_sm90 tests/ -q \
        --ignore=tests/test_notebooks.py

It also runs with the H200's Triton 3.6 from a separate venv (NumPy below 2.4, whose interpreter
breaks 3.6's), e.g. for ``benchmarks/sass_sm90.py``'s register and stack counts as that GPU compiles them::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 "numpy<2.4" einops \
        hypothesis pytest pytest-xdist
    ATTNREF_COMPILE_SM90=1 ATTNREF_COMPILE_SM90_REPORT=/tmp/sass.jsonl PYTHONPATH=. /tmp/t36/bin/python -m pytest \
        -q -n 0 -p tests.compile_sm90 -p no:cacheprovider benchmarks/sass_sm90.py

Under the Triton interpreter a kernel is never compiled, so a kernel that the interpreter runs can
still fail to compile on a GPU (a run-time ``if`` whose branches give tiles of different shapes,
``tl.dot`` with a dimension < 16, a non-power-of-two ``tl.arange``, too much shared memory ...).
This plugin wraps ``InterpretedFunction.run``: at every launch (and ``warmup``) it derives what a
compiled ``JITFunction.run`` would compile -- the signature (``*bf16`` for a bf16 tensor, ``i32``
or ``i64`` for an int by its value, ``fp32`` for a float, ints equal to 1 as constexprs), the
constexprs, the divisibility-by-16 attributes and the launch options (``num_warps``,
``num_stages``, ...) -- with Triton's own binder for the target ``GPUTarget("cuda", 90, 32)``.
Each distinct (kernel, signature, constexprs, options) is compiled once, by
``triton.compiler.compile(ASTSource(...), target=...)``, down to PTX and a cubin with the ptxas
bundled in the Triton wheel; a kernel whose shared memory exceeds an H100/H200's 227 KiB per block
(``OutOfResources`` at load time on the GPU) counts as a failure too. The interpreted launch then
proceeds as usual, so the tests still check numerics.

The compiles run in a separate worker process started with ``TRITON_INTERPRET=0``: there the
kernel modules are imported as compiled Triton sees them (real ``JITFunction`` objects, and
``triton_impl.interpreter.INTERPRET`` false, so ``cast_for_store`` and friends take their GPU
branch), a compiler crash cannot take pytest down, and compiling overlaps the tests. Kernels are
found there by module and qualified name, so they must be module-level. Host code still runs in
interpreter mode, so one host-side value is translated: ``dot_dtype`` returns fp32 under the
interpreter but the 16-bit query type on a GPU; the plugin marks its fp32 results and compiles with
the GPU's dtype. Other host-side ``INTERPRET`` branches (the interpreter's launch configs) are not
translated: a GPU-only config is checked only when a test launches it.

At the end of the session it prints the variants compiled and every failure (kernel, variant, the
first lines of the error) and turns a passing run into a failing one (exit status 1) when any
variant fails to compile. Triton here (CPU toolchain) may be newer than on the GPU machine, so an
error that only the GPU's Triton raises can be missed.

Environment: ``ATTNREF_COMPILE_SM90_JOBS`` (worker processes, default 1),
``ATTNREF_COMPILE_SM90_REPORT`` (a path: every variant and its outcome as JSON lines, with the
HGMMA and HMMA counts of its SASS and its registers and stack bytes per thread),
``ATTNREF_COMPILE_SM90_TIMEOUT`` (seconds to wait for outstanding compiles at the end, default
1800), ``ATTNREF_COMPILE_SM90_ERROR_LINES`` (lines of each error in the summary, default 12).
Under pytest-xdist (``-n``, on by default in pyproject) every xdist worker checks its own launches
with its own compile worker and hands its variants to the controller, which reports them all; a
variant launched in two xdist workers may be compiled twice. On a 2-core machine ``-n 0`` with
``ATTNREF_COMPILE_SM90_JOBS=1`` is as fast: the compiles, not the tests, take most of the time.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any

import pytest

ENV_FLAG = "ATTNREF_COMPILE_SM90"
TARGET = ("cuda", 90, 32)
# cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100 / H200: what Triton checks at load time.
MAX_SHARED_SM90 = 232448

# ----------------------------------------------------------------------------------------------
# The wire between pytest and a compile worker: length-prefixed pickles.
# ----------------------------------------------------------------------------------------------


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


# Constexpr values cross the wire as plain data: ("dtype", name), ("jit", module, qualname), tuples.


def _encode_constexpr(value: Any, dot_markers: dict[int, Any]) -> Any:
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        value = dot_markers.get(id(value), value)  # an interpreter-mode dot_dtype -> the GPU's dtype
        return ("dtype", value.name)
    if isinstance(value, tuple):
        return ("tuple", tuple(_encode_constexpr(v, dot_markers) for v in value))
    fn = getattr(value, "fn", None)
    if fn is not None and callable(fn) and hasattr(fn, "__qualname__"):  # a jit function as a constexpr
        return ("jit", fn.__module__, fn.__qualname__)
    return ("value", value)


def _decode_constexpr(value: Any) -> Any:
    import triton.language as tl

    kind = value[0]
    if kind == "dtype":
        return tl.dtype(value[1])
    if kind == "tuple":
        return tuple(_decode_constexpr(v) for v in value[1])
    if kind == "jit":
        return _resolve_kernel(value[1], value[2])
    return value[1]


def _describe_constexpr(value: Any) -> str:
    kind = value[0]
    if kind == "tuple":
        return "(" + ", ".join(_describe_constexpr(v) for v in value[1]) + ")"
    if kind == "jit":
        return f"{value[1]}.{value[2]}"
    return str(value[1]) if kind == "dtype" else repr(value[1])


# ----------------------------------------------------------------------------------------------
# Worker process: TRITON_INTERPRET=0, compiles one request at a time.
# ----------------------------------------------------------------------------------------------


def _resolve_kernel(module_name: str, qualname: str):
    import importlib

    from triton.runtime.jit import JITFunction

    if "<locals>" in qualname:
        raise LookupError(f"{module_name}.{qualname}: the compile worker can only import module-level kernels")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module_name}.{qualname} is {type(obj).__name__} in the worker, not a JITFunction")
    return obj


@contextlib.contextmanager
def _capture_fd2():
    """Collect what C++ (MLIR diagnostics, ptxas) and Python write to fd 2 meanwhile."""
    captured: dict[str, str] = {}
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured["text"] = tmp.read().decode(errors="replace")


def _compile_request(req: dict[str, Any]) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    start = time.perf_counter()
    result: dict[str, Any] = {"id": req["id"]}
    with _capture_fd2() as stderr:
        try:
            fn = _resolve_kernel(req["module"], req["qualname"])
            constexprs = {path: _decode_constexpr(v) for path, v in req["constexprs"].items()}
            src = ASTSource(fn, dict(req["signature"]), constexprs, req["attrs"])
            options = {"enable_fp_fusion": True, **req["options"]}  # 3.6's default, stated (3.9 warns)
            kernel = triton_compile(src, target=GPUTarget(*req["target"]), options=options)
            shared = int(kernel.metadata.shared)
            result.update(shared=shared, stages=sorted(kernel.asm))
            if os.environ.get(f"{ENV_FLAG}_REPORT"):  # the report also counts tensor-core MMAs in the SASS
                from triton_impl.bench import sass_mma_counts, sass_resources

                result["hgmma"], result["hmma"] = sass_mma_counts(kernel.asm["cubin"])
                result["registers"], result["stack"] = sass_resources(kernel.asm["cubin"])
            if shared > req["max_shared"]:
                result["error"] = (
                    f"OutOfResources: shared memory, Required: {shared}, Hardware limit: {req['max_shared']}"
                    " (raised when the GPU loads the kernel)"
                )
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}".rstrip()
            result["traceback"] = traceback.format_exc()
    diagnostics = stderr.get("text", "").strip()
    if "error" in result and diagnostics:
        result["error"] += "\n[stderr]\n" + diagnostics
    result["seconds"] = time.perf_counter() - start
    return result


def _worker_main() -> None:
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    proto_in = sys.stdin.buffer
    init = _recv(proto_in)
    sys.path[:] = init["sys_path"]
    os.environ["TRITON_INTERPRET"] = "0"
    _send(proto_out, {"ready": True})
    while True:
        try:
            req = _recv(proto_in)
        except EOFError:
            return
        if req is None:
            return
        _send(proto_out, _compile_request(req))


# ----------------------------------------------------------------------------------------------
# pytest side: derive each launch's variant, send new ones to the workers, report.
# ----------------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the thread that feeds it, one request at a time."""

    def __init__(self, checker: _Checker, index: int) -> None:
        self.checker = checker
        self.index = index
        self.queue: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (the worker's stderr, for as long as it lives)
        self.thread = threading.Thread(target=self._loop, name=f"compile-sm90-{index}", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where ``tests`` imports from
        env = dict(os.environ, TRITON_INTERPRET="0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.pop(ENV_FLAG, None)
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.compile_sm90 import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=os.getcwd(),
        )
        _send(self.proc.stdin, {"sys_path": list(sys.path)})
        _recv(self.proc.stdout)

    def _log_tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(Exception):
            _send(proc.stdin, None)
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _loop(self) -> None:
        while True:
            req = self.queue.get()
            if req is None:
                self._stop()
                return
            try:
                if self.proc is None:
                    self._start()
                assert self.proc is not None
                _send(self.proc.stdin, req)
                result = _recv(self.proc.stdout)
            except (EOFError, OSError):
                proc, self.proc = self.proc, None
                code = proc.wait() if proc is not None else None
                result = {
                    "id": req["id"],
                    "error": f"compile worker died (exit status {code})\n{self._log_tail()}",
                    "seconds": 0.0,
                }
            except Exception as exc:  # e.g. a constexpr that does not pickle: nothing was sent
                result = {"id": req["id"], "error": f"not sent to the compile worker: {exc!r}", "seconds": 0.0}
            self.checker.record(result)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


class _Checker:
    def __init__(self, jobs: int) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget(*TARGET))
        self.proxies: dict[int, Any] = {}  # id(InterpretedFunction) -> (it, JITFunction twin, binder)
        self.dot_markers: dict[int, Any] = {}  # id(marker dtype) -> the GPU's dtype
        self.variants: dict[Any, dict[str, Any]] = {}  # key -> request (+ its result)
        self.by_id: dict[int, dict[str, Any]] = {}
        self.launches = 0
        self.internal_errors: list[str] = []
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.outstanding = 0
        self.started = time.perf_counter()
        self.workers = [_Worker(self, i) for i in range(max(1, jobs))]

    # -- the twin JITFunction gives Triton's own binder and argument packing for the target --

    def _proxy(self, interp):
        entry = self.proxies.get(id(interp))
        if entry is None:
            from triton.runtime.jit import JITFunction, create_function_from_signature

            jit = JITFunction(interp.fn, **interp.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, self.backend)
            entry = (interp, jit, binder)  # holding interp keeps its id unique
            self.proxies[id(interp)] = entry
        return entry[1], entry[2]

    def on_launch(self, interp, args: tuple, kwargs: dict[str, Any]) -> None:
        from triton import knobs

        self.launches += 1
        jit, binder = self._proxy(interp)
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9 (3.6 has no such knob)
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        bound_args, specialization, options = binder(*args, **kwargs)
        with warnings.catch_warnings():  # parse_options: 3.9's TRITON_DEFAULT_FP_FUSION notice
            warnings.simplefilter("ignore")
            options, signature, constexprs, attrs = jit._pack_args(
                self.backend, kwargs, bound_args, specialization, options
            )
        encoded = {path: _encode_constexpr(v, self.dot_markers) for path, v in constexprs.items()}
        launch_options = {k: v for k, v in kwargs.items() if k in options.__dict__ and k not in signature}
        fn = interp.fn
        key = (
            fn.__module__,
            fn.__qualname__,
            tuple(signature.items()),
            repr(sorted(encoded.items())),
            repr(sorted(attrs.items())),
            repr(sorted(launch_options.items())),
        )
        with self.lock:
            if key in self.variants:
                self.variants[key]["launches"] += 1
                return
            req = {
                "id": next(self.ids),
                "module": fn.__module__,
                "qualname": fn.__qualname__,
                "signature": signature,
                "constexprs": encoded,
                "attrs": attrs,
                "options": launch_options,
                "target": TARGET,
                "max_shared": MAX_SHARED_SM90,
                "launches": 1,
                "variant": _describe_variant(jit, signature, encoded, launch_options, options),
            }
            self.variants[key] = req
            self.by_id[req["id"]] = req
            self.outstanding += 1
        worker = min(self.workers, key=lambda w: w.queue.qsize())
        worker.queue.put({k: req[k] for k in req if k not in ("launches", "variant")})

    def record(self, result: dict[str, Any]) -> None:
        with self.lock:
            req = self.by_id[result["id"]]
            req["result"] = result
            self.outstanding -= 1
            self.done.notify_all()

    def finish(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.outstanding and time.monotonic() < deadline:
                self.done.wait(timeout=min(5.0, max(0.0, deadline - time.monotonic())))
            timed_out = self.outstanding > 0
        for worker in self.workers:
            if timed_out:
                worker.kill()
            worker.queue.put(None)
        for worker in self.workers:
            worker.thread.join(timeout=60)
        with self.lock:
            for req in self.variants.values():
                req.setdefault("result", {"id": req["id"], "error": f"not compiled within {timeout:.0f} s"})
        self.elapsed = time.perf_counter() - self.started

    def rows(self) -> list[dict[str, Any]]:
        """One plain row per variant (JSON-able: it crosses from pytest-xdist workers)."""
        rows = []
        for key, req in self.variants.items():
            result = req["result"]
            rows.append(
                {
                    "key": repr(key),
                    "kernel": f"{req['module']}.{req['qualname']}",
                    "variant": req["variant"],
                    "launches": req["launches"],
                    "ok": "error" not in result,
                    "seconds": round(result.get("seconds", 0.0), 3),
                    "shared": result.get("shared"),
                    "hgmma": result.get("hgmma"),
                    "hmma": result.get("hmma"),
                    "registers": result.get("registers"),
                    "stack": result.get("stack"),
                    "error": result.get("error"),
                }
            )
        return rows


def _describe_variant(jit, signature: dict, encoded: dict, launch_options: dict, options) -> str:
    names = [p.name for p in jit.params]
    consts = {path[0]: v for path, v in encoded.items() if len(path) == 1}
    parts = []
    for i, name in enumerate(names):
        if i in consts:
            parts.append(f"{name}={_describe_constexpr(consts[i])}")
        elif name in signature and signature[name] != "constexpr":
            parts.append(f"{name}:{signature[name]}")
    hidden = ("debug", "instrumentation_mode", "fpsan_homomorphic_casts")
    shown = {"num_warps": options.num_warps, "num_stages": options.num_stages}
    shown.update((k, v) for k, v in launch_options.items() if k not in hidden or v)
    opts = ", ".join(f"{k}={v}" for k, v in shown.items())
    return f"[{opts}]({', '.join(parts)})"


class _Results:
    """What this pytest process reports: its own variants and, under pytest-xdist, its workers'."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.launches = 0
        self.internal_errors: list[str] = []
        self.seconds = 0.0

    def add(self, rows: list[dict[str, Any]], launches: int, internal_errors: list[str]) -> None:
        self.launches += launches
        self.internal_errors += internal_errors
        for row in rows:
            seen = self.rows.get(row["key"])
            if seen is None:
                self.rows[row["key"]] = dict(row)
            else:  # compiled in two xdist workers: one entry, a failure wins
                seen["launches"] += row["launches"]
                if not row["ok"] and seen["ok"]:
                    seen.update(ok=False, error=row["error"])

    def failures(self) -> list[dict[str, Any]]:
        return [row for row in self.rows.values() if not row["ok"]]


_CHECKER: _Checker | None = None
_RESULTS = _Results()
_OUTPUT_KEY = "attnref_compile_sm90"


def _install_dot_dtype_markers(checker: _Checker) -> None:
    """Make ``dot_dtype``'s interpreter answer (fp32) recognisable, to compile with the GPU's answer."""
    try:
        from triton_impl import interpreter
    except ImportError:
        return
    original = interpreter.dot_dtype
    gpu_dtypes = getattr(interpreter, "_DOT_DTYPES", None)
    if gpu_dtypes is None or getattr(original, "_compile_sm90", False):
        return
    import triton.language as tl

    markers: dict[Any, Any] = {}

    def dot_dtype(dtype):
        value = original(dtype)
        gpu = gpu_dtypes.get(dtype)
        if not bool(interpreter.INTERPRET) or gpu is None or gpu == value:
            return value
        if dtype not in markers:
            markers[dtype] = tl.dtype(value.name)  # equal to tl.float32, but a distinct object
            checker.dot_markers[id(markers[dtype])] = gpu
        return markers[dtype]

    dot_dtype.__doc__ = original.__doc__
    dot_dtype._compile_sm90 = True  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get("dot_dtype") is original:
            namespace["dot_dtype"] = dot_dtype


def _install(jobs: int) -> _Checker:
    import importlib

    importlib.import_module("triton_impl")  # first: selects the interpreter on a machine without CUDA
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    if not knobs.runtime.interpret:
        raise RuntimeError(f"{ENV_FLAG}=1 checks interpreted launches, but TRITON_INTERPRET is not 1")
    checker = _Checker(jobs)
    _install_dot_dtype_markers(checker)
    original_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            checker.on_launch(self, args, kwargs)
        except Exception:  # a bug here must not hide the launch; it is reported at the end
            checker.internal_errors.append(f"{getattr(self, '__name__', self)}: {traceback.format_exc()}")
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._compile_sm90_original = original_run  # type: ignore[attr-defined]
    InterpretedFunction.run = run
    return checker


def pytest_configure(config) -> None:
    global _CHECKER
    if os.environ.get(ENV_FLAG) != "1" or _CHECKER is not None:
        return
    _CHECKER = _install(int(os.environ.get(f"{ENV_FLAG}_JOBS", "1")))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist controller: collect a worker's variants."""
    if _CHECKER is None:
        return
    output = getattr(node, "workeroutput", {}).get(_OUTPUT_KEY)
    if output is None:
        _RESULTS.internal_errors.append(f"pytest-xdist worker {node.gateway.id} went down without results: {error}")
        return
    data = json.loads(output)
    _RESULTS.add(data["rows"], data["launches"], data["internal_errors"])


def pytest_sessionfinish(session, exitstatus) -> None:
    if _CHECKER is None:
        return
    _CHECKER.finish(float(os.environ.get(f"{ENV_FLAG}_TIMEOUT", "1800")))
    rows = _CHECKER.rows()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller reports
        payload = {"rows": rows, "launches": _CHECKER.launches, "internal_errors": _CHECKER.internal_errors}
        workeroutput[_OUTPUT_KEY] = json.dumps(payload)
        return
    _RESULTS.add(rows, _CHECKER.launches, _CHECKER.internal_errors)
    _RESULTS.seconds = _CHECKER.elapsed
    report = os.environ.get(f"{ENV_FLAG}_REPORT")
    if report:
        with open(report, "w") as f:
            for row in _RESULTS.rows.values():
                f.write(json.dumps({k: v for k, v in row.items() if k != "key"}) + "\n")
    if (_RESULTS.failures() or _RESULTS.internal_errors) and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _CHECKER is None or hasattr(terminalreporter.config, "workeroutput"):
        return
    tr = terminalreporter
    lines = int(os.environ.get(f"{ENV_FLAG}_ERROR_LINES", "12"))
    rows = list(_RESULTS.rows.values())
    failures = _RESULTS.failures()
    kernels = collections.Counter(row["kernel"] for row in rows)
    compile_s = sum(row["seconds"] for row in rows)
    tr.section(f"sm_90 compile check (target {TARGET}, Triton {_triton_version()})", sep="=")
    tr.write_line(
        f"{_RESULTS.launches} launches, {len(rows)} distinct variants of {len(kernels)} kernels;"
        f" {len(rows) - len(failures)} compiled, {len(failures)} failed"
        f" ({compile_s:.0f} s compiling, {_RESULTS.seconds:.0f} s session)"
    )
    for name, count in sorted(kernels.items()):
        bad = sum(1 for row in failures if row["kernel"] == name)
        tr.write_line(f"  {name}: {count} variants" + (f", {bad} FAILED" if bad else ""))
    for row in failures:
        error = (row["error"] or "").splitlines()
        tr.write_line("")
        tr.write_line(f"FAILED {row['kernel']}{row['variant']}", red=True)
        for line in error[:lines]:
            tr.write_line(f"    {line}")
        if len(error) > lines:
            tr.write_line(f"    ... ({len(error) - lines} more lines)")
    for error in _RESULTS.internal_errors[:5]:
        tr.write_line(f"INTERNAL ERROR (variant not checked): {error}", red=True)
    if failures or _RESULTS.internal_errors:
        tr.write_line(f"sm_90 compile check FAILED: {len(failures)} variants", red=True)


def _triton_version() -> str:
    import triton

    return triton.__version__
