"""The device-resident decode loops (greedy_graph.graph_greedy_loop, beam_graph.resident_beam_loop)
against stock HF generate() on CPU, fp32 (tests/oracle.py): the same tokens, for cases
test_generate_parity.py leaves out — block sizes 1 / 2 / 256, decoder prompts ending at a block
boundary, max_length instead of max_new_tokens, early_stopping / length_penalty variants, a pad id
other than 0, one or two new tokens, repeated calls on one model and calls alternating between two
models, and the CUDA-graph warm-up's state restore (simulated on CPU). The random mix of all of
these is tests/test_soak.py's. At the end, the gaps this file found when it was written (fixed
since): a user's MaxLengthCriteria, several EosTokenCriteria, a user generation_config without the
model's defaults."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from conftest import ends_early, make_batch, make_model, resident_loop
from oracle import compare_with_stock, stock_copy
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import hf_paged_t5 as hp
from hf_paged_t5.decode import graphs, greedy_graph


def _generate(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**kw)


def check(model, loops, block_size=4, **kw):
    """compare_with_stock on the default backend with `block_size`: the patched call must run the
    resident loop. Returns HF's sequences."""
    before = len(loops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = compare_with_stock(model, hp.PagedCacheConfig(block_size=block_size), **kw)
    assert loops[before:] == [resident_loop(kw)], "the resident path did not run"
    return ref


def _has_eos(sequences, eos) -> bool:
    return bool((sequences[:, 1:, None] == torch.tensor(eos)).any())


@pytest.fixture(scope="module")
def model():
    return make_model("t5", seed=4)


@pytest.fixture(scope="module")
def batch():
    return make_batch([12, 3, 9, 7], padding_side="left")


# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 2, 256])
def test_greedy_block_sizes_with_rows_ending_early(model, batch, loops, block_size):
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    ref = check(model, loops, block_size, input_ids=ids, attention_mask=mask, max_new_tokens=17,
                eos_token_id=eos, min_new_tokens=2)
    assert _has_eos(ref, eos)


@pytest.mark.parametrize("dec_len,start", [(3, 0), (4, 0), (5, 0), (8, 0), (4, 1), (5, 1)])
def test_greedy_decoder_prompt_at_block_boundaries(model, batch, loops, dec_len, start):
    """block_size 4, user decoder prompts of 4 / 5 / 6 / 9 tokens (HF prepends the start token when
    the prompt lacks it) and 4 / 5 (prompt starting with it)."""
    ids, mask = batch
    dec = torch.randint(2, 300, (ids.shape[0], dec_len), generator=torch.Generator().manual_seed(dec_len))
    if start:
        dec[:, 0] = 0
    check(model, loops, 4, input_ids=ids, attention_mask=mask, decoder_input_ids=dec, max_new_tokens=9,
          min_new_tokens=9)


@pytest.mark.parametrize(
    "opts",
    [dict(max_length=11), dict(max_length=11, min_length=9, eos_token_id=[1, 7, 11]),
     dict(max_new_tokens=7, min_length=8, eos_token_id=[1, 7, 11])],
    ids=["max_length", "max-min-length", "min_length-counts-prompt"],
)
def test_greedy_max_length_and_min_length_with_decoder_prompt(model, batch, loops, opts):
    ids, mask = batch
    dec = torch.tensor([[0, 5, 9, 33]] * ids.shape[0])
    check(model, loops, 4, input_ids=ids, attention_mask=mask, decoder_input_ids=dec, **opts)


@pytest.mark.parametrize("new", [1, 2])
def test_one_or_two_new_tokens(model, batch, loops, new):
    ids, mask = batch
    check(model, loops, 2, input_ids=ids, attention_mask=mask, max_new_tokens=new)
    check(model, loops, 2, input_ids=ids, attention_mask=mask, max_new_tokens=new, num_beams=3,
          num_return_sequences=2)


def test_pad_id_other_than_zero(model, batch, loops):
    """Finished greedy rows are padded with pad_token_id, finished beams filled with it (HF's
    `pad or eos[0]`: with pad 0, beams are filled with eos[0] instead)."""
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    for pad in (3, 0):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, eos_token_id=eos, pad_token_id=pad)
        assert _has_eos(check(model, loops, 4, **kw), eos)
        assert _has_eos(check(model, loops, 4, num_beams=3, num_return_sequences=3, **kw), eos)


# ---- beam search -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts",
    [
        dict(early_stopping=False, length_penalty=-0.8),
        dict(early_stopping="never", length_penalty=0.0),
        dict(early_stopping="never", length_penalty=-1.5),
        dict(early_stopping=True, length_penalty=2),  # an int: HF divides by a Python int
        dict(early_stopping=False, length_penalty=1.7, num_return_sequences=4),
    ],
    ids=["false-neg", "never-zero", "never-neg", "true-int", "false-nrs-all"],
)
def test_beam_length_penalty_and_early_stopping(model, batch, loops, opts):
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    check(model, loops, 2, input_ids=ids, attention_mask=mask, max_new_tokens=15, num_beams=4,
          eos_token_id=eos, **opts)


@pytest.mark.parametrize("block_size", [1, 256])
def test_beam_block_sizes_with_decoder_prompt_and_min_length(model, batch, loops, block_size):
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    dec = torch.tensor([[0, 5, 9]] * ids.shape[0])
    check(model, loops, block_size, input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
          max_new_tokens=13, num_beams=3, eos_token_id=eos, min_new_tokens=4, min_length=8)


@pytest.mark.parametrize("dec_len", [3, 4])  # 4 and 5 tokens in the cache: a full block, one past it
def test_beam_decoder_prompt_at_block_boundary_with_max_length(model, batch, loops, dec_len):
    ids, mask = batch
    dec = torch.randint(2, 300, (ids.shape[0], dec_len), generator=torch.Generator().manual_seed(7))
    check(model, loops, 4, input_ids=ids, attention_mask=mask, decoder_input_ids=dec, max_length=15,
          num_beams=2, num_return_sequences=2, length_penalty=0.5)


# ---- repeated calls, two models ----------------------------------------------------------------
def test_repeated_calls_and_two_models_alternating(batch, loops):
    """One patched model called again and again (greedy, beams, other batch sizes, its pool's blocks
    reused), interleaved with a second patched model: every call gives HF's tokens."""
    ids, mask = batch
    a, b = make_model("t5", seed=4), make_model("t5v1_1", seed=2)
    stock = {id(a): stock_copy(a), id(b): stock_copy(b)}
    calls = [
        (a, dict(input_ids=ids, attention_mask=mask, max_new_tokens=9)),
        (b, dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=6, num_beams=3)),
        (a, dict(input_ids=ids, attention_mask=mask, max_new_tokens=11, num_beams=2,
                 eos_token_id=[1, 7, 11])),
        (b, dict(input_ids=ids, attention_mask=mask, max_new_tokens=10)),
        (a, dict(input_ids=ids[1:3], attention_mask=mask[1:3], max_new_tokens=5)),
        (a, dict(input_ids=ids, attention_mask=mask, max_new_tokens=9)),
        (b, dict(input_ids=ids[2:], attention_mask=mask[2:], max_new_tokens=8, num_beams=4,
                 num_return_sequences=2)),
    ]
    hp.patch_model(a, hp.PagedCacheConfig(block_size=2))
    hp.patch_model(b, hp.PagedCacheConfig(block_size=4))
    try:
        for m, kw in calls:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compare_with_stock(m, stock_model=stock[id(m)], **kw)  # m stays patched, its pool kept
    finally:
        hp.unpatch_model(a)
        hp.unpatch_model(b)
    assert loops == [resident_loop(kw) for _, kw in calls]


# ---- the CUDA-graph warm-up's restore, simulated on CPU -----------------------------------------
_WRITTEN_BEFORE_READ = {"beam_idx", "next_tokens", "unfinished"}  # BeamStep outputs each update rewrites


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (the pool is torch.empty: NaNs there would make torch.equal fail)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("beams", [1, 3])
def test_warmup_leaves_no_trace(model, batch, monkeypatch, beams):
    """On CUDA `capture_update` runs the update once (BeamStep: without the block copies), restores
    the tensors the step's `capture` lists as its state, and records the graph. Here the steps' own
    `capture` runs on CPU with that warm-up and restore and an eager "graph": every tensor of the step
    object, the decode step's static inputs and the KV pool must come back as they were (BeamStep's
    three outputs aside), and the tokens must be HF's."""
    seen, current = [], {}

    def resident_capture(self, state, what):
        current["loop"] = self
        state.capture(None)  # on CPU the real one returns before this

    def cpu_capture_update(update, state, side, warmup=None):
        step, loop = update.__self__, current["loop"]
        tensors = {k: v.clone() for k, v in vars(step).items() if isinstance(v, torch.Tensor)}
        static = [loop.static.packed.clone(), loop.static.input_ids.clone()]
        pool = [_bits(g).clone() for g in loop.cache.pool.groups]
        saved = [t.clone() for t in state]
        (warmup or update)()
        for t, s in zip(state, saved):
            t.copy_(s)
        for k, v in tensors.items():
            if k not in _WRITTEN_BEFORE_READ:
                assert torch.equal(getattr(step, k), v), f"the warm-up left {type(step).__name__}.{k} changed"
        assert torch.equal(loop.static.packed, static[0]) and torch.equal(loop.static.input_ids, static[1])
        assert all(torch.equal(_bits(g), s) for g, s in zip(loop.cache.pool.groups, pool)), "pool written"
        seen.append(type(step).__name__)
        return types.SimpleNamespace(replay=update)

    monkeypatch.setattr(graphs.ResidentLoop, "capture_update", resident_capture)
    monkeypatch.setattr(graphs, "capture_update", cpu_capture_update)
    monkeypatch.setattr(greedy_graph, "capture_update", cpu_capture_update)
    ids, mask = batch
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams, eos_token_id=[1, 7, 11],
              min_new_tokens=3)
    compare_with_stock(model, hp.PagedCacheConfig(block_size=2), **kw)
    assert seen == ["GreedyStep" if beams == 1 else "BeamStep"]


# ---- gaps the review found (fixed: user max-length criteria, several EOS criteria, user generation_config)
BLOCK_4 = hp.PagedCacheConfig(block_size=4)


@pytest.mark.parametrize("limit", [6, 20], ids=["shorter", "longer"])
@pytest.mark.parametrize("beams", [1, 2])
def test_user_max_length_criteria(model, batch, beams, limit):
    """A user's MaxLengthCriteria replaces HF's default one: a shorter limit stops earlier (the
    resident loops decline, the lean loops read the criteria's limit), a longer one runs past
    max_new_tokens (the cache is sized for it)."""
    ids, mask = batch
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams,
              stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length=limit)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the patched call raises what stock HF raises, its pool idle after it
        ref, _ = compare_with_stock(model, BLOCK_4, stock_may_raise=True, **kw)
    if beams > 1 and limit > 13:  # stock HF's beam search indexes past its max_length-sized buffers
        assert isinstance(ref, IndexError), ref
        return
    assert isinstance(ref, torch.Tensor), ref
    assert ref.shape[1] <= limit and (limit > 12 or ref.shape[1] == limit)


@pytest.mark.parametrize("beams", [1, 2])
def test_two_user_eos_criteria(model, batch, beams):
    ids, mask = batch
    a, b = ends_early(model, ids, mask)
    criteria = StoppingCriteriaList([EosTokenCriteria(a), EosTokenCriteria(b)])
    compare_with_stock(model, BLOCK_4, input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams,
                       stopping_criteria=criteria)


@pytest.mark.parametrize("model_default", [dict(max_new_tokens=30), dict(num_beams=3)],
                         ids=["max_new", "beams"])
def test_user_generation_config_takes_model_defaults(batch, model_default):
    model = make_model("t5", seed=4)
    for k, v in model_default.items():
        setattr(model.generation_config, k, v)
    ids, mask = batch
    # the user's config leaves unset what the model's sets
    user = GenerationConfig(max_new_tokens=7 if "num_beams" in model_default else None, min_new_tokens=2)
    compare_with_stock(model, BLOCK_4, input_ids=ids, attention_mask=mask, generation_config=user)


def _greedy_args(input_ids, eos, minimum, pad=0, max_length=9):
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

    config = GenerationConfig(max_length=max_length, pad_token_id=pad)
    config._pad_token_tensor = torch.tensor(pad)
    processors = LogitsProcessorList(
        [MinNewTokensLengthLogitsProcessor(input_ids.shape[1], minimum, torch.tensor(eos))])
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length), EosTokenCriteria(torch.tensor(eos))])
    return input_ids, config, processors, criteria


def _greedy_state(input_ids, eos, minimum, owned, pad=0, state=None, vocab=20, block_size=4):
    """A GreedyStep over CPU buffers for `input_ids` (fresh, or `state` refilled by `reset`)."""
    rows = input_ids.shape[0]
    args = _greedy_args(input_ids, eos, minimum, pad)
    if state is not None:
        assert state.signature(*args, owned, vocab, block_size) == state.kept_signature  # a real reuse
        state.reset(*args, owned)
        return state
    buffers = (torch.zeros(rows, 1, vocab), torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, dtype=torch.int32),
               torch.zeros(rows, dtype=torch.int32))
    state = greedy_graph.GreedyStep(*args, *buffers, owned.clone(), block_size)
    state.kept_signature = state.signature(*args, owned, vocab, block_size)
    return state


def _run_updates(state, seed, steps=6):
    """Feed the update `steps` seeded logits; return every tensor it writes, per step."""
    g = torch.Generator().manual_seed(seed)
    trace = []
    for _ in range(steps):
        state.logits.copy_(torch.randn(state.logits.shape, generator=g))
        state.logits[:, 0, [3, 5]] += 4.0  # the EOS ids win often: rows end, get padded
        state.run()
        trace.append([t.clone() for t in (state.sequences, state.cur_len, state.unfinished,
                                          state.done_at, state.step_ids, state.slot_mapping, state.self_seq_lens)])
    return trace


def test_kept_greedy_state_refilled_equals_a_fresh_one():
    """`GreedyStep.reset` (what a kept, captured update's next call runs instead of a new capture)
    refills everything the update reads: the same writes, step by step, as a fresh state for the
    second call — other prompt, EOS id, pad id, minimum (its table of EOS lengths), blocks — after
    a first call that ended rows and moved every counter."""
    owned_a = torch.tensor([[3, 7, 1], [4, 0, 2], [6, 5, 8]], dtype=torch.int32)
    owned_b = torch.tensor([[8, 2, 6], [1, 3, 0], [7, 4, 5]], dtype=torch.int32)
    first = _greedy_state(torch.tensor([[0, 2], [0, 6], [0, 1]]), [3], 2, owned_a)
    _run_updates(first, seed=1)
    assert not first.unfinished.all()  # the first call ended rows
    second = dict(input_ids=torch.tensor([[0, 9], [0, 4], [0, 1]]), eos=[5], minimum=3, owned=owned_b, pad=7)
    reused = _run_updates(_greedy_state(**second, state=first), seed=2)
    fresh = _run_updates(_greedy_state(**second), seed=2)
    assert not fresh[-1][2].all()  # the second call ended rows too
    for step, (a, b) in enumerate(zip(reused, fresh)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), step
    # what a captured update bakes in makes another signature: the number of EOS ids, the rows'
    # block count; the minimum and the prompt length it skips are in the refilled table
    sig = lambda *a: greedy_graph.GreedyStep.signature(*_greedy_args(*a), owned_b, 20, 4)  # noqa: E731
    ids = second["input_ids"]
    base = sig(ids, [5], 2)
    assert sig(torch.tensor([[7, 3], [2, 2], [9, 9]]), [3], 2) == base
    assert sig(ids, [5], 3) == base and sig(ids[:, :1], [5], 2) == base
    assert sig(ids, [5, 6], 2) != base
    assert greedy_graph.GreedyStep.signature(*_greedy_args(ids, [5], 2), owned_b[:, :2], 20, 4) != base


def test_kept_updates_are_bounded_and_tied_to_their_static_step():
    """`DecodeGraphs.keep_update` keeps at most MAX_KEPT_UPDATES (least recently used dropped), a
    kept update serves only the static step it was captured on, and `clear` drops them all."""
    kept = graphs.DecodeGraphs()
    statics = [object() for _ in range(graphs.MAX_KEPT_UPDATES + 1)]
    for i, static in enumerate(statics):
        kept.keep_update(static, ("k",), f"state{i}")
        if i == 0:
            assert kept.cached_update(statics[0], ("k",)) == "state0"
    assert kept.cached_update(statics[0], ("k",)) is None  # the oldest went first
    assert kept.cached_update(statics[-1], ("k",)) == f"state{len(statics) - 1}"
    assert kept.cached_update(statics[-1], ("other",)) is None and kept.cached_update(object(), ("k",)) is None
    assert kept.cached_update(statics[1], None) is None
    assert kept.captures == len(statics)
    kept.clear()
    assert kept.cached_update(statics[-1], ("k",)) is None
