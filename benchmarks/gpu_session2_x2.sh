#!/usr/bin/env bash
# Session 2, device call B (two H200s): GPU tests, multi-GPU device_map check, data-parallel
# example, long inputs, encoder-only.   OUT=/some/dir bash benchmarks/gpu_session2_x2.sh
source "$(dirname "$0")/_device_call.sh"
run test_gpu 230 python -m pytest tests/test_fp16.py tests/test_device_map.py tests/test_soak.py \
    tests/test_gpu_e2e.py -m gpu -q -p no:cacheprovider
run multi_gpu 150 python benchmarks/multi_gpu_check.py --devices cuda:0,cuda:1 --out "$OUT"
run data_parallel 90 bash benchmarks/dp_check.sh
run bench_long 100 python benchmarks/bench_long.py --out "$OUT"
run bench_encoder 60 python benchmarks/bench_encoder.py --out "$OUT"
exit "$status"
