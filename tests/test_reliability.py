"""Reliability of the paged cache and of patched generate() (torch backend, CPU).

- the cache's block tables against a dense reference under random steps / beam reorders / growth;
- no block leaks when generate() ends normally or by an exception from user code;
- pool exhaustion refused before any work, growth when allowed;
- free blocks full of NaN never reach the output;
- bad inputs and bad configuration refused with clear messages;
- concurrent generate() calls on one model;
- every fallback option gives stock HF's result, with a warning, without building a pool.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter

import pytest
import torch
from conftest import make_batch, make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import compare_with_stock, stock_copy
from torch import nn
from transformers.generation import (
    BaseStreamer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

import hf_paged_t5 as hp
from hf_paged_t5 import reference
from hf_paged_t5.hf.cache import KVPool, LayerSpec, PagedEncoderDecoderCache
from hf_paged_t5.hf.policy import FALLBACK_OPTIONS

CONFIG = hp.PagedCacheConfig(block_size=8, backend="torch")
NUM_HEADS, HEAD_DIM = 2, 8


# ---- 1. the cache against a dense reference --------------------------------------------------
@st.composite
def cache_programs(draw):
    """(source_lens, expand, ops): ops are ("step", num_new), ("reorder", choice per row), ("grow", extra)."""
    num_sources = draw(st.integers(1, 3))
    expand = draw(st.integers(1, 3))
    rows = num_sources * expand
    source_lens = draw(st.lists(st.integers(1, 10), min_size=num_sources, max_size=num_sources))
    op = st.one_of(
        st.tuples(st.just("step"), st.integers(1, 5)),
        st.tuples(st.just("reorder"), st.lists(st.integers(0, expand - 1), min_size=rows, max_size=rows)),
        st.tuples(st.just("grow"), st.integers(1, 8)),
    )
    return source_lens, expand, draw(st.lists(op, max_size=12))


def _random_kv(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # [num_tokens, num_heads, head_dim] each
    shape = (num_tokens, NUM_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _check_against_dense(cache, pool, dense_k, dense_v, cross_k, cross_v):
    """Every row's paged keys/values, gathered through its block table, equal the dense reference."""
    kc, vc = pool.key_caches[0], pool.value_caches[0]
    self_table, self_lens, cross_table, cross_lens = cache.host_tables()
    for row in range(cache.num_rows):
        assert int(self_lens[row]) == dense_k[row].shape[0]
        k, v = reference.gather_kv(kc, vc, self_table[row], int(self_lens[row]))
        assert torch.equal(k, dense_k[row]) and torch.equal(v, dense_v[row]), f"self K/V of row {row}"
        src = row // cache.expand
        assert int(cross_lens[row]) == cross_k[src].shape[0]
        k, v = reference.gather_kv(kc, vc, cross_table[row], int(cross_lens[row]))
        assert torch.equal(k, cross_k[src]) and torch.equal(v, cross_v[src]), f"cross K/V of row {row}"
    # Reference counts equal the number of tables holding each block; the scratch block is nobody's.
    held = Counter(cache.owned_blocks())
    assert pool.scratch_block not in held
    for block_id in range(pool.num_blocks):
        expected = 1 if block_id == pool.scratch_block else held[block_id]
        assert pool.manager.ref_count(block_id) == expected, f"block {block_id}"
    assert pool.manager.num_used == len(held) + pool.num_reserved


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=cache_programs(), seed=st.integers(0, 2**16))
def test_cache_matches_dense_reference(program, seed):
    source_lens, expand, ops = program
    gen = torch.Generator().manual_seed(seed)
    config = hp.PagedCacheConfig(block_size=4, num_blocks=64, backend="torch")
    spec = LayerSpec(torch.device("cpu"), torch.float32, num_heads=NUM_HEADS, head_dim=HEAD_DIM)
    pool = KVPool(config, [spec])
    max_self_tokens = sum(n for name, n in ops if name == "step")
    # grow=True: the reservation may grow the 64-block pool, as generate() does.
    needed = PagedEncoderDecoderCache.blocks_needed(source_lens, expand, max_self_tokens, pool.block_size)
    pool.reserve(needed)
    cache = PagedEncoderDecoderCache(pool, len(source_lens), expand, max_self_tokens)
    rows = cache.num_rows

    slots = cache.store_cross_plan(source_lens)
    k, v = _random_kv(sum(source_lens), gen)
    reference.store_kv(k, v, pool.key_caches[0], pool.value_caches[0], slots)
    cross_k, cross_v = list(k.split(source_lens)), list(v.split(source_lens))
    with pytest.raises(RuntimeError, match="already stored"):
        cache.store_cross_plan(source_lens)

    empty = torch.zeros(0, NUM_HEADS, HEAD_DIM)
    dense_k, dense_v = [empty] * rows, [empty] * rows
    _check_against_dense(cache, pool, dense_k, dense_v, cross_k, cross_v)
    for name, arg in ops:
        if name == "step":
            slots = cache.begin_step(arg)
            assert slots.shape == (rows * arg,)
            k, v = _random_kv(rows * arg, gen)
            reference.store_kv(k, v, pool.key_caches[0], pool.value_caches[0], slots)
            dense_k = [torch.cat([dense_k[r], k[r * arg:(r + 1) * arg]]) for r in range(rows)]
            dense_v = [torch.cat([dense_v[r], v[r * arg:(r + 1) * arg]]) for r in range(rows)]
        elif name == "reorder":
            beam_idx = [(r // expand) * expand + choice for r, choice in enumerate(arg)]
            cache.reorder_cache(torch.tensor(beam_idx))
            dense_k = [dense_k[s] for s in beam_idx]
            dense_v = [dense_v[s] for s in beam_idx]
        else:  # the pool's tensors are re-allocated mid-call: contents must survive
            before = pool.num_blocks
            pool.reserve(pool.manager.num_free + arg)
            assert pool.num_blocks > before
        _check_against_dense(cache, pool, dense_k, dense_v, cross_k, cross_v)

    cache.release()
    assert pool.is_idle()
    cache.release()  # idempotent
    assert pool.is_idle()
    with pytest.raises(RuntimeError, match="released"):
        cache.begin_step(1)


# ---- 2. no leaks when generate() is interrupted --------------------------------------------------
class RaiseOnCall(LogitsProcessor):
    def __init__(self, on_call: int) -> None:
        self.calls, self.on_call = 0, on_call

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.on_call:
            raise RuntimeError("logits processor failed")
        return scores


class RaisingCriteria(StoppingCriteria):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("stopping criteria failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class InterruptingStreamer(BaseStreamer):
    """Ctrl-C while the 3rd token is streamed (the 1st put() is the decoder start token)."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, value):
        self.puts += 1
        if self.puts == 3:
            raise KeyboardInterrupt

    def end(self):
        pass


@pytest.fixture(scope="module")
def patched_with_refs():
    """A patched model, its inputs, and an unpatched copy of it (stock HF)."""
    model = make_model("t5", seed=21)
    ids, mask = make_batch([9, 14, 5])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    stock = stock_copy(model)
    hp.patch_model(model, CONFIG)
    return model, kw, stock


def _assert_still_serves_hf(model, kw, stock):
    pool = model._hf_paged_t5.pool
    assert pool is not None and pool.is_idle(), "generate() leaked KV blocks"
    compare_with_stock(model, stock_model=stock, **kw)  # each: the pool idle afterwards
    compare_with_stock(model, stock_model=stock, **kw, num_beams=3)


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_normal_generate_leaves_pool_idle(patched_with_refs, mode):
    model, kw, stock = patched_with_refs
    compare_with_stock(model, stock_model=stock, **kw, num_beams=3 if mode == "beam" else 1)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_logits_processor_exception_releases_blocks(patched_with_refs, num_beams):
    model, kw, stock = patched_with_refs
    processor = RaiseOnCall(on_call=3)
    with pytest.raises(RuntimeError, match="logits processor failed"):
        model.generate(**kw, num_beams=num_beams, logits_processor=LogitsProcessorList([processor]))
    assert processor.calls == 3
    _assert_still_serves_hf(model, kw, stock)


def test_stopping_criteria_exception_releases_blocks(patched_with_refs):
    model, kw, stock = patched_with_refs
    with pytest.raises(ValueError, match="stopping criteria failed"):
        model.generate(**kw, stopping_criteria=StoppingCriteriaList([RaisingCriteria()]))
    _assert_still_serves_hf(model, kw, stock)


def test_keyboard_interrupt_in_streamer_releases_blocks(patched_with_refs):
    model, kw, stock = patched_with_refs
    # streamers take batch 1
    one = dict(kw, input_ids=kw["input_ids"][:1], attention_mask=kw["attention_mask"][:1])
    streamer = InterruptingStreamer()
    with pytest.raises(KeyboardInterrupt):
        model.generate(**one, streamer=streamer)
    assert streamer.puts == 3
    _assert_still_serves_hf(model, kw, stock)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_out_of_memory_in_the_cross_store_releases_blocks(patched_with_refs, monkeypatch, num_beams):
    """Out of device memory while the cross K/V is stored (a batch too large for the card, as a
    static-batch sweep meets): the error reaches the caller, the call's blocks go back to the pool,
    and the next call, at any size, gives stock's tokens."""
    from hf_paged_t5.model import stacks

    model, kw, stock = patched_with_refs

    def store_cross_packed(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(stacks, "store_cross_packed", store_cross_packed)
        with pytest.raises(torch.OutOfMemoryError):
            model.generate(**kw, num_beams=num_beams)
    _assert_still_serves_hf(model, kw, stock)


# ---- 3. pool exhaustion and growth ------------------------------------------------------------
def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_exhausted_pool_refuses_before_any_work():
    model = make_model("t5", seed=22)
    ids, mask = make_batch([20, 17, 25, 9])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, num_beams=2)
    stock = stock_copy(model)
    needed = PagedEncoderDecoderCache.blocks_needed([20, 17, 25, 9], 2, 31, 8)
    assert needed > 8

    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, num_blocks=8, grow=False, backend="torch"))
    encoder_calls, head_calls = _count_calls(model.encoder), _count_calls(model.lm_head)
    with pytest.raises(hp.PoolExhaustedError) as info:
        model.generate(**kw)
    msg = str(info.value)
    assert f"needs {needed} KV blocks" in msg and "only 7 of 8 are free" in msg
    assert "num_blocks=" in msg and "grow=True" in msg
    assert encoder_calls == [0] and head_calls == [0], "the refused call ran the model"
    pool = model._hf_paged_t5.pool
    assert pool.is_idle() and pool.num_blocks == 8

    # A capped pool refuses too, naming the cap.
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, num_blocks=8, max_num_blocks=10, backend="torch"))
    with pytest.raises(hp.PoolExhaustedError, match=r"limit 10"):
        model.generate(**kw)
    assert model._hf_paged_t5.pool.is_idle()

    # The same request with growth allowed (the default) succeeds and grows the pool.
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, num_blocks=8, backend="torch"))
    compare_with_stock(model, stock_model=stock, **kw)
    pool = model._hf_paged_t5.pool
    assert pool.num_blocks >= needed + pool.num_reserved
    assert encoder_calls[0] >= 1


# ---- 4. poisoned free blocks ----------------------------------------------------------------
@pytest.mark.parametrize("num_beams", [1, 3])
def test_nan_in_free_blocks_never_reaches_output(num_beams):
    """Free blocks (and the scratch block, where unused table entries point) are filled with NaN;
    a read of any slot a row does not own would turn scores NaN or change them. The scores must be
    bit-identical to the same call on a clean pool, which gives stock HF's answer."""
    model = make_model("t5v1_1", seed=23)
    ids, mask = make_batch([11, 21, 6], padding_side="left")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, num_beams=num_beams, output_scores=True,
              return_dict_in_generate=True)
    stock = stock_copy(model)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, num_blocks=128, grow=False, backend="torch"))
    _, clean = compare_with_stock(model, stock_model=stock, **kw)  # builds the pool
    pool = model._hf_paged_t5.pool
    poisoned = [b for b in range(pool.num_blocks) if pool.manager.ref_count(b) == 0] + [pool.scratch_block]
    assert len(poisoned) == pool.num_blocks
    for k, v in zip(pool.key_caches, pool.value_caches):
        k[poisoned] = float("nan")
        v[poisoned] = float("nan")

    out = model.generate(**kw)
    assert torch.equal(out.sequences, clean.sequences)
    assert len(out.scores) == len(clean.scores)
    for a, b in zip(clean.scores, out.scores):
        assert not torch.isnan(b).any()
        assert torch.equal(a, b)
    if num_beams > 1:
        assert torch.equal(out.sequences_scores, clean.sequences_scores)
    assert pool.is_idle()


# ---- 5. bad input and configuration --------------------------------------------------------------
@pytest.fixture
def patched_t5():
    return hp.patch_model(make_model("t5", seed=24), CONFIG)


def test_empty_batch_refused(patched_t5):
    with pytest.raises(ValueError, match="empty batch"):
        patched_t5.generate(input_ids=torch.zeros(0, 5, dtype=torch.long), max_new_tokens=3)


def test_zero_length_input_refused(patched_t5):
    with pytest.raises(ValueError, match="zero-length"):
        patched_t5.generate(input_ids=torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3)


def test_all_padding_row_runs_stock_before_any_allocation(patched_t5):
    """A row with no real token is stock HF's case (tests/test_contract_generate.py checks the
    result); the call takes nothing from the pool."""
    ids, mask = make_batch([4, 6, 3])
    mask[1] = 0
    out = patched_t5.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    assert out.shape[0] == 3
    assert patched_t5._hf_paged_t5.pool is None, "decided before the pool was built"


def test_attention_mask_on_other_device_refused(patched_t5):
    if not torch.cuda.is_available():
        pytest.skip("needs a second device (CUDA)")
    ids, mask = make_batch([4, 6])
    with pytest.raises(ValueError, match="attention_mask is on"):
        patched_t5.generate(input_ids=ids, attention_mask=mask.cuda(), max_new_tokens=3)


@pytest.mark.parametrize("kind", ["bart", "module"])
def test_unsupported_model_refused(kind):
    if kind == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        model = BartForConditionalGeneration(BartConfig(
            vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        ))
    else:
        model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="supports T5ForConditionalGeneration.*got " + type(model).__name__):
        hp.patch_model(model, CONFIG)
    assert not hp.is_patched(model)


def test_config_must_be_paged_cache_config():
    model = make_model("t5", seed=25)
    with pytest.raises(TypeError, match="config must be a PagedCacheConfig, got dict"):
        hp.patch_model(model, {"block_size": 8})
    assert not hp.is_patched(model)


@pytest.mark.parametrize("block_size", [3, 0, 512])
def test_bad_block_size_refused(block_size):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        hp.PagedCacheConfig(block_size=block_size)


def test_triton_backend_on_cpu_refused_at_generate(monkeypatch):
    """backend='triton' is accepted by the config (the device is unknown then) and refused by the
    first generate() on CPU, from the encoder's first layer, with the fix in the message."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = hp.patch_model(make_model("t5", seed=26), hp.PagedCacheConfig(block_size=8, backend="triton"))
    ids, mask = make_batch([5, 7])
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, but a layer lives on cpu.*"
                                         r"backend='auto'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    assert model._hf_paged_t5.pool.is_idle()


# ---- 6. concurrency --------------------------------------------------------------------------
def test_concurrent_generate_calls_match_hf():
    """Two threads call generate() on one patched model at once. The paged path holds the model's
    lock (`PagedRuntime.lock`) for the whole call, so the calls run one after the other on the
    shared pool; each gets exactly stock HF's result and no block is leaked."""
    model = make_model("t5", seed=27)
    ids_a, mask_a = make_batch([12, 4], seed=2)
    ids_b, mask_b = make_batch([7, 19, 10], seed=3, padding_side="left")
    kw_a = dict(input_ids=ids_a, attention_mask=mask_a, max_new_tokens=20, min_new_tokens=20)
    kw_b = dict(input_ids=ids_b, attention_mask=mask_b, max_new_tokens=16, num_beams=3)
    refs = [model.generate(**kw_a), model.generate(**kw_b)]
    hp.patch_model(model, CONFIG)
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def run(i, kw):
        barrier.wait()
        try:
            for _ in range(3):
                out = model.generate(**kw)
                assert results[i] is None or torch.equal(results[i], out)
                results[i] = out
        except BaseException as exc:  # reported by the main thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, kw)) for i, kw in enumerate([kw_a, kw_b])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for ref, out in zip(refs, results):
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, ref)
    assert model._hf_paged_t5.pool.is_idle()


# ---- 7. fallbacks ----------------------------------------------------------------------------
# option -> (generate kwargs, batch lengths). Options whose stock-HF path is gone from this
# transformers (moved to Hub `custom_generate` repos) or needs CUDA are still checked: the patched
# model must raise exactly what stock HF raises, without touching the pool.
FALLBACK_CASES = {
    "output_attentions": (dict(output_attentions=True, return_dict_in_generate=True), [8, 5]),
    "output_hidden_states": (dict(output_hidden_states=True, return_dict_in_generate=True), [8, 5]),
    "cache_implementation": (dict(cache_implementation="static"), [8, 5]),
    # 1 is a real request for these two (HF tests `is not None`), not "off"
    "prompt_lookup_num_tokens": (dict(prompt_lookup_num_tokens=1), [8]),
    "assistant_early_exit": (dict(assistant_early_exit=1), [8]),
    "num_assistant_tokens": (dict(num_assistant_tokens=5), [8, 5]),
    "penalty_alpha": (dict(penalty_alpha=0.6, top_k=4), [8, 5]),
    "dola_layers": (dict(dola_layers="low"), [8, 5]),
    "num_beam_groups": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), [8, 5]),
    "constraints": (None, None),  # a Constraint object: the same Hub-only path as force_words_ids
    "force_words_ids": (dict(num_beams=3, force_words_ids=[[5]]), [8, 5]),
    "custom_generate": (None, None),  # loads code from the Hub
}


def _check_fallback(model, kw, reason, caplog):
    """Stock HF's result (every output bit for bit) or stock HF's exception, no pool, one warning."""
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        compare_with_stock(model, expect_paged=False, stock_may_raise=True, **kw)
    assert any(reason in r.getMessage() for r in caplog.records if r.name.startswith("hf_paged_t5")), (
        f"no warning naming {reason!r}"
    )


@pytest.mark.parametrize("option", sorted(FALLBACK_OPTIONS))
def test_fallback_option_gives_hf_result(option, caplog):
    assert set(FALLBACK_CASES) == set(FALLBACK_OPTIONS), "a new fallback option needs a case here"
    extra, lengths = FALLBACK_CASES[option]
    if extra is None:
        pytest.skip(f"{option} cannot be exercised offline on CPU")
    model = make_model("t5", seed=28)
    ids, mask = make_batch(lengths)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, **extra)
    _check_fallback(model, kw, FALLBACK_OPTIONS[option], caplog)


def test_use_cache_false_falls_back(caplog):
    model = make_model("t5", seed=29)
    ids, mask = make_batch([8, 5])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, use_cache=False)
    _check_fallback(model, kw, "use_cache=False", caplog)


def test_unknown_generation_option_falls_back(caplog):
    """An option the paged path has never seen (as a newer transformers would add) is not guessed at."""
    model = make_model("t5", seed=30)
    ids, mask = make_batch([8, 5])
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.max_new_tokens = 6
    gen_config.my_new_option = 3
    kw = dict(input_ids=ids, attention_mask=mask, generation_config=gen_config)
    _check_fallback(model, kw, "generation option 'my_new_option'=3 is not known", caplog)


def test_generate_nested_in_a_streamer_does_not_deadlock(caplog):
    """A streamer that calls generate() on the same model while the outer paged call holds the
    model's lock: the nested call runs on stock HF (it would otherwise wait on the lock forever,
    or take blocks promised to the outer call). Run in a thread so a deadlock fails, not hangs."""
    model = make_model("t5", seed=31)
    ids, mask = make_batch([8], seed=4)
    inner_kw = dict(input_ids=make_batch([5], seed=5)[0], max_new_tokens=4)
    outer_kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    refs = [model.generate(**outer_kw), model.generate(**inner_kw)]
    hp.patch_model(model, CONFIG)
    nested: list = []

    class NestingStreamer(BaseStreamer):
        def __init__(self) -> None:
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                nested.append(model.generate(**inner_kw))

        def end(self):
            pass

    result: list = []

    def run():
        try:
            result.append(model.generate(**outer_kw, streamer=NestingStreamer()))
        except BaseException as exc:  # reported by the main thread
            result.append(exc)

    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=60)
    assert not thread.is_alive(), "generate() nested in a streamer deadlocked"
    assert isinstance(result[0], torch.Tensor), result[0]
    assert torch.equal(result[0], refs[0]) and torch.equal(nested[0], refs[1])
    assert any("nested" in r.getMessage() for r in caplog.records)
    assert model._hf_paged_t5.pool.is_idle() and model._hf_paged_t5.runner.owner is None
