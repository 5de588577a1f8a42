"""Decode attention over many rows, per launch config (what BatchGenerator's and a wide batch's steps run).

BatchGenerator's rows hold encoder outputs of 20-2,000 tokens (the bench_batch.py workload: a
log-normal around 160) and 1-200 generated tokens. With one key split per (row, head) the few
long rows finish last while most of the GPU idles; this times the default launch against more
splits (short rows' extra splits exit at once), against the pipeline depths of the key loop
(async copies 1-3 deep, the register prefetch "tile"), and rows in random order against longest
first (the grid launches rows in order, so that is longest-processing-time-first scheduling).
Cases: `cross` (the 20-2,000-key mix, no bias), `self` (a 1-200-key mix with T5's causal bias
table), `uniform` (the shapes of --uniform, cross-attention of a wide generate() batch) and
`beams` (the shapes of --beams: sources x beams rows over one table per source, as a beam
search's cross-attention reads its source's keys once per beam; against `uniform` at the same row
count and at the source count it says what the shared keys save; it also times `grouped_decode`,
which reads them once per source: its default and, unless --configs default, its tile / split /
warp variants, merging splits on tickets as a step does). It prints µs per call in a CUDA graph
and the K/V bandwidth reached (K/V bytes counted once per source).

--layouts slot-major,head-major also times each case over a pool whose memory is [block, head,
slot, dim] (the kernels read the pool through its strides; the package's pool is [block, slot,
head, dim], where a head's key is 128 bytes at a num_heads * 128-byte stride, and head-major puts
a block's keys of one head in one run of block_size * 128 bytes).

    python benchmarks/tune_mixed_decode.py [--rows 512,256,64] [--kinds cross,self,uniform,beams]
        [--uniform 40x512,64x512,128x512,64x2048] [--beams 1x4x512,8x4x512] [--orders random,longest-first]
        [--configs all|few|depths|tiles|default] [--layouts slot-major,head-major] [--out DIR] [--quick]

Writes DIR/mixed-decode.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import random

import torch

import common  # benchmarks/ is on sys.path
from hf_paged_t5 import reference
from hf_paged_t5.kernels import paged_decode
from hf_paged_t5.kernels.decode import DecodeConfig, decode_config, grouped_config, grouped_decode

HEADS, HEAD_DIM, BLOCK_SIZE = 16, 64, 16


def lengths(rows: int, seed: int, median: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max(round(rng.lognormvariate(0, 1.0) * median), low), high) for _ in range(rows)]


LAYOUTS = ("slot-major", "head-major")


def pool(blocks: int, layout: str, device, dtype) -> torch.Tensor:
    """Random K or V blocks, shape [blocks, BLOCK_SIZE, HEADS, HEAD_DIM] in either memory layout."""
    if layout == "head-major":
        return torch.randn(blocks, HEADS, BLOCK_SIZE, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device=device, dtype=dtype)


def paged(lens: list[int], device, dtype, layout: str = "slot-major", group: int = 1):
    """K/V pools, a shuffled block table and seq_lens for rows of `lens` keys; each run of `group`
    consecutive rows shares one table row (a beam search's rows of one source; their lens alike)."""
    per_row = [-(-n // BLOCK_SIZE) for n in lens[::group]]
    blocks = sum(per_row) + 1
    key, value = pool(blocks, layout, device, dtype), pool(blocks, layout, device, dtype)
    ids = torch.randperm(blocks, device="cpu").tolist()
    table = torch.zeros(len(per_row), max(per_row), dtype=torch.int32)
    for row, n in enumerate(per_row):
        table[row, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    table = table.repeat_interleave(group, dim=0)
    return key, value, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def cases(args) -> list[tuple[str, str, list[int], int]]:
    """(kind, order, key counts per row, rows per table row) of each timed case."""
    quick = args.quick
    mixes = {"cross": (24, 4, 120) if quick else (160, 20, 2000), "self": (8, 1, 30) if quick else (60, 1, 200)}
    out = []
    for kind in args.kinds.split(","):
        if kind == "uniform":
            for shape in (args.uniform or ("3x20,5x40" if quick else "40x512,64x512,128x512,64x2048")).split(","):
                rows, keys = (int(v) for v in shape.split("x"))
                out.append((kind, "random", [keys] * rows, 1))
            continue
        if kind == "beams":
            for shape in (args.beams or ("2x3x20" if quick else "1x4x512,8x4x512,16x4x512")).split(","):
                parts = shape.split("x")
                if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                    raise SystemExit(f"--beams takes SOURCESxBEAMSxKEYS shapes of positive ints, got {shape!r}")
                sources, beams, keys = (int(v) for v in parts)
                out.append((kind, f"{sources} sources x {beams} beams", [keys] * (sources * beams), beams))
            continue
        if kind not in mixes:
            raise SystemExit(f"--kinds: unknown kind {kind!r} (cross, self, uniform, beams)")
        for rows, order in ((int(r), o) for r in args.rows.split(",") for o in args.orders.split(",")):
            lens = lengths(rows, 0, *mixes[kind])
            if order != "random":  # the grid launches rows in order: longest first is LPT scheduling
                lens = sorted(lens, reverse=order == "longest-first")
            out.append((kind, order, lens, 1))
    return out


def configs_for(which: str, default: DecodeConfig) -> dict:
    if which == "default":
        return {"default": default}
    configs = {"default": default, "tile": DecodeConfig(block_n=128, num_warps=4)}
    if which == "tiles":  # the async-copy loop's tile, warps and depth around the default
        for block_n, warps, depth in ((32, 1, 2), (32, 2, 2), (64, 2, 1), (64, 2, 2), (64, 4, 1), (64, 4, 2),
                                      (64, 4, 3), (128, 4, 1), (128, 4, 2), (128, 8, 1), (128, 8, 2), (256, 8, 1),
                                      (256, 8, 2)):
            configs[f"async {block_n} keys, {warps} warps, {depth} deep"] = DecodeConfig(
                block_n=block_n, num_warps=warps, num_stages=depth, prefetch="async")
        return configs
    for depth in (1, 2, 3):
        configs[f"async {depth} deep"] = DecodeConfig(block_n=128, num_warps=4, num_stages=depth, prefetch="async")
    if which == "depths":
        return configs
    for splits in (2, 4, 8, 16) if which == "all" else (2, 4):
        configs[f"splits {splits}"] = DecodeConfig(block_n=128, num_warps=4, num_splits=splits)
        configs[f"splits {splits} fused"] = DecodeConfig(block_n=128, num_warps=4, num_splits=splits,
                                                         fused_combine=True)
    if which == "all":
        configs["splits 4, 64-key tiles"] = DecodeConfig(block_n=64, num_warps=4, num_splits=4)
    return configs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="512,256,64", help="row counts of the cross / self mixes")
    ap.add_argument("--kinds", default="cross,self,uniform", help="cases to time: cross, self, uniform, beams")
    ap.add_argument("--uniform", default=None,
                    help="ROWSxKEYS shapes of the uniform case (default 40x512,64x512,128x512,64x2048)")
    ap.add_argument("--beams", default=None,
                    help="SOURCESxBEAMSxKEYS shapes of the beams case (default 1x4x512,8x4x512,16x4x512)")
    ap.add_argument("--orders", default="random,longest-first,shortest-first",
                    help="row orders to time (the kernel's grid follows the rows)")
    ap.add_argument("--configs", default="all",
                    help="'all' (default: pipeline depths, splits 2-16 fused or not), 'few' (depths, "
                         "splits 2 and 4), 'depths' (the default, tile, async 1-3 deep), 'tiles' (the async "
                         "loop at 32-256-key tiles, 1-8 warps, 1-3 deep) or 'default' alone")
    ap.add_argument("--layouts", default="slot-major",
                    help="pool memory layouts to time each case over: slot-major (the package's), head-major")
    ap.add_argument("--out", default=None,
                    help="folder for mixed-decode.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU ok)")
    args = ap.parse_args(argv)
    if args.configs not in ("all", "few", "depths", "tiles", "default"):
        raise SystemExit(f"--configs must be all, few, depths, tiles or default, got {args.configs!r}")
    layouts = args.layouts.split(",")
    if any(layout not in LAYOUTS for layout in layouts):  # "" included
        raise SystemExit(f"--layouts takes a comma-separated list of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    todo = cases(args)
    if not args.quick:
        common.require_cuda("tune_mixed_decode.py (without --quick)")
    out = common.start_suite(args.out, "mixed-decode")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gbps = common.copy_bandwidth(device, 1 << 30) if device.type == "cuda" else float("nan")
    report = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "copy_gbps": gbps, "rows": []}
    for (kind, order, lens, group), layout in ((case, layout) for case in todo for layout in layouts):
        rows = len(lens)
        key, value, table, seq_lens = paged(lens, device, dtype, layout, group)
        query = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=dtype)
        # self-attention: T5's causal distance table (128 buckets' worth of distances)
        bias = torch.randn(HEADS, 129, device=device, dtype=dtype) if kind == "self" else None
        kv_bytes = 2 * sum(lens[::group]) * HEADS * HEAD_DIM * key.element_size()  # once per table row
        ref = reference.paged_decode(query.float(), key.float(), value.float(), table, seq_lens,
                                     bias_table=None if bias is None else bias.float())
        sms = common.num_sms(device)
        configs = configs_for(args.configs, decode_config(rows, HEADS, HEAD_DIM, max(lens), sms))
        grouped = {}
        if group > 1:  # the grouped kernel: one program per (head, source, split) reads the keys once, the
            # split partials merged in-kernel on tickets, as a decode step launches it
            grouped["grouped default"] = grouped_config(-(-rows // group), HEADS, HEAD_DIM, max(lens), sms)
            if args.configs != "default":
                for block_n, splits, warps in ((64, 1, 4), (64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 1, 8), (32, 4, 4)):
                    grouped[f"grouped {block_n}x{splits}, {warps} warps"] = DecodeConfig(
                        block_n=block_n, num_warps=warps, num_splits=splits)
        tickets = torch.zeros(rows * HEADS, dtype=torch.int32, device=device)
        print(f"{kind}: {rows} rows ({order}, {layout}), keys {min(lens)}..{max(lens)} (mean {sum(lens) / rows:.0f}), "
              f"K+V {kv_bytes / 2**20:.1f} MiB; copy {gbps:.0f} GB/s; default {configs['default']}", flush=True)
        for name, config in [*configs.items(), *grouped.items()]:
            kw = dict(query=query, key_cache=key, value_cache=value, block_table=table, seq_lens=seq_lens,
                      max_seq_len=max(lens), config=config)
            if name in grouped:
                fn = lambda kw=kw: grouped_decode(**kw, group=group, tickets=tickets)  # noqa: E731
            else:
                fn = lambda kw=kw: paged_decode(**kw, bias_table=bias)  # noqa: E731
            knobs = config.__dict__.copy()
            err = float((fn().float() - ref).norm() / ref.norm())
            us = common.graph_us([fn] * 4)
            row = dict(kind=kind, rows=rows, rows_per_table_row=group, order=order, layout=layout, config=name,
                       knobs=knobs, us=us, rel_err=err, pct_of_copy=100 * kv_bytes / (us * 1e3) / gbps)
            report["rows"].append(row)
            print(f"  {name:<24} {us:8.1f} us  {row['pct_of_copy']:5.1f}% of copy  err {err:.1e}", flush=True)
    common.write_json(out / "mixed-decode.json", report)


if __name__ == "__main__":
    main()
