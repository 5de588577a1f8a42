"""The fused decode layer against one kernel per op, in one process: ms per decode step, kernels
per decoder layer, and where one step's GPU time goes.

    python benchmarks/ab_fusion.py [--models t5-large,flan-t5-xl] [--batch 1,4] [--out DIR]

For each model (`common.make_model`: a real layout, bf16) and batch, patched generate() on
512-token inputs with 128 new tokens forced, under four variants, each on a freshly patched
model (its own graphs): `fused` (`PagedCacheConfig(fused_decode=True)`, programmatic dependent
launches where the GPU has them: the default), `fused-no-pdl` (the same with HF_PAGED_T5_PDL=0),
`unfused` (`fused_decode=False`: one kernel per op) and `unpacked` (the default with
`pack_projections=False`: q/k/v, cross k/v and wi_0/wi_1 a GEMM each, `model/packing.py`).
Each variant reports ms per step of the whole call (median of 5 calls after 2; with
`output_logits`, whose [rows, vocab] float32 copy per step inflates it at 16-64 rows: compare
replays), µs per replay of its decode graph (median of 50, CUDA events), CUDA kernels per
replay, the bf16 tokens' agreement with `unfused` and the first step's logits' relative
difference from it; `fused` and `fused-no-pdl` the kernels of one replay by
name (µs summed; with dependent launches a kernel's time includes its wait for the one before,
so the sums overlap: `fused-no-pdl`'s say where the GPU time goes).
Writes DIR/fusion.json (default DIR: benchmarks/results/<date>-<gpu>/).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp

SRC_LEN, NEW = 512, 128
# (label, fused_decode, HF_PAGED_T5_PDL, pack_projections)
VARIANTS = (("unfused", False, "1", True), ("fused-no-pdl", True, "0", True), ("fused", True, "1", True),
            ("unpacked", True, "1", False))


def replay_us(graph, replays: int = 50) -> float:
    return common.median(common.replay_times_us(graph, replays))


def replay_kernels(graph) -> tuple[int, dict]:
    """(CUDA kernels in one replay, {kernel name: µs}): `common.graph_kernels` without the launch counts."""
    count, by_name = common.graph_kernels(graph)
    return count, {name: us for name, (_, us) in by_name.items()}


def run_variant(model, batch: int, fused: bool, pdl: str, pack: bool) -> dict:
    os.environ["HF_PAGED_T5_PDL"] = pdl  # read when a graph is captured
    if hp.is_patched(model):
        hp.unpatch_model(model)
    gc.collect()
    torch.cuda.empty_cache()
    hp.patch_model(model, hp.PagedCacheConfig(fused_decode=fused, pack_projections=pack))
    ids, mask = common.random_inputs(batch, SRC_LEN)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
              output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        for _ in range(2):
            out = model.generate(**kw)
        times = [common.timed(lambda: model.generate(**kw))[0] for _ in range(5)]
    graph = list(common.decode_graphs(model).values())[-1]
    kernels, by_name = replay_kernels(graph)
    return dict(ms_per_step=common.median(times) / NEW * 1e3, replay_us=replay_us(graph), kernels_per_step=kernels,
                kernels_per_decoder_layer=kernels / model.config.num_decoder_layers, by_name=by_name,
                tokens=out.sequences, logits0=out.logits[0].float())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="t5-large,flan-t5-xl")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("ab_fusion.py")
    out = common.start_suite(args.out, "fusion")
    rows = []
    for name in args.models.split(","):
        model = common.make_model(name, "sdpa", torch.bfloat16)
        for batch in (int(b) for b in args.batch.split(",")):
            results = {label: run_variant(model, batch, *knobs) for label, *knobs in VARIANTS}
            base = results["unfused"]
            for label, r in results.items():
                rows.append(dict(
                    model=name, batch=batch, variant=label, ms_per_step=r["ms_per_step"], replay_us=r["replay_us"],
                    kernels_per_step=r["kernels_per_step"], kernels_per_decoder_layer=r["kernels_per_decoder_layer"],
                    tokens_agree_with_unfused=float((r["tokens"] == base["tokens"]).float().mean()),
                    logits0_rel_diff=float((r["logits0"] - base["logits0"]).norm() / base["logits0"].norm()),
                    kernels_by_name_us=r["by_name"] if label in ("fused", "fused-no-pdl") else None,
                ))
                print(f"{name} b{batch} {label}: {r['ms_per_step']:.3f} ms/step, replay {r['replay_us']:.0f} us, "
                      f"{r['kernels_per_decoder_layer']:.1f} kernels/layer", flush=True)
        hp.unpatch_model(model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    os.environ.pop("HF_PAGED_T5_PDL", None)
    common.write_json(out / "fusion.json", dict(gpu=torch.cuda.get_device_name(), src_len=SRC_LEN, new_tokens=NEW,
                                                rows=rows))
    fmt = common.fmt
    common.print_table(
        ["model", "batch", "variant", "ms/step", "replay us", "kernels/layer", "tokens = unfused", "logits diff"],
        ([r["model"], r["batch"], r["variant"], fmt(r["ms_per_step"], ".3f"), fmt(r["replay_us"], ".0f"),
          fmt(r["kernels_per_decoder_layer"], ".1f"), fmt(r["tokens_agree_with_unfused"], ".3f"),
          fmt(r["logits0_rel_diff"], ".1e")] for r in rows),
        title=f"decode step, {SRC_LEN}-token inputs, {NEW} new tokens, bf16")


if __name__ == "__main__":
    main()
