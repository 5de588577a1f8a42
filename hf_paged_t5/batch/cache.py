"""`BatchCache`: the paged KV cache of a `BatchGenerator`, whose rows come and go between decode steps.

Unlike `PagedEncoderDecoderCache` (one `generate()` call, a fixed batch), a `BatchCache` lives for a
whole batch job. Requests join it when admitted and leave it the moment they finish, returning their
blocks to the pool at once. It offers what `DecodeRunner.decode` and `graphs.DecodeGraphs.run` need of a
cache: `pool`, `min_graph_rows`, `begin_step`, `host_tables`, `device_self_table` and `metadata`.

Bookkeeping is two `BlockTables` (`kv/tables.py`, shared mode) over fixed *slots* (a slot is
reused after its row leaves): `rows` (each row's decoder tokens; beams share full blocks by
reference count) and `sources` (each source's encoder tokens), plus `_source_of` [max_rows] int64,
the source slot whose encoder K/V a row attends to. A decode step serves the rows in `order`
(row slots), in that order. A row's self-table width is reserved when it joins, for the most
tokens it may hold (`add_row(max_tokens=...)`), not when it first needs it: the width then takes
its final bucket with the first admission round, and the job's steps replay the few graphs of
that width (one per batch bucket) instead of capturing new ones each time a row's length crosses
a power of two.

Its decode graphs serve at least `min_graph_rows` rows (`MIN_GRAPH_ROWS`, padded), so a job uses a
few graphs (64, 128, 256, 512 rows) instead of one per power of two down to 1. As a job drains, its
row count passes through small sizes, whose graphs use other kernel configurations (split keys, the
GEMV projections) that must be compiled when first captured (0.4-1.2 s stalls each on an H200);
with this floor a job captures and compiles those few configurations only. Padded rows read and
write only the pool's scratch block; at 64 rows a step costs about what a few rows do (the weights
are read either way).

`num_held` counts the distinct blocks this cache holds, so the generator knows how much of what it
promised its requests is still to be allocated. When the pool runs short, allocation asks the pool
to grow (`KVPool.reserve`), which raises `PoolExhaustedError` where the config forbids it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..kv.pool import KVPool, StepMetadata
from ..kv.tables import BlockTables, blocks_for, upload


MIN_GRAPH_ROWS = 64

__all__ = ["BatchCache", "MIN_GRAPH_ROWS", "blocks_for"]


class BatchCache:
    """Rows (decoder sequences) and sources (encoder outputs) over a persistent `KVPool`.

    Args:
        pool: the model's pool.
        max_rows: the most rows (and sources) alive at once.
    """

    cross_written_once = False  # sources are admitted (their cross K/V written) between steps
    # rows per source, consecutive in `order` (`StepMetadata.cross_group`): 1 for greedy and sampling
    # jobs (their rows in `order` are sorted by source length, not grouped); a beam job sets its beam
    # count, since it orders each input's beams together and keeps them until the input is done
    cross_group = 1

    def __init__(self, pool: KVPool, max_rows: int) -> None:
        self.pool = pool
        # the fewest rows a captured decode graph serves (see the module docstring)
        self.min_graph_rows = min(MIN_GRAPH_ROWS, pool.config.max_graph_batch)
        self.block_size = pool.block_size
        self.max_rows = max_rows
        self.rows = BlockTables(pool, max_rows)
        self.sources = BlockTables(pool, max_rows)
        self._source_of = np.zeros(max_rows, dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._free_sources = list(range(max_rows - 1, -1, -1))
        self._live_rows: set[int] = set()
        self._live_sources: set[int] = set()
        self.order = np.zeros(0, dtype=np.int64)  # [rows] row slots served by the next step

    @property
    def num_held(self) -> int:
        """Distinct blocks this cache holds."""
        return self.rows.num_held + self.sources.num_held

    @property
    def self_width(self) -> int:
        return self.rows.width

    @property
    def cross_width(self) -> int:
        return self.sources.width

    # ---- sources and rows ---------------------------------------------------------------------
    def add_source(self, length: int) -> tuple[int, torch.Tensor]:
        """Allocate blocks for `length` encoder tokens; returns (source slot, slot_mapping [length] int64 CPU)."""
        source = self._free_sources.pop()
        slots = self.sources.open(source, length)
        self._live_sources.add(source)
        return source, torch.from_numpy(slots)

    def add_row(self, source: int, max_tokens: int = 0) -> int:
        """A new empty row attending to `source`, which will hold at most `max_tokens` decoder tokens
        (its table width is reserved now; 0: grow when needed); returns its row slot."""
        row = self._free_rows.pop()
        self.rows.clear(row, blocks_for(max_tokens, self.block_size))
        self._live_rows.add(row)
        self._source_of[row] = source
        return row

    def free_row(self, row: int) -> None:
        self.rows.free(row)
        self._live_rows.remove(row)
        self._free_rows.append(row)

    def free_source(self, source: int) -> None:
        self.sources.free(source)
        self._live_sources.remove(source)
        self._free_sources.append(source)

    def release(self) -> None:
        """Return every block of every live row and source to the pool."""
        for row in list(self._live_rows):
            self.free_row(row)
        for source in list(self._live_sources):
            self.free_source(source)
        self.order = np.zeros(0, dtype=np.int64)

    def set_order(self, rows: Sequence[int]) -> None:
        """The row slots the next decode steps serve, in this order."""
        self.order = np.asarray(rows, dtype=np.int64)

    def self_length(self, row: int) -> int:
        return int(self.rows.lens[row])

    def reorder(self, moves: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Beam search, one step's reorders: for each (rows, sources), row `rows[j]` continues from
        the state that row `rows[sources[j]]` had (`BlockTables.reorder`: full blocks shared, a
        shared partial last block copied). The moves run as one reorder and their copies as one
        `copy_blocks`: a step reorders most of its inputs, and a copy each costs a host-to-device
        transfer and two launches per input."""
        if not moves:
            return
        all_rows: list[int] = []
        all_sources: list[int] = []
        for rows, sources in moves:  # (the moves' rows are disjoint: one reorder of them all)
            all_sources.extend(len(all_rows) + s for s in sources)
            all_rows.extend(rows)
        copies: list[tuple[int, int]] = []
        self.rows.reorder(all_rows, all_sources, copies)
        if copies:
            self.pool.copy_blocks(*zip(*copies))

    # ---- one decode step (the interface of DecodeRunner.decode and DecodeGraphs.run) ---------
    def prepare_step(self) -> None:
        """Make the blocks the next `begin_step` opens free now, growing the pool if needed: growth
        re-allocates the pool tensors, which must not happen inside `DecodeGraphs.run`, between its
        check of the pool's generation and the replay of a graph captured on the old tensors."""
        opening = self.rows.opening(self.order)
        if opening > self.pool.manager.num_free:
            self.pool.reserve(opening)

    def begin_step(self, num_new: int) -> torch.Tensor:
        """Reserve the slot of one new token in every row of `order`; returns slot_mapping [rows] int64 (CPU)."""
        if num_new != 1:
            raise ValueError(f"BatchCache decodes one token per row per step, got {num_new}")
        return torch.from_numpy(self.rows.append(self.order))  # blocks free since prepare_step: no growth

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies for the rows of `order`: (self_block_table [rows, self_width] int32, self_seq_lens
        [rows] int32, cross_block_table [rows, cross_width] int32, cross_seq_lens [rows] int32)."""
        self_table, self_lens = self.rows.gather(self.order)
        cross_table, cross_lens = self.sources.gather(self._source_of[self.order])
        return tuple(torch.from_numpy(t) for t in (self_table, self_lens, cross_table, cross_lens))

    def device_self_table(self) -> None:
        """None: a `BatchCache`'s block tables live on the host (its beam reorders are made there)."""
        return None

    def metadata(self, slot_mapping: torch.Tensor, num_new: int, device: torch.device) -> StepMetadata:
        """Device tensors for the step `begin_step` just planned (the eager path; graphs copy their own)."""
        self_table, self_lens, cross_table, cross_lens = (upload(t, device) for t in self.host_tables())
        return StepMetadata(
            num_new=num_new,
            slot_mapping=upload(slot_mapping, device),
            self_block_table=self_table,
            self_seq_lens=self_lens,
            cross_block_table=cross_table,
            cross_seq_lens=cross_lens,
            cross_group=self.cross_group,
        )
