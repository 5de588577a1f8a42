"""Encoder-only speed: `T5EncoderModel` patched (varlen kernel) vs HF sdpa and eager, one GPU, one run.

    python benchmarks/bench_encoder.py [--out DIR] [--quick --device cpu]

t5-large and flan-t5-xl encoder shapes, bf16, random weights; batch 1 and 32, length 77 (the
text-encoder case of text-to-image models) and 512; every row full length. Prints ms per
forward and the ratio to the best HF, and writes DIR/encoder.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse

import torch
from transformers import T5EncoderModel

import common  # benchmarks/ is on sys.path
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
        seconds, _ = common.timed(lambda: [model(input_ids=ids) for _ in range(repeats)], device)
    return seconds / repeats * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for encoder.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few repeats (a smoke run; CPU is fine)")
    args = ap.parse_args(argv)
    common.require_cuda("bench_encoder.py", args.device)
    out = common.start_suite(args.out, "encoder")
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
                ids = torch.randint(2, model.config.vocab_size, (batch, length), device=args.device)
                times.setdefault((batch, length), {})[attn] = ms_per_forward(model, ids, args.device, repeats)
            del model
        for (batch, length), t in times.items():
            best = min(t["eager"], t["sdpa"])
            rows.append(dict(model=shape, batch=batch, length=length, hf_eager_ms=t["eager"], hf_sdpa_ms=t["sdpa"],
                             paged_ms=t["paged"], speedup_vs_best_hf=best / t["paged"]))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    common.write_json(out / "encoder.json", dict(gpu=gpu, dtype=str(dtype), repeats=repeats, rows=rows))
    common.print_table(
        ["model", "batch", "length", "HF eager ms", "HF sdpa ms", "paged ms", "vs best HF"],
        ([r["model"], r["batch"], r["length"], f"{r['hf_eager_ms']:.3f}", f"{r['hf_sdpa_ms']:.3f}",
          f"{r['paged_ms']:.3f}", f"{r['speedup_vs_best_hf']:.2f}x"] for r in rows),
        title=f"ms per encoder forward, {dtype}, mean of {repeats} calls")


if __name__ == "__main__":
    main()
