"""generate() on CPU: stock HF vs patched, interleaved in one process (fp32; no GPU needed).

Random-weight models (`hf_paged_t5.tiny`, seeded) at the tiny layout (d_model 64), t5-small's and
flan-t5-base's; 96-token inputs; 24 new tokens forced (min_new_tokens = max_new_tokens = 24). For
each row, one warm-up call of each path, then stock and patched calls alternate (the order flips
every round, so drift of the machine falls on both); each path's median over `--repeats` calls is
reported, with the ratio stock ms / patched ms (> 1: patched is faster), the range of the ratios
of single rounds, and whether the patched tokens equal stock's in every call. A patched call that
ran on stock HF logs its reason, which the row records (its ratio then measures stock against
stock).

    python benchmarks/bench_cpu.py [--rows tiny-b1,t5-small-2x4] [--repeats 5] [--threads N]
        [--backend auto] [--out DIR]

Writes DIR/cpu.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from hf_paged_t5 import tiny

SRC_LEN = 96
NEW_TOKENS = 24

# layout -> tiny.build_model kwargs. flan-t5-base is t5-base's width, heads and depth with T5 v1.1's
# gated-gelu feed-forward, untied embeddings and d_ff 2048.
LAYOUTS = {
    "tiny": dict(shape="tiny"),
    "t5-small": dict(shape="t5-small"),
    "flan-t5-base": dict(shape="t5-base", family="t5v1_1", d_ff=2048),
}


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    layout: str
    batch: int
    beams: int
    padded: bool  # rows of different lengths, right-padded (as a T5 tokenizer pads)


ROWS = (
    Row("tiny-b1", "tiny", 1, 1, False),
    Row("tiny-b8", "tiny", 8, 1, True),
    Row("t5-small-b1", "t5-small", 1, 1, False),
    Row("t5-small-b8", "t5-small", 8, 1, False),
    Row("t5-small-b8p", "t5-small", 8, 1, True),
    Row("t5-small-2x4", "t5-small", 2, 4, False),
    Row("flan-t5-base-b1", "flan-t5-base", 1, 1, False),
)


def inputs(row: Row, vocab_size: int) -> dict:
    """input_ids / attention_mask [batch, SRC_LEN]: random tokens ending in EOS (id 1), pad id 0.

    Padded rows shrink from SRC_LEN to about 40% of it, each right-padded to SRC_LEN.
    """
    g = torch.Generator().manual_seed(row.batch * 10 + row.beams)
    ids = torch.randint(3, vocab_size, (row.batch, SRC_LEN), generator=g)
    lens = [SRC_LEN - (i * (SRC_LEN * 3 // 5) // max(row.batch - 1, 1) if row.padded else 0) for i in range(row.batch)]
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, n - 1] = 1
        ids[i, n:] = 0
        mask[i, :n] = 1
    return dict(input_ids=ids, attention_mask=mask)


def bench_row(row: Row, stock, patched, repeats: int, fallbacks: common.FallbackLog) -> dict:
    """Warm-up, then `repeats` rounds of one stock and one patched call (order alternating)."""
    batch = inputs(row, stock.config.vocab_size)
    kw = dict(do_sample=False, num_beams=row.beams, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    models = {"stock": stock, "patched": patched}

    def call(path: str) -> tuple[float, torch.Tensor]:
        return common.timed(lambda: models[path].generate(**batch, **kw), "cpu")

    fallbacks.reasons.clear()
    _, ref = call("stock")
    _, first = call("patched")  # the warm-up calls (the pool is sized there) are not in the medians
    runs = common.interleaved(["stock", "patched"], repeats, call)
    times = {path: [seconds for seconds, _ in runs[path]] for path in runs}
    outs = {"stock": [out for _, out in runs["stock"]], "patched": [first] + [out for _, out in runs["patched"]]}
    stock_ms = 1e3 * common.median(times["stock"])
    patched_ms = 1e3 * common.median(times["patched"])
    last = outs["patched"][-1]
    agreement = float((last == ref).float().mean()) if last.shape == ref.shape else None
    return {
        **dataclasses.asdict(row),
        "src_len": SRC_LEN,
        "src_lens": batch["attention_mask"].sum(1).tolist(),
        "new_tokens": NEW_TOKENS,
        "stock_ms": stock_ms,
        "patched_ms": patched_ms,
        "ratio": stock_ms / patched_ms,
        # one per round (its two calls ran back to back): their spread shows how far one run's ratio can be trusted
        "round_ratios": [a / b for a, b in zip(times["stock"], times["patched"])],
        "stock_runs_ms": [1e3 * t for t in times["stock"]],
        "patched_runs_ms": [1e3 * t for t in times["patched"]],
        "tokens_identical": all(o.shape == ref.shape and torch.equal(o, ref) for o in outs["patched"]),
        "stock_repeatable": all(torch.equal(o, ref) for o in outs["stock"]),
        "token_agreement": agreement,
        "fallback_reasons": sorted(set(fallbacks.reasons)),
    }


def _why_stock(reasons: list[str]) -> str:
    """A table cell's account of a row that ran on stock HF (the JSON keeps the logged reasons)."""
    if all("d_model" in reason for reason in reasons):
        return "stock HF: the CPU policy"
    return "ran on stock HF: " + "; ".join(reasons)


def print_table(rows: list[dict], repeats: int, backend: str) -> None:
    common.print_table(
        ["layout", "batch", "beams", "stock ms", f"patched ms ({backend})", "stock/patched", "per round",
         "fp32 tokens equal"],
        ([r["layout"], f"{r['batch']} (padded)" if r["padded"] else r["batch"], r["beams"], f"{r['stock_ms']:.1f}",
          f"{r['patched_ms']:.1f}",
          f"{r['ratio']:.2f}x" + (f" ({_why_stock(r['fallback_reasons'])})" if r["fallback_reasons"] else ""),
          f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}", "yes" if r["tokens_identical"] else "NO"]
         for r in rows))
    print(f"(median of {repeats} interleaved calls each, {SRC_LEN}-token inputs, {NEW_TOKENS} new tokens forced, "
          f"{torch.get_num_threads()} threads; > 1 means patched is faster)")
    paged = [r for r in rows if not r["fallback_reasons"]]
    stock = len(rows) - len(paged)
    print(f"every paged row >= 1.0x: {all(r['ratio'] >= 1.0 for r in paged)} ({len(paged)} rows); "
          f"tokens identical in every row: {all(r['tokens_identical'] for r in rows)}")
    if stock:
        print(f"{stock} rows ran on stock HF by the CPU policy: their ratio is stock HF against itself, "
              "the machine's run-to-run spread")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS),
                    help=f"comma-separated rows to run (default: all of {', '.join(r.name for r in ROWS)})")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path and row; the median is reported "
                                                           "(default: 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--backend", default="auto", help="PagedCacheConfig(backend=...) of the patched model "
                                                      "(default: auto)")
    ap.add_argument("--out", default=None, help="folder for cpu.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    known = {r.name: r for r in ROWS}
    unknown = [name for name in args.rows.split(",") if name not in known]
    if unknown or args.repeats < 1:
        ap.error(f"unknown rows {unknown} (known: {list(known)})" if unknown else "--repeats must be >= 1")
    args.rows = [known[name] for name in args.rows.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out = common.start_suite(args.out, "cpu")  # the code state at the start, before the first row loads modules
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = hp.PagedCacheConfig(backend=args.backend)
    backend = config.resolve_backend(torch.device("cpu"))
    results = []
    with common.FallbackLog() as fallbacks:
        for layout in dict.fromkeys(r.layout for r in args.rows):  # one model per layout, in the rows' order
            stock = tiny.build_model(**LAYOUTS[layout])
            patched = copy.deepcopy(stock)  # same weights; stock stays unpatched
            for row in (r for r in args.rows if r.layout == layout):
                hp.patch_model(patched, config)  # a fresh runtime: each row logs its own fallback reasons
                result = bench_row(row, stock, patched, args.repeats, fallbacks)
                results.append(result)
                print(f"{row.name}: stock {result['stock_ms']:.1f} ms, patched {result['patched_ms']:.1f} ms, "
                      f"{result['ratio']:.2f}x, tokens identical {result['tokens_identical']}", flush=True)
            del stock, patched
    report = {
        "threads": torch.get_num_threads(),
        "backend": backend,
        "dtype": "float32",
        "repeats": args.repeats,
        "rows": results,
    }
    common.write_json(out / "cpu.json", report)
    print_table(results, args.repeats, backend)


if __name__ == "__main__":
    main()
