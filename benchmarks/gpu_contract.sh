#!/usr/bin/env bash
# The drop-in contract on one GPU (< 10 minutes on an H200): the GPU contract tests (Triton path,
# fp32, every family and search mode, the mt5-base layout, holes, hooked projections), the rest of
# the GPU suite, and bench_generate at t5-small / t5-large (HF in the same run) with the fp32
# parity pass, so a contract fix that slowed the paged path shows.
#     OUT=/some/dir bash benchmarks/gpu_contract.sh
source "$(dirname "$0")/_device_call.sh"
python - > "$OUT/env.json" <<'PY'
import json, platform, subprocess, torch, transformers, triton
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": transformers.__version__, "python": platform.python_version(),
                  "command": "OUT=... bash benchmarks/gpu_contract.sh"}, indent=1))
PY
run gpu-contract 150 python -m pytest tests/test_gpu_contract.py -q -p no:cacheprovider -rf
run gpu-tests 260 python -m pytest tests -m gpu -q -p no:cacheprovider -rf --ignore=tests/test_gpu_contract.py
run generate 330 python benchmarks/bench_generate.py --out "$OUT/generate.json" --models t5-small,t5-large --parity t5-small
exit "$status"
