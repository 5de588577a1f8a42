"""Encoder-only speed: `T5EncoderModel` patched (varlen kernel) vs HF sdpa and eager, one GPU, one run.

    python benchmarks/bench_encoder.py [--out DIR] [--quick --device cpu]

t5-large and flan-t5-xl encoder shapes, bf16, random weights; batch 1 and 32, length 77 (the
text-encoder case of text-to-image models) and 512; every row full length. Prints ms per
forward and the ratio to the best HF, and writes `encoder-<gpu>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
from transformers import T5EncoderModel

import hf_paged_t5 as hp
from hf_paged_t5 import tiny


def encoder(shape: str, attn: str, dtype: torch.dtype, device: str) -> T5EncoderModel:
    config = tiny.build_config(shape, family="t5v1_1" if "flan" in shape else "t5")
    config._attn_implementation = attn
    with torch.device(device):
        torch.manual_seed(0)
        model = T5EncoderModel(config)
    return model.to(dtype).eval()


def ms_per_forward(model, ids, device: str, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(2):
            model(input_ids=ids)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=ids)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few repeats (a smoke run; CPU is fine)")
    args = ap.parse_args()
    shapes = ["tiny"] if args.quick else ["t5-large", "flan-t5-xl"]
    cases = [(1, 16), (4, 32)] if args.quick else [(1, 77), (32, 77), (1, 512), (32, 512)]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    repeats = 3 if args.quick else 20
    rows = []
    for shape in shapes:
        times: dict[tuple, dict] = {}
        for attn in ("eager", "sdpa", "paged"):
            model = encoder(shape, "sdpa" if attn == "paged" else attn, dtype, args.device)
            if attn == "paged":
                hp.patch_model(model)
            for batch, length in cases:
                ids = torch.randint(2, 32000 if not args.quick else 100, (batch, length), device=args.device)
                times.setdefault((batch, length), {})[attn] = ms_per_forward(model, ids, args.device, repeats)
            del model
        for (batch, length), t in times.items():
            best = min(t["eager"], t["sdpa"])
            rows.append(dict(model=shape, batch=batch, length=length, hf_eager_ms=t["eager"], hf_sdpa_ms=t["sdpa"],
                             paged_ms=t["paged"], speedup_vs_best_hf=best / t["paged"]))
            print(f"{shape:11s} b{batch:<3d} L{length:<4d} eager {t['eager']:8.3f} ms  sdpa {t['sdpa']:8.3f} ms  "
                  f"paged {t['paged']:8.3f} ms  ({best / t['paged']:.2f}x best HF)", flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = dict(gpu=gpu, torch=torch.__version__, date=datetime.date.today().isoformat(),
                  dtype=str(dtype), rows=rows)
    path = os.path.join(args.out, f"encoder-{gpu.replace(' ', '_')}-{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
