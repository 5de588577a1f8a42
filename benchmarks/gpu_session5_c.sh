#!/usr/bin/env bash
# Session 5, third device call (one H200, ~4 minutes): cross-attention decode over mixed-length
# rows in random vs longest-first order (is LPT ordering of BatchGenerator's rows worth it?), and
# where t5-small's batch-1 step goes (host launches vs decode graph).
#     OUT=/some/dir bash benchmarks/gpu_session5_c.sh
source "$(dirname "$0")/_device_call.sh"
run mixed_decode 60 python benchmarks/tune_mixed_decode.py --configs few --out "$OUT/mixed_decode.json"
run profile_step 90 python benchmarks/profile_step.py --models t5-small --batch 1,64
exit "$status"
