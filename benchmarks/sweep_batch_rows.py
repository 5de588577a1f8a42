"""`BatchGenerator` tokens/s at several `max_batch_rows`, one process, the token budget by default.

The job of bench_batch.py (t5-large layout, bf16, 2,000 long-tailed inputs of 20-2,000 tokens,
each with a forced length of 20-200 new tokens, greedy), run once per row count in a round, two
rounds; each row count's first job of the process runs a 500-input warm-up job before it (its
graphs and kernels). The patch serves graphs up to the largest row count (`max_graph_batch`).

    python benchmarks/sweep_batch_rows.py [--rows 512,1024,768] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import common  # benchmarks/ is on sys.path
from bench_batch import workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="512,1024,768", help="max_batch_rows values, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-inputs", type=int, default=2000)
    args = ap.parse_args(argv)
    common.require_cuda("sweep_batch_rows.py")
    import hf_paged_t5 as hp

    rows_list = [int(r) for r in args.rows.split(",")]
    model = common.make_model("t5-large", "sdpa", torch.bfloat16)
    items = workload(args.num_inputs, model.config.vocab_size, seed=1, quick=False)
    hp.patch_model(model, hp.PagedCacheConfig(max_graph_batch=max(rows_list)))
    requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in items]
    tokens = sum(n for _, n in items)
    rates: dict[int, list[int]] = {}
    for round_ in range(args.rounds):
        for rows in rows_list:
            gen = hp.BatchGenerator(model, max_batch_rows=rows)
            if round_ == 0:
                for _ in gen.generate(requests[: len(requests) // 4]):
                    pass
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in gen.generate(requests):
                pass
            torch.cuda.synchronize()
            rates.setdefault(rows, []).append(round(tokens / (time.perf_counter() - start)))
            print(f"round {round_}: {rows} rows, max_batch_tokens {gen.max_batch_tokens}: "
                  f"{rates[rows][-1]} tokens/s", flush=True)
    print(json.dumps({"tokens_per_s": rates}))


if __name__ == "__main__":
    main()
