#!/usr/bin/env bash
# Kernel tests and benchmark on the GPU machine, in one go:
#     OUT=/some/dir bash benchmarks/gpu_kernels.sh
# Writes $OUT/test_kernels_gpu.log, $OUT/test_kernels_all.log, $OUT/bench_kernels.log and
# $OUT/kernels.json; exits non-zero if any step failed (all steps run regardless).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true

# GPU-only tests first (realistic shapes, >2^31-element pool, CUDA-graph replay)...
python -m pytest tests/test_kernels.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/test_kernels_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

python benchmarks/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# ...then the small-shape tests, compiled for real this time (the CPU run only interprets them).
python -m pytest tests/test_kernels.py -m "not gpu" -q -p no:cacheprovider 2>&1 | tee "$OUT/test_kernels_all.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

exit "$status"
