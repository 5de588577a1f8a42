"""Run benchmark suites: each suite's script (its main()) in a fresh process, its output shown and
logged, its results and the one env.json of the run under one folder.

    python benchmarks/run.py --suite SUITE[,SUITE...] [--out DIR] [--timeout SECONDS] [suite options]

Results go to DIR (default: benchmarks/results/<YYYY-MM-DD>-<gpu>/, <gpu> e.g. `h200`, `cpu`
without CUDA): the suite's JSON, <suite>.log (everything it printed) and env.json (GPU, versions,
git commit and dirty flag, the command line of this run and of every suite). Every suite runs,
also after one fails; the exit status is 0 only if all of them passed.

Suite options are the options of the suite's script (`--SUITE.help` prints them; the GPU tests
take pytest's). Options written plainly go to every suite named; `--SUITE.OPTION [VALUE]` goes to
that suite alone (one letter: `-O`), e.g.

    python benchmarks/run.py --suite cpu --rows tiny-b1 --repeats 1
    python benchmarks/run.py --suite gpu-tests,generate --gpu-tests.k contract --generate.models t5-small
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import torch

import common  # benchmarks/ is on sys.path (python benchmarks/run.py puts it there)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    script: str | None  # benchmarks/<script>; None: the GPU tests (pytest -m gpu)
    summary: str


SUITES = {s.name: s for s in (
    Suite("generate", "bench_generate.py", "generate(): HF eager / sdpa vs patched, ms per step, memory (GPU)"),
    Suite("fusion", "ab_fusion.py", "the fused decode layer vs one kernel per op: ms per step, kernels per layer (GPU)"),
    Suite("batch", "bench_batch.py", "BatchGenerator vs static batches vs HF, tokens/s (GPU; --quick --device cpu)"),
    Suite("kernels", "bench_kernels.py", "Triton kernels vs HF eager math and SDPA (GPU; --quick on CPU)"),
    Suite("cold", "bench_cold.py", "first calls in fresh processes, empty Triton cache, stock vs patched"),
    Suite("gpu-tests", None, "pytest tests -m gpu (pytest options and test paths pass through)"),
    Suite("cpu", "bench_cpu.py", "generate() on CPU, stock vs patched interleaved, fp32"),
    Suite("import", "bench_import.py", "import cost in fresh processes"),
    Suite("encoder", "bench_encoder.py", "T5EncoderModel patched vs HF (GPU; --quick --device cpu)"),
    Suite("long", "bench_long.py",
          "8k / 16k-token T5 and 4k / 16k-token LongT5 inputs, time and peak memory (GPU; --quick --device cpu)"),
    Suite("ray", "bench_ray.py", "one Ray Data replica vs BatchGenerator in process, the long-tailed job (--quick on CPU)"),
    Suite("serve", "bench_serve.py", "the serve command vs generate()-per-request servers, Poisson load (--quick on CPU)"),
    Suite("xxl", "bench_xxl.py", "t5-11b / flan-t5-xxl / madlad400-10b layouts: generate() vs HF, fp32 parity (GPU)"),
    Suite("multi-gpu", "multi_gpu_check.py", "device_map split over two devices, tokens vs stock (2 GPUs)"),
    Suite("tune", "tune_kernels.py", "launch-knob sweep of the Triton kernels (GPU; --quick on CPU)"),
)}


def parse_args(argv=None) -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """The runner's options, and each named suite's own arguments."""
    ap = argparse.ArgumentParser(
        prog="python benchmarks/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a suite option must never be taken for an abbreviated runner option
        epilog="suites:\n" + "\n".join(f"  {s.name:<10} {s.summary}" for s in SUITES.values()))
    ap.add_argument("--suite", required=True, metavar="SUITE[,SUITE...]", help="the suites to run, in order (below)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="results folder (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="seconds each suite may run (default: no limit)")
    ap.add_argument("--commit", default=None, metavar="REV[-dirty]",
                    help="the commit measured, recorded in env.json instead of the tree's own git state: for a "
                         "copy of a checkout whose .git may lag (`git describe --always --dirty` where it was made)")
    args, rest = ap.parse_known_args(argv)
    args.suite = [name for name in args.suite.split(",") if name]
    unknown = [name for name in args.suite if name not in SUITES]
    if unknown or not args.suite:
        ap.error(f"unknown suite {', '.join(unknown) or '(none)'}; suites: {', '.join(SUITES)}")
    try:
        return args, route(rest, args.suite)
    except ValueError as exc:
        ap.error(str(exc))


def route(rest: list[str], suites: list[str]) -> dict[str, list[str]]:
    """Suite name -> its arguments: `--SUITE.OPTION` and the values after it to SUITE alone (as
    `--OPTION`, or `-O` for one letter), everything else to every suite, in the order given."""
    routed: dict[str, list[str]] = {name: [] for name in suites}
    target = None  # where values go: None, every suite
    for token in rest:
        if token.startswith("-") and not token[1:2].isdigit():  # an option (not a negative number)
            target = None
            name, dot, option = token.lstrip("-").partition(".")
            if token.startswith("--") and dot and name in SUITES:
                if name not in suites:
                    raise ValueError(f"{token}: suite {name} is not in --suite {','.join(suites)}")
                token = ("-" if len(option.split("=")[0]) == 1 else "--") + option
                routed[name].append(token)
                target = None if "=" in option else name  # `--s.opt=value` takes no value after it
                continue
        for name in [target] if target else suites:
            routed[name].append(token)
    return routed


def child_env() -> dict:
    path = [str(common.REPO), str(common.BENCH), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "PYTHONUNBUFFERED": "1"}


def suite_command(suite: Suite, args: list[str], out) -> list[str]:
    """The child's command line: the suite's script, or pytest for the GPU tests."""
    if suite.script is not None:
        return [sys.executable, str(common.BENCH / suite.script), "--out", str(out), *args]
    # test paths among the arguments replace the default `tests` (a value such as `-k EXPR`'s is no path)
    paths = [a for a in args if not a.startswith("-") and os.path.exists(common.REPO / a.split("::")[0])]
    return [sys.executable, "-m", "pytest", *([] if paths else ["tests"]), "-m", "gpu", "-q", "-p", "no:cacheprovider",
            "-rf", f"--junitxml={out / 'gpu-tests.xml'}", *args]


def run_logged(command: list[str], log_path, timeout: float | None) -> int:
    """Run `command` from the repository root, its output shown and written to `log_path`; the
    exit status, 124 if it ran past `timeout` seconds (then its process group is stopped)."""
    timed_out = threading.Event()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        proc = subprocess.Popen(command, cwd=common.REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)

        def stop() -> None:
            timed_out.set()
            stop_group(proc)

        timer = threading.Timer(timeout, stop) if timeout else None
        if timer is not None:
            timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            status = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:  # the runner itself interrupted
                stop_group(proc)
    return 124 if timed_out.is_set() else status


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the child and what it started (its own process group): TERM, then KILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv=None) -> int:
    args, suite_args = parse_args(argv)
    out = common.results_dir(args.out).resolve()  # the suites run from the repository root
    common.write_env(out, commit=args.commit)
    print(f"results: {out}", flush=True)
    summary = []
    for name in args.suite:
        suite = SUITES[name]
        command = suite_command(suite, suite_args[name], out)
        shown = common.command_line(command[1:])  # `python benchmarks/x.py ...`, `python -m pytest ...`
        if suite.script is None and not torch.cuda.is_available():  # pytest would skip every test and pass
            print(f"run.py: suite {name} needs a CUDA GPU, and torch {torch.__version__} sees none "
                  "(torch.cuda.is_available() is False)", flush=True)
            common.write_env(out, name, commit=args.commit, command=shown, returncode=2, note="not run: no CUDA GPU")
            summary.append([name, 2, "-", "-"])
            continue
        common.write_env(out, name, commit=args.commit, command=shown)  # a script writes it again as it starts
        print(f"=== {name}: {shown}", flush=True)
        start = time.perf_counter()
        status = run_logged(command, out / f"{name}.log", args.timeout)
        seconds = time.perf_counter() - start
        common.write_env(out, name, commit=args.commit, returncode=status, seconds=round(seconds, 1),
                         log=f"{name}.log")
        verdict = "ok" if status == 0 else "TIMED OUT" if status == 124 else f"FAILED (exit {status})"
        print(f"=== {name}: {verdict} in {seconds:.0f} s", flush=True)
        summary.append([name, status, f"{seconds:.0f}", f"{name}.log"])
    common.print_table(["suite", "exit", "seconds", "log"], summary, title=f"results in {out}")
    return 0 if all(row[1] == 0 for row in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
