"""Compile ahead: a cold process compiles the kernels of a call at once, not one after another.

Triton compiles a kernel the first time it is launched with a new specialization, and the
launch waits for it: a cold T5 v1.1 XXL encoder call compiles five kernels in a row (2.7 s on
an H200, 1.5 s of it the prefill kernel), builds a C launcher for each, builds Triton's CUDA
driver module and hashes Triton's own sources for the cache key (0.8 s) first.

`compile_ahead(device)` is a context in which every launch of this package's kernels, from this
thread, is compiled on a thread pool (Triton's `AsyncCompileMode`) and not run; leaving it waits
for them all, each with its launcher built and its binary loaded in the pool's thread. A caller
runs a forward once inside it (its outputs are garbage: no kernel ran), then for real. Before the
first compile, Triton's source hash runs on a thread while this one builds the driver module and
starts CUDA's and cuBLAS's handles with one small GEMM (quick where `triton_start` began them
early; its caller waits for that thread first).

`compile_behind()`, inside a pass: launches whose kernels a later call may need (another row
count's binaries) compile on threads of their own that start once the pass's own compiles are
done, or, inside `behind_after()`, once that context is left (a generate() call: after it
returns); nobody waits for them. Triton keeps each such compile's future in its kernel cache, so
a later launch of that kernel waits for what is left of the compile (starting the held ones if
they have not started) instead of compiling it again. An exiting process starts no more of them
and waits for the ones in progress.

Where this Triton lacks `AsyncCompileMode`, on the CPU and under TRITON_INTERPRET=1, `available`
is False and callers skip the pass. Compile errors inside the pass are dropped: the real call
compiles that kernel again and raises what it raises.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import os
import sys
import threading
import types
from typing import Iterator, Optional

import torch
import triton

from ._checks import interpreting

try:  # triton >= 3.5
    from triton.runtime.jit import JITFunction
    from triton import AsyncCompileMode
    from triton.runtime._async_compile import active_mode as _active_mode
except ImportError:  # pragma: no cover - an older Triton: no pass
    JITFunction = AsyncCompileMode = _active_mode = None

_COMPILE_ONLY = contextvars.ContextVar("hf_paged_t5_compile_only", default=False)
_BEHIND = contextvars.ContextVar("hf_paged_t5_compile_behind", default=None)  # the pass's `_Behind`
# the `_Behind`s of the passes inside a `behind_after` context, started when it is left
_AFTER = contextvars.ContextVar("hf_paged_t5_compile_behind_after", default=None)
_WORKERS = min(8, os.cpu_count() or 1)
# threads compiling behind a call: fewer, since the calls after it compete with them for the interpreter
_BEHIND_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
_KERNEL_MODULES = ("decode", "gated_gelu", "gemv", "linear", "local", "prefill", "rmsnorm", "store_kv")


class _Process:
    """What every pass of the process shares: the kernels' launch overrides (installed while any
    pass runs, in any thread), Triton's one-time start-up, and whether the interpreter is
    exiting (compiles behind a pass start no more; all three are the process's)."""

    lock = threading.Lock()
    active = 0  # passes in progress
    started = False
    kernels: Optional[list] = None  # `_kernels()`, once every kernel module is imported
    exiting = False
    exit_watched = False

    @classmethod
    def watch_exit(cls) -> None:
        """Have the interpreter's shutdown set `exiting` before it joins the threads compiling
        behind passes (their in-progress compiles then finish; no other starts)."""
        with cls.lock:
            if cls.exit_watched:
                return
            cls.exit_watched = True
        try:
            threading._register_atexit(cls._exit)  # noqa: SLF001 - concurrent.futures' own hook
        except (AttributeError, RuntimeError):  # an interpreter already shutting down: nothing to start
            cls.exiting = True

    @classmethod
    def _exit(cls) -> None:
        cls.exiting = True


def available(device: torch.device) -> bool:
    """Whether `compile_ahead` can compile on `device` (a CUDA device, a Triton that allows it)."""
    return AsyncCompileMode is not None and device.type == "cuda" and not interpreting()


def _kernels() -> list:
    """This package's JITFunctions (launched ones and the device functions they call); the list is
    kept once every kernel module is imported (it cannot change after that)."""
    if _Process.kernels is not None:
        return _Process.kernels
    found = []
    modules = [sys.modules.get(f"{__package__}.{name}") for name in _KERNEL_MODULES]
    for module in modules:
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, JITFunction) and value.module.startswith(__package__):
                found.append(value)
    if all(module is not None for module in modules):
        _Process.kernels = found
    return found


def binaries() -> int:
    """Binaries of this package's kernels loaded in this process (compiled here or read from
    Triton's cache), on every device: a count that rises only when a launch met a new
    configuration (0 with a Triton older than this module's pass needs)."""
    if JITFunction is None:
        return 0
    total = 0
    for kernel in _kernels():
        for entry in getattr(kernel, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) and entry else None  # (kernel cache, ...)
            total += len(cache) if isinstance(cache, dict) else 0
    return total


def _run(self, *args, grid, warmup, **kwargs):
    """`JITFunction.run` that only compiles inside this thread's pass."""
    return JITFunction.run(self, *args, grid=grid, warmup=warmup or _COMPILE_ONLY.get(), **kwargs)


def _compile_and_load(compile_fn, device: int):
    """Triton's compile, then the kernel's launcher (a C compile) built and its binary loaded, on
    `device`: the device that was current where the launch was (a layer of a device map makes its
    own device current around its launches: `model.attention.OnDevice`)."""
    with torch.cuda.device(device):
        kernel = compile_fn()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()
    return kernel


class _CompileAndLoad(concurrent.futures.ThreadPoolExecutor):
    """A pool whose compiles also build the kernel's launcher and load its binary."""

    def __init__(self) -> None:
        super().__init__(max_workers=_WORKERS, thread_name_prefix="hf_paged_t5-compile")

    def submit(self, fn, /, *args, **kwargs):
        device = torch.cuda.current_device()  # the launching thread's: Triton keyed the compile on it
        return super().submit(_compile_and_load, lambda: fn(*args, **kwargs), device)


class _Held(concurrent.futures.Future):
    """The future of a compile held behind a pass: waiting on it starts its `_Behind`, so a launch
    that needs the kernel before the held compiles were started never waits on nothing."""

    def __init__(self, behind: "_Behind") -> None:
        super().__init__()
        self._behind = behind

    def result(self, timeout=None):
        self._behind.start()
        return super().result(timeout)


class _Behind(concurrent.futures.Executor):
    """The compiles `compile_behind` submits: held until `start`, then run (`_compile_and_load`) in
    submission order on up to `_BEHIND_WORKERS` threads of their own. A process that exits starts none of those not yet begun
    and waits for the ones in progress (`_Process.exiting`), so no compile is cut off mid-way."""

    def __init__(self) -> None:
        self._held: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._started = False
        self._running = 0

    def submit(self, fn, /, *args, **kwargs):
        future = _Held(self)
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1  # (-1: no device to make current)
        with self._lock:
            self._held.append((future, lambda: fn(*args, **kwargs), device))
        if self._started:
            self._spawn()
        return future

    def start(self) -> None:
        """Run the held compiles (and those submitted later) from now on; again: nothing."""
        self._started = True
        self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            count = min(len(self._held), _BEHIND_WORKERS - self._running)
            self._running += count
        if count:
            _Process.watch_exit()
        for _ in range(count):
            threading.Thread(target=self._work, name="hf_paged_t5-compile-behind", daemon=False).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._held or _Process.exiting:
                    self._running -= 1
                    return
                future, compile_fn, device = self._held.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(_compile_and_load(compile_fn, device))
            except BaseException as exc:  # noqa: BLE001 - the launch that waits for it raises it
                future.set_exception(exc)


def _start_triton(device: torch.device) -> None:
    """Triton's one-time work of a process, overlapped: its source hash on a thread; here its
    CUDA driver module, then CUDA's and cuBLAS's handles (one small GEMM)."""
    if _Process.started:
        return
    from triton.runtime.cache import triton_key

    hashing = threading.Thread(target=triton_key, name="hf_paged_t5-triton-key", daemon=True)
    hashing.start()
    try:
        with torch.cuda.device(device):
            triton.runtime.driver.active.get_current_device()
            a = torch.ones(16, 16, device=device)
            a @ a
    finally:
        hashing.join()  # before any compile: lru_cache would hash again on this thread
    _Process.started = True


@contextlib.contextmanager
def compile_ahead(device: torch.device) -> Iterator[None]:
    """Within: this thread's launches of this package's kernels compile on a pool, none runs."""
    _start_triton(device)
    pool = _CompileAndLoad()
    kernels = _kernels()
    with _Process.lock:
        if _Process.active == 0:
            for kernel in kernels:
                kernel.run = types.MethodType(_run, kernel)
        _Process.active += 1
    token, behind = _COMPILE_ONLY.set(True), _Behind()
    behind_token = _BEHIND.set(behind)
    try:
        with AsyncCompileMode(pool, ignore_errors=True):
            yield
    finally:
        _BEHIND.reset(behind_token)
        after = _AFTER.get()
        if after is not None:
            after.append(behind)  # started when the call around the pass ends
        else:
            behind.start()
        _COMPILE_ONLY.reset(token)
        with _Process.lock:
            _Process.active -= 1
            if _Process.active == 0:
                for kernel in kernels:
                    kernel.__dict__.pop("run", None)
        pool.shutdown(wait=True)


@contextlib.contextmanager
def compile_behind() -> Iterator[None]:
    """Within a `compile_ahead` pass: launches compile after the pass's own compiles, on threads
    the pass does not wait for (the module docstring). Outside a pass, or where this Triton has no
    async compile mode: nothing (the kernels compile at their first launch)."""
    behind = _BEHIND.get()
    if behind is None or _active_mode is None:
        yield
        return
    token = _active_mode.set(AsyncCompileMode(behind, ignore_errors=True))  # never left: it would wait
    try:
        yield
    finally:
        _active_mode.reset(token)


@contextlib.contextmanager
def behind_after() -> Iterator[None]:
    """Within: the compiles behind a pass (`compile_behind`) start when this context is left, not
    when the pass ends: around a generate() call, they start once it has returned and do not
    compete with it for the interpreter (a launch that waits on one starts them at once)."""
    held: list = []
    token = _AFTER.set(held)
    try:
        yield
    finally:
        _AFTER.reset(token)
        for behind in held:
            behind.start()
