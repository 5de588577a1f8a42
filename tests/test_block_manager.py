"""`BlockManager` under random allocate / free / fork / make_private / grow, against a model of holders.

The model is a list of holders, each holding a list of distinct block ids (a block table).
A block's reference count must equal the number of holders that hold it; every block is
either free or held; nothing leaks and nothing is freed twice.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged_t5 import BlockManager, PoolExhaustedError


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager: BlockManager
        self.holders: list[list[int]] = []
        self.freed: list[int] = []  # blocks that went back to the free list at some point

    @initialize(num_blocks=st.integers(1, 24))
    def start(self, num_blocks):
        self.manager = BlockManager(num_blocks)

    # ---- helpers ----------------------------------------------------------------------------
    def held(self) -> Counter:
        return Counter(b for blocks in self.holders for b in blocks)

    # ---- rules ------------------------------------------------------------------------------
    @rule(count=st.integers(0, 10))
    def allocate(self, count):
        free_before = self.manager.num_free
        if count > free_before:
            with pytest.raises(PoolExhaustedError) as info:
                self.manager.allocate(count)
            msg, total = str(info.value), self.manager.num_blocks
            assert f"needs {count} more blocks but only {free_before} of {total} are free" in msg, msg
            assert self.manager.num_free == free_before, "a refused allocation must take nothing"
            return
        ids = self.manager.allocate(count)
        assert len(ids) == len(set(ids)) == count
        assert not set(ids) & set(self.held()), "allocate handed out a block someone holds"
        assert all(0 <= b < self.manager.num_blocks for b in ids)
        assert all(self.manager.ref_count(b) == 1 for b in ids)
        self.holders.append(ids)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        blocks = self.holders.pop(i)
        self.manager.free(blocks)
        held = self.held()
        self.freed.extend(b for b in blocks if held[b] == 0)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        forked = self.manager.fork(self.holders[i])
        assert forked == self.holders[i] and forked is not self.holders[i]
        self.holders.append(forked)

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def make_private(self, data):
        i = data.draw(st.sampled_from([k for k, blocks in enumerate(self.holders) if blocks]))
        j = data.draw(st.integers(0, len(self.holders[i]) - 1))
        old = self.holders[i][j]
        shared = self.held()[old] > 1
        free_before = self.manager.num_free
        if shared and free_before == 0:
            with pytest.raises(PoolExhaustedError):
                self.manager.make_private(old)
            assert self.manager.ref_count(old) == self.held()[old], "a refused copy-on-write changed counts"
            return
        new = self.manager.make_private(old)
        if not shared:
            assert new == old, "the only holder writes in place"
        else:
            assert new != old and new not in self.held()
            assert self.manager.ref_count(new) == 1
        self.holders[i][j] = new

    @rule(extra=st.integers(0, 6))
    def grow(self, extra):
        before = self.manager.num_blocks
        self.manager.grow(before + extra)
        assert self.manager.num_blocks == before + extra
        if extra:
            with pytest.raises(ValueError, match="cannot shrink"):
                self.manager.grow(before)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        block = data.draw(st.sampled_from(self.freed))
        if self.held()[block]:
            return  # handed out again since it was freed
        with pytest.raises(RuntimeError, match=f"double free of block {block}"):
            self.manager.free([block])
        with pytest.raises(RuntimeError, match=f"fork of free block {block}"):
            self.manager.fork([block])

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_holders(self):
        held = self.held()
        for b in range(self.manager.num_blocks):
            assert self.manager.ref_count(b) == held[b], f"block {b}"

    @invariant()
    def every_block_is_free_or_held(self):
        # A block on the free list twice would make num_free too large; a lost block, too small.
        assert self.manager.num_free + len(self.held()) == self.manager.num_blocks
        assert self.manager.num_used == len(self.held())

    def teardown(self):
        # Everything goes back: then the whole pool can be taken again, each id once.
        for blocks in self.holders:
            self.manager.free(blocks)
        assert self.manager.num_free == self.manager.num_blocks
        ids = self.manager.allocate(self.manager.num_blocks)
        assert sorted(ids) == list(range(self.manager.num_blocks))


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=50, deadline=None)
@given(num_blocks=st.integers(1, 32), take=st.integers(0, 32), ask=st.integers(1, 40))
def test_exhaustion_message_names_needed_and_free(num_blocks, take, ask):
    manager = BlockManager(num_blocks)
    manager.allocate(min(take, num_blocks))
    free = manager.num_free
    if ask <= free:
        assert len(manager.allocate(ask)) == ask
        return
    with pytest.raises(PoolExhaustedError) as info:
        manager.allocate(ask)
    assert f"needs {ask} more blocks but only {free} of {num_blocks} are free" in str(info.value)
    assert manager.num_free == free


def test_pool_exhausted_is_a_runtime_error():
    assert issubclass(PoolExhaustedError, RuntimeError)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_empty_manager_refused(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockManager(num_blocks)


def test_shared_block_freed_only_by_last_holder():
    manager = BlockManager(4)
    (block,) = manager.allocate(1)
    manager.fork([block])
    manager.fork([block])
    manager.free([block])
    manager.free([block])
    assert manager.ref_count(block) == 1 and manager.num_free == 3
    manager.free([block])
    assert manager.num_free == 4
    with pytest.raises(RuntimeError, match=f"double free of block {block}"):
        manager.free([block])
    assert manager.num_free == 4


def test_shift_applies_net_reference_changes():
    """`shift`: a beam reorder's net change per block at once; blocks reaching 0 return to the free
    list, and a change that would take a free block or go below 0 raises."""
    manager = BlockManager(6)
    a, b, c = manager.allocate(3)
    manager.fork([a, a])
    assert manager.shift([a, b, c], [-2, +2, -1]) == 1  # c freed
    assert [manager.ref_count(x) for x in (a, b, c)] == [1, 3, 0] and manager.num_free == 4
    with pytest.raises(RuntimeError, match=f"block {c} holds 0 references"):
        manager.shift([c], [+1])
    with pytest.raises(RuntimeError, match=f"block {a} holds 1 references, cannot take -2"):
        manager.shift([a], [-2])
