"""Benchmark the Triton kernels against HF's eager T5 attention math and torch SDPA.

    python benchmarks/bench_kernels.py [--out DIR] [--tuned TUNE.json] [--quick]

Measured in one run on one GPU:
- copy bandwidth: a large device-to-device copy, (bytes read + written) / time;
- paged decode (batch 64 x 2048 keys, batch 1 x 16k keys; t5-large-like 16 heads x 64, bf16)
  with the causal bias table, vs (a) HF's eager math on contiguous KV with a materialized bias
  (matmul + bias + fp32 softmax + matmul) and (b) SDPA with the bias as attn_mask; achieved
  bandwidth = bytes of K + V read / time, also as % of copy bandwidth; paged decode and SDPA
  also per call inside a CUDA graph (`*_graph`: no Python launch cost in the time);
- the two attention calls of a batch-1 t5-large decode step (self: 128 keys + bias table,
  cross: 512 keys), timed per call inside a CUDA graph with cold K/V, as the step runs them;
- encoder prefill (16 x 512, 4 x 2048, 1 x 8192 tokens) with the bidirectional bias table vs
  SDPA (and HF eager where it fits) with the materialized [1, heads, L, L] bias; prefill and
  SDPA also per call inside a CUDA graph (`*_graph`), so neither pays a Python launch cost;
- the host cost of one `prefill` / `paged_decode` call (argument checks and launch, measured
  on tiny inputs: what do_bench adds when the GPU outruns the host).
With `--tuned` (a tune_kernels.py JSON), the best configs it found for the same shapes (batch,
length, head_dim) run too (`*_tuned` rows), next to the defaults.
Baselines get their bias materialized once outside the timed region (HF rebuilds it every
forward, so they are timed at their best). Times are medians of `triton.testing.do_bench`.
`--quick` runs tiny shapes (on CPU through the Triton interpreter) to check the script itself.
Writes DIR/kernels.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import common  # noqa: E402  (benchmarks/ is on sys.path)
from hf_paged_t5.kernels import paged_decode, prefill  # noqa: E402
from hf_paged_t5.kernels.decode import DecodeConfig  # noqa: E402
from hf_paged_t5.kernels.prefill import PrefillConfig, prefill_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hf_eager_attention(q, k, v, bias):
    """T5Attention's math: q/k/v [batch, heads, L, D], bias [1|batch, heads, Lq, Lk]; no 1/sqrt(d)."""
    scores = torch.matmul(q, k.transpose(3, 2))
    scores += bias
    weights = F.softmax(scores.float(), dim=-1).type_as(scores)
    return torch.matmul(weights, v)


def sdpa_attention(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)


def host_us(fn, calls: int = 200) -> float:
    """Host µs per call of `fn` whose GPU work is tiny (so the launch queue never fills)."""
    if not torch.cuda.is_available():
        return float("nan")
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def tuned_configs(path) -> dict:
    """The best configs in a tune_kernels JSON: {("decode", batch, keys, head_dim, bias table?)
    or ("prefill", batch, length, head_dim, True): config}."""
    if path is None:
        return {}
    if not path.exists():
        print(f"--tuned {path} does not exist (did the sweep fail?): defaults only", flush=True)
        return {}
    result = json.loads(path.read_text())
    configs = {}
    for section, cls, length in (("decode", DecodeConfig, "keys"), ("prefill", PrefillConfig, "length")):
        for row in result.get(section, []):
            shape = row["shape"]
            if row.get("best"):
                key = (section, shape["batch"], shape[length], shape["head_dim"], shape.get("bias", True))
                configs[key] = cls(**row["best"]["config"])
    return configs


def decode_case(batch, keys, args, device, copy_gbps):
    """Paged decode of `batch` rows with `keys` keys each, against contiguous-KV baselines."""
    dtype, heads, head_dim, block_size = DTYPES[args.dtype], args.heads, args.head_dim, args.block_size
    blocks_per_row = triton.cdiv(keys, block_size)
    num_blocks = batch * blocks_per_row
    # [num_blocks, block_size, num_heads, head_dim], rows scattered over shuffled blocks.
    key_cache = torch.randn(num_blocks, block_size, heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_row)
    seq_lens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    table = torch.randn(heads, 129, device=device)  # causal table, max_distance 128

    # Contiguous copies for the baselines: [batch, heads, keys, head_dim].
    ids = block_table.long()
    k = key_cache[ids].reshape(batch, blocks_per_row * block_size, heads, head_dim)[:, :keys].transpose(1, 2)
    v = value_cache[ids].reshape(batch, blocks_per_row * block_size, heads, head_dim)[:, :keys].transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()
    q = query[:, :, None, :]
    distance = (keys - 1 - torch.arange(keys, device=device)).clamp(max=128)
    bias = table[:, distance][None, :, None, :].to(dtype)  # [1, heads, 1, keys] as HF builds it

    kv_bytes = 2 * batch * keys * heads * head_dim * key_cache.element_size()
    decode = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                  seq_lens=seq_lens, scale=1.0, bias_table=table)  # fmt: skip
    timings = {
        "paged_decode": common.kernel_ms(lambda: paged_decode(**decode)),
        "paged_decode_no_split": common.kernel_ms(lambda: paged_decode(**decode, num_splits=1)),
        "hf_eager": common.kernel_ms(lambda: hf_eager_attention(q, k, v, bias)),
        "sdpa": common.kernel_ms(lambda: sdpa_attention(q, k, v, bias)),
    }
    if device.type == "cuda":
        # do_bench times each call with its Python launch cost (tens of µs with the split's
        # combine launch), which hides the kernel at 1 x 16k keys; in a graph it does not.
        timings["paged_decode_graph"] = common.graph_us([lambda: paged_decode(**decode)] * 3) / 1e3
        timings["sdpa_graph"] = common.graph_us([lambda: sdpa_attention(q, k, v, bias)] * 3) / 1e3
        tuned = args.tuned.get(("decode", batch, keys, head_dim, True))
        if tuned is not None:
            tuned_calls = [lambda: paged_decode(**decode, config=tuned)] * 3
            timings["paged_decode_tuned_graph"] = common.graph_us(tuned_calls) / 1e3
    row = {"kind": "decode", "batch": batch, "keys": keys, "kv_bytes": kv_bytes, "ms": timings}
    row["gbps"] = {name: kv_bytes / ms / 1e6 for name, ms in timings.items()}
    row["pct_of_copy"] = {name: 100 * gbps / copy_gbps for name, gbps in row["gbps"].items()}
    return row


def step_decode_case(name, keys, capacity, bias, args, device):
    """One attention call of a batch-1 decode step as the step runs it: in a CUDA graph, cold KV.

    The graph holds many calls, each on its own rows of the pool, together twice the L2 size,
    so every call reads its K/V from memory as it would between the step's other kernels.
    """
    dtype, heads, head_dim, block_size = DTYPES[args.dtype], args.heads, args.head_dim, args.block_size
    per_row = triton.cdiv(keys, block_size)
    kv_bytes = 2 * keys * heads * head_dim * torch.finfo(dtype).bits // 8
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) if device.type == "cuda" else 0
    copies = max(2, min(256, triton.cdiv(2 * l2, kv_bytes)))
    key_cache = torch.randn(copies * per_row, block_size, heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.zeros(copies, 1, triton.cdiv(capacity, block_size), dtype=torch.int32, device=device)
    tables[:, :, :per_row] = torch.randperm(copies * per_row, device=device).to(torch.int32).view(copies, 1, per_row)
    seq_lens = torch.full((1,), keys, dtype=torch.int32, device=device)
    query = torch.randn(1, heads, head_dim, device=device, dtype=dtype)
    extra = {"bias_table": torch.randn(heads, 129, device=device)} if bias else {}
    calls = [
        (lambda i=i, **kw: paged_decode(query, key_cache, value_cache, tables[i], seq_lens, scale=1.0, **extra, **kw))
        for i in range(copies)
    ]
    row = {"kind": "step", "name": name, "keys": keys, "capacity": capacity, "kv_bytes": kv_bytes}
    row["graph_us"] = common.graph_us(calls)
    tuned = args.tuned.get(("decode", 1, keys, head_dim, bias))
    if tuned is not None:
        row["tuned_graph_us"] = common.graph_us([(lambda call=call: call(config=tuned)) for call in calls])
    return row


def prefill_case(batch, length, args, device):
    """Encoder (bidirectional) prefill of `batch` sequences of `length` tokens."""
    dtype, heads, head_dim = DTYPES[args.dtype], args.heads, args.head_dim
    total = batch * length
    query, key, value = (torch.randn(total, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    cu_seqlens = torch.arange(0, total + 1, length, dtype=torch.int32, device=device)
    table = torch.randn(heads, 257, device=device)  # bidirectional table, max_distance 128 (fp32, as patched)

    q, k, v = (t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (query, key, value))
    pos = torch.arange(length, device=device)
    index = (pos[None, :] - pos[:, None]).clamp(-128, 128) + 128
    bias = table[:, index][None].to(dtype)  # [1, heads, L, L] as HF builds it

    ours = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=length, bias_table=table)
    default = prefill_config(head_dim, dtype, length)
    # the band-tile and gather variants of the default tiles, whichever the default is
    variants = {"prefill_band": dataclasses.replace(default, band_tiles=True, toeplitz=False),
                "prefill_gather": dataclasses.replace(default, band_tiles=False)}
    timings = {
        "prefill": common.kernel_ms(lambda: prefill(**ours)),
        "sdpa": common.kernel_ms(lambda: sdpa_attention(q, k, v, bias)),
    }
    for name, config in variants.items():
        timings[name] = common.kernel_ms(lambda config=config: prefill(**ours, config=config))
    tuned = args.tuned.get(("prefill", batch, length, head_dim, True))
    if tuned is not None:
        timings["prefill_tuned"] = common.kernel_ms(lambda: prefill(**ours, config=tuned))
    if device.type == "cuda":
        # Both per call in a CUDA graph (no Python launch cost in either number).
        timings["prefill_graph"] = common.graph_us([lambda: prefill(**ours)] * 3) / 1e3
        timings["sdpa_graph"] = common.graph_us([lambda: sdpa_attention(q, k, v, bias)] * 3) / 1e3
        for name, config in variants.items():
            timings[name + "_graph"] = common.graph_us([lambda config=config: prefill(**ours, config=config)] * 3) / 1e3
        if tuned is not None:
            timings["prefill_tuned_graph"] = common.graph_us([lambda: prefill(**ours, config=tuned)] * 3) / 1e3
    # HF eager materializes [batch, heads, L, L] fp32 scores; skip it where that passes ~8 GB.
    if batch * heads * length * length * 4 <= 8 * 2**30:
        timings["hf_eager"] = common.kernel_ms(lambda: hf_eager_attention(q, k, v, bias))
    flops = 4 * batch * heads * length * length * head_dim
    row = {"kind": "prefill", "batch": batch, "length": length, "ms": timings}
    row["tflops"] = {name: flops / ms / 1e9 for name, ms in timings.items()}
    return row


def host_case(args, device):
    """Host µs of one `prefill` and one `paged_decode` call on tiny inputs (checks + launch)."""
    dtype, heads, head_dim = DTYPES[args.dtype], args.heads, args.head_dim
    qkv = [torch.randn(16, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
    cu_seqlens = torch.tensor([0, 16], dtype=torch.int32, device=device)
    table = torch.randn(heads, 257, device=device)
    cache = torch.randn(2, args.block_size, heads, head_dim, device=device, dtype=dtype)
    block_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    causal_table = torch.randn(heads, 129, device=device)
    return {
        "kind": "host",
        "us": {
            "prefill": host_us(lambda: prefill(*qkv, cu_seqlens, 16, bias_table=table)),
            "paged_decode": host_us(
                lambda: paged_decode(qkv[0][:1], cache, cache, block_table, seq_lens, bias_table=causal_table)
            ),
        },
    }


def table_rows(result: dict):
    """[case, impl, ms, GB/s, % copy, TFLOP/s, speedup] per timing of `result`'s rows."""
    for row in result["rows"]:
        if row["kind"] == "host":
            for name, us in row["us"].items():
                yield ["host " + name, "wrapper (host time)", f"{us / 1e3:.4f}", None, None, None, None]
            continue
        if row["kind"] == "step":
            yield ["step " + row["name"], "paged_decode in graph", f"{row['graph_us'] / 1e3:.4f}"] + [None] * 4
            if "tuned_graph_us" in row:
                yield ["step " + row["name"], "tuned, in graph", f"{row['tuned_graph_us'] / 1e3:.4f}"] + [None] * 4
            continue
        decode = row["kind"] == "decode"
        case = f"decode {row['batch']}x{row['keys']}" if decode else f"prefill {row['batch']}x{row['length']}"
        mine = row["ms"]["paged_decode" if decode else "prefill"]
        for name, ms in row["ms"].items():
            yield [case, name, f"{ms:.4f}", common.fmt(row.get("gbps", {}).get(name), ".0f"),
                   common.fmt(row.get("pct_of_copy", {}).get(name), ".0f"),
                   common.fmt(row.get("tflops", {}).get(name), ".1f"), f"{ms / mine:.2f}x"]


def print_table(result: dict) -> None:
    common.print_table(["case", "impl", "ms", "GB/s", "% copy", "TFLOP/s", "speedup"], table_rows(result),
                       title=f"{result['gpu']}, {result['dtype']}; copy bandwidth {result['copy_gbps']:.0f} GB/s "
                             "(read + write)")
    print("speedup: how many times faster the Triton kernel (first row of each case) is than that row")
    print("step rows: per call inside a CUDA graph, K/V cold (how the decode step runs it)")
    print("*_graph rows: per call inside a CUDA graph (no launch cost), 3 calls on the same inputs")
    print("host rows: host time of one wrapper call (checks + launch) on tiny inputs")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="folder for kernels.json (default: benchmarks/results/<date>-<gpu>)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    parser.add_argument("--tuned", type=pathlib.Path, default=None, help="a tune_kernels.py JSON: time its winners too")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.quick:  # the full shapes through the Triton interpreter would take hours
        common.require_cuda("bench_kernels.py (without --quick)")
    out = common.start_suite(args.out, "kernels")
    args.tuned = tuned_configs(args.tuned)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        decode_shapes, prefill_shapes, copy_bytes = [(2, 40), (1, 64)], [(2, 32), (1, 48)], 2**20
        step_shapes = [("self 1x20", 20, 32, True)]
        if device.type == "cpu":
            args.dtype, args.heads, args.head_dim = "fp32", 2, 16
    else:
        decode_shapes = [(64, 2048), (1, 16384)]
        # t5-large greedy decode step at batch 1: self keys <= 128 in a 256-key table, 512 cross keys.
        step_shapes = [("self 1x128", 128, 256, True), ("cross 1x512", 512, 512, False)]
        prefill_shapes = [(16, 512), (4, 2048), (1, 8192)]
        copy_bytes = 2**31
    torch.manual_seed(0)
    copy_gbps = common.copy_bandwidth(device, copy_bytes)
    rows = [decode_case(b, n, args, device, copy_gbps) for b, n in decode_shapes]
    rows += [step_decode_case(*shape, args, device) for shape in step_shapes]
    rows += [prefill_case(b, n, args, device) for b, n in prefill_shapes]
    rows.append(host_case(args, device))
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)",
        "dtype": args.dtype,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "copy_gbps": copy_gbps,
        "tuned": [[*key, cfg.__dict__] for key, cfg in args.tuned.items()],
        "rows": rows,
    }
    common.write_json(out / "kernels.json", result)
    print_table(result)


if __name__ == "__main__":
    main()
