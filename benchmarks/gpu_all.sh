#!/usr/bin/env bash
# Everything that needs the GPU, in one device call:
#     OUT=/some/dir bash benchmarks/gpu_all.sh [--quick]
# GPU tests (kernels, end to end), the kernel benchmark and the generate() benchmark; logs
# and JSON under $OUT. Every step runs; the exit status says whether any failed.
source "$(dirname "$0")/_device_call.sh"
run test_gpu 300 python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py -m gpu -q -x -p no:cacheprovider
run bench_kernels 200 python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run bench_generate 590 python benchmarks/bench_generate.py --out "$OUT/generate.json" "$@"
exit "$status"
