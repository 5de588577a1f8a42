"""`BlockTables` (kv/tables.py) in both modes, against plain Python lists of tokens.

Every stored token is its own value written into a one-element pool (head_dim 1) at the slot the
tables gave it; reading a row back through its table must give the reference row, after any mix
of appends, frees and beam reorders. Block size 4 (lengths cross block boundaries often); the pool starts
small so growth (copying the live blocks) happens along the way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_paged_t5 import PagedCacheConfig
from hf_paged_t5.kv.pool import KVPool, LayerSpec
from hf_paged_t5.kv.tables import BlockTables, blocks_for, widen

BLOCK = 4


def make_pool(num_blocks: int = 4) -> KVPool:
    config = PagedCacheConfig(block_size=BLOCK, num_blocks=num_blocks, grow=True)
    pool = KVPool(config, [LayerSpec(torch.device("cpu"), torch.float32, 1, 1)])
    return pool


def write(pool: KVPool, slots: np.ndarray, values) -> None:
    flat = pool.key_caches[0].view(-1)
    flat[torch.from_numpy(np.asarray(slots, dtype=np.int64))] = torch.tensor(values, dtype=torch.float32)


def read(pool: KVPool, table: np.ndarray, length: int) -> list[float]:
    flat = pool.key_caches[0].view(-1)
    positions = np.arange(length)
    slots = table[positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    return flat[torch.from_numpy(slots)].tolist()


def check(pool: KVPool, tables: BlockTables, reference: dict[int, list[float]], table=None) -> None:
    table = tables.table if table is None else table
    for slot, tokens in reference.items():
        assert int(tables.lens[slot]) == len(tokens) or tables.owned is not None
        assert read(pool, table[slot], len(tokens)) == tokens, f"slot {slot}"


@pytest.mark.parametrize("seed", range(6))
def test_shared_mode_random_appends_reorders_and_frees(seed):
    rng = np.random.default_rng(seed)
    pool = make_pool()
    tables = BlockTables(pool, num_slots=6)
    reference: dict[int, list[float]] = {}
    counter = 0.0
    for step in range(60):
        action = rng.integers(4)
        live = sorted(reference)
        if action == 0 and len(reference) < 6:  # a row joins
            slot = min(set(range(6)) - set(reference))
            tables.clear(slot, width=int(rng.integers(0, 3)))
            reference[slot] = []
        elif action == 1 and live:  # some rows store a token
            rows = np.asarray(sorted(rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)))
            values = [counter + i for i in range(len(rows))]
            counter += len(rows)
            write(pool, tables.append(rows), values)
            for row, value in zip(rows.tolist(), values):
                reference[row].append(value)
        elif action == 2 and live:  # beams: each row continues from a row of its group
            # one group, or two (a batch job's step: their partial blocks copied at once at the end)
            rows = live[: int(rng.integers(1, len(live) + 1))]
            cut = int(rng.integers(1, len(rows) + 1))
            groups = [rows[:cut], rows[cut:]] if rng.random() < 0.5 else [rows]
            copies = [] if len(groups) == 2 else None
            before = {row: list(reference[row]) for row in rows}
            for group in filter(None, groups):
                sources = rng.integers(0, len(group), size=len(group)).tolist()
                tables.reorder(group, sources, copies)
                for row, src in zip(group, sources):
                    reference[row] = list(before[group[src]])
            if copies:
                pool.copy_blocks(*zip(*copies))
        elif action == 3 and live:  # a row leaves
            slot = live[int(rng.integers(len(live)))]
            tables.free(slot)
            del reference[slot]
        check(pool, tables, reference)
        held = {b for slot in reference for b in tables.table[slot, : tables.held[slot]].tolist()}
        assert tables.num_held == len(held)
        assert tables.width >= max((int(tables.held[s]) for s in reference), default=0)
    tables.free_all()
    assert tables.num_held == 0 and pool.is_idle()


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("seed", range(4))
def test_owned_mode_beams_match_the_reference(seed, on_device):
    rng = np.random.default_rng(100 + seed)
    pool = make_pool()
    rows, width = 5, blocks_for(17, BLOCK)
    tables = BlockTables(pool, rows)
    tables.own_all(width)
    owned = tables.owned.copy()
    reference = {r: [] for r in range(rows)}
    for length in range(17):
        if length and rng.random() < 0.6:
            beam_idx = rng.integers(0, rows, size=rows)
            if on_device:
                tables.reorder_owned_on_device(torch.from_numpy(beam_idx), length)
            else:
                tables.reorder_owned(beam_idx, length)
            before = {r: list(tokens) for r, tokens in reference.items()}
            reference = {r: list(before[int(s)]) for r, s in enumerate(beam_idx)}
        slots = tables.slots_of(np.arange(rows), np.full(rows, length))
        assert np.array_equal(slots // BLOCK, owned[:, length // BLOCK]), "a row wrote outside its own blocks"
        values = [float(100 * length + r) for r in range(rows)]
        write(pool, slots, values)
        for r, value in enumerate(values):
            reference[r].append(value)
        table = tables.device_table.numpy() if tables.device_table is not None else tables.table
        check(pool, tables, reference, table)
    assert (tables.device_table is not None) == on_device
    assert sorted(tables.blocks_held()) == sorted(owned.reshape(-1).tolist())
    tables.free_all()
    assert pool.is_idle()


def test_open_gives_a_source_its_tokens_in_order():
    pool = make_pool(num_blocks=2)
    tables = BlockTables(pool, 3)
    slots = tables.open(1, 11)  # 3 blocks: the pool grows
    write(pool, slots, range(11))
    assert read(pool, tables.table[1], 11) == list(range(11))
    assert tables.width == 3 and tables.num_held == 3 and int(tables.lens[1]) == 11
    table, lens = tables.gather(np.array([1, 1, 0]))
    assert table.shape == (3, 3) and lens.tolist() == [11, 11, 0]
    assert table[2].tolist() == [0, 0, 0]  # unused entries are 0


def test_open_of_a_slot_out_of_range_takes_no_block():
    """A source past the tables' rows raises before any block leaves the pool (none is lost)."""
    pool = make_pool(num_blocks=8)
    tables = BlockTables(pool, 2)
    tables.open(0, 5)
    free = pool.manager.num_free
    with pytest.raises(IndexError):
        tables.open(2, 5)
    assert pool.manager.num_free == free and tables.num_held == 2
    tables.free_all()
    assert pool.manager.num_free == free + 2


def test_opening_counts_what_append_allocates():
    pool = make_pool(num_blocks=16)
    tables = BlockTables(pool, 4)
    rows = np.arange(4)
    for _ in range(7):
        free = pool.manager.num_free
        opening = tables.opening(rows[:3])
        tables.append(rows[:3])
        assert free - pool.manager.num_free == opening


def test_widen_doubles_and_keeps_columns():
    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert widen(table, 2) is table
    wider = widen(table, 4)
    assert wider.shape == (2, 6) and wider[:, :3].tolist() == table.tolist() and not wider[:, 3:].any()
    assert widen(table, 9).shape == (2, 9)
