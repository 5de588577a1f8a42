#!/usr/bin/env bash
# Session 4, last device calls (one H200), in two parts of < 10 minutes each:
#     OUT=/some/dir bash benchmarks/gpu_session4_final.sh a   # GPU tests (kernels excluded: they ran in call 1),
#                                                             # generate() t5-small + t5-large, beam memory
#     OUT=/some/dir bash benchmarks/gpu_session4_final.sh b   # generate() flan-t5-xl, BatchGenerator
source "$(dirname "$0")/_device_call.sh"
if [ "${1:-a}" = a ]; then
    run gpu_tests 150 python -m pytest tests -m gpu -q -x -p no:cacheprovider -rf --ignore=tests/test_kernels.py
    run bench_generate 330 python benchmarks/bench_generate.py --models t5-small,t5-large --out "$OUT/generate.json"
    run diag_memory 60 python benchmarks/diag_memory.py --models t5-small --cases 8x4 --hf
elif [ "$1" = c ]; then
    run gpu_tests 150 python -m pytest tests -m gpu -q -p no:cacheprovider -rf --ignore=tests/test_kernels.py
    run bench_generate 330 python benchmarks/bench_generate.py --models t5-small,flan-t5-xl --out "$OUT/generate.json"
    run diag_memory 50 python benchmarks/diag_memory.py --models t5-small --cases 8x4
elif [ "$1" = d ]; then  # after part c: the update-stream change, and BatchGenerator vs the new static path
    run gpu_e2e 80 python -m pytest tests/test_gpu_e2e.py tests/test_batching.py -m gpu -q -x -p no:cacheprovider -rf
    run bench_batch 170 python benchmarks/bench_batch.py --out "$OUT" --time-budget 80
else
    run bench_generate_xl 330 python benchmarks/bench_generate.py --models flan-t5-xl --out "$OUT/generate-xl.json"
    run bench_batch 200 python benchmarks/bench_batch.py --out "$OUT" --time-budget 100
fi
exit "$status"
# Part c (what the last call ran, after the fixes of part a's findings): GPU tests without the
# kernels, generate() on t5-small and flan-t5-xl, the beam memory breakdown.
#     OUT=/some/dir bash benchmarks/gpu_session4_final.sh c
