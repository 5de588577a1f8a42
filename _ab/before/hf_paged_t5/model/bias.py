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

import dataclasses
from typing import Callable

import torch
from torch import nn


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


def layer_bias_modules(stack: nn.Module) -> list[nn.Module]:
    """The attention module whose relative bias each layer of `stack` uses (T5: layer 0's for all;
    UMT5: each layer its own)."""
    first = stack.block[0].layer[0].SelfAttention
    modules = []
    for block in stack.block:
        own = block.layer[0].SelfAttention
        modules.append(own if getattr(own, "has_relative_attention_bias", False) else first)
    return modules


@dataclasses.dataclass
class _StackTables:
    """One stack's tables and what they were built from.

    stamp: (data_ptr, device, dtype, shape) of each weight; snapshot: a flat copy of the weights;
    tables: one per layer; weights: the stack's distinct bias weights
    """

    stamp: tuple
    snapshot: torch.Tensor
    tables: list[torch.Tensor]
    weights: list[torch.Tensor]


def _stamp(weights: list[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), w.device, w.dtype, w.shape) for w in weights)


def _flat_copy(weights: list[torch.Tensor]) -> torch.Tensor:
    """A copy of the weights as one flat tensor (`torch.cat` always allocates)."""
    with torch.no_grad():
        return torch.cat([w.detach().reshape(-1) for w in weights])


class BiasTableCache:
    """The bias tables of one patched model's encoder and decoder, kept across calls and rebuilt
    whenever a weight they derive from changes in any way a user can change it.

    `get` notices a replaced or moved weight (its storage pointer, device, dtype, shape) without a
    host sync. A write in place, also through `.data` (which bumps no version counter), is found by
    `check`, which compares each weight with the copy kept when its tables were built: one host
    sync for all, run once per call, never per decode step. on_rebuild() runs after every rebuild
    (the owner's captured decode steps read the old tables).
    """

    def __init__(self, on_rebuild: Callable[[], None]) -> None:
        self._stacks: dict[str, _StackTables] = {}  # "encoder" / "decoder"
        self._on_rebuild = on_rebuild

    def get(self, stack: nn.Module, causal: bool) -> list[torch.Tensor]:
        """One table per layer of `stack`: causal [num_heads, D + 1] or bidirectional [num_heads, 2D + 1]."""
        key = "decoder" if causal else "encoder"
        modules = layer_bias_modules(stack)
        weights = list({id(m): m.relative_attention_bias.weight for m in modules}.values())
        cached = self._stacks.get(key)
        if cached is not None and cached.stamp == _stamp(weights):
            return cached.tables
        build = causal_bias_table if causal else bidirectional_bias_table
        by_module: dict[int, torch.Tensor] = {}
        # Normal tensors even inside torch.inference_mode: their version counter lets the prefill
        # kernel keep what it derives from a table (its band tiles) until the table changes.
        with torch.inference_mode(False):
            tables = [by_module.setdefault(id(m), build(m)) for m in modules]
        self._stacks[key] = _StackTables(_stamp(weights), _flat_copy(weights), tables, weights)
        self._on_rebuild()
        return tables

    def check(self) -> None:
        """Drop the tables whose weights changed since they were built (`get` rebuilds them)."""
        for key in [k for k, t in self._stacks.items() if t.stamp != _stamp(t.weights)]:
            del self._stacks[key]  # replaced or moved: `get` sees that from the stamp alone
        if not self._stacks:
            return
        changed = [(t.snapshot != _flat_copy(t.weights)).any() for t in self._stacks.values()]
        flags = torch.stack([c.to(changed[0].device) for c in changed]).tolist()
        for key, flag in zip(list(self._stacks), flags):
            if flag:
                del self._stacks[key]
