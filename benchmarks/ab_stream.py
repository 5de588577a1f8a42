"""A/B in one process: patched generate() on the generation stream (the default) vs on the
caller's stream, alternating, so machine-to-machine noise cannot stand in for the difference.

    python benchmarks/ab_stream.py [--rounds 3] [--shape t5-small]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import hf_paged_t5 as hp
from bench_generate import fresh_workspaces, inputs, make  # benchmarks/ is on sys.path
from hf_paged_t5 import patch


@contextlib.contextmanager
def _callers_stream(runtime, model):
    yield lambda result: result


def step_ms(model, batch, beams, src_len=512, new=128) -> tuple[float, float]:
    ids, mask = inputs(batch, src_len)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    with torch.inference_mode():
        model.generate(**kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model.generate(**kw)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / new * 1e3, torch.cuda.max_memory_allocated() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="t5-small")
    args = ap.parse_args()
    original = patch._generation_stream
    model = make(args.shape, "sdpa", torch.bfloat16)
    results: dict[tuple, list] = {}
    for _ in range(args.rounds):
        for mode in ("generation stream", "caller's stream"):
            patch._generation_stream = original if mode == "generation stream" else _callers_stream
            for batch, beams in ((1, 1), (8, 4)):
                if hp.is_patched(model):
                    hp.unpatch_model(model)
                fresh_workspaces()
                hp.patch_model(model)
                results.setdefault((mode, batch, beams), []).append(step_ms(model, batch, beams))
    patch._generation_stream = original
    for (mode, batch, beams), runs in results.items():
        ms = statistics.median(r[0] for r in runs)
        peak = max(r[1] for r in runs)
        print(f"{mode:<18} b{batch} beams{beams}: {ms:.3f} ms/step (runs {[round(r[0], 3) for r in runs]}), "
              f"peak {peak:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
