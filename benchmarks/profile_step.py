"""Where a patched decode step's time goes: whole generate() vs model forward vs graph replay.

    python benchmarks/profile_step.py [--models t5-small,t5-large] [--batch 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_paged_t5 as hp
from bench_generate import inputs, make


def per_call(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def profile(name: str, batch: int, new: int = 64) -> None:
    model = hp.patch_model(make(name, "sdpa", torch.bfloat16))
    ids, mask = inputs(batch, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new)
    with torch.inference_mode():
        model.generate(**kw)
        gen = per_call(lambda: model.generate(**kw), 2) / new
        graphs = model._hf_paged_t5.graphs._graphs
        static = next(iter(graphs.values()))
        replay = per_call(static.graph.replay, 200)
        # Host + device cost of our forward alone, on a live cache (one extra step each call).
        runtime = model._hf_paged_t5
        cache = hp.PagedEncoderDecoderCache(runtime.pool, batch, 1, 4096)
        enc = model.encoder(input_ids=ids, attention_mask=mask)
        dec = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        step = lambda: model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=dec,  # noqa: E731
                             **{runtime.cache_kwarg: cache})
        step()
        fwd = per_call(step, 200)
        cache.release()
    print(f"{name} b{batch}: generate {gen:.3f} ms/step | forward {fwd:.3f} | graph replay {replay:.3f} | "
          f"HF loop + our host {gen - replay:.3f} | graphs {len(graphs)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="t5-small,t5-large")
    ap.add_argument("--batch", default="1")
    args = ap.parse_args()
    for name in args.models.split(","):
        for b in args.batch.split(","):
            profile(name, int(b))


if __name__ == "__main__":
    main()
