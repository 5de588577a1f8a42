"""Where a patched generate()'s peak memory comes from: the allocations alive at the peak, by caller.

Records PyTorch's CUDA allocation history during one generate() call (after a warm-up call), replays
it to find the peak, and prints the live bytes at that moment grouped by the innermost frame in
hf_paged_t5 / transformers (plus what was allocated before the call: weights, pool, graph pools).

    python benchmarks/diag_memory.py [--models t5-small] [--cases 1x1,16x1,64x1,8x4] [--hf]
"""

from __future__ import annotations

import argparse
import collections
import gc

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp


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


def held_by_caller() -> collections.Counter:
    """Bytes of every live allocation now, by the caller recorded when it was made."""
    by = collections.Counter()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                by[caller(block.get("frames", []))] += block["size"]
    return by


def run(name: str, cases: list[tuple[int, int]], patched: bool, src: int = 512, new: int = 128) -> None:
    """The cases in order on one model, as bench_generate runs them (re-patched per case, a short
    warm-up call, then the measured shape); the last case is broken down."""
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    model = common.make_model(name, "sdpa", torch.bfloat16)
    weights = torch.cuda.memory_allocated()
    gib = 2**30
    for i, (batch, beams) in enumerate(cases):
        if patched:
            hp.patch_model(model)
        gc.collect()
        torch.cuda.empty_cache()
        ids, mask = common.random_inputs(batch, src)
        kw = dict(max_new_tokens=new, min_new_tokens=new, num_beams=beams)
        with torch.inference_mode():
            model.generate(input_ids=ids[:, :32], attention_mask=mask[:, :32], max_new_tokens=4, min_new_tokens=4,
                           num_beams=beams)
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            held = held_by_caller()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(enabled=None)  # the trace from here: this call only
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        print(f"== {name} b{batch} beams{beams} {'patched' if patched else 'HF sdpa'} (case {i + 1}/{len(cases)}): "
              f"peak - weights {(peak - weights) / gib:.3f} GiB, held before the call {(before - weights) / gib:.3f}")
        if i + 1 < len(cases):
            continue
        for where, size in held.most_common(10):
            print(f"  held {size / 2**20:9.1f} MiB  {where}")
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        trace_peak, by = peak_breakdown(trace)
        print(f"  allocated in the call at its peak {trace_peak / gib:.3f} GiB")
        for where, size in by.most_common(10):
            print(f"  call {size / 2**20:9.1f} MiB  {where}")
        if patched:
            pool = common.kv_pool(model)
            print(f"  pool: {pool.num_blocks} blocks, {pool.num_blocks * pool.bytes_per_block() / gib:.3f} GiB; "
                  f"graphs {list(common.decode_graphs(model))}")
    torch.cuda.memory._record_memory_history(enabled=None)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="t5-small")
    ap.add_argument("--cases", default="8x4", help="run in order on one model; the last is broken down")
    ap.add_argument("--hf", action="store_true", help="also break down unpatched HF")
    args = ap.parse_args(argv)
    common.require_cuda("diag_memory.py")
    cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    for name in args.models.split(","):
        if args.hf:
            run(name, cases, False)
        run(name, cases, True)


if __name__ == "__main__":
    main()
