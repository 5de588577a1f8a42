#!/usr/bin/env bash
# Session 3, issue #3 (kernel targets): one H200 device call, ~6 minutes (at most ~8):
#     OUT=/some/dir bash benchmarks/gpu_session3_kernels.sh
# GPU kernel tests (the new prefill / decode variants included), the launch-knob sweep (its
# kernels compiled by worker processes at once), then bench_kernels with today's defaults and
# the sweep's winners side by side (prefill and SDPA also both inside CUDA graphs).
# Writes $OUT/test_kernels_gpu.log, tune_kernels.log + tune.json, bench_kernels.log + kernels.json.
source "$(dirname "$0")/_device_call.sh"
run test_kernels_gpu 150 python -m pytest tests/test_kernels.py -m gpu -q -p no:cacheprovider
run tune_kernels 210 python benchmarks/tune_kernels.py --budget 130 --out "$OUT/tune.json"
run bench_kernels 110 python benchmarks/bench_kernels.py --out "$OUT/kernels.json" --tuned "$OUT/tune.json"
exit "$status"
