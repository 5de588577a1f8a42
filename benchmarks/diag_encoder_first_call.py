"""Where a text encoder's cold first call waits: a timeline of its compiles, in this process and in the workers.

    TRITON_CACHE_DIR=<new empty folder> python benchmarks/diag_encoder_first_call.py [--model t5-v1_1-xxl] [--length 512]

Builds `bench_encoder.py`'s random-weight model (bf16) on the GPU, patches it, waits until every
compile worker has started (at most 60 s), then calls the encoder twice on one 1 x `--length`
input (the first call compiles ahead and runs eagerly; the second captures the shape's CUDA
graph). Prints both calls' seconds and, in seconds from just before the first call, every
compile or cache load in this process (`triton.compile`), every compile a worker process ran
(`compile_workers.history()`: its start and end there, and when it was asked for here) and every
graph capture; the workers' compiles that neither call waited for are listed once they end (at
most 60 s later). Run it with an empty Triton cache: a warm cache leaves nothing to compile.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import bench_encoder
import common


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="t5-v1_1-xxl", choices=sorted(bench_encoder.MODELS))
    ap.add_argument("--length", type=int, default=512, help="tokens of the one input")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("diag_encoder_first_call.py: needs a CUDA GPU")
    if args.length < 1:
        sys.exit(f"diag_encoder_first_call.py: --length must be at least 1, got {args.length}")
    import hf_paged_t5 as hp
    from hf_paged_t5.kernels import compile_workers

    events = []
    common.hook_compiles_and_captures(lambda kernel, start, end: events.append((f"load/compile {kernel}", start, end)),
                                      lambda start, end: events.append(("capture", start, end)))
    model = hp.patch_model(bench_encoder.build(args.model, "cuda").to(torch.bfloat16))
    deadline = time.monotonic() + 60
    while compile_workers.free() < compile_workers.count() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"compile workers free: {compile_workers.free()} of {compile_workers.count()}")
    ids = torch.randint(2, model.config.vocab_size, (1, args.length), device="cuda")
    torch.cuda.synchronize()
    with torch.no_grad():
        first = time.perf_counter()
        model(input_ids=ids)[0]
        torch.cuda.synchronize()
        second = time.perf_counter()
        model(input_ids=ids)[0]
        torch.cuda.synchronize()
        end = time.perf_counter()
    print(f"{args.model}, 1 x {args.length}: first call {second - first:.3f} s, second {end - second:.3f} s")
    deadline = time.monotonic() + 60  # compiles the calls did not wait for: on the timeline too
    while compile_workers.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    for job in compile_workers.history():
        if job["began"] is not None:
            events.append((f"worker {job['name']} (asked at {job['asked'] - first:.3f})", job["began"], job["ended"]))
    print(f"{'start s':>8} {'end s':>8} {'s':>7}  what")
    for what, start, stop in sorted(events, key=lambda e: e[1]):
        print(f"{start - first:8.3f} {stop - first:8.3f} {stop - start:7.3f}  {what}")


if __name__ == "__main__":
    main()
