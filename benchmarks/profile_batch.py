"""Where a BatchGenerator job's time goes: host time per phase, GPU busy time, rows per step.

Same workload and model as bench_batch.py (t5-large shape, bf16). Wraps BatchRun's phases with
perf_counter (no syncs added), and runs the job once more under a CUDA-only profiler to sum kernel
time (GPU busy) against wall time.

    python benchmarks/profile_batch.py [--num-inputs 2000] [--batch-rows 512]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_paged_t5 as hp
import hf_paged_t5.batch_run as br
from bench_batch import make_model, workload


def instrument() -> tuple[collections.Counter, collections.Counter]:
    spent, calls = collections.Counter(), collections.Counter()
    for name in ("_admit", "_encode", "_decode_step", "_rebuild_order", "_advance_rows", "_advance_beams", "_retire"):
        inner = getattr(br.BatchRun, name)

        def wrapped(self, *a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _inner(self, *a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0
                calls[_name] += 1

        setattr(br.BatchRun, name, wrapped)
    inner_decode = br._decode

    def decode(runtime, model, cache, ids):
        t0 = time.perf_counter()
        out = inner_decode(runtime, model, cache, ids)
        spent["_decode (graph launch)"] += time.perf_counter() - t0
        calls["_decode (graph launch)"] += 1
        calls["rows"] += ids.shape[0]
        return out

    br._decode = decode
    return spent, calls


def job(model, items, rows, tokens):
    gen = hp.BatchGenerator(model, max_batch_tokens=tokens, max_batch_rows=rows)
    requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = sum(r.num_new_tokens for _, r in gen.as_completed(requests))
    torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-inputs", type=int, default=2000)
    ap.add_argument("--batch-rows", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=262144)
    args = ap.parse_args()
    model = make_model("t5-large", torch.bfloat16, "cuda")
    items = workload(args.num_inputs, model.config.vocab_size, seed=1, quick=False)
    # graphs serve up to max(512, --batch-rows) rows (the default max_graph_batch is 512)
    config = hp.PagedCacheConfig(max_tokens=args.batch_tokens + args.batch_rows * 32,
                                 max_graph_batch=max(512, args.batch_rows))
    hp.patch_model(model, config)
    graphs = model._hf_paged_t5.graphs
    job(model, items[: len(items) // 4], args.batch_rows, args.batch_tokens)  # warm: graphs
    spent, calls = instrument()
    captured = graphs.captures
    n, wall = job(model, items, args.batch_rows, args.batch_tokens)
    steps = calls["_decode (graph launch)"]
    print(f"{n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s; {steps} decode steps, "
          f"{calls['rows'] / max(steps, 1):.1f} rows/step, {wall / max(steps, 1) * 1e3:.2f} ms/step, "
          f"{graphs.captures - captured} graphs captured while timed")
    for name, s in spent.most_common():
        print(f"  host {name:28s} {s:7.3f} s  {calls[name]:6d} calls  {s / max(calls[name], 1) * 1e3:8.3f} ms/call")
    sub = items[: len(items) // 4]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n2, wall2 = job(model, sub, args.batch_rows, args.batch_tokens)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    print(f"profiled quarter: wall {wall2:.2f} s, GPU kernel time {busy:.2f} s ({busy / wall2:.0%} busy)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))


if __name__ == "__main__":
    main()
