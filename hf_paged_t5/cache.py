"""`KVPool` (persistent per-layer K/V blocks) and `PagedEncoderDecoderCache` (one generate call's view of it).

KV layout, per decoder layer, made once in `KVPool`:
    key_caches[layer], value_caches[layer]: [num_blocks, block_size, num_heads, head_dim]
Block ids index every layer's pool alike, so one `BlockManager` serves all layers.

A `PagedEncoderDecoderCache` holds two kinds of block tables over that pool:
    self-attention:  one list of blocks per row (row = one beam / returned sequence)
    cross-attention: one list of blocks per *source* sequence, shared by the `expand`
                     rows HF made of it (beams, num_return_sequences): the encoder's K/V
                     is stored once per source, real tokens only.
Beam search forks tables (`reorder_cache`): full blocks are shared by reference count and a
shared partial last block is copied when next written.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache

from .block_manager import BlockManager, PoolExhaustedError
from .config import PagedCacheConfig

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
        """(Re)allocate every layer's tensors with `num_blocks` blocks, copying the old ones if `keep`."""
        old_k, old_v = (self.key_caches, self.value_caches) if keep else ([], [])
        self.key_caches, self.value_caches = [], []
        for i, spec in enumerate(self.specs):
            shape = (num_blocks, self.block_size, spec.num_heads, spec.head_dim)
            # [num_blocks, block_size, num_heads, head_dim]
            k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
            if old_k:
                k[: old_k[i].shape[0]].copy_(old_k[i])
                v[: old_v[i].shape[0]].copy_(old_v[i])
            self.key_caches.append(k)
            self.value_caches.append(v)
        self.generation += 1

    def bytes_per_block(self) -> int:
        return sum(
            2 * self.block_size * s.num_heads * s.head_dim * torch.finfo(s.dtype).bits // 8 for s in self.specs
        )

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
        if not self.config.grow or (cap is not None and target > cap):
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

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer (copy-on-write)."""
        if not src:
            return
        for k, v in zip(self.key_caches, self.value_caches):
            s = torch.tensor(src, device=k.device)
            d = torch.tensor(dst, device=k.device)
            k[d] = k[s]
            v[d] = v[s]


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _table_tensor(tables: list[list[int]], width: int) -> torch.Tensor:
    """[len(tables), width] int32; unused entries point at block 0 and are never read."""
    out = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        if blocks:
            out[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return out


@dataclasses.dataclass
class StepMetadata:
    """Device tensors for one decoder forward of `num_new` tokens per row (on one device).

    slot_mapping: [rows * num_new] int64 or int32, row-major (row, token)
    self_block_table: [rows, max_self_blocks] int32
    self_seq_lens: [rows] int32, keys per row after this step's tokens are stored
    cross_block_table: [rows, max_cross_blocks] int32 (rows of one source share blocks)
    cross_seq_lens: [rows] int32, real encoder tokens of each row's source
    """

    num_new: int
    slot_mapping: torch.Tensor
    self_block_table: torch.Tensor
    self_seq_lens: torch.Tensor
    cross_block_table: torch.Tensor
    cross_seq_lens: torch.Tensor


class PagedEncoderDecoderCache(Cache):
    """The paged KV cache of one `generate()` call, over a persistent `KVPool`.

    Args:
        pool: the model's pool.
        num_sources: source sequences (the user's batch size).
        expand: rows per source (num_beams or num_return_sequences); rows of a source are
            contiguous, as HF's `_expand_inputs_for_generation` lays them out.
        max_self_tokens: decoder tokens each row may reach (sizes the block table width).
    """

    def __init__(self, pool: KVPool, num_sources: int, expand: int, max_self_tokens: int) -> None:
        super().__init__(layers=[])
        self.pool = pool
        self.num_sources = num_sources
        self.expand = expand
        self.num_rows = num_sources * expand
        self.block_size = pool.block_size
        self.max_self_blocks = _blocks_for(max(max_self_tokens, 1), self.block_size)
        self.self_blocks: list[list[int]] = [[] for _ in range(self.num_rows)]
        self.self_lens: list[int] = [0] * self.num_rows
        self.cross_blocks: list[list[int]] = []
        self.cross_lens: list[int] = []
        self.released = False
        self._tables_dirty = True
        self._host: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._device_state: dict[torch.device, dict[str, torch.Tensor]] = {}

    # ---- the transformers.Cache contract -------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.self_lens[0] if self.self_lens else 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def batch_size(self) -> int:
        return self.num_rows

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.pool.specs)

    def __repr__(self) -> str:
        return (
            f"PagedEncoderDecoderCache(rows={self.num_rows}, sources={self.num_sources}, "
            f"decoder_len={self.get_seq_length()}, released={self.released})"
        )

    def update(self, *args, **kwargs):
        raise NotImplementedError(
            "PagedEncoderDecoderCache is filled by hf_paged_t5's patched forward, not by HF attention layers; "
            "call the patched model, or unpatch_model() to use stock HF caches"
        )

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedEncoderDecoderCache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row `r` continues from row `beam_idx[r]`: fork block tables, move no KV."""
        self._check_live()
        src_rows = beam_idx.tolist()
        new_blocks = [self.pool.manager.fork(self.self_blocks[s]) for s in src_rows]
        new_lens = [self.self_lens[s] for s in src_rows]
        for blocks in self.self_blocks:
            self.pool.manager.free(blocks)
        self.self_blocks, self.self_lens = new_blocks, new_lens
        self._tables_dirty = True

    # ---- bookkeeping --------------------------------------------------------------------
    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(
                "this PagedEncoderDecoderCache was released when its generate() call ended; its blocks "
                "belong to later calls now. Start a new generate() instead of reusing the cache."
            )

    @staticmethod
    def blocks_needed(source_lens: Sequence[int], expand: int, max_self_tokens: int, block_size: int) -> int:
        """Upper bound on the blocks one generate() call takes (checked before any work)."""
        cross = sum(_blocks_for(n, block_size) for n in source_lens)
        rows = len(source_lens) * expand
        # + one spare block per row for a copy-on-write of a shared partial block.
        return cross + rows * (_blocks_for(max(max_self_tokens, 1), block_size) + (1 if expand > 1 else 0))

    def store_cross_plan(self, source_lens: Sequence[int]) -> torch.Tensor:
        """Allocate cross blocks per source; returns the slot mapping [sum(source_lens)] int64 (CPU)
        for the packed real encoder tokens, source by source."""
        self._check_live()
        if self.cross_blocks:
            raise RuntimeError("cross-attention K/V were already stored for this cache")
        bs = self.block_size
        slots = []
        for n in source_lens:
            blocks = self.pool.manager.allocate(_blocks_for(n, bs))
            self.cross_blocks.append(blocks)
            self.cross_lens.append(n)
            pos = torch.arange(n)
            slots.append(torch.tensor(blocks, dtype=torch.int64)[pos // bs] * bs + pos % bs)
        self._tables_dirty = True
        return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)

    def begin_step(self, num_new: int) -> torch.Tensor:
        """Reserve slots for `num_new` tokens in every row; returns slot_mapping [rows * num_new] int64 (CPU)."""
        self._check_live()
        bs = self.block_size
        manager = self.pool.manager
        cow_src, cow_dst, slots = [], [], []
        for row in range(self.num_rows):
            blocks, start = self.self_blocks[row], self.self_lens[row]
            end = start + num_new
            if start % bs and manager.ref_count(blocks[-1]) > 1:
                # The partial last block is shared with another beam: copy it before writing.
                new_id = manager.make_private(blocks[-1])
                cow_src.append(blocks[-1])
                cow_dst.append(new_id)
                blocks[-1] = new_id
            missing = _blocks_for(end, bs) - len(blocks)
            if missing > 0:
                blocks.extend(manager.allocate(missing))
            if len(blocks) > self.max_self_blocks:
                self.max_self_blocks = len(blocks)
            for pos in range(start, end):
                slots.append(blocks[pos // bs] * bs + pos % bs)
            self.self_lens[row] = end
            if missing > 0:
                self._tables_dirty = True
        if cow_src:
            self.pool.copy_blocks(cow_src, cow_dst)
            self._tables_dirty = True
        return torch.tensor(slots, dtype=torch.int64)

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU (self_block_table [rows, W] int32, self_seq_lens [rows] int32,
        cross_block_table [rows, Wc] int32, cross_seq_lens [rows] int32); tables rebuilt only when changed."""
        if self._tables_dirty or self._host is None:
            cross_rows = [self.cross_blocks[r // self.expand] for r in range(self.num_rows)]
            cross_lens = [self.cross_lens[r // self.expand] for r in range(self.num_rows)]
            width = max((len(b) for b in self.cross_blocks), default=1)
            self._host = (
                _table_tensor(self.self_blocks, self.max_self_blocks),
                _table_tensor(cross_rows, width),
                torch.tensor(cross_lens, dtype=torch.int32),
            )
            self._device_state.clear()
            self._tables_dirty = False
        self_table, cross_table, cross_lens = self._host
        return self_table, torch.tensor(self.self_lens, dtype=torch.int32), cross_table, cross_lens

    def metadata(self, slot_mapping: torch.Tensor, num_new: int, device: torch.device) -> StepMetadata:
        """Device tensors for the step `begin_step` just planned."""
        self_table, self_lens, cross_table, cross_lens = self.host_tables()
        state = self._device_state.get(device)
        if state is None:
            state = {
                "self_block_table": self_table.to(device),
                "cross_block_table": cross_table.to(device),
                "cross_seq_lens": cross_lens.to(device),
            }
            self._device_state[device] = state
        return StepMetadata(
            num_new=num_new,
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            self_block_table=state["self_block_table"],
            self_seq_lens=self_lens.to(device, non_blocking=True),
            cross_block_table=state["cross_block_table"],
            cross_seq_lens=state["cross_seq_lens"],
        )

    def release(self) -> None:
        """Return every block to the pool. Idempotent; the cache is unusable afterwards."""
        if self.released:
            return
        manager = self.pool.manager
        for blocks in self.self_blocks + self.cross_blocks:
            manager.free(blocks)
        self.self_blocks, self.cross_blocks = [], []
        self._device_state.clear()
        self.released = True
