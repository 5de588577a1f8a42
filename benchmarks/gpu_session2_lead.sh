#!/usr/bin/env bash
# Session 2, device call A (one H200): GPU tests, kernel benchmark, batch benchmark.
#     OUT=/some/dir bash benchmarks/gpu_session2_lead.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {  # run NAME SECONDS CMD...: tee the output to $OUT/NAME.log, give up after SECONDS
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "=== $name FAILED"; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
run test_gpu 200 python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py tests/test_batching.py \
    tests/test_fp16.py tests/test_device_map.py -m gpu -q -p no:cacheprovider
run bench_kernels 100 python benchmarks/bench_kernels.py --out "$OUT/kernels.json"
run bench_batch 230 python benchmarks/bench_batch.py --out "$OUT" --time-budget 150 --hf-inputs 128
exit "$status"
