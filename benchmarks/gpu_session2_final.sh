#!/usr/bin/env bash
# Session 2, last device call (two H200s): the generate() benchmark on cuda:0, the graph-recapture
# test, the two-GPU device_map check, the data-parallel example, long inputs.
source "$(dirname "$0")/_device_call.sh"
run test_recapture 40 python -m pytest tests/test_gpu_e2e.py -m gpu -q -p no:cacheprovider -k "recapture or deferred"
run bench_generate 280 python benchmarks/bench_generate.py --models t5-small,t5-large,flan-t5-xl --out "$OUT/generate.json"
run multi_gpu 100 python benchmarks/multi_gpu_check.py --devices cuda:0,cuda:1 --out "$OUT"
run data_parallel 50 bash benchmarks/dp_check.sh
run bench_long 75 python benchmarks/bench_long.py --out "$OUT"
exit "$status"
