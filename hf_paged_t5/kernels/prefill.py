"""Varlen flash-attention prefill with T5 bias (Triton twin of `reference.prefill`).

One program handles BLOCK_M queries of one (sequence, head) and streams that sequence's keys
in BLOCK_N tiles with an online softmax (tl.dot in the input dtype, fp32 accumulation, exp2),
so memory stays O(L): no L x L tensor is ever made. The bias comes from the per-head distance
table, from a dense [batch|1, heads|1, L, L] tensor, or is absent. With the bidirectional
table only the key tiles within max_distance of the query block gather per (query, key);
tiles wholly left or right of that band add one scalar (every distance there clamps to the
table's first or last entry). Whole tiles skip the key mask; only the ragged end (and, when
causal, the diagonal) is masked. With `PrefillConfig.toeplitz` the wrapper first widens the
table (`_wide_table_kernel`: every distance a tile can meet, in log2 units, each entry with its
next three), so a gathering tile loads its bias at k - q as 16-byte vectors with no clamp and
no scaling: a Toeplitz tile whose offsets are the same in every tile. With
`PrefillConfig.band_tiles` (bidirectional table) it instead builds every bias tile the band
can hold (`_band_tiles_kernel`: a tile's bias depends only on k_start - q_start, so there are
~2 * max_distance / block_n + 2 of them per head, and one constant tile either side), and a
band tile loads its bias as one dense, coalesced tile; the ragged end, wherever it falls, loads
its tile from that set (one masked copy of the tile step instead of one per place). Launch
knobs are a `PrefillConfig`, picked by `prefill_config`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import ahead, fast_math
from ._checks import block_d, broadcast_strides, check_prefill_args, interpreting
from .launch import PrefillConfig, prefill_config

# BIAS_MODE values.
_NO_BIAS, _TABLE_BIAS, _DENSE_BIAS = 0, 1, 2
# The default band-tile binaries a cold process's pass sent to the compile workers: their
# one-loop twins (the same bits, a shorter compile) run until the workers are done.
_ONE_LOOP_TWINS = ahead.Twins()
# Launches whose one-loop twin runs as fast as the default binary, so that a CUDA graph captured
# while a worker still compiles the default keeps the twin: sequences of at most TWIN_GRAPH_LEN
# tokens, TWIN_GRAPH_TOKENS in all (one H100, `tune_kernels.py --only prefill`, ms per call,
# default / twin: 4 x 77 0.0129 / 0.0123, 4 x 512 0.0292 / 0.0291; 16 x 512 +1.7%, 8 x 1,024 +13%).
TWIN_GRAPH_LEN = 512
TWIN_GRAPH_TOKENS = 2048
# Entries of the widened table written per program of `_wide_table_kernel`.
_WIDE_BLOCK = 1024


@triton.jit(do_not_specialize=["reach"])  # workload sizes: see kernels/__init__.py
def _wide_table_kernel(
    bias_ptr,  # [num_heads, entries] distance table
    wide_ptr,  # [num_heads, 2 * reach + 1, 4] fp32, layout: `_wide_table`
    max_distance,
    reach,
    stride_bias_head,
    stride_bias_key,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat index into one head's [2 * reach + 1, 4]
    distance = cols // 4 + cols % 4 - reach  # k_pos - q_pos
    if CAUSAL:
        index = tl.minimum(tl.maximum(-distance, 0), max_distance)
    else:
        index = tl.minimum(tl.maximum(distance, -max_distance), max_distance) + max_distance
    live = cols < 4 * (2 * reach + 1)
    bias = tl.load(bias_ptr + head * stride_bias_head + index * stride_bias_key, mask=live, other=0.0)
    tl.store(wide_ptr + head * (4 * (2 * reach + 1)) + cols, bias.to(tl.float32) * 1.4426950408889634, mask=live)


@triton.jit(do_not_specialize=["first_offset"])  # workload sizes: see kernels/__init__.py
def _band_tiles_kernel(
    bias_ptr,  # [num_heads, 2 * max_distance + 1] bidirectional distance table
    band_ptr,  # [num_heads, tiles, BLOCK_M, BLOCK_N], the table's dtype, layout: `_band_tiles`
    max_distance,
    first_offset,
    stride_bias_head,
    stride_bias_key,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    distance = first_offset + tile * BLOCK_N + cols - rows  # k_pos - q_pos
    index = tl.minimum(tl.maximum(distance, -max_distance), max_distance) + max_distance
    bias = tl.load(bias_ptr + head * stride_bias_head + index * stride_bias_key)
    out = band_ptr + (head * tl.num_programs(1) + tile) * (BLOCK_M * BLOCK_N)
    tl.store(out + rows * BLOCK_N + cols, bias)


@triton.jit
def _clamped_band_tile(band_head, offset, band_first, band_count, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The prebuilt bias tile of a key tile at `offset` = k_start - q_start, clamped into the set
    (its first and last tiles are the constant ones either side of the band)."""
    index = tl.minimum(tl.maximum(offset - band_first, 0) // BLOCK_N, band_count - 1)
    return band_head + index * (BLOCK_M * BLOCK_N)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    k_start,
    const_bias,
    q_pos,
    seq_len,
    seq,
    head,
    qk_scale,
    max_distance,
    head_dim,
    stride_key_token,
    stride_value_token,
    bias_ptr,
    bias_row_ptr,
    stride_bias_batch,
    stride_bias_head,
    stride_bias_query,
    stride_bias_key,
    diag_ptr,
    band_tile_ptr,
    CAUSAL: tl.constexpr,
    TILE_BIAS: tl.constexpr,
    MASKED: tl.constexpr,
    TOEPLITZ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [k_start, k_start + BLOCK_N); scores in log2 units.

    MASKED: the tile may hold keys past seq_len (or, when CAUSAL, after a query); unmasked
    tiles skip every comparison. TILE_BIAS: 0 none, 1 a gather from the distance table, 2 a
    dense bias tile (these two match BIAS_MODE), 3 one scalar `const_bias` for the whole tile
    (far from the diagonal every distance clamps to the same table entry), 4 the prebuilt band
    tile at `band_tile_ptr`. TOEPLITZ: the gather reads the widened table at `diag_ptr` (its
    entry for k_pos - q_pos = -q_start).
    """
    k_pos = k_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, BLOCK_D)
    # 64-bit scalar tile bases plus 32-bit in-tile offsets: 64-bit offset tiles would cost two
    # registers per element (and spill at BLOCK_D = 128).
    k_start64 = tl.full([], k_start, tl.int64)
    rows = tl.arange(0, BLOCK_N)
    k_ptrs = (k_base + k_start64 * stride_key_token) + (rows[:, None] * stride_key_token + dims[None, :])
    v_ptrs = (v_base + k_start64 * stride_value_token) + (rows[:, None] * stride_value_token + dims[None, :])
    if MASKED or not EVEN_D:
        kv_mask = (k_pos[:, None] < seq_len) & (dims[None, :] < head_dim)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
    if TILE_BIAS == 3:
        s += const_bias
    if TILE_BIAS == 1 and TOEPLITZ:
        # Keys c = 4 * g + e of query row r are at distance d + e with d = k_start - q_start
        # + 4 * g - r, and the widened table holds those four as one 16-byte entry. One scalar
        # base per tile plus offsets that are the same in every tile: no clamp, mask or scaling,
        # and a quarter of the loads (or async copies) of one per element.
        group = tl.arange(0, BLOCK_N // 4)
        lane = tl.arange(0, 4)
        diagonal = 4 * (4 * group[None, :, None] - tl.arange(0, BLOCK_M)[:, None, None]) + lane[None, None, :]
        s += tl.reshape(tl.load(diag_ptr + 4 * k_start + diagonal), [BLOCK_M, BLOCK_N])
    if TILE_BIAS == 1 and not TOEPLITZ:
        # The clamp keeps every index inside the table, so the gather needs no mask.
        if CAUSAL:
            index = tl.minimum(tl.maximum(q_pos[:, None] - k_pos[None, :], 0), max_distance)
        else:
            index = tl.minimum(tl.maximum(k_pos[None, :] - q_pos[:, None], -max_distance), max_distance)
            index += max_distance
        s += tl.load(bias_row_ptr + index * stride_bias_key).to(tl.float32) * 1.4426950408889634
    if TILE_BIAS == 4:
        # A prebuilt band tile (`band_tile_ptr`: this tile's k_start - q_start): a dense,
        # coalesced load, the same values the gather below reads.
        tile_rows = tl.arange(0, BLOCK_M)
        band = tl.load(band_tile_ptr + tile_rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        s += band.to(tl.float32) * 1.4426950408889634
    if TILE_BIAS == 2:
        bias_off = seq.to(tl.int64) * stride_bias_batch + head * stride_bias_head
        bias_off += q_pos[:, None].to(tl.int64) * stride_bias_query + k_pos[None, :] * stride_bias_key
        live_bias = (q_pos[:, None] < seq_len) & (k_pos[None, :] < seq_len)
        s += tl.load(bias_ptr + bias_off, mask=live_bias, other=0.0).to(tl.float32) * 1.4426950408889634
    if MASKED:
        live = k_pos[None, :] < seq_len
        if CAUSAL:
            live = live & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(live, s, float("-inf"))
    # Every row meets a live key in its first tile (key 0), so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = fast_math.exp2(m_i - m_new)
    p = fast_math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["max_seqlen", "reach", "band_first", "band_count"])  # workload sizes: see kernels/__init__.py
def _prefill_kernel(
    query_ptr,  # [total_tokens, num_heads, head_dim]
    key_ptr,  # [total_tokens, num_heads, head_dim]
    value_ptr,  # [total_tokens, num_heads, head_dim]
    cu_seqlens_ptr,  # [batch + 1] int32
    bias_ptr,  # table [num_heads, entries] | dense [batch|1, num_heads|1, L, L] | unused
    wide_ptr,  # [num_heads, 2 * reach + 1, 4] fp32 widened table (TOEPLITZ, layout: `_wide_table`) | unused
    band_ptr,  # [num_heads, band_count, BLOCK_M, BLOCK_N] band tiles (BAND_TILES, layout: `_band_tiles`) | unused
    out_ptr,  # [total_tokens, num_heads, head_dim]
    scale,
    head_dim,
    max_seqlen,
    max_distance,
    reach,
    band_first,
    band_count,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_bias_batch,
    stride_bias_head,
    stride_bias_query,
    stride_bias_key,
    stride_out_token,
    stride_out_head,
    CAUSAL: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TILE_RANGES: tl.constexpr,
    BAND_SPLIT: tl.constexpr,
    TOEPLITZ: tl.constexpr,
    BAND_TILES: tl.constexpr,
    ONE_LOOP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    q_start = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    seq_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    # Clamped to max_seqlen so a caller's wrong bound cannot make the dense bias read out of range.
    seq_len = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1) - tl.load(cu_seqlens_ptr + seq), max_seqlen)
    if q_start >= seq_len:
        return

    q_pos = q_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions within the sequence
    dims = tl.arange(0, BLOCK_D)
    q_mask = (q_pos[:, None] < seq_len) & (dims[None, :] < head_dim)
    q_base = query_ptr + (seq_start + q_start) * stride_query_token + head * stride_query_head
    rows_m = tl.arange(0, BLOCK_M)
    q = tl.load(q_base + rows_m[:, None] * stride_query_token + dims[None, :], mask=q_mask, other=0.0)
    # Scores in log2 units (exp2 is the native instruction); the scale is applied to the fp32
    # scores (rounding a scaled q to bf16 would cost T5's unscaled logits ~0.1 absolute).
    qk_scale = scale * 1.4426950408889634
    k_base = key_ptr + seq_start * stride_key_token + head * stride_key_head
    bias_row_ptr = bias_ptr + head * stride_bias_head  # this head's distance table row
    # This head's widened entry for k_pos - q_pos = -q_start (TOEPLITZ; |k_pos - q_pos| < reach).
    diag_ptr = wide_ptr + head * (4 * (2 * reach + 1)) + 4 * (reach - q_start)
    v_base = value_ptr + seq_start * stride_value_token + head * stride_value_head
    # This head's band tiles (BAND_TILES): tile i holds k_start - q_start = band_first + i * BLOCK_N.
    band_head = band_ptr + head * (band_count * BLOCK_M * BLOCK_N)
    if BIAS_MODE == 1 and not CAUSAL:
        # every distance left / right of the band clamps to the table's first / last entry
        left_bias = tl.load(bias_row_ptr).to(tl.float32) * 1.4426950408889634
        right_bias = tl.load(bias_row_ptr + 2 * max_distance * stride_bias_key).to(tl.float32)
        right_bias = right_bias * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum(seq_len, q_start + BLOCK_M)
    # Loop arguments shared by every tile kind.
    tile_args = (q_pos, seq_len, seq, head, qk_scale, max_distance, head_dim, stride_key_token, stride_value_token)
    bias_args = (
        bias_ptr, bias_row_ptr, stride_bias_batch, stride_bias_head, stride_bias_query, stride_bias_key, diag_ptr,
    )  # fmt: skip
    tail_start = 0
    if TILE_RANGES:
        # Keys [0, full_end) come in whole tiles that need no key mask (nor, when causal, a
        # causal mask: they end before the block's first query).
        full_end = (seq_len // BLOCK_N) * BLOCK_N
        if CAUSAL:
            full_end = tl.minimum(full_end, (q_start // BLOCK_N) * BLOCK_N)
        if BAND_TILES and ONE_LOOP:
            # Every whole tile loads its prebuilt bias tile, the offset clamped into the set
            # (whose first and last tiles are the constant ones either side of the band): one
            # copy of the tile step where the split below has three.
            for k_start in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args,
                    _clamped_band_tile(band_head, k_start - q_start, band_first, band_count, BLOCK_M, BLOCK_N),
                    CAUSAL, 4, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                )  # fmt: skip
        elif BIAS_MODE == 1 and not CAUSAL and BAND_SPLIT:
            # Far from the diagonal every distance clamps to the table's first (keys before
            # the queries) or last entry: only the ~2 * max_distance keys around it gather.
            # A tile is left of that band when k_start + BLOCK_N - 1 - q_start <= -max_distance,
            # right of it when k_start - (q_start + BLOCK_M - 1) >= max_distance.
            left_end = tl.minimum(tl.maximum(q_start - max_distance + 1, 0) // BLOCK_N * BLOCK_N, full_end)
            right_start = tl.cdiv(q_start + BLOCK_M - 1 + max_distance, BLOCK_N) * BLOCK_N
            right_start = tl.maximum(tl.minimum(right_start, full_end), left_end)
            for k_start in tl.range(0, left_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, k_start, left_bias, *tile_args, *bias_args, band_head,
                    CAUSAL, 3, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                )  # fmt: skip
            for k_start in tl.range(left_end, right_start, BLOCK_N, num_stages=NUM_STAGES):
                if BAND_TILES:
                    offset = k_start - q_start
                    band_tile = _clamped_band_tile(band_head, offset, band_first, band_count, BLOCK_M, BLOCK_N)
                    acc, l_i, m_i = _attend_tile(
                        acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args, band_tile,
                        CAUSAL, 4, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                    )  # fmt: skip
                else:
                    acc, l_i, m_i = _attend_tile(
                        acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args, band_head,
                        CAUSAL, 1, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                    )  # fmt: skip
            for k_start in tl.range(right_start, full_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, k_start, right_bias, *tile_args, *bias_args, band_head,
                    CAUSAL, 3, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                )  # fmt: skip
        else:
            for k_start in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args, band_head,
                    CAUSAL, BIAS_MODE, False, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
                )  # fmt: skip
        tail_start = full_end
    # The ragged end (the last partial tile; with CAUSAL the diagonal), or every key.
    if BAND_TILES:
        # At most one tile (tail_start is the last whole tile's end), left of, in or right of the
        # band: its prebuilt bias tile, the offset clamped into the set (whose first and last
        # tiles are the constant ones either side of the band), so the binary holds one masked
        # copy of the tile step, not three.
        for k_start in range(tail_start, kv_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args,
                _clamped_band_tile(band_head, k_start - q_start, band_first, band_count, BLOCK_M, BLOCK_N),
                CAUSAL, 4, True, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
            )  # fmt: skip
    else:
        for k_start in tl.range(tail_start, kv_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, k_start, 0.0, *tile_args, *bias_args, band_head,
                CAUSAL, BIAS_MODE, True, TOEPLITZ, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, INPUT_PRECISION,
            )  # fmt: skip

    out = acc / l_i[:, None]
    out_base = out_ptr + (seq_start + q_start) * stride_out_token + head * stride_out_head
    out_ptrs = out_base + rows_m[:, None] * stride_out_token + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _wide_table(bias_table: torch.Tensor, max_distance: int, reach: int, causal: bool) -> torch.Tensor:
    """The distance table at every k_pos - q_pos = d in (-reach, reach), times log2(e).

    bias_table: [num_heads, entries] (see `prefill`); reach: > every |k_pos - q_pos| a tile
        meets, masked key and query rows included (max_seqlen + the larger tile side)
    returns: [num_heads, 2 * reach + 1, 4] fp32; [h, reach + d, e] is head h's bias at
        distance d + e (the entries for d .. d + 3, so a tile loads four keys at once)
    """
    num_heads = bias_table.shape[0]
    wide = torch.empty((num_heads, 2 * reach + 1, 4), dtype=torch.float32, device=bias_table.device)
    _wide_table_kernel[(num_heads, triton.cdiv(4 * (2 * reach + 1), _WIDE_BLOCK))](
        bias_table, wide, max_distance, reach, bias_table.stride(0), bias_table.stride(1),
        CAUSAL=bool(causal), BLOCK=_WIDE_BLOCK, num_warps=4,
    )  # fmt: skip
    return wide


def band_range(max_distance: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(first, count): the k_start - q_start of every key tile the band loop can meet (bidirectional
    table, q_start a multiple of block_m, itself a multiple of block_n): first, first + block_n, ...,
    count of them. A tile at offset o spans distances o - (block_m - 1) .. o + block_n - 1; left
    of `first` every distance is <= -max_distance, from first + count * block_n on >= max_distance."""
    first = (1 - max_distance) // block_n * block_n
    end = -(-(block_m - 1 + max_distance) // block_n) * block_n
    return first, (end - first) // block_n


def _band_tiles(bias_table: torch.Tensor, max_distance: int, first: int, count: int, block_m: int,
                block_n: int) -> torch.Tensor:
    """Every bias tile the band can hold, in the table's dtype (unscaled).

    returns: [num_heads, count, block_m, block_n]; [h, i, r, c] is head h's bias at distance
        first + i * block_n + c - r, clamped to +-max_distance as T5 does
    """
    num_heads = bias_table.shape[0]
    band = torch.empty((num_heads, count, block_m, block_n), dtype=bias_table.dtype, device=bias_table.device)
    _band_tiles_kernel[(num_heads, count)](
        bias_table, band, max_distance, first, bias_table.stride(0), bias_table.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return band


def _cached_band_tiles(bias_table: torch.Tensor, memo: Optional[dict], max_distance: int, first: int, count: int,
                       block_m: int, block_n: int) -> torch.Tensor:
    """`_band_tiles`, kept in the caller's `memo` for its next call: T5's layers share one table, so
    an encoder that passes the same memo for every layer builds its band tiles once, not once per
    layer (a launch each). Rebuilt when the tile shape or device changes or the table is written in
    place (its version counter moves); never kept while a CUDA graph is being captured (the tiles
    would live in the graph's pool) unless the memo says `capture_scoped` (made for one capture and
    dropped with it), nor for a table made under torch.inference_mode (no version counter).
    Without a memo, built every call. A memo with a `group` (a dict holding `stacked`, the layers'
    tables as the rows of one [layers, num_heads, 2D + 1] tensor) and its `row`: `bias_table` is that
    row, and the first layer to ask builds every row's tiles in one launch, kept in the group."""
    if memo is None or bias_table.is_inference():
        return _band_tiles(bias_table, max_distance, first, count, block_m, block_n)
    group = memo.get("group")
    row = memo["row"] if group is not None and _is_row(group["stacked"], memo["row"], bias_table) else None
    # a row of the group's stacked tables: every row's tiles in one launch, kept in the group
    source, holder = (bias_table, memo) if row is None else (group["stacked"], group)
    key = (source.device, source._version, max_distance, first, count, block_m, block_n)
    kept = holder.get("band")
    if kept is None or kept[0] != key:
        # a [num_heads, 2D + 1] table, or the group's [layers, num_heads, 2D + 1]: its rows as heads
        band = _band_tiles(source.reshape(-1, source.shape[-1]), max_distance, first, count, block_m, block_n)
        kept = (key, band.view(*source.shape[:-1], count, block_m, block_n))
        if memo.get("capture_scoped") or not (source.is_cuda and torch.cuda.is_current_stream_capturing()):
            holder["band"] = kept
    return kept[1] if row is None else kept[1][row]


def _is_row(stacked: torch.Tensor, row: int, table: torch.Tensor) -> bool:
    """Whether `table` is `stacked[row]` itself (the same memory, shape and strides)."""
    view = stacked[row]
    return (table.data_ptr() == view.data_ptr() and table.shape == view.shape and table.stride() == view.stride()
            and table.dtype == view.dtype)


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float = 1.0,
    causal: bool = False,
    bias_table: Optional[torch.Tensor] = None,
    dense_bias: Optional[torch.Tensor] = None,
    config: Optional[PrefillConfig] = None,
    band_memo: Optional[dict] = None,
) -> torch.Tensor:
    """Attention within each packed sequence (varlen, no padding), O(L) memory.

    query, key, value: [total_tokens, num_heads, head_dim], one dtype, sequences back to back
    cu_seqlens: [batch + 1] int32, sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1])
    max_seqlen: host int >= every sequence length (sizes the grid; longer sequences are cut)
    causal: decoder (query attends to keys at or before it) or encoder (all keys)
    bias_table: causal table [num_heads, max_distance + 1] when causal, bidirectional
        table [num_heads, 2 * max_distance + 1] otherwise; or None
    dense_bias: [batch | 1, num_heads | 1, max_seqlen, max_seqlen] indexed by positions
        within the sequence, or None. At most one of bias_table / dense_bias.
    config: optional override of the launch knobs (tuning)
    band_memo: a dict the owner of `bias_table` keeps with it, where the tiles derived from the
        table are kept between calls (`_cached_band_tiles`); None: derived every call
    returns: [total_tokens, num_heads, head_dim], query's dtype
    """
    max_distance = check_prefill_args(query, key, value, cu_seqlens, max_seqlen, causal, bias_table, dense_bias)
    max_seqlen = int(max_seqlen)
    total_tokens, num_heads, head_dim = query.shape
    out = torch.empty((total_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    batch = cu_seqlens.shape[0] - 1
    if total_tokens == 0 or batch == 0 or max_seqlen == 0 or num_heads == 0:
        return out

    if config is None and interpreting():
        # Small tiles: cheap in the interpreter and they exercise tile edges on tiny shapes.
        config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    default = config is None
    if default:
        config = prefill_config(head_dim, query.dtype, max_seqlen)
    if bias_table is not None:
        bias_mode, bias, bias_strides = _TABLE_BIAS, bias_table, [0, bias_table.stride(0), 0, bias_table.stride(1)]
    elif dense_bias is not None:
        bias_mode, bias, bias_strides = _DENSE_BIAS, dense_bias, broadcast_strides(dense_bias)
    else:
        bias_mode, bias, bias_strides = _NO_BIAS, query, [0, 0, 0, 0]
    band_tiles = (config.band_tiles and bias_table is not None and not causal and config.tile_ranges
                  and config.band_split and config.block_m % config.block_n == 0)
    toeplitz = config.toeplitz and bias_table is not None
    wide, reach = bias, 0  # unused placeholders without the widened table
    if toeplitz:
        reach = max_seqlen + max(config.block_m, config.block_n)
        wide = _wide_table(bias_table, max_distance, reach, causal)
    band, band_first, band_count = bias, 0, 0  # unused placeholders without band tiles
    if band_tiles:
        band_first, band_count = band_range(max_distance, config.block_m, config.block_n)
        band_first, band_count = band_first - config.block_n, band_count + 2  # and the constant tile either side
        band = _cached_band_tiles(bias_table, band_memo, max_distance, band_first, band_count, config.block_m, config.block_n)
    # fp32 callers expect fp32 matmuls (HF parity); TF32 would cost ~3 decimal digits.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_seqlen, config.block_m), batch, num_heads)

    def launch(one_loop: bool):
        return _prefill_kernel[grid](
            query, key, value, cu_seqlens, bias, wide, band, out,
            float(scale), head_dim, max_seqlen, max_distance, reach, band_first, band_count,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *bias_strides,
            out.stride(0), out.stride(1),
            CAUSAL=bool(causal), BIAS_MODE=bias_mode, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_D=block_d(head_dim), EVEN_D=block_d(head_dim) == head_dim, NUM_STAGES=config.num_stages,
            TILE_RANGES=config.tile_ranges, BAND_SPLIT=config.band_split, TOEPLITZ=toeplitz, BAND_TILES=band_tiles,
            ONE_LOOP=one_loop, INPUT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip

    if default and band_tiles and not config.one_loop and query.is_cuda and (_ONE_LOOP_TWINS or ahead.compile_only()):
        # a pass, or a launch while the pass's worker compiles the default binary: its one-loop twin
        tensors = (query, key, value, cu_seqlens, bias, band, out)
        signature = (query.device, query.dtype, config, causal, precision, head_dim, max_distance,
                     *(t.stride() for t in tensors), *(t.data_ptr() % 16 for t in tensors))
        in_graph = max_seqlen <= TWIN_GRAPH_LEN and batch * max_seqlen <= TWIN_GRAPH_TOKENS
        _ONE_LOOP_TWINS.launch(signature, launch, in_graph)
    else:
        launch(band_tiles and config.one_loop)
    return out
