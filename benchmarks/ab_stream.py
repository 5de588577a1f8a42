"""A/B in one process: patched generate() on the generation stream (the default) vs on the
caller's stream, alternating, so machine-to-machine noise cannot stand in for the difference.

    python benchmarks/ab_stream.py [--rounds 3] [--shape t5-small]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp

MODES = {"generation stream": contextlib.nullcontext, "caller's stream": common.on_callers_stream}
CASES = ((1, 1), (8, 4))  # (batch, num_beams)


def step_ms(model, batch, beams, src_len=512, new=128) -> tuple[float, float]:
    """ms per step of one call after a warm-up call, and its peak MiB."""
    ids, mask = common.random_inputs(batch, src_len)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    with torch.inference_mode():
        model.generate(**kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        seconds, _ = common.timed(lambda: model.generate(**kw))
    return seconds / new * 1e3, torch.cuda.max_memory_allocated() / 2**20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="t5-small")
    args = ap.parse_args(argv)
    common.require_cuda("ab_stream.py")
    model = common.make_model(args.shape, "sdpa", torch.bfloat16)

    def one_round(mode: str) -> dict:
        runs = {}
        with MODES[mode]():
            for batch, beams in CASES:
                if hp.is_patched(model):
                    hp.unpatch_model(model)
                common.fresh_workspaces()
                hp.patch_model(model)
                runs[batch, beams] = step_ms(model, batch, beams)
        return runs

    rounds = common.interleaved(list(MODES), args.rounds, one_round)
    rows = []
    for mode, runs in rounds.items():
        for case in CASES:
            ms = [r[case][0] for r in runs]
            rows.append([mode, f"b{case[0]} beams{case[1]}", f"{common.median(ms):.3f}",
                         " ".join(f"{m:.3f}" for m in ms), f"{max(r[case][1] for r in runs):.0f}"])
    common.print_table(["stream", "case", "ms/step (median)", "runs", "peak MiB"], rows,
                       title=f"{args.shape}, bf16, 512-token inputs, 128 new tokens, {args.rounds} rounds")


if __name__ == "__main__":
    main()
