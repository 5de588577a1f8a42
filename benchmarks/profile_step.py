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


def fixed_ms(model, kw: dict, calls: int = 5) -> float:
    """Median ms of a generate() call with one new token: the per-call cost (HF's preamble, the
    encoder, the decoder prompt, the loop's setup) that every step of a call shares."""
    one = {**kw, "max_new_tokens": 1, "min_new_tokens": 1}
    times = []
    with torch.inference_mode():
        model.generate(**one)
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(**one)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def phase_ms(model, kw: dict, calls: int = 5) -> dict:
    """Median ms per phase of a generate() call with one new token, each phase bracketed by
    device syncs: the encoder, the loop's set-up (decoder prompt + static step buffers), the
    update's capture, the step state; 'rest' is HF's preamble and the paged call's own set-up."""
    from hf_paged_t5 import beam_graph, graphs, greedy_graph

    spent: dict[str, float] = {}

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            spent[label] = spent.get(label, 0.0) + (time.perf_counter() - t0) * 1e3
            return out
        return wrapper

    targets = [(model.encoder, "forward", "encoder"), (graphs.ResidentLoop, "__init__", "prompt + buffers"),
               (graphs.ResidentLoop, "capture_update", "update capture"),
               (greedy_graph.GreedyStep, "__init__", "step state"),
               (beam_graph.BeamStep, "__init__", "step state")]
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in targets]
    for obj, attr, label in targets:
        setattr(obj, attr, timed(label, getattr(obj, attr)))
    one = {**kw, "max_new_tokens": 1, "min_new_tokens": 1}
    rows = []
    try:
        with torch.inference_mode():
            for _ in range(calls):
                spent.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(**one)
                torch.cuda.synchronize()
                total = (time.perf_counter() - t0) * 1e3
                rows.append({**spent, "rest": total - sum(spent.values()), "total": total})
    finally:
        for obj, attr, value in saved:
            if value is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
    return {k: sorted(r.get(k, 0.0) for r in rows)[len(rows) // 2] for k in rows[0]}


def run(name: str, batch: int, beams: int, table: str | None, new: int = 64, table_new: int = 16) -> None:
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
                model.generate(**{**kw, "max_new_tokens": table_new, "min_new_tokens": table_new})
            with open(table, "a") as f:
                f.write(f"\n##### {name} b{batch} beams{beams}\n")
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45))
    fixed = fixed_ms(model, kw)
    phases = phase_ms(model, kw)
    print(f"{name} b{batch} beams{beams}: phases of a 1-token call (ms, synced) "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    print(f"{name} b{batch} beams{beams}: per call outside the steps (generate() with 1 new token) {fixed:.2f} ms",
          flush=True)
    print(f"{name} b{batch} beams{beams}: generate {total:.3f} ms/step | host launches per step (decode graph + "
          f"update) {launches:.3f} | decode graph replay alone (GPU) {replay:.3f} | generate minus replay "
          f"{total - replay:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="t5-small,t5-large")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--beams", default="1")
    ap.add_argument("--table", default=None, help="append a torch.profiler table of one call to this file")
    ap.add_argument("--table-new-tokens", type=int, default=16, help="new tokens of the profiled call")
    args = ap.parse_args()
    for name in args.models.split(","):
        for b in args.batch.split(","):
            for k in args.beams.split(","):
                run(name, int(b), int(k), args.table, table_new=args.table_new_tokens)


if __name__ == "__main__":
    main()
