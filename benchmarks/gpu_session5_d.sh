#!/usr/bin/env bash
# Session 5, fourth device call (one H200, ~3 minutes): what a generate() call costs outside its
# decode steps (call c: ~28 ms per call at t5-small batch 1, ~57% of a 128-token call), by phase,
# and a profiler table of a 1-token call; after the per-call parameter walks were cut to one.
#     OUT=/some/dir bash benchmarks/gpu_session5_d.sh
source "$(dirname "$0")/_device_call.sh"
run profile_step 150 python benchmarks/profile_step.py --models t5-small,t5-large --batch 1 --table "$OUT/profile_table.txt" --table-new-tokens 1
exit "$status"
