"""The batch engine's encoder for one lone input (what a server admits between two decode steps):
the eager packed forward against the bucket graph, in time and in error.

    python benchmarks/diag_batch_encode.py [--shape t5-large] [--lengths 32,200,500,1030,1100,1200,2000,3000]
        [--calls 20] [--out DIR]

A random-weight model at `--shape` (bf16) and the same weights in fp32. Per input length, after 3
warm-up calls of each path (the bucket's graph is captured in them): host ms (until the call
returns: what the engine's thread spends, while every running request's next decode step waits)
and wall ms (until the GPU is done), medians of `--calls`; and each path's output against the fp32
model's packed encoder output (max |error| over the tokens, relative to the reference's max |value|),
next to stock HF bf16's own error on the same input. Writes DIR/batch_encode.json (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import time

import torch

import common  # benchmarks/ is on sys.path


def timed(fn, ids, calls: int) -> tuple[float, float, torch.Tensor]:
    host, wall = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = fn(ids)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        host.append(returned - start)
        wall.append(time.perf_counter() - start)
    return 1e3 * sorted(host)[calls // 2], 1e3 * sorted(wall)[calls // 2], out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="t5-large", help="tiny.SHAPES layout (default t5-large)")
    ap.add_argument("--lengths", default="32,200,500,1030,1100,1200,2000,3000", help="input lengths, comma-separated")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per path and length (default 20)")
    ap.add_argument("--out", default=None, help="folder for batch_encode.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if not lengths or min(lengths) < 1 or args.calls < 1:
        ap.error("--lengths: positive integers; --calls: at least 1")
    common.require_cuda("diag_batch_encode.py")
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    out = common.start_suite(args.out, "batch_encode")
    stock = tiny.build_model(args.shape, dtype=torch.bfloat16, device="cuda")
    reference = tiny.build_model(args.shape, dtype=torch.float32, device="cuda")
    model = hp.patch_model(tiny.build_model(args.shape, dtype=torch.bfloat16, device="cuda"))
    eager, graphed = common.batch_encode_paths(model)
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(2, model.config.vocab_size, (n,), generator=generator).tolist()
            x = torch.tensor([ids], device="cuda")
            want = reference.get_encoder()(x)[0][0]
            scale = want.abs().max().item()

            def error(y: torch.Tensor) -> float:
                return (y.float() - want).abs().max().item() / scale

            row = dict(tokens=n, stock_bf16_error=error(stock.get_encoder()(x)[0][0]))
            for name, fn in (("eager", eager), ("graph", graphed)):
                for _ in range(3):
                    fn(ids)
                host, wall, y = timed(fn, ids, args.calls)
                row[name] = None if y is None else dict(host_ms=host, wall_ms=wall, error=error(y))
            rows.append(row)
            cells = [f"{k} host {v['host_ms']:.2f} wall {v['wall_ms']:.2f} ms error {v['error']:.3g}"
                     for k, v in row.items() if isinstance(v, dict)]
            print(f"{n} tokens: stock bf16 error {row['stock_bf16_error']:.3g} | " + " | ".join(cells), flush=True)
    common.write_json(out / "batch_encode.json", dict(shape=args.shape, dtype="bfloat16", calls=args.calls,
                                                      rows=rows, graphs=hp.runtime_stats(model)))


if __name__ == "__main__":
    main()
