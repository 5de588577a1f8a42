"""Sweep the launch knobs of the row-wise kernels at text-encoder shapes: `gated_gelu` and `rms_norm`.

    python benchmarks/tune_pointwise.py [--tokens 77,512,1024] [--d-model 4096] [--d-ff 10240] [--out DIR]

At T5 v1.1 XXL's widths (defaults), for each token count: `gated_gelu` over [tokens, d_ff] for
elements per program x warps, and `rms_norm` with the residual add over [tokens, d_model] for
warps per row, against torch's copy of the same bytes. 24 calls over distinct tensors (none stays
in L2) replayed in one CUDA graph (`common.graph_us`, as an encoder graph runs them); each config
is checked against the package's own call first (same bits). Prints µs per call, GB/s of bytes
read + written, and the best config per shape; writes DIR/pointwise.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import itertools

import torch

import common  # benchmarks/ is on sys.path
from hf_paged_t5.kernels import gated_gelu, rms_norm
from hf_paged_t5.kernels.gated_gelu import gated_gelu_config
from hf_paged_t5.kernels.rmsnorm import rms_norm_warps

CALLS = 24


def gelu_launch(gate, linear, block: int, warps: int) -> torch.Tensor:
    return gated_gelu(gate, linear, config=(block, warps))


def norm_launch(x, r, weight, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(hidden=x, weight=weight, eps=1e-6, residual=r, num_warps=warps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="77,512,1024")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=10240)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("tune_pointwise.py")
    out_dir = common.start_suite(args.out, "pointwise")
    dtype, dev = torch.bfloat16, torch.device("cuda")
    results, table = [], []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        # gated_gelu: reads gate and linear, writes out
        gates = [torch.randn(tokens, args.d_ff, device=dev, dtype=dtype) for _ in range(CALLS)]
        lins = [torch.randn_like(g) for g in gates]
        outs = [torch.empty_like(g) for g in gates]
        nbytes = 3 * gates[0].numel() * 2
        ref = gated_gelu(gates[0], lins[0])
        copy_us = common.graph_us([(lambda i=i: outs[i].copy_(gates[i])) for i in range(CALLS)])
        del outs
        rows = []
        default = gated_gelu_config(gates[0].numel())
        for block, warps in itertools.product((512, 1024, 2048, 4096, 8192), (2, 4, 8, 16)):
            if block // (32 * warps) < 1:
                continue
            assert torch.equal(gelu_launch(gates[0], lins[0], block, warps), ref), (block, warps)
            us = common.graph_us([(lambda i=i: gelu_launch(gates[i], lins[i], block, warps)) for i in range(CALLS)])
            rows.append({"block": block, "num_warps": warps, "us": us, "gbps": nbytes / us / 1e3})
        best = min(rows, key=lambda r: r["us"])
        dflt = next(r for r in rows if (r["block"], r["num_warps"]) == default)
        results.append({"kernel": "gated_gelu", "tokens": tokens, "width": args.d_ff, "copy_2_of_3_bytes_us": copy_us,
                        "default": dflt, "best": best, "configs": rows})
        table.append(("gated_gelu", tokens, args.d_ff, f"{dflt['us']:.2f}", f"{best['us']:.2f}",
                      f"{best['gbps']:.0f}", f"block {best['block']}, {best['num_warps']} warps"))
        del gates, lins
        # rms_norm with the residual: reads x, residual, weight; writes the sum and the normed rows
        xs = [torch.randn(tokens, args.d_model, device=dev, dtype=dtype) for _ in range(CALLS)]
        rs = [torch.randn_like(x) for x in xs]
        weight = torch.rand(args.d_model, device=dev, dtype=dtype) + 0.5
        nbytes = 4 * xs[0].numel() * 2
        ref_out, ref_sum = rms_norm(hidden=xs[0], weight=weight, eps=1e-6, residual=rs[0])
        rows = []
        for warps in (1, 2, 4, 8, 16):
            got_out, got_sum = norm_launch(xs[0], rs[0], weight, warps)
            assert torch.equal(got_out, ref_out) and torch.equal(got_sum, ref_sum), warps
            us = common.graph_us([(lambda i=i: norm_launch(xs[i], rs[i], weight, warps)) for i in range(CALLS)])
            rows.append({"num_warps": warps, "us": us, "gbps": nbytes / us / 1e3})
        best = min(rows, key=lambda r: r["us"])
        dflt = next(r for r in rows if r["num_warps"] == rms_norm_warps(args.d_model))
        results.append({"kernel": "rms_norm+residual", "tokens": tokens, "width": args.d_model, "default": dflt,
                        "best": best, "configs": rows})
        table.append(("rms_norm+residual", tokens, args.d_model, f"{dflt['us']:.2f}", f"{best['us']:.2f}",
                      f"{best['gbps']:.0f}", f"{best['num_warps']} warps"))
        del xs, rs
        torch.cuda.empty_cache()
    common.print_table(("kernel", "tokens", "width", "default us", "best us", "best GB/s", "best config"), table,
                       title=f"µs per call, bf16, {CALLS} calls over distinct tensors in one CUDA graph")
    common.write_json(out_dir / "pointwise.json", {"gpu": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
