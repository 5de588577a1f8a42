#!/usr/bin/env bash
# First device call for the next session (one H200, < 10 minutes). Session 6 landed two changes
# after its last device call, verified on CPU only: BatchGenerator's graphs serve at least 64 rows
# (BatchCache.min_graph_rows: a draining job no longer captures few-row graphs, whose kernel
# configurations compiled mid-job), and the corrected test_gpu_new_workload_sizes_compile_nothing
# (its warm-up had run the 3-split decode configurations as 1 split). Expected: bench_batch's first
# timed BatchGenerator job captures and compiles nothing (session 6: 3 graphs, 7 kernels).
#     OUT=/some/dir bash benchmarks/gpu_session7_first.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_kernels_batching 200 python -m pytest tests/test_kernels.py tests/test_batching.py -m gpu -q -p no:cacheprovider -rf
run bench_batch 230 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
run gpu_rest 150 python -m pytest tests -m gpu -q -p no:cacheprovider -rf --ignore=tests/test_kernels.py --ignore=tests/test_batching.py
exit "$status"
