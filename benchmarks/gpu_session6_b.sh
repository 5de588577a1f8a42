#!/usr/bin/env bash
# Session 6, second device call (one H200, < 10 minutes): the GPU tests after the encoder stopped
# reading its mask back from the device (BatchGenerator's whole step now checked sync-free) and
# max_graph_batch went to 512; bench_batch with BatchGenerator at 512 rows (the new default); where
# its time goes at 512 rows.
#     OUT=/some/dir bash benchmarks/gpu_session6_b.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_tests 240 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
run bench_batch 200 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
run profile_batch 70 python benchmarks/profile_batch.py
exit "$status"
