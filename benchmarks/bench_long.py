"""Long inputs: a flan-t5-xl-shaped model summarizes 8k- and 16k-token inputs; time and peak memory.

    python benchmarks/bench_long.py [--out DIR] [--lengths 8192,16384] [--quick --device cpu]

bf16, random weights, batch 1, 128 new tokens forced. Stock HF (eager and sdpa) and the patched
model in one run; a system that runs out of memory is recorded as "oom". The paged encoder's
attention is O(L) in memory (varlen flash attention with the bias table in the kernel); HF's
materializes [heads, L, L] scores and position bias. Writes DIR/long.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import gc

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from hf_paged_t5 import tiny


def run(model, ids, new: int, device: str) -> dict:
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new)
    try:
        with torch.inference_mode():
            model.generate(**{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            seconds, out = common.timed(lambda: model.generate(**kw), device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        return dict(seconds=seconds, peak_gib=peak, tokens=out[0].tolist())
    except torch.OutOfMemoryError:
        return dict(oom=True)
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for long.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny shape and lengths (a smoke run; CPU is fine)")
    args = ap.parse_args(argv)
    common.require_cuda("bench_long.py", args.device)
    out = common.start_suite(args.out, "long")
    shape = "tiny" if args.quick else "flan-t5-xl"
    lengths = [64, 300] if args.quick else [int(n) for n in args.lengths.split(",")]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    new = 8 if args.quick else args.new
    rows = []
    for attn in ("eager", "sdpa", "paged"):
        model = tiny.build_model(shape, family="t5v1_1", dtype=dtype, device=args.device,
                                 attn_implementation="sdpa" if attn == "paged" else attn)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        if attn == "paged":
            hp.patch_model(model)
        for length in lengths:
            g = torch.Generator().manual_seed(length)
            ids = torch.randint(2, model.config.vocab_size, (1, length), generator=g).to(args.device)
            r = run(model, ids, new, args.device)
            rows.append(dict(system=attn, src_len=length, new_tokens=new, weights_gib=weights, **r))
            shown = "out of memory" if r.get("oom") else (
                f"{r['seconds']:.2f} s  peak {r['peak_gib'] or float('nan'):.2f} GiB")
            print(f"{attn:6s} L={length:6d}: {shown}", flush=True)
        del model
        gc.collect()
    for length in lengths:
        by = {r["system"]: r for r in rows if r["src_len"] == length}
        hf = [by[a]["seconds"] for a in ("eager", "sdpa") if not by[a].get("oom")]
        paged = by["paged"]
        if hf and not paged.get("oom"):
            paged["speedup_vs_best_hf"] = min(hf) / paged["seconds"]
            print(f"L={length}: paged {paged['speedup_vs_best_hf']:.1f}x faster than the best HF", flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = dict(gpu=gpu, shape=shape, dtype=str(dtype),
                  rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    common.write_json(out / "long.json", report)
    common.print_table(
        ["system", "input tokens", "seconds", "peak GiB", "vs best HF"],
        ([r["system"], r["src_len"], "out of memory" if r.get("oom") else f"{r['seconds']:.2f}",
          common.fmt(r.get("peak_gib"), ".2f"), common.fmt(r.get("speedup_vs_best_hf"), ".1f")] for r in rows),
        title=f"{shape}, {dtype}, batch 1, {new} new tokens forced")


if __name__ == "__main__":
    main()
