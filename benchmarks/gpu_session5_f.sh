#!/usr/bin/env bash
# Session 5, last device call (one H200, ~5 minutes): generate() on t5-small after call e's fix
# (band tiles on inference-mode tables: call e's bench crashed on them), then the end-to-end GPU
# tests and the soak (kept greedy updates counted as captures).
#     OUT=/some/dir bash benchmarks/gpu_session5_f.sh
source "$(dirname "$0")/_device_call.sh"
run bench_generate 140 python benchmarks/bench_generate.py --models t5-small --parity t5-small --out "$OUT/generate.json"
run gpu_e2e 150 python -m pytest tests/test_gpu_e2e.py tests/test_soak.py -m gpu -q -p no:cacheprovider -rf
exit "$status"
