"""Compile workers: Triton compiles in processes of their own, for binaries a later call needs.

A Triton compile holds this interpreter's lock for most of its ~1 s (its LLVM lowering runs under
it), so compiling on threads behind a call slows every call that runs meanwhile. A worker process
compiles into Triton's cache directory instead; the launch that needs the binary later finds it
there (a cache hit: the files read, the module loaded, milliseconds).

`start()` launches up to `count()` workers (`HF_PAGED_T5_COMPILE_WORKERS`; by default half the
CPU cores, divided among torchrun's `LOCAL_WORLD_SIZE` processes, at most 8, none below 2 each;
0 turns them off). `triton_start` calls it at
import where torch is imported and sees a GPU, so the workers' own start-up (importing torch,
Triton and this package's kernel modules, not the package: ~2 s) overlaps loading the model.
A worker runs at a lower priority, compiles what it is sent with the sender's target, options and
cache-invalidating environment, also builds the kernel's C launcher into the cache (beside the
compile, where Triton builds one per signature: `launcher_build`), and exits when
its input closes, or after `IDLE_S` seconds without work (its exit reaped by the parent).

`submit(key, compile_fn)` sends the compile that `compile_fn` (Triton's own closure over its
source, target and options; `key`: Triton's cache key of it) would run to a worker, and returns a
future whose `result()` runs `compile_fn()` in the caller once the worker is done: Triton's cache
hit. A compile no worker has begun when its result is asked for (all busy, none ready yet) is
taken back and compiled there; one whose worker failed, died, or reported another cache key than
this process's is compiled there too. So a result is always this process's own compile's,
wherever the work ran.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import types
import warnings
from typing import Callable, Optional

logger = logging.getLogger(__name__)

IDLE_S = 300.0  # a worker with nothing to do for this long exits (its memory goes back)
_PACKAGE = __name__.rsplit(".", 2)[0]  # "hf_paged_t5"
_HEADER = struct.Struct("<I")


def count() -> int:
    """Workers `start()` launches: `HF_PAGED_T5_COMPILE_WORKERS` if set (0: none), else half the
    CPU cores, shared among the processes of one launch on this machine (`LOCAL_WORLD_SIZE`, as
    torchrun sets it), at most 8, none below 2 cores each (the calls' own threads need them)."""
    value = os.environ.get("HF_PAGED_T5_COMPILE_WORKERS")
    if value is not None:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"HF_PAGED_T5_COMPILE_WORKERS must be a whole number of processes (0: none), "
                             f"got {value!r}") from None
    try:
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    share = (os.cpu_count() or 1) // 2 // processes
    return 0 if share < 2 else min(8, share)


def _send(fd: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _receive(fd: int):
    """The next message on `fd`, or None at its end."""
    def exactly(n: int) -> Optional[bytes]:
        chunks = []
        while n:
            chunk = os.read(fd, n)
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    header = exactly(_HEADER.size)
    if header is None:
        return None
    body = exactly(_HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


# ---- the parent's side ------------------------------------------------------------------------
class _Job:
    """One compile sent out: queued (no worker has it), running, taken (back, compiled by the
    parent), or finished (`ok`: the worker wrote the binary under the parent's cache key; not
    `ok`: it failed, `error` says why, or it exited first)."""

    def __init__(self, job_id: int, key_hash: str, spec: dict, compile_fn: Callable) -> None:
        self.id, self.hash, self.spec, self.compile_fn = job_id, key_hash, spec, compile_fn
        self.state = "queued"
        # time.perf_counter() (one clock for every process of the machine): asked for here, begun
        # and ended in a worker (None where no worker ran it)
        self.asked, self.began, self.ended = time.perf_counter(), None, None
        self.ok = False
        self.error = ""  # what the worker reported, where it failed
        self.finished = threading.Event()


class _Worker:
    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.ready = False
        self.job: Optional[_Job] = None


class _Pool:
    """The process's workers and their queue (the workers are the process's, not a model's)."""

    lock = threading.Lock()
    started = False
    pid = 0  # the process that started them (a forked child has none: their pipes are the parent's)
    workers: list = []
    queue: collections.deque = collections.deque()
    done: collections.deque = collections.deque(maxlen=256)  # the last jobs workers finished (`history`)
    next_id = 0
    sent = 0  # compiles handed to the workers' queue
    idle_s = IDLE_S

    @classmethod
    def dispatch(cls) -> None:
        """Hand queued jobs to ready, idle workers (called with `lock` held)."""
        for worker in cls.workers:
            if not cls.queue:
                return
            if worker.ready and worker.job is None:
                job = cls.queue.popleft()
                try:
                    _send(worker.process.stdin.fileno(), (job.id, job.spec))
                except OSError:  # a worker that died: the reader thread removes it
                    cls.queue.appendleft(job)
                    continue
                job.state, worker.job = "running", job


class RemoteFuture(concurrent.futures.Future):
    """The result of a compile sent to the workers: see the module docstring."""

    def __init__(self, job: _Job) -> None:
        super().__init__()
        self._job = job
        self._loading = threading.Lock()

    def result(self, timeout=None):
        with self._loading:
            if not self.done():
                job = self._job
                with _Pool.lock:
                    if job.state == "queued":
                        _Pool.queue.remove(job)
                        job.state = "taken"
                if job.state != "taken":
                    job.finished.wait()
                    if not job.ok:
                        logger.debug("%s: compiled here, the worker did not (%s)", job.spec["name"],
                                     job.error or "another cache key, or the worker exited")
                try:
                    self.set_result(job.compile_fn())  # a cache hit where the worker wrote it
                except BaseException as exc:  # noqa: BLE001 - the launch that waits raises it
                    self.set_exception(exc)
        return super().result(timeout)

    def ready(self) -> bool:
        """Whether `result()` would not wait for a compile: done here, or the worker finished (its
        binary in Triton's cache, or its failure reported: `result()` then compiles here)."""
        return self.done() or self._job.finished.is_set()


def pending() -> int:
    """Compiles sent to this process's workers that are not finished (queued or running)."""
    with _Pool.lock:
        return len(_Pool.queue) + sum(worker.job is not None for worker in _Pool.workers)


def free() -> int:
    """Workers of this process ready for a compile now: started up, with none running or queued for
    them (0 without workers, or while they start)."""
    with _Pool.lock:
        if _Pool.pid != os.getpid():
            return 0
        idle = sum(worker.ready and worker.job is None for worker in _Pool.workers)
        return max(0, idle - len(_Pool.queue))


def history() -> list[dict]:
    """The last compiles this process's workers finished, oldest first: the kernel's name, whether
    it came back usable (`ok`), and when (`time.perf_counter()` seconds, one clock for the
    machine's processes) it was asked for here, begun and ended in the worker."""
    with _Pool.lock:
        jobs = list(_Pool.done) if _Pool.pid == os.getpid() else []
    return [dict(name=job.spec.get("name", ""), ok=job.ok, asked=job.asked, began=job.began, ended=job.ended)
            for job in jobs]


def sent() -> int:
    """Compiles this process has sent to its workers so far."""
    with _Pool.lock:
        return _Pool.sent


def running() -> bool:
    """Whether any worker of this process is alive (started, not exited)."""
    with _Pool.lock:
        return bool(_Pool.workers) and _Pool.pid == os.getpid()


def start() -> None:
    """Launch the workers (once per process; `count()` of them; none where Triton is not importable)."""
    with _Pool.lock:
        if _Pool.started:
            return
        _Pool.started, _Pool.pid = True, os.getpid()
    try:
        n = count()
    except ValueError as exc:  # (on the start-up thread: said once, and no workers)
        logger.warning("%s; starting no compile workers", exc)
        return
    if n == 0 or "python" not in os.path.basename(sys.executable or "").lower():
        return  # (an embedding host's executable is not an interpreter to run this file with)
    try:
        import triton

        cache_dir = triton.knobs.cache.dir
    except (ImportError, AttributeError):
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
    argv = [sys.executable, os.path.abspath(__file__), root, _PACKAGE, str(_Pool.idle_s)]
    for _ in range(n):
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as exc:
            logger.debug("no compile worker: %s", exc)
            break
        worker = _Worker(process)
        with _Pool.lock:
            _Pool.workers.append(worker)
        threading.Thread(target=_read, args=(worker,), name="hf_paged_t5-compile-worker", daemon=True).start()
    atexit.register(stop)


def stop() -> None:
    """End the workers (at exit; safe mid-compile: Triton writes a cache entry under a temporary
    name and renames it)."""
    with _Pool.lock:
        workers = list(_Pool.workers) if _Pool.pid == os.getpid() else []  # (a forked child's are not its own)
    for worker in workers:
        try:
            worker.process.kill()
            worker.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _read(worker: _Worker) -> None:
    """A worker's messages: ready, then one per job; at its end, it is gone."""
    fd = worker.process.stdout.fileno()
    while True:
        try:
            message = _receive(fd)
        except (OSError, pickle.UnpicklingError, EOFError):
            message = None
        with _Pool.lock:
            if message is None:
                _Pool.workers.remove(worker)
                job, worker.job = worker.job, None
                if job is not None:
                    job.ok, job.state = False, "finished"
                    job.finished.set()
                break
            if message[0] == "ready":
                worker.ready = True
            else:
                job_id, ok, key_hash, error, began, ended = message
                job, worker.job = worker.job, None
                if job is not None:  # (one job at a time per worker: the reply is this job's)
                    job.ok = bool(ok) and job.id == job_id and key_hash == job.hash
                    job.error, job.state, job.began, job.ended = error, "finished", began, ended
                    _Pool.done.append(job)
                    job.finished.set()
            _Pool.dispatch()
    try:
        worker.process.wait(timeout=60)  # reaped: an exited worker leaves no zombie behind
    except subprocess.TimeoutExpired:
        pass


def spec_of(compile_fn: Callable) -> Optional[dict]:
    """What a worker needs to run the compile of Triton's closure `compile_fn` (the kernel's
    module and name, signature, constants, attributes, target, options, environment), or None
    where it is not one of this package's kernels or not picklable."""
    try:
        names = inspect.getclosurevars(compile_fn).nonlocals
        src, target, options = names["src"], names["target"], names["options"]
        fn = src.fn
        spec = dict(module=fn.module, name=fn.__name__, signature=dict(src.signature), constants=dict(src.constants),
                    attrs=dict(src.attrs), target=(target.backend, target.arch, target.warp_size),
                    options=dict(vars(options)), env_vars=dict(names.get("env_vars") or {}))
        if not spec["module"].startswith(f"{_PACKAGE}.kernels."):
            return None
        pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        return spec
    except Exception:  # noqa: BLE001 - another Triton's closure: compile it here
        return None


def submit(key: str, compile_fn: Callable) -> concurrent.futures.Future:
    """The compile of `compile_fn` (Triton's cache key `key`) sent to the workers; see the module
    docstring. Where it cannot be sent, a future that compiles it here when asked."""
    spec = spec_of(compile_fn)
    with _Pool.lock:
        _Pool.next_id += 1
        job = _Job(_Pool.next_id, hashlib.sha256(key.encode("utf-8")).hexdigest(), spec or {}, compile_fn)
        future = RemoteFuture(job)
        if spec is None or not _Pool.workers or _Pool.pid != os.getpid():
            job.state = "taken"
            return future
        _Pool.queue.append(job)
        _Pool.sent += 1
        _Pool.dispatch()
    return future


def launcher_build(src) -> Optional[tuple[str, Callable[[], None]]]:
    """(source, build) for the launcher of Triton source `src` (an `ASTSource`) where this Triton
    builds a C launcher per kernel signature (its NVIDIA driver's `make_launcher`, as in 3.6: a
    `gcc` run of ~0.2-0.3 s when the binary loads): `build()` compiles it into Triton's cache,
    where the binary's load (`CudaLauncher`) finds it. The source is the one that load makes: it
    depends on the kernel's signature and constants alone (and on tensor descriptors' metadata,
    known only after the compile: kernels with descriptor arguments get None), so it can be built
    beside the compile instead of after it. None for another driver (Triton 3.9 launches every
    kernel through one generic launcher)."""
    try:
        driver = importlib.import_module("triton.backends.nvidia.driver")
        make = getattr(driver, "make_launcher", None)
        if make is None or list(inspect.signature(make).parameters) != ["constants", "signature", "tensordesc_meta"]:
            return None
        names = src.fn.arg_names
        signature = dict(src.signature)
        if any(isinstance(kind, str) and kind.startswith("tensordesc") for kind in signature.values()):
            return None
        constants = {((names.index(k),) if isinstance(k, str) else k): v for k, v in src.constants.items()}
        source = make(constants, signature, None)
    except Exception:  # noqa: BLE001 - another Triton: the binary's load builds its launcher
        return None

    def build() -> None:
        driver.compile_module_from_src(src=source, name="__triton_launcher", library_dirs=driver.library_dirs(),
                                       include_dirs=driver.include_dirs, libraries=driver.libraries)

    return source, build


# ---- a worker's side --------------------------------------------------------------------------
def _compile(spec: dict) -> str:
    """Compile one spec into Triton's cache, its C launcher built beside it (`launcher_build`);
    returns its cache hash."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    src = ASTSource(fn, spec["signature"], spec["constants"], spec["attrs"])
    _, build = launcher_build(src) or (None, None)
    beside = threading.Thread(target=_quietly, args=(build,), daemon=True) if build is not None else None
    if beside is not None:
        beside.start()
    try:
        kernel = compile(src, target=GPUTarget(*spec["target"]), options=spec["options"], _env_vars=spec["env_vars"])
    finally:
        if beside is not None:
            beside.join()
    try:  # the C launcher, into the cache too (it needs the CUDA driver library, not a GPU context)
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the parent builds it at its first launch instead
        pass
    return kernel.hash


def _quietly(build: Callable[[], None]) -> None:
    """`build()`, its failure dropped: the launcher is built again where it is loaded, and fails there."""
    try:
        build()
    except Exception:  # noqa: BLE001
        pass


def serve(package_root: str, package: str, idle_s: float = IDLE_S) -> None:
    """A worker's loop (see the module docstring): messages on stdin, replies on stdout."""
    reply = os.dup(1)
    os.dup2(2, 1)  # what imports print goes to stderr (the parent drops it), not into the replies
    warnings.simplefilter("ignore")
    try:
        os.nice(5)
    except (AttributeError, OSError):
        pass
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this file's folder: its modules are the kernels', imported as the package's
    sys.path.insert(0, package_root)
    stub = types.ModuleType(package)  # the package without its __init__ (transformers, the hooks)
    stub.__path__ = [os.path.join(package_root, package)]
    sys.modules[package] = stub
    importlib.import_module(f"{package}.kernels")
    from triton.runtime.cache import triton_key

    triton_key()
    _send(reply, ("ready", os.getpid()))
    while True:
        if not select.select([0], [], [], idle_s)[0]:
            return
        message = _receive(0)
        if message is None:
            return
        job_id, spec = message
        began = time.perf_counter()
        try:
            key_hash, ok, error = _compile(spec), True, ""
        except Exception as exc:  # noqa: BLE001 - the parent compiles it and raises what it raises
            key_hash, ok, error = "", False, repr(exc)[:2000]
        _send(reply, (job_id, ok, key_hash, error, began, time.perf_counter()))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], float(sys.argv[3]))
