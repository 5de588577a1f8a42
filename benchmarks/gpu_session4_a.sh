#!/usr/bin/env bash
# Session 4, first device call (one H200): the whole GPU test suite (the tuned kernel defaults and
# the beam bookkeeping graph had not run on a GPU), generate() on t5-small (median of 3) after the
# capture-stream change, and the memory breakdown of t5-small's cases in sequence.
#     OUT=/some/dir bash benchmarks/gpu_session4_a.sh
source "$(dirname "$0")/_device_call.sh"
run gpu_tests 240 python -m pytest tests -m gpu -q -p no:cacheprovider -rf
run bench_generate 150 python benchmarks/bench_generate.py --models t5-small --out "$OUT/generate.json"
run diag_memory 120 python benchmarks/diag_memory.py --models t5-small --cases 1x1,16x1,64x1,8x4 --hf
exit "$status"
