"""What one GEMM over concatenated projection weights buys against separate ones, at encoder sizes.

    python benchmarks/diag_gemm.py [--tokens 77,512,1024] [--d-model 4096] [--d-ff 10240] [--out DIR]

For each token count: a T5 v1.1 XXL layer's q, k and v (three [d_model, d_model] weights) and
its `wi_0` / `wi_1` (two [d_ff, d_model]) as separate `F.linear` calls, as one call over the
concatenated weight, and as separate calls on parallel CUDA streams; 24 layers of distinct
weights (so none of them stays in L2), captured as one CUDA graph, ms per layer (mean of 20
replays after 3). bf16, cuBLAS as torch picks it. Writes DIR/gemm.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path

LAYERS = 24


def graph_ms(body, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # cuBLAS picks and allocates its workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / LAYERS


def parallel(x, weights, streams):
    main = torch.cuda.current_stream()
    outs = []
    for w, s in zip(weights, streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(F.linear(x, w))
    for s in streams:
        main.wait_stream(s)
    return outs


def case(tokens: int, d_model: int, n_out: int, parts: int) -> dict:
    x = torch.randn(tokens, d_model, device="cuda", dtype=torch.bfloat16)
    fused = [torch.randn(parts * n_out, d_model, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    split = [list(w.split(n_out)) for w in fused]
    streams = [torch.cuda.Stream() for _ in range(parts)]
    separate_ms = graph_ms(lambda: [F.linear(x, w) for ws in split for w in ws])
    fused_ms = graph_ms(lambda: [F.linear(x, w) for w in fused])
    streams_ms = graph_ms(lambda: [parallel(x, ws, streams) for ws in split])
    flops = 2 * tokens * d_model * n_out * parts
    return dict(tokens=tokens, n_out=n_out, parts=parts, separate_ms=separate_ms, fused_ms=fused_ms,
                streams_ms=streams_ms, fused_tflops=flops / fused_ms / 1e9, separate_tflops=flops / separate_ms / 1e9)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="77,512,1024")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=10240)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_gemm.py")
    out = common.start_suite(args.out, "gemm")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, n_out, parts in (("q,k,v", args.d_model, 3), ("wi_0,wi_1", args.d_ff, 2)):
            row = dict(case(tokens, args.d_model, n_out, parts), weights=name)
            rows.append(row)
            print(row, flush=True)
    common.write_json(out / "gemm.json", dict(rows=rows, layers=LAYERS))
    common.print_table(["weights", "tokens", "separate ms", "one GEMM ms", "streams ms", "TFLOP/s sep", "TFLOP/s one"],
                       ([r["weights"], r["tokens"], f"{r['separate_ms']:.4f}", f"{r['fused_ms']:.4f}",
                         f"{r['streams_ms']:.4f}", f"{r['separate_tflops']:.0f}", f"{r['fused_tflops']:.0f}"] for r in rows),
                       title="ms per layer, bf16, 24 layers in one CUDA graph")


if __name__ == "__main__":
    main()
