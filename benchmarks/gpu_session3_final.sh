#!/usr/bin/env bash
# Session 3, last device call (two H200s): GPU tests (beam bookkeeping graph, device reorder,
# device_map), the two-GPU device_map check after the current-device fix, generate() (t5-small and
# t5-large: beams) and BatchGenerator throughput. Every step has a limit; together < 8 minutes.
#     OUT=/some/dir bash benchmarks/gpu_session3_final.sh
source "$(dirname "$0")/_device_call.sh"
run test_gpu_e2e 80 python -m pytest tests/test_gpu_e2e.py tests/test_device_map.py -m gpu -q -x -p no:cacheprovider
run multi_gpu 100 python benchmarks/multi_gpu_check.py --devices cuda:0,cuda:1 --out "$OUT"
run bench_generate 170 python benchmarks/bench_generate.py --models t5-small,t5-large --out "$OUT/generate.json"
run bench_batch 120 python benchmarks/bench_batch.py --out "$OUT" --time-budget 90
exit "$status"
