#!/usr/bin/env bash
# One device call for tuning: GPU tests, the attention-kernel and GEMV sweeps, a step profile.
#     OUT=/some/dir bash benchmarks/gpu_tune.sh
source "$(dirname "$0")/_device_call.sh"
run test_gpu 150 python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py -m gpu -q -x -p no:cacheprovider
run tune_gemv 120 python benchmarks/tune_gemv.py --out "$OUT"
run profile 70 python benchmarks/profile_step.py --models t5-small,t5-large --batch 1,64
run tune_kernels 200 python benchmarks/tune_kernels.py --out "$OUT/tune.json"
exit "$status"
