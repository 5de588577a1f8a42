"""T5 relative-position bias as small per-head tables indexed by clamped distance.

T5 maps `key_pos - query_pos` to one of `num_buckets` buckets, and every distance past
`max_distance` lands in the last bucket. So a table over distances `0..D` (causal) or
`-D..D` (bidirectional), clamped beyond, reproduces HF's bias exactly. The tables are
built by calling HF's own `compute_bias` of the attention module, so bucketing and the
embedding lookup are HF's code. `D = max_distance`: HF's log-bucketing reaches its last
bucket there (its log ratio is 1 at max_distance and the bucket is clamped to the last one
above), so every longer distance has the bias at D (tests/test_bias.py checks HF's bias to
3 * max_distance). A tight D keeps the encoder kernel's gathering band narrow.

LongT5's encoder (local and transient-global attention) has the same bidirectional table for its
local keys, built from HF's `compute_bias(block_length)` of those modules, and, for
transient-global attention, a second one of the same layout for its side (global) keys: layer 0's
`global_relative_attention_bias` at the bucket of `global_block - block_id(query)`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

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


@torch.no_grad()
def bidirectional_buckets(attention: nn.Module) -> torch.Tensor:
    """[2D + 1] int64 on the weight's device: the bucket HF's own `compute_bias` looks up for each
    relative position -D..D (the input its `relative_attention_bias` embedding is called with), so
    that `gathered_table` rebuilds `bidirectional_bias_table` from the weight in two kernels."""
    d = table_distance(attention)
    seen = []
    handle = attention.relative_attention_bias.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    try:
        attention.compute_bias(1, 2 * d + 1, past_seen_tokens=d)
    finally:
        handle.remove()
    return seen[-1].reshape(-1)


def gathered_table(attention: nn.Module, buckets: torch.Tensor) -> torch.Tensor:
    """`bidirectional_bias_table(attention)` as a lookup of `bidirectional_buckets` in the weight:
    no host work, so a captured CUDA graph rebuilds it from the weight at every replay."""
    weight = attention.relative_attention_bias.weight
    return weight.detach().index_select(0, buckets).T.to(_table_dtype(weight)).contiguous()


def stacked_gathered_tables(attentions: list[nn.Module], buckets: torch.Tensor) -> torch.Tensor:
    """`gathered_table` of each of `attentions` (their embeddings of one shape, dtype and device,
    all looked up at the same `buckets`) as the rows of one [len(attentions), num_heads, 2D + 1]
    tensor, the same values: three kernels for all of them (the weights stacked, one lookup, one
    cast into place), not two per module. A captured UMT5 encoder rebuilds its 24 tables so."""
    weights = torch.stack([a.relative_attention_bias.weight.detach() for a in attentions])  # [n, buckets, heads]
    looked_up = weights.index_select(1, buckets).transpose(1, 2)
    return looked_up.to(_table_dtype(weights), memory_format=torch.contiguous_format)


@torch.no_grad()
def local_bias_table(attention: nn.Module) -> torch.Tensor:
    """LongT5 local / transient-global encoder table, float32 [num_heads, 2D + 1], index
    `clamp(k - q, -D, D) + D`, as `bidirectional_bias_table` (float64 for a float64 model)."""
    d = table_distance(attention)
    # HF's window of block_length d + 1: its first query sits at d + 1 over keys 0 .. 3d + 2, so
    # keys 1 .. 2d + 1 are at relative positions -d .. d.
    values = attention.compute_bias(d + 1)  # [1, 1, num_heads, d + 1, 3 * (d + 1)]
    return values[0, 0, :, 0, 1 : 2 * d + 2].to(_table_dtype(values)).contiguous()


@torch.no_grad()
def side_bias_table(attention: nn.Module) -> torch.Tensor:
    """LongT5 transient-global side table, float32 [num_heads, 2D + 1], index
    `clamp(g - block_id, -D, D) + D` (g: the side key's global block, block_id: the query's), from
    HF's own bucketing and `global_relative_attention_bias` (float64 for a float64 model)."""
    d = table_distance(attention)
    embedding = attention.global_relative_attention_bias
    relative = torch.arange(-d, d + 1, device=embedding.weight.device)
    buckets = attention._relative_position_bucket(
        relative, bidirectional=not attention.is_decoder, num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance,
    )  # fmt: skip
    values = embedding(buckets)  # [2d + 1, num_heads]
    return values.T.to(_table_dtype(values)).contiguous()


def _table_dtype(values: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 model (whose attention the torch backend runs in float64)."""
    return torch.promote_types(values.dtype, torch.float32)


# The self-attention module's name in a block's first layer: T5's, LongT5's local and transient-global
SELF_ATTENTION_NAMES = ("SelfAttention", "LocalSelfAttention", "TransientGlobalSelfAttention")


def self_attention(layer: nn.Module) -> nn.Module:
    """The self-attention module of a block's first layer (see SELF_ATTENTION_NAMES)."""
    for name in SELF_ATTENTION_NAMES:
        if hasattr(layer, name):
            return getattr(layer, name)
    raise TypeError(f"{type(layer).__name__} has none of {', '.join(SELF_ATTENTION_NAMES)}")


def is_local(attention: nn.Module) -> bool:
    """Whether `attention` is LongT5's local or transient-global encoder attention."""
    return hasattr(attention, "local_radius")


def layer_bias_modules(stack: nn.Module) -> list[nn.Module]:
    """The attention module whose relative bias each layer of `stack` uses (T5, LongT5: layer 0's
    for all; UMT5: each layer its own)."""
    first = self_attention(stack.block[0].layer[0])
    modules = []
    for block in stack.block:
        own = self_attention(block.layer[0])
        modules.append(own if getattr(own, "has_relative_attention_bias", False) else first)
    return modules


@dataclasses.dataclass
class _StackTables:
    """One stack's tables and what they were built from.

    stamp: (data_ptr, device, dtype, shape) of each weight; snapshot: a flat copy of the weights;
    tables: one per layer; weights: the stack's distinct bias weights; memos: one per layer, a
    dict the prefill kernel keeps what it derives from that layer's table in (layers sharing a
    table share its memo), dropped with the tables
    """

    stamp: tuple
    snapshot: torch.Tensor
    tables: list[torch.Tensor]
    weights: list[torch.Tensor]
    memos: list[dict]


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
        self._stacks: dict[str, _StackTables] = {}  # "encoder" / "decoder" / "encoder_side"
        self._on_rebuild = on_rebuild

    def get(self, stack: nn.Module, causal: bool) -> list[torch.Tensor]:
        """One table per layer of `stack`: causal [num_heads, D + 1] or bidirectional [num_heads, 2D + 1]
        (LongT5's encoder: the table of its local keys)."""
        modules = layer_bias_modules(stack)
        if causal:
            build = causal_bias_table
        else:
            build = local_bias_table if is_local(modules[0]) else bidirectional_bias_table
        return self._get("decoder" if causal else "encoder", modules, "relative_attention_bias", build)

    def side_tables(self, stack: nn.Module) -> Optional[list[torch.Tensor]]:
        """LongT5 transient-global encoder: one side table per layer ([num_heads, 2D + 1], see
        `side_bias_table`); None for a stack without side keys."""
        modules = layer_bias_modules(stack)
        if not hasattr(modules[0], "global_relative_attention_bias"):
            return None
        return self._get("encoder_side", modules, "global_relative_attention_bias", side_bias_table)

    def _get(self, key: str, modules: list[nn.Module], weight_name: str, build) -> list[torch.Tensor]:
        weights = list({id(m): getattr(m, weight_name).weight for m in modules}.values())
        cached = self._stacks.get(key)
        if cached is not None and cached.stamp == _stamp(weights):
            return cached.tables
        by_module: dict[int, torch.Tensor] = {}
        # Normal tensors even inside torch.inference_mode: with a version counter, the prefill
        # kernel keeps what it derives from a table (its band tiles, in the layer's memo).
        # (T5's layers share the first layer's module: its table is built once, not once per layer)
        with torch.inference_mode(False):
            for m in modules:
                if id(m) not in by_module:
                    by_module[id(m)] = build(m)
        tables = [by_module[id(m)] for m in modules]
        memo_of: dict[int, dict] = {}
        memos = [memo_of.setdefault(id(m), {}) for m in modules]
        self._stacks[key] = _StackTables(_stamp(weights), _flat_copy(weights), tables, weights, memos)
        self._on_rebuild()
        return tables

    def memos(self, stack: nn.Module, causal: bool) -> list[dict]:
        """One dict per layer of `stack` for the prefill kernel's derived tiles (see `_StackTables`),
        kept as long as the tables `get` returns."""
        self.get(stack, causal)
        return self._stacks["decoder" if causal else "encoder"].memos

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
