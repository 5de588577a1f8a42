"""The per-head distance tables against HF's own position bias, far past max_distance."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from hf_paged_t5.model import bias as bias_mod


def expand(table: torch.Tensor, length: int, causal: bool) -> torch.Tensor:
    """[heads, length, length] from a table as the kernels index it (clamped distance)."""
    d = bias_mod.table_distance_of(table, causal)
    pos = torch.arange(length)
    distance = pos[None, :] - pos[:, None]  # k - q
    index = (-distance).clamp(0, d) if causal else distance.clamp(-d, d) + d
    return table[:, index]


@pytest.mark.parametrize("family", ["t5", "umt5"])
@pytest.mark.parametrize("buckets, max_distance", [(32, 128), (16, 20), (64, 256), (8, 7)])
def test_tables_equal_hf_bias_past_max_distance(family, buckets, max_distance):
    """HF's bucketing saturates by max_distance (its log ratio reaches 1 there), so a table over
    0..max_distance, clamped beyond, is HF's bias exactly at every distance."""
    model = make_model(family, num_layers=1, num_decoder_layers=1, relative_attention_num_buckets=buckets,
                       relative_attention_max_distance=max_distance)
    length = 3 * max_distance + 5
    for stack, causal in ((model.encoder, False), (model.decoder, True)):
        attention = stack.block[0].layer[0].SelfAttention
        build = bias_mod.causal_bias_table if causal else bias_mod.bidirectional_bias_table
        table = build(attention)
        assert bias_mod.table_distance_of(table, causal) == max_distance
        hf = attention.compute_bias(length, length)[0].float()  # [heads, q, k]
        if causal:  # HF's decoder bias is causal in the bucket only; compare at k <= q
            keep = torch.ones(length, length, dtype=torch.bool).tril()
            assert torch.equal(expand(table, length, True)[:, keep], hf[:, keep])
        else:
            assert torch.equal(expand(table, length, False), hf)


@pytest.mark.parametrize("family, distinct", [("t5", 1), ("umt5", 3)])
def test_cache_builds_each_layer_modules_table_once(family, distinct):
    """T5's layers share the first layer's bias module: `BiasTableCache.get` builds its table once
    for the whole stack (and one per layer where each has its own, UMT5), every layer's entry the
    one HF would use."""
    model = make_model(family, num_layers=3, num_decoder_layers=3)
    built = []
    real = bias_mod.bidirectional_bias_table
    cache = bias_mod.BiasTableCache(lambda: None)
    try:
        bias_mod.bidirectional_bias_table = lambda m: built.append(m) or real(m)
        tables = cache.get(model.encoder, causal=False)
    finally:
        bias_mod.bidirectional_bias_table = real
    assert len(built) == distinct and len({id(t) for t in tables}) == distinct
    for table, module in zip(tables, bias_mod.layer_bias_modules(model.encoder)):
        assert torch.equal(table, real(module))
