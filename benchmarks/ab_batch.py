"""One side of an A/B of two checkouts of the package: `BatchGenerator` tokens/s on one GPU.

bf16, random weights (`hf_paged_t5.tiny.build_model`), t5-small and t5-large layouts; 600 seeded
inputs of 20-600 tokens, each with a forced length of 16-96 new tokens, greedy; and 64 of them
with 4 beams (`--beam-inputs`; with `--beam-rows` under the inputs' rows, inputs join the job
at different steps). Median of 3 jobs after one warm-up job. Prints one line: the label, the package
file imported, and tokens/s per case as JSON. Run it in fresh processes alternating the checkouts,
as `ab_generate.py` says:

    for side in before after before after; do
        PYTHONPATH=$([ $side = before ] && echo /tmp/before || echo .) python benchmarks/ab_batch.py $side
    done
"""
from __future__ import annotations

import argparse
import random
import time

import torch

import common  # benchmarks/ is on sys.path


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, 32000) for _ in range(rng.randint(20, 600))], rng.randint(16, 96)) for _ in range(n)]


def time_cases(label: str, shapes=("t5-small", "t5-large"), beam_counts=(1, 4), beam_inputs: int = 64,
               beam_rows=None) -> dict:
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    res = {}
    items = workload(max(600, beam_inputs))
    for shape in shapes:
        model = tiny.build_model(shape=shape, dtype=torch.bfloat16, device="cuda")
        hp.patch_model(model)
        for beams in beam_counts:
            subset = items[:600] if beams == 1 else items[:beam_inputs]
            gen = hp.BatchGenerator(model, num_beams=beams, max_batch_rows=beam_rows) if beams > 1 else \
                hp.BatchGenerator(model)
            requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in subset]
            tokens = sum(n for _, n in subset)
            rates = []
            for i in range(4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in gen.generate(requests):
                    pass
                torch.cuda.synchronize()
                if i:  # the first job is the warm-up
                    rates.append(tokens / (time.perf_counter() - start))
            res[f"{shape} beams{beams}"] = round(sorted(rates)[1], 1)
        del model
        torch.cuda.empty_cache()
    common.ab_side(label, res)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label", help="this side's name in the output line (e.g. before, after)")
    ap.add_argument("--shapes", default="t5-small,t5-large", help="model layouts (comma-separated)")
    ap.add_argument("--beams", default="1,4", help="num_beams cases (comma-separated; 1: greedy)")
    ap.add_argument("--beam-inputs", type=int, default=64, help="inputs of a beam case's job (default: 64)")
    ap.add_argument("--beam-rows", type=int, default=None,
                    help="max_batch_rows of a beam case (default: the generator's)")
    args = ap.parse_args(argv)
    common.require_cuda("ab_batch.py")
    time_cases(args.label, tuple(args.shapes.split(",")), tuple(int(b) for b in args.beams.split(",")),
               args.beam_inputs, args.beam_rows)


if __name__ == "__main__":
    main()
