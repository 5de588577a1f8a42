#!/usr/bin/env bash
# Session 6, third device call (one H200, < 10 minutes): bench_batch with two timed BatchGenerator
# jobs (call b's single job at 512 rows ran 18.9k tok/s where profile_batch's ran 33.6k: which
# stalls — slowest gaps, graphs captured, Triton compiles while timed), then generate() on t5-large
# with the fp32 parity pass (its row was measured before session 5's per-call savings).
#     OUT=/some/dir bash benchmarks/gpu_session6_c.sh
source "$(dirname "$0")/_device_call.sh"
run bench_batch 230 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
run bench_generate 220 python benchmarks/bench_generate.py --models t5-large --parity t5-large --out "$OUT/generate.json"
exit "$status"
