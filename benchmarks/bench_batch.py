"""Batch-job throughput: BatchGenerator (continuous batching) vs patched generate() in static batches
vs stock HF generate(), on one GPU, in one run.

Workload: `--num-inputs` (2,000) random-token inputs, lengths long-tailed (log-normal, median 160,
clipped to 20-2,000 tokens), each with a summary length drawn long-tailed in 20-200 tokens (median
60) and forced: BatchGenerator gets it per request (min_new_tokens = max_new_tokens = n).
Static batching cannot give rows their own lengths, so each static batch runs to the longest n in it
(min = max = that n). That is what static batching costs anyway: generate() keeps computing every row
until the batch's last row stops at its EOS. Only the n wanted tokens of each input are counted, for
every system: tokens/s = sum(n) / wall time, encoder included. Static batches are sorted by input
length (least padding), as in a well-tuned HF job; each static system uses the best batch size of a
sweep on a probe subset of twice its largest batch size (so every size runs two or more full
batches: on a probe of one batch the two largest sizes would run the same batch, and noise would
pick between them), halved where the whole workload's longest batches do not fit in memory (as a
user of static batches would). Model: random weights with the t5-large shape, bf16; HF with SDPA.

HF is slow, so it runs on a random subset (`--hf-inputs`) and, like the static paged run, stops at
its share of `--time-budget` (batches run in shuffled order, so a partial run is a random sample); the
JSON says how many inputs each system measured. Graphs are captured before timing (warm-up runs).
BatchGenerator runs the whole job `--batch-repeats` times (2) and reports the median (of two, the
slower); the JSON lists every run, with the graphs captured and Triton kernels compiled while timed
(`compiled_kernels`: which binary, finished how many seconds into the job),
and `warm_*` keys: the slowest BatchGenerator run that captured and compiled nothing while timed,
against the static runs (which must not have either), the like-for-like comparison.

    python benchmarks/bench_batch.py [--out DIR] [--num-inputs 2000] [--hf-inputs 256] [--time-budget 210]
    python benchmarks/bench_batch.py --quick --device cpu     # tiny smoke run of the whole script

Writes DIR/batch.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json) with
top-level keys gpu, tokens_per_s (per system), speedup_vs_static_paged, speedup_vs_hf and job_floor
(the workload's K/V reads and matrix products, `job_work`, at the GPU's measured read bandwidth and
bf16 GEMM rate: a bound on any engine's job, its ratio to the static batches, and each
BatchGenerator job's tokens/s in percent of it), and prints a table. `--static-reference N` (with
`--defaults`: 64, the static batch size the first-contact issue's figures were measured against)
also runs patched static batches of N rows over the whole workload where the sweep picked another
size: the JSON's `static_reference` and, with `--defaults`, `first_job_vs_static_reference` and
`second_job_vs_static_reference` (the sweep's pick stays the baseline of every other ratio).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp


def workload(num: int, vocab: int, seed: int, quick: bool) -> list[tuple[list[int], int]]:
    """[(input ids, forced new tokens)], both long-tailed (see the module docstring)."""
    rng = random.Random(seed)
    src_median, src_max, new_median, new_min, new_max = (24, 120, 6, 3, 24) if quick else (160, 2000, 60, 20, 200)
    items = []
    for _ in range(num):
        length = min(max(round(rng.lognormvariate(0, 1.0) * src_median), 20 if not quick else 4), src_max)
        new = min(max(round(rng.lognormvariate(0, 0.6) * new_median), new_min), new_max)
        items.append(([rng.randrange(2, vocab) for _ in range(length)], new))
    return items


def job_work(config, items, element_size: int = 2) -> dict:
    """What the workload asks of any engine, counted from the model's shape: the bytes of K/V its
    decode steps read (each new token reads its input's cross-attention keys and its own earlier
    tokens' self-attention keys in every decoder layer; t5's start token is the first of those) and
    the FLOPs of its matrix products (the encoder over every input token, its attention included;
    the cross K/V projections; the decoder and LM head once per new token)."""
    inner, d, layers, dec_layers = config.num_heads * config.d_kv, config.d_model, config.num_layers, config.num_decoder_layers
    ff = (3 if getattr(config, "is_gated_act", False) else 2) * d * config.d_ff
    keys = sum(len(ids) * n + n * (n + 1) // 2 for ids, n in items)
    kv_bytes = keys * dec_layers * 2 * inner * element_size
    encoder = sum(len(ids) * layers * (2 * (4 * d * inner + ff) + 4 * len(ids) * inner) for ids, _ in items)
    cross_kv = sum(len(ids) for ids, _ in items) * dec_layers * 2 * 2 * d * inner
    new = sum(n for _, n in items)
    decoder = new * (dec_layers * 2 * (6 * d * inner + ff) + 2 * d * config.vocab_size)
    return dict(kv_bytes=kv_bytes, flops=encoder + cross_kv + decoder,
                flops_by_part=dict(encoder=encoder, cross_kv_projection=cross_kv, decoder_and_lm_head=decoder))


def job_floor(config, items, device: str, static_tokens_per_s: float) -> dict:
    """The job at the GPU's measured rates (a bf16 8192^3 GEMM, a read pass over 1 GiB), K/V reads
    and matrix products one after another, nothing else: a bound on any engine's job, and what a
    target over static batches asks of it. On the CPU: the work only."""
    work = job_work(config, items)
    if not device.startswith("cuda"):
        return work
    gemm_tflops = common.gemm_tflops(torch.device(device))
    read_gbps = common.read_bandwidth(torch.device(device), 1 << 30)
    seconds = work["kv_bytes"] / read_gbps / 1e9 + work["flops"] / gemm_tflops / 1e12
    tokens_per_s = sum(n for _, n in items) / seconds
    return dict(work, read_gbps=read_gbps, gemm_tflops=gemm_tflops, kv_seconds=work["kv_bytes"] / read_gbps / 1e9,
                gemm_seconds=work["flops"] / gemm_tflops / 1e12, seconds=seconds, tokens_per_s=tokens_per_s,
                vs_static=tokens_per_s / static_tokens_per_s)


def static_batches(items, batch_size: int, seed: int = 0):
    """Batches of inputs sorted by length, in shuffled order (a run cut short is a random sample)."""
    ordered = sorted(items, key=lambda item: len(item[0]))
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def generate_batch(model, batch, device: str, stop_after=None) -> None:
    """One static generate() call: right-padded inputs, every row forced to the batch's longest n."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (tokens, _) in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    new = max(n for _, n in batch)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1)
    if stop_after is not None:
        kw = dict(max_new_tokens=new, stopping_criteria=StoppingCriteriaList([stop_after()]))
    with torch.inference_mode():
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)


class StopSoon(StoppingCriteria):
    """Ends a warm-up call after two steps (its cache, and so its graph key, is sized as the real call's)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= 2, dtype=torch.bool, device=input_ids.device)


def run_static(model, items, batch_size: int, device: str, deadline: float, compiles: common.TritonCompiles) -> dict:
    """Static batches until done or `deadline`; useful tokens, inputs measured, seconds, and the
    graphs captured and kernels compiled while timed (a timed run that does either pays for it)."""
    tokens = inputs = 0
    captured, compiled = common.graphs_captured(model), compiles.count
    common.sync(device)
    start = time.perf_counter()
    for batch in static_batches(items, batch_size):
        generate_batch(model, batch, device)
        tokens += sum(n for _, n in batch)
        inputs += len(batch)
        if time.perf_counter() > deadline:
            break
    common.sync(device)
    seconds = time.perf_counter() - start
    return dict(batch_size=batch_size, tokens=tokens, inputs=inputs, seconds=seconds, tokens_per_s=tokens / seconds,
                graph_captures=common.graphs_captured(model) - captured, triton_compiles=compiles.count - compiled)


def run_static_halving(model, items, batch_size: int, device: str, deadline: float, compiles, warm=None) -> dict:
    """`run_static` (after `warm(model, items, batch_size, device)` where given), halving the batch
    size on out-of-memory (longer inputs than the sweep saw: what a user of static batches meets);
    the result's `halved_from` names the size that did not fit."""
    first = batch_size
    while True:
        try:
            if warm is not None:
                warm(model, items, batch_size, device)
            result = run_static(model, items, batch_size, device, deadline, compiles)
            return dict(result, halved_from=first) if batch_size != first else result
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            print(f"  out of memory at batch {batch_size}: retrying at {batch_size // 2}", flush=True)
            batch_size //= 2
            gc.collect()
            torch.cuda.empty_cache()


def sweep(model, probe, sizes, device: str, deadline: float, warm_all: bool, compiles) -> tuple[int, dict]:
    """The batch size with the best tokens/s on `probe`; all sizes' results (OOM is reported).

    Each size is warmed first: a two-step call (cuBLAS, allocator), or with `warm_all` a pass over
    the whole probe (the paged path also captures a CUDA graph per batch and table-width bucket).
    """
    results = {}
    for size in sizes:
        try:
            if warm_all:
                run_static(model, probe, size, device, float("inf"), compiles)
            else:
                generate_batch(model, probe[:size], device, stop_after=StopSoon)
            results[size] = run_static(model, probe, size, device, float("inf"), compiles)
        except torch.OutOfMemoryError as exc:
            results[size] = dict(error=repr(exc)[:200])
            gc.collect()
            torch.cuda.empty_cache()
        print(f"  batch {size}: {results[size].get('tokens_per_s', float('nan')):.0f} tok/s", flush=True)
        if time.perf_counter() > deadline:
            break
    ok = {size: r for size, r in results.items() if "tokens_per_s" in r}
    return max(ok, key=lambda size: ok[size]["tokens_per_s"]), results


def warm_static_paged(model, items, batch_size: int, device: str) -> None:
    """Capture the static paged run's decode graphs for full batches: per input-length tier and
    output-length tier (with the batch size, the keys of the decode graphs)."""
    max_src = max(len(ids) for ids, _ in items)
    # largest first: a pool that must grow does so once, before any graph is captured on it
    tiers = sorted({min(n, max_src) for n in (16, 48, 112, 240, 496, 1008, 2000)}, reverse=True)
    news = sorted({min(n, max(n for _, n in items)) for n in (60, 120, 200)}, reverse=True)
    for src in tiers:
        for new in news:
            generate_batch(model, [([5] * src, new)] * batch_size, device, stop_after=StopSoon)


def run_batch_generator(model, items, device: str, batch_tokens, batch_rows, compiles) -> dict:
    """One BatchGenerator job over `items`, timed (making the generator included); with the slowest
    steps (a stall: a graph capture, a kernel compile, the pool growing) and what was captured or
    compiled while timed. batch_tokens / batch_rows None: the generator's defaults."""
    common.sync(device)
    made = time.perf_counter()
    gen = hp.BatchGenerator(model, max_batch_tokens=batch_tokens, max_batch_rows=batch_rows)
    requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
    captured, compiled = common.graphs_captured(model), compiles.count
    step_seconds = []
    common.sync(device)
    start = last = time.perf_counter()
    tokens = 0
    for _, result in gen.as_completed(requests):
        tokens += result.num_new_tokens
        now = time.perf_counter()
        step_seconds.append(now - last)
        last = now
    common.sync(device)
    seconds = time.perf_counter() - start
    assert tokens == sum(n for _, n in items), "BatchGenerator did not produce the forced lengths"
    gaps = sorted(step_seconds, reverse=True)
    seconds = time.perf_counter() - made
    # each compile while timed: seconds into the job when it finished, and which binary it was
    kernels = [dict(c, at=round(c["at"] - made, 3)) for c in compiles.compiled[compiled:]]
    return dict(tokens=tokens, inputs=len(items), seconds=seconds, tokens_per_s=tokens / seconds,
                first_result_s=(start - made) + step_seconds[0], max_batch_tokens=gen.max_batch_tokens,
                max_batch_rows=gen.max_batch_rows,
                graph_captures=common.graphs_captured(model) - captured, triton_compiles=compiles.count - compiled,
                compiled_kernels=kernels, slowest_gaps_ms=[round(g * 1e3, 1) for g in gaps[:5]])


def stats(values) -> dict:
    values = sorted(values)
    pick = lambda q: values[min(int(q * len(values)), len(values) - 1)]  # noqa: E731
    return dict(min=values[0], median=pick(0.5), p90=pick(0.9), p99=pick(0.99), max=values[-1],
                mean=sum(values) / len(values))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for batch.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="model shape (default t5-large; tiny with --quick)")
    ap.add_argument("--num-inputs", type=int, default=None, help="inputs (default 2000; 40 with --quick)")
    ap.add_argument("--hf-inputs", type=int, default=None, help="HF's random subset (default 256; 16 --quick)")
    ap.add_argument("--probe-inputs", type=int, default=None,
                    help="batch-size sweep subset (default: twice the system's largest batch size)")
    ap.add_argument("--hf-batch-sizes", default=None, help="HF sweep (default 16,32,64)")
    ap.add_argument("--static-batch-sizes", default=None, help="static paged sweep (default 32,64,128,256)")
    ap.add_argument("--static-reference", type=int, default=None,
                    help="also static batches of this many rows where the sweep picks another size (default: 64 "
                         "with --defaults, else none; 0: none)")
    ap.add_argument("--batch-tokens", type=int, default=262144, help="BatchGenerator max_batch_tokens")
    ap.add_argument("--batch-rows", type=int, default=512, help="BatchGenerator max_batch_rows")
    ap.add_argument("--batch-repeats", type=int, default=2,
                    help="timed BatchGenerator jobs over all inputs; the median is reported (of two, the slower)")
    ap.add_argument("--time-budget", type=float, default=210.0, help="seconds for the whole run, roughly")
    ap.add_argument("--defaults", action="store_true",
                    help="BatchGenerator as a user meets it: patch_model() and BatchGenerator() with their defaults, "
                         "no warm-up job (the first job is timed, then a second); the static runs follow")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (a smoke run, CPU is fine)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.shape = args.shape or ("tiny" if quick else "t5-large")
    args.num_inputs = args.num_inputs or (40 if quick else 2000)
    args.hf_inputs = args.hf_inputs or (16 if quick else 256)
    args.hf_batch_sizes = [int(s) for s in (args.hf_batch_sizes or ("4,8" if quick else "16,32,64")).split(",")]
    if args.static_reference is None:
        args.static_reference = (4 if quick else 64) if args.defaults else 0
    if args.static_reference < 0:
        ap.error("--static-reference must be a batch size (0: none)")
    static_sizes = args.static_batch_sizes or ("4,8" if quick else "32,64,128,256")
    args.static_batch_sizes = [int(s) for s in static_sizes.split(",")]
    if quick and not args.defaults:
        args.batch_tokens, args.batch_rows = min(args.batch_tokens, 2048), min(args.batch_rows, 16)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    common.require_cuda("bench_batch.py", args.device)
    out = common.start_suite(args.out, "batch")
    t0 = time.perf_counter()
    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device == "cpu":
        torch.set_num_threads(1)  # tiny matmuls: OpenMP spin-waits make multi-thread CPU timings erratic
    model = common.make_model(args.shape, "sdpa", dtype, device)
    items = workload(args.num_inputs, model.config.vocab_size, seed=1, quick=args.quick)
    report = dict(gpu=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
                  model_shape=args.shape, dtype=str(dtype), num_inputs=len(items),
                  input_tokens=stats([len(ids) for ids, _ in items]), new_tokens=stats([n for _, n in items]),
                  settings=vars(args).copy())
    with common.TritonCompiles() as compiles:
        report.update(measure(model, items, args, compiles, deadline=t0 + args.time_budget))
    report["wall_seconds"] = time.perf_counter() - t0
    common.write_json(out / "batch.json", report)
    print_table(report)


def measure(model, items, args, compiles, deadline: float) -> dict:
    """BatchGenerator, then patched generate() in static batches, then HF: the report's results."""
    device, vocab = args.device, model.config.vocab_size
    rng = random.Random(2)

    def probe_size(sizes) -> int:  # every batch size of the sweep runs two or more full batches
        return min(args.probe_inputs or 2 * max(sizes), len(items))

    probe = rng.sample(items, max(probe_size(args.static_batch_sizes), probe_size(args.hf_batch_sizes)))
    hf_items = rng.sample(items, min(args.hf_inputs, len(items)))
    if args.defaults:  # what a user gets: the default pool and budget, the first job in the process timed
        hp.patch_model(model)
        print("BatchGenerator, defaults: first job, then a second", flush=True)
        repeats = [run_batch_generator(model, items, device, None, None, compiles) for _ in range(2)]
    else:
        # One pool, sized up front for the largest need of either paged system, so that no timed run
        # grows it (growth re-allocates the pool and drops the captured CUDA graphs).
        max_src, max_new = max(len(ids) for ids, _ in items), max(n for _, n in items)
        static_need = max(args.static_batch_sizes) * (max_src + max_new + 2 * 16)
        pool_tokens = max(args.batch_tokens + args.batch_rows * 2 * 16, static_need)
        # graphs serve every BatchGenerator step (the static sizes are below the default limit)
        hp.patch_model(model, hp.PagedCacheConfig(max_tokens=pool_tokens, max_graph_batch=max(512, args.batch_rows)))
        print(f"KV pool: {pool_tokens} tokens", flush=True)
        print("warm-up: BatchGenerator", flush=True)
        longest = (max((ids for ids, _ in items), key=len), max_new)  # the widest graphs early
        run_batch_generator(model, [longest] + workload(max(len(items) // 4, 8), vocab, 3, args.quick),
                            device, args.batch_tokens, args.batch_rows, compiles)
        print("BatchGenerator", flush=True)
        repeats = [run_batch_generator(model, items, device, args.batch_tokens, args.batch_rows, compiles)
                   for _ in range(args.batch_repeats)]
    for r in repeats:
        print(f"  {r['tokens_per_s']:.0f} tok/s over {r['seconds']:.1f} s, first result after "
              f"{r['first_result_s']:.2f} s ({r['graph_captures']} graphs captured, {r['triton_compiles']} Triton "
              f"compiles while timed; budget {r['max_batch_tokens']} tokens, {r['max_batch_rows']} rows; slowest "
              f"gaps between results {r['slowest_gaps_ms']} ms)", flush=True)
    # of two, the slower; with --defaults, the first job
    batch_gen = repeats[0] if args.defaults else common.upper_median(repeats, key=lambda r: r["seconds"])
    batch_gen = dict(batch_gen, repeats=[r["tokens_per_s"] for r in repeats])
    # "warm": timed with nothing captured or compiled, as the static runs are after their warm-up
    warm_runs = [r for r in repeats if r["graph_captures"] == 0 and r["triton_compiles"] == 0]
    warm = max(warm_runs, key=lambda r: r["seconds"]) if warm_runs else None  # the slowest warm run

    print("patched generate(), static batches: sweep", flush=True)
    static_deadline = time.perf_counter() + 0.4 * max(deadline - time.perf_counter(), 0.0)
    size, static_sweep = sweep(model, probe[:probe_size(args.static_batch_sizes)], args.static_batch_sizes, device,
                               static_deadline, True, compiles)
    static = run_static_halving(model, items, size, device, static_deadline, compiles, warm=warm_static_paged)
    print(f"  batch {static['batch_size']}: {static['tokens_per_s']:.0f} tok/s over {static['inputs']} inputs "
          f"({static['graph_captures']} graphs captured while timed)", flush=True)
    reference = None
    if args.static_reference and args.static_reference != static["batch_size"]:
        print(f"patched generate(), static batches of {args.static_reference} (the reference size)", flush=True)
        reference = run_static_halving(model, items, args.static_reference, device, deadline, compiles,
                                       warm=warm_static_paged)
        print(f"  batch {reference['batch_size']}: {reference['tokens_per_s']:.0f} tok/s over {reference['inputs']} "
              f"inputs ({reference['graph_captures']} graphs captured, {reference['triton_compiles']} Triton compiles "
              f"while timed)", flush=True)

    hp.unpatch_model(model)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print("HF generate(), static batches: sweep", flush=True)
    hf_size, hf_sweep = sweep(model, probe[:probe_size(args.hf_batch_sizes)], args.hf_batch_sizes, device, deadline,
                              False, compiles)
    hf = run_static_halving(model, hf_items, hf_size, device, deadline, compiles)
    print(f"  batch {hf_size}: {hf['tokens_per_s']:.0f} tok/s over {hf['inputs']} inputs", flush=True)

    floor = job_floor(model.config, items, device, static["tokens_per_s"])
    if "tokens_per_s" in floor:  # each BatchGenerator job's tokens/s, in percent of the floor's
        floor["batch_generator_pct"] = [100 * r["tokens_per_s"] / floor["tokens_per_s"] for r in repeats]
    report = dict(
        job_floor=floor,
        tokens_per_s=dict(batch_generator=batch_gen["tokens_per_s"], static_paged=static["tokens_per_s"],
                          hf=hf["tokens_per_s"]),
        speedup_vs_static_paged=batch_gen["tokens_per_s"] / static["tokens_per_s"],
        speedup_vs_hf=batch_gen["tokens_per_s"] / hf["tokens_per_s"],
        runs=dict(batch_generator=batch_gen, static_paged=static, hf=hf),
        sweeps=dict(static_paged=static_sweep, hf=hf_sweep),
        probe_inputs=dict(static_paged=probe_size(args.static_batch_sizes), hf=probe_size(args.hf_batch_sizes)),
        hf_subset=(f"HF measured on {hf['inputs']} of {len(items)} inputs (a random subset, whole batches in "
                   f"random order), the other systems on {batch_gen['inputs']} and {static['inputs']}"),
    )
    if reference is not None:
        report["static_reference"] = reference
        if args.defaults:
            report.update(first_job_vs_static_reference=repeats[0]["tokens_per_s"] / reference["tokens_per_s"],
                          second_job_vs_static_reference=repeats[1]["tokens_per_s"] / reference["tokens_per_s"])
    if args.defaults:
        first, second = repeats
        report.update(first_job_vs_static=first["tokens_per_s"] / static["tokens_per_s"],
                      first_job_vs_hf=first["tokens_per_s"] / hf["tokens_per_s"],
                      second_job_vs_static=second["tokens_per_s"] / static["tokens_per_s"],
                      second_job_vs_hf=second["tokens_per_s"] / hf["tokens_per_s"],
                      first_result_s=first["first_result_s"])
    if warm is not None and static["graph_captures"] == 0 and static["triton_compiles"] == 0:
        report.update(
            warm_tokens_per_s=dict(batch_generator=warm["tokens_per_s"], static_paged=static["tokens_per_s"],
                                   hf=hf["tokens_per_s"]),
            warm_speedup_vs_static_paged=warm["tokens_per_s"] / static["tokens_per_s"],
            warm_speedup_vs_hf=warm["tokens_per_s"] / hf["tokens_per_s"],
        )
    return report


def print_table(report: dict) -> None:
    runs, best = report["runs"], report["tokens_per_s"]["batch_generator"]
    labels = (("batch_generator", "BatchGenerator"), ("static_paged", "patched generate, static"),
              ("hf", "HF generate, static"))
    common.print_table(
        ["system", "batch", "inputs", "seconds", "tokens/s", "BatchGenerator speedup"],
        ([label, runs[name].get("batch_size"), runs[name]["inputs"], f"{runs[name]['seconds']:.1f}",
          f"{runs[name]['tokens_per_s']:.0f}", f"{best / runs[name]['tokens_per_s']:.1f}x"] for name, label in labels))
    print(report["hf_subset"])
    for name, label in labels[1:]:
        if "halved_from" in runs[name]:
            print(f"{label}: batch {runs[name]['halved_from']} (the sweep's best) ran out of memory on the whole "
                  f"workload; batch {runs[name]['batch_size']} fit")
    if "static_reference" in report:
        ref = report["static_reference"]
        line = f"patched generate(), static batches of {ref['batch_size']} (the reference size): {ref['tokens_per_s']:.0f} tok/s"
        if "first_job_vs_static_reference" in report:
            line += (f"; first job {report['first_job_vs_static_reference']:.2f}x, second job "
                     f"{report['second_job_vs_static_reference']:.2f}x of it")
        print(line)
    if "first_job_vs_static" in report:
        print(f"defaults: first job {report['first_job_vs_static']:.2f}x static paged, {report['first_job_vs_hf']:.1f}x "
              f"HF (first result after {report['first_result_s']:.2f} s); second job "
              f"{report['second_job_vs_static']:.2f}x static paged, {report['second_job_vs_hf']:.1f}x HF")
    floor = report.get("job_floor", {})
    if "seconds" in floor:
        jobs = ", ".join(f"{pct:.0f}%" for pct in floor["batch_generator_pct"])
        print(f"floor: K/V reads {floor['kv_bytes'] / 1e12:.2f} TB at {floor['read_gbps']:.0f} GB/s "
              f"({floor['kv_seconds']:.2f} s) + {floor['flops'] / 1e12:.0f} TFLOP at {floor['gemm_tflops']:.0f} "
              f"TFLOP/s ({floor['gemm_seconds']:.2f} s) = {floor['seconds']:.2f} s, {floor['tokens_per_s']:.0f} "
              f"tok/s, {floor['vs_static']:.2f}x static paged; BatchGenerator's jobs at {jobs} of it")
    if "warm_speedup_vs_static_paged" in report:
        print(f"warm (nothing captured or compiled while timed, every system): BatchGenerator "
              f"{report['warm_tokens_per_s']['batch_generator']:.0f} tok/s, "
              f"{report['warm_speedup_vs_static_paged']:.1f}x static paged, {report['warm_speedup_vs_hf']:.1f}x HF")


if __name__ == "__main__":
    main()
