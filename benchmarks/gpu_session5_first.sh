#!/usr/bin/env bash
# First device call for the next session (one H200, < 10 minutes): what session 4 landed after its
# last device call (graphs.ResidentLoop shared by the resident greedy/beam loops, verified on CPU
# only), then the measurements that session 4 could not repeat: generate() on t5-large with the
# encoder FF chunks capped at 4 per layer (its b64 row ran with 4 MiB chunks), and BatchGenerator
# with the full time budget (session 4's short run measured HF on 32 inputs only).
#     OUT=/some/dir bash benchmarks/gpu_session5_first.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_tests 150 python -m pytest tests -m gpu -q -p no:cacheprovider -rf --ignore=tests/test_kernels.py
run bench_generate 200 python benchmarks/bench_generate.py --models t5-large --out "$OUT/generate.json"
run bench_batch 200 python benchmarks/bench_batch.py --out "$OUT" --time-budget 150
exit "$status"
