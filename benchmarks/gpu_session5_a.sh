#!/usr/bin/env bash
# Session 5, first device call (one H200, < 10 minutes), most wanted first: the GPU tests (kernels included: the
# prefill's band tiles and the tables cut to max_distance are new), the prefill sweep with band
# tiles, the kernel benchmark (band tiles vs gather vs SDPA), and generate() on t5-small (the
# beam-memory target after moving the whole patched call onto the graphs' stream).
#     OUT=/some/dir bash benchmarks/gpu_session5_a.sh
source "$(dirname "$0")/_device_call.sh"
run bench_generate 150 python benchmarks/bench_generate.py --models t5-small --parity t5-small --out "$OUT/generate.json"
run tune_prefill 110 python benchmarks/tune_kernels.py --only prefill --budget 60 --out "$OUT/tune.json"
run bench_kernels 80 python benchmarks/bench_kernels.py --tuned "$OUT/tune.json" --out "$OUT/kernels.json"
run mixed_decode 45 python benchmarks/tune_mixed_decode.py --out "$OUT/mixed_decode.json"
run gpu_tests 200 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
exit "$status"
