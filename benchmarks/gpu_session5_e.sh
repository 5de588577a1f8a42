#!/usr/bin/env bash
# Session 5, fifth device call (one H200, ~6 minutes): the GPU tests after the per-call savings
# (one walk over the weights, band tiles kept on the table, the small-batch greedy update kept
# across calls), generate() on t5-small, the per-call phases again, the kernel benchmark (its JSON;
# call b returned only its log).
#     OUT=/some/dir bash benchmarks/gpu_session5_e.sh
source "$(dirname "$0")/_device_call.sh"
run bench_generate 150 python benchmarks/bench_generate.py --models t5-small --parity t5-small --out "$OUT/generate.json"
run profile_step 60 python benchmarks/profile_step.py --models t5-small --batch 1
run bench_kernels 80 python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run gpu_tests 220 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
exit "$status"
