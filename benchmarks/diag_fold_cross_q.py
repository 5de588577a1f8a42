"""Whether the cross-attention query projection could fold into cross-attention: registers and
spills at sm_90, compiled here, no GPU needed.

The fused decode layer runs `norm + cross q` and `cross-attention` as two dependent launches
(docs/performance.md, "What one dependent stage costs"). Folded, each (head, row, split) program
of cross-attention would compute its head's query itself: RMSNorm of the row, then the head's
[head_dim, d_model] slice of the q weight times it. To gain the stage (~2 µs at t5-large, one
row), that weight slice must load before the program waits for the kernel before it, as every
other weight of the layer does, so it stays in registers across the wait. This kernel does the
whole folded program (the first K/V tile also loaded before the wait, the split merge on tickets)
and `diag_ptxas.compile_report` reads what ptxas makes of it for each warp count.

    python benchmarks/diag_fold_cross_q.py [--arch 90]

To read what the GPU machine's Triton makes, put that version's wheel first on the path
(`PYTHONPATH=/tmp/triton36:. python benchmarks/diag_fold_cross_q.py`; diag_ptxas.py says how).
"""

from __future__ import annotations

import argparse
import importlib

import triton
import triton.language as tl

import common  # benchmarks/ is on sys.path (the scripts' import rule)
from diag_ptxas import compile_report

decode = importlib.import_module("hf_paged_t5.kernels.decode")  # its tile helpers, as the real kernel calls them


@triton.jit(do_not_specialize=["max_keys", "keys_per_split", "stride_table_batch"])
def _folded_cross_kernel(
    x_ptr, norm_weight_ptr, wq_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_ptr, ticket_ptr, eps, head_dim, d_model, max_keys, keys_per_split,
    stride_x_row, stride_w_row, stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_batch,
    stride_out_batch, stride_out_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_heads = tl.num_programs(0)
    num_splits = tl.num_programs(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + row), max_keys)
    start = split * keys_per_split
    end = tl.minimum(seq_len, start + keys_per_split)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < d_model
    # before the wait: the head's q weight slice, the norm weight, the first K/V tile
    w = tl.load(wq_ptr + (head * head_dim + dims)[:, None].to(tl.int64) * stride_w_row + offs_k[None, :],
                mask=dim_mask[:, None] & k_mask[None, :], other=0.0)
    g = tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0)
    table_row_ptr = block_table_ptr + row * stride_table_batch
    slot_args = (table_row_ptr, max_keys, head, stride_cache_block, stride_cache_slot, stride_cache_head)
    kv_args = (key_cache_ptr, value_cache_ptr, end, dims, dim_mask)
    k, v = decode._load_kv(decode._tile_slots(start, *slot_args, BLOCK_SIZE, BLOCK_N), start, *kv_args, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # after it: the residual row, its RMSNorm (HF's roundings) and the head's query
    x = tl.load(x_ptr + row * stride_x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    normed = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / d_model + eps)).to(g.dtype)
    h = (g * normed).to(tl.float32)
    q = tl.sum(w.to(tl.float32) * h[None, :], axis=1).to(wq_ptr.dtype.element_ty).to(tl.float32)
    q = q * 1.4426950408889634
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile_start in tl.range(start, end, BLOCK_N, num_stages=1):
        slots = decode._tile_slots(tile_start + BLOCK_N, *slot_args, BLOCK_SIZE, BLOCK_N)
        k_next, v_next = decode._load_kv(slots, tile_start + BLOCK_N, *kv_args, BLOCK_N)
        acc, l_i, m_i = decode._attend_keys(acc, l_i, m_i, q, k, v, bias, tile_start, end, 0, BLOCK_N)
        k, v = k_next, v_next
    if (num_splits == 1) | (seq_len <= keys_per_split):
        if split == 0:
            tl.store(out_ptr + row * stride_out_batch + head * stride_out_head + dims,
                     (acc / l_i).to(out_ptr.dtype.element_ty), mask=dim_mask)
    else:
        part_row_ptr = part_ptr + ((row * num_heads + head) * num_splits + split) * (BLOCK_D + 2)
        tl.store(part_row_ptr + dims, acc)
        tl.store(part_row_ptr + BLOCK_D, m_i)
        tl.store(part_row_ptr + BLOCK_D + 1, l_i)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + row * num_heads + head, 1, sem="acq_rel")
        if ticket == num_splits - 1:
            decode._merge_splits(part_ptr, out_ptr, row, head, num_heads, num_splits, head_dim,
                                 stride_out_batch, stride_out_head, MERGE_CHUNK, BLOCK_D)
            tl.atomic_xchg(ticket_ptr + row * num_heads + head, 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: Hopper)")
    args = ap.parse_args(argv)
    types = dict(eps="fp32", block_table_ptr="*i32", seq_lens_ptr="*i32", part_ptr="*fp32", ticket_ptr="*i32")
    rows = []
    for model, d_model in (("t5-large", 1024), ("flan-t5-xl", 2048)):
        for warps in (4, 8, 16):
            for block_n in (64, 128):
                const = dict(BLOCK_SIZE=16, BLOCK_N=block_n, BLOCK_D=64, BLOCK_K=d_model, MERGE_CHUNK=16, PDL=True)
                report = compile_report(_folded_cross_kernel, const, types, warps, args.arch, True, frozenset(), 1)
                rows.append([model, warps, block_n, report["registers"], report["spill_loads"], report["spill_stores"]])
    common.print_table(["layout", "warps", "keys per tile", "registers", "spill loads", "spill stores"], rows,
                       title=f"sm_{args.arch}: cross-attention with its head's q projection folded in")


if __name__ == "__main__":
    main()
