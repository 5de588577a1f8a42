"""The XXL layouts: generate() patched vs stock HF in one process, and fp32 parity at reduced depth.

Random weights (`hf_paged_t5.tiny.build_model`, built on the GPU) with the real shapes of
  - t5-11b:        d_model 1024, 128 heads x d_kv 128, d_ff 65536, ReLU, 24 + 24 layers, tied;
  - flan-t5-xxl:   d_model 4096, 64 heads x 64, d_ff 10240, gated-gelu, 24 + 24 (= t5-v1_1-xxl);
  - madlad400-10b: d_model 2048, 32 heads x 128, d_ff 16384, gated-gelu, 32 + 32, vocabulary
                   256,000, pad id 1 != decoder start 0.
For each: bf16, 512-token inputs, `--new-tokens` forced, batch 1 and 16, greedy; stock HF (sdpa)
first, then the same model patched; ms per decode step (median of `--repeats` calls after one
warm-up call), peak memory, the bf16 tokens' agreement with stock. Then the fp32 parity pass: the
same layout with 2 + 2 layers, a padded batch of 4, greedy: fp32 tokens against stock and a float64
copy, each path's fp32 logit error against that copy along its own tokens, and bf16 tokens likewise.

    python benchmarks/bench_xxl.py [--layouts t5-11b,flan-t5-xxl,madlad400-10b] [--new-tokens 64]
        [--repeats 2] [--out DIR]

Writes DIR/xxl.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import gc

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp

SRC_LEN = 512
BATCHES = (1, 16)

# name -> tiny.build_model kwargs (a base shape, the family, the config fields that differ)
LAYOUTS = {
    "t5-11b": dict(shape="t5-large", family="t5", d_ff=65536, d_kv=128, num_heads=128),
    "flan-t5-xxl": dict(shape="flan-t5-xl", family="t5v1_1", d_model=4096, d_ff=10240, d_kv=64, num_heads=64),
    "madlad400-10b": dict(shape="flan-t5-xl", family="t5v1_1", d_model=2048, d_ff=16384, d_kv=128, num_heads=32,
                          num_layers=32, num_decoder_layers=32, vocab_size=256000, pad_token_id=1,
                          decoder_start_token_id=0, eos_token_id=2),
}


def build(name: str, dtype: torch.dtype, **overrides):
    from hf_paged_t5 import tiny

    kw = {**LAYOUTS[name], **overrides}
    return tiny.build_model(kw.pop("shape"), kw.pop("family"), vocab_size=kw.pop("vocab_size", None), dtype=dtype,
                            device="cuda", attn_implementation="sdpa", **kw)


def timed(model, batch: int, new: int, repeats: int) -> dict:
    """ms per step (median of `repeats` calls after a warm-up call), peak GiB, the tokens."""
    common.fresh_workspaces()
    ids, mask = common.random_inputs(batch, SRC_LEN, vocab_size=min(32000, model.config.vocab_size))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.inference_mode():
        model.generate(**kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        runs = [common.timed(lambda: model.generate(**kw)) for _ in range(repeats)]
    seconds = common.median(s for s, _ in runs)
    return dict(ms_per_step=seconds / new * 1e3, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                tokens=runs[-1][1])


def bench_layout(name: str, new: int, repeats: int) -> list[dict]:
    model = build(name, torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    rows = []
    stock = {}
    for batch in BATCHES:
        try:
            stock[batch] = timed(model, batch, new, repeats)
        except torch.cuda.OutOfMemoryError as exc:  # reported, not fatal
            stock[batch] = dict(error=repr(exc)[:200])
        print(f"{name} stock b{batch}: {stock[batch].get('ms_per_step')}", flush=True)
    hp.patch_model(model)
    for batch in BATCHES:
        paged = timed(model, batch, new, repeats)
        ref = stock[batch].get("tokens")
        agree = None if ref is None or ref.shape != paged["tokens"].shape else float((ref == paged["tokens"]).float().mean())
        hf_ms = stock[batch].get("ms_per_step")
        rows.append(dict(layout=name, batch=batch, src_len=SRC_LEN, new_tokens=new, weights_gib=weights,
                         hf_sdpa_ms_per_step=hf_ms, paged_ms_per_step=paged["ms_per_step"],
                         speedup=None if hf_ms is None else hf_ms / paged["ms_per_step"],
                         hf_peak_gib=stock[batch].get("peak_gib"), paged_peak_gib=paged["peak_gib"],
                         bf16_tokens_agree=agree, hf_error=stock[batch].get("error")))
        print(f"{name} paged b{batch}: {paged['ms_per_step']:.3f} ms/step", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def fp32_parity(name: str, init_factor: float, batch: int = 4, src_len: int = 128, new: int = 32) -> dict:
    """Greedy tokens, fp32, 2 + 2 layers of the layout, a padded batch: patched vs stock, and both
    against a float64 copy. Random weights at these widths can be chaotic in fp32 (stock's own
    rounding flips near-tied tokens): `common.greedy_parity` says whether each differing row first
    differs on a near-tie, and each path's logit error vs float64 along its own tokens."""
    import copy

    model = build(name, torch.float32, num_layers=2, num_decoder_layers=2, initializer_factor=init_factor)
    model64 = copy.deepcopy(model).double()
    ids, mask = common.random_inputs(batch, src_len, vocab_size=min(32000, model.config.vocab_size))
    mask[1::2, src_len // 2:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    kw = dict(**inputs, max_new_tokens=new, min_new_tokens=new)
    with torch.inference_mode():
        ref64 = model64.generate(**kw)
        half = copy.deepcopy(model).to(torch.bfloat16)  # bf16: how far stock and paged each move
        ref16 = half.generate(**kw)
        hp.patch_model(half)
        out16 = half.generate(**kw)
    result = dict(**common.greedy_parity(model, model64, inputs, max_new_tokens=new, min_new_tokens=new),
                  bf16_paged_vs_stock=float((ref16 == out16).float().mean()),
                  bf16_stock_vs_float64=float((ref16 == ref64).float().mean()),
                  bf16_paged_vs_float64=float((out16 == ref64).float().mean()))
    print(f"fp32 parity {name} (2 + 2 layers): {result}", flush=True)
    model = model64 = half = None
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens forced per call (default: 64)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per case; the median is reported")
    ap.add_argument("--init-factor", type=float, default=None,
                    help="initializer_factor of the parity pass's weights (default: tiny.INIT_FACTOR; at these "
                         "widths it makes stock HF's own fp32 logits differ from float64 by 1e-2 to 1e-1, 1.5 by "
                         "far less)")
    ap.add_argument("--parity-only", action="store_true", help="only the parity pass")
    ap.add_argument("--out", default=None, help="folder for xxl.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names or args.new_tokens < 1 or args.repeats < 1:
        ap.error(f"unknown layouts {unknown} (known: {list(LAYOUTS)})" if unknown or not names
                 else "--new-tokens and --repeats must be >= 1")
    common.require_cuda("bench_xxl.py")
    out = common.start_suite(args.out, "xxl")
    from hf_paged_t5 import tiny

    factor = tiny.INIT_FACTOR if args.init_factor is None else args.init_factor
    parity = {name: fp32_parity(name, factor) for name in names}
    rows = [] if args.parity_only else [row for name in names for row in bench_layout(name, args.new_tokens,
                                                                                    args.repeats)]
    common.write_json(out / "xxl.json", dict(gpu=torch.cuda.get_device_name(), repeats=args.repeats,
                                            parity_init_factor=factor, fp32_parity=parity, rows=rows))
    fmt = common.fmt
    common.print_table(
        ["layout", "batch", "weights GiB", "HF sdpa ms", "paged ms", "speedup", "HF peak GiB", "paged peak GiB",
         "bf16 tokens = HF"],
        ([r["layout"], r["batch"], fmt(r["weights_gib"], ".1f"), fmt(r["hf_sdpa_ms_per_step"], ".2f"),
          fmt(r["paged_ms_per_step"], ".2f"), (fmt(r["speedup"], ".1f") or "-") + "x", fmt(r["hf_peak_gib"], ".1f"),
          fmt(r["paged_peak_gib"], ".1f"), fmt(r["bf16_tokens_agree"], ".3f")] for r in rows),
        title=f"ms per decode step, {SRC_LEN}-token inputs, {args.new_tokens} new tokens, bf16, "
              f"median of {args.repeats} calls")
    common.print_table(
        ["layout", "fp32 tokens = HF", "HF fp32 = fp64", "paged fp32 = fp64", "HF fp32 logit error",
         "paged fp32 logit error", "bf16 paged = HF", "HF bf16 = fp64", "paged bf16 = fp64"],
        ([n, fmt(p["agreement"], ".3f"), fmt(p["stock_vs_float64"], ".3f"), fmt(p["paged_vs_float64"], ".3f"),
          fmt(p["stock_error"], ".1e"), fmt(p["paged_error"], ".1e"), fmt(p["bf16_paged_vs_stock"], ".3f"),
          fmt(p["bf16_stock_vs_float64"], ".3f"), fmt(p["bf16_paged_vs_float64"], ".3f")] for n, p in parity.items()),
        title=f"fp32 parity: initializer_factor {factor}, 2 + 2 layers, greedy, a padded batch of 4, 32 new tokens; logit errors against a "
              "float64 copy along each path's own tokens, relative to the largest logit")


if __name__ == "__main__":
    main()
