"""A decode step's GEMMs on cuBLAS and on cuBLASLt, at the row counts a step runs.

    python benchmarks/diag_blas.py [--rows 64,128,321,512] [--shapes t5-large,flan-t5-xl] [--out DIR]

For each row count and each projection of a decoder layer of the layout (packed q/k/v, o and
the cross q, wi (wi_0 and wi_1 packed for a gated layout), wo; the LM head), µs per call of
`layers` distinct weights (the LM head: 4) replayed in one CUDA graph (`common.graph_us`), bf16:
  - `linear`: `F.linear(x, w)`, what the op-by-op step runs (cuBLAS as torch picks it);
  - `addmm`: `torch.addmm(zero_bias, x, w.T)`, the cuBLASLt call with a bias epilogue that
    `relu_linear` uses for its ReLU epilogue;
  - `lt`: `F.linear` with `torch.backends.cuda.preferred_blas_library("cublaslt")` (this process
    only; set back to cuBLAS after each row).
A graphed batch-job step runs at the power-of-two bucket of its rows (`decode.graphs.bucket`):
321 live rows run 512-row GEMMs. Writes DIR/blas.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path
from hf_paged_t5 import tiny

LM_HEAD_LAYERS = 4  # the LM head's weight is large: fewer copies keep the run short


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (in features, out features) of the decode step's GEMMs of `shape` (a `tiny` layout)."""
    c = tiny.build_config(shape)
    inner, d_ff = c.num_heads * c.d_kv, c.d_ff * (2 if c.is_gated_act else 1)
    return {"q,k,v": (c.d_model, 3 * inner), "o / cross q": (c.d_model, inner), "wi": (c.d_model, d_ff),
            "wo": (c.d_ff, c.d_model), "lm_head": (c.d_model, c.vocab_size)}


def row(rows: int, k: int, n: int, layers: int, device: torch.device) -> dict:
    dtype = torch.bfloat16
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    xs = [torch.randn(rows, k, device=device, dtype=dtype) for _ in range(layers)]
    zero = torch.zeros(n, device=device, dtype=dtype)
    linear = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
    addmm = [lambda x=x, w=w: torch.addmm(zero, x, w.t()) for x, w in zip(xs, weights)]
    result = dict(linear_us=common.graph_us(linear), addmm_us=common.graph_us(addmm))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        result["lt_us"] = common.graph_us(linear)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,321,512")
    ap.add_argument("--shapes", default="t5-large,flan-t5-xl")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_blas.py")
    out = common.start_suite(args.out, "blas")
    device = torch.device("cuda")
    results = []
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for name, (k, n) in projections(shape).items():
                layers = LM_HEAD_LAYERS if name == "lm_head" else args.layers
                results.append(dict(shape=shape, rows=rows, gemm=name, k=k, n=n, **row(rows, k, n, layers, device)))
                print(results[-1], flush=True)
    common.write_json(out / "blas.json", dict(gpu=torch.cuda.get_device_name(), dtype="bfloat16", rows=results))
    common.print_table(["layout", "rows", "GEMM", "K x N", "F.linear µs", "addmm µs", "cuBLASLt µs"],
                       ([r["shape"], r["rows"], r["gemm"], f"{r['k']} x {r['n']}", f"{r['linear_us']:.2f}",
                         f"{r['addmm_us']:.2f}", f"{r['lt_us']:.2f}"] for r in results),
                       title="µs per call, bf16, distinct weights in one CUDA graph")


if __name__ == "__main__":
    main()
