"""One side of an A/B of two checkouts of the package: µs per replay of the decode step's graph.

bf16, random weights (`hf_paged_t5.tiny.build_model`, torch seed 0), 512-token inputs, 128 new
tokens forced; per case (layout:rows:beams) two warm-up calls, the median of 5 whole calls
(ms), then the upper median of 200 replays of the last decode graph captured (CUDA events: the GPU
time of one step, without the per-step token choice or the call's encoder), and a hash of the
last call's tokens (equal hashes: the same tokens). Prints one line: the label, the variant and
the figures as JSON. Run it in fresh processes, alternating the checkouts:

    git archive REV hf_paged_t5 | tar -x -C /tmp/before
    for side in before after before after; do
        PYTHONPATH=$([ $side = before ] && echo /tmp/before || echo .) python benchmarks/ab_replay.py $side
    done

--variant one-split: where a decode launch has fewer (row, head) programs than SMs and at most
512 keys, one split whose single tile holds every key (warps scaled to keep 64 K elements per
thread) instead of `decode_config`'s pick (up to 4 splits of 128-key tiles merged by the last);
at 512 keys that is 16 warps, whose 128-register cap spills. --variant wide-tiles: the same
launches as splits of 256-key tiles on 8 warps (one tile per split, no spills at sm_90).
--variant narrow-tiles: as many splits of 64 keys as the SMs take one program each (one tile
per split; where the SMs do not cover the keys that way, the default 128-key tiles).
--variant one-split-two-tiles: over more than 256 keys (cross-attention), one split streaming
256-key tiles on 8 warps (at 512 keys the first tile loads before the dependent-launch wait, the
second is requested right after it; 206 registers at sm_90, no spills) in place of up to 4 split
programs merged by the last.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json

import torch

import common  # benchmarks/ is on sys.path

DEFAULT_CASES = "t5-large:1:1,flan-t5-xl:1:1,t5-large:1:4,t5-large:16:1"


def few_programs_config(variant: str):
    """`decode_config` with the `variant` rule above (patched into kernels.decode for this process)."""
    from hf_paged_t5.kernels.decode import DecodeConfig

    dec = importlib.import_module("hf_paged_t5.kernels.decode")  # the module (its launch reads decode_config)

    default = dec.decode_config

    def pick(batch, num_heads, head_dim, max_keys, num_sms):
        if batch * num_heads < num_sms and max_keys <= 512 and head_dim <= 64:
            if variant == "wide-tiles":
                return DecodeConfig(block_n=256, num_warps=8, num_splits=-(-max_keys // 256))
            if variant == "one-split-two-tiles":
                if max_keys > 256:  # cross-attention; self-attention (at most 256 keys here) keeps the default
                    return DecodeConfig(block_n=256, num_warps=8, num_splits=1)
                return default(batch, num_heads, head_dim, max_keys, num_sms)
            if variant == "narrow-tiles":
                splits = max(1, min(-(-max_keys // 64), num_sms // (batch * num_heads)))
                return DecodeConfig(block_n=64 if splits * 64 >= max_keys else 128, num_warps=4, num_splits=splits)
            block_n = max(128, 1 << (max_keys - 1).bit_length())
            return DecodeConfig(block_n=block_n, num_warps=max(4, block_n * 64 // 2048), num_splits=1)
        return default(batch, num_heads, head_dim, max_keys, num_sms)

    dec.decode_config = pick


def time_case(shape: str, rows: int, beams: int) -> dict:
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    torch.manual_seed(0)
    model = tiny.build_model(shape=shape, dtype=torch.bfloat16, device="cuda")
    hp.patch_model(model)
    ids, mask = common.random_inputs(rows, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=128, min_new_tokens=128, num_beams=beams)
    with torch.inference_mode():
        for _ in range(2):
            out = model.generate(**kw)
        calls = [common.timed(lambda: model.generate(**kw))[0] for _ in range(5)]
    replays = common.replay_times_us(list(common.decode_graphs(model).values())[-1], 200)
    return dict(replay_us=round(sorted(replays)[len(replays) // 2], 1), call_ms=round(common.median(calls) * 1e3, 2),
                tokens=hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest()[:8])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="layout:rows:beams,...")
    ap.add_argument("--variant", choices=("default", "one-split", "wide-tiles", "narrow-tiles", "one-split-two-tiles"), default="default")
    args = ap.parse_args(argv)
    common.require_cuda("ab_replay.py")
    cases = []
    for item in filter(None, args.cases.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise SystemExit(f"ab_replay.py: --cases wants layout:rows:beams items, got {item!r}")
        cases.append((parts[0], int(parts[1]), int(parts[2])))
    if args.variant != "default":
        few_programs_config(args.variant)
    res = {}
    for shape, rows, beams in cases:
        res[f"{shape}:{rows}:{beams}"] = time_case(shape, rows, beams)
        torch.cuda.empty_cache()
    print(args.label, args.variant, json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
