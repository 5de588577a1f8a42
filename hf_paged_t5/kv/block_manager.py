"""`BlockManager`: which KV blocks are free, and how many block tables hold each one.

Pure bookkeeping over block ids `0 .. num_blocks - 1`; it never touches a tensor. The same
ids index every decoder layer's pool, so one manager serves all layers.
"""

from __future__ import annotations

from collections import deque


class PoolExhaustedError(RuntimeError):
    """Raised when the pool has fewer free blocks than a request needs."""


class BlockManager:
    """Free list and reference counts of a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def grow(self, num_blocks: int) -> None:
        """Add blocks `self.num_blocks .. num_blocks - 1` (the pool tensors grew)."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"cannot shrink the pool from {self.num_blocks} to {num_blocks} blocks")
        self._free.extend(range(self.num_blocks, num_blocks))
        self._ref_counts.extend([0] * (num_blocks - self.num_blocks))
        self.num_blocks = num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with reference count 1."""
        if count > len(self._free):
            raise PoolExhaustedError(
                f"the KV pool needs {count} more blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        ids = [self._free.popleft() for _ in range(count)]
        for block_id in ids:
            self._ref_counts[block_id] = 1
        return ids

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share `block_ids` with one more holder (reference counts + 1); returns them."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"fork of free block {block_id}")
            self._ref_counts[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with no references returns to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def shift(self, block_ids: list[int], deltas: list[int]) -> int:
        """Add `deltas[i]` references to `block_ids[i]` (distinct ids; a beam reorder's net change:
        `fork` and `free` at once); returns how many blocks this frees."""
        counts, freed = self._ref_counts, 0
        for block_id, delta in zip(block_ids, deltas):
            count = counts[block_id]
            if count <= 0 or count + delta < 0:
                raise RuntimeError(f"block {block_id} holds {count} references, cannot take {delta:+d}")
            counts[block_id] = count + delta
            if count + delta == 0:
                self._free.append(block_id)
                freed += 1
        return freed

    def make_private(self, block_id: int) -> int:
        """Copy-on-write: a block id the caller may write to in place of `block_id`.

        Returns `block_id` itself when the caller is its only holder; otherwise allocates a
        new block (the caller copies the contents) and drops the caller's reference.
        """
        if self._ref_counts[block_id] == 1:
            return block_id
        (new_id,) = self.allocate(1)
        self.free([block_id])
        return new_id
