"""One side of an A/B of two checkouts of the package: `BatchGenerator` tokens/s on one GPU (or,
with `--device cpu`, on the CPU backend in float32).

bf16 on a GPU, random weights (`hf_paged_t5.tiny.build_model`), t5-small and t5-large layouts; 600 seeded
inputs of 20-600 tokens, each with a forced length of 16-96 new tokens, greedy; and 64 of them
with 4 beams (`--beam-inputs`; with `--beam-rows` under the inputs' rows, inputs join the job
at different steps; `--inputs` sets the greedy job's count). Median of 3 jobs after one warm-up job. Prints one line: the label, the package
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


def workload(n: int, seed: int = 0, vocab_size: int = 32000) -> list[tuple[list[int], int]]:
    """n (ids, new tokens) pairs; ids below min(vocab_size, 32000), so every layout of 32,000 ids or
    more gets the same inputs."""
    rng = random.Random(seed)
    top = min(vocab_size, 32000)
    return [([rng.randrange(2, top) for _ in range(rng.randint(20, 600))], rng.randint(16, 96)) for _ in range(n)]


def time_cases(label: str, shapes=("t5-small", "t5-large"), beam_counts=(1, 4), beam_inputs: int = 64,
               beam_rows=None, device: str = "cuda", inputs: int = 600) -> dict:
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    res = {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for shape in shapes:
        model = tiny.build_model(shape=shape, dtype=dtype, device=device)
        hp.patch_model(model)
        items = workload(max(inputs, beam_inputs), vocab_size=model.config.vocab_size)
        for beams in beam_counts:
            subset = items[:inputs] if beams == 1 else items[:beam_inputs]
            gen = hp.BatchGenerator(model, num_beams=beams, max_batch_rows=beam_rows) if beams > 1 else \
                hp.BatchGenerator(model)
            requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in subset]
            tokens = sum(n for _, n in subset)
            rates = []
            for i in range(4):
                common.sync(device)
                start = time.perf_counter()
                for _ in gen.generate(requests):
                    pass
                common.sync(device)
                if i:  # the first job is the warm-up
                    rates.append(tokens / (time.perf_counter() - start))
            res[f"{shape} beams{beams}"] = round(sorted(rates)[1], 1)
        del model
        if device == "cuda":
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
    ap.add_argument("--inputs", type=int, default=600, help="inputs of a greedy case's job (default: 600)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (bf16, the Triton backend) or cpu (float32, the CPU backend)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        common.require_cuda("ab_batch.py")
    time_cases(args.label, tuple(args.shapes.split(",")), tuple(int(b) for b in args.beams.split(",")),
               args.beam_inputs, args.beam_rows, args.device, args.inputs)


if __name__ == "__main__":
    main()
