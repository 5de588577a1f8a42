"""Run pytest with a log of every CUDA graph capture, Triton binary load and Triton launch in a capture.

    python benchmarks/diag_capture.py --log FILE [pytest arguments ...]
    e.g. python benchmarks/diag_capture.py --log capture.log -m "gpu and not slow" \\
             tests/test_encoder_graphs.py -k follows_the_weights

Each line of FILE: seconds since start, the thread, and one of: the test that starts; a capture's
begin (the capturing stream, its mode, the process's threads, bytes allocated) and end (or how it
failed); a Triton binary's load (whether the loading thread's stream was capturing, with the stack
where it was); a Triton launch inside a capture (kernel, stream, whether compile-only). What it is
for: a capture that CUDA invalidates ("operation failed due to a previous error during capture")
names no culprit, and this log shows what ran inside it and beside it. Exits with pytest's code.
"""

from __future__ import annotations

import argparse
import threading
import time
import traceback

import torch


class CaptureLog:
    """A pytest plugin: wraps `torch.cuda.CUDAGraph.capture_begin/capture_end`, Triton's binary load
    (`CompiledKernel._init_handles`) and launch (`JITFunction.run`) for the session, and logs them."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "w")
        self.start = time.time()
        self.restore = []

    def log(self, message: str) -> None:
        self.file.write(f"{time.time() - self.start:8.3f} [{threading.current_thread().name}] {message}\n")
        self.file.flush()

    def _wrap(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self.restore.append((owner, name, original))
        setattr(owner, name, make(original))

    def pytest_configure(self, config) -> None:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else (lambda: False)

        def load(original):
            def init_handles(kernel):
                if getattr(kernel, "module", None) is None:
                    inside = capturing()
                    self.log(f"load {kernel.name} capturing={inside}")
                    if inside:
                        self.log("".join(traceback.format_stack(limit=12)))
                return original(kernel)
            return init_handles

        def launch(original):
            def run(fn, *args, **kwargs):
                if capturing():
                    self.log(f"launch {fn.fn.__name__} stream={torch.cuda.current_stream().cuda_stream} "
                             f"compile-only={bool(kwargs.get('warmup'))}")
                return original(fn, *args, **kwargs)
            return run

        def begin(original):
            def capture_begin(graph, *args, **kwargs):
                threads = sorted({t.name for t in threading.enumerate()})
                self.log(f"capture_begin stream={torch.cuda.current_stream().cuda_stream} {kwargs} threads={threads} "
                         f"allocated={torch.cuda.memory_allocated()}")
                return original(graph, *args, **kwargs)
            return capture_begin

        def end(original):
            def capture_end(graph):
                try:
                    result = original(graph)
                except Exception as exc:
                    self.log(f"capture_end FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    raise
                self.log("capture_end")
                return result
            return capture_end

        self._wrap(CompiledKernel, "_init_handles", load)
        self._wrap(JITFunction, "run", launch)
        self._wrap(torch.cuda.CUDAGraph, "capture_begin", begin)
        self._wrap(torch.cuda.CUDAGraph, "capture_end", end)

    def pytest_unconfigure(self, config) -> None:
        for owner, name, original in reversed(self.restore):
            setattr(owner, name, original)
        self.file.close()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self.log(f"TEST {nodeid}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", required=True, help="the log file to write")
    args, pytest_args = ap.parse_known_args(argv)
    import pytest

    return int(pytest.main(pytest_args, plugins=[CaptureLog(args.log)]))


if __name__ == "__main__":
    raise SystemExit(main())
