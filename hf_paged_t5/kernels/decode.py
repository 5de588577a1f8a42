"""Paged decode attention, one query token per row (Triton twin of `reference.paged_decode`).

One program handles one (head, row, key split) and streams that split's keys in tiles of
BLOCK_N keys (several blocks, or part of one): per key it gathers the block id from the row's
table and loads the K / V rows as one [BLOCK_N, head_dim] pointer tile with 16-byte loads,
requesting the next tile before it uses the current one (`DecodeConfig.prefetch` picks how).
With one split it writes the output; with several (flash-decoding, for few rows over long
keys) each writes an unnormalised partial (running max, running sum, weighted V sum) and
`_combine_splits_kernel` merges them with a log-sum-exp rescale; or (`fused_combine`) the last
program of a (row, head) to finish, counted by an atomic ticket, merges them itself, sparing
the second launch. As a programmatic dependent launch (`pdl`) a program reads seq_lens before
it waits for the kernel before it, and with `keys_ready` its first tile's block ids, K/V and bias
too (keys written before that kernel began; a row's newest key, written by it, after the wait).
Given each row's newest K/V (`new_key`), the async-load binary (many rows) stores them itself (the
program whose split holds that key) and attends to them from registers: a many-row decode step's
self-attention then needs no `store_kv` launch before it.
The grid depends on tensor shapes and the host bound `max_seq_len` only: no host-device sync, so
the wrapper can be captured in a CUDA graph; programs past a row's `seq_len` contribute nothing.
Launch knobs are a `DecodeConfig`, picked by `decode_config`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from . import fast_math
from ._checks import block_d, broadcast_strides, check_decode_args, check_device, check_float, interpreting, pdl_options
from .launch import _PREFETCH, DecodeConfig, _num_sms, decode_config, grouped_config
from .store_kv import store_kv

# BIAS_MODE values.
_NO_BIAS, _TABLE_BIAS, _DENSE_BIAS = 0, 1, 2
# paged_decode's keys_ready -> the kernel's READY.
_READY = MappingProxyType({None: 0, "past": 1, "all": 2})
# Partials merged per step of the split merge: [16, head_dim] fp32 in registers; any split count
# (up to launch._MAX_SPLITS = 128: 8 steps) runs the same compiled kernel.
_MERGE_CHUNK = 16


@triton.jit
def _tile_slots(
    tile_start,
    table_row_ptr,
    max_keys,
    head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[BLOCK_N] int64 element offsets of keys [tile_start, tile_start + BLOCK_N) of one head.

    The tile spans BLOCK_N // BLOCK_SIZE blocks (or part of one): each key gathers its block id
    from the row's table (repeated ids hit one cache line).
    """
    keys = tile_start + tl.arange(0, BLOCK_N)
    # Masked by the table's width, not by `end`: every entry of the row is a valid block id,
    # and the table load then need not wait for seq_len (one round trip less per call).
    block_id = tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=keys < max_keys, other=0).to(tl.int64)
    # int64: block_id * stride_cache_block passes 2^31 in pools of a few GB.
    return block_id * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot + head * stride_cache_head


@triton.jit
def _load_kv(slot_off, tile_start, key_cache_ptr, value_cache_ptr, end, dims, dim_mask, BLOCK_N: tl.constexpr):
    """K and V rows [BLOCK_N, BLOCK_D] at `slot_off` (from `_tile_slots` of the same tile_start).

    K/V of keys at or past `end` are masked, so a tile past the end costs no K/V traffic.
    """
    key_mask = (tile_start + tl.arange(0, BLOCK_N)) < end
    kv_off = slot_off[:, None] + dims[None, :]
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _merge_splits(
    part_ptr,
    out_ptr,
    row,
    head,
    num_heads,
    num_splits,
    head_dim,
    stride_out_batch,
    stride_out_head,
    MERGE_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the partials of one (row, head) (layout: `_combine_splits_kernel`) into the output,
    MERGE_CHUNK splits at a time with a running log-sum-exp rescale: the split count is a runtime
    value, so every count runs one compiled kernel (with up to MERGE_CHUNK splits the loop runs
    once and gives the one-shot merge's bits)."""
    dims = tl.arange(0, BLOCK_D)
    first_off = (row * num_heads + head) * num_splits
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.full([], 0.0, tl.float32)
    acc_run = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, num_splits, MERGE_CHUNK):
        splits = first + tl.arange(0, MERGE_CHUNK)
        split_mask = splits < num_splits
        part_off = (first_off + splits) * (BLOCK_D + 2)  # [MERGE_CHUNK]
        # .cg: read from L2, where other SMs' partials are (this SM's L1 may not have seen them).
        m = tl.load(part_ptr + part_off + BLOCK_D, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ptr + part_off + BLOCK_D + 1, mask=split_mask, other=0.0, cache_modifier=".cg")
        acc_ptrs = part_ptr + part_off[:, None] + dims[None, :]  # [MERGE_CHUNK, BLOCK_D]
        acc = tl.load(acc_ptrs, mask=split_mask[:, None], other=0.0, cache_modifier=".cg")
        # Split 0 always holds key 0 (seq_len >= 1), so the first chunk's max is finite (and the
        # running state's weight, exp2(-inf), is 0); empty splits and chunks get weight 0.
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = fast_math.exp2(m_run - m_new)
        weight = fast_math.exp2(m - m_new)  # [MERGE_CHUNK]
        acc_run = acc_run * alpha + tl.sum(weight[:, None] * acc, axis=0)
        l_run = l_run * alpha + tl.sum(weight * l, axis=0)
        m_run = m_new
    out = acc_run / l_run
    tl.store(
        out_ptr + row * stride_out_batch + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@triton.jit
def _tile_bias(
    tile_start,
    end,
    q_pos,
    row,
    head,
    max_distance,
    dense_len,
    bias_ptr,
    stride_bias_batch,
    stride_bias_head,
    stride_bias_key,
    BIAS_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The bias of keys [tile_start, tile_start + BLOCK_N) as stored, [BLOCK_N] (with BIAS_MODE 0
    a zero `_attend_keys` does not add)."""
    keys = tile_start + tl.arange(0, BLOCK_N)
    key_mask = keys < end
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if BIAS_MODE == 1:
        index = tl.minimum(q_pos - keys, max_distance)
        bias = tl.load(bias_ptr + head * stride_bias_head + index * stride_bias_key, mask=key_mask, other=0.0)
    if BIAS_MODE == 2:
        bias_off = row * stride_bias_batch + head * stride_bias_head + keys.to(tl.int64) * stride_bias_key
        bias = tl.load(bias_ptr + bias_off, mask=key_mask & (keys < dense_len), other=0.0)
    return bias


@triton.jit
def _attend_keys(acc, l_i, m_i, q, k, v, bias, tile_start, end, BIAS_MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step of the query q [BLOCK_D] (log2 units) over one K/V tile and its
    bias (`_tile_bias`)."""
    keys = tile_start + tl.arange(0, BLOCK_N)
    key_mask = keys < end
    s = tl.sum(q[None, :] * k.to(tl.float32), axis=1)  # [BLOCK_N]
    if BIAS_MODE != 0:
        s += bias.to(tl.float32) * 1.4426950408889634
    s = tl.where(key_mask, s, float("-inf"))
    # Every tile holds at least one live key, so m_new is finite and no NaN appears.
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = fast_math.exp2(m_i - m_new)
    p = fast_math.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return acc, l_i, m_new


@triton.jit
def _newest_kv(
    new_key_ptr,
    new_value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot,
    here,
    row,
    head,
    dims,
    dim_mask,
    stride_new_batch,
    stride_new_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """A row's newest key and value as given ([BLOCK_D] each, in the cache's dtype), loaded and
    stored at `slot` by the program `here` (the one whose keys hold the newest, with a slot >= 0);
    elsewhere zeros, unused."""
    new_off = row * stride_new_batch + head * stride_new_head + dims
    new_mask = dim_mask & (dims * 0 + here.to(tl.int32) != 0)  # a tensor: a scalar condition in a mask trips the interpreter
    k_new = tl.load(new_key_ptr + new_off, mask=new_mask, other=0.0).to(key_cache_ptr.dtype.element_ty)
    v_new = tl.load(new_value_ptr + new_off, mask=new_mask, other=0.0).to(value_cache_ptr.dtype.element_ty)
    if here:
        # int64 slot: block_id * stride_cache_block passes 2^31 in pools of a few GB.
        cache_off = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
        cache_off += head * stride_cache_head + dims
        tl.store(key_cache_ptr + cache_off, k_new, mask=dim_mask)
        tl.store(value_cache_ptr + cache_off, v_new, mask=dim_mask)
    return k_new, v_new


@triton.jit
def _attend_newest(acc, l_i, m_i, q, k_new, v_new, bias_args, BIAS_MODE: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online-softmax step over a row's newest key alone (`_newest_kv`), after the loop over
    the keys before it: a 16-key tile whose one live key is the newest."""
    q_pos = bias_args[0]
    k = tl.broadcast_to(k_new[None, :], [16, BLOCK_D])
    v = tl.broadcast_to(v_new[None, :], [16, BLOCK_D])
    bias = _tile_bias(q_pos, q_pos + 1, *bias_args, BIAS_MODE, 16)
    return _attend_keys(acc, l_i, m_i, q, k, v, bias, q_pos, q_pos + 1, BIAS_MODE, 16)


# workload sizes: see kernels/__init__.py; the new K/V's strides too (placeholders where nothing is stored)
@triton.jit(do_not_specialize=["max_keys", "keys_per_split", "dense_len", "stride_table_batch",
                               "stride_new_batch", "stride_new_head"])
def _paged_decode_kernel(
    query_ptr,  # [batch, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_heads, head_dim]
    block_table_ptr,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch] int32
    bias_ptr,  # table [num_heads, max_distance + 1] | dense [batch|1, num_heads|1, dense_len] | unused
    out_ptr,  # [batch, num_heads, head_dim], written with one split (with several and FUSED_COMBINE, by the last split)
    part_ptr,  # [batch, num_heads, num_splits, BLOCK_D + 2] fp32, written with several splits (layout: _combine_splits_kernel)
    ticket_ptr,  # [batch, num_heads] int32 zeros, with FUSED_COMBINE: splits of (row, head) done so far (left at zero)
    new_key_ptr,  # [batch, num_heads, head_dim]: each row's newest key (STORE; else unused)
    new_value_ptr,  # like new_key_ptr
    slot_mapping_ptr,  # [batch] int32 / int64: where the newest K/V go (STORE; negative: not stored)
    scale,
    head_dim,
    max_keys,
    keys_per_split,
    max_distance,
    dense_len,
    stride_query_batch,
    stride_query_head,
    stride_new_batch,
    stride_new_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_batch,
    stride_bias_batch,
    stride_bias_head,
    stride_bias_key,
    stride_out_batch,
    stride_out_head,
    BIAS_MODE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    PREFETCH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    READY: tl.constexpr,
    STORE: tl.constexpr,
):
    # Heads vary fastest over the grid: programs running side by side read neighbouring
    # head slices of the same slots, so together they stream whole blocks.
    head = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_heads = tl.num_programs(0)
    num_splits = tl.num_programs(2)

    # Clamping to the table's capacity keeps a bad seq_len from reading past the row.
    # seq_lens, tables and the bias come from the step's inputs (written before its first
    # kernel): they may load before the wait for the kernel before this one.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + row), max_keys)
    slot = tl.full([], -1, tl.int64)
    if STORE:
        slot = tl.load(slot_mapping_ptr + row).to(tl.int64)  # a step input too
    q_pos = seq_len - 1
    start = split * keys_per_split
    end = tl.minimum(seq_len, start + keys_per_split)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    table_row_ptr = block_table_ptr + row * stride_table_batch
    slot_args = (table_row_ptr, max_keys, head, stride_cache_block, stride_cache_slot, stride_cache_head)
    kv_args = (key_cache_ptr, value_cache_ptr, end, dims, dim_mask)
    bias_args = (
        q_pos, row, head, max_distance, dense_len, bias_ptr, stride_bias_batch, stride_bias_head, stride_bias_key,
    )  # fmt: skip
    q_off = row * stride_query_batch + head * stride_query_head + dims
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if PREFETCH == 2:
        if PDL:
            # The query and the newest keys come from the kernels just before this one.
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # Work in log2 units (exp2 is the native instruction); fp32 so fp16 scores never overflow.
        q = tl.load(query_ptr + q_off, mask=dim_mask, other=0.0).to(tl.float32) * (scale * 1.4426950408889634)
        # With STORE, the program that holds a row's newest key (a slot given) leaves it out of
        # the loop and attends to it from the given values after it.
        newest_here = (slot >= 0) & (start <= q_pos) & (q_pos < end)
        loop_end = tl.where(newest_here, q_pos, end)
        # Plain loop: Triton's pipeliner copies the K/V of the next NUM_STAGES - 1 tiles into
        # shared memory asynchronously (the block ids a stage earlier still).
        for tile_start in tl.range(start, loop_end, BLOCK_N, num_stages=NUM_STAGES):
            slots = _tile_slots(tile_start, *slot_args, BLOCK_SIZE, BLOCK_N)
            k, v = _load_kv(slots, tile_start, key_cache_ptr, value_cache_ptr, loop_end, dims, dim_mask, BLOCK_N)
            bias = _tile_bias(tile_start, loop_end, *bias_args, BIAS_MODE, BLOCK_N)
            acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k, v, bias, tile_start, loop_end, BIAS_MODE, BLOCK_N)
        if STORE:
            k_new, v_new = _newest_kv(
                new_key_ptr, new_value_ptr, key_cache_ptr, value_cache_ptr, slot, newest_here, row, head, dims,
                dim_mask, stride_new_batch, stride_new_head, stride_cache_block, stride_cache_slot, stride_cache_head,
                BLOCK_SIZE,
            )  # fmt: skip
            if newest_here:
                acc, l_i, m_i = _attend_newest(acc, l_i, m_i, q, k_new, v_new, bias_args, BIAS_MODE, BLOCK_D)
    else:
        if PDL and READY == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # The first tile is in flight while the state is set up; inside the loop the next tile
        # is requested before the current one is used, so each program keeps one tile of K and
        # V in flight while it computes (latency hiding that does not rely on occupancy). With
        # READY the keys were written before the step (all of them, or all but each row's newest):
        # the first tile, its block ids and its bias load before the wait.
        slots = _tile_slots(start, *slot_args, BLOCK_SIZE, BLOCK_N)
        first_slots = slots
        k, v = _load_kv(slots, start, *kv_args, BLOCK_N)
        bias = _tile_bias(start, end, *bias_args, BIAS_MODE, BLOCK_N)
        if PREFETCH == 1:
            slots = _tile_slots(start + BLOCK_N, *slot_args, BLOCK_SIZE, BLOCK_N)
        if PDL and READY != 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        q = tl.load(query_ptr + q_off, mask=dim_mask, other=0.0).to(tl.float32) * (scale * 1.4426950408889634)
        if READY == 1:
            # The newest key was stored by the kernel just before: loaded again after the wait, its
            # row of the first tile replaces the one loaded before (a later tile loads after the wait).
            mine = ((start + tl.arange(0, BLOCK_N)) == q_pos)[:, None] & dim_mask[None, :]
            first_off = first_slots[:, None] + dims[None, :]
            k = tl.load(key_cache_ptr + first_off, mask=mine, other=k)
            v = tl.load(value_cache_ptr + first_off, mask=mine, other=v)
        for tile_start in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            if PREFETCH == 1:
                # The next tile's block ids came one tile ago, so its K/V loads need not wait
                # for a table round trip; the ids of the tile after it are requested now.
                k_next, v_next = _load_kv(slots, tile_start + BLOCK_N, *kv_args, BLOCK_N)
                slots = _tile_slots(tile_start + 2 * BLOCK_N, *slot_args, BLOCK_SIZE, BLOCK_N)
            else:
                slots = _tile_slots(tile_start + BLOCK_N, *slot_args, BLOCK_SIZE, BLOCK_N)
                k_next, v_next = _load_kv(slots, tile_start + BLOCK_N, *kv_args, BLOCK_N)
            bias_next = _tile_bias(tile_start + BLOCK_N, end, *bias_args, BIAS_MODE, BLOCK_N)
            acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k, v, bias, tile_start, end, BIAS_MODE, BLOCK_N)
            k, v, bias = k_next, v_next, bias_next

    # The split count is read at run time (the grid's third axis), not specialized on: one binary
    # serves a launch of one split (a wide batch) and of several (a narrow one), so a new batch
    # size does not compile the kernel again. With the fused merge, a row whose keys all lie in
    # the first split is finished by that split as with one split (the same loop, the same bits),
    # and its other splits, whose key ranges are empty, store nothing and take no ticket: a
    # step's split count follows its table's capacity, and the merge's round trips (~1.8 us on an
    # H200) are not paid for rows that have not grown into a second split yet.
    whole = num_splits == 1
    if FUSED_COMBINE:
        whole = whole | (seq_len <= keys_per_split)
    if whole:
        if split == 0:
            out = acc / l_i
            out_off = row * stride_out_batch + head * stride_out_head + dims
            tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=dim_mask)
    else:
        # A split past seq_len stores max -inf and sum 0: the merge gives it weight 0.
        part_row_ptr = part_ptr + ((row * num_heads + head) * num_splits + split) * (BLOCK_D + 2)
        tl.store(part_row_ptr + dims, acc)
        tl.store(part_row_ptr + BLOCK_D, m_i)
        tl.store(part_row_ptr + BLOCK_D + 1, l_i)
        if FUSED_COMBINE:
            # Every thread's partial stores precede the ticket (one thread takes it, release),
            # and the last split's loads follow it (acquire): that split sees all partials.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + row * num_heads + head, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                _merge_splits(
                    part_ptr, out_ptr, row, head, num_heads, num_splits, head_dim,
                    stride_out_batch, stride_out_head, MERGE_CHUNK, BLOCK_D,
                )  # fmt: skip
                # Every split has counted: back to zero for the next launch over these counters.
                tl.atomic_xchg(ticket_ptr + row * num_heads + head, 0)


@triton.jit(do_not_specialize=["num_splits"])  # workload sizes: see kernels/__init__.py
def _combine_splits_kernel(
    part_ptr,  # [batch, num_heads, num_splits, BLOCK_D + 2] fp32: weighted V sum, running max (log2), sum
    out_ptr,  # [batch, num_heads, head_dim]
    head_dim,
    num_splits,
    stride_out_batch,
    stride_out_head,
    MERGE_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _merge_splits(
        part_ptr, out_ptr, row, head, tl.num_programs(1), num_splits, head_dim,
        stride_out_batch, stride_out_head, MERGE_CHUNK, BLOCK_D,
    )  # fmt: skip


def _check_tickets(tickets: torch.Tensor, needed: int, device: torch.device) -> None:
    if not isinstance(tickets, torch.Tensor) or tickets.dtype != torch.int32 or not tickets.is_contiguous():
        raise TypeError("tickets must be a contiguous int32 tensor of zeros")
    if tickets.numel() < needed or tickets.device != device:
        raise ValueError(f"tickets must hold >= batch * num_heads = {needed} counters on {device}, "
                         f"got {tickets.numel()} on {tickets.device}")


def _check_newest(query: torch.Tensor, new_key, new_value, slot_mapping) -> bool:
    """`paged_decode`'s checks of its new K/V and slots; returns whether it stores them."""
    given = [t is not None for t in (new_key, new_value, slot_mapping)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("storing each row's newest K/V needs new_key, new_value and slot_mapping together")
    for name, tensor in (("new_key", new_key), ("new_value", new_value)):
        check_float(name, tensor, 3)
        check_device(name, tensor, query.device)
        if tensor.shape != query.shape or tensor.dtype != query.dtype:
            raise ValueError(f"{name} must be {tuple(query.shape)} in {query.dtype} like the query, "
                             f"got {tuple(tensor.shape)} {tensor.dtype}")
    if new_key.stride() != new_value.stride():
        raise ValueError(f"new_key and new_value need one layout (strides {new_key.stride()} and "
                         f"{new_value.stride()}); pass .contiguous() copies")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError("slot_mapping must be an int32 or int64 tensor")
    check_device("slot_mapping", slot_mapping, query.device)
    if slot_mapping.shape != (query.shape[0],):
        raise ValueError(f"slot_mapping must be [batch={query.shape[0]}], got {tuple(slot_mapping.shape)}")
    return True


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float = 1.0,
    bias_table: Optional[torch.Tensor] = None,
    dense_bias: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    config: Optional[DecodeConfig] = None,
    pdl: bool = False,
    tickets: Optional[torch.Tensor] = None,
    keys_ready: Optional[str] = None,
    new_key: Optional[torch.Tensor] = None,
    new_value: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query token per row over that row's paged keys.

    query: [batch, num_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim], query's dtype
    block_table: [batch, max_blocks] int32
    seq_lens: [batch] int32, keys of each row (1 <= seq_len <= max_blocks * block_size);
        the query sits at position seq_len - 1
    bias_table: causal distance table [num_heads, max_distance + 1], or None
    dense_bias: [batch | 1, num_heads | 1, max_keys] additive bias (max_keys >= max(seq_lens);
        keys past its end get no bias), or None. At most one of bias_table / dense_bias.
    max_seq_len: optional host-side upper bound on seq_lens (a promise: longer rows are cut);
        only sizes the key splits. Without it the bound is max_blocks * block_size.
    num_splits: optional override of the number of key splits (testing, tuning).
    config: optional override of every launch knob (tuning); `num_splits` still wins if given.
    pdl: launch as a programmatic dependent launch (`launch.pdl_available`); ignored under the interpreter
    tickets: [>= batch * num_heads] int32 zeros (left at zero), or None: with several splits the
        last split of each (row, head) merges the partials, counting on these (`fused_combine`
        without its memset); a graph's step owns them (`StepMetadata.tickets`)
    keys_ready: which keys no kernel of the step before this one wrote: "all" (cross-attention,
        stored before the step), "past" (all but each row's newest key, at seq_len - 1, which
        the kernel just before stored: self-attention of one new token per row) or None. Not
        None promises that the tables, seq_lens and bias were written before the step too; with
        pdl, the first K/V tile of each program, its block ids and bias then load before the wait
        for the kernel before (the newest key after it). The same attention either way.
    new_key, new_value: [batch, num_heads, head_dim] in query's dtype (head_dim contiguous, one
        layout for both), with slot_mapping [batch] int32 / int64: each row's newest K/V, at
        position seq_len - 1, not yet in the cache, stored at the row's slot (negative: none,
        the cache's are read). The same result and the same cache as `store_kv(new_key,
        new_value, ..., slot_mapping)` first: with async loads (`DecodeConfig.prefetch`, many
        rows) the kernel stores them itself and attends to them as given, in one launch; with
        the other loads `store_kv` runs first. Give all three or none.
    returns: [batch, num_heads, head_dim], query's dtype
    """
    max_distance = check_decode_args(query, key_cache, value_cache, block_table, seq_lens, bias_table, dense_bias)
    if keys_ready not in _READY:
        raise ValueError(f"keys_ready must be 'all', 'past' or None, got {keys_ready!r}")
    store = _check_newest(query, new_key, new_value, slot_mapping)
    batch, num_heads, head_dim = query.shape
    block_size = key_cache.shape[1]
    max_keys = block_table.shape[1] * block_size
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0 or num_heads == 0 or max_keys == 0:
        return out

    padded_d = block_d(head_dim)
    covered = max_keys if max_seq_len is None else max(1, min(max_keys, int(max_seq_len)))
    if config is None and not interpreting():
        config = decode_config(batch, num_heads, head_dim, covered, _num_sms(query.device))
    config, splits, keys_per_split = _key_splits(config, num_splits, covered, max_keys)
    if store and config.prefetch != "async":
        # Only the async-load binary (many rows: no 1-row step shares it) stores inside: compiled
        # into the others the new K/V would stay live through their key loops (registers, compile
        # time) and a batch size that shares the 1-row binary would compile one more.
        store_kv(key=new_key, value=new_value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
        store = False

    if bias_table is not None:
        bias_mode, bias, bias_strides, dense_len = _TABLE_BIAS, bias_table, [0, *bias_table.stride()], 0
    elif dense_bias is not None:
        bias_mode, bias, bias_strides, dense_len = _DENSE_BIAS, dense_bias, broadcast_strides(dense_bias), dense_bias.shape[2]
    else:
        bias_mode, bias, bias_strides, dense_len = _NO_BIAS, query, [0, 0, 0], 0

    pdl, launch = pdl_options(pdl)
    # With tickets (a decode step's launch) the fused merge is compiled in whatever the split
    # count: the kernel branches on the count at run time, so one and several splits share one
    # binary. The partials' placeholder is float32 even for one split, as pointer types are part
    # of a binary's signature.
    fused = tickets is not None or (splits > 1 and config.fused_combine)
    # One buffer for the three partials: one allocation, one pointer argument.
    part = torch.empty((batch, num_heads, splits, padded_d + 2) if splits > 1 else (1,), dtype=torch.float32,
                       device=query.device)
    ticket = out  # unused placeholder without the fused merge
    if tickets is not None:
        _check_tickets(tickets, batch * num_heads, query.device)
        ticket = tickets
    elif fused:
        ticket = torch.zeros((batch, num_heads), dtype=torch.int32, device=query.device)

    # Without a store the new K/V and slots are placeholders (query, seq_lens) a binary compiled
    # without STORE never reads.
    new_k, new_v, slots = (new_key, new_value, slot_mapping) if store else (query, query, seq_lens)
    _paged_decode_kernel[(num_heads, batch, splits)](
        query, key_cache, value_cache, block_table, seq_lens, bias, out, part, ticket, new_k, new_v, slots,
        float(scale), head_dim, max_keys, keys_per_split, max_distance, dense_len,
        query.stride(0), query.stride(1), new_k.stride(0), new_k.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        *bias_strides,
        out.stride(0), out.stride(1),
        BIAS_MODE=bias_mode, BLOCK_SIZE=block_size, BLOCK_N=config.block_n, BLOCK_D=padded_d,
        MERGE_CHUNK=_MERGE_CHUNK, FUSED_COMBINE=fused,
        PREFETCH=_PREFETCH[config.prefetch],
        NUM_STAGES=config.num_stages, PDL=pdl, READY=_READY[keys_ready], STORE=store, num_warps=config.num_warps,
        **launch,
    )  # fmt: skip
    if splits > 1 and not fused:
        _combine_splits_kernel[(batch, num_heads)](
            part, out,
            head_dim, splits, out.stride(0), out.stride(1),
            MERGE_CHUNK=_MERGE_CHUNK, BLOCK_D=padded_d, PDL=pdl,
            num_warps=4, **launch,
        )  # fmt: skip
    return out


# workload sizes: see kernels/__init__.py
@triton.jit(do_not_specialize=["batch", "group", "max_keys", "keys_per_split", "stride_table_batch"])
def _grouped_decode_kernel(
    query_ptr,  # [batch, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_heads, head_dim]
    value_cache_ptr,
    block_table_ptr,  # [batch, max_blocks] int32: row g * group's row serves rows g * group .. g * group + group - 1
    seq_lens_ptr,  # [batch] int32, read at row g * group
    out_ptr,  # [batch, num_heads, head_dim], written with one split (with several and FUSED_COMBINE, by the last split)
    part_ptr,  # [batch, num_heads, num_splits, BLOCK_D + 2] fp32 (several splits; layout: _combine_splits_kernel)
    ticket_ptr,  # [groups, num_heads] int32 zeros, with FUSED_COMBINE: splits of (group, head) done (left at zero)
    scale,
    batch,
    group,
    head_dim,
    max_keys,
    keys_per_split,
    stride_query_batch,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_batch,
    stride_out_batch,
    stride_out_head,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: one (head, group, key split), the group's rows (a source's beams) at once, so
    each K/V tile is read once for all of them; the rows' queries are a [BLOCK_G, BLOCK_D] tile
    (members past the group or the batch are zeros, never stored) and scores and the V sum are
    tensor-core dots. The group size is a run-time value: every group up to BLOCK_G runs one binary."""
    head = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_heads = tl.num_programs(0)
    num_splits = tl.num_programs(2)
    first_row = g * group
    # The step's inputs (seq_lens, tables) and the cross keys were written before the step: they
    # and the first tile load before the wait for the kernel before (which wrote the queries).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + first_row), max_keys)
    start = split * keys_per_split
    end = tl.minimum(seq_len, start + keys_per_split)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    members = tl.arange(0, BLOCK_G)
    rows = first_row + members
    row_mask = (members < group) & (rows < batch)
    slot_args = (block_table_ptr + first_row * stride_table_batch, max_keys, head,
                 stride_cache_block, stride_cache_slot, stride_cache_head)
    kv_args = (key_cache_ptr, value_cache_ptr, end, dims, dim_mask)
    slots = _tile_slots(start, *slot_args, BLOCK_SIZE, BLOCK_N)
    k, v = _load_kv(slots, start, *kv_args, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q_off = rows[:, None] * stride_query_batch + head * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_off, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    c = scale * 1.4426950408889634  # log2 units
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        slots = _tile_slots(tile_start + BLOCK_N, *slot_args, BLOCK_SIZE, BLOCK_N)
        k_next, v_next = _load_kv(slots, tile_start + BLOCK_N, *kv_args, BLOCK_N)
        key_mask = (tile_start + tl.arange(0, BLOCK_N)) < end
        # [BLOCK_G, BLOCK_N] fp32 (masked keys' K rows are zeros)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * c
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * c
        s = tl.where(key_mask[None, :], s, float("-inf"))
        # Every tile holds a live key, so m_new is finite for every member row.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = fast_math.exp2(m_i - m_new)
        p = fast_math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)  # rounded as the tensor cores take it
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
        k, v = k_next, v_next

    # As in `_paged_decode_kernel`: the split count is read at run time, and with the fused merge
    # a group whose keys all lie in the first split is finished by that split.
    whole = num_splits == 1
    if FUSED_COMBINE:
        whole = whole | (seq_len <= keys_per_split)
    if whole:
        if split == 0:
            out_off = rows[:, None] * stride_out_batch + head * stride_out_head + dims[None, :]
            tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & dim_mask[None, :])
    else:
        # An empty split (past seq_len) stores max -inf and sum 0: the merge gives it weight 0.
        part_rows = part_ptr + ((rows * num_heads + head) * num_splits + split) * (BLOCK_D + 2)  # [BLOCK_G]
        tl.store(part_rows[:, None] + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(part_rows + BLOCK_D, m_i, mask=row_mask)
        tl.store(part_rows + BLOCK_D + 1, l_i, mask=row_mask)
        if FUSED_COMBINE:
            # Release / acquire on one counter per (group, head): the last split to finish sees
            # every split's partials and merges them, row by row.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + g * num_heads + head, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                for member in range(0, tl.minimum(group, batch - first_row)):
                    _merge_splits(
                        part_ptr, out_ptr, first_row + member, head, num_heads, num_splits, head_dim,
                        stride_out_batch, stride_out_head, MERGE_CHUNK, BLOCK_D,
                    )  # fmt: skip
                tl.atomic_xchg(ticket_ptr + g * num_heads + head, 0)


# Rows a grouped program serves at most: its queries are one [16, head_dim] tile (tl.dot's least M).
MAX_GROUP = 16


def _key_splits(config: Optional[DecodeConfig], num_splits: Optional[int], covered: int,
                max_keys: int) -> tuple[DecodeConfig, int, int]:
    """(config, splits, keys per split) of a decode launch over `covered` of a table's `max_keys`
    keys: `config` (None: small tiles, for the interpreter: cheap, and they exercise tile edges on
    tiny shapes) with `num_splits` overriding its split count, the keys cut into whole tiles per split."""
    if config is None:
        config = DecodeConfig(block_n=16, num_warps=4)
    splits = config.num_splits if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    keys_per_split = max_keys
    if splits > 1:
        keys_per_split = triton.cdiv(triton.cdiv(covered, splits), config.block_n) * config.block_n
        splits = triton.cdiv(covered, keys_per_split)
    return config, splits, keys_per_split


def grouped_supports(query: torch.Tensor, group: int) -> bool:
    """Whether `grouped_decode` takes these rows: groups of 2 to MAX_GROUP, a half-precision query
    (the step's grouped launch; float32 keeps `paged_decode`), head_dim at most 128."""
    return 1 < group <= MAX_GROUP and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 128


def grouped_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    group: int,
    scale: float = 1.0,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    config: Optional[DecodeConfig] = None,
    pdl: bool = False,
    tickets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`paged_decode` without a bias for rows in consecutive groups of `group` that share keys (a
    beam search's rows of one source, over its cross-attention keys; the last group may be
    shorter): each group's first row's table and seq_len serve the whole group (a promise,
    unchecked), and each K/V tile is read once per group. Like `paged_decode` with
    keys_ready="all": with `pdl` the first tile loads before the wait for the kernel before.

    query: [batch, num_heads, head_dim]; fp16 / bf16 (the scores and the V sum are tensor-core
        dots, the probabilities rounded to the query's dtype for the second, as flash attention
        does) or fp32 (dots in full fp32)
    group: rows per group, 1 to MAX_GROUP
    num_splits, config: overrides of `grouped_config`'s knobs (testing, tuning; block_n,
        num_warps and num_splits are read)
    tickets: [>= groups * num_heads] int32 zeros (left at zero), or None: with several splits the
        last split of each (group, head) merges the partials (else a second kernel does)
    returns: [batch, num_heads, head_dim], query's dtype
    """
    check_decode_args(query, key_cache, value_cache, block_table, seq_lens, None, None)
    batch, num_heads, head_dim = query.shape
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group must be an int from 1 to {MAX_GROUP}, got {group!r}")
    block_size = key_cache.shape[1]
    max_keys = block_table.shape[1] * block_size
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0 or num_heads == 0 or max_keys == 0:
        return out
    groups = triton.cdiv(batch, group)
    padded_d = block_d(head_dim)
    covered = max_keys if max_seq_len is None else max(1, min(max_keys, int(max_seq_len)))
    if config is None and not interpreting():
        config = grouped_config(groups, num_heads, head_dim, covered, _num_sms(query.device))
    config, splits, keys_per_split = _key_splits(config, num_splits, covered, max_keys)
    part = torch.empty((batch, num_heads, splits, padded_d + 2) if splits > 1 else (1,), dtype=torch.float32,
                       device=query.device)
    ticket = out  # unused placeholder without the fused merge
    if tickets is not None:
        _check_tickets(tickets, groups * num_heads, query.device)
        ticket = tickets
    pdl, launch = pdl_options(pdl)
    _grouped_decode_kernel[(num_heads, groups, splits)](
        query, key_cache, value_cache, block_table, seq_lens, out, part, ticket,
        float(scale), batch, group, head_dim, max_keys, keys_per_split,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        BLOCK_G=MAX_GROUP, BLOCK_SIZE=block_size, BLOCK_N=config.block_n, BLOCK_D=padded_d,
        MERGE_CHUNK=_MERGE_CHUNK, FUSED_COMBINE=tickets is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot reads bfloat16 operands as integers: there they go in as float32
        # (the same values; the probabilities still rounded to bfloat16 first).
        DOT_F32=interpreting() and query.dtype == torch.bfloat16, PDL=pdl,
        num_warps=config.num_warps, **launch,
    )  # fmt: skip
    if splits > 1 and tickets is None:
        _combine_splits_kernel[(batch, num_heads)](
            part, out, head_dim, splits, out.stride(0), out.stride(1),
            MERGE_CHUNK=_MERGE_CHUNK, BLOCK_D=padded_d, PDL=pdl, num_warps=4, **launch,
        )  # fmt: skip
    return out
