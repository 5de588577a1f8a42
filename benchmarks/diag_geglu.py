"""The gated feed-forward's middle as one Triton GEMM (`geglu_linear`) against cuBLAS + `gated_gelu`.

    python benchmarks/diag_geglu.py [--shapes xxl:77,512,1024;xl:64,128,512] [--configs ...] [--out DIR]

For each layout and token count: HF's packed `wi_0`/`wi_1` as one cuBLAS GEMM followed by the
package's `gated_gelu` over its two halves (what a patched bf16 model runs), the GEMM alone (the
fused kernel's target), and `geglu_linear` at each launch configuration; 24 layers of distinct
weights in one CUDA graph (no layer's weights stay in L2), µs per layer, the median of 20
replays. Each system's error against float64 math on the same inputs (largest absolute error
over the largest magnitude), HF's op-by-op bf16 chain included. Writes DIR/geglu.json.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path
from hf_paged_t5.kernels import gated_gelu
from hf_paged_t5.kernels.geglu_linear import geglu_config, geglu_linear

LAYERS = 24
LAYOUTS = {"xxl": (4096, 10240), "xl": (2048, 5120), "large": (1024, 2816), "base": (768, 2048)}
CONFIGS = ("128,128,64,8,3;128,64,64,4,4;64,128,64,4,4;64,64,64,4,4;"
           "128,128,64,8,3,tma;128,128,64,8,4,tma;128,64,64,4,4,tma;128,64,64,8,4,tma;64,128,64,4,4,tma;"
           "64,128,64,8,4,tma;64,256,64,8,3,tma;64,64,64,4,4,tma;128,128,128,8,2,tma;64,128,128,4,3,tma")


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def case(layout: str, tokens: int, configs: list) -> list[dict]:
    d_model, d_ff = LAYOUTS[layout]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, d_model, device="cuda", dtype=torch.bfloat16, generator=gen)
    packed = [torch.randn(2 * d_ff, d_model, device="cuda", dtype=torch.bfloat16, generator=gen) * d_model**-0.5
              for _ in range(LAYERS)]
    halves = [w.split(d_ff) for w in packed]

    def cublas_gated(layer):
        y = F.linear(x, packed[layer])
        return gated_gelu(*y.split(d_ff, dim=-1))

    a = x.double() @ halves[0][0].double().T
    b = x.double() @ halves[0][1].double().T
    exact = gelu_tanh(a) * b
    scale = exact.abs().max().item()

    def error(out):
        return (out.double() - exact).abs().max().item() / scale

    hf_chain = (gelu_tanh(F.linear(x, halves[0][0])) * F.linear(x, halves[0][1]))
    rows = [dict(system="cublas+gated_gelu", us=common.graph_us([lambda i=i: cublas_gated(i) for i in range(LAYERS)],
                                                                 replays=20), error=error(cublas_gated(0))),
            dict(system="cublas GEMM alone", us=common.graph_us([lambda i=i: F.linear(x, packed[i]) for i in range(LAYERS)],
                                                                 replays=20)),
            dict(system="HF op-by-op", error=error(hf_chain))]
    default = geglu_config(tokens, d_ff, d_model)
    for cfg in [default] + [c for c in configs if c != default]:
        try:
            fn = [lambda i=i: geglu_linear(x, *halves[i], config=cfg) for i in range(LAYERS)]
            rows.append(dict(system="geglu " + ",".join(map(str, cfg)) + (" (default)" if cfg == default else ""),
                             us=common.graph_us(fn, replays=20), error=error(geglu_linear(x, *halves[0], config=cfg))))
        except Exception as exc:  # a configuration that does not fit the SM's shared memory or registers
            rows.append(dict(system="geglu " + ",".join(map(str, cfg)), failed=f"{type(exc).__name__}: {str(exc)[:200]}"))
    flops = 4 * tokens * d_model * d_ff
    for row in rows:
        row.update(layout=layout, tokens=tokens)
        if row.get("us"):
            row["tflops"] = flops / row["us"] / 1e6
        print(row, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="xxl:77,512,1024;xl:64,128,512,2048")
    ap.add_argument("--configs", default=CONFIGS, help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages;...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_geglu.py")
    out = common.start_suite(args.out, "geglu")
    configs = [tuple(int(v) if v.isdigit() else v for v in c.split(",")) for c in args.configs.split(";") if c]
    rows = []
    for part in args.shapes.split(";"):
        layout, tokens = part.split(":")
        for t in tokens.split(","):
            rows.extend(case(layout, int(t), configs))
            torch.cuda.empty_cache()
    common.write_json(out / "geglu.json", dict(rows=rows, layers=LAYERS, layouts=LAYOUTS))
    common.print_table(["layout", "tokens", "system", "µs per layer", "TFLOP/s", "error"],
                       ([r["layout"], r["tokens"], r["system"], common.fmt(r.get("us"), ".2f") or r.get("failed", ""),
                         common.fmt(r.get("tflops"), ".0f"), common.fmt(r.get("error"), ".2e")] for r in rows),
                       title="gated FF middle, bf16, 24 layers in one CUDA graph")


if __name__ == "__main__":
    main()
