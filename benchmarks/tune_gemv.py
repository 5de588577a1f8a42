"""Sweep `kernels.gemv` launch configs against F.linear on the decode projections of T5 shapes.

    python benchmarks/tune_gemv.py [--out DIR]

Each candidate is checked against F.linear first, then timed as 20 back-to-back calls replayed
in a CUDA graph (`common.graph_us`: how the decode step runs them). Prints the best config per
shape and writes DIR/gemv.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path
from hf_paged_t5.kernels.gemv import gemv, gemv_config

# (N, K) of q/k/v/o, wi, wo, lm_head for t5-small, t5-large, flan-t5-xl
SHAPES = [
    (512, 512), (2048, 512), (512, 2048), (32128, 512),
    (1024, 1024), (4096, 1024), (1024, 4096), (32128, 1024),
    (2048, 2048), (5120, 2048), (2048, 5120), (32128, 2048),
]
CALLS = 20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for gemv.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    common.require_cuda("tune_gemv.py")
    out = common.start_suite(args.out, "gemv")
    dtype = torch.bfloat16
    results = []
    for (n, k), rows in itertools.product(SHAPES, (1, 4)):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        ref = F.linear(x, w).float()
        torch_us = common.graph_us([lambda: F.linear(x, w)] * CALLS)
        best = None
        for bn, bk, warps in itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8)):
            if bk > max(256, triton_pow2(k)):
                continue
            cfg = (bn, bk, warps)
            out = gemv(x, w, cfg).float()
            if not torch.allclose(out, ref, rtol=2e-2, atol=2e-2):
                print(f"MISMATCH {n}x{k} rows {rows} cfg {cfg}", flush=True)
                continue
            us = common.graph_us([lambda: gemv(x, w, cfg)] * CALLS)
            if best is None or us < best[1]:
                best = (cfg, us)
        default_us = common.graph_us([lambda: gemv(x, w)] * CALLS)
        gbps = n * k * 2 / (best[1] * 1e-6) / 1e9
        row = dict(N=n, K=k, rows=rows, torch_us=torch_us, default_cfg=gemv_config(rows, n, k), default_us=default_us,
                   best_cfg=best[0], best_us=best[1], best_gbps=gbps)
        results.append(row)
        print(f"{n:6d}x{k:5d} rows {rows}: F.linear {torch_us:7.2f} us | default {default_us:7.2f} | "
              f"best {best[1]:7.2f} us {best[0]} ({gbps:.0f} GB/s)", flush=True)
    common.write_json(out / "gemv.json", dict(gpu=torch.cuda.get_device_name(), results=results))


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
