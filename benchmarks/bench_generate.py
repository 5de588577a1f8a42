"""generate() speed: unpatched HF (eager and sdpa) vs patched, in one run, on one GPU.

Random weights with the real shapes of t5-small, t5-base, t5-large and flan-t5-xl; bf16;
512-token inputs; 128 new tokens forced (min_new_tokens). Also an fp32 parity pass: greedy
tokens of the patched model identical to HF's (t5-small and t5-large shapes, batch 16, on
`tiny.build_model` weights, whose tokens depend on the input), and both against a float64 copy.
Every case starts with no cuBLAS workspace allocated (`fresh_workspaces`), so its peak memory
counts the workspaces its own system makes (HF: the caller's stream; patched: the generation
stream its graphs are captured on) and none an earlier case left.

    python benchmarks/bench_generate.py [--out DIR] [--models t5-small,t5-base,t5-large,flan-t5-xl] [--parity t5-small,t5-large]
        [--quick] [--repeats 3] [--hf eager,sdpa] [--cases 1x1,16x1,64x1,8x4]

A model's stock rows take most of a run (t5-large: ~2 minutes for both implementations at 3 calls
per case on an H200): `--hf sdpa` times stock HF's sdpa alone, `--cases` fewer cases.

Where `ctranslate2` is importable, CTranslate2 is a row too: the same weights saved and
converted with its own converter (bf16), `Translator.translate_batch` on the same token ids as
strings, exactly 128 new tokens (`min_decoding_length` = `max_decoding_length`), the same beams.
The JSON also holds `kernels_per_decoder_layer` (CUDA kernels of one graphed step, from a profile,
over the decoder's layers), per row that step's kernels by name (`step_kernels_by_name`: launches
and µs of GPU time, most time first) and two floors per row: `floor_ms_per_step`, the decoder weights and
the K/V a step reads at the read bandwidth measured in the same run (a sum over 1 GiB), and
`launch_floor_ms_per_step`, the step's kernels at the graphed launch cost measured in the run.

Writes DIR/generate.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import time
from typing import Optional

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp

CASES = [(1, 1), (16, 1), (64, 1), (8, 4)]  # (batch, num_beams)
SRC_LEN = 512


def timed(model, batch, src_len, new, beams, repeats):
    """ms per step (the median of `repeats` calls after three warm-up calls), peak GiB, the tokens."""
    common.fresh_workspaces()  # the previous patched runtime is collected: no graph is alive
    ids, mask = common.random_inputs(batch, src_len)
    kw = dict(max_new_tokens=new, min_new_tokens=new, num_beams=beams, do_sample=False)
    with torch.inference_mode():
        model.generate(input_ids=ids[:, :32], attention_mask=mask[:, :32], max_new_tokens=4, min_new_tokens=4,
                       num_beams=beams)
        for _ in range(2):  # warm: graphs (a shape's second call captures its encoder's), autotune, allocator
            model.generate(input_ids=ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # the median: one host hiccup (a GC pass, a busy core) skews one call
        runs = [common.timed(lambda: model.generate(input_ids=ids, attention_mask=mask, **kw)) for _ in range(repeats)]
    dt = common.median(seconds for seconds, _ in runs)
    return dict(ms_per_step=dt / new * 1e3, peak_gib=torch.cuda.max_memory_allocated() / 2**30, tokens=runs[-1][1])


def launch_us() -> float:
    """Time per tiny kernel replayed in a CUDA graph: the per-kernel floor of a graphed step."""
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(500):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (20 * 500) * 1e6


def step_kernels(model) -> tuple[int, dict]:
    """CUDA kernels in one replay of the patched model's most recently used decode graph
    (`common.graph_kernels`): what a step's time is made of."""
    return common.graph_kernels(list(common.decode_graphs(model).values())[-1])


def floor_ms(model, batch, beams, src_len, new, kernels, read_gbps, launch) -> dict:
    """The step's floor: the decoder weights a step reads and its K/V, once per step at the read
    bandwidth measured in the same run (`floor_ms`); and what `kernels` graphed launches cost at
    least (`launch_floor_ms`), a floor of the kernel count, not of the memory system."""
    cfg = model.config
    # The cross k / v projections ran once per source, before the steps: a step does not read them.
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if n.startswith(("decoder.block", "lm_head", "decoder.final"))
                       and ".EncDecAttention.k." not in n and ".EncDecAttention.v." not in n)
    kv_row = cfg.num_decoder_layers * 2 * cfg.num_heads * cfg.d_kv * 2  # bf16 K+V per token, all layers
    kv_bytes = batch * src_len * kv_row + batch * beams * (new / 2) * kv_row  # cross once per source; self avg
    bytes_ms = (weight_bytes + kv_bytes) / (read_gbps * 1e9) * 1e3
    return dict(floor_ms=bytes_ms, launch_floor_ms=kernels * launch * 1e-3, kernels_per_step=kernels)


def ct2_translator(model, folder: str, device: str, compute_type: str):
    """(ctranslate2.Translator of `model`, its vocabulary: token of each id), or None where
    ctranslate2 is not importable. The model is saved with the package's local tokenizer (whose
    pad / EOS / unk ids are T5's 0 / 1 / 2) and converted as CTranslate2's own converter does;
    ids past the tokenizer's vocabulary become CTranslate2's `<extra_id_N>` tokens."""
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        return None
    import json
    import pathlib

    from hf_paged_t5 import tiny

    source = pathlib.Path(folder) / "hf"
    model.save_pretrained(source)
    tiny.build_tokenizer().save_pretrained(source)
    converted = pathlib.Path(folder) / "ct2"
    TransformersConverter(str(source)).convert(str(converted), quantization=compute_type, force=True)
    vocabulary = json.loads((converted / "shared_vocabulary.json").read_text())
    return ctranslate2.Translator(str(converted), device=device, compute_type=compute_type), vocabulary


def ct2_tokens(vocabulary, ids) -> list[list[str]]:
    """The rows of `ids` as CTranslate2's token strings."""
    return [[vocabulary[i] for i in row] for row in ids.tolist()]


def ct2_case(translator, source: list[list[str]], new: int, beams: int):
    """One `translate_batch` of `source`, exactly `new` tokens per row (min and max decoding
    length), `beams` beams, the best hypothesis only."""
    return translator.translate_batch(source, beam_size=beams, num_hypotheses=1, min_decoding_length=new,
                                      max_decoding_length=new)


def ct2_rows(model, src_len: int, new: int, cases, repeats: int) -> Optional[dict]:
    """{(batch, beams): {"ms_per_step": ...} or {"error": ...}} of CTranslate2 (bf16, on the GPU),
    with the same inputs as the other systems (median of `repeats` calls after two), or None
    without ctranslate2."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ct2-") as folder:
        made = ct2_translator(model, folder, "cuda", "bfloat16")
        if made is None:
            return None
        translator, vocabulary = made
        out = {}
        for batch, beams in cases:
            source = ct2_tokens(vocabulary, common.random_inputs(batch, src_len)[0])  # the others' ids
            try:
                for _ in range(2):
                    ct2_case(translator, source, new, beams)
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    ct2_case(translator, source, new, beams)
                    runs.append(time.perf_counter() - start)
                out[(batch, beams)] = dict(ms_per_step=common.median(runs) / new * 1e3)
            except Exception as exc:  # a case CTranslate2 fails (e.g. out of memory) is reported, not fatal
                out[(batch, beams)] = dict(error=repr(exc)[:200])
            print(f"ctranslate2 b{batch} beams{beams}: {out[(batch, beams)]}", flush=True)
        translator.unload_model()  # its GPU memory back before the patched runs size their pool
    return out


def ct2_facts(rows) -> Optional[dict]:
    """CTranslate2's version and the cuBLAS files it ran on (its 4.8.5 wheel asks for
    libcublas.so.12; a machine with CUDA 13 alone answers with libcublas.so.13 linked under that
    name in the wheel's ctranslate2.libs/, a benchmark-only shim, which these paths show)."""
    if not any(r.get("ctranslate2_ms_per_step") is not None or r.get("ctranslate2_error") for r in rows):
        return None
    import ctranslate2

    return dict(version=ctranslate2.__version__, compute_type="bfloat16", cublas=cublas_loaded())


def cublas_loaded() -> list[str]:
    """The cuBLAS libraries this process has mapped (where CTranslate2 found its cuBLAS)."""
    try:
        lines = pathlib.Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in lines if "libcublas" in line})


def weights_gib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def bench_model(name, src_len, new, cases, rows, read_gbps, launch, repeats, hf_impls=("eager", "sdpa")):
    """Stock HF with each of `hf_impls` (the last, sdpa, is the model then patched), CTranslate2
    where importable, and patched, per case; a row per case into `rows`."""
    results = {}
    ct2 = None
    for attn in hf_impls:
        model = common.make_model(name, attn, torch.bfloat16)
        for batch, beams in cases:
            try:
                r = timed(model, batch, src_len, new, beams, repeats)
                results[(attn, batch, beams)] = r
            except Exception as exc:  # a baseline that fails (e.g. OOM) is reported, not fatal
                results[(attn, batch, beams)] = dict(error=repr(exc)[:200])
            print(f"{name} {attn} b{batch} beams{beams}: {results[(attn, batch, beams)].get('ms_per_step')}",
                  flush=True)
        if attn == "sdpa":
            wgib = weights_gib(model)
            ct2 = ct2_rows(model, src_len, new, cases, repeats)
            gc.collect()
            torch.cuda.empty_cache()
            for batch, beams in cases:
                if hp.is_patched(model):
                    hp.unpatch_model(model)  # the previous case's runtime (pool, graphs) goes before timed()
                hp.patch_model(model)  # a fresh pool per case: its peak memory is this case's own
                r = timed(model, batch, src_len, new, beams, repeats)
                kernels, by_name = step_kernels(model)
                r.update(floor_ms(model, batch, beams, src_len, new, kernels, read_gbps, launch))
                results[("paged", batch, beams)] = r
                hf = [results.get((a, batch, beams), {}) for a in ("eager", "sdpa")]  # eager: {} if not timed
                best = min(x["ms_per_step"] for x in hf if "ms_per_step" in x)
                ref_tokens = results[("sdpa", batch, beams)].get("tokens")
                rows.append(dict(
                    model=name, batch=batch, beams=beams, src_len=src_len, new_tokens=new,
                    hf_eager_ms_per_step=hf[0].get("ms_per_step"), hf_sdpa_ms_per_step=hf[1].get("ms_per_step"),
                    paged_ms_per_step=r["ms_per_step"], speedup_vs_best_hf=best / r["ms_per_step"],
                    hf_peak_gib=hf[1].get("peak_gib"), paged_peak_gib=r["peak_gib"], weights_gib=wgib,
                    bf16_tokens_agree=None if ref_tokens is None else float((ref_tokens == r["tokens"]).float().mean()),
                    floor_ms_per_step=r["floor_ms"], launch_floor_ms_per_step=r["launch_floor_ms"],
                    kernels_per_step=r["kernels_per_step"],
                    kernels_per_decoder_layer=r["kernels_per_step"] / model.config.num_decoder_layers,
                    step_kernels_by_name=by_name,
                    ctranslate2_ms_per_step=(ct2 or {}).get((batch, beams), {}).get("ms_per_step"),
                    ctranslate2_error=(ct2 or {}).get((batch, beams), {}).get("error"),
                    mem_vs_hf=None if hf[1].get("peak_gib") is None
                    else (r["peak_gib"] - wgib) / (hf[1]["peak_gib"] - wgib),  # (peak - weights) vs HF sdpa's
                ))
                if rows[-1]["ctranslate2_ms_per_step"] is not None:
                    rows[-1]["speedup_vs_ctranslate2"] = rows[-1]["ctranslate2_ms_per_step"] / r["ms_per_step"]
                print(f"{name} paged b{batch} beams{beams}: {r['ms_per_step']:.3f} ms/step "
                      f"({best / r['ms_per_step']:.1f}x)", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()


# initializer_factor of the parity pass's first workload: HF's T5 init scaled 1.5x is the largest of
# 1.5 / 1.75 / 2.0 / 2.5 / 3.0 / 4.0 at which stock fp32's greedy tokens equal a float64 copy's at
# t5-small .. t5-large depth, 512-token inputs (CPU and H200 measured); past it the random model is
# chaotic (stock fp32's own logits 10-100% off float64 at tiny.INIT_FACTOR).
WELL_CONDITIONED_FACTOR = 1.5


def fp32_parity(name: str, init_factor: float, batch: int = 16, src_len: int = SRC_LEN, new: int = 64) -> dict:
    """Greedy fp32 generate(), patched vs stock HF and both vs a float64 copy, on `tiny.build_model`
    weights at `init_factor` (HF's own init repeats one token for every input: `tiny.INIT_FACTOR`).

    A token may differ from stock's only on a near-tie (`common.greedy_parity`); on the
    well-conditioned workload that leaves no room: the tokens must be identical."""
    import copy

    from hf_paged_t5 import tiny

    model = tiny.build_model(name, dtype=torch.float32, device="cuda", attn_implementation="sdpa",
                             initializer_factor=init_factor)
    model64 = copy.deepcopy(model).double()
    ids, mask = common.random_inputs(batch, src_len)
    mask[1::3, src_len // 2:] = 0  # padded rows too
    result = dict(init_factor=init_factor, **common.greedy_parity(
        model, model64, dict(input_ids=ids, attention_mask=mask), max_new_tokens=new, min_new_tokens=new))
    print(f"fp32 parity {name} at init factor {init_factor}: {result}", flush=True)
    del model, model64
    gc.collect()
    torch.cuda.empty_cache()
    return result


def parity_pass(names: list[str]) -> dict:
    """`fp32_parity` of each model on a well-conditioned workload and on an input-dependent one."""
    from hf_paged_t5 import tiny

    return {f"{name}@{factor}": fp32_parity(name, factor)
            for name in names for factor in (WELL_CONDITIONED_FACTOR, tiny.INIT_FACTOR)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for generate.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--models", default="t5-small,t5-base,t5-large,flan-t5-xl")
    ap.add_argument("--quick", action="store_true", help="fewer new tokens (smoke run)")
    ap.add_argument("--parity", default="t5-small,t5-large",
                    help="models of the fp32 parity pass (comma-separated; empty: none)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per case; the median is reported")
    ap.add_argument("--hf", default="eager,sdpa",
                    help="stock HF attention implementations timed: eager,sdpa or sdpa (about half the stock time)")
    ap.add_argument("--cases", default=",".join(f"{b}x{beams}" for b, beams in CASES),
                    help="batch x beams cases, comma-separated (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.hf not in ("eager,sdpa", "sdpa"):
        ap.error(f"--hf must be 'eager,sdpa' or 'sdpa' (the patched model is the sdpa one), got {args.hf!r}")
    try:
        args.cases = [tuple(int(v) for v in item.split("x")) for item in args.cases.split(",") if item]
        assert args.cases and all(len(c) == 2 and min(c) >= 1 for c in args.cases)
    except (ValueError, AssertionError):
        ap.error(f"--cases wants BATCHxBEAMS items such as 1x1,8x4, got {args.cases!r}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    common.require_cuda("bench_generate.py")
    out = common.start_suite(args.out, "generate")
    repeats = max(1, args.repeats)
    new = 32 if args.quick else 128
    rows: list[dict] = []
    parity = parity_pass([name for name in args.parity.split(",") if name])
    read_gbps, launch = common.read_bandwidth(torch.device("cuda"), 1 << 30), launch_us()
    print(f"read bandwidth {read_gbps:.0f} GB/s; {launch:.2f} us per kernel in a graph", flush=True)
    for name in args.models.split(","):
        bench_model(name, SRC_LEN, new, args.cases, rows, read_gbps, launch, repeats, tuple(args.hf.split(",")))
        # written after each model: a run cut short (a device call's time limit) keeps what it measured
        report = dict(gpu=torch.cuda.get_device_name(), repeats=repeats, read_gbps=read_gbps, graph_launch_us=launch,
                      fp32_tokens_identical=all(p["identical"] for p in parity.values()) if parity else None,
                      fp32_parity_passed=all(p["passed"] for p in parity.values()) if parity else None,
                      fp32_parity=parity, rows=rows,
                      kernels_per_decoder_layer=max((r["kernels_per_decoder_layer"] for r in rows), default=None),
                      ctranslate2=ct2_facts(rows))
        common.write_json(out / "generate.json", report)
    fmt = common.fmt
    common.print_table(
        ["model", "batch", "beams", "HF eager ms", "HF sdpa ms", "CT2 ms", "paged ms", "speedup", "vs CT2",
         "HF peak GiB", "paged peak GiB", "weights GiB", "mem/HF", "floor ms", "launches ms", "kernels/layer"],
        ([r["model"], r["batch"], r["beams"], fmt(r["hf_eager_ms_per_step"], ".2f"),
          fmt(r["hf_sdpa_ms_per_step"], ".2f"), fmt(r["ctranslate2_ms_per_step"], ".3f"),
          fmt(r["paged_ms_per_step"], ".3f"), fmt(r["speedup_vs_best_hf"], ".1f") + "x",
          fmt(r.get("speedup_vs_ctranslate2"), ".2f"), fmt(r["hf_peak_gib"], ".2f"),
          fmt(r["paged_peak_gib"], ".2f"), fmt(r["weights_gib"], ".2f"), fmt(r["mem_vs_hf"], ".2f"),
          fmt(r["floor_ms_per_step"], ".3f"), fmt(r["launch_floor_ms_per_step"], ".3f"),
          fmt(r["kernels_per_decoder_layer"], ".1f")] for r in rows),
        title=f"ms per decode step, {SRC_LEN}-token inputs, {new} new tokens, bf16, median of {repeats} calls")
    print(f"fp32 greedy parity with HF passed: {report['fp32_parity_passed']} "
          f"(tokens identical: {report['fp32_tokens_identical']})")
    for name, p in parity.items():
        print(f"  {name}: agreement {p['agreement']:.4f} ({p['rows_differing']} rows differ, {p['near_ties']} on a "
              f"near-tie); with float64's tokens: stock {p['stock_vs_float64']:.4f}, paged {p['paged_vs_float64']:.4f}; "
              f"logit error vs float64: stock {p['stock_error']:.2e}, paged {p['paged_error']:.2e}")


if __name__ == "__main__":
    main()
