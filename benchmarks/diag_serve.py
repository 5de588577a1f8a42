"""Where the serve command's time goes under load: the server's threads sampled by py-spy.

Starts `python -m hf_paged_t5 serve` (bench_serve's checkpoint, workload and client processes),
runs `--warmup` seconds of unmeasured load at `--rate`, then attaches `py-spy record --threads
--subprocesses` to the server (the HTTP process and the engine process) for `--duration` seconds
at `--rate` while reading /metrics every second, and prints: the load's row (as
bench_serve's), the running requests and rows seen, each thread's share of the samples (a thread
waiting for the GIL counts as busy; one idle in a wait does not), and per thread the functions
with the most samples under them.

    python benchmarks/diag_serve.py [--shape t5-large] [--rate 32] [--duration 15] [--warmup 10]
        [--py-spy PATH] [--out DIR]

Needs py-spy (`pip install py-spy`; on PATH or `--py-spy`) and what bench_serve needs. Writes
DIR/serve-profile.txt (py-spy's raw stacks) and DIR/serve-profile.json.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import threading
import urllib.request

import bench_serve
import common  # benchmarks/ is on sys.path


def metrics(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (line.split(" ", 1) for line in text.splitlines()
                                     if line.startswith("hf_paged_t5_") and "{" not in line)}


def summarize(raw: pathlib.Path, top: int) -> dict:
    """Per thread: samples; the functions (function (file)) with the most samples under them, less
    the ones under which nearly all of the thread's samples are (its entry frames); and the
    innermost frames with the most samples."""
    threads: collections.Counter = collections.Counter()
    under: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def key(frame: str) -> str:
        fn, _, where = frame.partition(" (")
        return f"{fn} ({where.rsplit('/', 1)[-1].split(':')[0]})"

    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        process = ""
        if frames[0].startswith("process ") and len(frames) > 1:  # --subprocesses: the process, then the thread
            process = "engine: " if "spawn_main" in frames[0] else "http: "
            frames = frames[1:]
        name = process + (frames[0].split(": ", 1)[-1] if ": " in frames[0] else frames[0])
        threads[name] += int(n)
        keys = [key(f) for f in frames[1:]]
        for k in set(keys):
            under[name][k] += int(n)
        if keys:
            inner[name][keys[-1]] += int(n)
    return {name: dict(samples=n, under=[(k, c) for k, c in under[name].most_common() if c < 0.9 * n][:top],
                       innermost=inner[name].most_common(top)) for name, n in threads.most_common()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="t5-large")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--device", default=None)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--py-spy", default=None, help="the py-spy binary (default: on PATH)")
    ap.add_argument("--out", default=None, help="folder for the profile (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    spy = args.py_spy or shutil.which("py-spy")
    if not spy:
        ap.error("py-spy not found: pip install py-spy, or give --py-spy PATH")
    import torch

    from hf_paged_t5 import tiny

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = common.start_suite(args.out, "serve-profile")
    raw = out / "serve-profile.txt"

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = tiny.save_demo_checkpoint(pathlib.Path(folder) / args.shape, shape=args.shape)
        vocab = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())["vocab_size"]
        clients = concurrent.futures.ProcessPoolExecutor(
            args.clients, mp_context=multiprocessing.get_context("spawn"),
            initializer=bench_serve._client_init, initargs=(vocab, False))
        proc, base = bench_serve.start("paged-server", checkpoint, device)  # answers /health after its warm-up
        seen: list[dict] = []
        spy_proc = None
        try:
            bench_serve.load(clients, args.clients, base, args.rate, args.warmup, True)
            # the sampler joins now: the profile holds the timed load, not the start or the warm-up
            spy_proc = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--threads", "--subprocesses",
                                         "--rate", "200", "--format", "raw", "--output", str(raw)])
            stop = threading.Event()

            def watch():
                while not stop.wait(1.0):
                    seen.append(metrics(base))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            row = bench_serve.load(clients, args.clients, base, args.rate, args.duration, True)
            stop.set()
            watcher.join()
        finally:
            clients.shutdown()
            if spy_proc is not None:
                spy_proc.send_signal(signal.SIGINT)  # py-spy stops and writes its file
                try:
                    spy_proc.wait(120)
                except subprocess.TimeoutExpired:
                    spy_proc.kill()
            os.kill(proc.pid, signal.SIGINT)  # the server drains and exits
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    threads = summarize(raw, args.top)
    gauges = {k: [m.get(k) for m in seen] for k in ("hf_paged_t5_running_requests", "hf_paged_t5_running_rows",
                                                    "hf_paged_t5_queue_depth")}
    common.write_json(out / "serve-profile.json", dict(shape=args.shape, device=device, rate=args.rate,
                                                       duration_s=args.duration, load=row, gauges=gauges,
                                                       threads=threads))
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    for k, v in gauges.items():
        print(k, v)
    for name, t in threads.items():
        print(f"\n== {name}: {t['samples']} samples")
        for fn, n in t["under"]:
            print(f"{n:7d}  {fn}")
        print("  innermost:")
        for fn, n in t["innermost"][:12]:
            print(f"{n:7d}  {fn}")


if __name__ == "__main__":
    main()
