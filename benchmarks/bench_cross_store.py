"""The cross K/V store of a layer span: one layered `store_kv` launch against PyTorch's indexed copy.

A call's (or a batch job's encoder chunk's) cross K/V store runs one GEMM over several decoder
layers' packed k/v weights, then writes its output [tokens, layers * 2 * heads * head_dim] into
the pool's layer group at each token's slot (`model.stacks._store_span`). This times that write
alone, in one run on one GPU, at the spans `_store_span` cuts (`CROSS_SPAN_BYTES` of output at
most), for the package's `store_kv` with a layer dimension and for the indexed copy
`dest[:, slots] = y.view(tokens, 2 * layers, heads, head_dim).transpose(0, 1)` that PyTorch runs
per element; both write the same bits (checked). Times are medians of `triton.testing.do_bench`;
GB/s counts the bytes read plus written.

    python benchmarks/bench_cross_store.py [--out DIR] [--quick]

`--quick` runs tiny shapes (on CPU through the Triton interpreter) to check the script itself.
Writes DIR/cross_store.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import os

import torch

import common  # benchmarks/ is on sys.path

# (name, tokens, layers, heads, head_dim): t5-large's 24 layers of 16 x 64 at one 512-token source,
# 64 of them (one layer a span at 64 MiB), and flan-t5-xl's 32 x 64 at 8 sources
CASES = [
    ("t5-large 1 x 512", 512, 24, 16, 64),
    ("t5-large 64 x 512", 32768, 24, 16, 64),
    ("flan-t5-xl 8 x 512", 4096, 24, 32, 64),
]
QUICK_CASES = [("tiny 2 x 7", 14, 3, 2, 8)]


def measure(name: str, tokens: int, layers: int, heads: int, head_dim: int, device, dtype) -> dict:
    from hf_paged_t5.kernels import store_kv

    block_size = 16
    step = common.cross_span_layers(tokens, layers, heads, head_dim, torch.finfo(dtype).bits // 8)
    num_blocks = 2 * tokens // block_size + 2
    group = torch.zeros(step, 2, num_blocks, block_size, heads, head_dim, dtype=dtype, device=device)
    y = torch.randn(tokens, step * 2 * heads * head_dim, device=device).to(dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].sort().values
    slots32, slots64 = slots.to(torch.int32).to(device), slots.to(device)
    kv = y.view(tokens, step, 2, heads, head_dim)

    def layered() -> None:
        store_kv(key=kv[:, :, 0].transpose(0, 1), value=kv[:, :, 1].transpose(0, 1), key_cache=group[:, 0],
                 value_cache=group[:, 1], slot_mapping=slots32)

    def indexed() -> None:
        dest = group.view(step * 2, num_blocks * block_size, heads, head_dim)
        dest[:, slots64] = y.view(tokens, step * 2, heads, head_dim).transpose(0, 1)

    indexed()
    want = group.clone()
    group.zero_()
    layered()
    if not torch.equal(group, want):
        raise SystemExit(f"bench_cross_store.py: {name}: the layered store wrote other bits than the indexed copy")
    moved = 2 * y.numel() * y.element_size()  # read once, written once
    row = {"case": name, "tokens": tokens, "layers_per_span": step, "spans_per_call": -(-layers // step),
           "mb_per_span": moved / 2 / 1e6}
    for label, fn in (("store_kv", layered), ("indexed_copy", indexed)):
        ms = common.kernel_ms(fn)
        row[f"{label}_us"] = ms * 1e3
        row[f"{label}_gb_s"] = moved / ms / 1e6
    row["speedup"] = row["indexed_copy_us"] / row["store_kv_us"]
    row["per_call_saved_ms"] = (row["indexed_copy_us"] - row["store_kv_us"]) * row["spans_per_call"] / 1e3
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for cross_store.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    args = ap.parse_args(argv)
    if args.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, cases = torch.device("cpu"), torch.float32, QUICK_CASES
    else:
        common.require_cuda("bench_cross_store.py")
        device, dtype, cases = torch.device("cuda"), torch.bfloat16, (QUICK_CASES if args.quick else CASES)
    folder = common.start_suite(args.out, "cross_store")
    rows = [measure(*case, device=device, dtype=dtype) for case in cases]
    common.print_table(
        ["case", "layers a span", "spans a call", "MB a span", "store_kv µs", "GB/s", "indexed copy µs", "GB/s",
         "speedup", "ms saved a call"],
        ([r["case"], r["layers_per_span"], r["spans_per_call"], f"{r['mb_per_span']:.1f}", f"{r['store_kv_us']:.1f}",
          f"{r['store_kv_gb_s']:.0f}", f"{r['indexed_copy_us']:.1f}", f"{r['indexed_copy_gb_s']:.0f}",
          f"{r['speedup']:.2f}x", f"{r['per_call_saved_ms']:.3f}"] for r in rows),
        title=f"cross K/V span store, {dtype}, one run on {', '.join(common.gpu_names()) or 'the CPU (Triton interpreter)'}",
    )
    common.write_json(folder / "cross_store.json", {"dtype": str(dtype), "device": str(device), "rows": rows})


if __name__ == "__main__":
    main()
