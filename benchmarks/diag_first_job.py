"""Where a cold process's first `BatchGenerator` job spends the seconds before its first result.

    python benchmarks/diag_first_job.py [--shape t5-large] [--num-inputs 2000] [--again] [--out DIR]

Runs itself in a fresh process with an empty TRITON_CACHE_DIR, as `bench_cold.py`'s batch job
does: builds the random-weight model (bf16, not timed), patches it with the defaults (timed:
`patch_model_s`), then runs `bench_batch.py`'s long-tailed workload through a `BatchGenerator`
with its defaults once. It records a timeline in seconds from just before the generator is made:
the KV pool's (re)allocations, each `_compile_ahead` pass, each encoder chunk, the first decode steps, every
Triton compile in this process (start and end; a binary a compile worker made is a cache hit
here, milliseconds), every compile a worker process ran (its start and end there, and when it was
asked for here: `compile_workers.history()`), every CUDA graph capture, and the first results; the caching allocator's device
allocations, frees and retries over each job (`torch.cuda.memory_stats`); and a cProfile of the host
from the generator's making to the first result (the functions with the most cumulative time),
or with `--profile-pass` of the first compile-ahead pass alone (Python 3.12's cProfile records
every thread: the pass's compile threads too). `--again` runs the same job a second time in the
process (a new generator, the kernels and graphs the first one left): the cold job's extra
seconds over it are what a cold process pays. Writes DIR/first_job.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json) and prints the timeline.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from typing import Optional

RESULT_PREFIX = "first-job: "


def _top(profiler, count: int) -> list[dict]:
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():
        rows.append(dict(function=f"{os.path.basename(path)}:{line}:{name}", calls=calls, cumulative_s=cumulative))
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:count]


def worker(args) -> dict:
    import torch

    import bench_batch
    import common
    import hf_paged_t5 as hp
    from hf_paged_t5.kernels import compile_workers

    events: list[dict] = []  # what, start, end (perf_counter; made relative below)

    def timed(owner, name: str, label: str, limit: int = 1 << 30):
        real = getattr(owner, name)
        seen = [0]

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                if seen[0] < limit:
                    events.append(dict(what=label, start=start, end=time.perf_counter()))
                seen[0] += 1

        setattr(owner, name, wrapper)

    common.hook_compiles_and_captures(
        lambda kernel, start, end: events.append(dict(what=f"triton compile {kernel}", start=start, end=end)),
        lambda start, end: events.append(dict(what="graph capture", start=start, end=end)))
    profiler = cProfile.Profile()
    for owner, name, label in common.first_job_phases():
        if args.profile_pass and name == "_compile_ahead":
            _profile_first_call(owner, name, profiler)
        timed(owner, name, label, limit=args.steps if name in ("_decode_step", "encoder_forward") else 1 << 30)

    model = common.make_model(args.shape, "sdpa", torch.bfloat16, "cuda")
    items = bench_batch.workload(args.num_inputs, model.config.vocab_size, seed=1, quick=False)
    patching = time.perf_counter()
    hp.patch_model(model)
    torch.cuda.synchronize()
    patch_s = time.perf_counter() - patching  # (before the timeline: what patch_model itself takes)
    results: list[float] = []

    def allocator(since: Optional[dict] = None) -> dict:
        """The caching allocator's device allocations, frees and retries so far (or since `since`)."""
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) - (since or {}).get(k, 0)
                for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}

    with torch.inference_mode():
        before = allocator()
        made = time.perf_counter()
        if not args.profile_pass:
            profiler.enable()
        gen = hp.BatchGenerator(model)
        events.append(dict(what="BatchGenerator()", start=made, end=time.perf_counter()))
        requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
        for _ in gen.as_completed(requests):
            results.append(time.perf_counter())
            if len(results) == 1 and not args.profile_pass:
                profiler.disable()
        torch.cuda.synchronize()
        done = time.perf_counter()
        allocations = allocator(since=before)
        again = None
        if args.again:  # the same job once more in this process: what the cold one paid beyond it
            before_again = allocator()
            start, first = time.perf_counter(), None
            gen2 = hp.BatchGenerator(model)
            requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
            for _ in gen2.as_completed(requests):
                first = first or time.perf_counter()
            torch.cuda.synchronize()
            kinds = [e["what"] for e in events if e["start"] >= start]
            again = dict(job_s=time.perf_counter() - start, first_result_s=first - start,
                         compiles=sum(k.startswith("triton compile") for k in kinds),
                         captures=kinds.count("graph capture"),
                         allocations=allocator(since=before_again))
    for job in compile_workers.history():  # the workers' own compiles (one clock for the machine's processes)
        if job["began"] is not None:
            events.append(dict(what=f"worker compile {job['name']} (asked at {job['asked'] - made:.3f})",
                               start=job["began"], end=job["ended"]))
    timeline = sorted((dict(what=e["what"], start_s=round(e["start"] - made, 4), end_s=round(e["end"] - made, 4))
                       for e in events if made <= e["end"] <= done), key=lambda e: e["start_s"])
    return dict(gpu=torch.cuda.get_device_name(), shape=args.shape, num_inputs=len(items),
                max_batch_tokens=gen.max_batch_tokens, max_batch_rows=gen.max_batch_rows,
                patch_model_s=patch_s, job_s=done - made, first_result_s=results[0] - made, again=again,
                allocations=allocations,
                results_at_s=[round(t - made, 4) for t in results[:10]],
                timeline=timeline, profile_span="the first compile-ahead pass" if args.profile_pass else
                "generator made to first result", host_profile_to_first_result=_top(profiler, args.profile_rows))


def _profile_first_call(owner, name: str, profiler) -> None:
    """`profiler` on for the first call of `owner.name` only."""
    real, seen = getattr(owner, name), []

    def wrapper(*a, **kw):
        if seen:
            return real(*a, **kw)
        seen.append(True)
        profiler.enable()
        try:
            return real(*a, **kw)
        finally:
            profiler.disable()

    setattr(owner, name, wrapper)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="t5-large")
    ap.add_argument("--num-inputs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=5, help="decode steps to put on the timeline")
    ap.add_argument("--profile-rows", type=int, default=40)
    ap.add_argument("--profile-pass", action="store_true",
                    help="profile the first compile-ahead pass alone, not the host up to the first result")
    ap.add_argument("--again", action="store_true",
                    help="run the same job a second time in the process (a new generator) and report it")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(worker(args)), flush=True)
        return
    import common

    common.require_cuda("diag_first_job.py", "cuda")
    out = common.start_suite(args.out, "first_job")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        argv = [sys.executable, __file__, "--worker", *sys.argv[1:]] if argv is None else \
            [sys.executable, __file__, "--worker", *argv]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"diag_first_job.py: the fresh process failed (exit {proc.returncode})")
    report = json.loads(lines[-1][len(RESULT_PREFIX):])
    common.write_json(out / "first_job.json", report)
    print(f"{report['gpu']}, {report['shape']}: patch_model {report['patch_model_s']:.2f} s, then the job "
          f"{report['job_s']:.2f} s, first result after {report['first_result_s']:.2f} s (budget {report['max_batch_tokens']} tokens, {report['max_batch_rows']} rows)")
    if report.get("again"):
        a = report["again"]
        print(f"the same job again in that process: {a['job_s']:.2f} s, first result after {a['first_result_s']:.2f} s "
              f"({a['compiles']} compiles, {a['captures']} graph captures); the cold job's extra "
              f"{report['job_s'] - a['job_s']:.2f} s")
        print(f"the allocator's device allocations / frees / retries: first job "
              f"{' / '.join(str(v) for v in report['allocations'].values())}, again "
              f"{' / '.join(str(v) for v in a['allocations'].values())}")
    print(f"{'start s':>8} {'end s':>8} {'s':>7}  what")
    for e in report["timeline"]:
        if e["start_s"] <= report["first_result_s"] + 0.5:
            print(f"{e['start_s']:8.3f} {e['end_s']:8.3f} {e['end_s'] - e['start_s']:7.3f}  {e['what']}")
    print(f"host, {report['profile_span']} (cumulative s):")
    for row in report["host_profile_to_first_result"][:25]:
        print(f"  {row['cumulative_s']:7.3f} {row['calls']:6d}  {row['function']}")


if __name__ == "__main__":
    main()
