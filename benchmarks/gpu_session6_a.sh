#!/usr/bin/env bash
# Session 6, first device call (one H200, < 10 minutes): the GPU tests (the kept greedy update's
# rewritten test has not run on a GPU yet), where a BatchGenerator job's time goes (host phases,
# kernels, graph captures while timed) at 256 and 512 rows, and bench_batch after the table widths
# became fixed at admission (a timed job used to capture ~6 new decode graphs).
#     OUT=/some/dir bash benchmarks/gpu_session6_a.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_tests 240 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
run profile_batch 70 python benchmarks/profile_batch.py
run profile_batch_512 70 python benchmarks/profile_batch.py --batch-rows 512
run bench_batch 200 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
exit "$status"
