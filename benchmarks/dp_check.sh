#!/usr/bin/env bash
# The accelerate data-parallel example on 2 processes (one per GPU) vs 1 process: same outputs.
#     OUT=/some/dir bash benchmarks/dp_check.sh
set -eu
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
WORK=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - "$WORK" <<'PY'
import json, random, sys
from hf_paged_t5.tiny import save_demo_checkpoint
work = sys.argv[1]
save_demo_checkpoint(f"{work}/ckpt", shape="t5-small")
words = "the a report said that markets rose fell sharply while officials in city council debated new rules".split()
rng = random.Random(0)
with open(f"{work}/in.jsonl", "w") as f:
    for i in range(200):
        f.write(json.dumps({"id": i, "text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 300)))}) + "\n")
PY
t0=$(date +%s.%N)
python examples/data_parallel.py --model "$WORK/ckpt" --input "$WORK/in.jsonl" --output "$WORK/one.jsonl" --max-new-tokens 48
t1=$(date +%s.%N)
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    examples/data_parallel.py --model "$WORK/ckpt" --input "$WORK/in.jsonl" --output "$WORK/two.jsonl" --max-new-tokens 48
t2=$(date +%s.%N)
lines=$(wc -l < "$WORK/two.jsonl")
if cmp -s "$WORK/one.jsonl" "$WORK/two.jsonl"; then same=true; else same=false; fi
python - "$OUT" "$same" "$lines" "$t0" "$t1" "$t2" <<'PY'
import datetime, json, sys, torch
out, same, lines, t0, t1, t2 = sys.argv[1], sys.argv[2] == "true", int(sys.argv[3]), *map(float, sys.argv[4:])
report = dict(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], inputs=200,
              output_lines=lines, identical_to_one_process=same, one_process_s=t1 - t0, two_processes_s=t2 - t1,
              date=datetime.date.today().isoformat(), note="wall time includes process start and model load")
print(json.dumps(report, indent=1))
json.dump(report, open(f"{out}/data-parallel-2gpu-{datetime.date.today():%Y%m%d}.json", "w"), indent=1)
PY
[ "$same" = true ] && [ "$lines" -eq 200 ]
