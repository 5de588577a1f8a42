"""Ray Data's overhead: one `BatchReplica` on one GPU against `BatchGenerator` in this process, same job.

Workload: bench_batch's long-tailed job (`--num-inputs` random-token inputs of 20-2,000 tokens, each
forcing its own 20-200 new tokens), t5-large layout, random weights, bf16. In-process: one
`BatchGenerator` job. Ray: a local Ray with this machine's GPUs, the inputs as a
dataset (token ids, per-row `max_new_tokens` / `min_new_tokens` columns) through `map_batches` with
one replica (`num_gpus=1`, `--batch-size` rows per batch, `--replica-batches` batches at once in
it). Both warm up the same way before they are timed: a small job, then the job itself once (so
neither pays for a graph capture or a kernel compile while timed); the Ray job is timed from its
first batch to its last (model load and warm-up excluded) and whole (both included).

    python benchmarks/bench_ray.py [--num-inputs 2000] [--batch-size 256] [--replica-batches 8] [--out DIR]
    python benchmarks/bench_ray.py --quick --device cpu     # tiny smoke run

Needs the ray extra (`pip install "hf_paged_t5[ray]"`). Writes DIR/ray.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json): tokens/s of both, and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import tempfile
import time

import common  # benchmarks/ is on sys.path
from bench_batch import workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="model shape (default t5-large; tiny with --quick)")
    ap.add_argument("--num-inputs", type=int, default=None, help="inputs (default 2000; 40 with --quick)")
    ap.add_argument("--batch-size", type=int, default=256, help="rows per batch Ray hands the replica")
    ap.add_argument("--replica-batches", type=int, default=8, help="batches the replica runs at once")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (CPU is fine)")
    ap.add_argument("--out", default=None, help="folder for ray.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    common.require_cuda("bench_ray.py", args.device)
    import ray
    import ray.data
    import torch

    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    out = common.start_suite(args.out, "ray")
    shape = args.shape or ("tiny" if args.quick else "t5-large")
    num = args.num_inputs or (40 if args.quick else 2000)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = tiny.save_demo_checkpoint(pathlib.Path(folder) / shape, shape=shape)
        vocab = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())["vocab_size"]
        items = workload(num, vocab, 0, args.quick)
        warm = workload(min(num, 64), vocab, 1, args.quick)
        wanted = sum(n for _, n in items)

        # ---- in this process
        model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        hp.patch_model(model)
        gen = hp.BatchGenerator(model, tokenizer)
        requests = lambda job: [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in job]  # noqa: E731
        for job in (warm, items):  # warm-up: the job itself once (every graph and kernel it needs), untimed
            list(gen.generate(requests(job)))
        start = time.perf_counter()
        results = list(gen.generate(requests(items)))
        local_s = time.perf_counter() - start
        assert sum(r.num_new_tokens for r in results) == wanted
        local = {r.index: r.text for r in results}
        del gen, model, results
        gc.collect()  # the patched model's cycles hold its KV pool (and the budget it reserved)
        if args.device == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            print(f"GPU memory free before the Ray replica: {free / 2**30:.1f} of {total / 2**30:.1f} GiB")

        # ---- one Ray replica
        class TimedReplica(hp.BatchReplica):
            """BatchReplica that runs the in-process warm-up (the small job, then the job itself) when it
            starts, and gives each batch's start and end times."""

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                for job in (warm, items):
                    for f in [self.engine.submit(r) for r in requests(job)]:
                        f.result()

            def __call__(self, batch):
                began = time.time()
                result = super().__call__(batch)
                result["began"] = [began] * len(batch["id"])
                result["ended"] = [time.time()] * len(batch["id"])
                return result

        ray.init(num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False, log_to_driver=False)
        ds = ray.data.from_items([{"id": i, "text": ids, "max_new_tokens": n, "min_new_tokens": n}
                                  for i, (ids, n) in enumerate(items)])
        start = time.perf_counter()
        rows = ds.map_batches(
            TimedReplica, batch_size=args.batch_size, **hp.replica_compute(1, args.replica_batches),
            num_gpus=1 if args.device == "cuda" else 0,
            fn_constructor_kwargs=dict(model=checkpoint, dtype=dtype, device=args.device)).take_all()
        whole_s = time.perf_counter() - start
        ray.shutdown()
    ray_s = max(r["ended"] for r in rows) - min(r["began"] for r in rows)
    tokens = sum(int(r["num_new_tokens"]) for r in rows)
    assert tokens == wanted and sorted(int(r["id"]) for r in rows) == list(range(num))
    same = sum(r["output"] == local[int(r["id"])] for r in rows)  # each input's answer, both ways
    report = dict(shape=shape, device=args.device, dtype=dtype, num_inputs=num, new_tokens=wanted,
                  batch_size=args.batch_size, replica_batches=args.replica_batches,
                  in_process=dict(seconds=local_s, tokens_per_s=wanted / local_s),
                  ray_one_replica=dict(seconds_first_to_last_batch=ray_s, tokens_per_s=wanted / ray_s,
                                       seconds_whole_job=whole_s, tokens_per_s_whole_job=wanted / whole_s),
                  ray_vs_in_process=(wanted / ray_s) / (wanted / local_s), outputs_equal=same)
    common.write_json(out / "ray.json", report)
    common.print_table(
        ["system", "seconds", "tokens/s", "vs in-process"],
        [["BatchGenerator, in process", f"{local_s:.2f}", f"{wanted / local_s:.0f}", "1.00"],
         ["Ray Data, 1 replica (first to last batch)", f"{ray_s:.2f}", f"{wanted / ray_s:.0f}",
          f"{report['ray_vs_in_process']:.2f}"],
         ["Ray Data, 1 replica (whole job, load included)", f"{whole_s:.2f}", f"{wanted / whole_s:.0f}",
          f"{local_s / whole_s:.2f}"]],
        title=f"{shape} on {args.device}, {num} inputs, {wanted} new tokens; {same}/{num} outputs equal")


if __name__ == "__main__":
    main()
