#!/usr/bin/env bash
# Session 6, last device call (one H200, < 10 minutes): the GPU tests after the kernels stopped
# specializing on workload sizes (do_not_specialize; new test: new sizes compile nothing), then
# bench_batch (call c's first timed job compiled 8 kernels while timed).
#     OUT=/some/dir bash benchmarks/gpu_session6_d.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_tests 240 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
run bench_batch 230 python benchmarks/bench_batch.py --out "$OUT" --time-budget 130
exit "$status"
