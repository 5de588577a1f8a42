"""T5's non-gated feed-forward with its ReLU as a kernel of its own or in the wi GEMM's epilogue.

    python benchmarks/diag_relu_epilogue.py [--rows 1,4,16,32,64,128,512,4096] [--out DIR]

`wo(relu(wi(x)))` for 24 layers of distinct bf16 weights (t5-large: d_model 1,024, d_ff 4,096;
t5-small's widths: 512, 2,048) replayed in one CUDA graph, µs per replay (`common.graph_us`: the
median of 50 replays): `F.linear` then `torch.relu` (what HF runs) against `torch._addmm_activation` with a zero
bias (cuBLASLt's ReLU epilogue, `kernels.relu_linear`). Also whether the two give the same bits
on the first layer. Writes DIR/relu_epilogue.json (default DIR: benchmarks/results/<date>-<gpu>/).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path (the scripts' import rule)

LAYOUTS = {"t5-large": (1024, 4096), "t5-small widths": (512, 2048)}
LAYERS = 24


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,128,512,4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_relu_epilogue.py", "cuda")
    out = common.start_suite(args.out, "relu_epilogue")
    torch.manual_seed(0)
    rows_out = []
    for layout, (d_model, d_ff) in LAYOUTS.items():
        wi = [torch.randn(d_ff, d_model, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        wo = [torch.randn(d_model, d_ff, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        zero = torch.zeros(d_ff, device="cuda", dtype=torch.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, d_model, device="cuda", dtype=torch.bfloat16)

            def plain():
                for i in range(LAYERS):
                    F.linear(torch.relu(F.linear(x, wi[i])), wo[i])

            def epilogue():
                for i in range(LAYERS):
                    F.linear(torch._addmm_activation(zero, x, wi[i].t()), wo[i])

            same = torch.equal(torch.relu(F.linear(x, wi[0])), torch._addmm_activation(zero, x, wi[0].t()))
            row = dict(layout=layout, rows=rows, plain_us=common.graph_us([plain], replays=50),
                       epilogue_us=common.graph_us([epilogue], replays=50), same_bits=same)
            row["change"] = row["epilogue_us"] / row["plain_us"] - 1
            rows_out.append(row)
            print(f"{layout:16s} rows {rows:5d}: plain {row['plain_us']:8.1f} µs, epilogue {row['epilogue_us']:8.1f} µs "
                  f"({row['change'] * 100:+.1f}%), same bits {same}", flush=True)
    common.write_json(out / "relu_epilogue.json", dict(gpu=torch.cuda.get_device_name(), layers=LAYERS, rows=rows_out))


if __name__ == "__main__":
    main()
