"""`PagedEncoderDecoderCache`: one `generate()` call's view of the model's `KVPool`.

Two `BlockTables` over the pool (`kv/tables.py`):
    self-attention:  one row of blocks per decoder row (a beam / returned sequence), in owned
                     mode: each row owns `max_self_blocks` blocks, allocated up front, and only
                     ever writes into its own; its table may read full blocks owned by another row.
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
from ..kv.tables import BlockTables, blocks_for, upload

__all__ = ["KVPool", "LayerSpec", "PagedEncoderDecoderCache", "StepMetadata"]

logger = logging.getLogger(__name__)


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
        # rows of a source are consecutive and share its cross table row: `StepMetadata.cross_group`.
        # With one source the row kernel stays: its rows' second reads of the same keys hit L2, and
        # one launch per row spreads over more programs (1 x 4 beams replayed 3.8% slower grouped
        # on an H100, 8 x 4 7-14% faster; docs/performance.md)
        self.cross_group = expand if num_sources > 1 else 1
        self.num_rows = num_sources * expand
        self.block_size = pool.block_size
        self.max_self_blocks = blocks_for(max(max_self_tokens, 1), self.block_size)
        self.length = 0  # decoder tokens stored in every row
        # rows own max_self_blocks blocks each, allocated here, freed by release (owned mode)
        self.rows = BlockTables(pool, self.num_rows)
        self.rows.own_all(self.max_self_blocks)
        self.sources = BlockTables(pool, num_sources)  # cross blocks, one slot per source
        self.cross_stored = False
        self.released = False
        self._source_of_row = np.arange(self.num_rows) // expand
        self._tables_dirty = True
        self._host: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._device_state: dict[torch.device, dict[str, torch.Tensor]] = {}

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

        With `beam_idx` on a CUDA device this happens there (`BlockTables.reorder_owned_on_device`):
        no host sync.
        """
        self._check_live()
        if beam_idx.shape != (self.num_rows,):
            raise ValueError(f"beam_idx has shape {tuple(beam_idx.shape)}, expected ({self.num_rows},)")
        if beam_idx.device.type == "cuda" or self.rows.device_table is not None:
            self.rows.reorder_owned_on_device(beam_idx, self.length)
        else:
            self.rows.reorder_owned(np.asarray(beam_idx.tolist(), dtype=np.int64), self.length)
            self._tables_dirty = True

    def device_self_table(self) -> Optional[torch.Tensor]:
        """[rows, max_self_blocks] int32 on the device once beams were reordered there (the host
        copy is stale from then on), else None."""
        return self.rows.device_table

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
        cross = sum(blocks_for(n, block_size) for n in source_lens)
        return cross + len(source_lens) * expand * blocks_for(max(max_self_tokens, 1), block_size)

    def owned_blocks(self) -> list[int]:
        """Every block this cache holds (self blocks it owns, then cross blocks)."""
        return self.rows.blocks_held() + self.sources.blocks_held()

    def source_blocks(self, source: int) -> tuple[list[int], int]:
        """(cross block ids, encoder tokens stored) of one source."""
        held = int(self.sources.held[source])
        return self.sources.table[source, :held].tolist(), int(self.sources.lens[source])

    def store_cross_plan(self, source_lens: Sequence[int]) -> torch.Tensor:
        """Allocate cross blocks per source; returns the slot mapping [sum(source_lens)] int64 (CPU)
        for the packed real encoder tokens, source by source."""
        self._check_live()
        if self.cross_stored:
            raise RuntimeError("cross-attention K/V were already stored for this cache")
        slots = [self.sources.open(source, n) for source, n in enumerate(source_lens)]
        self.cross_stored = True
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
        self.length = end  # every row's (the owned tables' `lens` are not kept: see kv/tables.py)

    def begin_step(self, num_new: int) -> torch.Tensor:
        """Slots for `num_new` more tokens in every row; returns slot_mapping [rows * num_new] int64 (CPU)."""
        start = self.length
        self.advance(num_new)
        rows = np.repeat(np.arange(self.num_rows), num_new)
        positions = np.tile(np.arange(start, self.length), self.num_rows)
        return torch.from_numpy(self.rows.slots_of(rows, positions))

    def owned_table(self, device: torch.device) -> torch.Tensor:
        """[rows, max_self_blocks] int32 on `device`: the blocks each row writes into."""
        return self.rows.owned_on(device)

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU (self_block_table [rows, W] int32, self_seq_lens [rows] int32,
        cross_block_table [rows, Wc] int32, cross_seq_lens [rows] int32); rebuilt only when changed."""
        if self._tables_dirty or self._host is None:
            self_table, _ = self.rows.gather(np.arange(self.num_rows))
            cross_table, cross_lens = self.sources.gather(self._source_of_row)
            self._host = tuple(torch.from_numpy(t) for t in (self_table, cross_table, cross_lens))
            self._device_state.clear()
            self._tables_dirty = False
        self_table, cross_table, cross_lens = self._host
        return self_table, torch.full((self.num_rows,), self.length, dtype=torch.int32), cross_table, cross_lens

    def metadata(self, slot_mapping: torch.Tensor, num_new: int, device: torch.device) -> StepMetadata:
        """Device tensors for the step `begin_step` just planned."""
        self_table, self_lens, cross_table, cross_lens = self.host_tables()
        state = self._device_state.get(device)
        if state is None:
            state = {name: upload(t, device) for name, t in (
                ("self_block_table", self_table), ("cross_block_table", cross_table), ("cross_seq_lens", cross_lens))}
            self._device_state[device] = state
        device_table = self.rows.device_table
        return StepMetadata(
            num_new=num_new,
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            self_block_table=state["self_block_table"] if device_table is None else device_table.to(device),
            self_seq_lens=self_lens.to(device, non_blocking=True),
            cross_block_table=state["cross_block_table"],
            cross_seq_lens=state["cross_seq_lens"],
            cross_group=self.cross_group,
        )

    def release(self) -> None:
        """Return every block to the pool. Idempotent; the cache is unusable afterwards."""
        if self.released:
            return
        self.rows.free_all()
        self.sources.free_all()
        self._device_state.clear()
        self.released = True
