"""One side of an A/B of two checkouts of the package: patched generate() ms per call on one GPU.

bf16, random weights (`hf_paged_t5.tiny.build_model`), 512-token inputs; by default the t5-small
and t5-large layouts at b1 / b16 / 8 sources x 4 beams, 128 new tokens forced (`--cases` names
others as layout:rows:beams:new_tokens); median of 7 calls after 2 warm-up calls. Prints one line:
the label, the package file imported, and per case the ms and a hash of the last call's tokens
(equal hashes: the same tokens) as JSON. Run it
in fresh processes alternating the checkouts, e.g. with the older one extracted to /tmp/before
(`git archive REV hf_paged_t5 | tar -x -C /tmp/before`):

    for side in before after before after; do
        PYTHONPATH=$([ $side = before ] && echo /tmp/before || echo .) python benchmarks/ab_generate.py $side
    done
"""
from __future__ import annotations

import argparse
import hashlib
import time

import torch

import common  # benchmarks/ is on sys.path


DEFAULT_CASES = ",".join(f"{shape}:{b}:{beams}:128" for shape in ("t5-small", "t5-large")
                         for b, beams in ((1, 1), (16, 1), (8, 4)))


def parse_cases(text: str) -> list[tuple[str, int, int, int]]:
    """"layout:rows:beams:new_tokens,..." as tuples; a clear error for anything else."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise SystemExit(f"ab_generate.py: --cases wants layout:rows:beams:new_tokens items, got {item!r}")
        cases.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return cases


def time_cases(label: str, cases: list[tuple[str, int, int, int]]) -> dict:
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    res = {}
    for shape in dict.fromkeys(case[0] for case in cases):
        model = tiny.build_model(shape=shape, dtype=torch.bfloat16, device="cuda")
        hp.patch_model(model)
        for _, b, beams, new in (case for case in cases if case[0] == shape):
            g = torch.Generator(device="cuda").manual_seed(1)
            ids = torch.randint(2, 32000, (b, 512), device="cuda", generator=g)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      num_beams=beams)
            for _ in range(2):
                model.generate(**kw)
            torch.cuda.synchronize()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                out = model.generate(**kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            res[f"{shape} b{b}x{beams}" + ("" if new == 128 else f" new{new}")] = dict(
                ms=round(sorted(times)[3] * 1e3, 2), tokens=hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()[:8])
        del model
        torch.cuda.empty_cache()
    common.ab_side(label, res)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label", help="this side's name in the output line (e.g. before, after)")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help="comma-separated layout:rows:beams:new_tokens (default: %(default)s)")
    args = ap.parse_args(argv)
    cases = parse_cases(args.cases)
    common.require_cuda("ab_generate.py")
    time_cases(args.label, cases)


if __name__ == "__main__":
    main()
