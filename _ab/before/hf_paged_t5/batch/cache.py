"""`BatchCache`: the paged KV cache of a `BatchGenerator`, whose rows come and go between decode steps.

Unlike `PagedEncoderDecoderCache` (one `generate()` call, a fixed batch), a `BatchCache` lives for a
whole batch job. Requests join it when admitted and leave it the moment they finish, returning their
blocks to the pool at once. It offers what `DecodeRunner.decode` and `graphs.DecodeGraphs.run` need of a
cache: `pool`, `min_graph_rows`, `begin_step`, `host_tables`, `device_self_table` and `metadata`.

Bookkeeping is in numpy over fixed row and source *slots* (a slot is reused after its row leaves):
    _self_table: [max_rows, self_width] int32, block ids of each row's decoder tokens
    _self_lens:  [max_rows] int32, decoder tokens stored per row
    _num_self:   [max_rows] int32, blocks held per row
    _source_of:  [max_rows] int64, the source slot whose encoder K/V a row attends to
    _cross_table: [max_rows, cross_width] int32, block ids of each source's encoder tokens
    _cross_lens: [max_rows] int32, encoder tokens per source
A decode step serves the rows in `order` (row slots), in that order. Unused table entries are 0 and
never read (the kernels stop at each row's length). Widths only grow, so captured CUDA graphs keyed
on them are reused. A row's self-table width is reserved when it joins, for the most tokens it may
hold (`add_row(max_tokens=...)`), not when it first needs it: the width then takes its final bucket
with the first admission round, and the job's steps replay the few graphs of that width (one per
batch bucket) instead of capturing new ones each time a row's length crosses a power of two.

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
from ..model.stacks import upload


MIN_GRAPH_ROWS = 64


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BatchCache:
    """Rows (decoder sequences) and sources (encoder outputs) over a persistent `KVPool`.

    Args:
        pool: the model's pool.
        max_rows: the most rows (and sources) alive at once.
    """

    cross_written_once = False  # sources are admitted (their cross K/V written) between steps

    def __init__(self, pool: KVPool, max_rows: int) -> None:
        self.pool = pool
        # the fewest rows a captured decode graph serves (see the module docstring)
        self.min_graph_rows = min(MIN_GRAPH_ROWS, pool.config.max_graph_batch)
        self.block_size = pool.block_size
        self.max_rows = max_rows
        self._self_table = np.zeros((max_rows, 4), dtype=np.int32)
        self._self_lens = np.zeros(max_rows, dtype=np.int32)
        self._num_self = np.zeros(max_rows, dtype=np.int32)
        self._source_of = np.zeros(max_rows, dtype=np.int64)
        self._cross_table = np.zeros((max_rows, 4), dtype=np.int32)
        self._cross_lens = np.zeros(max_rows, dtype=np.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._free_sources = list(range(max_rows - 1, -1, -1))
        self._live_rows: set[int] = set()
        self._live_sources: set[int] = set()
        self.self_width = 1  # widest self table any row has needed
        self.cross_width = 1
        self.order = np.zeros(0, dtype=np.int64)  # [rows] row slots served by the next step
        self.num_held = 0

    def _allocate(self, count: int) -> list[int]:
        if count > self.pool.manager.num_free:
            self.pool.reserve(count)
        self.num_held += count
        return self.pool.manager.allocate(count)

    def _free(self, block_ids: list[int]) -> None:
        manager = self.pool.manager
        manager.free(block_ids)
        self.num_held -= sum(1 for b in block_ids if manager.ref_count(b) == 0)

    # ---- sources and rows ---------------------------------------------------------------------
    def add_source(self, length: int) -> tuple[int, torch.Tensor]:
        """Allocate blocks for `length` encoder tokens; returns (source slot, slot_mapping [length] int64 CPU)."""
        bs = self.block_size
        num = blocks_for(length, bs)
        blocks = self._allocate(num)
        source = self._free_sources.pop()
        self._live_sources.add(source)
        if num > self._cross_table.shape[1]:
            self._cross_table = _widen(self._cross_table, num)
        self._cross_table[source, :num] = blocks
        self._cross_table[source, num:] = 0
        self._cross_lens[source] = length
        self.cross_width = max(self.cross_width, num)
        pos = np.arange(length)
        slots = np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs
        return source, torch.from_numpy(slots)

    def add_row(self, source: int, max_tokens: int = 0) -> int:
        """A new empty row attending to `source`, which will hold at most `max_tokens` decoder tokens
        (its table width is reserved now; 0: grow when needed); returns its row slot."""
        width = blocks_for(max_tokens, self.block_size)
        if width > self._self_table.shape[1]:
            self._self_table = _widen(self._self_table, width)
        self.self_width = max(self.self_width, width)
        row = self._free_rows.pop()
        self._live_rows.add(row)
        self._source_of[row] = source
        self._self_lens[row] = 0
        self._num_self[row] = 0
        self._self_table[row] = 0
        return row

    def free_row(self, row: int) -> None:
        self._free(self._self_table[row, : self._num_self[row]].tolist())
        self._num_self[row] = 0
        self._live_rows.remove(row)
        self._free_rows.append(row)

    def free_source(self, source: int) -> None:
        num = blocks_for(int(self._cross_lens[source]), self.block_size)
        self._free(self._cross_table[source, :num].tolist())
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
        return int(self._self_lens[row])

    def reorder(self, rows: Sequence[int], sources: Sequence[int]) -> None:
        """Beam search: row `rows[j]` continues from the state that row `rows[sources[j]]` had.

        Full blocks are shared by reference count; a shared partial last block is copied now, before
        the next step writes to it. No other KV moves.
        """
        manager, bs = self.pool.manager, self.block_size
        rows = np.asarray(rows, dtype=np.int64)
        old_tables, old_lens, old_num = self._self_table[rows].copy(), self._self_lens[rows], self._num_self[rows]
        new = [manager.fork(old_tables[s, : old_num[s]].tolist()) for s in sources]
        for j in range(len(rows)):
            self._free(old_tables[j, : old_num[j]].tolist())
        if manager.num_free < len(rows):
            self.pool.reserve(len(rows))  # room for the copies below
        cow_src, cow_dst = [], []
        for row, src, blocks in zip(rows.tolist(), sources, new):
            if old_lens[src] % bs and manager.ref_count(blocks[-1]) > 1:
                private = manager.make_private(blocks[-1])
                self.num_held += 1
                cow_src.append(blocks[-1])
                cow_dst.append(private)
                blocks[-1] = private
            self._self_table[row, : len(blocks)] = blocks
            self._self_lens[row] = old_lens[src]
            self._num_self[row] = len(blocks)
        self.pool.copy_blocks(cow_src, cow_dst)

    # ---- one decode step (the interface of DecodeRunner.decode and DecodeGraphs.run) ---------
    def prepare_step(self) -> None:
        """Make the blocks the next `begin_step` opens free now, growing the pool if needed: growth
        re-allocates the pool tensors, which must not happen inside `DecodeGraphs.run`, between its
        check of the pool's generation and the replay of a graph captured on the old tensors."""
        rows = self.order
        opening = int((self._self_lens[rows] // self.block_size >= self._num_self[rows]).sum())
        if opening > self.pool.manager.num_free:
            self.pool.reserve(opening)

    def begin_step(self, num_new: int) -> torch.Tensor:
        """Reserve the slot of one new token in every row of `order`; returns slot_mapping [rows] int64 (CPU)."""
        if num_new != 1:
            raise ValueError(f"BatchCache decodes one token per row per step, got {num_new}")
        bs, rows = self.block_size, self.order
        lens = self._self_lens[rows]
        starts_block = lens // bs >= self._num_self[rows]  # the new token opens a block
        if starts_block.any():
            opening = rows[starts_block]
            blocks = self.pool.manager.allocate(len(opening))  # free since prepare_step: no growth here
            self.num_held += len(opening)
            width = int(self._num_self[opening].max()) + 1
            if width > self._self_table.shape[1]:
                self._self_table = _widen(self._self_table, width)
            self._self_table[opening, self._num_self[opening]] = blocks
            self._num_self[opening] += 1
            self.self_width = max(self.self_width, width)
        slots = self._self_table[rows, lens // bs].astype(np.int64) * bs + lens % bs
        self._self_lens[rows] = lens + 1
        return torch.from_numpy(slots)

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies for the rows of `order`: (self_block_table [rows, self_width] int32, self_seq_lens
        [rows] int32, cross_block_table [rows, cross_width] int32, cross_seq_lens [rows] int32)."""
        rows = self.order
        sources = self._source_of[rows]
        return (
            torch.from_numpy(self._self_table[rows, : self.self_width]),
            torch.from_numpy(self._self_lens[rows]),
            torch.from_numpy(self._cross_table[sources, : self.cross_width]),
            torch.from_numpy(self._cross_lens[sources]),
        )

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
        )


def _widen(table: np.ndarray, width: int) -> np.ndarray:
    """`table` with at least `width` columns (doubling), new columns 0."""
    new_width = max(width, 2 * table.shape[1])
    out = np.zeros((table.shape[0], new_width), dtype=table.dtype)
    out[:, : table.shape[1]] = table
    return out
