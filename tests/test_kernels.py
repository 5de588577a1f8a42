"""Triton kernels against the plain-PyTorch reference.

On a CPU-only machine the kernels run in Triton's interpreter (tiny shapes, no bf16: the
interpreter's bf16 `tl.dot` is wrong). On a GPU every test runs compiled; `@pytest.mark.gpu`
tests add realistic shapes, a pool past 2^31 elements and CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import; conftest.py normally does it already.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from hf_paged_t5 import reference  # noqa: E402
from hf_paged_t5.kernels import local_prefill, paged_decode, prefill, store_kv  # noqa: E402
from hf_paged_t5.kernels.decode import DecodeConfig, decode_config  # noqa: E402
from hf_paged_t5.kernels.launch import LocalConfig  # noqa: E402
from hf_paged_t5.kernels.prefill import PrefillConfig, _band_tiles, _wide_table, band_range, prefill_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def gpu_test(fn):
    """Mark a test `gpu` and skip it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(fn))


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# ||out - ref|| / ||ref|| bounds: a few units of each dtype's rounding (fp16 eps 9.8e-4,
# bf16 eps 7.8e-3), as the output is rounded once and softmax weights once more.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_paged_kv(lens, block_size, num_heads, head_dim, dtype, extra_cols=1, seed=0):
    """A shuffled pool holding rows of `lens` keys.

    returns key_cache, value_cache [num_blocks, block_size, num_heads, head_dim],
    block_table [batch, max_blocks] int32 (padding columns point at block 0), seq_lens [batch] int32
    """
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    max_blocks = max(per_row) + extra_cols
    num_blocks = sum(per_row) + 3
    key_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for row, n in enumerate(per_row):
        block_table[row, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (key_cache, value_cache, block_table, seq_lens)]


def decode_reference(query, key_cache, value_cache, block_table, seq_lens, **kw):
    """The reference on float32 copies of every float input."""
    up = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return reference.paged_decode(
        query.float(), key_cache.float(), value_cache.float(), block_table, seq_lens, **up
    )


def prefill_reference(query, key, value, cu_seqlens, max_seqlen, **kw):
    up = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return reference.prefill(query.float(), key.float(), value.float(), cu_seqlens, max_seqlen, **up)


def make_bias(kind, num_heads, batch, length, causal, dims=1, seed=0):
    """kwargs for one bias flavour: none / table / dense / dense_bcast (stride-0 expand)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return {}
    if kind == "table":
        max_distance = 7
        entries = max_distance + 1 if causal else 2 * max_distance + 1
        return {"bias_table": (3 * torch.randn(num_heads, entries, generator=g)).to(DEVICE)}
    tail = [length + 3] * dims
    if kind == "dense":
        return {"dense_bias": (3 * torch.randn(batch, num_heads, *tail, generator=g)).to(DEVICE)}
    # [1, num_heads, ...] broadcast over the batch, and an expand()ed (stride 0) head dim.
    bias = (3 * torch.randn(1, 1, *tail, generator=g)).to(DEVICE).expand(1, num_heads, *tail)
    return {"dense_bias": bias}


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_store_kv_matches_reference(block_size, dtype, head_dim):
    num_heads, num_tokens = 3, 11
    num_blocks = -(-2 * num_tokens // block_size)
    g = torch.Generator().manual_seed(1)
    cache_k = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    cache_v = torch.randn_like(cache_k)
    key = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slot_mapping = slots.to(torch.int32).to(DEVICE)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    reference.store_kv(key, value, want_k, want_v, slot_mapping)
    store_kv(key=key, value=value, key_cache=cache_k, value_cache=cache_v, slot_mapping=slot_mapping)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)


def test_store_kv_casts_skips_negative_slots_and_takes_strided_input():
    cache_k = torch.zeros(4, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    # [tokens, heads, head_dim] views of a wider projection: token stride != heads * head_dim.
    packed = torch.randn(3, 2, 2, 16, device=DEVICE)
    key, value = packed[:, 0], packed[:, 1]
    slot_mapping = torch.tensor([5, -1, 15], dtype=torch.int64, device=DEVICE)
    store_kv(key=key, value=value, key_cache=cache_k, value_cache=cache_v, slot_mapping=slot_mapping)
    flat_k, flat_v = cache_k.view(16, 2, 16), cache_v.view(16, 2, 16)
    assert torch.equal(flat_k[5], key[0].half()) and torch.equal(flat_k[15], key[2].half())
    assert torch.equal(flat_v[5], value[0].half()) and torch.equal(flat_v[15], value[2].half())
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_of_several_layers_matches_the_reference(slot_dtype, dtype):
    """Layered K/V ([layers, tokens, heads, dim], as one GEMM over several layers' packed cross k/v
    weights lays it out: strided views) into a span of a pool group ([layers, blocks, block_size,
    heads, dim] views of [layers, 2, ...]): every layer at its slots, nothing else touched."""
    layers, num_tokens, num_heads, head_dim, block_size = 3, 13, 5, 24, 4
    num_blocks = -(-2 * num_tokens // block_size)
    g = torch.Generator().manual_seed(2)
    group = torch.randn(layers + 1, 2, num_blocks, block_size, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(num_tokens, layers, 2, num_heads, head_dim, generator=g).to(DEVICE)  # fp32: cast on store
    key, value = y[:, :, 0].transpose(0, 1), y[:, :, 1].transpose(0, 1)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(slot_dtype).to(DEVICE)
    want = group.clone()
    reference.store_kv(key, value, want[1:, 0], want[1:, 1], slot_mapping)
    for i in range(layers):  # the reference's layered copy is its one-layer copy, layer by layer
        flat = group[1 + i].view(2, num_blocks * block_size, num_heads, head_dim).clone()
        flat[0, slot_mapping.long()] = key[i].to(dtype)
        flat[1, slot_mapping.long()] = value[i].to(dtype)
        assert torch.equal(want[1 + i].view_as(flat), flat)
    store_kv(key=key, value=value, key_cache=group[1:, 0], value_cache=group[1:, 1], slot_mapping=slot_mapping)
    assert torch.equal(group, want)
    with pytest.raises(ValueError, match="layers"):
        store_kv(key=key, value=value, key_cache=group[2:, 0], value_cache=group[2:, 1], slot_mapping=slot_mapping)


# ----------------------------------------------------------------------------- decode


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values [num_blocks, block_size, num_heads, head_dim] in memory [block, head, slot, dim]."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("prefetch", ["tile", "async"])
def test_store_kv_and_paged_decode_address_the_pool_through_its_strides(prefetch):
    """A pool laid out [block, head, slot, dim] (what `benchmarks/tune_mixed_decode.py --layouts`
    times) is written and read by slot like the package's [block, slot, head, dim] one: same bits."""
    block_size, num_heads, head_dim = 4, 3, 32
    lens = [3, 4, 37, 1]  # 37 keys: three 16-key tiles
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim,
                                                                  torch.float32)
    key_hm, value_hm = head_major(key_cache), head_major(value_cache)
    assert key_hm.stride()[1:3] == (head_dim, block_size * head_dim)
    new_k, new_v = (torch.randn(2, num_heads, head_dim, device=DEVICE) for _ in range(2))
    slots = torch.tensor([2, 13], dtype=torch.int64, device=DEVICE)
    for k, v in ((key_cache, value_cache), (key_hm, value_hm)):
        store_kv(key=new_k, value=new_v, key_cache=k, value_cache=v, slot_mapping=slots)
    assert torch.equal(key_hm, key_cache) and torch.equal(value_hm, value_cache)
    query = torch.randn(len(lens), num_heads, head_dim, device=DEVICE)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=2 if prefetch == "async" else 1, prefetch=prefetch)
    outs = [paged_decode(query=query, key_cache=k, value_cache=v, block_table=block_table, seq_lens=seq_lens,
                         scale=0.5, config=config)
            for k, v in ((key_cache, value_cache), (key_hm, value_hm))]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], decode_reference(query, key_cache, value_cache, block_table, seq_lens, scale=0.5)) \
        < TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", ["none", "table", "dense", "dense_bcast"])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode_matches_reference(block_size, dtype, bias, num_splits):
    num_heads, head_dim = 2, 32
    # Lengths at block_size - 1 / + 0 / + 1, one key, and a long row, in one batch.
    lens = [max(1, block_size - 1), block_size, block_size + 1, 1, 37]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim, dtype)
    query = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
    kw = dict(scale=0.7, **make_bias(bias, num_heads, len(lens), max(lens), causal=True))
    out = paged_decode(
        query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
        seq_lens=seq_lens, num_splits=num_splits, **kw,
    )  # fmt: skip
    ref = decode_reference(query, key_cache, value_cache, block_table, seq_lens, **kw)
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [16, 24, 64])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_paged_decode_head_dims_and_batch_one(head_dim, num_splits):
    key_cache, value_cache, block_table, seq_lens = make_paged_kv([29], 8, 1, head_dim, torch.float32)
    query = torch.randn(1, 1, head_dim, device=DEVICE)
    table = torch.randn(1, 5, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    out = paged_decode(*args, scale=1.0, bias_table=table, num_splits=num_splits)
    ref = decode_reference(*args, scale=1.0, bias_table=table)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_paged_decode_split_counts_agree(num_splits):
    """Many splits (some past every row's end) merge to the same result as one."""
    lens = [1, 20, 40]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 4, 2, 16, torch.float32, extra_cols=3)
    query = torch.randn(3, 2, 16, device=DEVICE)
    table = torch.randn(2, 9, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    out = paged_decode(*args, bias_table=table, num_splits=num_splits)
    assert rel_err(out, decode_reference(*args, bias_table=table)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_tile_configs(block_size, block_n, num_splits):
    """Tiles of several blocks and tiles inside one block, rows ending at tile edges, shuffled tables."""
    lens = [block_n - 1, block_n, block_n + 1, 2 * block_n, 3 * block_n + 5, 1]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, 2, 16, torch.float32, seed=3)
    query = torch.randn(len(lens), 2, 16, device=DEVICE)
    table = torch.randn(2, 40, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    config = DecodeConfig(block_n=block_n, num_warps=4, num_stages=2, num_splits=num_splits)
    out = paged_decode(*args, scale=0.5, bias_table=table, config=config)
    ref = decode_reference(*args, scale=0.5, bias_table=table)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("prefetch", ["tile", "table", "async"])
@pytest.mark.parametrize("fused_combine", [False, True])
def test_paged_decode_prefetch_and_fused_combine(block_size, block_n, prefetch, fused_combine):
    """Block ids read a tile ahead, the pipeliner's async copies, and the merge done by the
    last split (atomic ticket): rows ending at tile edges, one split past every row's end."""
    lens = [block_n - 1, block_n + 1, 3 * block_n + 5, 1]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, 2, 16, torch.float32, seed=4)
    query = torch.randn(len(lens), 2, 16, device=DEVICE)
    table = torch.randn(2, 40, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    stages = 3 if prefetch == "async" else 1
    config = DecodeConfig(block_n, 4, stages, 5, fused_combine=fused_combine, prefetch=prefetch)
    out = paged_decode(*args, scale=0.5, bias_table=table, config=config)
    assert rel_err(out, decode_reference(*args, scale=0.5, bias_table=table)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("prefetch", ["tile", "table", "async"])
@pytest.mark.parametrize("bias", ["table", "dense", None])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_keys_ready_is_the_same_attention(prefetch, bias, num_splits):
    """`keys_ready` moves loads before the dependent launch's wait and takes each row's newest
    key after it ("past"); the attention is the same bits as without, rows whose newest key lies
    in the first tile of its split, at a tile edge or further on, with one split and several."""
    block_size, block_n = 4, 16
    lens = [1, block_n, block_n + 1, 2 * block_n + 3, 5]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, 2, 16, torch.float32, seed=9)
    query = torch.randn(len(lens), 2, 16, device=DEVICE)
    biases = dict(table=dict(bias_table=torch.randn(2, 40, device=DEVICE)),
                  dense=dict(dense_bias=torch.randn(len(lens), 2, max(lens), device=DEVICE)), none={})
    kwargs = biases[bias or "none"]
    args = (query, key_cache, value_cache, block_table, seq_lens)
    config = DecodeConfig(block_n, 4, 3 if prefetch == "async" else 1, num_splits, fused_combine=True, prefetch=prefetch)
    plain = paged_decode(*args, scale=0.5, config=config, **kwargs)
    assert rel_err(plain, decode_reference(*args, scale=0.5, **kwargs)) < TOLERANCE[torch.float32]
    for ready in ("past", "all"):
        assert torch.equal(paged_decode(*args, scale=0.5, config=config, keys_ready=ready, **kwargs), plain)
    with pytest.raises(ValueError, match="keys_ready must be 'all', 'past' or None"):
        paged_decode(*args, keys_ready="newest")


@pytest.mark.parametrize("prefetch", ["tile", "async"])
@pytest.mark.parametrize("bias", ["table", "dense"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4])
def test_paged_decode_stores_the_newest_kv(prefetch, bias, num_splits, block_size):
    """Given each row's newest K/V and slot, `paged_decode` leaves the cache `store_kv` leaves, bit
    for bit, and returns the attention of `store_kv` then `paged_decode`: the same bits where it
    runs `store_kv` first (the register-prefetch loads); where the kernel stores them itself (async
    loads) and attends to the newest key after the loop, an error against a float64 reference no
    larger than that launch's own plus a float32 ulp. Rows whose newest key opens a tile, closes
    one, lies in a later split or is the only key; a negative slot stores nothing (the cache's key
    is read); the new K/V as views of one packed projection, as a decode step has them."""
    block_n, heads, head_dim = 16, 3, 24
    lens = [1, block_n, block_n + 1, 2 * block_n + 3, 5, 3 * block_n]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, heads, head_dim,
                                                                  torch.float32, seed=11)
    rows = len(lens)
    packed = torch.randn(rows, 3, heads, head_dim, device=DEVICE)  # q, k, v side by side per row
    query, new_k, new_v = packed.unbind(1)
    table_cpu, lens_cpu = block_table.cpu(), seq_lens.cpu()
    slots = [int(table_cpu[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for r, n in enumerate(lens_cpu.tolist())]
    slots[4] = -1  # row 4 stores nothing: its newest key is the cache's
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    kwargs = dict(bias_table=torch.randn(heads, 40, device=DEVICE)) if bias == "table" else dict(
        dense_bias=torch.randn(rows, heads, max(lens), device=DEVICE))
    config = DecodeConfig(block_n, 4, 2 if prefetch == "async" else 1, num_splits, fused_combine=True, prefetch=prefetch)
    caches = [(key_cache.clone(), value_cache.clone()) for _ in range(2)]
    store_kv(key=new_k, value=new_v, key_cache=caches[0][0], value_cache=caches[0][1], slot_mapping=slot_mapping)
    ready = "past" if prefetch == "async" else None  # the async loop loads after the wait either way
    want = paged_decode(query, *caches[0], block_table, seq_lens, scale=0.5, config=config, keys_ready=ready, **kwargs)
    got = paged_decode(query, *caches[1], block_table, seq_lens, scale=0.5, config=config, keys_ready=ready,
                       new_key=new_k, new_value=new_v, slot_mapping=slot_mapping, **kwargs)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert not torch.equal(caches[0][0], key_cache)  # the store did write
    if prefetch != "async":
        assert torch.equal(got, want)
        return
    up = {k: v.double() for k, v in kwargs.items()}
    ref = reference.paged_decode(query.double(), caches[0][0].double(), caches[0][1].double(), block_table,
                                 seq_lens, scale=0.5, **up)
    assert rel_err(got, ref) <= rel_err(want, ref) + torch.finfo(torch.float32).eps


def test_paged_decode_new_kv_checks():
    key_cache, value_cache, block_table, seq_lens = make_paged_kv([3, 5], 4, 2, 16, torch.float32)
    query = torch.randn(2, 2, 16, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="new_key, new_value and slot_mapping together"):
        paged_decode(*args, new_key=query)
    with pytest.raises(ValueError, match=r"new_value must be \(2, 2, 16\)"):
        paged_decode(*args, new_key=query, new_value=query[:1], slot_mapping=slots)
    with pytest.raises(ValueError, match="new_key and new_value need one layout"):
        paged_decode(*args, new_key=query, new_value=torch.randn(2, 4, 16, device=DEVICE)[:, :2], slot_mapping=slots)
    strided = torch.randn(2, 2, 32, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="new_key must be contiguous in its last dim"):
        paged_decode(*args, new_key=strided, new_value=strided, slot_mapping=slots)
    with pytest.raises(TypeError, match="int32 or int64"):
        paged_decode(*args, new_key=query, new_value=query, slot_mapping=slots.float())
    with pytest.raises(ValueError, match=r"slot_mapping must be \[batch=2\]"):
        paged_decode(*args, new_key=query, new_value=query, slot_mapping=slots[:1])


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_paged_decode_fused_combine_split_counts(num_splits):
    """The ticket reaches num_splits exactly once per (row, head), empty splits included."""
    lens = [1, 20, 40]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 4, 3, 16, torch.float16, extra_cols=3)
    query = torch.randn(3, 3, 16, device=DEVICE).half()
    args = (query, key_cache, value_cache, block_table, seq_lens)
    config = DecodeConfig(16, 4, 1, num_splits, fused_combine=True)
    out = paged_decode(*args, config=config)
    assert rel_err(out, decode_reference(*args)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_paged_decode_leaves_given_tickets_at_zero(num_splits):
    """With the caller's counters (a graph step's `StepMetadata.tickets`), the last split merges
    and sets its counter back to zero: the next launch over the same counters (another layer,
    another row count) merges right, and a launch of one split does not touch them."""
    lens = [1, 20, 40]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 4, 3, 16, torch.float16, extra_cols=3)
    tickets = torch.zeros(3 * 3 + 5, dtype=torch.int32, device=DEVICE)
    for rows in (3, 2, 3):
        query = torch.randn(rows, 3, 16, device=DEVICE).half()
        args = (query, key_cache, value_cache, block_table[:rows], seq_lens[:rows])
        out = paged_decode(*args, num_splits=num_splits, tickets=tickets)
        assert rel_err(out, decode_reference(*args)) < TOLERANCE[torch.float16]
        assert not tickets.any()
    with pytest.raises(ValueError, match="tickets must hold >= batch"):
        paged_decode(*args, num_splits=3, tickets=tickets[:4])


@pytest.mark.parametrize("num_splits", [2, 4])
def test_paged_decode_rows_within_the_first_split_skip_the_merge(num_splits):
    """With the fused merge, a row whose keys all lie in the first split is finished by that
    split: its output has the bits of a one-split launch (no merge's rescaling), and its counters
    are never taken; longer rows in the same launch still merge right."""
    lens = [3, 16, 17, 60, 1]  # a 64-key table: 2 splits of 32 keys or 4 of 16
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 4, 3, 16, torch.float16, extra_cols=1)
    assert block_table.shape[1] * 4 == 64
    query = torch.randn(len(lens), 3, 16, device=DEVICE).half()
    args = (query, key_cache, value_cache, block_table, seq_lens)
    keys_per_split = 64 // num_splits
    whole = [i for i, n in enumerate(lens) if n <= keys_per_split]
    assert whole and len(whole) < len(lens)
    # The whole rows' counters hold a value no merge could start from: had any of their splits
    # taken a ticket, the count would move and no split would merge (garbage out).
    tickets = torch.zeros(len(lens), 3, dtype=torch.int32, device=DEVICE)
    tickets[whole] = 1000
    config = DecodeConfig(16, 4, 1, num_splits)
    one = paged_decode(*args, config=DecodeConfig(16, 4, 1, 1))
    split = paged_decode(*args, config=config, tickets=tickets.view(-1))
    assert torch.equal(split[whole], one[whole])
    assert rel_err(split, decode_reference(*args)) < TOLERANCE[torch.float16]
    assert (tickets[whole] == 1000).all() and not tickets[[i for i in range(len(lens)) if i not in whole]].any()
    # the separate combine kernel (no tickets, no fused merge) merges every row as before
    assert rel_err(paged_decode(*args, config=config), decode_reference(*args)) < TOLERANCE[torch.float16]


def test_paged_decode_num_splits_overrides_config():
    lens = [70, 3]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 8, 2, 16, torch.float32)
    query = torch.randn(2, 2, 16, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    config = DecodeConfig(block_n=32, num_warps=4, num_splits=1)
    out = paged_decode(*args, config=config, num_splits=3)
    assert rel_err(out, decode_reference(*args)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "knobs, words",
    [
        (dict(block_n=24, num_warps=4), "power of two"),
        (dict(block_n=8, num_warps=4), "power of two"),
        (dict(block_n=32, num_warps=3), "num_warps"),
        (dict(block_n=32, num_warps=4, num_splits=0), "num_splits"),
        (dict(block_n=32, num_warps=4, prefetch="tma"), "prefetch"),
    ],
)
def test_decode_config_rejects_bad_knobs(knobs, words):
    with pytest.raises(ValueError, match=words):
        DecodeConfig(**knobs)


def test_decode_config_heuristic_on_an_h200():
    """The H200 sweeps' winners: no split for the 128-key self step and for many rows,
    ~128-key splits for one row over 512 keys, >= 16 splits for one row over 16K keys."""
    sms = 132
    assert decode_config(1, 16, 64, 128, sms) == DecodeConfig(128, 4, 1, 1)
    assert decode_config(1, 16, 64, 512, sms).num_splits == 4
    assert decode_config(16, 16, 64, 512, sms) == DecodeConfig(128, 4, 1, 1)
    # batch 1's split launch and batch 16's unsplit one differ only in the split count, which
    # the kernel reads at run time: one binary (a new batch size compiles no decode kernel)
    assert dataclasses.replace(decode_config(1, 16, 64, 512, sms), num_splits=1) == decode_config(16, 16, 64, 512, sms)
    # many rows at d64: the async-copy pipeline 2 deep, over <= 256 keys on 32-key tiles of one warp;
    # past 1,024 keys only with 8+ programs per SM (64 rows keep the register prefetch)
    assert decode_config(64, 16, 64, 2048, sms) == DecodeConfig(128, 4, 1, 1)
    assert decode_config(512, 16, 64, 2048, sms) == DecodeConfig(128, 4, 2, 1, prefetch="async")
    assert decode_config(64, 16, 64, 512, sms) == DecodeConfig(128, 4, 2, 1, prefetch="async")
    assert decode_config(512, 16, 64, 208, sms) == DecodeConfig(32, 1, 2, 1, prefetch="async")
    assert decode_config(64, 16, 64, 256, sms) == DecodeConfig(32, 1, 2, 1, prefetch="async")
    assert decode_config(128, 16, 128, 512, sms) == DecodeConfig(64, 4, 3, 1, prefetch="async")
    assert decode_config(64, 16, 128, 2048, sms) == DecodeConfig(64, 4, 1, 2)
    for head_dim in (64, 128):
        long_row = decode_config(1, 16, head_dim, 16384, sms)
        assert 16 <= long_row.num_splits <= 64 and long_row.block_n * head_dim <= 4096
    for batch, keys in ((1, 128), (1, 300), (16, 512), (64, 2048), (1, 16384), (3, 5000)):
        cfg = decode_config(batch, 16, 64, keys, sms)
        assert cfg.block_n * 64 <= 8192 and triton.cdiv(keys, cfg.num_splits) >= 64


def test_paged_decode_short_rows_default():
    """The launch `decode_config` gives many rows over <= 256 keys at head_dim 64 (32-key tiles
    across two 16-slot blocks, one warp, async copies) over rows of 1 to 200 keys with T5's causal
    table: the reference's attention."""
    num_heads, head_dim, block_size = 4, 64, 16
    config = decode_config(512, 16, head_dim, 200, 132)
    assert (config.block_n, config.num_warps, config.prefetch) == (32, 1, "async")
    lens = [200, 1, 31, 32, 33, 65, 17, 130]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim, torch.float32)
    query = torch.randn(len(lens), num_heads, head_dim, device=DEVICE)
    table = torch.randn(num_heads, 129, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    out = paged_decode(*args, bias_table=table, max_seq_len=200, config=config)
    assert rel_err(out, decode_reference(*args, bias_table=table)) < TOLERANCE[torch.float32]


def test_paged_decode_max_seq_len_hint():
    lens = [3, 33]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 2, 2, 16, torch.float32, extra_cols=20)
    query = torch.randn(2, 2, 16, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    out = paged_decode(*args, max_seq_len=33, num_splits=4)
    assert rel_err(out, decode_reference(*args)) < TOLERANCE[torch.float32]


def test_paged_decode_fp16_large_scores_do_not_overflow():
    """Scores near 1e5 overflow fp16; the kernel must keep them in fp32."""
    key_cache, value_cache, block_table, seq_lens = make_paged_kv([20, 7], 4, 2, 32, torch.float16)
    key_cache = (key_cache.float() * 60).clamp(-6e4, 6e4).half()
    query = torch.full((2, 2, 32), 60.0, device=DEVICE).half()
    args = (query, key_cache, value_cache, block_table, seq_lens)
    out = paged_decode(*args)
    assert torch.isfinite(out).all()
    assert rel_err(out, decode_reference(*args)) < TOLERANCE[torch.float16]


def _decode_args(**over):
    key_cache, value_cache, block_table, seq_lens = make_paged_kv([5, 9], 4, 2, 16, torch.float32)
    args = dict(
        query=torch.randn(2, 2, 16, device=DEVICE), key_cache=key_cache, value_cache=value_cache,
        block_table=block_table, seq_lens=seq_lens,
    )  # fmt: skip
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(query=torch.randn(2, 2, 16).half()), TypeError, "cast the query"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "int32"),
        (dict(seq_lens=torch.ones(2, dtype=torch.int64)), TypeError, "int32"),
        (dict(query=torch.randn(2, 3, 16)), ValueError, "num_heads"),
        (dict(query=torch.randn(2, 2, 32)[..., ::2]), ValueError, "contiguous"),
        (dict(seq_lens=torch.ones(3, dtype=torch.int32)), ValueError, "batch"),
        (dict(bias_table=torch.zeros(2, 5), dense_bias=torch.zeros(2, 2, 9)), ValueError, "at most one"),
        (dict(bias_table=torch.zeros(3, 5)), ValueError, "num_heads"),
        (dict(dense_bias=torch.zeros(2, 2, 1, 9)), ValueError, "dense_bias"),
        (dict(query=torch.randn(2, 2, 16).to(torch.int32)), TypeError, "dtype"),
    ],
)
def test_paged_decode_rejects_bad_arguments(over, error, words):
    over = {k: v.to(DEVICE) for k, v in over.items()}
    with pytest.raises(error, match=words):
        paged_decode(**_decode_args(**over))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    key_cache, value_cache, block_table, seq_lens = (t.cpu() for t in make_paged_kv([3], 4, 1, 16, torch.float32))
    with pytest.raises(ValueError, match="CUDA"):
        paged_decode(torch.randn(1, 1, 16), key_cache, value_cache, block_table, seq_lens)


# ----------------------------------------------------------------------------- prefill


def packed(lens, num_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    qkv = [torch.randn(total, num_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    cu_seqlens = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return (*qkv, cu_seqlens)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", ["none", "table", "dense", "dense_bcast"])
def test_prefill_matches_reference(causal, dtype, bias):
    num_heads, head_dim = 2, 32
    # Around the 16-token tiles of the interpreter, an empty sequence, one token, a long one.
    lens = [15, 16, 17, 0, 1, 38]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype)
    kw = dict(scale=0.5, causal=causal, **make_bias(bias, num_heads, len(lens), max(lens), causal, dims=2))
    out = prefill(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), **kw)
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), **kw)
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [16, 24, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_head_dims_batch_one(head_dim, causal):
    query, key, value, cu_seqlens = packed([33], 1, head_dim, torch.float32)
    entries = 9 if causal else 17
    table = torch.randn(1, entries, device=DEVICE)
    args = (query, key, value, cu_seqlens, 33)
    out = prefill(*args, causal=causal, bias_table=table)
    assert rel_err(out, prefill_reference(*args, causal=causal, bias_table=table)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_m, block_n, tile_ranges, band_split", [
    (16, 16, True, True), (32, 16, True, True), (16, 32, True, True), (64, 32, True, True),
    (32, 16, True, False), (32, 16, False, True)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", ["none", "table", "dense"])
def test_prefill_tile_configs(block_m, block_n, tile_ranges, band_split, causal, bias):
    """Sequences ending at tile edges and long enough (vs max_distance 7) for key tiles wholly
    left of, inside and right of the bias band, where the kernel uses a constant bias; the
    one gathering loop over whole tiles (band_split off) and the single masked loop
    (tile_ranges off)."""
    num_heads, head_dim = 2, 16
    lens = [1, block_n - 1, block_n, block_n + 1, 2 * block_m + 3, 100]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, torch.float32, seed=5)
    kw = dict(scale=0.3, causal=causal, **make_bias(bias, num_heads, len(lens), max(lens), causal, dims=2, seed=2))
    config = PrefillConfig(block_m, block_n, 4, 2, tile_ranges=tile_ranges, band_split=band_split)
    args = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens))
    out = prefill(**args, config=config, **kw)
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), **kw)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_m, block_n, tile_ranges, band_split", [
    (16, 16, True, True), (32, 16, True, False), (16, 32, True, True), (64, 32, True, True),
    (16, 64, False, True)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_toeplitz_table(block_m, block_n, tile_ranges, band_split, causal, dtype):
    """The widened table (bias loaded at k - q in 4-key vectors, no clamp) in every tile range."""
    num_heads, head_dim = 2, 16
    lens = [1, block_n - 1, block_n + 1, 2 * block_m + 3, 100]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype, seed=6)
    kw = dict(scale=0.3, causal=causal, **make_bias("table", num_heads, len(lens), max(lens), causal, seed=3))
    config = PrefillConfig(block_m, block_n, 4, 2, tile_ranges=tile_ranges, band_split=band_split, toeplitz=True)
    out = prefill(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), config=config, **kw)
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), **kw)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("n", [1, 37, 63, 64])
def test_prefill_bucket_layout_gives_the_lone_rows(n):
    """The batch engine's encoder graphs (`hf.forward.bucket_forward`): an input of n tokens padded
    to a bucket of 64, its padding a packed sequence of its own (empty when n is the bucket's length)
    and max_seqlen the bucket's, gives the input's rows bit for bit as its own launch does."""
    num_heads, head_dim, bucket = 2, 16, 64
    query, key, value, _ = packed([bucket], num_heads, head_dim, torch.float32, seed=9)
    table = torch.randn(num_heads, 2 * 7 + 1, device=DEVICE)
    config = PrefillConfig(32, 16, 4, 2, band_tiles=True)
    padded = torch.tensor([0, n, bucket], dtype=torch.int32, device=DEVICE)
    alone = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    out = prefill(query=query, key=key, value=value, cu_seqlens=padded, max_seqlen=bucket, scale=0.3, bias_table=table,
                  config=config)
    want = prefill(query=query[:n], key=key[:n], value=value[:n], cu_seqlens=alone, max_seqlen=n, scale=0.3,
                   bias_table=table, config=config)
    assert torch.equal(out[:n], want)
    ref = prefill_reference(query, key, value, padded, bucket, scale=0.3, bias_table=table)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]  # the padding's rows too


BAND_BLOCKS = [(16, 16), (32, 16), (64, 16), (16, 32), (32, 32)]


# every block combination in fp16; fp32 (the same code, another dtype) at one in CI, the rest slow
@pytest.mark.parametrize("block_m, block_n, dtype", [
    *(pytest.param(m, n, torch.float16, id=f"fp16-{m}-{n}") for m, n in BAND_BLOCKS),
    *(pytest.param(m, n, torch.float32, id=f"fp32-{m}-{n}", marks=() if (m, n) == (32, 16) else pytest.mark.slow)
      for m, n in BAND_BLOCKS),
])
def test_prefill_band_tiles(block_m, block_n, dtype):
    """Prebuilt band tiles in every tile range, a ragged tail tile in and right of the band
    (lengths vs max_distance 7 and 20; left of it only at max_distance 0, in the test below),
    split into three loops or in one (`one_loop`). Where
    they apply (block_m a multiple of block_n) the bias values are the gather's, so the output
    equals the gathering kernel's bit for bit; elsewhere the flags are ignored."""
    num_heads, head_dim = 2, 16
    lens = [1, block_n - 1, block_n + 1, 2 * block_m + 3, 3 * block_m + block_n + 5, 100]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype, seed=7)
    for max_distance in (7, 20):
        table = torch.randn(num_heads, 2 * max_distance + 1, device=DEVICE).to(dtype)
        args = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), scale=0.3,
                    bias_table=table)
        gather = PrefillConfig(block_m, block_n, 4, 2)
        out = prefill(**args, config=dataclasses.replace(gather, band_tiles=True))
        ref = prefill_reference(query, key, value, cu_seqlens, max(lens), scale=0.3, bias_table=table)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        want = prefill(**args, config=gather)
        assert torch.equal(out, want)
        assert torch.equal(prefill(**args, config=dataclasses.replace(gather, band_tiles=True, one_loop=True)), want)


@pytest.mark.parametrize("head_dim, max_distance", [(24, 5), (16, 0), (16, 40)])
def test_prefill_one_loop_at_awkward_sizes(head_dim, max_distance):
    """Band tiles, split into three loops and in one (`one_loop`), with a head_dim that is not a
    power of two (masked dims), a table of one entry per side (max_distance 0: every tile
    constant, a ragged tail left of the band) and a band wider than every sequence: the gathering
    kernel's bits, within the reference's tolerance."""
    num_heads, dtype = 3, torch.float16
    lens = [1, 15, 16, 17, 70, 33]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype, seed=11)
    table = torch.randn(num_heads, 2 * max_distance + 1, device=DEVICE).to(dtype)
    args = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), scale=0.25,
                bias_table=table)
    gather = PrefillConfig(32, 16, 4, 2)
    want = prefill(**args, config=gather)
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), scale=0.25, bias_table=table)
    assert rel_err(want, ref) < TOLERANCE[dtype]
    for one_loop in (False, True):
        out = prefill(**args, config=dataclasses.replace(gather, band_tiles=True, one_loop=one_loop))
        assert torch.equal(out, want), one_loop


@pytest.mark.parametrize("max_distance, block_m, block_n", [(7, 16, 16), (128, 64, 64), (128, 128, 32), (0, 32, 16)])
def test_prefill_band_tiles_layout(max_distance, block_m, block_n):
    """[h, i, r, c] is head h's bias at distance first + i * block_n + c - r (clamped), and the tiles
    left of and right of the range are constant (every distance clamps to one end)."""
    first, count = band_range(max_distance, block_m, block_n)
    table = torch.randn(3, 2 * max_distance + 1, device=DEVICE).to(torch.bfloat16)
    band = _band_tiles(table, max_distance, first, count, block_m, block_n)
    assert band.shape == (3, count, block_m, block_n) and band.dtype == table.dtype
    rows, cols = torch.arange(block_m)[:, None], torch.arange(block_n)[None, :]
    offsets = first + block_n * torch.arange(-1, count + 1)[:, None, None]
    distance = offsets + cols - rows  # [count + 2, block_m, block_n]
    index = distance.clamp(-max_distance, max_distance) + max_distance
    assert torch.equal(band.cpu(), table.cpu()[:, index[1:-1]])
    assert (distance[0] <= -max_distance).all() and (distance[-1] >= max_distance).all()


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_wide_table_layout(causal):
    """[h, reach + d, e] holds head h's bias at distance d + e (clamped as T5 does), in log2 units."""
    max_distance, reach = 3, 6
    table = torch.randn(2, max_distance + 1 if causal else 2 * max_distance + 1, device=DEVICE)
    wide = _wide_table(table, max_distance, reach, causal)
    assert wide.shape == (2, 2 * reach + 1, 4)
    distance = torch.arange(-reach, reach + 1)[:, None] + torch.arange(4)[None, :]  # [2 * reach + 1, 4]
    if causal:
        index = (-distance).clamp(0, max_distance)
    else:
        index = distance.clamp(-max_distance, max_distance) + max_distance
    assert torch.allclose(wide.cpu(), table.cpu()[:, index] * 1.4426950408889634)


@pytest.mark.parametrize(
    "knobs, words",
    [
        (dict(block_m=48, block_n=16, num_warps=4), "block_m"),
        (dict(block_m=16, block_n=8, num_warps=4), "block_n"),
        (dict(block_m=16, block_n=16, num_warps=5), "num_warps"),
        (dict(block_m=16, block_n=16, num_warps=4, num_stages=0), "num_stages"),
    ],
)
def test_prefill_config_rejects_bad_knobs(knobs, words):
    with pytest.raises(ValueError, match=words):
        PrefillConfig(**knobs)


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16),
                                             (64, torch.float32)])
@pytest.mark.parametrize("longest", [1, 77, 1024, 1025, 2000, 4096, 4097, 9000])
def test_prefill_lengths_hit_every_configuration_once(head_dim, dtype, longest):
    """`prefill_lengths`: one length per configuration `prefill_config` gives 1..longest tokens
    (what a compile-only pass runs the encoder at), none past `longest`, shortest first."""
    from hf_paged_t5.kernels.launch import prefill_lengths

    lengths = prefill_lengths(head_dim, dtype, longest)
    configs = [prefill_config(head_dim, dtype, n) for n in lengths]
    assert lengths == sorted(lengths) and 1 <= lengths[0] and lengths[-1] <= longest
    assert len(set(configs)) == len(configs)
    probes = {1, longest} | {n + d for n in (1024, 4096) for d in (-1, 0, 1) if 1 <= n + d <= longest}
    assert {prefill_config(head_dim, dtype, n) for n in probes} == set(configs)


def test_prefill_fp16_large_scores_do_not_overflow():
    query, key, value, cu_seqlens = packed([20, 9], 2, 32, torch.float16)
    query = torch.full_like(query, 60.0)
    key = (key.float() * 60).clamp(-6e4, 6e4).half()
    args = (query, key, value, cu_seqlens, 20)
    out = prefill(*args)
    assert torch.isfinite(out).all()
    assert rel_err(out, prefill_reference(*args)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(key=torch.randn(10, 2, 16).half()), TypeError, "dtype"),
        (dict(cu_seqlens=torch.tensor([0, 4, 10])), TypeError, "int32"),
        (dict(max_seqlen=torch.tensor(6)), TypeError, "host int"),
        (dict(value=torch.randn(9, 2, 16)), ValueError, "total_tokens"),
        (dict(bias_table=torch.zeros(2, 8)), ValueError, "odd"),
        (dict(dense_bias=torch.zeros(2, 2, 5, 5)), ValueError, "max_seqlen"),
        (dict(query=torch.randn(10, 2, 32)[..., ::2]), ValueError, "contiguous"),
    ],
)
def test_prefill_rejects_bad_arguments(over, error, words):
    args = dict(
        query=torch.randn(10, 2, 16), key=torch.randn(10, 2, 16), value=torch.randn(10, 2, 16),
        cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6,
    )  # fmt: skip
    args.update(over)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in args.items()}
    with pytest.raises(error, match=words):
        prefill(**args)


# ----------------------------------------------------------------------------- local prefill (LongT5)


def side_inputs(lens, size, num_heads, head_dim, dtype, seed=0):
    """LongT5 transient-global side keys of packed rows of `lens` tokens, blocks of `size`:
    side_key, side_value [total_globals, heads, head_dim], cu_globals [batch + 1], block_ids [total_tokens]
    (orphan tails in the last full block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [n // size for n in lens]
    side = [torch.randn(sum(blocks), num_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    cu_globals = torch.tensor([0, *torch.tensor(blocks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    ids = [torch.minimum(torch.arange(n) // size, torch.tensor(max(b - 1, 0))) for n, b in zip(lens, blocks)]
    block_ids = torch.cat(ids).to(torch.int32).to(DEVICE)
    return dict(side_key=side[0], side_value=side[1], cu_globals=cu_globals, block_ids=block_ids)


def local_reference(query, key, value, cu_seqlens, max_seqlen, local_radius, **kw):
    up = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    return reference.local_prefill(query.float(), key.float(), value.float(), cu_seqlens, max_seqlen, local_radius,
                                   **up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("local_radius", [0, 16, 37])
@pytest.mark.parametrize("side", [False, True])
def test_local_prefill_matches_reference(dtype, local_radius, side):
    """Windows inside one 16-key tile, reaching past it and wider than several; lengths around the
    tiles, an empty row, rows shorter than a global block; tables shorter than the distances met
    (the clamp), side keys spanning several tiles."""
    num_heads, head_dim = 2, 24
    lens = [1, 15, 16, 17, 0, 3, 70]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    kw = dict(scale=0.5, bias_table=(3 * torch.randn(num_heads, 15, generator=g)).to(DEVICE))
    if side:
        kw.update(side_inputs(lens, 4, num_heads, head_dim, dtype, seed=13))
        kw["side_bias_table"] = (3 * torch.randn(num_heads, 7, generator=g)).to(DEVICE)
    args = (query, key, value, cu_seqlens, max(lens), local_radius)
    out = local_prefill(*args, **kw)
    ref = local_reference(*args, **kw)
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("block_m, block_n, block_g", [(32, 16, 16), (16, 32, 32), (64, 16, 32), (16, 16, 64)])
def test_local_prefill_tile_configs(block_m, block_n, block_g):
    """Query blocks larger and smaller than key tiles, side tiles larger than a row's globals."""
    num_heads, head_dim = 2, 16
    lens = [block_n - 1, block_m + 1, 2 * block_m + 3, 90]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, torch.float32, seed=14)
    kw = dict(bias_table=torch.randn(num_heads, 41, device=DEVICE),
              side_bias_table=torch.randn(num_heads, 9, device=DEVICE),
              **side_inputs(lens, 2, num_heads, head_dim, torch.float32, seed=15))
    args = (query, key, value, cu_seqlens, max(lens), 20)
    out = local_prefill(*args, config=LocalConfig(block_m, block_n, block_g, num_warps=4), **kw)
    assert rel_err(out, local_reference(*args, **kw)) < TOLERANCE[torch.float32]


def test_local_prefill_without_tables_and_radius_past_the_row():
    """No bias at all (a layer of a model without bias weights) and a window wider than every row:
    full bidirectional attention, the prefill kernel's result; no side bias table."""
    query, key, value, cu_seqlens = packed([5, 33], 2, 16, torch.float32, seed=16)
    out = local_prefill(query, key, value, cu_seqlens, 33, 1000)
    assert rel_err(out, prefill_reference(query, key, value, cu_seqlens, 33)) < TOLERANCE[torch.float32]
    side = side_inputs([5, 33], 4, 2, 16, torch.float32, seed=17)
    out = local_prefill(query, key, value, cu_seqlens, 33, 2, **side)
    ref = local_reference(query, key, value, cu_seqlens, 33, 2, **side)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(local_radius=-1), TypeError, "local_radius"),
        (dict(local_radius=torch.tensor(3)), TypeError, "local_radius"),
        (dict(bias_table=torch.zeros(2, 8)), ValueError, "odd"),
        (dict(bias_table=torch.zeros(2, 9, 2)[..., 0]), ValueError, "contiguous"),
        (dict(side_key=torch.randn(2, 2, 16)), ValueError, "all of side_key"),
        (dict(side_bias_table=torch.zeros(2, 5)), ValueError, "side_bias_table needs"),
        (dict(side=True, block_ids=torch.zeros(9, dtype=torch.int32)), ValueError, "block_ids"),
        (dict(side=True, side_value=torch.randn(2, 2, 8)), ValueError, "side_value"),
        (dict(side=True, cu_globals=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "cu_globals"),
    ],
)
def test_local_prefill_rejects_bad_arguments(over, error, words):
    args = dict(
        query=torch.randn(10, 2, 16), key=torch.randn(10, 2, 16), value=torch.randn(10, 2, 16),
        cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6, local_radius=3,
    )  # fmt: skip
    if over.pop("side", False):
        args.update(side_key=torch.randn(2, 2, 16), side_value=torch.randn(2, 2, 16),
                    cu_globals=torch.tensor([0, 1, 2], dtype=torch.int32), block_ids=torch.zeros(10, dtype=torch.int32))
    args.update(over)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in args.items()}
    with pytest.raises(error, match=words):
        local_prefill(**args)


def test_local_config_rejects_bad_knobs():
    with pytest.raises(ValueError, match="block_g"):
        LocalConfig(block_m=16, block_n=16, block_g=24, num_warps=4)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch, keys", [(64, 2048), (1, 16384)])
@gpu_test
def test_gpu_paged_decode_realistic(dtype, head_dim, batch, keys):
    num_heads, block_size = 16, 16
    g = torch.Generator().manual_seed(0)
    lens = [keys] + torch.randint(keys // 2, keys + 1, (batch - 1,), generator=g).tolist()
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim, dtype)
    query = torch.randn(batch, num_heads, head_dim, device=DEVICE).to(dtype)
    table = torch.randn(num_heads, 129, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    ref = decode_reference(*args, scale=head_dim**-0.5, bias_table=table)
    for num_splits in (None, 1):
        out = paged_decode(*args, scale=head_dim**-0.5, bias_table=table, num_splits=num_splits)
        assert rel_err(out, ref) < TOLERANCE[dtype], num_splits
    for config in (DecodeConfig(128, 8, 2, 4), DecodeConfig(32, 4, 3, 1)):
        out = paged_decode(*args, scale=head_dim**-0.5, bias_table=table, config=config)
        assert rel_err(out, ref) < TOLERANCE[dtype], config


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_gpu_prefill_realistic(dtype, head_dim, causal):
    num_heads = 16
    lens = [2048, 1000, 129, 1]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype)
    table = torch.randn(num_heads, 129 if causal else 257, device=DEVICE)
    args = (query, key, value, cu_seqlens, max(lens))
    out = prefill(*args, causal=causal, bias_table=table)
    assert rel_err(out, prefill_reference(*args, causal=causal, bias_table=table)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", [False, True])
@gpu_test
def test_gpu_local_prefill_realistic(dtype, side):
    """LongT5-large's layout: 16 heads x 64, radius 127, global blocks of 16, a 4k row and short ones."""
    num_heads, head_dim = 16, 64
    lens = [4096, 1000, 129, 15, 1]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype)
    kw = dict(bias_table=torch.randn(num_heads, 257, device=DEVICE))
    if side:
        kw.update(side_inputs(lens, 16, num_heads, head_dim, dtype), side_bias_table=torch.randn(num_heads, 257,
                                                                                                device=DEVICE))
    args = (query, key, value, cu_seqlens, max(lens), 127)
    out = local_prefill(*args, **kw)
    assert rel_err(out, local_reference(*args, **kw)) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_gpu_prefill_toeplitz_configs(head_dim, causal):
    """The tuner's prefill variants (widened table, band tiles), compiled, on sequences up to 2K (bf16)."""
    num_heads, dtype = 16, torch.bfloat16
    lens = [2048, 1000, 129, 1]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, dtype)
    table = torch.randn(num_heads, 129 if causal else 257, device=DEVICE)
    args = (query, key, value, cu_seqlens, max(lens))
    ref = prefill_reference(*args, causal=causal, bias_table=table)
    default = prefill_config(head_dim, dtype, max(lens))
    for config in (dataclasses.replace(default, toeplitz=True), PrefillConfig(128, 64, 8, 2, toeplitz=True),
                   dataclasses.replace(default, band_tiles=True), PrefillConfig(128, 32, 8, 3, band_tiles=True),
                   PrefillConfig(64, 64, 4, 2, band_tiles=True, toeplitz=True),
                   dataclasses.replace(default, band_tiles=True, one_loop=True)):
        out = prefill(*args, causal=causal, bias_table=table, config=config)
        assert rel_err(out, ref) < TOLERANCE[dtype], config
    if not causal and head_dim == 64:  # the default binary and its one-loop twin: the same bits, compiled
        out = prefill(*args, bias_table=table.to(dtype))
        assert torch.equal(out, prefill(*args, bias_table=table.to(dtype), config=dataclasses.replace(default, one_loop=True)))


@pytest.mark.parametrize("head_dim", [64, 128])
@gpu_test
def test_gpu_paged_decode_prefetch_and_fused_combine(head_dim):
    """The tuner's new decode variants, compiled: one row over 16K keys, a batch of mixed rows."""
    num_heads, block_size, dtype = 16, 16, torch.bfloat16
    table = torch.randn(num_heads, 129, device=DEVICE)
    for lens in ([16384], [2048, 5, 700, 1999]):
        key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim, dtype)
        query = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
        args = (query, key_cache, value_cache, block_table, seq_lens)
        ref = decode_reference(*args, bias_table=table)
        for config in (
            DecodeConfig(64, 4, 1, 32, fused_combine=True),
            DecodeConfig(64, 4, 1, 32, prefetch="table"),
            DecodeConfig(64, 4, 3, 16, fused_combine=True, prefetch="async"),
            DecodeConfig(128, 8, 2, 1, prefetch="async"),
            DecodeConfig(32, 1, 2, 1, prefetch="async"),  # many short rows' default
        ):
            out = paged_decode(*args, bias_table=table, config=config)
            assert rel_err(out, ref) < TOLERANCE[dtype], config


@pytest.mark.parametrize("lens", [[1, 16, 17, 200, 5, 128] * 11, [20, 700, 1, 511, 33] * 60], ids=["64-rows", "300-rows"])
@gpu_test
def test_gpu_paged_decode_stores_the_newest_kv(lens):
    """Many bf16 rows, as a decode step launches self-attention with each row's new K/V: the
    default binary (async loads) stores them itself; the cache is `store_kv`'s, bit for bit, and
    the error against float64 exceeds that of `store_kv` then `paged_decode` by at most a bf16 ulp."""
    lens = lens[:64] if len(lens) < 100 else lens
    num_heads, head_dim, block_size, dtype = 16, 64, 16, torch.bfloat16
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, block_size, num_heads, head_dim, dtype, seed=3)
    max_keys = block_table.shape[1] * block_size
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert decode_config(len(lens), num_heads, head_dim, max_keys, sms).prefetch == "async"
    packed = torch.randn(len(lens), 3, num_heads, head_dim, device=DEVICE).to(dtype)
    query, new_k, new_v = packed.unbind(1)
    table_host = block_table.tolist()
    slots = [table_host[r][(n - 1) // block_size] * block_size + (n - 1) % block_size for r, n in enumerate(lens)]
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    bias = torch.randn(num_heads, 129, device=DEVICE)
    caches = [(key_cache.clone(), value_cache.clone()) for _ in range(2)]
    store_kv(key=new_k, value=new_v, key_cache=caches[0][0], value_cache=caches[0][1], slot_mapping=slot_mapping)
    want = paged_decode(query, *caches[0], block_table, seq_lens, bias_table=bias, keys_ready="past")
    got = paged_decode(query, *caches[1], block_table, seq_lens, bias_table=bias, keys_ready="past",
                       new_key=new_k, new_value=new_v, slot_mapping=slot_mapping)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    ref = reference.paged_decode(query.double(), caches[0][0].double(), caches[0][1].double(), block_table,
                                 seq_lens, bias_table=bias.double())
    assert rel_err(got, ref) <= rel_err(want, ref) + torch.finfo(dtype).eps


@gpu_test
def test_gpu_pool_past_int32_offsets():
    """A bf16 pool of > 2^31 elements per cache: offsets of the last blocks need int64."""
    num_heads, head_dim, block_size = 16, 64, 16
    num_blocks = 2**31 // (block_size * num_heads * head_dim) + 64  # 4.3 GB per cache
    key_cache = torch.empty(num_blocks, block_size, num_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    lens = [2 * block_size + 5, 17]  # 3 and 2 blocks
    ids = torch.arange(num_blocks - 6, num_blocks, dtype=torch.int32, device=DEVICE).flip(0)
    block_table = ids.view(2, 3)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    num_tokens = sum(lens)
    key = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).bfloat16()
    value = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).bfloat16()
    # Slot of token t of row r: its block from the table, its offset in the block.
    table_host = block_table.tolist()
    slots = [table_host[r][t // block_size] * block_size + t % block_size for r, n in enumerate(lens) for t in range(n)]
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    store_kv(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    flat_k = key_cache.view(-1, num_heads, head_dim)
    assert torch.equal(flat_k[slot_mapping.long()], key)
    query = torch.randn(2, num_heads, head_dim, device=DEVICE).bfloat16()
    table = torch.randn(num_heads, 129, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    # The reference upcasts after its gather, so the bf16 pool is not copied to fp32 whole.
    ref = reference.paged_decode(query.float(), key_cache, value_cache, block_table, seq_lens, bias_table=table)
    for num_splits in (None, 2):
        out = paged_decode(*args, bias_table=table, num_splits=num_splits)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    del key_cache, value_cache, flat_k
    torch.cuda.empty_cache()


@gpu_test
def test_gpu_paged_decode_replays_in_cuda_graph():
    """No host sync in the wrapper: capture once, then change seq_lens and replay."""
    lens = [700, 5, 2048]
    key_cache, value_cache, block_table, seq_lens = make_paged_kv(lens, 16, 4, 64, torch.bfloat16)
    query = torch.randn(3, 4, 64, device=DEVICE).bfloat16()
    table = torch.randn(4, 129, device=DEVICE)
    args = (query, key_cache, value_cache, block_table, seq_lens)
    # The fused merge's tickets are zeroed by a memset captured with the kernel: every replay
    # starts from zero again.
    fused = DecodeConfig(64, 4, 1, 8, fused_combine=True)
    paged_decode(*args, bias_table=table)  # compile outside the capture
    paged_decode(*args, bias_table=table, config=fused)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(*args, bias_table=table)
        out_fused = paged_decode(*args, bias_table=table, config=fused)
    for lens in ([1, 16, 1500], [700, 3, 2048]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_reference(*args, bias_table=table)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        assert rel_err(out_fused, ref) < TOLERANCE[torch.bfloat16]


# ---- gemv (few-row projections) ----------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(5, 7), (96, 64), (130, 520), (1030, 33)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_matches_reference(rows, n, k, dtype):
    from hf_paged_t5 import kernels

    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, 1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    assert kernels.gemv_supports(x, w)
    out = kernels.gemv(x, w)
    ref = x.double() @ w.double().T
    assert out.shape == (rows, 1, n) and out.dtype == dtype
    # fp32 accumulation: what is left is the final rounding to `dtype`, at most one ulp
    # (Triton's interpreter truncates instead of rounding to nearest).
    ulp = ref.abs() * torch.finfo(dtype).eps
    assert ((out.double() - ref).abs() <= ulp * 1.01 + 1e-4).all()


def test_gemv_refuses_what_it_does_not_serve():
    from hf_paged_t5 import kernels

    w = torch.randn(8, 16).half()
    assert not kernels.gemv_supports(torch.randn(5, 16).half(), w)  # too many rows
    assert not kernels.gemv_supports(torch.randn(1, 16).half(), torch.randn(9000, 16).half())  # vocab-sized: cuBLAS
    assert not kernels.gemv_supports(torch.randn(2, 1024).half(), torch.randn(4096, 1024).half())
    assert not kernels.gemv_supports(torch.randn(1, 16), w.float())  # fp32 stays on torch
    assert not kernels.gemv_supports(torch.randn(1, 16).half(), w.T.contiguous().T)  # column-major
    with pytest.raises(ValueError, match="at most 4 rows"):
        kernels.gemv(torch.randn(5, 16).half(), w)
    with pytest.raises(ValueError, match="features"):
        kernels.gemv(torch.randn(1, 15).half(), w)


def test_prefill_band_tiles_kept_in_the_memo():
    """Given the owner's memo, the band tiles are built once per table and tile shape and rebuilt
    after an in-place write to the table (the result follows the new values); without one, they
    are built every call and kept nowhere."""
    num_heads, head_dim, lens = 2, 16, [40, 23]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, torch.float32, seed=8)
    table = torch.randn(num_heads, 15, device=DEVICE)  # max_distance 7
    config = PrefillConfig(16, 16, 4, 2, band_tiles=True)
    memo = {}
    args = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), bias_table=table,
                config=config, band_memo=memo)
    prefill(**args)
    kept = memo["band"][1]
    prefill(**args)
    assert memo["band"][1] is kept
    with torch.no_grad():
        table.mul_(-2.0)
    out = prefill(**args)
    assert memo["band"][1] is not kept
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), bias_table=table)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    args.pop("band_memo")
    assert torch.equal(prefill(**args), out)
    assert vars(table) == {}  # nothing hangs on the caller's tensor


def test_prefill_band_tiles_with_inference_tensors():
    """A table made under torch.inference_mode has no version counter: its band tiles are rebuilt
    every call, never kept; the patched model's own tables are normal tensors even when built
    under inference mode, so theirs are kept, in one memo per distinct table."""
    from hf_paged_t5.model.bias import BiasTableCache
    from hf_paged_t5 import tiny

    num_heads, head_dim, lens = 2, 16, [40, 23]
    query, key, value, cu_seqlens = packed(lens, num_heads, head_dim, torch.float32, seed=9)
    config = PrefillConfig(16, 16, 4, 2, band_tiles=True)
    with torch.inference_mode():
        table = torch.randn(num_heads, 15, device=DEVICE)
        memo = {}
        args = dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max(lens), config=config)
        out = prefill(**args, bias_table=table, band_memo=memo)
        assert memo == {}
        assert torch.equal(prefill(**args, bias_table=table, band_memo=memo), out)
        model = tiny.build_model().to(DEVICE)
        cache = BiasTableCache(on_rebuild=lambda: None)
        own = cache.get(model.encoder, causal=False)
        memos = cache.memos(model.encoder, causal=False)
        assert not own[0].is_inference()
        assert len(memos) == len(own) and all(m is memos[0] for m in memos)  # T5: one table for all layers
    ref = prefill_reference(query, key, value, cu_seqlens, max(lens), bias_table=table)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_patched_encoder_builds_band_tiles_once_per_table(monkeypatch):
    """The patched encoder's layers share one bias table and its memo: a call builds the band tiles
    once, the next call none; a write to the bias weight makes new tables, whose tiles are built
    again. On CPU (the interpreter) the GPU's launch defaults for short bf16 inputs are forced."""
    import importlib

    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    prefill_mod = importlib.import_module("hf_paged_t5.kernels.prefill")  # the package exports a function of that name
    if DEVICE.type == "cpu":
        monkeypatch.setattr(prefill_mod, "interpreting", lambda: False)
        monkeypatch.setattr(prefill_mod, "prefill_config",
                            lambda *a: PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, band_tiles=True))
    built = []
    real = prefill_mod._band_tiles
    monkeypatch.setattr(prefill_mod, "_band_tiles", lambda *a: built.append(1) or real(*a))
    shape = "tiny" if DEVICE.type == "cpu" else "t5-small"  # d_kv 16 / 64: both under the band-tile defaults
    model = tiny.build_model(shape, dtype=torch.bfloat16, device=DEVICE)
    hp.patch_model(model, hp.PagedCacheConfig(backend="triton"))
    ids = torch.randint(2, 500, (2, 40), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    encoder = model.get_encoder()
    with torch.no_grad():  # the paged encoder serves inference (gradients run stock HF)
        first = encoder(input_ids=ids).last_hidden_state
        assert len(built) == 1
        assert torch.equal(encoder(input_ids=ids).last_hidden_state, first) and len(built) == 1
        encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(0.5)
        encoder(input_ids=ids)
        assert len(built) == 2


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's stand-in for an encoder graph's capture")
def test_a_captured_umt5_encoder_builds_every_layers_band_tiles_in_one_launch(monkeypatch, cpu_encoder_graphs):
    """A captured encoder whose layers each have a bias table (UMT5) looks every table up from the
    weights as the rows of one stacked tensor, and the first layer's prefill builds every layer's
    band tiles in one launch (`_cached_band_tiles`' group): one launch per forward, not one per
    layer; the output bit for bit the eager encoder's, whose tables come from HF's compute_bias;
    a write to one layer's bias weight is seen by the next replay."""
    import importlib

    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    prefill_mod = importlib.import_module("hf_paged_t5.kernels.prefill")
    monkeypatch.setattr(prefill_mod, "interpreting", lambda: False)
    monkeypatch.setattr(prefill_mod, "prefill_config",
                        lambda *a: PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, band_tiles=True))
    built = []
    real = prefill_mod._band_tiles
    monkeypatch.setattr(prefill_mod, "_band_tiles", lambda table, *a: built.append(table.shape[0]) or real(table, *a))
    torch.manual_seed(0)
    model = tiny.build_model("tiny", family="umt5", dtype=torch.float16, num_layers=2, num_decoder_layers=2)
    encoder = model.get_encoder()
    heads = model.config.num_heads
    ids = torch.randint(2, 500, (1, 24), generator=torch.Generator().manual_seed(0))

    def outputs(cuda_graphs: bool, calls: int) -> list:
        hp.patch_model(model, hp.PagedCacheConfig(backend="triton", cuda_graphs=cuda_graphs))
        try:
            with torch.no_grad():
                return [encoder(input_ids=ids).last_hidden_state for _ in range(calls)]
        finally:
            hp.unpatch_model(model)

    want = outputs(False, 1)[0]
    assert built == [heads] * 2  # eager: each layer's own table, its tiles kept with it
    built.clear()
    got = outputs(True, 3)  # eager, captured, replayed
    # eager (each layer's tables from HF); then each captured forward (the capture's and the
    # replay's) builds every layer's tiles in one launch
    assert built[:2] == [heads] * 2 and len(built) >= 4 and set(built[2:]) == {2 * heads}, built
    assert all(torch.equal(g, want) for g in got)
    with torch.no_grad():
        encoder.block[1].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0.0, 3.0)
    replayed = outputs(True, 3)[-1]
    assert not torch.equal(replayed, want) and torch.equal(replayed, outputs(False, 1)[0])


# ---- compile once per configuration ------------------------------------------------------
@gpu_test
def test_gpu_new_workload_sizes_compile_nothing():
    """Once a kernel configuration has run, new lengths, key counts, split sizes and table
    widths reuse its binary: Triton would otherwise compile again for each new "equals 1" /
    "divisible by 16" pattern among those integers (a 0.4-1 s stall each; a BatchGenerator job
    on an H200 hit 8 after its warm-up). Results still match the reference."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no post-compile hook (triton.knobs)")
    compiled = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        compiled.append(kwargs.get("repr", "?"))
        return previous(*args, **kwargs) if previous else None

    num_heads, head_dim = 4, 64
    table = make_bias("table", num_heads, 1, 1, causal=False)["bias_table"].bfloat16()
    causal_table = torch.randn(num_heads, 33, device=DEVICE)
    configs = [DecodeConfig(64, 4, 1, 1), DecodeConfig(64, 4, 1, 3), DecodeConfig(64, 4, 1, 3, fused_combine=True)]

    def run(prefill_lens, decode_lens, extra_cols, configs=configs):
        query, key, value, cu = packed(prefill_lens, num_heads, head_dim, torch.bfloat16, seed=len(prefill_lens))
        out = prefill(query=query, key=key, value=value, cu_seqlens=cu, max_seqlen=max(prefill_lens),
                      bias_table=table)
        ref = prefill_reference(query, key, value, cu, max(prefill_lens), bias_table=table)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        caches = make_paged_kv(decode_lens, 16, num_heads, head_dim, torch.bfloat16, extra_cols=extra_cols)
        q = torch.randn(len(decode_lens), num_heads, head_dim, device=DEVICE).bfloat16()
        ref = decode_reference(q, *caches, bias_table=causal_table)
        for config in configs:
            assert rel_err(paged_decode(q, *caches, bias_table=causal_table, config=config), ref) < 2e-2

    # Key counts (16 x table width) where 3 requested splits stay 3 (the wrapper merges splits of
    # fewer keys, and a count of 1 is the unsplit kernel): widths 9-12, 17-24 or 25-36 blocks.
    run([40, 7], [37, 5], 7)  # width 10: compiles each configuration once
    # other split counts merge in the same kernel (the count is a runtime value)
    other_counts = [DecodeConfig(64, 4, 1, 2), DecodeConfig(64, 4, 1, 5, fused_combine=True)]
    from hf_paged_t5.kernels import ahead

    loaded = ahead.binaries()  # the server's hf_paged_t5_kernel_binaries gauge
    knobs.runtime.jit_post_compile_hook = hook
    try:
        for prefill_lens, decode_lens, extra_cols in (  # widths 10, 21, 17, 32
            ([1], [1], 9), ([48, 16], [16, 48, 130], 12), ([33, 100, 2], [1, 17], 15), ([17], [200, 3, 64, 9], 19),
        ):
            run(prefill_lens, decode_lens, extra_cols)
        run([48, 16], [16, 48, 130], 12, configs=other_counts)  # width 21: 2 and 5 splits
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [] and ahead.binaries() == loaded

    # A decode step's launch (tickets given: the fused merge compiled in) of one split and of
    # several is one binary: a new batch size, whose split count differs, compiles nothing.
    tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    caches = make_paged_kv([37, 5], 16, num_heads, head_dim, torch.bfloat16, extra_cols=7)
    q = torch.randn(2, num_heads, head_dim, device=DEVICE).bfloat16()
    ref = decode_reference(q, *caches)
    step_compiles = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: step_compiles.append(k.get("repr", "?"))
    try:
        for splits in (3, 1, 2):
            out = paged_decode(q, *caches, config=DecodeConfig(64, 4, 1, splits), tickets=tickets, pdl=True)
            assert rel_err(out, ref) < 2e-2
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert len(step_compiles) <= 1  # the first launch's, where no earlier test compiled it
    assert ahead.binaries() == loaded + len(step_compiles)
    assert int(tickets.count_nonzero()) == 0


@pytest.mark.parametrize("group,rows_cut,head_dim,block_size", [(4, 0, 64, 16), (3, 2, 40, 4), (1, 0, 32, 16),
                                                                (5, 3, 64, 1), (16, 9, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # bf16 in the interpreter too
@pytest.mark.parametrize("num_splits,merge", [(1, "none"), (3, "kernel"), (3, "tickets")])
def test_grouped_decode_matches_the_reference_per_row(group, rows_cut, head_dim, block_size, dtype, num_splits, merge):
    """Rows in groups sharing a table row (a beam search's rows of a source, the last group short
    where `rows_cut` rows are cut): the grouped kernel gives each row the reference's attention
    over its own table, at awkward groups, head dims, block sizes and lengths (a tile edge, one
    key, a long source), one split or three merged by a second kernel or in-kernel on tickets
    (left at zero), and the reference twin agrees."""
    from hf_paged_t5.kernels.decode import grouped_decode

    num_heads = 2
    source_lens = [max(1, block_size - 1), 1, 37, 70]
    key_cache, value_cache, table, _ = make_paged_kv(source_lens, block_size, num_heads, head_dim, dtype)
    rows = len(source_lens) * group - rows_cut
    block_table = table.repeat_interleave(group, dim=0)[:rows]
    seq_lens = torch.tensor(source_lens, dtype=torch.int32, device=DEVICE).repeat_interleave(group)[:rows]
    query = torch.randn(rows, num_heads, head_dim, device=DEVICE).to(dtype)
    tickets = torch.zeros(rows * num_heads, dtype=torch.int32, device=DEVICE) if merge == "tickets" else None
    out = grouped_decode(query, key_cache, value_cache, block_table, seq_lens, group, scale=0.7,
                         num_splits=num_splits, tickets=tickets)
    ref = decode_reference(query, key_cache, value_cache, block_table, seq_lens, scale=0.7)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    if tickets is not None:
        assert int(tickets.count_nonzero()) == 0
    # the twin reads each group's first row only: another table for the other rows changes nothing
    scrambled = block_table.clone()
    scrambled[torch.arange(rows, device=DEVICE) % group != 0] = 0
    assert torch.equal(reference.grouped_decode(query, key_cache, value_cache, scrambled, seq_lens, group, 0.7),
                       reference.paged_decode(query, key_cache, value_cache, block_table, seq_lens, 0.7))
    with pytest.raises(ValueError, match="group"):
        grouped_decode(query, key_cache, value_cache, block_table, seq_lens, 17)


_NO_LIBDEVICE = r"""
import re
import triton
import triton.backends.nvidia.compiler as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
decode, prefill, rmsnorm = (importlib.import_module(f"hf_paged_t5.kernels.{m}") for m in ("decode", "prefill", "rmsnorm"))

links = []
real_link = nvidia.llvm.link_extern_libs


def link(module, paths):
    links.append(sorted(set(re.findall(r"declare [^@]*@(__nv_\w+)", str(module)))))
    real_link(module, paths)


nvidia.llvm.link_extern_libs = link


def compile_for_sm90(kernel, constexprs, types, warps, stages):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                 for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


cases = [
    ("rms_norm", "rsqrt.approx.ftz.f32", rmsnorm._rms_norm_kernel,
     dict(HAS_RESIDUAL=True, SPLITS=0, HALF_WEIGHT=True, BLOCK=1024, PDL=True), dict(eps="fp32"), 4, 3),
    ("paged_decode", "ex2.approx.ftz.f32", decode._paged_decode_kernel,
     dict(BIAS_MODE=1, BLOCK_SIZE=16, BLOCK_N=128, BLOCK_D=64, MERGE_CHUNK=16, FUSED_COMBINE=True, PREFETCH=0,
          NUM_STAGES=1, PDL=True, READY=1),
     dict(scale="fp32", block_table_ptr="*i32", seq_lens_ptr="*i32", bias_ptr="*fp32", part_ptr="*fp32",
          ticket_ptr="*i32"), 4, 1),
    ("prefill", "ex2.approx.ftz.f32", prefill._prefill_kernel,
     dict(CAUSAL=False, BIAS_MODE=1, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64, EVEN_D=True, NUM_STAGES=3, TILE_RANGES=True,
          BAND_SPLIT=True, TOEPLITZ=False, BAND_TILES=True, ONE_LOOP=False, INPUT_PRECISION="tf32"),
     dict(scale="fp32", cu_seqlens_ptr="*i32", wide_ptr="*fp32"), 4, 3),
]
for name, instruction, kernel, constexprs, types, warps, stages in cases:
    links.clear()
    compiled = compile_for_sm90(kernel, constexprs, types, warps, stages)
    print(name, "links", links, "has", instruction in compiled.asm["ptx"])
"""


def test_kernels_link_no_libdevice(tmp_path):
    """`kernels.fast_math`: the prefill, decode-attention and RMSNorm kernels compiled for sm_90
    (this machine's Triton and ptxas, no GPU) call no libdevice function, so their compiles skip
    linking the library's bitcode, and their PTX holds the instruction Triton's `tl.exp2` /
    `tl.math.rsqrt` become (`ex2.approx.ftz.f32`, `rsqrt.approx.ftz.f32`). Either kernel calling
    Triton's own function again fails it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    done = subprocess.run([sys.executable, "-c", _NO_LIBDEVICE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines == [f"{name} links [] has True" for name in ("rms_norm", "paged_decode", "prefill")], done.stdout


@gpu_test
def test_gpu_fast_math_matches_triton():
    """`fast_math.exp2` / `fast_math.rsqrt` give the bits of Triton's `tl.exp2` / `tl.math.rsqrt`
    over float32's whole range: zeros, subnormals (flushed by both), the exp2 overflow and
    underflow edges, infinities, NaN and 2^20 random values of every exponent."""
    import triton.language as tl

    from hf_paged_t5.kernels import fast_math

    @triton.jit
    def both(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(out_ptr + i, fast_math.exp2(x), mask=i < n)
        tl.store(out_ptr + n + i, tl.exp2(x), mask=i < n)
        tl.store(out_ptr + 2 * n + i, fast_math.rsqrt(x), mask=i < n)
        tl.store(out_ptr + 3 * n + i, tl.math.rsqrt(x), mask=i < n)

    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 1.17e-38, 1.0, -1.0, 127.99, 128.0, 128.5,
                            -125.9, -126.0, -149.0, -150.5, 3.4e38, float("inf"), -float("inf"), float("nan")])
    bits = torch.randint(0, 2**31 - 1, (1 << 20,), dtype=torch.int32).view(torch.float32)  # every exponent
    x = torch.cat([special, bits, -bits]).to(DEVICE)
    n = x.numel()
    out = torch.empty(4 * n, device=DEVICE)
    both[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
    ours_exp2, exp2, ours_rsqrt, rsqrt = out.view(4, n).view(torch.int32)
    assert torch.equal(ours_exp2, exp2)
    assert torch.equal(ours_rsqrt, rsqrt)
