"""What each launch of the fused decode layer costs as one stage of a dependent chain.

`diag_handoff.py` gives the price of a bare stage (a [1024, 1024] GEMV passed on by a dependent
launch: ~1.9 µs on one H200, 0.5 µs of it bytes, and a t5-large batch-1 step ~3.2 µs per launch:
docs/performance.md, "What one dependent stage costs", 2026-12-04); this finds where the rest goes. Each kind of the fused layer's launches (`model/fused_layer.py`)
runs as a chain of `--launches` launches in one CUDA graph, each a programmatic dependent launch
reading the output of the one before, with distinct weights per launch (as distinct layers have)
and the step's launch options:

- qkv: RMSNorm + q/k/v (three weights, K/V stored at a slot), the next reading q;
- o: o projection + residual add (early residual);
- q: RMSNorm + cross-attention's q projection;
- ff: RMSNorm + wi (+ ReLU or the gated GELU) and wo + residual, alternating (µs per launch);
- self / cross: decode attention over `--self-keys` / `--keys` keys of each row (self: the
  causal bias table, "past"; cross: "all"), on the step's tickets, each query the output of
  the attention before.

µs per launch = the median of the replays' GPU time / launches; beside it, the launch's
weight and K/V bytes at the copy bandwidth measured in the run.

    python benchmarks/diag_stages.py [--layouts t5-large,flan-t5-xl] [--rows 1] [--launches 48]

Writes stages.json (with env.json) under --out or benchmarks/results/<date>-<gpu>/.
"""

from __future__ import annotations

import argparse

import torch

import common  # benchmarks/ is on sys.path

KINDS = ("qkv", "o", "q", "ff", "self", "cross")


def shape_of(layout: str) -> dict:
    from hf_paged_t5 import tiny

    s = tiny.SHAPES[layout]
    return dict(d_model=s["d_model"], d_ff=s["d_ff"], heads=s["num_heads"], head_dim=s["d_kv"],
                gated=s["feed_forward_proj"].startswith("gated"))


def chain(kind: str, shape: dict, rows: int, launches: int, keys: int, device, pdl: bool = True):
    """(a function launching the chain once, the bytes one launch reads from weights and K/V)."""
    from hf_paged_t5.kernels import fused_linear, paged_decode

    g = torch.Generator().manual_seed(0)
    d, ff, heads, hd = shape["d_model"], shape["d_ff"], shape["heads"], shape["head_dim"]
    inner = heads * hd
    dtype = torch.bfloat16

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(dtype).to(device)

    x0 = rand(rows, d)
    norm = rand(d, scale=0.1) + 1
    residual = rand(rows, d)
    if kind in ("self", "cross"):
        block_size = 16
        blocks = -(-keys // block_size)
        cache = [rand(rows * blocks + 1, block_size, heads, hd) for _ in range(2)]
        table = torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks)
        seq_lens = torch.full((rows,), keys, dtype=torch.int32, device=device)
        tickets = torch.zeros(rows * heads, dtype=torch.int32, device=device)
        bias = dict(bias_table=torch.randn(heads, 129, generator=g).to(device)) if kind == "self" else {}
        q0 = rand(rows, heads, hd)

        def run():
            q = q0
            for _ in range(launches):
                q = paged_decode(query=q, key_cache=cache[0], value_cache=cache[1], block_table=table,
                                         seq_lens=seq_lens, scale=1.0, pdl=pdl, tickets=tickets,
                                         keys_ready="past" if kind == "self" else "all", **bias)
            return q
        return run, 2 * rows * keys * inner * 2

    if kind == "qkv":
        ws = [[rand(inner, d, scale=d**-0.5) for _ in range(3)] for _ in range(launches)]
        cache = [torch.zeros(rows * 4, 1, heads, hd, dtype=dtype, device=device) for _ in range(2)]
        slots = torch.arange(rows, dtype=torch.int32, device=device)
        if inner != d:
            raise ValueError(f"qkv chains q into the next launch's input: heads * d_kv ({inner}) must be d_model ({d})")

        def run():
            x = x0
            for w in ws:
                x = fused_linear(x=x, weights=w, norm_weight=norm, eps=1e-6, key_cache=cache[0],
                                         value_cache=cache[1], slot_mapping=slots, pdl=pdl, early_inputs=True)
            return x
        return run, 3 * inner * d * 2
    if kind in ("o", "q"):
        ws = [rand(d, d, scale=d**-0.5) for _ in range(launches)]
        kw = dict(residual=residual, early_inputs=True) if kind == "o" else dict(norm_weight=norm, eps=1e-6)

        def run():
            x = x0
            for w in ws:
                x = fused_linear(x=x, weights=(w,), pdl=pdl, **kw)
            return x
        return run, d * d * 2
    if kind == "ff":
        pairs = [([rand(ff, d, scale=d**-0.5) for _ in range(2 if shape["gated"] else 1)], rand(d, ff, scale=ff**-0.5))
                 for _ in range(launches // 2)]
        act = "gelu_tanh" if shape["gated"] else "relu"

        def run():
            x = x0
            for wi, wo in pairs:
                h = fused_linear(x=x, weights=wi, norm_weight=norm, eps=1e-6, activation=act, pdl=pdl)
                x = fused_linear(x=h, weights=(wo,), residual=residual, pdl=pdl, early_inputs=True)
            return x
        return run, (len(pairs[0][0]) + 1) * ff * d * 2 / 2
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="t5-large,flan-t5-xl")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--launches", type=int, default=48, help="launches per chain (even: ff alternates two)")
    ap.add_argument("--keys", type=int, default=512, help="keys of each row for cross")
    ap.add_argument("--self-keys", type=int, default=128, help="keys of each row for self")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_stages.py")
    kinds = [k for k in args.kinds.split(",") if k]
    device = torch.device("cuda")
    bandwidth = common.copy_bandwidth(device, 1 << 30)  # GB/s
    rows = []
    for layout in filter(None, args.layouts.split(",")):
        shape = shape_of(layout)
        for kind in kinds:
            keys = args.self_keys if kind == "self" else args.keys
            run, nbytes = chain(kind, shape, args.rows, args.launches, keys, device)
            us = common.graph_us([run], args.replays) / args.launches
            rows.append(dict(layout=layout, kind=kind, rows=args.rows, us_per_launch=us,
                             bytes_us=nbytes / bandwidth * 1e-3))
            print(f"{layout} {kind}: {us:.2f} us per launch (bytes {rows[-1]['bytes_us']:.2f})", flush=True)
            del run
            torch.cuda.empty_cache()
    folder = common.start_suite(args.out, "stages")
    common.print_table(["layout", "launch", "µs per launch", "bytes at copy bandwidth µs"],
                       [[r["layout"], r["kind"], f"{r['us_per_launch']:.2f}", f"{r['bytes_us']:.2f}"] for r in rows],
                       title=f"{args.rows} row(s), chains of {args.launches} dependent launches in one CUDA graph")
    common.write_json(folder / "stages.json", dict(rows_per_launch=args.rows, launches=args.launches, keys=args.keys,
                                                   self_keys=args.self_keys,
                                                   copy_bandwidth_gbs=bandwidth, rows=rows,
                                                   environment=common.environment()))


if __name__ == "__main__":
    main()
