"""`PagedEncoderDecoderCache`: one `generate()` call's view of the model's `KVPool`.

Two kinds of block tables over the pool:
    self-attention:  one row of blocks per decoder row (a beam / returned sequence). Each row
                     *owns* `max_self_blocks` blocks, allocated up front, and only ever writes
                     into its own; its table may read full blocks owned by another row.
    cross-attention: one list of blocks per *source* sequence, shared by the `expand` rows HF
                     made of it (beams, num_return_sequences): the encoder's K/V is stored once
                     per source, real tokens only.
HF's `generate()` keeps every row at the same decoder length, so one `length` serves all rows
and a step's slots are one vectorised lookup. Beam search (`reorder_cache`) gathers table
rows; full blocks are then shared read-only, and the partial block each row will write next
is copied into the row's own block (one gather + scatter per pool group, all layers).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..kv.pool import KVPool, LayerSpec, StepMetadata

__all__ = ["KVPool", "LayerSpec", "PagedEncoderDecoderCache", "StepMetadata"]

logger = logging.getLogger(__name__)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PagedEncoderDecoderCache(Cache):
    """The paged KV cache of one `generate()` call, over a persistent `KVPool`.

    Args:
        pool: the model's pool; `blocks_needed(...)` blocks must be free (see `KVPool.reserve`).
        num_sources: source sequences (the user's batch size).
        expand: rows per source (num_beams or num_return_sequences); rows of a source are
            contiguous, as HF's `_expand_inputs_for_generation` lays them out.
        max_self_tokens: decoder tokens each row may reach (sizes the self block tables).
    """

    min_graph_rows = 1  # a call's batch is fixed: its graph serves the smallest bucket holding it
    cross_written_once = True  # its sources' cross K/V are stored once, before the first decode step

    def __init__(self, pool: KVPool, num_sources: int, expand: int, max_self_tokens: int) -> None:
        super().__init__(layers=[])
        self.pool = pool
        self.num_sources = num_sources
        self.expand = expand
        self.num_rows = num_sources * expand
        self.block_size = pool.block_size
        self.max_self_blocks = _blocks_for(max(max_self_tokens, 1), self.block_size)
        self.length = 0  # decoder tokens stored in every row
        # [rows, max_self_blocks] int32: the blocks row r writes into (allocated here, freed by release)
        owned = pool.manager.allocate(self.num_rows * self.max_self_blocks)
        self._owned = np.asarray(owned, dtype=np.int32).reshape(self.num_rows, self.max_self_blocks)
        # [rows, max_self_blocks] int32: the blocks row r reads (after beam reorders, maybe another row's)
        self._self_table = self._owned.copy()
        self.cross_blocks: list[list[int]] = []
        self.cross_lens: list[int] = []
        self.released = False
        self._tables_dirty = True
        self._host: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._device_state: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._device_table: Optional[torch.Tensor] = None  # see `_reorder_on_device`
        self._device_owned: Optional[torch.Tensor] = None

    # ---- the transformers.Cache contract -------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.length

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
            f"decoder_len={self.length}, released={self.released})"
        )

    def update(self, *args, **kwargs):
        raise NotImplementedError(
            "PagedEncoderDecoderCache is filled by hf_paged_t5's patched forward, not by HF attention layers; "
            "call the patched model, or unpatch_model() to use stock HF caches"
        )

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedEncoderDecoderCache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row `r` continues from row `beam_idx[r]`: gather table rows, copy only partial blocks.

        With `beam_idx` on a CUDA device this happens there (`_reorder_on_device`): no host sync.
        """
        self._check_live()
        if beam_idx.shape != (self.num_rows,):
            raise ValueError(f"beam_idx has shape {tuple(beam_idx.shape)}, expected ({self.num_rows},)")
        if beam_idx.device.type == "cuda" or self._device_table is not None:
            self._reorder_on_device(beam_idx)
            return
        src_rows = np.asarray(beam_idx.tolist(), dtype=np.int64)
        table = self._self_table[src_rows]
        current = self.length // self.block_size  # the block the next token goes into
        if self.length % self.block_size:
            # It already holds the source's first tokens: copy them into the row's own block.
            src, dst = table[:, current], self._owned[:, current]
            moved = src != dst
            self.pool.copy_blocks(src[moved], dst[moved])
        table[:, current:] = self._owned[:, current:]
        self._self_table = table
        self._tables_dirty = True

    def _reorder_on_device(self, beam_idx: torch.Tensor) -> None:
        """`reorder_cache` on the device: the self table lives there from the first such reorder on
        (`device_self_table`), and the partial block is copied for every row (a row continuing
        from itself copies its block onto itself), so no value of `beam_idx` reaches the host."""
        if self._device_table is None:
            self._device_table = torch.from_numpy(self._self_table).to(beam_idx.device)
        owned = self.owned_table(self._device_table.device)
        table = self._device_table.index_select(0, beam_idx.to(self._device_table.device, torch.long))
        current = self.length // self.block_size
        if self.length % self.block_size:
            self.pool.copy_blocks(table[:, current], owned[:, current])
        table[:, current:] = owned[:, current:]
        self._device_table = table

    def device_self_table(self) -> Optional[torch.Tensor]:
        """[rows, max_self_blocks] int32 on the device once beams were reordered there (the host
        copy is stale from then on), else None."""
        return self._device_table

    # ---- bookkeeping --------------------------------------------------------------------
    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(
                "this PagedEncoderDecoderCache was released when its generate() call ended; its blocks "
                "belong to later calls now. Start a new generate() instead of reusing the cache."
            )

    @staticmethod
    def blocks_needed(source_lens: Sequence[int], expand: int, max_self_tokens: int, block_size: int) -> int:
        """Blocks one generate() call takes: every row's self blocks plus each source's cross blocks."""
        cross = sum(_blocks_for(n, block_size) for n in source_lens)
        return cross + len(source_lens) * expand * _blocks_for(max(max_self_tokens, 1), block_size)

    def owned_blocks(self) -> list[int]:
        """Every block this cache holds (self blocks it owns, then cross blocks)."""
        return self._owned.reshape(-1).tolist() + [b for blocks in self.cross_blocks for b in blocks]

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
            pos = np.arange(n)
            slots.append(np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs)
        self._tables_dirty = True
        return torch.from_numpy(np.concatenate(slots)) if slots else torch.zeros(0, dtype=torch.int64)

    def advance(self, num_new: int) -> None:
        """Count `num_new` more tokens in every row (their slots are the caller's, e.g. computed on
        the device by `greedy_graph`); raises when the rows' blocks cannot hold them."""
        self._check_live()
        end = self.length + num_new
        capacity = self.max_self_blocks * self.block_size
        if end > capacity:
            raise RuntimeError(
                f"this cache was sized for {capacity} decoder tokens per row (max_new_tokens / max_length of "
                f"the call); a step to {end} tokens does not fit"
            )
        self.length = end

    def begin_step(self, num_new: int) -> torch.Tensor:
        """Slots for `num_new` more tokens in every row; returns slot_mapping [rows * num_new] int64 (CPU)."""
        start = self.length
        self.advance(num_new)
        pos = np.arange(start, self.length)
        slots = self._owned[:, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        return torch.from_numpy(slots.reshape(-1))

    def owned_table(self, device: torch.device) -> torch.Tensor:
        """[rows, max_self_blocks] int32 on `device`: the blocks each row writes into."""
        if self._device_owned is None or self._device_owned.device != torch.device(device):
            self._device_owned = torch.from_numpy(self._owned).to(device)
        return self._device_owned

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU (self_block_table [rows, W] int32, self_seq_lens [rows] int32,
        cross_block_table [rows, Wc] int32, cross_seq_lens [rows] int32); rebuilt only when changed."""
        if self._tables_dirty or self._host is None:
            width = max((len(b) for b in self.cross_blocks), default=1)
            cross = np.zeros((self.num_sources, width), dtype=np.int32)  # unused entries are never read
            for source, blocks in enumerate(self.cross_blocks):
                cross[source, : len(blocks)] = blocks
            lens = np.asarray(self.cross_lens or [0] * self.num_sources, dtype=np.int32)
            self._host = (
                torch.from_numpy(self._self_table.copy()),
                torch.from_numpy(np.repeat(cross, self.expand, axis=0)),
                torch.from_numpy(np.repeat(lens, self.expand)),
            )
            self._device_state.clear()
            self._tables_dirty = False
        self_table, cross_table, cross_lens = self._host
        return self_table, torch.full((self.num_rows,), self.length, dtype=torch.int32), cross_table, cross_lens

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
        device_table = self._device_table
        return StepMetadata(
            num_new=num_new,
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            self_block_table=state["self_block_table"] if device_table is None else device_table.to(device),
            self_seq_lens=self_lens.to(device, non_blocking=True),
            cross_block_table=state["cross_block_table"],
            cross_seq_lens=state["cross_seq_lens"],
        )

    def release(self) -> None:
        """Return every block to the pool. Idempotent; the cache is unusable afterwards."""
        if self.released:
            return
        self.pool.manager.free(self.owned_blocks())
        self.cross_blocks = []
        self._device_state.clear()
        self.released = True
