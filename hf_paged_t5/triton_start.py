"""Triton's one-time start-up of a process, begun on a thread as soon as it can be useful.

Before its first compile in a process, Triton hashes its own sources and libraries for the cache
key (0.8 s on an H200 machine), builds its CUDA driver module with the C compiler (0.55 s with
an empty cache) and imports its code generator. `start()` does these on a daemon thread when
torch is already imported and sees a GPU (`torch.cuda.is_available()`, which starts CUDA's
driver but makes no context), so they overlap what a user does next (loading the checkpoint,
moving it to the GPU); the same thread launches the compile worker processes
(`kernels/compile_workers.py`) first. `import hf_paged_t5` calls it, and so does `patch_model`.
A process that imports hf_paged_t5 before torch (the CLI), runs without a GPU or under
TRITON_INTERPRET=1 starts nothing at import.
`HF_PAGED_T5_EARLY_TRITON=0` turns it off. `wait()` returns once it is done (the first compile
ahead, `kernels/ahead.py`, is entered after it: two threads would hash twice).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional


class _Start:
    """The process's one start-up thread (Triton's start-up is the process's, not a model's)."""

    thread: Optional[threading.Thread] = None
    lock = threading.Lock()


def _work() -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            return
        from .kernels import compile_workers

        compile_workers.start()  # their start-up (~2 s) overlaps the model's load too
        import triton
        from triton.runtime.cache import triton_key

        triton_key()  # lru-cached for the process
        triton.runtime.driver.active  # builds and loads the driver module (no CUDA context is made)
        # The first compile's own import (Triton's code generator, which imports its Gluon
        # frontend): 0.11 s of a cold batch job's compile-ahead pass on an H100 where the
        # installed Triton's bytecode is not cached, holding the import lock other compiles wait on.
        import triton.compiler.code_generator  # noqa: F401
    except Exception:  # noqa: BLE001 - start-up work only: the first compile does it again and raises
        return


def start() -> None:
    """Begin Triton's start-up on a thread (once per process; see the module's docs for when)."""
    if _Start.thread is not None or "torch" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1" \
            or os.environ.get("HF_PAGED_T5_EARLY_TRITON", "1") == "0":
        return
    with _Start.lock:
        if _Start.thread is None:
            _Start.thread = threading.Thread(target=_work, name="hf_paged_t5-triton-start", daemon=True)
            _Start.thread.start()


def wait() -> None:
    """Return once the thread `start()` began (if any) is done."""
    if _Start.thread is not None:
        _Start.thread.join()


def started() -> bool:
    """Whether `start()` began the thread in this process."""
    return _Start.thread is not None
