"""One side of an A/B of two checkouts of the package: patched generate() ms per call on one GPU.

bf16, random weights (`hf_paged_t5.tiny.build_model`), t5-small and t5-large layouts, 512-token
inputs, 128 new tokens forced, b1 / b16 / 8 sources x 4 beams; median of 7 calls after 2 warm-up
calls. Prints one line: the label, the package file imported, and the ms per case as JSON. Run it
in fresh processes alternating the checkouts, e.g. with the older one extracted to /tmp/before
(`git archive REV hf_paged_t5 | tar -x -C /tmp/before`):

    for side in before after before after; do
        PYTHONPATH=$([ $side = before ] && echo /tmp/before || echo .) python benchmarks/ab_generate.py $side
    done
"""
from __future__ import annotations

import argparse
import time

import torch

import common  # benchmarks/ is on sys.path


def time_cases(label: str) -> dict:
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    res = {}
    for shape in ("t5-small", "t5-large"):
        model = tiny.build_model(shape=shape, dtype=torch.bfloat16, device="cuda")
        hp.patch_model(model)
        for b, beams in ((1, 1), (16, 1), (8, 4)):
            g = torch.Generator(device="cuda").manual_seed(1)
            ids = torch.randint(2, 32000, (b, 512), device="cuda", generator=g)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                      num_beams=beams)
            for _ in range(2):
                model.generate(**kw)
            torch.cuda.synchronize()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                model.generate(**kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            res[f"{shape} b{b}x{beams}"] = round(sorted(times)[3] * 1e3, 2)
        del model
        torch.cuda.empty_cache()
    common.ab_side(label, res)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label", help="this side's name in the output line (e.g. before, after)")
    args = ap.parse_args(argv)
    common.require_cuda("ab_generate.py")
    time_cases(args.label)


if __name__ == "__main__":
    main()
