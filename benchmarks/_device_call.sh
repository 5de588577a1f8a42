# Sourced by the benchmarks/gpu_*.sh device-call scripts: work from the repository root, results
# under $OUT (default benchmarks/results), and `run NAME SECONDS CMD...`, which tees CMD's output
# to $OUT/NAME.log, gives up after SECONDS and records a failure in $status (every step runs).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "=== $name FAILED"; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
