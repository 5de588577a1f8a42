"""Where a BatchGenerator job's time goes: host time per phase, GPU busy time, tokens per step.

Same workload and model as bench_batch.py (t5-large shape, bf16). Wraps the batch run's phases
with perf_counter (no syncs added), and runs the job once more under a CUDA-only profiler to sum
kernel time (GPU busy) against wall time.

    python benchmarks/profile_batch.py [--num-inputs 2000] [--batch-rows 512] [--beams 1] [--stacks NAME]

With --beams K (beam search, K beams per input) the job's beam steps show as `_advance_beams`, and
each input's K rows count against --batch-rows.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from bench_batch import workload


def job(model, items, rows, tokens, beams=1):
    gen = hp.BatchGenerator(model, max_batch_tokens=tokens, max_batch_rows=rows, num_beams=beams)
    requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = sum(r.num_new_tokens for _, r in gen.as_completed(requests))
    torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=2000)
    ap.add_argument("--batch-rows", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=262144)
    ap.add_argument("--beams", type=int, default=1, help="num_beams of the job (default: 1, greedy)")
    ap.add_argument("--stacks", default=None, metavar="NAME",
                    help="also run a tenth of the job with the host's ops recorded and print where the "
                         "operators whose name contains NAME (e.g. 'index') were called from, with their GPU time")
    args = ap.parse_args(argv)
    common.require_cuda("profile_batch.py")
    model = common.make_model("t5-large", "sdpa", torch.bfloat16)
    items = workload(args.num_inputs, model.config.vocab_size, seed=1, quick=False)
    # graphs serve up to max(512, --batch-rows) rows (the default max_graph_batch is 512)
    config = hp.PagedCacheConfig(max_tokens=args.batch_tokens + args.batch_rows * 32,
                                 max_graph_batch=max(512, args.batch_rows))
    hp.patch_model(model, config)
    job(model, items[: len(items) // 4], args.batch_rows, args.batch_tokens, args.beams)  # warm: graphs
    captured = common.graphs_captured(model)
    with common.timers(common.batch_run_phases()) as (spent, calls):
        n, wall = job(model, items, args.batch_rows, args.batch_tokens, args.beams)
    steps = calls["decode step launch"]
    print(f"{n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s; {steps} decode steps, "
          f"{n / max(steps, 1):.1f} tokens/step, {wall / max(steps, 1) * 1e3:.2f} ms/step, "
          f"{common.graphs_captured(model) - captured} graphs captured while timed")
    common.print_table(["host phase", "s", "calls", "ms/call"],
                       ([name, f"{s:.3f}", calls[name], f"{s / max(calls[name], 1) * 1e3:.3f}"]
                        for name, s in spent.most_common()))
    sub = items[: len(items) // 4]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall2 = job(model, sub, args.batch_rows, args.batch_tokens, args.beams)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    print(f"profiled quarter: wall {wall2:.2f} s, GPU kernel time {busy:.2f} s ({busy / wall2:.0%} busy)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))
    if args.stacks:
        with stack_profile([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            job(model, items[: len(items) // 10], args.batch_rows, args.batch_tokens, args.beams)
        print("\n".join(call_sites(prof, args.stacks)))


def stack_profile(activities):
    """A profiler that records each operator's Python call stack (torch keeps an operator's stack only
    with its verbose experimental config; without it `key_averages(group_by_stack_n=...)` has none)."""
    config = torch._C._profiler._ExperimentalConfig(verbose=True)
    return profile(activities=activities, with_stack=True, experimental_config=config)


def call_sites(prof, name: str, top: int = 8, frames: int = 6) -> list[str]:
    """Lines naming the operators whose name contains `name` (aten ops, not kernels), grouped by their
    innermost `frames` Python frames, most device time first: calls, device ms, then the frames."""
    ops = [e for e in prof.key_averages(group_by_stack_n=frames) if "::" in e.key and name in e.key]
    ops.sort(key=lambda e: (-e.device_time_total, -e.count))
    lines = []
    for e in ops[:top]:
        lines.append(f"{e.key}: {e.count} calls, GPU {e.device_time_total / 1e3:.1f} ms")
        lines.extend(f"    {frame}" for frame in e.stack)
    return lines


if __name__ == "__main__":
    main()
