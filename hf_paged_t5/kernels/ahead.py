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

`compile_in_workers()`, inside a pass: its launches compile in the worker processes where one is
free, else on the pool, and leaving the pass waits only for the pool's (the first real launch of a
worker's binary waits for that one). On the pool's threads a pass's compiles run largely one after
another (a Triton compile holds the interpreter's lock for most of its time) and slow the walk
that asks for them; in the workers they run side by side. Every pass of
`PagedRuntime.compile_ahead` runs inside it.

`compile_elsewhere()`, inside a pass: launches whose binaries a later call may need (another row
count's) compile in the worker processes (`compile_workers`), not on the pool; leaving the pass
does not wait for them. Each one's future goes into the kernel's cache at once (Triton 3.6 puts a
pass's futures there only once they finish), so the later launch finds it and reads the worker's
binary from Triton's cache, or waits for the worker, or compiles it itself if no worker began it.

Where this Triton lacks `AsyncCompileMode`, on the CPU and under TRITON_INTERPRET=1, `available`
is False and callers skip the pass. Compile errors inside the pass are dropped: the real call
compiles that kernel again and raises what it raises.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import os
import sys
import threading
import types
from typing import Callable, Iterator, Optional

import torch
import triton

from . import compile_workers
from ._checks import interpreting

try:  # triton >= 3.5
    from triton.runtime.jit import JITFunction
    from triton import AsyncCompileMode
    from triton.runtime._async_compile import FutureKernel, active_mode as _active_mode
except ImportError:  # pragma: no cover - an older Triton: no pass
    JITFunction = AsyncCompileMode = FutureKernel = _active_mode = None

logger = logging.getLogger(__name__)
_COMPILE_ONLY = contextvars.ContextVar("hf_paged_t5_compile_only", default=False)
_KERNEL_MODULES = ("beam", "decode", "gated_gelu", "gemv", "greedy", "linear", "local", "prefill", "rmsnorm", "store_kv")


class _Process:
    """What every pass of the process shares: the kernels' launch overrides (installed while any
    pass runs, in any thread) and Triton's one-time start-up (both are the process's)."""

    lock = threading.Lock()
    active = 0  # passes in progress
    started = False
    kernels: Optional[list] = None  # `_kernels()`, once every kernel module is imported


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


class _CompileAndLoad(concurrent.futures.ThreadPoolExecutor):
    """A pool whose compiles also build the kernel's launcher and load its binary, on the device
    that was current where the launch was (a layer of a device map makes its own device current
    around its launches: `model.attention.OnDevice`). Where Triton's launcher is a C module of
    the kernel's signature (Triton 3.6 on NVIDIA: a C compile of ~0.2-0.3 s when the
    binary loads, after its compile), that module is built on a thread of its own from the
    moment the compile is asked for (`_launcher_build`), and the load waits for it: a kernel is
    ready after the longer of the two, not after both."""

    def __init__(self) -> None:
        super().__init__(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="hf_paged_t5-compile")
        self._launchers = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                                thread_name_prefix="hf_paged_t5-launcher")
        self._launcher_builds: dict[str, concurrent.futures.Future] = {}  # launcher source -> its build

    def submit(self, fn, /, *args, **kwargs):
        device = torch.cuda.current_device()  # the launching thread's: Triton keyed the compile on it
        source, build = _launcher_build(fn) or (None, None)
        launcher = None
        if build is not None:
            launcher = self._launcher_builds.get(source)
            if launcher is None:
                launcher = self._launcher_builds[source] = self._launchers.submit(build)

        def compile_and_load():
            with torch.cuda.device(device):
                kernel = fn(*args, **kwargs)
                if launcher is not None:
                    launcher.exception()  # wait; a build that failed leaves the load to build (and raise)
                init = getattr(kernel, "_init_handles", None)
                if init is not None:
                    init()
            return kernel

        return super().submit(compile_and_load)

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        super().shutdown(wait, **kwargs)
        self._launchers.shutdown(wait)


def _launcher_build(compile_fn) -> Optional[tuple]:
    """`compile_workers.launcher_build` of the source Triton's compile closure `compile_fn` compiles
    (None for a closure without one)."""
    try:
        src = inspect.getclosurevars(compile_fn).nonlocals["src"]
    except Exception:  # noqa: BLE001 - another Triton's closure: its load builds the launcher
        return None
    return compile_workers.launcher_build(src)


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


def compile_only() -> bool:
    """Whether this thread is inside a `compile_ahead` pass: its launches compile and none runs
    (their outputs hold garbage)."""
    return _COMPILE_ONLY.get()


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
    token = _COMPILE_ONLY.set(True)
    try:
        with AsyncCompileMode(pool, ignore_errors=True):
            yield
    finally:
        _COMPILE_ONLY.reset(token)
        with _Process.lock:
            _Process.active -= 1
            if _Process.active == 0:
                for kernel in kernels:
                    kernel.__dict__.pop("run", None)
        pool.shutdown(wait=True)


if AsyncCompileMode is not None:
    # Triton 3.9's FutureKernel takes a cleanup callback; 3.6's does not
    _FUTURE_CLEANS_UP = "cleanup_compile" in inspect.signature(FutureKernel).parameters

    class _Elsewhere(AsyncCompileMode):
        """Triton's async-compile mode with its compiles sent to the worker processes; a compile
        an enclosing mode (`outer`, and its own outer) already runs is that one's. `spill`: a
        compile that finds no worker free goes to `outer` instead (the pass's pool), not to the
        workers' queue."""

        def __init__(self, outer, spill: bool = False) -> None:
            super().__init__(None)
            self.outer, self.spill = outer, spill

        def known(self, key):
            """The future of `key` this mode or an enclosing one holds (None: none)."""
            mode = self
            while mode is not None:
                kernel = getattr(mode, "future_kernels", {}).get(key)
                if kernel is not None:
                    return kernel
                mode = getattr(mode, "outer", None)
            return None

        def submit(self, key, compile_fn, finalize_fn, cleanup_fn=None):
            kernel = self.known(key)
            if kernel is None and self.spill and compile_workers.free() < 1:
                return self.outer.submit(key, compile_fn, finalize_fn, *(() if cleanup_fn is None else (cleanup_fn,)))
            if kernel is None:
                future = compile_workers.submit(key, compile_fn)
                kernel = (FutureKernel(finalize_fn, cleanup_fn or (lambda _kernel: None), future)
                          if _FUTURE_CLEANS_UP else FutureKernel(finalize_fn, future))
                _into_kernel_cache(kernel, finalize_fn)
                self.future_kernels[key] = kernel
            return kernel


def _into_kernel_cache(kernel, finalize_fn) -> None:
    """Put a compile's future in its kernel's cache now, where a later launch finds it: through
    Triton's `finalize_compile` closure's own cache and key, or (another Triton's closure) by
    calling it, which also runs the post-compile hook early."""
    try:
        names = inspect.getclosurevars(finalize_fn).nonlocals
        names["kernel_cache"][names["key"]] = kernel
    except (KeyError, TypeError):
        finalize_fn(kernel)


def _loadable(kernel) -> bool:
    """Whether a launch of `kernel` (a binary, or a compile's future) would not wait for a compile:
    loaded, or its compile finished wherever it ran (a worker's binary is read from Triton's
    cache: milliseconds)."""
    if getattr(kernel, "kernel", None) is not None:
        return True
    future = getattr(kernel, "future", None)
    if future is None:
        return True
    return future.ready() if isinstance(future, compile_workers.RemoteFuture) else future.done()


def _in_worker(kernel) -> bool:
    """Whether `kernel`, what a compile-only launch returned, is a compile a worker process runs
    (not loaded here, not done there)."""
    return isinstance(getattr(kernel, "future", None), compile_workers.RemoteFuture) and not _loadable(kernel)


class Twins:
    """Binaries with a twin of the same bits that compiles in less time (the prefill kernel's
    one-loop variant: `PrefillConfig.one_loop`). Inside a pass, a binary whose compile goes to a
    worker process has its twin's compile sent to a free worker beside it; until the binary's
    worker is done, launches outside a CUDA graph capture run the twin, so a cold process waits
    for the shorter compile. A capture waits for the binary itself (a graph keeps what it
    captured) unless the caller says the twin is as fast at that launch's sizes (`in_graph`), and
    where no worker is free the twin is not asked for (the pass would wait for it on its pool).
    One instance per kernel; `signature` is the caller's key of everything the binary is
    specialized on (dtype, strides, alignment, constants)."""

    def __init__(self) -> None:
        self._waiting: dict = {}  # signature -> the binary's future, while its worker compiles it
        self._said: set = set()  # signatures whose twin ran (logged once each)

    def __len__(self) -> int:
        return len(self._waiting)

    def launch(self, signature, launch: Callable[[bool], object], in_graph: bool = False):
        """`launch(twin)` of the binary (False) or its twin (True), as above; returns what it returns.
        in_graph: a capture may keep the twin too (it runs as fast as the binary at these sizes)."""
        if _COMPILE_ONLY.get():
            asked = signature in self._waiting
            kernel = launch(False)
            if not asked and _in_worker(kernel) and compile_workers.free() >= 1:
                launch(True)
                self._waiting[signature] = kernel
            return kernel
        kernel = self._waiting.get(signature) if self._waiting else None
        if kernel is not None:
            if _loadable(kernel):
                self._waiting.pop(signature, None)
            elif in_graph or not torch.cuda.is_current_stream_capturing():
                if signature not in self._said:
                    self._said.add(signature)
                    logger.debug("the twin of a binary a compile worker compiles runs meanwhile (%s)", signature)
                return launch(True)
        return launch(False)


def elsewhere_available() -> bool:
    """Whether `compile_elsewhere` sends compiles anywhere (this process has compile workers)."""
    return AsyncCompileMode is not None and compile_workers.running()


@contextlib.contextmanager
def compile_in_workers() -> Iterator[bool]:
    """Inside a pass (`compile_ahead`): this thread's launches compile in a worker process where one
    is free when the launch asks, else on the pass's pool; leaving the pass waits only for the
    pool's (a launch that needs a worker's binary waits for it, as after `compile_elsewhere`). A
    Triton compile holds the interpreter's lock for most of its time, so a pass's compiles on the
    pool's threads run one after another and slow the walk that asks for them; in the workers
    they run side by side. Yields whether any worker can take them (as `compile_elsewhere`)."""
    if not _COMPILE_ONLY.get() or not elsewhere_available():
        yield False
        return
    token = _active_mode.set(_Elsewhere(_active_mode.get(), spill=True))
    try:
        yield True
    finally:
        _active_mode.reset(token)


@contextlib.contextmanager
def compile_elsewhere() -> Iterator[bool]:
    """Inside a pass (`compile_ahead`): this thread's launches compile in the worker processes and
    nothing here waits for them (see the module docstring). Yields whether they do: False outside
    a pass or without workers, where a caller launches nothing inside (those launches would
    compile on the pass's pool, like its own)."""
    if not _COMPILE_ONLY.get() or not elsewhere_available():
        yield False
        return
    token = _active_mode.set(_Elsewhere(_active_mode.get()))
    try:
        yield True
    finally:
        _active_mode.reset(token)
