#!/usr/bin/env bash
# Session 3, second device call (two H200s): GPU end-to-end tests (beam reorder on the device, the
# graph step reading the device table), the two-GPU device_map check after the current-device fix,
# the generate() benchmark (beams without a per-step sync) and beam memory by caller.
#     OUT=/some/dir bash benchmarks/gpu_session3_x2b.sh
source "$(dirname "$0")/_device_call.sh"
run test_gpu_e2e 90 python -m pytest tests/test_gpu_e2e.py tests/test_device_map.py -m gpu -q -x -p no:cacheprovider
run multi_gpu 110 python benchmarks/multi_gpu_check.py --devices cuda:0,cuda:1 --out "$OUT"
run bench_generate 300 python benchmarks/bench_generate.py --models t5-small,t5-large,flan-t5-xl --out "$OUT/generate.json"
run diag_memory 40 python benchmarks/diag_memory.py --models t5-small --cases 8x4
exit "$status"
