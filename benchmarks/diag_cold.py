"""Where a cold first generate() spends its seconds, and whether its Triton compiles run in parallel.

    python benchmarks/diag_cold.py [--shape t5-large] [--src-len 300] [--new-tokens 64]
                                   [--profile N [--profile-call I]] [--out DIR]
    python benchmarks/diag_cold.py --encoder t5-v1_1-xxl [--encoder-layers 4] [--src-len 512] [--stock]

Runs itself in a fresh process with an empty TRITON_CACHE_DIR. There it builds the random-weight
model (bf16, not timed), patches it and times five calls: the first generate() (1 row), a first
call at a new batch size, a first beam call, and each of the last two again (warm: what those
first calls cost beyond the work itself). For each call the seconds are split into Triton
compiles (each compile's own wall time, by kernel), CUDA graph captures (capture_begin to
capture_end, less the compiles inside them) and the rest (HF's preamble, the encoder, allocation,
the decode steps). Then it compiles every kernel of those calls again into new empty cache
folders: one after another, then all at once on a thread pool, then on a process pool (each
worker recompiles from the kernel's specialization data, as `JITFunction.preload` does), to
measure how much of the compile time parallel compilation can hide. Writes DIR/cold_diag.json
(`cold_diag-<encoder>[-stock].json`; default DIR: benchmarks/results/<date>-<gpu>/, with its env.json) and prints a table.

`--encoder NAME` (a model of `bench_encoder.py`, bf16, its first `--encoder-layers` layers: the
kernels and their specializations do not depend on the layer count) times three calls of the
patched text encoder at 1 x `--src-len` instead: the first (compiles), the second (the graph
capture), the third (a replay). `--stock` times the same three calls of the unpatched encoder in
its own fresh process: the first-call costs (CUDA and cuBLAS start-up) that any encoder pays.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

RESULT_PREFIX = "cold-diag: "


def _compile_one(item: tuple[str, str, str, str]) -> float:
    """Recompile one kernel from its specialization data in this (pool) process; seconds."""
    module, name, data, cache = item
    os.environ["TRITON_CACHE_DIR"] = cache
    import importlib

    import torch

    torch.cuda.current_device()  # CUDA up, as in the process that compiled it first
    kernel = getattr(importlib.import_module(module), name)
    while not hasattr(kernel, "preload"):  # an autotuner or heuristics around the JITFunction
        kernel = kernel.fn
    start = time.perf_counter()
    kernel.preload(data)
    return time.perf_counter() - start


def _top(profiler, count: int) -> dict[str, list[dict]]:
    """The `count` functions of a cProfile run with the most cumulative time, and with the most own time."""
    stats = pstats.Stats(profiler)
    entries = [dict(function=f"{path.rsplit('/', 2)[-1]}:{line}:{name}", cumulative_s=round(ct, 4), own_s=round(tt, 4),
                    calls=nc) for (path, line, name), (_, nc, tt, ct, _) in stats.stats.items()]
    return dict(cumulative=sorted(entries, key=lambda e: -e["cumulative_s"])[:count],
                own=sorted(entries, key=lambda e: -e["own_s"])[:count])


def _spec_summary(data) -> str:
    """One compile's kernel, constexprs and argument signature (what made it a new binary)."""
    try:
        spec = json.loads(data)
    except (TypeError, ValueError):
        return "?"
    constants = {str(k[0]) if len(k) == 1 else str(k): v for k, v in zip(spec.get("constant_keys", []),
                                                                     spec.get("constant_vals", []))}
    options = {k: spec.get("options", {}).get(k) for k in ("num_warps", "num_stages")}
    pointers = {k: v for k, v in spec.get("signature", {}).items() if str(v).startswith("*")}
    return f"{spec.get('name', '?').rsplit('.', 1)[-1]} {options} constants={constants} pointers={pointers}"


def worker(args) -> dict:
    import torch
    import triton
    import triton.compiler
    from triton import knobs

    import common  # benchmarks/ is on sys.path
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    compiles: list[dict] = []  # one per compile: kernel, seconds, start
    captures: list[list[float]] = []  # [begin, end] per graph capture
    specs: list[tuple[object, str]] = []  # (JITFunction, specialization data) per compiled kernel
    common.hook_compiles_and_captures(
        lambda kernel, start, end: compiles.append(dict(kernel=kernel, start=start, seconds=end - start)),
        lambda start, end: captures.append([start, end]))

    def record_spec(**kw):  # jit_post_compile_hook: the kernel and its specialization data
        specs.append((getattr(kw.get("fn"), "jit_function", None), kw.get("compile", {}).get("specialization_data")))
        return None

    knobs.runtime.jit_post_compile_hook = record_spec
    if args.encoder:
        import bench_encoder

        family, shape, overrides, cls = bench_encoder.MODELS[args.encoder]
        config = tiny.build_config(shape, family=family, **dict(overrides, num_layers=args.encoder_layers))
        with torch.device("cuda"):
            model = cls(config).to(torch.bfloat16).eval()
    else:
        model = tiny.build_model(args.shape, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    if not args.stock:
        hp.patch_model(model)
    patch_s = time.perf_counter() - start
    rows, profile = [], None
    if args.encoder:
        calls = [("first encoder call", 1, 0), ("second (graph capture)", 1, 0), ("third (replay)", 1, 0)]
    else:
        calls = [("first generate(), batch 1", 1, 1), (f"first call at batch {args.new_batch}", args.new_batch, 1),
                 (f"first beam call, {args.beams} beams", 1, args.beams),
                 (f"second call at batch {args.new_batch}", args.new_batch, 1),
                 (f"second beam call, {args.beams} beams", 1, args.beams)]
    with torch.inference_mode():
        for label, batch, beams in calls:
            ids, mask = common.random_inputs(batch, args.src_len, "cuda", model.config.vocab_size)
            if args.encoder:
                mask = None  # as Flux and SD3 call it
            first_compile, first_capture, first_spec = len(compiles), len(captures), len(specs)
            torch.cuda.synchronize()
            profiler = cProfile.Profile() if args.profile and len(rows) == args.profile_call else None
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            if args.encoder:
                model(ids)
            else:
                model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, do_sample=False,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()
                profile = _top(profiler, args.profile)
            mine = compiles[first_compile:]
            compile_s = sum(c["seconds"] for c in mine)
            capture_s = 0.0
            for b, e in captures[first_capture:]:
                inside = sum(c["seconds"] for c in mine if b <= c["start"] <= e)
                capture_s += (e - b) - inside
            by_kernel: dict[str, float] = {}
            for c in mine:
                by_kernel[c["kernel"]] = by_kernel.get(c["kernel"], 0.0) + c["seconds"]
            rows.append(dict(call=label, seconds=seconds, compiles=len(mine), compile_s=compile_s,
                             graphs=len(captures) - first_capture, capture_s=capture_s,
                             rest_s=seconds - compile_s - capture_s,
                             compile_s_by_kernel=dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])),
                             compiled=[_spec_summary(d) for _, d in specs[first_spec:]]))

    # the same kernels compiled again, into new empty caches: serial, threads, processes
    kernels = [(k, d) for k, d in specs if k is not None]
    total = sum(c["seconds"] for c in compiles)
    replay = {}

    def fresh_cache() -> str:
        folder = tempfile.mkdtemp(prefix="triton-diag-")
        knobs.cache.dir = folder
        os.environ["TRITON_CACHE_DIR"] = folder
        for k, _ in kernels:
            for cache in k.device_caches.values():
                cache[0].clear()  # the in-memory kernel cache: compile again
        return folder

    def attempt(name, fn):
        try:
            fn()
        except Exception as exc:  # a mode this Triton does not allow: say so, measure the others
            replay[name + "_error"] = f"{type(exc).__name__}: {exc}"[:500]

    def serial():
        fresh_cache()
        start = time.perf_counter()
        for k, d in kernels:
            k.preload(d)
        replay["serial_s"] = time.perf_counter() - start

    def threads():
        fresh_cache()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(kernels)) as pool:
            list(pool.map(lambda kd: kd[0].preload(kd[1]), kernels))
        replay["threads_s"] = time.perf_counter() - start

    def processes():
        import multiprocessing

        folder = fresh_cache()
        items = [(k.fn.__module__, k.fn.__name__, d, folder) for k, d in kernels]
        start = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(min(len(items), os.cpu_count() or 1),
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            replay["processes_each_s"] = list(pool.map(_compile_one, items))
        replay["processes_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for k, d in kernels:  # this process, from the cache the workers filled
            k.preload(d)
        replay["load_from_cache_s"] = time.perf_counter() - start

    if kernels and all(d for _, d in kernels):
        for name, fn in (("serial", serial), ("threads", threads), ("processes", processes)):
            attempt(name, fn)
    else:
        replay["note"] = "this Triton's post-compile hook gives no specialization data: no replay"
    return dict(profiled_call=calls[args.profile_call][0] if args.profile else None, profile=profile, shape=args.encoder or args.shape, stock=args.stock, src_len=args.src_len, new_tokens=args.new_tokens, patch_model_s=patch_s,
                rows=rows, compiles_total=len(compiles), compile_s_total=total, kernels_replayed=len(kernels),
                replay=replay, cpu_count=os.cpu_count(), triton=triton.__version__)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="t5-large")
    ap.add_argument("--src-len", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--new-batch", type=int, default=16)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--encoder", default=None, help="a text encoder of bench_encoder.py instead of generate()")
    ap.add_argument("--encoder-layers", type=int, default=4)
    ap.add_argument("--stock", action="store_true", help="time the unpatched model's first calls")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile the first call (cProfile) and keep its N costliest functions")
    ap.add_argument("--profile-call", type=int, default=0, choices=range(5), metavar="I",
                    help="with --profile: the call to profile instead of the first (0-4, in the order above)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(worker(args)), flush=True)
        return
    if args.encoder and args.profile_call > 2:
        ap.error("--profile-call: an encoder run times three calls (0-2)")
    import common  # benchmarks/ is on sys.path

    common.require_cuda("diag_cold.py")
    out = common.start_suite(args.out, "cold-diag")
    cache = tempfile.mkdtemp(prefix="triton-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(common.REPO), str(common.BENCH),
                                                       os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, __file__, "--worker", "--shape", args.shape, "--src-len", str(args.src_len),
            "--new-tokens", str(args.new_tokens), "--new-batch", str(args.new_batch), "--beams", str(args.beams),
            "--profile", str(args.profile), "--profile-call", str(args.profile_call), "--encoder-layers", str(args.encoder_layers)]
    argv += ["--encoder", args.encoder] if args.encoder else []
    argv += ["--stock"] if args.stock else []
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(lines[-1][len(RESULT_PREFIX):])
    name = "cold_diag" + (f"-{args.encoder}" if args.encoder else "") + ("-stock" if args.stock else "")
    common.write_json(out / f"{name}.json", report)
    common.print_table(
        ["call", "seconds", "compiles", "compile s", "graphs", "capture s", "rest s"],
        ([r["call"], f"{r['seconds']:.3f}", r["compiles"], f"{r['compile_s']:.3f}", r["graphs"],
          f"{r['capture_s']:.3f}", f"{r['rest_s']:.3f}"] for r in report["rows"]),
        title=f"{args.encoder or args.shape}{' (stock)' if args.stock else ''}, bf16, fresh process, empty Triton cache (patch_model {report['patch_model_s']:.3f} s)")
    for r in report["rows"]:
        print(r["call"], {k: round(v, 3) for k, v in r["compile_s_by_kernel"].items()})
        if r is not report["rows"][0]:
            for summary in r.get("compiled", []):
                print("    compiled:", summary)
    print("replay of", report["kernels_replayed"], "kernels:", report["replay"])
    if report["profile"]:
        print("profile of", report["profiled_call"])
    for entry in [e for part in (report["profile"] or {}).values() for e in part]:
        print(f"{entry['cumulative_s']:8.3f} s cumulative {entry['own_s']:8.3f} s own {entry['calls']:7d} calls  "
              f"{entry['function']}")


if __name__ == "__main__":
    main()
