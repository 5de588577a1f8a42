"""Where a patched decode step's time goes: the whole step, our decode's host work, the graph replay.

    python benchmarks/profile_step.py [--models t5-small,t5-large] [--batch 1,64] [--table PATH]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_paged_t5 as hp
from bench_generate import inputs, make


def timed_decode():
    """Wrap the paged decode step (`patch._decode`) to sum its host time (no syncs added)."""
    import hf_paged_t5.patch as patch_mod

    inner = patch_mod._decode
    spent = [0.0, 0]

    def decode(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    patch_mod._decode = decode
    return spent, lambda: setattr(patch_mod, "_decode", inner)


def run(name: str, batch: int, beams: int, table: str | None, new: int = 64) -> None:
    model = hp.patch_model(make(name, "sdpa", torch.bfloat16))
    ids, mask = inputs(batch, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    with torch.inference_mode():
        model.generate(**kw)
        spent, restore = timed_decode()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(**kw)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / new * 1e3
        restore()
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
    print(f"{name} b{batch} beams{beams}: generate {total:.3f} ms/step | our decode step (host) {fwd:.3f} | "
          f"graph replay alone (GPU) {replay:.3f} | generate minus replay {total - replay:.3f}", flush=True)


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
