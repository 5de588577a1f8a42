#!/usr/bin/env bash
# Session 2, device call A (one H200): GPU tests, kernel benchmark, batch benchmark.
#     OUT=/some/dir bash benchmarks/gpu_session2_lead.sh
source "$(dirname "$0")/_device_call.sh"
run test_gpu 200 python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py tests/test_batching.py \
    tests/test_fp16.py tests/test_device_map.py -m gpu -q -p no:cacheprovider
run bench_kernels 100 python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run bench_batch 230 python benchmarks/bench_batch.py --out "$OUT" --time-budget 150 --hf-inputs 128
exit "$status"
