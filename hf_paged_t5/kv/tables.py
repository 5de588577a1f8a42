"""`BlockTables`: which pool blocks hold each row's tokens. Both caches keep theirs in it.

A `BlockTables` is one row per *slot* (a decoder row, or an encoder source), in numpy:
    table: [slots, capacity] int32, the block ids a slot reads, in token order
    lens:  [slots] int32, the tokens stored per slot
    held:  [slots] int32, the blocks the slot holds a reference to (see `BlockManager`)
`width` is the widest any slot has needed (the kernels' table width); the arrays widen by
doubling and never shrink, so CUDA graphs keyed on a width are reused. Unused entries are 0 and
never read: the kernels stop at each row's length.

A slot's token `p` lives at pool slot `table[slot, p // block_size] * block_size + p % block_size`.

Two ways for a beam to continue from another row:
- shared (`reorder`): the row takes a reference to each of the source row's blocks; a shared,
  partly filled last block is copied into a private one (copy-on-write) before the next token is
  written there. Blocks are opened as tokens need them (`append`). `BatchCache` works this way.
- owned (`own_all`, `reorder_owned`): every row holds its whole width from the start, so the slot
  of every row's every future token is known and a CUDA graph computes it on the device. A
  reorder points the row's table at the source's blocks and copies only the partial block the
  row will write next into the row's own block; a table's reads of another row's blocks take no
  reference (every row's blocks live until the cache frees them all at once). All rows are at
  one length, which the caller keeps and passes (`reorder_owned(..., length)`): `lens` stays 0.
  `PagedEncoderDecoderCache` works this way, also on the device (`reorder_owned_on_device`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .pool import KVPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def widen(table: np.ndarray, width: int) -> np.ndarray:
    """`table` with at least `width` columns (doubling), the new columns 0."""
    if width <= table.shape[1]:
        return table
    out = np.zeros((table.shape[0], max(width, 2 * table.shape[1])), dtype=table.dtype)
    out[:, : table.shape[1]] = table
    return out


class BlockTables:
    """Block tables of `num_slots` slots over `pool` (see the module docstring).

    Allocation grows the pool when it runs short and the pool's config allows (`KVPool.reserve`);
    `num_held` counts the distinct blocks these tables hold.
    """

    def __init__(self, pool: KVPool, num_slots: int, width: int = 1) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.table = np.zeros((num_slots, max(width, 4)), dtype=np.int32)
        self.lens = np.zeros(num_slots, dtype=np.int32)
        self.held = np.zeros(num_slots, dtype=np.int32)
        self.width = max(width, 1)
        self.num_held = 0
        self.owned: Optional[np.ndarray] = None  # [slots, width] int32 once `own_all`
        self.device_table: Optional[torch.Tensor] = None  # the read table, once reordered on a device
        self._device_owned: Optional[torch.Tensor] = None

    # ---- allocation -------------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[int]:
        if count > self.pool.manager.num_free:
            self.pool.reserve(count)
        self.num_held += count
        return self.pool.manager.allocate(count)

    def _drop(self, block_ids: list[int]) -> None:
        manager = self.pool.manager
        manager.free(block_ids)
        self.num_held -= sum(1 for b in block_ids if manager.ref_count(b) == 0)

    def reserve_width(self, width: int) -> None:
        """Make the table at least `width` blocks wide (`width` counts as needed from now on)."""
        self.table = widen(self.table, width)
        self.width = max(self.width, width)

    def open(self, slot: int, num_tokens: int) -> np.ndarray:
        """Give an empty `slot` blocks for `num_tokens` tokens and count them stored; returns their
        pool slots [num_tokens] int64, in order (an encoder source, written at once)."""
        num = blocks_for(num_tokens, self.block_size)
        self.reserve_width(num)
        self.table[slot] = 0  # (a slot out of range raises here, before any block is taken)
        blocks = self._allocate(num)
        self.table[slot, :num] = blocks
        self.lens[slot], self.held[slot] = num_tokens, num
        return self.slots_of(np.full(num_tokens, slot), np.arange(num_tokens))

    def clear(self, slot: int, width: int = 0) -> None:
        """Make `slot` an empty row that may grow to `width` blocks (the width is reserved now)."""
        self.reserve_width(width)
        self.table[slot] = 0
        self.lens[slot] = self.held[slot] = 0

    def own_all(self, width: int) -> None:
        """Owned mode: every slot holds `width` blocks of its own from now on, empty."""
        num_slots = self.table.shape[0]
        blocks = self._allocate(num_slots * width)
        self.owned = np.asarray(blocks, dtype=np.int32).reshape(num_slots, width)
        self.table = self.owned.copy()
        self.width = width
        self.held[:] = width
        self.lens[:] = 0

    def free(self, slot: int) -> None:
        """Drop `slot`'s references to its blocks (a block no table holds returns to the pool)."""
        source = self.owned if self.owned is not None else self.table
        self._drop(source[slot, : self.held[slot]].tolist())
        self.lens[slot] = self.held[slot] = 0

    def free_all(self) -> None:
        for slot in np.flatnonzero(self.held).tolist():
            self.free(slot)
        self.device_table = self._device_owned = None

    def blocks_held(self) -> list[int]:
        """Every block these tables hold a reference to (a shared block once per holder)."""
        source = self.owned if self.owned is not None else self.table
        return [b for slot in np.flatnonzero(self.held).tolist() for b in source[slot, : self.held[slot]].tolist()]

    # ---- tokens -------------------------------------------------------------------------------------
    def slots_of(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool slots [n] int64 of token `positions[i]` of slot `slots[i]` (owned mode: in the
        row's own blocks, where it writes)."""
        table = self.owned if self.owned is not None else self.table
        bs = self.block_size
        return table[slots, positions // bs].astype(np.int64) * bs + positions % bs

    def opening(self, slots: np.ndarray) -> int:
        """How many of `slots` open a new block with their next token (`append`)."""
        return int((self.lens[slots] // self.block_size >= self.held[slots]).sum())

    def append(self, slots: np.ndarray) -> np.ndarray:
        """Store one more token in every slot of `slots`, opening blocks where needed; returns the
        new tokens' pool slots [len(slots)] int64."""
        lens = self.lens[slots]
        opens = lens // self.block_size >= self.held[slots]
        if opens.any():
            opening = slots[opens]
            blocks = self._allocate(len(opening))
            self.reserve_width(int(self.held[opening].max()) + 1)
            self.table[opening, self.held[opening]] = blocks
            self.held[opening] += 1
        out = self.slots_of(slots, lens)
        self.lens[slots] = lens + 1
        return out

    def gather(self, slots: np.ndarray, width: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """(table [len(slots), width] int32, lens [len(slots)] int32) of `slots`, copies."""
        return self.table[slots, : width or self.width], self.lens[slots]  # fancy indexing: copies

    # ---- beams ----------------------------------------------------------------------------------------
    def reorder(self, rows: Sequence[int], sources: Sequence[int],
                copies: Optional[list[tuple[int, int]]] = None) -> None:
        """Shared mode: row `rows[j]` continues from the state row `rows[sources[j]]` had. Full blocks
        are shared by reference count; a shared partial last block is copied now, or, given `copies`,
        its (source, destination) block pair is appended there for the caller to copy with the other
        reorders of the step (`KVPool.copy_blocks` once): a copy's source stays held by the rows
        that share it, and its destination is a block no row has written.

        In numpy for all rows at once (a batch job reorders every beam input's rows each step): the
        references change by their net count per block, then the rows whose last block is partial
        and still shared take private copies, all but its last holder (in row order) where the rows
        hold every reference to it."""
        manager, bs = self.pool.manager, self.block_size
        rows = np.asarray(rows, dtype=np.int64)
        sources = np.asarray(sources, dtype=np.int64)
        old_tables, old_held = self.table[rows], self.held[rows]  # (fancy indexing: copies)
        tables, lens, held = old_tables[sources], self.lens[rows][sources], old_held[sources]
        columns = np.arange(tables.shape[1])
        gained = tables[columns < held[:, None]]
        lost = old_tables[columns < old_held[:, None]]
        ids, inverse = np.unique(np.concatenate([gained, lost]), return_inverse=True)
        deltas = np.bincount(inverse, weights=np.repeat([1, -1], [len(gained), len(lost)]), minlength=len(ids))
        moved = np.flatnonzero(deltas)
        self.num_held -= manager.shift(ids[moved].tolist(), deltas[moved].astype(np.int64).tolist())
        partial = np.flatnonzero((lens % bs != 0) & (held > 0))
        if len(partial):
            last = tables[partial, held[partial] - 1]
            order = np.argsort(last, kind="stable")  # rows grouped by their last block, in row order
            grouped = last[order]
            starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
            rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
            refs = np.array([manager.ref_count(b) for b in grouped.tolist()], dtype=np.int64)
            private_rows = partial[order[rank < refs - 1]]  # a block's first ref - 1 holders copy it
            if len(private_rows):
                shared = tables[private_rows, held[private_rows] - 1].tolist()
                private = self._allocate(len(shared))  # (grows the pool if it must)
                manager.free(shared)  # (each keeps a holder: no block is freed here)
                tables[private_rows, held[private_rows] - 1] = private
                pairs = list(zip(shared, private))
                if copies is not None:
                    copies.extend(pairs)
                else:
                    self.pool.copy_blocks(*zip(*pairs))
        self.table[rows], self.lens[rows], self.held[rows] = tables, lens, held

    def reorder_owned(self, src_rows: np.ndarray, length: int) -> None:
        """Owned mode, all rows at `length` tokens: row r continues from row `src_rows[r]`."""
        table = self.table[src_rows]
        current = length // self.block_size  # the block the next token goes into
        if length % self.block_size:
            # It already holds the source's first tokens: copy them into the row's own block.
            src, dst = table[:, current], self.owned[:, current]
            moved = src != dst
            self.pool.copy_blocks(src[moved], dst[moved])
        table[:, current:] = self.owned[:, current:]
        self.table = table

    def reorder_owned_on_device(self, beam_idx: torch.Tensor, length: int) -> None:
        """`reorder_owned` on `beam_idx`'s device: the read table lives there from the first such
        reorder on (`device_table`; `table` is stale from then on), and the partial block is copied
        for every row (a row continuing from itself copies its block onto itself), so no value of
        `beam_idx` reaches the host."""
        if self.device_table is None:
            self.device_table = torch.from_numpy(self.table).to(beam_idx.device)
        owned = self.owned_on(self.device_table.device)
        table = self.device_table.index_select(0, beam_idx.to(self.device_table.device, torch.long))
        current = length // self.block_size
        if length % self.block_size:
            self.pool.copy_blocks(table[:, current], owned[:, current])
        table[:, current:] = owned[:, current:]
        self.device_table = table

    def owned_on(self, device: torch.device) -> torch.Tensor:
        """Owned mode: [slots, width] int32 on `device`, the blocks each row writes into."""
        if self._device_owned is None or self._device_owned.device != torch.device(device):
            self._device_owned = upload(torch.from_numpy(self.owned), device)
        return self._device_owned


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` without waiting for the device: a plain `.to(cuda)` from
    pageable memory synchronizes the stream, i.e. waits for every queued step. The pinned copy is
    held by PyTorch's host allocator until the transfer has read it."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
