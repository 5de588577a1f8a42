#!/usr/bin/env bash
# Session 5, second device call (one H200, < 10 minutes): generate() on the generation stream vs
# the caller's stream in one process (call a's t5-small steps were ~15% slower than session 4's
# on another machine), the kernel benchmark with the band-tile prefill defaults, generate() on
# t5-large, then BatchGenerator with what is left.
#     OUT=/some/dir bash benchmarks/gpu_session5_b.sh
source "$(dirname "$0")/_device_call.sh"
run ab_stream 90 python benchmarks/ab_stream.py
run bench_kernels 90 python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run bench_generate 200 python benchmarks/bench_generate.py --models t5-large --parity t5-large --out "$OUT/generate.json"
run bench_batch 190 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
exit "$status"
