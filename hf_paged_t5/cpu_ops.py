"""The CPU backend: the kernels' interface in PyTorch, written for speed (`reference.py` is for reading).

Same functions, keyword arguments and results (up to rounding) as `reference.py` and `kernels/`:
`store_kv`, `paged_decode`, `prefill`, `rms_norm`, `gemv`, `gemv_supports`. The reference loops over
rows in Python and builds a bias per row; here every call is a few batched tensor ops:

- `paged_decode` gathers each row's blocks at once ([batch, keys, heads, head_dim], padded to the
  longest row) and runs one `scaled_dot_product_attention` whose additive mask carries the bias
  (gathered from the small table once per call) and the key padding;
- `prefill` pads the packed sequences to [batch, max_seqlen] and runs SDPA per chunk of query rows
  with the bias of relative positions built once per chunk (it is the same for every sequence),
  so its memory is O(batch * heads * chunk * max_seqlen), never O(L^2) per head for long inputs.

Like the reference, a float64 model is computed in float64 (softmax and accumulation in
`promote_types(dtype, float32)`).

KV pool layout: key_cache, value_cache [num_blocks, block_size, num_heads, head_dim].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .reference import gemv, gemv_supports, rms_norm, store_kv

__all__ = ["gemv", "gemv_supports", "paged_decode", "prefill", "rms_norm", "store_kv"]

# Query rows per SDPA call in `prefill`: bounds the [batch, heads, rows, keys] bias + mask.
PREFILL_QUERY_CHUNK = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float = 1.0,
    bias_table: Optional[torch.Tensor] = None,
    dense_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query token per row over that row's paged keys (see `reference.paged_decode`).

    query: [batch, num_heads, head_dim]; block_table: [batch, max_blocks] int32;
    seq_lens: [batch] int32 (>= 1); returns [batch, num_heads, head_dim], query's dtype
    """
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size = key_cache.shape[:2]
    max_len = int(seq_lens.max())
    dtype = _compute_dtype(query.dtype)
    k_pos = torch.arange(max_len, device=query.device)
    lens = seq_lens.to(query.device, torch.long)
    beyond = k_pos[None, :] >= lens[:, None]  # [batch, max_len]: slots past the row's keys
    # Each row's slots, one gather for all rows. A slot past a row's length would read another
    # row's K/V or never-written memory (maybe NaN, which a -inf mask does not cancel: 0 * NaN is
    # NaN), so it reads the row's first key instead, which the mask then leaves out.
    positions = torch.where(beyond, 0, k_pos[None, :])
    blocks = block_table.to(query.device, torch.long).gather(1, positions // block_size)
    slots = blocks * block_size + positions % block_size  # [batch, max_len]

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [batch, heads, max_len, head_dim]
        return cache.reshape(num_blocks * block_size, num_heads, head_dim)[slots].transpose(1, 2).to(dtype)

    k, v = gathered(key_cache), gathered(value_cache)
    mask = torch.zeros(batch, 1, 1, max_len, dtype=dtype, device=query.device)
    mask.masked_fill_(beyond[:, None, None, :], float("-inf"))
    if bias_table is not None:
        max_distance = bias_table.shape[1] - 1
        index = ((lens[:, None] - 1) - k_pos[None, :]).clamp(0, max_distance)  # [batch, max_len]
        mask = mask + bias_table.to(dtype)[:, index].permute(1, 0, 2)[:, :, None, :]
    if dense_bias is not None:
        mask = mask + dense_bias[:, :, None, :max_len].to(dtype)
    out = F.scaled_dot_product_attention(query.to(dtype)[:, :, None, :], k, v, attn_mask=mask, scale=scale)
    return out[:, :, 0, :].to(query.dtype)


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
) -> torch.Tensor:
    """Attention within each packed sequence (see `reference.prefill`).

    query, key, value: [total_tokens, num_heads, head_dim]; cu_seqlens: [batch + 1] int32;
    returns [total_tokens, num_heads, head_dim], query's dtype
    """
    total, num_heads, head_dim = query.shape
    dtype = _compute_dtype(query.dtype)
    device = query.device
    starts = cu_seqlens[:-1].to(device, torch.long)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device, torch.long)
    batch, length = lens.shape[0], max_seqlen
    pos = torch.arange(length, device=device)
    real = pos[None, :] < lens[:, None]  # [batch, length]
    # packed token of each padded slot (clamped into range where the slot is padding)
    index = (starts[:, None] + pos[None, :]).clamp(max=max(total - 1, 0))

    def padded(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim]
        return x.to(dtype)[index].transpose(1, 2)

    q, k, v = padded(query), padded(key), padded(value)
    key_mask = torch.zeros(batch, 1, 1, length, dtype=dtype, device=device)
    key_mask.masked_fill_(~real[:, None, None, :], float("-inf"))
    out = torch.empty(batch, num_heads, length, head_dim, dtype=dtype, device=device)
    for q0 in range(0, length, PREFILL_QUERY_CHUNK):
        q1 = min(q0 + PREFILL_QUERY_CHUNK, length)
        mask = key_mask.expand(batch, 1, q1 - q0, length)
        rel = pos[None, :] - pos[q0:q1, None]  # [chunk, length]: key - query
        if bias_table is not None:
            if causal:
                idx = (-rel).clamp(0, bias_table.shape[1] - 1)
            else:
                d = (bias_table.shape[1] - 1) // 2
                idx = rel.clamp(-d, d) + d
            mask = mask + bias_table.to(dtype)[:, idx][None]
        if dense_bias is not None:
            mask = mask + dense_bias[:, :, q0:q1, :length].to(dtype)
        if causal:
            mask = mask.masked_fill((rel > 0)[None, None], float("-inf"))
        out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], k, v, attn_mask=mask, scale=scale)
    # back to packed order: each real slot's row
    return out.transpose(1, 2)[real].to(query.dtype)
