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
        [--backend auto] [--out DIR | --out FILE.json]

Writes `cpu-<date>.json` under `--out` (default: $OUT, else benchmarks/results/<date>-cpu/),
or to `--out` itself when it ends in `.json`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

import hf_paged_t5 as hp
from hf_paged_t5 import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    Row("t5-small-2x4", "t5-small", 2, 4, False),
    Row("flan-t5-base-b1", "flan-t5-base", 1, 1, False),
)


class FallbackLog(logging.Handler):
    """Collects the library's "running ... on stock HF: reason" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "on stock HF" in message:
            self.reasons.append(message)


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


def bench_row(row: Row, stock, patched, repeats: int, fallbacks: FallbackLog) -> dict:
    """Warm-up, then `repeats` rounds of one stock and one patched call (order alternating)."""
    batch = inputs(row, stock.config.vocab_size)
    kw = dict(do_sample=False, num_beams=row.beams, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    times = {"stock": [], "patched": []}
    models = {"stock": stock, "patched": patched}

    def call(path: str) -> torch.Tensor:
        start = time.perf_counter()
        out = models[path].generate(**batch, **kw)
        times[path].append(time.perf_counter() - start)
        return out

    fallbacks.reasons.clear()
    ref = call("stock")
    outs = {"stock": [], "patched": [call("patched")]}
    for runs in times.values():  # the warm-up calls (the pool is sized there) are not in the medians
        runs.clear()
    for i in range(repeats):
        for path in ("stock", "patched") if i % 2 == 0 else ("patched", "stock"):
            outs[path].append(call(path))
    stock_ms = 1e3 * statistics.median(times["stock"])
    patched_ms = 1e3 * statistics.median(times["patched"])
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


def code_state() -> dict:
    """The commit measured and the files changed since it (the measured code may be uncommitted)."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    try:  # porcelain lines are "XY path": two status letters, a space
        return {"commit": git("rev-parse", "--short", "HEAD").strip(),
                "changed": [line[3:] for line in git("status", "--porcelain").splitlines()]}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "changed": None}


def print_table(rows: list[dict], repeats: int, backend: str) -> None:
    print(f"\n| layout | batch | beams | stock ms | patched ms ({backend}) | stock/patched | per round | "
          "fp32 tokens equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        batch = f"{r['batch']} (padded)" if r["padded"] else str(r["batch"])
        ran = f" (ran on stock HF: {'; '.join(r['fallback_reasons'])})" if r["fallback_reasons"] else ""
        print(f"| {r['layout']} | {batch} | {r['beams']} | {r['stock_ms']:.1f} | {r['patched_ms']:.1f} | "
              f"{r['ratio']:.2f}x{ran} | {min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f} | "
              f"{'yes' if r['tokens_identical'] else 'NO'} |")
    print(f"(median of {repeats} interleaved calls each, {SRC_LEN}-token inputs, {NEW_TOKENS} new tokens forced, "
          f"{torch.get_num_threads()} threads; > 1 means patched is faster)")
    print(f"every row >= 1.0x: {all(r['ratio'] >= 1.0 for r in rows)}; "
          f"tokens identical in every row: {all(r['tokens_identical'] for r in rows)}")


def output_path(out: str | None, today: datetime.date) -> str:
    if out is not None and out.endswith(".json"):
        return out
    folder = out or os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results", f"{today.isoformat()}-cpu")
    return os.path.join(folder, f"cpu-{today:%Y%m%d}.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS),
                    help=f"comma-separated rows to run (default: all of {', '.join(r.name for r in ROWS)})")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path and row; the median is reported "
                                                           "(default: 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--backend", default="auto", help="PagedCacheConfig(backend=...) of the patched model "
                                                      "(default: auto)")
    ap.add_argument("--out", default=None, help="folder for cpu-<date>.json, or a .json path")
    args = ap.parse_args()
    known = {r.name: r for r in ROWS}
    unknown = [name for name in args.rows.split(",") if name not in known]
    if unknown or args.repeats < 1:
        ap.error(f"unknown rows {unknown} (known: {list(known)})" if unknown else "--repeats must be >= 1")
    rows = [known[name] for name in args.rows.split(",")]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = hp.PagedCacheConfig(backend=args.backend)
    backend = config.resolve_backend(torch.device("cpu"))
    fallbacks = FallbackLog()
    logging.getLogger("hf_paged_t5").addHandler(fallbacks)
    started = datetime.datetime.now(datetime.timezone.utc)
    code = code_state()  # at the start (hf_paged_t5 loads its modules on first use, in the first row)
    results = []
    for layout in dict.fromkeys(r.layout for r in rows):  # one model per layout, in the rows' order
        stock = tiny.build_model(**LAYOUTS[layout])
        patched = copy.deepcopy(stock)  # same weights; stock stays unpatched
        for row in (r for r in rows if r.layout == layout):
            hp.patch_model(patched, config)  # a fresh runtime: each row logs its own fallback reasons
            result = bench_row(row, stock, patched, args.repeats, fallbacks)
            results.append(result)
            print(f"{row.name}: stock {result['stock_ms']:.1f} ms, patched {result['patched_ms']:.1f} ms, "
                  f"{result['ratio']:.2f}x, tokens identical {result['tokens_identical']}", flush=True)
        del stock, patched
    print_table(results, args.repeats, backend)
    report = {
        "date": started.date().isoformat(),
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {"arch": platform.machine(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                    "processor": platform.processor() or None},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "hf_paged_t5": code},
        "backend": backend,
        "dtype": "float32",
        "repeats": args.repeats,
        "rows": results,
    }
    path = output_path(args.out, started.date())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
