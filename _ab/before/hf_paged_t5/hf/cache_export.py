"""HF's own `EncoderDecoderCache`, filled from a paged cache's blocks, for outputs that hand one back.

With `return_dict_in_generate=True`, `generate()` returns its cache (`past_key_values` /
`cache`) so that a caller can continue from it. The paged cache's blocks go back to the pool
when the call ends, so the output gets what stock HF would have returned instead: a
`DynamicCache` pair with each decoder row's self-attention K/V (the tokens the call stored)
and each row's cross-attention K/V laid out over the encoder's padded positions as HF lays
them out (positions the mask hides hold zeros; HF holds K/V of padding there, which it never
reads).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from .cache import PagedEncoderDecoderCache


def replace_paged_cache(result: Any, cache: PagedEncoderDecoderCache, encoder_mask: Optional[torch.Tensor],
                        source_len: int) -> Any:
    """`result` (generate()'s return value) with every reference to `cache` replaced by the
    equivalent HF cache; a plain tensor result is returned as it is."""
    if not isinstance(result, dict):
        return result
    keys = [key for key, value in result.items() if value is cache]
    if keys:
        exported = to_hf_cache(cache, encoder_mask, source_len)
        for key in keys:
            result[key] = exported
    return result


def _rows_of(pool_layer: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, num_heads, length, head_dim] of the first `length` slots the rows of `table` read.

    pool_layer: [num_blocks, block_size, num_heads, head_dim]; table: [rows, blocks] int
    """
    rows, blocks = table.shape
    picked = pool_layer[table.to(pool_layer.device).long()]  # [rows, blocks, block_size, heads, dim]
    picked = picked.reshape(rows, blocks * pool_layer.shape[1], *pool_layer.shape[2:])[:, :length]
    return picked.permute(0, 2, 1, 3).contiguous()


@torch.no_grad()
def to_hf_cache(cache: PagedEncoderDecoderCache, encoder_mask: Optional[torch.Tensor],
                source_len: int) -> EncoderDecoderCache:
    """An `EncoderDecoderCache` holding what `cache` holds, in HF's layout.

    encoder_mask: [sources or rows, source_len] the call's attention_mask (None: no padding)
    source_len: the encoder's padded input length
    """
    pool, length = cache.pool, cache.length
    device_table = cache.device_self_table()
    self_table = device_table if device_table is not None else cache.host_tables()[0]
    self_table = self_table[:, : -(-length // cache.block_size)] if length else self_table[:, :0]
    if encoder_mask is None:
        encoder_mask = torch.ones(cache.num_sources, source_len, dtype=torch.long)
    elif encoder_mask.shape[0] != cache.num_sources:
        encoder_mask = encoder_mask[:: cache.expand]
    real = encoder_mask.bool().cpu()
    self_part, cross_part = DynamicCache(), DynamicCache()
    for i, (keys, values) in enumerate(zip(pool.key_caches, pool.value_caches)):
        self_part.update(_rows_of(keys, self_table, length), _rows_of(values, self_table, length), i)
        cross_k, cross_v = (_cross_rows(layer, cache, real) for layer in (keys, values))
        cross_part.update(cross_k, cross_v, i)
    return EncoderDecoderCache(self_part, cross_part)


def _cross_rows(pool_layer: torch.Tensor, cache: PagedEncoderDecoderCache, real: torch.Tensor) -> torch.Tensor:
    """[rows, num_heads, source_len, head_dim]: each source's stored encoder K (or V) at the
    positions of its real tokens, zeros elsewhere, repeated for the source's `expand` rows.

    real: [sources, source_len] bool (CPU)
    """
    sources, source_len = real.shape
    heads, dim = pool_layer.shape[2:]
    out = pool_layer.new_zeros(sources, source_len, heads, dim)
    for source, (blocks, n) in enumerate(zip(cache.cross_blocks, cache.cross_lens)):
        ids = torch.tensor(blocks, dtype=torch.long, device=pool_layer.device)
        stored = pool_layer[ids].reshape(-1, heads, dim)[:n]  # the source's real tokens, in order
        out[source, real[source].nonzero().squeeze(1).to(pool_layer.device)] = stored
    return out.permute(0, 2, 1, 3).repeat_interleave(cache.expand, dim=0).contiguous()
