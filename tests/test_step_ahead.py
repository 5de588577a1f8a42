"""A cold generate()'s first decode step compiled in its encoder's pass: the predicted graph key and the wiring.

On a GPU the first call of a process runs its encoder once compile-only (`kernels/ahead.py`), and
with it the call's cross K/V store and first decode step, so every kernel of the call compiles on
one pool at once. What a CPU can check: the key predicted before the encoder runs is the key the
first step's graph gets, and the encoder's pass runs the call's extra work only inside that call.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged_t5 as hp
from hf_paged_t5.decode.graphs import graph_key, predicted_key
from hf_paged_t5.hf.cache import PagedEncoderDecoderCache
from hf_paged_t5.kv.pool import KVPool, LayerSpec

from conftest import make_batch, make_model


@pytest.mark.parametrize("source_lens,expand,max_self_tokens,block_size", [
    ([7], 1, 20, 4), ([300, 12, 77], 4, 63, 16), ([1, 1], 2, 1, 16), ([513, 40], 1, 129, 16), ([16], 3, 64, 16),
])
def test_predicted_key_is_the_first_steps(source_lens, expand, max_self_tokens, block_size):
    config = hp.PagedCacheConfig(block_size=block_size, num_blocks=8, backend="torch")
    pool = KVPool(config, [LayerSpec(torch.device("cpu"), torch.float32, num_heads=2, head_dim=8)])
    pool.reserve(PagedEncoderDecoderCache.blocks_needed(source_lens, expand, max_self_tokens, pool.block_size))
    cache = PagedEncoderDecoderCache(pool, len(source_lens), expand, max_self_tokens)
    predicted = predicted_key(cache, max(source_lens))
    cache.store_cross_plan(source_lens)  # what the encoder's call does next
    assert predicted == graph_key(cache, cache.num_rows, cache.host_tables(), capture=True)
    cache.release()


def test_the_encoder_pass_runs_the_calls_extra_work_only_inside_that_call(monkeypatch):
    """generate() registers its first step and cross store for its encoder's compile pass; a pass
    outside a call (a standalone encoder call) runs only the encoder; the work is gone after the call."""
    from hf_paged_t5.hf import runtime as runtime_mod

    passes = []

    def fake_pass(device, backend, forward, what, before=None):
        passes.append(what)
        forward()

    monkeypatch.setattr(runtime_mod, "run_compiled_ahead", fake_pass)
    model = hp.patch_model(make_model("t5"), hp.PagedCacheConfig(block_size=4, backend="torch"))
    runtime = model._hf_paged_t5  # private: the runtime patch_model attaches
    ran = []
    with runtime.runner.owning(), runtime.also_ahead(lambda: ran.append("extra")):
        runtime.compile_ahead(torch.device("cpu"), "kind-a", lambda: ran.append("encoder"))
    assert ran == ["encoder", "extra"] and passes == ["kind-a"]
    with runtime.also_ahead(lambda: ran.append("extra")):  # not owning: a standalone call
        runtime.compile_ahead(torch.device("cpu"), "kind-b", lambda: ran.append("encoder"))
    assert ran == ["encoder", "extra", "encoder"]
    assert runtime._also_ahead is None
    ids, mask = make_batch([5, 3])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)  # wiring in place: no error
    assert runtime._also_ahead is None
