"""The CPU backend (`cpu_ops.py`) against the plain-PyTorch reference, at awkward sizes.

float64 inputs must agree to float64 rounding; float32 / bfloat16 within a few units of the
dtype's rounding of the reference computed on float32 copies (tests/test_kernels.py's bounds).
Never-written pool memory is NaN here: a backend that reads a slot past a row's length shows it.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged_t5 import cpu_ops, reference

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def paged_pool(lens, block_size, heads, head_dim, dtype, seed):
    """A shuffled pool of rows of `lens` keys; every slot past a row's length is NaN."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 2
    k = torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=torch.float64)
    v = k.clone()
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), max(per_row) + 1), ids[-1], dtype=torch.int32)  # spare column: a NaN block
    for row, (n, blocks) in enumerate(zip(lens, per_row)):
        row_ids = [ids.pop(0) for _ in range(blocks)]
        table[row, :blocks] = torch.tensor(row_ids, dtype=torch.int32)
        for t in range(n):
            b, o = row_ids[t // block_size], t % block_size
            k[b, o] = torch.randn(heads, head_dim, generator=g, dtype=torch.float64)
            v[b, o] = torch.randn(heads, head_dim, generator=g, dtype=torch.float64)
    return k.to(dtype), v.to(dtype), table, torch.tensor(lens, dtype=torch.int32)


def _bias(kind, heads, batch, keys, causal, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "table":
        d = 5
        return {"bias_table": 3 * torch.randn(heads, d + 1 if causal else 2 * d + 1, generator=g, dtype=torch.float64)}
    if kind == "dense":
        shape = (batch, heads, keys) if causal is None else (batch, heads, keys, keys)
        return {"dense_bias": 3 * torch.randn(*shape, generator=g, dtype=torch.float64)}
    return {}


def _cast(kw, dtype):
    return {k: v.to(torch.float64 if dtype == torch.float64 else torch.float32) for k, v in kw.items()}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("bias", ["none", "table", "dense"])
@pytest.mark.parametrize("lens", [[1], [5, 17, 16, 2], [33, 1, 15]])
def test_paged_decode_matches_reference(dtype, block_size, bias, lens):
    heads, head_dim = 3, 12
    k, v, table, seq_lens = paged_pool(lens, block_size, heads, head_dim, dtype, seed=len(lens) + block_size)
    q = torch.randn(len(lens), heads, head_dim, dtype=torch.float64).to(dtype)
    kw = _bias(bias, heads, len(lens), max(lens), causal=True if bias == "table" else None, seed=1)
    out = cpu_ops.paged_decode(query=q, key_cache=k, value_cache=v, block_table=table, seq_lens=seq_lens,
                               scale=0.7, **{n: t.to(dtype) if dtype == torch.float64 else t.float() for n, t in kw.items()})
    up = torch.float64 if dtype == torch.float64 else torch.float32
    ref = reference.paged_decode(query=q.to(up), key_cache=k.to(up), value_cache=v.to(up), block_table=table,
                                 seq_lens=seq_lens, scale=0.7, **_cast(kw, dtype))
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "a slot past a row's length (NaN) was read"
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", ["none", "table", "dense"])
@pytest.mark.parametrize("lens", [[1], [7, 1, 12, 12], [3, 20], [9, 9, 9]])  # [9, 9, 9]: no padding
def test_prefill_matches_reference(dtype, causal, bias, lens, monkeypatch):
    monkeypatch.setattr(cpu_ops, "PREFILL_QUERY_CHUNK", 5)  # several query chunks, one partial
    heads, head_dim = 2, 8
    total = sum(lens)
    g = torch.Generator().manual_seed(total)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    kw = _bias(bias, heads, len(lens), max(lens), causal=causal, seed=2)
    out = cpu_ops.prefill(query=q, key=k, value=v, cu_seqlens=cu, max_seqlen=max(lens), scale=0.9, causal=causal,
                          **{n: t.to(dtype) if dtype == torch.float64 else t.float() for n, t in kw.items()})
    up = torch.float64 if dtype == torch.float64 else torch.float32
    ref = reference.prefill(query=q.to(up), key=k.to(up), value=v.to(up), cu_seqlens=cu, max_seqlen=max(lens),
                            scale=0.9, causal=causal, **_cast(kw, dtype))
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("group,rows", [(2, 6), (4, 10), (3, 3)])  # (4, 10): a short last group
def test_grouped_decode_matches_the_reference_row_by_row(dtype, group, rows):
    """Rows in consecutive groups sharing their source's table and length (a beam step's
    cross-attention): each group's keys gathered once, its queries in one SDPA call; every row as
    the reference computes it alone, and no slot past a source's length (NaN) read."""
    heads, head_dim, block_size = 3, 12, 3
    lens = [17, 1, 5, 9][: -(-rows // group)]
    k, v, table, seq_lens = paged_pool(lens, block_size, heads, head_dim, dtype, seed=rows)
    source = torch.arange(rows) // group
    table, seq_lens = table[source], seq_lens[source]
    q = torch.randn(rows, heads, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(group)).to(dtype)
    out = cpu_ops.grouped_decode(query=q, key_cache=k, value_cache=v, block_table=table, seq_lens=seq_lens,
                                 group=group, scale=0.7)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    ref = reference.paged_decode(query=q.to(up), key_cache=k.to(up), value_cache=v.to(up), block_table=table,
                                 seq_lens=seq_lens, scale=0.7)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "a slot past a source's length (NaN) was read"
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert cpu_ops.grouped_supports(q, group) and not cpu_ops.grouped_supports(q, 1)


def test_interface_matches_the_reference():
    """Same functions, same keyword arguments in the same order (the backends are interchangeable)."""
    import inspect

    for name in ("store_kv", "paged_decode", "prefill", "local_prefill", "rms_norm", "gemv", "gemv_supports"):
        assert list(inspect.signature(getattr(cpu_ops, name)).parameters) == \
            list(inspect.signature(getattr(reference, name)).parameters), name


def _decode_inputs(lens, block_size, seed, heads=3, head_dim=12):
    k, v, table, seq_lens = paged_pool(lens, block_size, heads, head_dim, torch.float64, seed=seed)
    q = torch.randn(len(lens), heads, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return dict(query=q, key_cache=k, value_cache=v, block_table=table, seq_lens=seq_lens)


def test_decode_state_reuses_only_what_is_unchanged():
    """`DecodeState` equals `paged_decode` step after step: its kept gather plan, bias mask and
    cross K/V serve a layer only while the block table, lengths and bias table are the same ones."""
    state = cpu_ops.DecodeState()
    table5 = 3 * torch.randn(3, 6, dtype=torch.float64)
    other_table = 3 * torch.randn(3, 6, dtype=torch.float64)
    first = _decode_inputs([5, 17, 2], block_size=3, seed=1)
    cases = [
        (first, table5),
        (dict(first, query=first["query"].flip(0)), table5),  # next layer: same plan, new query
        (first, other_table),  # a layer with its own bias table (UMT5)
        (dict(first, seq_lens=first["seq_lens"] - 1), table5),  # next step: shorter rows here
        (_decode_inputs([5, 17, 2], block_size=3, seed=2), table5),  # same lengths, other blocks
        (_decode_inputs([4, 1], block_size=3, seed=3), table5),  # another batch
    ]
    for i, (kw, bias_table) in enumerate(cases):
        want = reference.paged_decode(scale=0.7, bias_table=bias_table, **kw)
        got = state.self_decode(scale=0.7, bias_table=bias_table, **kw)
        assert rel_err(got, want) < TOLERANCE[torch.float64], f"self-attention case {i}"
        want = reference.paged_decode(scale=0.7, **kw)
        got = state.cross_decode(0, scale=0.7, **kw)
        assert rel_err(got, want) < TOLERANCE[torch.float64], f"cross-attention case {i}"


def test_decode_state_keeps_cross_kv_per_layer():
    """Layers have their own pools: one layer's kept cross K/V never serve another's."""
    state = cpu_ops.DecodeState()
    a = _decode_inputs([7, 3], block_size=4, seed=4)
    b = dict(a, key_cache=a["key_cache"].flip(2), value_cache=a["value_cache"] * 2)
    for layer, kw in ((0, a), (1, b), (0, a), (1, b)):
        want = reference.paged_decode(scale=1.0, **kw)
        assert rel_err(state.cross_decode(layer, scale=1.0, **kw), want) < TOLERANCE[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("local_radius", [0, 2, 9])
@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("chunk", [None, 1])
def test_local_prefill_matches_reference(dtype, local_radius, side, chunk, monkeypatch):
    """LongT5's windowed attention: windows of local_radius + 1 around rows of awkward lengths (an
    empty row, rows shorter than a window and than a global block), one block per chunk or all."""
    if chunk is not None:
        monkeypatch.setattr(cpu_ops, "LOCAL_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(21)
    lens, heads, head_dim, size = [7, 0, 1, 3, 26], 3, 8, 4
    total = sum(lens)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(scale=0.7, bias_table=torch.randn(heads, 9, generator=g, dtype=torch.float64).to(dtype))
    if side:
        blocks = [n // size for n in lens]
        kw.update(
            side_key=torch.randn(sum(blocks), heads, head_dim, generator=g, dtype=torch.float64).to(dtype),
            side_value=torch.randn(sum(blocks), heads, head_dim, generator=g, dtype=torch.float64).to(dtype),
            cu_globals=torch.tensor([0, *torch.tensor(blocks).cumsum(0).tolist()], dtype=torch.int32),
            block_ids=torch.cat([torch.minimum(torch.arange(n) // size, torch.tensor(max(b - 1, 0)))
                                 for n, b in zip(lens, blocks)]).to(torch.int32),
            side_bias_table=torch.randn(heads, 5, generator=g, dtype=torch.float64).to(dtype),
        )  # fmt: skip
    out = cpu_ops.local_prefill(q, k, v, cu, max(lens), local_radius, **kw)
    ref = reference.local_prefill(q, k, v, cu, max(lens), local_radius, **kw)
    assert out.dtype == dtype and rel_err(out, ref) < TOLERANCE[dtype]
