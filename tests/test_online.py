"""OnlineEngine: requests submitted at any time, from several threads, join the running decode loop;
each result is patched generate()'s on that input alone; cancelled requests give their blocks back
(CPU, fp32)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
from conftest import make_model

import hf_paged_t5 as hp
from hf_paged_t5.batch.run import BatchRun

LENGTHS = [5, 23, 3, 17, 9, 30, 2, 12]
MAX_NEW = [7, 19, 3, 12, 25, 4, 16, 9]


pytestmark = pytest.mark.usefixtures("one_thread_per_module")  # conftest: tiny matmuls, one thread


def inputs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in lengths]


def patched(seed=0, **config):
    return hp.patch_model(make_model("t5", seed=seed), hp.PagedCacheConfig(**{"block_size": 4, **config}))


def alone(model, ids, max_new, **kwargs):
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new, **kwargs)
    return out.tolist()


def wait_until(condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


@pytest.fixture
def steps(monkeypatch):
    """Counts the engine's decode steps."""
    state = {"steps": 0}
    original = BatchRun._decode_step

    def spy(self):
        state["steps"] += 1
        return original(self)

    monkeypatch.setattr(BatchRun, "_decode_step", spy)
    return state


@pytest.mark.parametrize("num_beams", [1, 3])
def test_requests_from_several_threads_give_generate_alone_results(num_beams):
    model = patched()
    items = inputs()
    want = [alone(model, ids, m, num_beams=num_beams) for ids, m in zip(items, MAX_NEW)]
    with hp.OnlineEngine(model, max_batch_rows=4 * num_beams, num_beams=num_beams) as engine:
        futures = [None] * len(items)

        def client(which):
            for i in which:
                futures[i] = engine.submit(hp.BatchRequest(items[i], max_new_tokens=MAX_NEW[i],
                                                           min_new_tokens=MAX_NEW[i]))
                time.sleep(0.003 * (i % 3))  # arrivals spread over the running steps

        threads = [threading.Thread(target=client, args=(range(k, len(items), 3),)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [f.result(timeout=120) for f in futures]
    assert len({r.index for r in results}) == len(items)  # one index per submission
    for result, expected, ids in zip(results, want, items):
        assert result.sequences == expected and result.num_input_tokens == len(ids)
    assert model._hf_paged_t5.pool.is_idle()


def test_a_late_request_joins_the_running_loop(steps):
    """B, submitted while A decodes 60 tokens, finishes long before A: it did not wait for A's batch."""
    model = patched()
    a_ids, b_ids = inputs([9, 6], seed=3)
    with hp.OnlineEngine(model) as engine:
        a = engine.submit(hp.BatchRequest(a_ids, max_new_tokens=60, min_new_tokens=60))
        wait_until(lambda: steps["steps"] >= 5)
        b = engine.submit(hp.BatchRequest(b_ids, max_new_tokens=4, min_new_tokens=4))
        at_b = steps["steps"]
        b_result = b.result(timeout=60)
        b_done = steps["steps"]
        assert not a.done(), "B waited for A"
        assert b_done - at_b <= 4 + 3  # its 4 tokens, a step to join, one late read-back, slack of one
        a_result = a.result(timeout=120)
    assert b_result.sequences == alone(model, b_ids, 4)
    assert a_result.sequences == alone(model, a_ids, 60)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cancel_while_running_and_while_queued(steps, num_beams):
    model = patched()
    a_ids, b_ids, c_ids = inputs([9, 6, 11], seed=4)
    with hp.OnlineEngine(model, max_batch_rows=num_beams, num_beams=num_beams) as engine:  # one input at a time
        a = engine.submit(hp.BatchRequest(a_ids, max_new_tokens=300, min_new_tokens=300))
        b = engine.submit(hp.BatchRequest(b_ids, max_new_tokens=5, min_new_tokens=5))  # waits: no rows free
        wait_until(lambda: steps["steps"] >= 2)
        assert engine.stats()["running"] == 1
        assert a.cancel() and b.cancel()  # a running, b queued behind it
        with pytest.raises(concurrent.futures.CancelledError):
            a.result(timeout=1)
        wait_until(lambda: engine.stats() == dict(queued=0, running=0, rows=0))
        assert model._hf_paged_t5.pool.is_idle(), "the cancelled request's blocks went back"
        stopped_at = steps["steps"]
        c = engine.submit(hp.BatchRequest(c_ids, max_new_tokens=6, min_new_tokens=6))
        assert c.result(timeout=60).sequences == alone(model, c_ids, 6, num_beams=num_beams)
    assert stopped_at < 300, "the cancelled request stopped early"


def test_bad_input_is_refused_in_the_callers_thread_and_the_engine_goes_on():
    model = patched()
    with hp.OnlineEngine(model, max_new_tokens=3) as engine:
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            engine.submit(hp.BatchRequest([5, 6, 7], max_new_tokens=0))
        with pytest.raises(ValueError, match="a text, but BatchGenerator was given no tokenizer"):
            engine.submit("a text, but no tokenizer")
        with pytest.raises(ValueError, match="token id 100000 is outside the model's vocabulary"):
            engine.submit([5, 100000])
        ids = inputs([7])[0]
        assert engine.submit(ids).result(timeout=60).sequences == alone(model, ids, 3)


def test_an_input_too_large_for_the_pool_fails_alone():
    model = patched(num_blocks=6, grow=False)  # 24 tokens of K/V
    with hp.OnlineEngine(model, max_new_tokens=3) as engine:
        big = engine.submit(list(range(2, 60)))
        small_ids = inputs([4])[0]
        small = engine.submit(small_ids)
        with pytest.raises(hp.PoolExhaustedError, match="needs .* KV blocks by itself"):
            big.result(timeout=60)
        assert small.result(timeout=60).sequences == alone(model, small_ids, 3)


def test_close_drains_then_refuses():
    model = patched()
    engine = hp.OnlineEngine(model, max_new_tokens=8)
    futures = [engine.submit(ids) for ids in inputs()[:3]]
    engine.close()
    assert all(f.done() and not f.cancelled() for f in futures)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.submit([5, 6])
    assert model._hf_paged_t5.pool.is_idle()


def test_close_with_cancel_and_an_error_reaches_every_caller(monkeypatch):
    model = patched()
    engine = hp.OnlineEngine(model, max_new_tokens=40)
    futures = [engine.submit(ids) for ids in inputs()[:3]]
    engine.close(cancel=True)
    assert all(f.cancelled() or f.done() for f in futures)
    assert model._hf_paged_t5.pool.is_idle()

    def broken(self):
        raise RuntimeError("a decode step failed")

    monkeypatch.setattr(BatchRun, "_decode_step", broken)
    engine = hp.OnlineEngine(model, max_new_tokens=4)
    future = engine.submit([5, 6, 7])
    with pytest.raises(RuntimeError, match="a decode step failed"):
        future.result(timeout=60)
    with pytest.raises(RuntimeError, match="the engine stopped after an error"):
        engine.submit([5, 6])
    engine.close()
    assert model._hf_paged_t5.pool.is_idle()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_on_tokens_streams_the_first_sequence(steps, num_beams):
    """Greedy: the tokens arrive over many steps, before the result; beams: once, at the end. Either
    way, concatenated, they are the result's first sequence after the start token."""
    model = patched()
    ids = inputs([10], seed=6)[0]
    batches = []
    with hp.OnlineEngine(model, num_beams=num_beams) as engine:
        future = engine.submit(hp.BatchRequest(ids, max_new_tokens=20, min_new_tokens=20),
                               on_tokens=lambda tokens: batches.append((steps["steps"], list(tokens))))
        result = future.result(timeout=60)
    streamed = [t for _, batch in batches for t in batch]
    assert streamed == result.token_ids[1:] and len(streamed) == 20
    if num_beams == 1:
        assert len(batches) >= 10 and batches[0][0] < batches[-1][0], "tokens came step by step"
    else:
        assert len(batches) == 1


def test_close_with_a_timeout_cancels_what_is_left():
    model = patched()
    engine = hp.OnlineEngine(model)
    long = engine.submit(hp.BatchRequest(inputs([8])[0], max_new_tokens=5000, min_new_tokens=5000))
    wait_until(lambda: engine.stats()["running"] == 1)
    engine.close(timeout=0.2)
    assert long.cancelled() and not engine._thread.is_alive()
    assert model._hf_paged_t5.pool.is_idle()


def test_warm_up_runs_its_waves_and_leaves_nothing_behind(monkeypatch):
    """On the CPU warm_up does nothing unless forced; forced, every wave's requests run (1, 2, 4
    and the large wave at once, short and long inputs, 3 new tokens each), every block is given
    back, and a request after it is generate()'s on that input alone."""
    from hf_paged_t5.batch import online

    model = patched()
    with hp.OnlineEngine(model, max_new_tokens=5, max_batch_rows=8) as engine:
        submitted = []
        real_submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda item, **kw: submitted.append(item) or real_submit(item, **kw))
        assert engine.warm_up() == 0.0 and submitted == []  # a CPU model: skipped
        monkeypatch.setattr(online, "WARM_UP_WAVES", ((1, (6,)), (2, (6,)), ("many", (6, 40))))
        assert engine.warm_up(force=True) > 0
        assert [len(r.inputs) for r in submitted] == [6, 6, 6, 6, 40, 6, 40, 6, 40, 6, 40]  # many = 8 rows
        assert all(r.max_new_tokens == r.min_new_tokens == online.WARM_UP_NEW_TOKENS for r in submitted)
        wait_until(lambda: engine.stats() == dict(queued=0, running=0, rows=0))
        assert engine.kv_blocks()["used"] == 0
        ids = inputs([11])[0]
        assert real_submit(ids).result(timeout=60).sequences == alone(model, ids, 5)


def test_kernel_binaries_counts_each_device_cache(monkeypatch):
    """The count the server exports: the entries of every kernel's per-device binary cache (Triton
    keeps (binaries, ...) per device), 0 for a kernel that has none."""
    pytest.importorskip("triton")
    from hf_paged_t5.kernels import ahead

    kernels = [type("K", (), {"device_caches": {0: ({"a": 1, "b": 2}, None), 1: ({"c": 3}, None)}})(),
               type("K", (), {"device_caches": {}})(), object()]
    monkeypatch.setattr(ahead, "_kernels", lambda: kernels)
    assert ahead.binaries() == 3
    with hp.OnlineEngine(patched(), max_new_tokens=2) as engine:
        assert engine.kernel_binaries() == 3  # the kernels package is loaded in this process


def test_warm_up_skips_inputs_the_engine_cannot_hold(caplog):
    """A warm-up input too large for the pool (or the token budget) is skipped with one log line,
    not an error that would stop a server from starting; the engine serves on."""
    from hf_paged_t5.batch import online

    model = patched(num_blocks=12, grow=False)  # 48 tokens of K/V
    with hp.OnlineEngine(model, max_new_tokens=3, max_batch_rows=4) as engine:
        with caplog.at_level("INFO", logger=online.__name__):
            assert engine.warm_up(force=True) > 0
        assert "inputs of [1100] tokens skipped" in caplog.text
        wait_until(lambda: engine.stats() == dict(queued=0, running=0, rows=0))
        ids = inputs([9])[0]
        forced = hp.BatchRequest(ids, max_new_tokens=3, min_new_tokens=3)
        assert engine.submit(forced).result(timeout=60).sequences == alone(model, ids, 3)


def test_a_request_held_back_for_room_runs_when_the_others_finish():
    """An input that had to wait for room (token budget) while others ran is admitted once they
    finish, with nothing else submitted after it (the engine must not sleep while it waits)."""
    model = patched()
    a_ids, b_ids = inputs([20, 20])
    with hp.OnlineEngine(model, max_new_tokens=3, max_batch_tokens=30) as engine:  # one 24-token input at a time
        a, b = engine.submit(a_ids), engine.submit(b_ids)
        assert a.result(timeout=60).sequences == alone(model, a_ids, 3)
        assert b.result(timeout=60).sequences == alone(model, b_ids, 3)
        wait_until(lambda: engine.stats() == dict(queued=0, running=0, rows=0))
