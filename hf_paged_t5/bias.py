"""T5 relative-position bias as small per-head tables indexed by clamped distance.

T5 maps `key_pos - query_pos` to one of `num_buckets` buckets, and every distance past
`max_distance` lands in the last bucket. So a table over distances `0..D` (causal) or
`-D..D` (bidirectional), clamped beyond, reproduces HF's bias exactly. The tables are
built by calling HF's own `compute_bias` of the attention module, so bucketing and the
embedding lookup are HF's code. `D = max_distance`: HF's log-bucketing reaches its last
bucket there (its log ratio is 1 at max_distance and the bucket is clamped to the last one
above), so every longer distance has the bias at D (tests/test_bias.py checks HF's bias to
3 * max_distance). A tight D keeps the encoder kernel's gathering band narrow.
"""

from __future__ import annotations

import torch
from torch import nn


# Attribute set (True) on a table that its owner never writes in place (the patched model's: it
# builds new ones when the weights change), so the prefill kernel may keep the band tiles it
# derives on it even when it is an inference tensor, which has no version counter.
KEEP_BAND_TILES = "_hf_paged_t5_keep_band"


def table_distance(attention: nn.Module) -> int:
    """Largest distance a table for `attention` stores explicitly."""
    return attention.relative_attention_max_distance


def table_distance_of(table: torch.Tensor, causal: bool) -> int:
    """D of a causal [num_heads, D + 1] or bidirectional [num_heads, 2D + 1] table."""
    return table.shape[1] - 1 if causal else (table.shape[1] - 1) // 2


@torch.no_grad()
def causal_bias_table(attention: nn.Module) -> torch.Tensor:
    """Decoder self-attention table, float32 [num_heads, D + 1], index `min(q - k, D)` (float64
    for a float64 model)."""
    d = table_distance(attention)
    # One query at position d over keys 0..d: key k sits at distance d - k.
    values = attention.compute_bias(1, d + 1, past_seen_tokens=d)  # [1, num_heads, 1, d + 1]
    return values[0, :, 0, :].flip(-1).to(_table_dtype(values)).contiguous()


@torch.no_grad()
def bidirectional_bias_table(attention: nn.Module) -> torch.Tensor:
    """Encoder table, float32 [num_heads, 2D + 1], index `clamp(k - q, -D, D) + D` (float64 for
    a float64 model)."""
    d = table_distance(attention)
    # One query at position d over keys 0..2d: key k sits at relative position k - d.
    values = attention.compute_bias(1, 2 * d + 1, past_seen_tokens=d)  # [1, num_heads, 1, 2d + 1]
    return values[0, :, 0, :].to(_table_dtype(values)).contiguous()


def _table_dtype(values: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 model (whose attention the torch backend runs in float64)."""
    return torch.promote_types(values.dtype, torch.float32)
