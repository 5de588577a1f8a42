#!/usr/bin/env bash
# Session 2, one H200 (the counterpart of gpu_session2_x2.sh when only one GPU is lent):
# the GPU tests of fp16 safety and device_map, the 1,000-call soak, the device_map check split
# between cuda:0 and the CPU, long inputs and encoder-only benchmarks. Every step has a time
# limit; all of them together stay under 9 minutes.
#     OUT=/some/dir bash benchmarks/gpu_session2.sh
# Logs: $OUT/<step>.log; JSON: $OUT/multi-gpu-*.json, long-*.json, encoder-*.json, tests-*.xml.
source "$(dirname "$0")/_device_call.sh"
run test_fp16_device_map 80 python -m pytest tests/test_fp16.py tests/test_device_map.py -m gpu -q \
    -p no:cacheprovider --junitxml "$OUT/tests-fp16-device-map.xml"
run test_soak 190 python -m pytest tests/test_soak.py -m gpu -q -s -p no:cacheprovider \
    --junitxml "$OUT/tests-soak.xml"
run multi_gpu_cuda_cpu 70 python benchmarks/multi_gpu_check.py --devices cuda:0,cpu --shape t5-small --out "$OUT"
run bench_long 100 python benchmarks/bench_long.py --out "$OUT"
run bench_encoder 60 python benchmarks/bench_encoder.py --out "$OUT"
exit "$status"
