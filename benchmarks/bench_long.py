"""Long inputs: a flan-t5-xl-shaped model summarizes 8k- and 16k-token inputs, and a
long-t5-tglobal-large-shaped LongT5 (both encoder attention types) 4k- and 16k-token ones; time and
peak memory.

    python benchmarks/bench_long.py [--out DIR] [--lengths 8192,16384] [--longt5-lengths 4096,16384]
                                    [--models t5,longt5] [--quick --device cpu]

bf16, random weights, batch 1, 128 new tokens forced. Stock HF (T5: eager and sdpa; LongT5: its
only, eager, attention) and the patched model in one run; a system that runs out of memory is
recorded as "oom". The paged T5 encoder's attention is O(L) in memory (varlen flash attention with
the bias table in the kernel); HF's materializes [heads, L, L] scores and position bias. The paged
LongT5 encoder streams each query block's local window (and, transient-global, the side keys of
its sequence) in the kernel; HF materializes [blocks, heads, block, 3 * block (+ globals)] scores
and bias. Writes DIR/long.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import gc

import torch
from transformers import LongT5Config, LongT5ForConditionalGeneration

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from hf_paged_t5 import tiny

# long-t5-tglobal-large's layout (LongT5Config's defaults are its base); local_radius and the
# global block size are the released checkpoints'
LONGT5_SHAPES = {
    "long-t5-large": dict(vocab_size=32128, d_model=1024, d_kv=64, num_heads=16, d_ff=2816, num_layers=24,
                          num_decoder_layers=24, feed_forward_proj="gated-gelu", local_radius=127,
                          global_block_size=16),
    "tiny": dict(vocab_size=512, d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2,
                 num_decoder_layers=2, feed_forward_proj="gated-gelu", local_radius=7, global_block_size=4),
}
LONGT5_ATTENTION = ("local", "transient-global")


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


def longt5_model(shape: str, attention: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A LongT5 at `shape` with `attention` in its encoder, seeded random weights (HF's init), eval mode."""
    config = LongT5Config(**LONGT5_SHAPES[shape], encoder_attention_type=attention, decoder_start_token_id=0,
                          pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = LongT5ForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval()


def measure(rows: list, model_name: str, system: str, model, lengths, new: int, device: str) -> None:
    """One row per input length for `model` (patched or not) as `system`."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(2, model.config.vocab_size, (1, length), generator=g).to(device)
        r = run(model, ids, new, device)
        rows.append(dict(model=model_name, system=system, src_len=length, new_tokens=new, weights_gib=weights,
                         **r))
        peak = r.get("peak_gib") or float("nan")
        shown = "out of memory" if r.get("oom") else f"{r['seconds']:.2f} s  peak {peak:.2f} GiB"
        print(f"{model_name} {system:6s} L={length:6d}: {shown}", flush=True)


def t5_rows(rows: list, shape: str, lengths, new: int, dtype, device: str) -> None:
    for attn in ("eager", "sdpa", "paged"):
        model = tiny.build_model(shape, family="t5v1_1", dtype=dtype, device=device,
                                 attn_implementation="sdpa" if attn == "paged" else attn)
        if attn == "paged":
            hp.patch_model(model)
        measure(rows, shape, attn, model, lengths, new, device)
        del model
        gc.collect()


def longt5_rows(rows: list, shape: str, lengths, new: int, dtype, device: str) -> None:
    for attention in LONGT5_ATTENTION:
        name = f"{shape}-{'tglobal' if attention == 'transient-global' else 'local'}"
        for system in ("stock", "paged"):
            model = longt5_model(shape, attention, dtype, device)
            if system == "paged":
                hp.patch_model(model)
            measure(rows, name, system, model, lengths, new, device)
            del model
            gc.collect()


def add_speedups(rows: list) -> None:
    """`speedup_vs_best_hf` on each paged row: the fastest stock row of its model and length over it."""
    for r in rows:
        if r["system"] != "paged" or r.get("oom"):
            continue
        hf = [s["seconds"] for s in rows if s["model"] == r["model"] and s["src_len"] == r["src_len"]
              and s["system"] != "paged" and not s.get("oom")]
        if hf:
            r["speedup_vs_best_hf"] = min(hf) / r["seconds"]
            # bf16: paged and stock sum in other orders, so a near tie may pick another token
            stock = [s for s in rows if s["model"] == r["model"] and s["src_len"] == r["src_len"]
                     and s["system"] != "paged" and not s.get("oom")]
            r["same_tokens_as_stock"] = all(s["tokens"] == r["tokens"] for s in stock)
            print(f"{r['model']} L={r['src_len']}: paged {r['speedup_vs_best_hf']:.1f}x faster than the best "
                  "HF", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for long.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="8192,16384", help="input tokens of the T5 rows")
    ap.add_argument("--longt5-lengths", default="4096,16384", help="input tokens of the LongT5 rows")
    ap.add_argument("--models", default="t5,longt5", help="which rows: t5, longt5 or both")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny shapes and lengths (a smoke run; CPU is fine)")
    args = ap.parse_args(argv)
    common.require_cuda("bench_long.py", args.device)
    models = set(args.models.split(","))
    if not models or models - {"t5", "longt5"}:
        ap.error(f"--models takes t5, longt5 or both, got {args.models!r}")
    out = common.start_suite(args.out, "long")
    shape = "tiny" if args.quick else "flan-t5-xl"
    longt5_shape = "tiny" if args.quick else "long-t5-large"
    lengths = [64, 300] if args.quick else [int(n) for n in args.lengths.split(",")]
    longt5_lengths = [64, 300] if args.quick else [int(n) for n in args.longt5_lengths.split(",")]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    new = 8 if args.quick else args.new
    rows = []
    if "t5" in models:
        t5_rows(rows, shape, lengths, new, dtype, args.device)
    if "longt5" in models:
        longt5_rows(rows, longt5_shape, longt5_lengths, new, dtype, args.device)
    add_speedups(rows)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = dict(gpu=gpu, shape=shape, longt5_shape=longt5_shape, dtype=str(dtype),
                  rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    common.write_json(out / "long.json", report)
    common.print_table(
        ["model", "system", "input tokens", "seconds", "peak GiB", "vs best HF"],
        ([r["model"], r["system"], r["src_len"], "out of memory" if r.get("oom") else f"{r['seconds']:.2f}",
          common.fmt(r.get("peak_gib"), ".2f"), common.fmt(r.get("speedup_vs_best_hf"), ".1f")] for r in rows),
        title=f"{dtype}, batch 1, {new} new tokens forced")


if __name__ == "__main__":
    main()
