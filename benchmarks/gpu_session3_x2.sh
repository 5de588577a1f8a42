#!/usr/bin/env bash
# Session 3, first device call (two H200s): where beam-search memory and step time go (diag_memory,
# profile_step, profile_batch), the two-GPU device_map check and the 2-process data-parallel example (#8), and the
# GPU tests (kernels, end to end, fp16, device_map). Every step has a limit; together < 10 min.
#     OUT=/some/dir bash benchmarks/gpu_session3_x2.sh
source "$(dirname "$0")/_device_call.sh"
run diag_memory 75 python benchmarks/diag_memory.py --models t5-small,t5-large --cases 8x4 --hf
run profile_step 70 python benchmarks/profile_step.py --models t5-small --batch 1,16 --table "$OUT/profile-table.txt"
run profile_beams 60 python benchmarks/profile_step.py --models t5-small,t5-large --batch 8 --beams 4 \
    --table "$OUT/profile-table.txt"
run profile_batch 110 python benchmarks/profile_batch.py
run multi_gpu 110 python benchmarks/multi_gpu_check.py --devices cuda:0,cuda:1 --out "$OUT"
run data_parallel 140 bash benchmarks/dp_check.sh
run test_gpu 170 python -m pytest tests/test_kernels.py tests/test_gpu_e2e.py tests/test_fp16.py \
    tests/test_device_map.py -m gpu -q -x -p no:cacheprovider --junitxml "$OUT/tests-gpu.xml"
exit "$status"
