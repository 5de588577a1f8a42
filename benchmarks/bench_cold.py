"""First calls, as on a fresh machine: stock HF generate() vs patched, each process new, Triton's
cache empty.

Each measurement runs in a new Python process whose TRITON_CACHE_DIR is a new empty folder, so
the patched model compiles every kernel it uses. A process builds a random-weight model
(`hf_paged_t5.tiny.build_model`; the t5-small layout by default), then times, in order:
  - `patch_model()` (patched processes only);
  - the first generate() (`--batch` rows, greedy);
  - a second call of the same shape (warm);
  - the first call at a new batch size (`--new-batch` rows, greedy);
  - the first beam call (`--batch` rows, `--beams` beams).
Stock and patched processes alternate, `--repeats` of each; every row reports the medians, with
the Triton kernels compiled and CUDA graphs captured in the patched call. Then (unless
`--no-batch-job`) `bench_batch.py --defaults` runs in one more fresh process with an empty cache:
`BatchGenerator`'s first and second jobs with its defaults against patched static batches and stock
HF on bench_batch's long-tailed workload (`--batch-inputs` inputs). Inputs are random
tokens, `--src-len` long, `--new-tokens` forced (min_new_tokens = max_new_tokens). `build_model`
runs one forward pass (it calibrates the logits), so CUDA, cuBLAS and PyTorch's own kernels are
loaded before the first timed call, in both kinds of process alike; `patch_model()` includes
loading the package's modules on first use.

    python benchmarks/bench_cold.py [--shape t5-large] [--repeats 3] [--device cuda|cpu]
                                    [--compile-workers N] [--out DIR]

`--compile-workers N` sets HF_PAGED_T5_COMPILE_WORKERS in the fresh processes (0: none), for a
run against the package's default; each row counts the Triton compiles of its call and, of them,
the cache hits (a binary a compile worker wrote), and names their kernels (`compiled_kernels`); each
process records `compiles_sent`.

Prints a table and writes DIR/cold.json (default DIR: benchmarks/results/<date>-<gpu>/, with
its env.json). Its top-level keys: `first_generate_s` and `hf_first_generate_s` (medians),
`new_batch_size_s` and `first_beam_call_s` (patched), `first_job_vs_static`, `first_job_vs_hf`,
`warm_job_vs_static` (the batch job's, against the static batch size its sweep picked:
`static_batch_size`), the same two against bench_batch's reference size where the sweep picked
another (`first_job_vs_static_reference`, `warm_job_vs_static_reference`,
`static_reference_batch_size`: 64 rows, what the first-contact issue measured; the targets are
checked against the sweep's pick), `floor_vs_static` and `jobs_pct_of_floor` (bench_batch's
job floor: the workload's K/V reads and matrix products at the GPU's measured rates, against static
batches, and each job's tokens/s in percent of it), `targets` and `targets_met` (true only if every
target holds in this run; the targets are set for the defaults: t5-large, 1 x 300 tokens, 64 new).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

import common  # benchmarks/ is on sys.path

SYSTEMS = ("stock", "patched")
RESULT_PREFIX = "cold-result: "  # the line a worker process prints its JSON on
# (key, bound, "max" | "min"): what a fresh process must reach on one H200, t5-large layout, bf16
TARGETS = (("first_generate_s", 3.0, "max"), ("new_batch_size_s", 0.3, "max"), ("first_beam_call_s", 0.3, "max"),
           ("first_job_vs_static", 3.0, "min"), ("first_job_vs_hf", 30.0, "min"), ("warm_job_vs_static", 4.0, "min"))


def calls(args) -> list[tuple[str, dict]]:
    """(label, {batch: rows, num_beams}) of the timed generate() calls, in order."""
    return [
        (f"first generate(), batch {args.batch}", dict(batch=args.batch, num_beams=1)),
        (f"second call, batch {args.batch}", dict(batch=args.batch, num_beams=1)),
        (f"first call at batch {args.new_batch}", dict(batch=args.new_batch, num_beams=1)),
        (f"first beam call, batch {args.batch} x {args.beams} beams", dict(batch=args.batch, num_beams=args.beams)),
    ]


def worker(args) -> dict:
    """One fresh process's measurements: {rows: label -> {seconds, triton_compiles,
    graphs_captured}, fallback_reasons: why patched calls ran on stock HF, if any did}."""
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = tiny.build_model(args.shape, dtype=dtype, device=device)
    common.sync(device)
    rows = {}
    stalls = common.CallingThreadStalls() if device.type == "cuda" else None
    with common.TritonCompiles() as compiles, common.FallbackLog() as fallbacks:
        def measure(label, fn):
            compiled, hits, captured = compiles.count, compiles.cache_hits, common.graphs_captured(model)
            before = dict(stalls.seconds) if stalls is not None else {}
            seconds, result = common.timed(fn, device)
            rows[label] = dict(seconds=seconds, triton_compiles=compiles.count - compiled,
                               compiled_kernels=sorted(c["kernel"] or "?" for c in compiles.compiled[compiled:]),
                               triton_cache_hits=compiles.cache_hits - hits,
                               graphs_captured=common.graphs_captured(model) - captured,
                               stalls_s={k: v - before[k] for k, v in stalls.seconds.items()} if stalls else {})
            return result

        if args.worker == "patched":
            measure("patch_model()", lambda: hp.patch_model(model))
        with torch.inference_mode():
            for label, kw in calls(args):
                ids, mask = common.random_inputs(kw["batch"], args.src_len, device, model.config.vocab_size)
                measure(label, lambda: model.generate(input_ids=ids, attention_mask=mask, num_beams=kw["num_beams"],
                                                      do_sample=False, max_new_tokens=args.new_tokens,
                                                      min_new_tokens=args.new_tokens))
    return dict(rows=rows, fallback_reasons=sorted(set(fallbacks.reasons)), compiles_sent=common.compiles_sent())


def fresh_env(args, cache: str) -> dict:
    """A fresh process's environment: its own Triton cache, this repository first on the path,
    `--compile-workers` where given."""
    env = {**os.environ, "TRITON_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(common.REPO), str(common.BENCH),
                                                       os.environ.get("PYTHONPATH")]))}
    if args.compile_workers is not None:
        env["HF_PAGED_T5_COMPILE_WORKERS"] = str(args.compile_workers)
    return env


def fresh_process(system: str, args) -> dict:
    """`worker` of `system` in a new interpreter with a new, empty Triton cache."""
    cache = tempfile.mkdtemp(prefix="triton-cold-")
    env = fresh_env(args, cache)
    argv = [sys.executable, __file__, "--worker", system, "--shape", args.shape, "--device", args.device,
            "--batch", str(args.batch), "--new-batch", str(args.new_batch), "--beams", str(args.beams),
            "--src-len", str(args.src_len), "--new-tokens", str(args.new_tokens)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, env=env, check=False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {system} process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def summarize(runs: dict[str, list[dict]], args) -> list[dict]:
    """One row per timed call: each system's median seconds, the patched call's compiles and captures."""
    labels = ["patch_model()"] + [label for label, _ in calls(args)]
    rows = []
    for label in labels:
        row = {"call": label}
        for system in SYSTEMS:
            found = [run["rows"][label] for run in runs[system] if label in run["rows"]]
            row[f"{system}_s"] = common.median(r["seconds"] for r in found) if found else None
            row[f"{system}_runs_s"] = [r["seconds"] for r in found]
        patched = [run["rows"][label] for run in runs["patched"]]
        row["triton_compiles"] = max(r["triton_compiles"] for r in patched)
        row["compiled_kernels"] = sorted({k for r in patched for k in r.get("compiled_kernels", [])})
        row["triton_cache_hits"] = max(r.get("triton_cache_hits", 0) for r in patched)
        row["graphs_captured"] = max(r["graphs_captured"] for r in patched)
        stalls = [r.get("stalls_s") or {} for r in patched]
        row["patched_stalls_s"] = {k: common.median(s.get(k, 0.0) for s in stalls) for k in stalls[0]} if stalls else {}
        stock, paged = row["stock_s"], row["patched_s"]
        row["patched_over_stock"] = paged / stock if stock else None
        rows.append(row)
    return rows


def headline(rows: list[dict], args) -> dict:
    """The first calls' figures the targets name, from the summarized rows."""
    by_label = {r["call"]: r for r in rows}
    labels = [label for label, _ in calls(args)]
    return dict(first_generate_s=by_label[labels[0]]["patched_s"], hf_first_generate_s=by_label[labels[0]]["stock_s"],
                new_batch_size_s=by_label[labels[2]]["patched_s"], first_beam_call_s=by_label[labels[3]]["patched_s"])


def batch_job(args) -> dict:
    """bench_batch.py --defaults in a fresh process with an empty Triton cache: its first and second
    jobs against static batches and HF, and where its report is."""
    cache, folder = tempfile.mkdtemp(prefix="triton-cold-"), tempfile.mkdtemp(prefix="cold-batch-")
    env = fresh_env(args, cache)
    argv = [sys.executable, str(common.BENCH / "bench_batch.py"), "--defaults", "--shape", args.shape,
            "--device", args.device, "--out", folder]
    if args.shape == "tiny":
        argv.append("--quick")
    if args.batch_inputs:
        argv += ["--num-inputs", str(args.batch_inputs)]
    if args.batch_time_budget:
        argv += ["--time-budget", str(args.batch_time_budget)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the batch job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        batch = json.loads(pathlib.Path(folder, "batch.json").read_text())
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    print(proc.stdout[-1500:], flush=True)
    floor = batch.get("job_floor", {})
    return dict(first_job_vs_static=batch["first_job_vs_static"], first_job_vs_hf=batch["first_job_vs_hf"],
                warm_job_vs_static=batch["second_job_vs_static"], warm_job_vs_hf=batch["second_job_vs_hf"],
                first_job_first_result_s=batch["first_result_s"], floor_vs_static=floor.get("vs_static"),
                static_batch_size=batch["runs"]["static_paged"]["batch_size"],
                first_job_vs_static_reference=batch.get("first_job_vs_static_reference"),
                warm_job_vs_static_reference=batch.get("second_job_vs_static_reference"),
                static_reference_batch_size=batch.get("static_reference", {}).get("batch_size"),
                jobs_pct_of_floor=floor.get("batch_generator_pct"), batch_job=batch)


def print_table(rows: list[dict], args) -> None:
    common.print_table(
        ["call", "stock HF s", "patched s", "patched / stock", "Triton compiles", "of them cache hits",
         "graphs captured", "its thread in compiles / loads / captures, s"],
        ([r["call"], common.fmt(r["stock_s"], ".3f"), common.fmt(r["patched_s"], ".3f"),
          common.fmt(r["patched_over_stock"], ".2f"), r["triton_compiles"], r["triton_cache_hits"],
          r["graphs_captured"], " / ".join(f"{r['patched_stalls_s'][k]:.3f}" for k in ("compile", "load", "capture"))
          if r.get("patched_stalls_s") else "-"] for r in rows),
        title=f"{args.shape} layout on {args.device}, {args.src_len}-token inputs, {args.new_tokens} new tokens; "
              f"medians of {args.repeats} fresh processes each, Triton cache empty")
    for r in rows:
        if r.get("compiled_kernels"):
            print(f"{r['call']} compiled (cache hits included): {', '.join(r['compiled_kernels'])}")
    first = [r for r in rows if r["call"].startswith("first") and r["patched_over_stock"] is not None]
    print(f"every first call no slower than stock HF's: {all(r['patched_over_stock'] <= 1.0 for r in first)}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="t5-large",
                    help="hf_paged_t5.tiny layout (default: t5-large; tiny: a smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="default: cuda where torch sees a GPU, else cpu")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per system (default: 3)")
    ap.add_argument("--batch", type=int, default=1, help="rows of the first call (default: 1)")
    ap.add_argument("--new-batch", type=int, default=16, help="rows of the call at a new batch size (default: 16)")
    ap.add_argument("--beams", type=int, default=4, help="beams of the first beam call (default: 4)")
    ap.add_argument("--src-len", type=int, default=300, help="input tokens per row (default: 300)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens forced per call (default: 64)")
    ap.add_argument("--no-batch-job", action="store_true", help="skip the BatchGenerator job in a fresh process")
    ap.add_argument("--batch-inputs", type=int, default=None,
                    help="inputs of the batch job (default: bench_batch's, 2000; 40 with --shape tiny)")
    ap.add_argument("--batch-time-budget", type=float, default=None,
                    help="seconds for the batch job, roughly (default: bench_batch's --time-budget)")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="HF_PAGED_T5_COMPILE_WORKERS of the fresh processes (default: the package's own)")
    ap.add_argument("--out", default=None, help="folder for cold.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)  # one fresh process's part
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    common.require_cuda("bench_cold.py", args.device)
    if args.worker is not None:
        print(RESULT_PREFIX + json.dumps(worker(args)), flush=True)
        return
    out = common.start_suite(args.out, "cold")

    def one(system: str) -> dict:
        run = fresh_process(system, args)
        print(f"{system}: " + ", ".join(f"{label} {r['seconds']:.3f} s" for label, r in run["rows"].items()),
              flush=True)
        return run

    runs = common.interleaved(SYSTEMS, args.repeats, one)
    rows = summarize(runs, args)
    reasons = sorted({reason for run in runs["patched"] for reason in run["fallback_reasons"]})
    report = dict(gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
                  shape=args.shape, dtype="bfloat16" if args.device.startswith("cuda") else "float32",
                  settings={k: v for k, v in vars(args).items() if k not in ("out", "worker")},
                  patched_fallback_reasons=reasons, rows=rows, runs=runs)
    report.update(headline(rows, args))
    if not args.no_batch_job:
        report.update(batch_job(args))
    report["targets"] = {key: f"{'<=' if kind == 'max' else '>='} {bound}" for key, bound, kind in TARGETS}
    report["targets_met"] = all(
        report.get(key) is not None and (report[key] <= bound if kind == "max" else report[key] >= bound)
        for key, bound, kind in TARGETS)
    common.write_json(out / "cold.json", report)
    print_table(rows, args)
    print("targets (" + ", ".join(f"{k} {v}" for k, v in report["targets"].items()) + "): "
          + ", ".join(f"{k} {report.get(k) if report.get(k) is None else round(report[k], 3)}" for k, _, _ in TARGETS)
          + f"; all met: {report['targets_met']}")
    if reasons:
        print(f"patched calls that ran on stock HF: {'; '.join(reasons)}")


if __name__ == "__main__":
    main()
