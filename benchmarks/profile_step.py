"""Where a patched decode step's time goes: HF's loop, our forward's host work, the graph replay.

    python benchmarks/profile_step.py [--models t5-small,t5-large] [--batch 1,64] [--table PATH]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_paged_t5 as hp
from bench_generate import inputs, make


def timed_forward(model):
    """Wrap the patched forward to sum its host time (no syncs added)."""
    inner = model.forward
    spent = [0.0, 0]

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    model.forward = forward
    return spent


def run(name: str, batch: int, beams: int, table: str | None, new: int = 64) -> None:
    model = hp.patch_model(make(name, "sdpa", torch.bfloat16))
    ids, mask = inputs(batch, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    with torch.inference_mode():
        model.generate(**kw)
        spent = timed_forward(model)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(**kw)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / new * 1e3
        fwd = spent[0] / spent[1] * 1e3
        static = next(iter(model._hf_paged_t5.graphs._graphs.values()))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            static.graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t0) / 100 * 1e3
        if table:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate(**{**kw, "max_new_tokens": 16, "min_new_tokens": 16})
            with open(table, "a") as f:
                f.write(f"\n##### {name} b{batch} beams{beams}\n")
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45))
    print(f"{name} b{batch} beams{beams}: generate {total:.3f} ms/step | our forward (host) {fwd:.3f} | "
          f"graph replay (GPU) {replay:.3f} | rest (HF loop) {total - fwd - replay:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="t5-small,t5-large")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--beams", default="1")
    ap.add_argument("--table", default=None)
    args = ap.parse_args()
    for name in args.models.split(","):
        for b in args.batch.split(","):
            for k in args.beams.split(","):
                run(name, int(b), int(k), args.table)


if __name__ == "__main__":
    main()
