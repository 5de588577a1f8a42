"""Cross-attention from the encoder output itself, with k and v folded into the query side.

A T5 decoder layer's cross-attention reads its K = E Wk^T and V = E Wv^T (E: the encoder output,
[keys, d_model]) once per step: 2 * inner_dim values per key and layer. The same scores and output
come from E alone, which every layer shares:

    s_h = q_h . (E Wk_h^T)^T = (q_h Wk_h) . E^T         (q'_h = q_h Wk_h: [d_model] per head)
    o_h = softmax(s_h) (E Wv_h^T) = (softmax(s_h) E) Wv_h^T

so a step reads d_model values per key and layer instead of 2 * inner_dim (half, where inner_dim =
d_model as in t5-large), and a pool would hold E once for all layers instead of every layer's K/V.
The price: q' and z_h = softmax(s_h) E are d_model wide per head (rows x heads x d_model each, made
by a per-head GEMM over the rows, written and read once per layer), and the score and weighted sum
take heads x d_model products per key instead of inner_dim: tensor-core work with all of a row's
heads as the dot's M dimension, so one program holds a row's [heads, d_model] fp32 accumulator.

This script times that against the package's cross-attention on the same data, as a decode step
runs them: `paged_decode` over K/V pools against q' (one batched GEMM), the kernel over an E pool,
and z Wv^T (another), over the batch job's mix of source lengths (bench_batch's workload) and
uniform batches, µs per call in a CUDA graph, and each path's error against a float64 reference.

    python benchmarks/diag_absorbed_cross.py [--rows 512,320,128] [--uniform 64x512,128x512]
        [--configs default|all|split-d] [--splits 1,2,4] [--out DIR] [--quick]

`--quick` runs tiny shapes through Triton's interpreter (CPU: TRITON_INTERPRET=1). Writes
DIR/absorbed-cross.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
import triton
import triton.language as tl

import common  # benchmarks/ is on sys.path
from hf_paged_t5.kernels import paged_decode
from hf_paged_t5.kernels.decode import decode_config

BLOCK_SIZE = 16
LOG2E = 1.4426950408889634


@triton.jit
def _absorbed_kernel(
    qa_ptr,  # [rows, heads, d_model] (q' = q_h Wk_h per head)
    e_ptr,  # [num_blocks, BLOCK_SIZE, d_model] encoder outputs, paged
    table_ptr,  # [rows, max_blocks] int32
    lens_ptr,  # [rows] int32
    out_ptr,  # [rows, heads, d_model]: z_h = softmax(s_h) E, written with one split
    part_ptr,  # [rows, splits, H_PAD, D_PAD + 2] fp32 partials with several splits
    heads,
    d_model,
    keys_per_split,
    stride_qa_row,
    stride_qa_head,
    stride_e_block,
    stride_e_slot,
    stride_table,
    stride_out_row,
    stride_out_head,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_D: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(lens_ptr + row)
    start = split * keys_per_split
    end = tl.minimum(seq_len, start + keys_per_split)
    hs = tl.arange(0, H_PAD)
    ds = tl.arange(0, D_PAD)
    h_mask = hs < heads
    d_mask = ds < d_model
    qa = tl.load(qa_ptr + row * stride_qa_row + hs[:, None] * stride_qa_head + ds[None, :],
                 mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if SPLIT_D > 1:  # the scores' d_model sum as SPLIT_D batched dots of D_PAD // SPLIT_D (spread over warps)
        qa3 = tl.permute(tl.reshape(qa, [H_PAD, SPLIT_D, D_PAD // SPLIT_D]), (1, 0, 2))
    m_i = tl.full([H_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, D_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        block = tl.load(table_ptr + row * stride_table + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        off = block * stride_e_block + (keys % BLOCK_SIZE) * stride_e_slot
        e = tl.load(e_ptr + off[:, None] + ds[None, :], mask=key_mask[:, None] & d_mask[None, :], other=0.0)
        if SPLIT_D > 1:
            e3 = tl.permute(tl.reshape(e, [BLOCK_N, SPLIT_D, D_PAD // SPLIT_D]), (1, 2, 0))
            s = tl.sum(tl.dot(qa3, e3), axis=0) * 1.4426950408889634
        else:
            s = tl.dot(qa, tl.trans(e)) * 1.4426950408889634  # [H_PAD, BLOCK_N], log2 units
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(e.dtype), e)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_out_row + hs[:, None] * stride_out_head + ds[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        base = part_ptr + (row * SPLITS + split) * H_PAD * (D_PAD + 2)
        tl.store(base + hs[:, None] * (D_PAD + 2) + ds[None, :], acc)
        tl.store(base + hs * (D_PAD + 2) + D_PAD, m_i)
        tl.store(base + hs * (D_PAD + 2) + D_PAD + 1, l_i)


def absorbed_attention(qa: torch.Tensor, e_pool: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                       max_seq_len: int, block_n: int = 16, num_warps: int = 8, num_stages: int = 2,
                       splits: int = 1, split_d: int = 1) -> torch.Tensor:
    """z [rows, heads, d_model] = per head softmax(q'_h . E^T) E over each row's paged E."""
    rows, heads, d_model = qa.shape
    h_pad, d_pad = max(16, triton.next_power_of_2(heads)), triton.next_power_of_2(d_model)
    out = torch.empty_like(qa)
    keys_per_split = -(-max_seq_len // (splits * block_n)) * block_n
    part = (torch.empty(rows, splits, h_pad, d_pad + 2, device=qa.device, dtype=torch.float32) if splits > 1
            else out)
    _absorbed_kernel[(rows, splits)](
        qa, e_pool, table, seq_lens, out, part, heads, d_model, keys_per_split,
        qa.stride(0), qa.stride(1), e_pool.stride(0), e_pool.stride(1), table.stride(0), out.stride(0), out.stride(1),
        H_PAD=h_pad, D_PAD=d_pad, BLOCK_SIZE=e_pool.shape[1], BLOCK_N=block_n, SPLITS=splits, SPLIT_D=split_d,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits == 1:
        return out
    acc, m, l = part[..., :d_pad], part[..., d_pad], part[..., d_pad + 1]  # [rows, splits, h_pad(, d_pad)]
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - top).nan_to_num(0.0)  # empty splits: -inf - finite -> weight 0
    z = (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]
    return z[:, :heads, :d_model].to(qa.dtype)


def row_keys(e_pool: torch.Tensor, table: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """Row `row`'s first n encoder outputs gathered from the paged pool, float64 [n, d_model]."""
    blocks = table[row, : -(-n // e_pool.shape[1])].long()
    return e_pool[blocks].reshape(-1, e_pool.shape[-1])[:n].double()


def reference(qa: torch.Tensor, e_pool: torch.Tensor, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """float64 z of `absorbed_attention`, row by row."""
    out = []
    for row, n in enumerate(lens):
        e = row_keys(e_pool, table, row, n)
        p = torch.softmax(qa[row].double() @ e.T, dim=-1)
        out.append(p @ e)
    return torch.stack(out)


def problem(lens: list[int], heads: int, head_dim: int, d_model: int, device, dtype, seed: int = 0):
    """Random E (paged, shuffled blocks), cross k / v weights, the K/V pools they give, queries."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_row = [-(-n // BLOCK_SIZE) for n in lens]
    blocks = sum(per_row) + 1
    ids = torch.randperm(blocks, generator=g).tolist()
    table = torch.zeros(len(lens), max(per_row), dtype=torch.int32)
    for row, n in enumerate(per_row):
        table[row, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    e_pool = torch.randn(blocks, BLOCK_SIZE, d_model, generator=g).to(device, dtype)
    wk = (torch.randn(heads * head_dim, d_model, generator=g) / d_model ** 0.5).to(device, dtype)
    wv = (torch.randn(heads * head_dim, d_model, generator=g) / d_model ** 0.5).to(device, dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(device, dtype)
    k_pool = (e_pool @ wk.T).view(blocks, BLOCK_SIZE, heads, head_dim)  # as the cross K/V store makes them
    v_pool = (e_pool @ wv.T).view(blocks, BLOCK_SIZE, heads, head_dim)
    return dict(e_pool=e_pool, wk=wk, wv=wv, q=q, k_pool=k_pool, v_pool=v_pool, table=table.to(device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device))


def absorbed_query(p: dict) -> torch.Tensor:
    """q'_h = q_h Wk_h for every row and head: [rows, heads, d_model] (a strided view of one batched GEMM)."""
    heads, head_dim = p["q"].shape[1:]
    return torch.bmm(p["q"].transpose(0, 1), p["wk"].view(heads, head_dim, -1)).transpose(0, 1)


def absorbed_sublayer(p: dict, max_seq_len: int, qa: Optional[torch.Tensor] = None, **config) -> torch.Tensor:
    """The cross-attention output before `o` [rows, heads * head_dim] by way of q' and z (`qa`: q'
    made beforehand, or None: made here)."""
    wv = p["wv"]
    rows, heads, head_dim = p["q"].shape
    qa = absorbed_query(p) if qa is None else qa
    z = absorbed_attention(qa, p["e_pool"], p["table"], p["seq_lens"], max_seq_len, **config)
    out = torch.bmm(z.transpose(0, 1), wv.view(heads, head_dim, -1).transpose(1, 2))  # [heads, rows, head_dim]
    return out.transpose(0, 1).reshape(rows, heads * head_dim)


def standard_sublayer(p: dict, max_seq_len: int) -> torch.Tensor:
    """The package's cross-attention over the K/V pools (its default launch)."""
    rows, heads, head_dim = p["q"].shape
    out = paged_decode(query=p["q"], key_cache=p["k_pool"], value_cache=p["v_pool"], block_table=p["table"],
                       seq_lens=p["seq_lens"], max_seq_len=max_seq_len)
    return out.reshape(rows, heads * head_dim)


def sublayer_reference(p: dict, lens: list[int]) -> torch.Tensor:
    """float64 cross-attention output before `o`, from E and the weights."""
    rows, heads, head_dim = p["q"].shape
    wk, wv = p["wk"].double(), p["wv"].double()
    out = []
    for row, n in enumerate(lens):
        e = row_keys(p["e_pool"], p["table"], row, n)
        k, v = (e @ wk.T).view(n, heads, head_dim), (e @ wv.T).view(n, heads, head_dim)
        s = torch.einsum("hd,nhd->hn", p["q"][row].double(), k)
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v).reshape(-1))
    return torch.stack(out)


def mixes(args) -> list[tuple[str, list[int]]]:
    """(name, key counts per row, longest first as BatchGenerator orders them) of each case."""
    import tune_mixed_decode as tmd

    low, median, high = (4, 24, 120) if args.quick else (20, 160, 2000)
    out = []
    for rows in (int(r) for r in args.rows.split(",") if r):
        lens = sorted(tmd.lengths(rows, 0, median, low, high), reverse=True)
        out.append((f"mix {rows} rows", lens))
    for shape in (s for s in args.uniform.split(",") if s):
        rows, keys = (int(x) for x in shape.split("x"))
        out.append((f"uniform {rows}x{keys}", [keys] * rows))
    return out


CONFIGS = {
    "default": [dict(block_n=16, num_warps=8, num_stages=2)],
    "all": [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (16, 32) for w in (4, 8) for st in (1, 2, 3)],
    # the scores' d_model sum split over warps (batched dots), longer tiles
    "split-d": [dict(block_n=bn, num_warps=w, num_stages=st, split_d=sd) for bn, w, st, sd in (
        (32, 8, 3, 1), (32, 8, 3, 4), (32, 8, 2, 8), (64, 8, 2, 4), (64, 8, 1, 8), (32, 4, 3, 4), (16, 8, 3, 8))],
}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="512,320,128", help="row counts of the batch job's length mix")
    ap.add_argument("--uniform", default="64x512,128x512", help="ROWSxKEYS uniform cases")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--configs", default="default", choices=sorted(CONFIGS))
    ap.add_argument("--splits", default="1,2,4", help="key splits to time (each merged by torch ops)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if not args.quick:
        common.require_cuda("diag_absorbed_cross.py (without --quick)")
    elif os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise SystemExit("--quick on a CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = common.start_suite(args.out, "absorbed-cross")
    gbps = common.copy_bandwidth(device, 1 << 30) if device.type == "cuda" else float("nan")
    report = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "copy_gbps": gbps,
              "heads": args.heads, "head_dim": args.head_dim, "d_model": args.d_model, "rows": []}
    inner = args.heads * args.head_dim
    for name, lens in mixes(args):
        rows, max_len, keys = len(lens), max(lens), sum(lens)
        p = problem(lens, args.heads, args.head_dim, args.d_model, device, dtype)
        ref = sublayer_reference(p, lens)
        scale = float(ref.norm())
        kv_bytes = 2 * keys * inner * p["k_pool"].element_size()
        e_bytes = keys * args.d_model * p["e_pool"].element_size()
        side_bytes = 4 * rows * args.heads * args.d_model * p["e_pool"].element_size()  # q' and z, written and read
        print(f"{name}: keys {min(lens)}..{max_len} (mean {keys / rows:.0f}); K+V {kv_bytes / 2**20:.1f} MiB, "
              f"E {e_bytes / 2**20:.1f} MiB + q'/z {side_bytes / 2**20:.1f} MiB; copy {gbps:.0f} GB/s", flush=True)
        cfg = decode_config(rows, args.heads, args.head_dim, max_len, common.num_sms(device)) if device.type == "cuda" else None
        variants = {f"paged_decode (default {cfg})": lambda: standard_sublayer(p, max_len)}
        for config in CONFIGS[args.configs]:
            for splits in (int(s) for s in args.splits.split(",")):
                label = (f"absorbed {config['block_n']} keys, {config['num_warps']} warps, {config['num_stages']} deep, "
                         f"{splits} split" + (f", d in {config['split_d']}" if config.get("split_d", 1) > 1 else ""))
                variants[label] = lambda c=config, s=splits: absorbed_sublayer(p, max_len, splits=s, **c)
        qa = absorbed_query(p).contiguous()
        for config in CONFIGS["default"]:  # on q' made beforehand: what its GEMM adds
            label = f"absorbed without the q' GEMM, {config['block_n']} keys, 1 split"
            variants[label] = lambda c=config: absorbed_sublayer(p, max_len, qa=qa, **c)
        for label, fn in variants.items():
            try:
                err = float((fn().double() - ref).norm()) / scale
            except Exception as exc:  # a configuration that does not compile (registers, shared memory)
                print(f"  {label:<58} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                report["rows"].append(dict(case=name, variant=label, failed=f"{type(exc).__name__}: {exc}"[:400]))
                continue
            us = common.graph_us([fn] * 4) if device.type == "cuda" else float("nan")
            row = dict(case=name, rows=rows, keys=keys, max_keys=max_len, variant=label, us=us, rel_err=err,
                       kv_pct_of_copy=100 * kv_bytes / (us * 1e3) / gbps)
            report["rows"].append(row)
            print(f"  {label:<58} {us:8.1f} us  (K/V bytes at {row['kv_pct_of_copy']:5.1f}% of copy)  err {err:.1e}",
                  flush=True)
    common.write_json(out_dir / "absorbed-cross.json", report)


if __name__ == "__main__":
    main()
