"""Where a patched decode step's time goes: the whole step, the host time of its launches (the
decode graph and the greedy / beam update of the device-resident loops), the decode graph alone.

    python benchmarks/profile_step.py [--models t5-small,t5-large] [--batch 1,64] [--table PATH]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_paged_t5 as hp
from bench_generate import inputs, make


def timed_launches():
    """Sum the host time of each step's launches on the device-resident loops (the decode graph's
    `DecodeGraphs.replay` and the greedy / beam update's `run`), no syncs added; restore() undoes it."""
    from hf_paged_t5 import beam_graph, graphs, greedy_graph

    spent = [0.0, 0]
    originals = [(graphs.DecodeGraphs, "replay", graphs.DecodeGraphs.__dict__["replay"]),
                 (greedy_graph.GreedyStep, "run", greedy_graph.GreedyStep.run),
                 (beam_graph.BeamStep, "run", beam_graph.BeamStep.run)]

    def timed(fn, count):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[0] += time.perf_counter() - t0
            spent[1] += count
            return out
        return wrapper

    graphs.DecodeGraphs.replay = staticmethod(timed(graphs.DecodeGraphs.replay, 1))
    greedy_graph.GreedyStep.run = timed(greedy_graph.GreedyStep.run, 0)
    beam_graph.BeamStep.run = timed(beam_graph.BeamStep.run, 0)

    def restore():
        for owner, name, value in originals:
            setattr(owner, name, value)

    return spent, restore


def run(name: str, batch: int, beams: int, table: str | None, new: int = 64) -> None:
    model = hp.patch_model(make(name, "sdpa", torch.bfloat16))
    ids, mask = inputs(batch, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    with torch.inference_mode():
        model.generate(**kw)
        spent, restore = timed_launches()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(**kw)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / new * 1e3
        restore()
        launches = spent[0] / max(spent[1], 1) * 1e3
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
    print(f"{name} b{batch} beams{beams}: generate {total:.3f} ms/step | host launches per step (decode graph + "
          f"update) {launches:.3f} | decode graph replay alone (GPU) {replay:.3f} | generate minus replay "
          f"{total - replay:.3f}", flush=True)


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
