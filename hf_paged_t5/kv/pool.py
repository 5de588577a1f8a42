"""`KVPool`: the persistent per-layer K/V blocks of a patched model, and the step metadata over them.

KV layout, per decoder layer, made once in `KVPool`:
    key_caches[layer], value_caches[layer]: [num_blocks, block_size, num_heads, head_dim]
Block ids index every layer's pool alike, so one `BlockManager` serves all layers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import numpy as np
import torch

from .block_manager import BlockManager, PoolExhaustedError
from ..config import PagedCacheConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer's pool holds, and where."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    head_dim: int


class KVPool:
    """Per-layer K/V block tensors, persistent across `generate()` calls, and their block manager."""

    def __init__(self, config: PagedCacheConfig, specs: Sequence[LayerSpec]) -> None:
        self.config = config
        self.specs = list(specs)
        self.block_size = config.block_size
        self.manager = BlockManager(config.initial_num_blocks)
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        # Bumped whenever the tensors are re-allocated: captured CUDA graphs hold their addresses.
        self.generation = 0
        self._allocate(self.manager.num_blocks)
        # A block no sequence owns: padded rows of a captured decode step write their
        # (discarded) K/V here and read it back, so they never touch a live sequence's blocks.
        (self.scratch_block,) = self.manager.allocate(1)
        self.num_reserved = 1

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    def is_idle(self) -> bool:
        """True when no generate() holds any block (only the reserved scratch block is used)."""
        return self.manager.num_used == self.num_reserved

    def _allocate(self, num_blocks: int, keep: bool = True) -> None:
        """(Re)allocate every layer's tensors with `num_blocks` blocks, copying the old ones if `keep`.

        Consecutive layers with the same spec share one tensor [layers, 2, num_blocks, block_size,
        num_heads, head_dim], so a block copy (beam search) is one gather and one scatter per
        group instead of two per layer; `key_caches[i]` / `value_caches[i]` are views of it.
        """
        old_k, old_v = (self.key_caches, self.value_caches) if keep else ([], [])
        self.key_caches, self.value_caches, self.groups = [], [], []
        self._group_of: list[tuple[int, int]] = []  # per layer: (index in `groups`, its place there)
        for spec, count in _runs(self.specs):
            shape = (count, 2, num_blocks, self.block_size, spec.num_heads, spec.head_dim)
            group = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            self._group_of.extend((len(self.groups), i) for i in range(count))
            self.groups.append(group)
            self.key_caches.extend(group[:, 0].unbind(0))
            self.value_caches.extend(group[:, 1].unbind(0))
        for i, (k, v) in enumerate(zip(old_k, old_v)):
            self.key_caches[i][: k.shape[0]].copy_(k)
            self.value_caches[i][: v.shape[0]].copy_(v)
        self.generation += 1

    def layer_span(self, start: int, stop: int) -> Optional[torch.Tensor]:
        """Layers start..stop-1's K/V as one view [stop - start, 2, num_blocks, block_size, num_heads,
        head_dim] (`key_caches[i]` is `span[i - start, 0]`), or None where they lie in more than one
        group (another device, dtype or head shape between them)."""
        group, first = self._group_of[start]
        if self._group_of[stop - 1] != (group, first + stop - 1 - start):
            return None
        return self.groups[group][first : first + stop - start]

    def bytes_per_block(self) -> int:
        return sum(
            2 * self.block_size * s.num_heads * s.head_dim * torch.finfo(s.dtype).bits // 8 for s in self.specs
        )

    def can_reserve(self, blocks_needed: int) -> bool:
        """Whether `reserve(blocks_needed)` would succeed: enough free blocks, or growth within the cap."""
        if blocks_needed <= self.manager.num_free:
            return True
        cap = self.config.max_num_blocks
        return self.config.grow and (cap is None or self.manager.num_used + blocks_needed <= cap)

    def reserve(self, blocks_needed: int) -> None:
        """Make sure `blocks_needed` blocks are free, growing the pool if the config allows.

        Raises `PoolExhaustedError` (before any work is done) with the numbers and the setting
        to change when the request cannot be served.
        """
        free = self.manager.num_free
        if blocks_needed <= free:
            return
        target = self.manager.num_used + blocks_needed
        cap = self.config.max_num_blocks
        if not self.can_reserve(blocks_needed):
            limit = cap if self.config.grow else self.num_blocks
            raise PoolExhaustedError(
                f"this generate() call needs {blocks_needed} KV blocks of {self.block_size} tokens, but only "
                f"{free} of {self.num_blocks} are free (limit {limit}). Pass a larger pool, e.g. "
                f"patch_model(model, PagedCacheConfig(num_blocks={target}, ...)) or allow growth with "
                f"PagedCacheConfig(grow=True, max_num_blocks=None); or lower the batch size / max_new_tokens."
            )
        # Idle: re-make the pool at the size asked for (nothing to copy, no memory held twice).
        # In use by another call: double it, copying the live blocks.
        idle = self.is_idle()
        new_size = target if idle else max(target, 2 * self.num_blocks)
        if cap is not None:
            new_size = min(new_size, cap)
        logger.info("growing the KV pool from %d to %d blocks", self.num_blocks, new_size)
        try:
            self._allocate(new_size, keep=not idle)
        except torch.OutOfMemoryError as exc:
            if idle:  # the old tensors are gone: put back a pool of the old size
                self._allocate(self.num_blocks, keep=False)
            raise PoolExhaustedError(
                f"growing the KV pool to {new_size} blocks ({new_size * self.bytes_per_block() / 2**30:.2f} GiB) "
                f"ran out of device memory; lower the batch size or max_new_tokens, or set "
                f"PagedCacheConfig(max_num_blocks=...)"
            ) from exc
        self.manager.grow(new_size)

    def copy_blocks(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer; all sources are read before any
        destination is written, so a block may be both (beams swapping places)."""
        if len(src) == 0:
            return
        if isinstance(src, torch.Tensor):  # ids already on a device: no host round trip
            src_ids, dst_ids = src.long(), dst.long()
        else:
            src_ids = torch.as_tensor(np.asarray(src, dtype=np.int64))
            dst_ids = torch.as_tensor(np.asarray(dst, dtype=np.int64))
        for group in self.groups:  # [layers, 2, num_blocks, block_size, num_heads, head_dim]
            s, d = src_ids.to(group.device, non_blocking=True), dst_ids.to(group.device, non_blocking=True)
            group.index_copy_(2, d, group.index_select(2, s))


def _runs(specs: Sequence[LayerSpec]) -> list[tuple[LayerSpec, int]]:
    """Consecutive equal specs as (spec, count)."""
    runs: list[tuple[LayerSpec, int]] = []
    for spec in specs:
        if runs and runs[-1][0] == spec:
            runs[-1] = (spec, runs[-1][1] + 1)
        else:
            runs.append((spec, 1))
    return runs


@dataclasses.dataclass
class StepMetadata:
    """Device tensors for one decoder forward of `num_new` tokens per row (on one device).

    slot_mapping: [rows * num_new] int64 or int32, row-major (row, token)
    self_block_table: [rows, max_self_blocks] int32
    self_seq_lens: [rows] int32, keys per row after this step's tokens are stored
    cross_block_table: [rows, max_cross_blocks] int32 (rows of one source share blocks)
    cross_seq_lens: [rows] int32, real encoder tokens of each row's source
    tickets: [>= rows * num_heads] int32 zeros, or None: counters of split attention (each kernel
        that uses them leaves them at zero); a captured step owns one, so its split attention
        merges its partials in-kernel with no memset per launch
    cross_group: rows per source, consecutive (a generate() call's beams or returned sequences,
        the last group possibly short in a padded step), sharing one cross table row and length:
        cross-attention may read each source's keys once for its rows (`kernels.grouped_decode`);
        1: no such promise
    """

    num_new: int
    slot_mapping: torch.Tensor
    self_block_table: torch.Tensor
    self_seq_lens: torch.Tensor
    cross_block_table: torch.Tensor
    cross_seq_lens: torch.Tensor
    tickets: Optional[torch.Tensor] = None
    cross_group: int = 1
