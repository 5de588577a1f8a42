"""The batch engine's encoder graphs on the CPU (`BatchRun._encode_graphed`): a stand-in for the CUDA
capture replays the captured forward eagerly, so what is tested is everything around a graph: that
a lone input padded to its bucket (the padding packed as a sequence of its own) gives the eager
packed forward's rows, which chunks and models take the graphs, that a bucket is captured once and
replayed after, that the results stay generate()'s on each input alone, and that a server's warm-up
captures every bucket. tests/test_encoder_graphs.py and the GPU tests of tests/test_batching.py
run real graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from transformers import LongT5Config, LongT5ForConditionalGeneration

import hf_paged_t5 as hp
from hf_paged_t5.batch import online
from hf_paged_t5.batch.run import BatchRun
from hf_paged_t5.hf import forward as forward_mod
from hf_paged_t5.model import encoder_graphs
from hf_paged_t5.model.stacks import encoder_forward

pytestmark = pytest.mark.usefixtures("one_thread_per_module")  # conftest: tiny matmuls, one thread

BUCKETS = (8, 16, 32, 64)


@pytest.fixture(autouse=True)
def cpu_graphs(cpu_encoder_graphs, monkeypatch):
    """Encoder graphs "captured" on the CPU (conftest), and small buckets (a test model's inputs are short)."""
    monkeypatch.setattr(encoder_graphs, "BUCKETS", BUCKETS)


def patched(family="t5", seed=0, **config):
    return hp.patch_model(make_model(family, seed=seed), hp.PagedCacheConfig(**{"block_size": 4, **config}))


def inputs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in lengths]


def alone(model, ids, max_new):
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new)
    return out.tolist()


@pytest.mark.parametrize("family", ["t5", "umt5"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 64])
def test_a_padded_bucket_gives_the_packed_rows(family, n):
    """The bucket forward over an input padded to its bucket (cu_seqlens [0, n, bucket]) gives, in
    its first n rows, the eager packed forward's rows of that input; every row is finite (the
    padding is a sequence of its own, not garbage). UMT5: a bias table per layer."""
    model = patched(family)
    encoder, runtime = model.get_encoder(), model._hf_paged_t5
    ids = inputs([n])[0]
    length = encoder_graphs.bucket_of(n)
    assert length >= n and (length == BUCKETS[0] or BUCKETS[BUCKETS.index(length) - 1] < n)
    src = torch.tensor(ids + [0] * (length - n) + [0, n, length])
    with torch.no_grad():
        graphed = forward_mod.bucket_forward(runtime, encoder, length)(src)
        eager = encoder_forward(encoder, runtime.ops_for, runtime.bias_tables(encoder, causal=False), None, None,
                                input_ids=torch.tensor([ids]), packed=True)
    assert graphed.shape == (length, model.config.d_model) and torch.isfinite(graphed).all()
    torch.testing.assert_close(graphed[:n], eager, rtol=1e-5, atol=1e-5)


def test_lone_inputs_replay_one_graph_per_bucket_and_give_generate_alone():
    """Inputs admitted one at a time (one row): each bucket is captured at its first input and
    replayed for the rest; every result is generate() on that input alone, and eager chunks (graphs
    off) give the same."""
    lengths, max_new = [5, 12, 3, 30, 9, 16, 40, 2], [4, 6, 3, 5, 7, 2, 4, 6]
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs(lengths), max_new)]
    model = patched()
    results = [r.sequences for r in hp.BatchGenerator(model, max_batch_rows=1).generate(requests)]
    stats = hp.runtime_stats(model)
    assert stats["bucket_graphs_captured"] == stats["bucket_graphs"] == 4  # buckets 8, 16, 32 and 64 met
    assert stats["bucket_replays"] == len(lengths)  # a capture replays its first input too
    for request, result in zip(requests, results):
        assert result == alone(model, request.inputs, request.max_new_tokens)
    eager = patched(cuda_graphs=False)
    assert [r.sequences for r in hp.BatchGenerator(eager, max_batch_rows=1).generate(requests)] == results
    assert eager._hf_paged_t5.bucket_graphs.captures == 0
    assert model._hf_paged_t5.pool.is_idle()


def test_what_the_bucket_graphs_leave_to_the_eager_forward(monkeypatch):
    """A chunk of more than GRAPH_CHUNK_INPUTS inputs (a job's first admission), an input past the
    longest bucket, an encoder with a hook and LongT5's local attention run the eager packed forward."""
    calls = []
    original = BatchRun._encode_eager
    monkeypatch.setattr(BatchRun, "_encode_eager", lambda self, chunk: calls.append(len(chunk)) or
                        original(self, chunk))
    model = patched()
    many = [hp.BatchRequest(ids, max_new_tokens=2) for ids in inputs([4, 6, 3, 5, 7, 9])]
    list(hp.BatchGenerator(model, max_batch_rows=6).generate(many))
    assert calls == [6] and model._hf_paged_t5.bucket_graphs.captures == 0
    calls.clear()
    long = inputs([BUCKETS[-1] + 1])[0]
    forced = hp.BatchRequest(long, max_new_tokens=3, min_new_tokens=3)
    assert [r.sequences for r in hp.BatchGenerator(model).generate([forced])] == [alone(model, long, 3)]
    assert calls == [1] and model._hf_paged_t5.bucket_graphs.captures == 0
    calls.clear()
    hooked = patched()
    runs = []  # (a hook on a module the engine calls: a block's would make it refuse the job)
    hooked.get_encoder().block[0].layer[0].SelfAttention.q.register_forward_hook(lambda *_: runs.append(1))
    list(hp.BatchGenerator(hooked, max_batch_rows=1, max_new_tokens=2).generate(inputs([5, 9])))
    assert calls == [1, 1] and hooked._hf_paged_t5.bucket_graphs.captures == 0  # a hook must run on every call
    assert len(runs) == 2
    calls.clear()
    config = LongT5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, local_radius=3,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    longt5 = hp.patch_model(LongT5ForConditionalGeneration(config).eval(), hp.PagedCacheConfig(block_size=4))
    list(hp.BatchGenerator(longt5, max_batch_rows=1, max_new_tokens=2).generate(inputs([5, 9])))
    assert calls == [1, 1] and longt5._hf_paged_t5.bucket_graphs.captures == 0


def test_warm_up_captures_every_bucket(monkeypatch):
    """A graph-capable engine's warm-up ends with one lone input per bucket, one at a time: every
    bucket's graph is captured before the first request; an input the engine cannot hold is
    skipped, and a request after it is generate()'s alone."""
    monkeypatch.setattr(online, "WARM_UP_WAVES", ((1, (6,)),))
    model = patched(num_blocks=12, grow=False)  # 48 tokens of K/V: a 64-token input does not fit
    with hp.OnlineEngine(model, max_new_tokens=4) as engine:
        submitted = []
        real_submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda item, **kw: submitted.append(item) or real_submit(item, **kw))
        assert engine.warm_up(force=True) > 0
        assert [len(r.inputs) for r in submitted] == [6, 8, 16, 32, 64]
        graphs = model._hf_paged_t5.bucket_graphs
        assert graphs.captures == 3 and graphs.num_graphs == 3
        ids = inputs([20])[0]
        assert real_submit(ids).result(timeout=60).sequences == alone(model, ids, 4)
        assert graphs.captures == 3  # bucket 32 replayed
