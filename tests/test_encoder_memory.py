"""The encoder's feed-forward runs in row chunks (peak memory); results must not change.

Chunks are forced tiny (5 tokens, which divides none of the token counts here) by replacing
`stacks.ff_chunk_tokens`, and every test checks that the chunking really ran: a forward
pre-hook on each encoder `DenseReluDense` counts its calls and the rows it was given.

Chunked and whole outputs are close, not bitwise equal: MKL's fp32 GEMM sums a row in another
order depending on how many rows the product has (a 5-row product differs from the same rows
inside a 43-row one, by an ulp or so). Measured: <= 1.1e-5 on outputs of magnitude ~4, less than
the paged encoder's own distance from stock HF here (1.5e-5). A wrong row or a lost chunk would
be off by O(1). Against stock HF, the outputs are within stock's own fp32 error (tests/oracle.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_batch, make_model
from oracle import assert_within_stock_error, compare_with_stock, fp64_twin, stock_copy
from torch import nn

import hf_paged_t5 as hp
from hf_paged_t5 import cpu_ops
from hf_paged_t5.model import stacks

CONFIG = hp.PagedCacheConfig(block_size=8, backend="torch")
TINY_CHUNK = 5
ONE_CHUNK = 10**9
CHUNKING_ATOL = 3e-5
# (row lengths, padding side): mixed lengths padded on either side, and a batch with no padding.
BATCHES = [([13, 7, 21, 2], "right"), ([13, 7, 21, 2], "left"), ([11, 11, 11], "right")]


def ff_modules(encoder: nn.Module) -> list[nn.Module]:
    return [block.layer[-1].DenseReluDense for block in encoder.block]


def count_calls(modules: list[nn.Module]) -> tuple[list[int], list]:
    """([calls, most rows], hook handles): how often `modules` ran, and the most rows (tokens)
    any one call was given."""
    calls = [0, 0]

    def pre_hook(_module, args):
        calls[0] += 1
        calls[1] = max(calls[1], args[0].reshape(-1, args[0].shape[-1]).shape[0])

    return calls, [m.register_forward_pre_hook(pre_hook) for m in modules]


def patched_encoder_output(model, ids, mask, chunk_tokens, monkeypatch):
    """(last_hidden_state of the patched encoder with `chunk_tokens` rows per FF chunk, [calls, max rows])."""
    monkeypatch.setattr(stacks, "ff_chunk_tokens", lambda d_ff, element_size, tokens: chunk_tokens)
    calls, handles = count_calls(ff_modules(model.encoder))
    hp.patch_model(model, CONFIG)
    try:
        with torch.no_grad():
            out = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        hp.unpatch_model(model)
        for h in handles:
            h.remove()
    return out, calls


def test_chunk_rule():
    # A [chunk, d_ff] intermediate of at most FF_CHUNK_BYTES (4 MiB), at least 1,024 rows, at most 4 chunks.
    assert stacks.ff_chunk_tokens(2048, 2, 4096) == 1024  # t5-small, bf16, 8 x 512 tokens
    assert stacks.ff_chunk_tokens(2048, 2, 16384) == 4096  # t5-small, bf16, 32 x 512 tokens: 4 chunks
    assert stacks.ff_chunk_tokens(4096, 2, 2048) == 1024  # t5-large, bf16: two chunks of the smallest size
    assert stacks.ff_chunk_tokens(10240, 2, 512) == 1024  # T5 v1.1 XXL, bf16, 1 x 512: one chunk
    assert stacks.ff_chunk_tokens(1024, 4, 8192) == 2048  # t5-small-like FF, fp32: 4 MiB per chunk
    assert stacks.ff_chunk_tokens(65536, 2, 100) == stacks.FF_MIN_CHUNK_TOKENS == 1024
    assert stacks.ff_chunk_tokens(4096, 2, 32768) == 8192 == 32768 // stacks.FF_MAX_CHUNKS  # batch 64 x 512
    dense = make_model("t5v1_1").encoder.block[0].layer[-1].DenseReluDense.half()
    assert stacks._ff_element_size(dense, torch.zeros(1, dtype=torch.float16)) == 2
    dense.wo.float()  # HF's `_keep_in_fp32_modules`: the intermediate is cast up to fp32
    assert stacks._ff_element_size(dense, torch.zeros(1, dtype=torch.float16)) == 4


@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
@pytest.mark.parametrize("lengths, side", BATCHES, ids=["right", "left", "no-padding"])
def test_chunked_encoder_equals_unchunked(family, lengths, side, monkeypatch):
    model = make_model(family, seed=3)
    ids, mask = make_batch(lengths, padding_side=side)
    total_tokens, layers = sum(lengths), len(model.encoder.block)
    whole, calls = patched_encoder_output(model, ids, mask, ONE_CHUNK, monkeypatch)
    assert calls == [layers, total_tokens]
    chunked, calls = patched_encoder_output(model, ids, mask, TINY_CHUNK, monkeypatch)
    assert calls == [layers * math.ceil(total_tokens / TINY_CHUNK), TINY_CHUNK], "the FF did not run in chunks"
    torch.testing.assert_close(chunked, whole, rtol=0, atol=CHUNKING_ATOL)  # see the module docstring
    real = mask.bool()
    assert (chunked[~real] == 0).all()
    with torch.no_grad():
        ref = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        ref64 = fp64_twin(model).encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_within_stock_error(chunked[real], ref[real], ref64[real], "last_hidden_state")


def test_chunk_output_takes_the_modules_dtype():
    """fp16 with `wo` kept in fp32 (HF's `_keep_in_fp32_modules`): the FF returns fp32, and the
    chunks must be gathered in fp32, not rounded to the fp16 activations."""
    ff = make_model("t5v1_1", seed=4).encoder.block[0].layer[-1].half()
    ff.DenseReluDense.wo.float()
    normed = torch.randn(41, ff.DenseReluDense.wi_0.in_features, generator=torch.Generator().manual_seed(0))
    normed = normed.half()
    calls, handles = count_calls([ff.DenseReluDense])
    try:
        with torch.no_grad():
            whole = ff.dropout(ff.DenseReluDense(normed))
            chunked = stacks._chunked_feed_forward(cpu_ops, ff, normed, TINY_CHUNK)
    finally:
        for h in handles:
            h.remove()
    assert calls == [1 + math.ceil(41 / TINY_CHUNK), 41]
    assert chunked.dtype == whole.dtype == torch.float32
    # fp32-close (measured 8e-6 relative); chunks rounded through fp16 would be off by ~5e-4.
    torch.testing.assert_close(chunked, whole, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_greedy_with_tiny_ff_chunks_matches_hf(family, side, monkeypatch):
    model = make_model(family, seed=5)
    lengths = [13, 7, 21, 2]
    ids, mask = make_batch(lengths, padding_side=side)
    stock = stock_copy(model)  # before the hooks: they count the patched call's FF calls only
    monkeypatch.setattr(stacks, "ff_chunk_tokens", lambda d_ff, element_size, tokens: TINY_CHUNK)
    calls, handles = count_calls(ff_modules(model.encoder))
    hp.patch_model(model, CONFIG)
    try:
        compare_with_stock(model, stock_model=stock, input_ids=ids, attention_mask=mask, max_new_tokens=16,
                           min_new_tokens=16)
    finally:
        hp.unpatch_model(model)
        for h in handles:
            h.remove()
    assert calls == [len(model.encoder.block) * math.ceil(sum(lengths) / TINY_CHUNK), TINY_CHUNK]


def test_only_real_tokens_are_embedded():
    """Given input_ids, the patched encoder embeds the real tokens only (no [batch, seq, d_model]
    embedding of the padded batch is made); the output is HF's, padded positions 0."""
    model = make_model("t5", seed=3)
    ids, mask = make_batch([9, 3, 6], padding_side="left")
    with torch.no_grad():
        ref = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        ref64 = fp64_twin(model).encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    shapes = []
    handle = model.encoder.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    hp.patch_model(model)
    try:
        with torch.no_grad():
            out = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        handle.remove()
        hp.unpatch_model(model)
    assert shapes == [(18, model.config.d_model)]  # 9 + 3 + 6 real tokens, flat
    real = mask.bool()
    assert_within_stock_error(out[real], ref[real], ref64[real], "last_hidden_state")
    assert not out[~real].any()


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_encoder_output_is_the_real_rows(side):
    """`encoder_forward(packed=True)` (BatchGenerator's call) returns the real tokens only, row by
    row, equal to the padded output's real positions; a CPU mask for device inputs is accepted."""
    model = make_model("t5", seed=6)
    ids, mask = make_batch([5, 11, 2], padding_side=side)
    runtime = hp.patch_model(model, hp.PagedCacheConfig(backend="torch"))._hf_paged_t5
    try:
        tables = runtime.bias_tables(model.encoder, causal=False)
        with torch.no_grad():
            padded = stacks.encoder_forward(model.encoder, runtime.ops_for, tables, None, mask, input_ids=ids)
            packed = stacks.encoder_forward(model.encoder, runtime.ops_for, tables, None, mask.bool(),
                                            input_ids=ids, packed=True)
    finally:
        hp.unpatch_model(model)
    assert packed.shape == (18, model.config.d_model)
    torch.testing.assert_close(packed, padded[mask.bool()], rtol=0, atol=0)


def test_first_blocks_only():
    """`encoder_forward(blocks=k)` (a compile-only pass's early request of one length's kernels) is
    the encoder of the first k layers and the final norm: the same bits as that stack cut to k."""
    model = make_model("t5", seed=7)
    assert model.config.num_layers > 1
    ids, mask = make_batch([6, 3])
    runtime = hp.patch_model(model, hp.PagedCacheConfig(backend="torch"))._hf_paged_t5
    try:
        tables = runtime.bias_tables(model.encoder, causal=False)
        with torch.no_grad():
            first = stacks.encoder_forward(model.encoder, runtime.ops_for, tables, None, mask, input_ids=ids,
                                           blocks=1)
            whole = stacks.encoder_forward(model.encoder, runtime.ops_for, tables, None, mask, input_ids=ids)
            model.encoder.block = model.encoder.block[:1]
            cut = stacks.encoder_forward(model.encoder, runtime.ops_for, tables, None, mask, input_ids=ids)
    finally:
        hp.unpatch_model(model)
    torch.testing.assert_close(first, cut, rtol=0, atol=0)
    assert not torch.equal(first, whole)
