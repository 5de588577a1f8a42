"""Where a patched generate()'s peak memory comes from: the allocations alive at the peak, by caller.

Records PyTorch's CUDA allocation history during one generate() call (after a warm-up call), replays
it to find the peak, and prints the live bytes at that moment grouped by the innermost frame in
hf_paged_t5 / transformers (plus what was allocated before the call: weights, pool, graph pools).

    python benchmarks/diag_memory.py [--models t5-small] [--cases 8x4,16x1] [--hf]
"""

from __future__ import annotations

import argparse
import collections
import gc

import torch

import hf_paged_t5 as hp
from bench_generate import inputs, make


def caller(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "hf_paged_t5" in name or "transformers" in name:
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "other"


def peak_breakdown(trace) -> tuple[int, collections.Counter]:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], caller(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by = collections.Counter()
    for size, where in at_peak.values():
        by[where] += size
    return peak, by


def run(name: str, batch: int, beams: int, patched: bool, src: int = 512, new: int = 128) -> None:
    model = make(name, "sdpa", torch.bfloat16)
    if patched:
        hp.patch_model(model)
    ids, mask = inputs(batch, src)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    weights = torch.cuda.memory_allocated()
    with torch.inference_mode():
        model.generate(**kw)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        model.generate(**kw)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    trace_peak, by = peak_breakdown(snap["device_traces"][torch.cuda.current_device()])
    gib = 2**30
    print(f"\n== {name} b{batch} beams{beams} {'patched' if patched else 'HF sdpa'}: weights {weights / gib:.3f} GiB, "
          f"held before the call {(before - weights) / gib:.3f}, peak - weights {(peak - weights) / gib:.3f}, "
          f"allocated in the call at its peak {trace_peak / gib:.3f}")
    if patched:
        rt = model._hf_paged_t5
        pool = rt.pool
        print(f"  pool: {pool.num_blocks if pool is not None else 0} blocks, "
              f"{(pool.num_blocks * pool.bytes_per_block() if pool is not None else 0) / gib:.3f} GiB")
        print("  graphs:", list(rt.graphs._graphs.keys()))
    for where, size in by.most_common(12):
        print(f"  {size / 2**20:9.1f} MiB  {where}")
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="t5-small")
    ap.add_argument("--cases", default="8x4")
    ap.add_argument("--hf", action="store_true", help="also break down unpatched HF")
    args = ap.parse_args()
    for name in args.models.split(","):
        for case in args.cases.split(","):
            b, k = map(int, case.split("x"))
            if args.hf:
                run(name, b, k, False)
            run(name, b, k, True)


if __name__ == "__main__":
    main()
