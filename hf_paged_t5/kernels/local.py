"""Varlen local (sliding-window) attention with T5 bias and optional side keys: LongT5's encoder
(Triton twin of `reference.local_prefill`).

One program handles BLOCK_M queries of one (sequence, head). It streams only the key tiles that
meet the window [q_start - local_radius, q_end + local_radius] of its sequence, masking keys
farther than local_radius and past the sequence's end, with the bias gathered from the
bidirectional distance table. With side keys (transient-global attention) it then streams the
sequence's side keys (one per global block, packed back to back as `cu_globals` says) in BLOCK_G
tiles, with the bias of `side_bias_table` at clamp(g - block_id(query)), in the same online
softmax (tl.dot in the input dtype, fp32 accumulation, exp2). Memory stays O(L): no L x L nor
L x globals tensor is made. Launch knobs are a `LocalConfig`, picked by `local_config`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fast_math
from ._checks import block_d, check_local_args, interpreting
from .launch import LocalConfig, local_config

@triton.jit
def _online_step(acc, l_i, m_i, s, v, INPUT_PRECISION: tl.constexpr):
    """One online-softmax update with scores `s` [BLOCK_M, BLOCK_N] (log2 units, -inf = masked) and
    values `v` [BLOCK_N, BLOCK_D]. A row whose keys so far are all masked keeps m = -inf; its
    exponentials are taken against 0 so that no -inf - -inf (NaN) arises."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = fast_math.exp2(m_i - m_safe)
    p = fast_math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["max_seqlen", "local_radius"])  # workload sizes: see kernels/__init__.py
def _local_prefill_kernel(
    query_ptr,  # [total_tokens, num_heads, head_dim]
    key_ptr,  # [total_tokens, num_heads, head_dim]
    value_ptr,  # [total_tokens, num_heads, head_dim]
    cu_seqlens_ptr,  # [batch + 1] int32
    bias_ptr,  # [num_heads, 2 * max_distance + 1] bidirectional distance table | unused
    side_key_ptr,  # [total_globals, num_heads, head_dim] | unused
    side_value_ptr,  # [total_globals, num_heads, head_dim] | unused
    cu_globals_ptr,  # [batch + 1] int32 | unused
    block_ids_ptr,  # [total_tokens] int32 | unused
    side_bias_ptr,  # [num_heads, 2 * side_max_distance + 1] | unused
    out_ptr,  # [total_tokens, num_heads, head_dim]
    scale,
    head_dim,
    max_seqlen,
    local_radius,
    max_distance,
    side_max_distance,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_bias_head,
    stride_side_key_token,
    stride_side_key_head,
    stride_side_value_token,
    stride_side_value_head,
    stride_side_bias_head,
    stride_out_token,
    stride_out_head,
    HAS_BIAS: tl.constexpr,
    HAS_SIDE: tl.constexpr,
    HAS_SIDE_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    q_start = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    seq_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1) - tl.load(cu_seqlens_ptr + seq), max_seqlen)
    if q_start >= seq_len:
        return

    q_pos = q_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions within the sequence
    dims = tl.arange(0, BLOCK_D)
    q_live = q_pos < seq_len
    q_mask = q_live[:, None] & (dims[None, :] < head_dim)
    rows_m = tl.arange(0, BLOCK_M)
    q_base = query_ptr + (seq_start + q_start) * stride_query_token + head * stride_query_head
    q = tl.load(q_base + rows_m[:, None] * stride_query_token + dims[None, :], mask=q_mask, other=0.0)
    qk_scale = scale * 1.4426950408889634  # scores in log2 units (exp2 is the native instruction)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Local keys: only the tiles meeting [q_start - radius, q_start + BLOCK_M - 1 + radius].
    k_base = key_ptr + seq_start * stride_key_token + head * stride_key_head
    v_base = value_ptr + seq_start * stride_value_token + head * stride_value_head
    bias_row_ptr = bias_ptr + head * stride_bias_head
    k_lo = tl.maximum(q_start - local_radius, 0) // BLOCK_N * BLOCK_N
    k_hi = tl.minimum(q_start + BLOCK_M + local_radius, seq_len)
    rows_n = tl.arange(0, BLOCK_N)
    for k_start in range(k_lo, k_hi, BLOCK_N):
        k_pos = k_start + rows_n
        kv_mask = (k_pos[:, None] < seq_len) & (dims[None, :] < head_dim)
        k_start64 = tl.full([], k_start, tl.int64)
        k = tl.load(k_base + k_start64 * stride_key_token + rows_n[:, None] * stride_key_token + dims[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + k_start64 * stride_value_token + rows_n[:, None] * stride_value_token + dims[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        distance = k_pos[None, :] - q_pos[:, None]
        if HAS_BIAS:
            index = tl.minimum(tl.maximum(distance, -max_distance), max_distance) + max_distance
            s += tl.load(bias_row_ptr + index).to(tl.float32) * 1.4426950408889634
        live = (k_pos[None, :] < seq_len) & (distance <= local_radius) & (distance >= -local_radius)
        s = tl.where(live, s, float("-inf"))
        acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, INPUT_PRECISION)

    if HAS_SIDE:
        # The sequence's side keys (every one of them: the caller passes only the global blocks its
        # real tokens attend), bias at clamp(g - block_id(query)).
        g_first = tl.load(cu_globals_ptr + seq).to(tl.int64)
        num_globals = tl.load(cu_globals_ptr + seq + 1) - tl.load(cu_globals_ptr + seq)
        block_id = tl.load(block_ids_ptr + seq_start + q_pos, mask=q_live, other=0)  # [BLOCK_M]
        sk_base = side_key_ptr + g_first * stride_side_key_token + head * stride_side_key_head
        sv_base = side_value_ptr + g_first * stride_side_value_token + head * stride_side_value_head
        side_row_ptr = side_bias_ptr + head * stride_side_bias_head
        rows_g = tl.arange(0, BLOCK_G)
        for g_start in range(0, num_globals, BLOCK_G):
            g_pos = g_start + rows_g
            g_mask = (g_pos[:, None] < num_globals) & (dims[None, :] < head_dim)
            g_start64 = tl.full([], g_start, tl.int64)
            k = tl.load(sk_base + g_start64 * stride_side_key_token + rows_g[:, None] * stride_side_key_token
                        + dims[None, :], mask=g_mask, other=0.0)
            v = tl.load(sv_base + g_start64 * stride_side_value_token + rows_g[:, None] * stride_side_value_token
                        + dims[None, :], mask=g_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_G]
            if HAS_SIDE_BIAS:
                rel = g_pos[None, :] - block_id[:, None]
                index = tl.minimum(tl.maximum(rel, -side_max_distance), side_max_distance) + side_max_distance
                s += tl.load(side_row_ptr + index).to(tl.float32) * 1.4426950408889634
            s = tl.where(g_pos[None, :] < num_globals, s, float("-inf"))
            acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, INPUT_PRECISION)

    # every real query attends itself, so l_i > 0 on every row that is stored
    out = acc / tl.where(q_live, l_i, 1.0)[:, None]
    out_base = out_ptr + (seq_start + q_start) * stride_out_token + head * stride_out_head
    tl.store(out_base + rows_m[:, None] * stride_out_token + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def local_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    local_radius: int,
    scale: float = 1.0,
    bias_table: Optional[torch.Tensor] = None,
    side_key: Optional[torch.Tensor] = None,
    side_value: Optional[torch.Tensor] = None,
    cu_globals: Optional[torch.Tensor] = None,
    block_ids: Optional[torch.Tensor] = None,
    side_bias_table: Optional[torch.Tensor] = None,
    config: Optional[LocalConfig] = None,
) -> torch.Tensor:
    """Local attention within each packed sequence, plus optional side keys; O(L) memory.

    query, key, value: [total_tokens, num_heads, head_dim], one dtype, sequences back to back
    cu_seqlens: [batch + 1] int32; max_seqlen: host int >= every sequence length
    local_radius: query i attends key j of its sequence iff |i - j| <= local_radius
    bias_table: bidirectional table [num_heads, 2 * max_distance + 1] (index clamp(j - i) + D), or None
    side_key, side_value: [total_globals, num_heads, head_dim], sequence b's side keys at rows
        [cu_globals[b], cu_globals[b + 1]), attended by each of its tokens; None: local only
    cu_globals: [batch + 1] int32; block_ids: [total_tokens] int32, each token's global block
    side_bias_table: [num_heads, 2 * side_max_distance + 1], index clamp(g - block_id) + D, or None
    config: optional override of the launch knobs
    returns: [total_tokens, num_heads, head_dim], query's dtype
    """
    max_distance, side_max_distance = check_local_args(
        query, key, value, cu_seqlens, max_seqlen, local_radius, bias_table, side_key, side_value, cu_globals,
        block_ids, side_bias_table,
    )  # fmt: skip
    max_seqlen = int(max_seqlen)
    total_tokens, num_heads, head_dim = query.shape
    out = torch.empty((total_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    batch = cu_seqlens.shape[0] - 1
    if total_tokens == 0 or batch == 0 or max_seqlen == 0 or num_heads == 0:
        return out
    if config is None and interpreting():
        config = LocalConfig(block_m=16, block_n=16, block_g=16, num_warps=4)  # cheap; tile edges on tiny shapes
    if config is None:
        config = local_config(head_dim, query.dtype)
    has_side = side_key is not None
    bias = bias_table if bias_table is not None else query
    side_bias = side_bias_table if side_bias_table is not None else query
    side_k = side_key if has_side else query
    side_v = side_value if has_side else query
    globals_ = cu_globals if has_side else cu_seqlens
    ids = block_ids if has_side else cu_seqlens
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # fp32 callers expect fp32 matmuls (HF parity)
    grid = (triton.cdiv(max_seqlen, config.block_m), batch, num_heads)
    _local_prefill_kernel[grid](
        query, key, value, cu_seqlens, bias, side_k, side_v, globals_, ids, side_bias, out,
        float(scale), head_dim, max_seqlen, int(local_radius), max_distance, side_max_distance,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        bias.stride(0) if bias_table is not None else 0,
        side_k.stride(0), side_k.stride(1), side_v.stride(0), side_v.stride(1),
        side_bias.stride(0) if side_bias_table is not None else 0,
        out.stride(0), out.stride(1),
        HAS_BIAS=bias_table is not None, HAS_SIDE=has_side, HAS_SIDE_BIAS=has_side and side_bias_table is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_G=config.block_g, BLOCK_D=block_d(head_dim),
        INPUT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
