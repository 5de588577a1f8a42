"""Compiles on threads while the launching thread runs Python: what the interpreter's switch
interval does to them. No GPU needed.

A cold process's compile-ahead pass (`kernels/ahead.py`) compiles its kernels on a thread pool
while the launching thread walks the model's forward in Python. A Triton compile runs most of its
passes with the interpreter's lock released, but takes the lock back between them (and runs its
AST-to-IR step in Python); while another thread runs Python, each of those takes waits until
that thread is made to drop the lock, every `sys.getswitchinterval()` (5 ms by default).

This script compiles the decode step's kernels and the encoder's prefill kernel for sm_`arch`
(`diag_ptxas.py`'s cases, `TRITON_ALWAYS_COMPILE`) on a pool of min(8, CPUs) threads, while this
thread runs a pure-Python loop for `--busy` seconds (a stand-in for the pass's walk) and then
waits; once per switch interval, fresh each time. It prints the compiles' wall time, the loop's
iterations per second against the loop alone, and the same compiles with this thread idle.

    python benchmarks/diag_switch_interval.py [--intervals 0.005,0.001,0.0002] [--busy 0.5] [--arch 90]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import common  # benchmarks/ is on sys.path (the scripts' import rule)
import diag_ptxas


def spin(seconds: float) -> int:
    """Pure-Python work for `seconds`; returns the iterations done."""
    end, count = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        count += 1
    return count


def compile_all(jobs: list, arch: int, busy: float) -> tuple[float, int]:
    """Wall seconds of `jobs` compiled on a pool while this thread spins for `busy` seconds, and
    the spin's iterations."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    start = time.perf_counter()
    futures = [pool.submit(diag_ptxas.compile_report, kernel, const, types, warps, arch, pdl, unaligned, stages)
               for _, kernel, const, types, warps, pdl, unaligned, stages in jobs]
    spun = spin(busy) if busy > 0 else 0
    for future in futures:
        future.result()
    seconds = time.perf_counter() - start
    pool.shutdown()
    return seconds, spun


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals to try, seconds")
    ap.add_argument("--busy", type=float, default=0.5, help="seconds this thread runs Python meanwhile")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    try:
        intervals = [float(v) for v in args.intervals.split(",")]
    except ValueError:
        ap.error(f"--intervals must be comma-separated seconds, got {args.intervals!r}")
    if args.busy < 0 or any(v <= 0 for v in intervals):
        ap.error("--busy must be >= 0 and every interval > 0")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    jobs = [job for job in diag_ptxas.cases() + diag_ptxas.prefill_cases()
            if job[0].startswith(("paged_decode self", "paged_decode cross", "rms_norm", "prefill 64x32, band tiles in three"))]
    compile_all(jobs[:1], args.arch, 0.0)  # Triton's one-time start-up
    alone_rate = spin(0.5) / 0.5
    saved = sys.getswitchinterval()
    rows = []
    try:
        for interval in intervals:
            sys.setswitchinterval(interval)
            idle, _ = compile_all(jobs, args.arch, 0.0)
            busy, spun = compile_all(jobs, args.arch, args.busy)
            rows.append([f"{interval * 1e3:g} ms", len(jobs), f"{idle:.2f}", f"{busy:.2f}",
                         f"{spun / max(args.busy, 1e-9) / alone_rate:.0%}" if args.busy else "-"])
    finally:
        sys.setswitchinterval(saved)
    common.print_table(["switch interval", "compiles", "wall s, thread idle", f"wall s, thread busy {args.busy:g} s",
                        "its Python's pace vs alone"], rows,
                       title=f"{os.cpu_count()} CPUs, sm_{args.arch}, compiles on min(8, CPUs) threads")


if __name__ == "__main__":
    main()
