#!/usr/bin/env bash
# Everything that needs the GPU, in one device call:
#     OUT=/some/dir bash benchmarks/gpu_all.sh [--quick]
# GPU tests (kernels, end to end), the kernel benchmark and the generate() benchmark; logs
# and JSON under $OUT. Every step runs; the exit status says whether any failed.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {  # run NAME CMD...: tee the output to $OUT/NAME.log
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "=== $name FAILED"; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1 || true
run test_gpu python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py -m gpu -q -x -p no:cacheprovider
run bench_kernels python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run bench_generate python benchmarks/bench_generate.py --out "$OUT/generate.json" "$@"
exit "$status"
