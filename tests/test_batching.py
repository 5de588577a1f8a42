"""BatchGenerator (continuous batching) against patched generate() on each input alone (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_model
from oracle import stock_copy
from transformers import GenerationConfig

import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.batch.cache import BatchCache, blocks_for
from hf_paged_t5.batch.rows import DecodeRows
from hf_paged_t5.batch.run import BatchRun

# Lengths crossing the 4-token block boundaries; limits that make rows finish at different steps.
LENGTHS = [5, 23, 3, 17, 9, 30, 2, 12, 8, 4]
MAX_NEW = [7, 19, 3, 12, 25, 4, 16, 9, 1, 11]


pytestmark = pytest.mark.usefixtures("one_thread_per_module")  # conftest: tiny matmuls, one thread


def make_inputs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in lengths]


def patched(family="t5", seed=0, dtype=torch.float32, **config):
    model = make_model(family, seed=seed, dtype=dtype)
    config = {"block_size": 4, "backend": "torch", **config}
    return hp.patch_model(model, hp.PagedCacheConfig(**config))


def alone(model, ids, **kwargs):
    """Patched generate() on one input: (rows as lists, sequences_scores or None)."""
    out = model.generate(input_ids=torch.tensor([ids]), return_dict_in_generate=True, output_scores=True, **kwargs)
    scores = getattr(out, "sequences_scores", None)
    return out.sequences.tolist(), None if scores is None else scores.tolist()


def _frequent_token(model, inputs, new=12):
    """A token greedy decoding emits early for some input (made an EOS, rows then end early)."""
    firsts = [alone(model, ids, max_new_tokens=new)[0][0] for ids in inputs]
    counts = torch.bincount(torch.tensor([t for seq in firsts for t in seq[2:6]]))
    return int(counts.argmax())


@pytest.fixture
def admissions(monkeypatch):
    """Records, per admission round, (requests admitted, requests running afterwards, admitted input lengths)."""
    log = []
    original = BatchRun._admit

    def spy(self, pool):
        admitted = original(self, pool)
        log.append((len(admitted), len(self.running), [len(r.ids) for r in admitted]))
        return admitted

    monkeypatch.setattr(BatchRun, "_admit", spy)
    return log


# ---- token-exact parity ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_greedy_matches_generate_alone_with_small_pool(family, admissions):
    # 40 blocks of 4 tokens: the largest input needs 14 (30 + 4 new tokens), three typical ones ~30,
    # so admission must wait for finished requests to free their blocks.
    model = patched(family, num_blocks=40, grow=False)
    inputs = make_inputs()
    eos = [1, _frequent_token(model, inputs)]  # random weights rarely pick token 1: add one they do pick
    requests = [hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, MAX_NEW)]
    gen = hp.BatchGenerator(model, max_batch_rows=3, max_batch_tokens=1000, eos_token_id=eos)
    results = list(gen.generate(requests))
    pool = model._hf_paged_t5.pool
    assert pool.is_idle() and pool.num_blocks == 40
    assert [r.index for r in results] == list(range(len(inputs)))
    for ids, m, result in zip(inputs, MAX_NEW, results):
        assert result.sequences == alone(model, ids, max_new_tokens=m, eos_token_id=eos)[0]
        assert result.num_input_tokens == len(ids)
    assert sum(n for n, _, _ in admissions) == len(inputs)
    assert max(running for _, running, _ in admissions) <= 3
    assert sum(1 for n, _, _ in admissions if n) >= 4, "expected admissions mid-run"
    assert any(r.num_new_tokens < m and r.token_ids[-1] in eos for r, m in zip(results, MAX_NEW))


def test_pool_not_rows_limits_admission(admissions):
    model = patched(num_blocks=24, grow=False)
    inputs = make_inputs([14, 13, 15, 12, 14, 13])
    gen = hp.BatchGenerator(model, max_batch_rows=6, max_new_tokens=10)
    results = list(gen.generate(inputs))
    # each input needs 4 + 3 blocks: three fit in the 23 usable blocks, never six
    assert max(running for _, running, _ in admissions) == 3
    for ids, result in zip(inputs, results):
        assert result.sequences == alone(model, ids, max_new_tokens=10)[0]
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
            hp.BatchGenerator(model, gpu_memory_utilization=bad)
    assert model._hf_paged_t5.pool.is_idle()


def test_default_kv_budget_from_gpu_memory(monkeypatch):
    """Off CUDA the default budget is DEFAULT_BATCH_TOKENS; on CUDA devices (stood in for here) it is
    what fits in the utilization share of each device's memory after what is in use, the model's
    pool counting as room, the fewest over the devices; no room at all is an error with the numbers."""
    from hf_paged_t5.batch import generator as gen_mod
    from hf_paged_t5.kv.pool import LayerSpec

    model = make_model("t5")
    hp.patch_model(model, hp.PagedCacheConfig(backend="torch"))
    assert hp.BatchGenerator(model).max_batch_tokens == gen_mod.DEFAULT_BATCH_TOKENS
    assert hp.BatchGenerator(model, max_batch_tokens=300).max_batch_tokens == 300
    gib = 2**30
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    specs = [LayerSpec(cuda0, torch.bfloat16, 16, 64)] * 2 + [LayerSpec(cuda1, torch.bfloat16, 16, 64)]
    memory = {cuda0: (50 * gib, 100 * gib), cuda1: (30 * gib, 100 * gib)}
    # per token: cuda:0 holds two layers (2 x 2 x 16 x 64 x 2 B = 8 KiB), cuda:1 one (4 KiB)
    tokens = gen_mod.kv_token_budget(specs, 0.9, memory.__getitem__)
    assert tokens == min(int((50 - 10) * gib // 8192), int((30 - 10) * gib // 4096))  # cuda:0's 40 GiB / 8 KiB
    assert gen_mod.kv_token_budget(specs, 0.5, memory.__getitem__) == 0  # cuda:1: 30 GiB free < 50 GiB kept unused
    monkeypatch.setattr(model._hf_paged_t5, "layer_specs", lambda decoder: specs)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: memory[torch.device(device)])
    assert gen_mod._default_batch_tokens(model._hf_paged_t5, model.decoder, 0.9) == (tokens, True)
    assert gen_mod._default_batch_tokens(model._hf_paged_t5, model.decoder, 0.9, cap=1000) == (1000, True)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 leaves no room for KV on cuda:0 \(50.0 of "
                                         r"100.0 GiB free\), cuda:1 \(30.0 of 100.0 GiB free\)"):
        gen_mod._default_batch_tokens(model._hf_paged_t5, model.decoder, 0.5)


def test_a_budget_sized_from_memory_is_reserved_up_front():
    """A job whose budget came from the GPU's memory (stood in for by `reserve_tokens`) re-makes the
    idle pool at once to hold it, and never grows it by copying during the job; a job with the
    caller's budget leaves the pool to grow as it needs; a capped pool is not grown past its cap."""
    from hf_paged_t5.batch.cache import blocks_for

    model = patched(seed=9)
    pool_of = lambda: model._hf_paged_t5.pool  # noqa: E731
    inputs = make_inputs([10, 12, 60, 9], seed=8)
    gen = hp.BatchGenerator(model, max_new_tokens=6, max_batch_rows=3)
    assert gen.reserve_tokens is None  # off CUDA: the fixed default, no reservation
    list(gen.generate(inputs[:1]))
    before = pool_of().num_blocks
    gen.reserve_tokens = gen.max_batch_tokens = 4000
    sizes = []
    grow = type(pool_of()).reserve

    def recording(self, blocks):
        sizes.append((self.is_idle(), blocks))
        return grow(self, blocks)

    type(pool_of()).reserve = recording
    try:
        results = list(gen.generate(inputs))
    finally:
        type(pool_of()).reserve = grow
    wanted = blocks_for(4000, pool_of().block_size) + 2 * 3
    assert before < wanted <= pool_of().num_blocks
    assert sizes[0] == (True, wanted) and all(blocks <= pool_of().num_blocks for _, blocks in sizes)
    for ids, result in zip(inputs, results):
        assert result.sequences == alone(model, ids, max_new_tokens=6)[0]
    assert pool_of().is_idle()

    capped = patched(seed=9, num_blocks=64, max_num_blocks=96)
    gen = hp.BatchGenerator(capped, max_new_tokens=6, max_batch_rows=3)
    gen.reserve_tokens = gen.max_batch_tokens = 4000
    list(gen.generate(inputs[:2]))
    assert capped._hf_paged_t5.pool.num_blocks <= 96


def test_token_budget_limits_admission_and_a_larger_input_runs_alone(admissions):
    model = patched(seed=9)
    inputs = make_inputs([10, 12, 60, 9, 11, 8], seed=8)
    # worst cases: input + 1 + 6 new tokens, i.e. 15-19 tokens each, and 67 for the long input
    gen = hp.BatchGenerator(model, max_new_tokens=6, max_batch_tokens=40, max_batch_rows=8)
    results = list(gen.generate(inputs))
    for ids, result in zip(inputs, results):
        assert result.sequences == alone(model, ids, max_new_tokens=6)[0]
    assert max(running for _, running, _ in admissions) == 2
    assert (1, 1, [60]) in admissions  # the 60-token input, over the 40-token budget, ran by itself
    assert model._hf_paged_t5.pool.is_idle()


def test_pool_grows_at_most_once_per_admission_round(monkeypatch):
    model = patched(num_blocks=4)  # 3 usable blocks: admissions must grow the pool
    pool = model._hf_paged_t5.get_pool(model.decoder)
    growth = []  # pool re-allocations per admission round (growth drops captured CUDA graphs: keep it rare)
    original = BatchRun._admit

    def spy(self, pool):
        before = pool.generation
        admitted = original(self, pool)
        growth.append((len(admitted), pool.generation - before))
        return admitted

    monkeypatch.setattr(BatchRun, "_admit", spy)
    generation = pool.generation
    inputs = make_inputs([10, 12, 9, 11, 8, 13, 7], seed=9)
    results = list(hp.BatchGenerator(model, max_new_tokens=6, max_batch_rows=3).generate(inputs))
    assert growth[0] == (3, 1) and all(grew <= 1 for _, grew in growth)
    assert pool.generation - generation == sum(grew for _, grew in growth)  # none outside admission
    assert [r.sequences for r in results] == [alone(model, ids, max_new_tokens=6)[0] for ids in inputs]
    assert pool.is_idle()


@pytest.mark.parametrize("num_beams", [1, 2])
def test_table_widths_are_set_at_admission_not_grown_per_step(monkeypatch, num_beams):
    """The decode graphs are keyed on the block tables' widths: a row's self-table width is reserved
    when it is admitted, for the most tokens it may hold (start token + max_new), so every step of an
    admission round has the same widths; growing them as rows lengthen would capture a new graph
    each time a length crossed a power of two."""
    from hf_paged_t5.decode.runner import DecodeRunner

    model = patched()
    widths = []
    inner = DecodeRunner.decode

    def spy(runner, model_, cache, ids):
        self_table, _, cross_table, _ = cache.host_tables()
        widths.append((self_table.shape[1], cross_table.shape[1]))
        return inner(runner, model_, cache, ids)

    monkeypatch.setattr(DecodeRunner, "decode", spy)
    inputs = make_inputs()
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs, MAX_NEW)]
    gen = hp.BatchGenerator(model, max_batch_rows=len(inputs) * num_beams, num_beams=num_beams)
    results = list(gen.generate(requests))  # one admission round: every input fits
    assert set(widths) == {(blocks_for(1 + max(MAX_NEW), 4), blocks_for(max(LENGTHS), 4))}
    assert len(widths) >= max(MAX_NEW)  # the longest row's steps all ran at that width
    for ids, m, result in zip(inputs, MAX_NEW, results):
        assert result.sequences == alone(model, ids, max_new_tokens=m, min_new_tokens=m, num_beams=num_beams)[0]


def test_a_draining_job_uses_one_graph_bucket(monkeypatch):
    """A job's decode graphs serve at least `min_graph_rows` rows (padded): as rows finish, the
    steps keep the graph key they had (one capture for the job here) instead of stepping down
    through every power of two, whose small-batch kernel configurations compile on first capture."""
    from hf_paged_t5.decode.runner import DecodeRunner
    from hf_paged_t5.decode.graphs import graph_key

    model = patched()
    keys, rows = set(), set()
    inner = DecodeRunner.decode

    def spy(runner, model_, cache, ids):
        keys.add(graph_key(cache, ids.shape[0], cache.host_tables()))
        rows.add(ids.shape[0])
        return inner(runner, model_, cache, ids)

    monkeypatch.setattr(DecodeRunner, "decode", spy)
    inputs = make_inputs()
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs, MAX_NEW)]
    results = list(hp.BatchGenerator(model, max_batch_rows=len(inputs)).generate(requests))
    assert [r.num_new_tokens for r in results] == MAX_NEW
    assert len(rows) >= 5  # the job drained through many row counts...
    # ...under one graph key: 64 rows, 7 self blocks (26 tokens), 8 cross blocks, 1 row per source
    assert keys == {(64, 8, 8, 1)}


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_search_matches_generate_alone(early_stopping):
    model = patched(dtype=torch.float64, seed=3)
    inputs = make_inputs(LENGTHS[:7], seed=2)
    kw = dict(num_beams=3, length_penalty=0.7, early_stopping=early_stopping, num_return_sequences=2)
    min_new = [0, 5, 0, 2, 9, 0, 4]
    _beam_job_matches_alone(model, inputs, MAX_NEW, min_new, max_batch_rows=7, **kw)


def _beam_job_matches_alone(model, inputs, max_new, min_new, max_batch_rows, **kw):
    """A beam job of per-input limits (EOS: token 1 and one the model picks early) against patched
    generate() on each input alone: sequences equal; scores equal up to float64 rounding (the callers'
    models are float64: the same engine on other batch compositions sums in other orders, nothing else)."""
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=n) for ids, m, n in zip(inputs, max_new, min_new)]
    gen = hp.BatchGenerator(model, max_batch_rows=max_batch_rows, eos_token_id=[1, _frequent_token(model, inputs)], **kw)
    for request, result in zip(requests, gen.generate(requests)):
        sequences, scores = alone(model, request.inputs, max_new_tokens=request.max_new_tokens,
                                  min_new_tokens=request.min_new_tokens, eos_token_id=list(gen.eos), **kw)
        assert result.sequences == sequences
        assert result.scores == pytest.approx(scores, rel=1e-12, abs=0)
    assert model._hf_paged_t5.pool.is_idle()


def test_a_beam_steps_block_copies_run_as_one(monkeypatch):
    """A beam job's step reorders the rows of many inputs; the partial blocks they share are copied
    in one `KVPool.copy_blocks` per step (each input's copy was a transfer and launches of its own),
    with the results generate()'s on each input alone."""
    from hf_paged_t5.kv.pool import KVPool

    per_step = []  # copy_blocks calls of each of the job's steps: [blocks copied by each call]
    copy, decode = KVPool.copy_blocks, BatchRun._decode_step

    def spy_decode(run):
        per_step.append([])
        try:
            return decode(run)
        finally:
            per_step[-1] = tuple(per_step[-1])  # closed: generate() alone below copies outside the job

    def spy_copy(pool, src, dst):
        if per_step and isinstance(per_step[-1], list):
            per_step[-1].append(len(src))
        return copy(pool, src, dst)

    monkeypatch.setattr(KVPool, "copy_blocks", spy_copy)
    monkeypatch.setattr(BatchRun, "_decode_step", spy_decode)
    model = patched(dtype=torch.float64, seed=3)
    inputs = make_inputs(LENGTHS[:8], seed=6)
    _beam_job_matches_alone(model, inputs, MAX_NEW[:8], [0] * 8, max_batch_rows=24, num_beams=3)
    assert max(len(calls) for calls in per_step) == 1  # one call per step...
    assert max(n for calls in per_step for n in calls) > 3  # ...copying blocks of several inputs


@pytest.mark.parametrize("early_stopping,length_penalty", [(False, 1.0), (True, 1.0), ("never", 0.0), ("never", 1.5)])
def test_beam_requests_of_any_length_and_admission_share_a_group(monkeypatch, admissions, early_stopping,
                                                                   length_penalty):
    """Beam requests with different max_new_tokens, admitted at different steps (9 rows: 3 inputs of
    3 beams at a time), step as one `BeamGroup`, each source at its own length with its own length
    limits and length-penalty divisors (early_stopping="never" with a positive penalty: the
    heuristic's divisor from its own max length); each result is generate()'s on the input alone."""
    stepped = []
    advance = BatchRun._advance_beams
    def spy(run, logits):
        stepped.append([g.batch for g in run.groups])
        return advance(run, logits)

    monkeypatch.setattr(BatchRun, "_advance_beams", spy)
    model = patched(dtype=torch.float64, seed=5)
    inputs = make_inputs(LENGTHS[:6], seed=4)
    max_new, min_new = [9, 4, 13, 6, 11, 4], [0, 2, 5, 0, 3, 1]
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=early_stopping, length_penalty=length_penalty)
    _beam_job_matches_alone(model, inputs, max_new, min_new, max_batch_rows=9, **kw)
    assert len([n for n, _, _ in admissions if n]) >= 3  # inputs joined at several steps...
    assert max(len(groups) for groups in stepped) == 1  # ...into one group
    assert max(groups[0] for groups in stepped) == 3


def test_beam_requests_of_other_eos_ids_step_in_a_group_of_their_own(monkeypatch):
    """EOS ids decide how many candidates HF keeps per step (max(2, 1 + num_eos) x num_beams):
    requests with their own EOS ids step in a group per EOS ids; results are generate()'s alone."""
    stepped = []
    advance = BatchRun._advance_beams
    def spy(run, logits):
        stepped.append(sorted(g.eos_ids for g in run.groups))
        return advance(run, logits)

    monkeypatch.setattr(BatchRun, "_advance_beams", spy)
    model = patched(dtype=torch.float64, seed=6)
    inputs = make_inputs(LENGTHS[:5], seed=7)
    frequent = _frequent_token(model, inputs)
    eos = [[1], [1, frequent], [1], [frequent, 1], [1, frequent]]
    requests = [hp.BatchRequest(ids, eos_token_id=e, max_new_tokens=m) for ids, e, m in zip(inputs, eos, MAX_NEW)]
    kw = dict(num_beams=2, length_penalty=0.8)
    results = list(hp.BatchGenerator(model, max_batch_rows=10, **kw).generate(requests))
    for request, result in zip(requests, results):
        sequences, scores = alone(model, request.inputs, max_new_tokens=request.max_new_tokens,
                                  eos_token_id=request.eos_token_id, **kw)
        assert result.sequences == sequences
        assert result.scores == pytest.approx(scores, rel=1e-12, abs=0)  # float64: rounding only
    assert max(len(groups) for groups in stepped) == 3  # (1,), (1, frequent), (frequent, 1)


def test_per_request_min_new_tokens_and_eos():
    model = patched(seed=4)
    inputs = make_inputs(LENGTHS[:6], seed=3)
    # each input's EOS: the 2nd token greedy decoding gives it, so minimums have something to hold back
    eos = [alone(model, ids, max_new_tokens=12)[0][0][2] for ids in inputs]
    specs = [dict(eos_token_id=eos[0]), dict(eos_token_id=eos[1], min_new_tokens=4),
             dict(eos_token_id=[eos[2], 1], min_new_tokens=3), dict(max_new_tokens=4, min_new_tokens=4),
             dict(), dict(eos_token_id=eos[5], max_new_tokens=20, min_new_tokens=6)]
    requests = [hp.BatchRequest(ids, **spec) for ids, spec in zip(inputs, specs)]
    gen = hp.BatchGenerator(model, max_new_tokens=12, max_batch_rows=4)
    results = list(gen.generate(requests))
    for ids, spec, result in zip(inputs, specs, results):
        assert result.sequences == alone(model, ids, **{"max_new_tokens": 12, **spec})[0], spec
    assert results[0].num_new_tokens <= 2 and results[0].token_ids[-1] == eos[0]
    assert results[1].num_new_tokens >= 4 and results[5].num_new_tokens >= 6
    assert model._hf_paged_t5.pool.is_idle()


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default:UserWarning")  # stock HF, the reference
@pytest.mark.parametrize("kwargs, config", [
    ({}, None), ({"max_length": 12}, None), ({}, GenerationConfig(max_length=9, min_length=6)),
    ({"min_length": 4, "max_new_tokens": 7}, None),
])
def test_length_defaults_follow_hf(kwargs, config):
    """No max_new_tokens: HF's rules (20 new tokens by default, else max_length - 1 for the start token)."""
    model, stock = patched(seed=1), make_model("t5", seed=1)  # same weights; stock HF is the reference
    inputs = make_inputs([5, 9])
    results = hp.BatchGenerator(model, generation_config=config, **kwargs).generate(inputs)
    for ids, result in zip(inputs, results):
        assert result.sequences == stock.generate(input_ids=torch.tensor([ids]), generation_config=config,
                                                  **kwargs).tolist()


def test_history_processors_run_per_length_group():
    model = patched(seed=5)
    inputs = make_inputs(LENGTHS[:6], seed=4)
    kw = dict(max_new_tokens=14, repetition_penalty=1.8, no_repeat_ngram_size=2, forced_eos_token_id=1)
    requests = [hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, [14, 6, 9, 14, 3, 11])]
    gen = hp.BatchGenerator(model, max_batch_rows=3, **kw)
    assert gen.rules.needs_history
    for request, result in zip(requests, gen.generate(requests)):
        assert result.sequences == alone(model, request.inputs, **{**kw, "max_new_tokens": request.max_new_tokens})[0]


def test_sampling_warpers_and_return_sequences():
    model = patched(seed=6)
    inputs = make_inputs(LENGTHS[:5], seed=5)
    # top_k=1 leaves one candidate: sampling must then reproduce greedy, through HF's warpers
    greedy = [r.sequences for r in hp.BatchGenerator(model, max_new_tokens=10).generate(inputs)]
    gen = hp.BatchGenerator(model, max_new_tokens=10, do_sample=True, top_k=1, temperature=0.7, max_batch_rows=2)
    assert not gen.rules.needs_history
    assert [r.sequences for r in gen.generate(inputs)] == greedy
    gen = hp.BatchGenerator(model, max_new_tokens=10, do_sample=True, top_p=0.9, num_return_sequences=3)
    torch.manual_seed(0)
    first = [r.sequences for r in gen.generate(inputs)]
    torch.manual_seed(0)
    assert [r.sequences for r in gen.generate(inputs)] == first  # the global RNG drives the draws
    for rows in first:
        assert len(rows) == 3 and len({len(row) for row in rows}) == 1 and len(rows[0]) <= 11
    assert len({tuple(row) for rows in first for row in rows}) > len(inputs), "samples should differ"
    assert model._hf_paged_t5.pool.is_idle()


# ---- tokens read back one step late (batch_rows.DecodeRows) -----------------------------------------
@pytest.fixture
def late_steps(monkeypatch):
    """Checks at every step that each row writes K/V only into the blocks its request was promised at
    admission; records how far each row got: [(max_new, decoder tokens stored)], one entry per row."""
    rows = []
    of_slot = {}  # slot -> (blocks promised to the row, its entry in `rows`)

    def encode(self, admitted, pool):
        original_encode(self, admitted, pool)
        for request in admitted:
            promised = (request.blocks - blocks_for(len(request.ids), self.cache.block_size)) // request.expand
            for slot in request.rows:
                rows.append([request.max_new, 0])
                of_slot[slot] = (promised, rows[-1])

    def begin_step(self, num_new):
        slots = original_begin(self, num_new)
        for slot in self.order.tolist():
            promised, row = of_slot[slot]
            assert self.rows.held[slot] <= promised, "a row outgrew the blocks promised to it"
            row[1] = int(self.rows.lens[slot])
        return slots

    original_encode, original_begin = BatchRun._encode, BatchCache.begin_step
    monkeypatch.setattr(BatchRun, "_encode", encode)
    monkeypatch.setattr(BatchCache, "begin_step", begin_step)
    return rows


@pytest.mark.parametrize("do_sample", [False, True])
def test_rows_ending_together_at_block_boundaries_and_on_the_first_token(late_steps, admissions, do_sample):
    """A row that ends at step n runs step n+1 before the host knows: that step stays in the row's
    promised blocks (max_new at a 4-token block boundary: the late step opens a block) and its token is
    dropped. Rows ending on the same step; an EOS that is the first token; with top_k=1 sampling too."""
    model = patched(seed=11, num_blocks=48, grow=False)
    inputs = make_inputs([6, 9, 4, 13, 7, 5, 11, 8], seed=11)
    eos = alone(model, inputs[0], max_new_tokens=4)[0][0][1]  # input 0's first token: it ends at once
    max_new = [9, 4, 4, 4, 8, 3, 8, 7]  # 4 and 8: the last token fills a block
    kw = dict(do_sample=True, top_k=1) if do_sample else {}
    gen = hp.BatchGenerator(model, max_batch_rows=8, eos_token_id=[1, eos], **kw)
    requests = [hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, max_new)]
    results = list(gen.generate(requests))
    for ids, m, result in zip(inputs, max_new, results):
        assert result.sequences == alone(model, ids, max_new_tokens=m, eos_token_id=[1, eos])[0]
    assert admissions[0][0] == len(inputs)  # all start together: equal lengths end on the same step
    assert results[0].num_new_tokens == 1
    lengths = [r.num_new_tokens for r in results]
    assert len(lengths) > len(set(lengths)), "expected rows ending on the same step"
    # every row ran exactly one step past its last token (its K/V up to position max_new at most)
    assert sorted(stored for _, stored in late_steps) == sorted(n + 1 for n in lengths)
    assert any(stored == 1 + m and m % 4 == 0 for m, stored in late_steps), "no late step opened a block"
    assert model._hf_paged_t5.pool.is_idle()


def test_decode_steps_read_no_device_values(monkeypatch):
    """The host learns a step's tokens only from the read-back of `DecodeRows.collect`, a step late:
    nothing else on the greedy/sampling step path turns a tensor into host values (on a GPU each would
    wait for the step just queued). Greedy, a history rule, sampling with a warper."""
    calls = []
    watching = [False]

    def watch(name):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, **kwargs):
            if watching[0]:
                calls.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)

    def watched(method):
        original = getattr(DecodeRows, method)

        def run(self, *args, **kwargs):
            watching[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                watching[0] = False

        monkeypatch.setattr(DecodeRows, method, run)

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        watch(name)
    for method in ("set_order", "next_input", "choose", "collect"):
        watched(method)
    model = patched(seed=12)
    inputs = make_inputs(LENGTHS[:6], seed=12)
    for kw in ({}, dict(repetition_penalty=1.5), dict(do_sample=True, top_k=3)):
        gen = hp.BatchGenerator(model, max_new_tokens=6, max_batch_rows=4, **kw)
        assert len(list(gen.generate(inputs))) == len(inputs)
    assert not calls


# ---- order, texts -----------------------------------------------------------------------------------
def test_as_completed_runs_ahead_of_input_order():
    model = patched(seed=7)
    inputs = make_inputs([20, 3, 9, 5], seed=6)
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs, [24, 2, 6, 4])]
    gen = hp.BatchGenerator(model)
    order = [index for index, _ in gen.as_completed(requests)]
    assert sorted(order) == [0, 1, 2, 3] and order[-1] == 0
    assert [r.index for r in gen.generate(requests)] == [0, 1, 2, 3]


def test_rows_decode_longest_source_first(monkeypatch):
    """Each step's rows run longest source first (the decode kernels launch rows in that order),
    and the order changes no result: every output equals that input decoded alone."""
    orders = []
    original = BatchCache.set_order

    def spy(self, rows):
        orders.append(self.sources.lens[self._source_of[list(rows)]].tolist())
        return original(self, rows)

    monkeypatch.setattr(BatchCache, "set_order", spy)
    model = patched(seed=3)
    inputs = make_inputs(seed=3)
    gen = hp.BatchGenerator(model, max_new_tokens=5, max_batch_rows=6)
    results = list(gen.generate(inputs))
    assert any(len(set(lens)) > 2 for lens in orders)  # steps held sources of several lengths
    for lens in orders:
        assert lens == sorted(lens, reverse=True)
    for ids, result in zip(inputs, results):
        assert result.sequences == alone(model, ids, max_new_tokens=5)[0]


def test_text_inputs_with_tokenizer():
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model("tiny", vocab_size=len(tokenizer))
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, backend="torch"))
    texts = list(tiny.CORPUS[:4]) + [" ".join(tiny.CORPUS[4:7])]
    results = list(hp.BatchGenerator(model, tokenizer, max_new_tokens=8, max_batch_rows=2).generate(texts))
    for text, result in zip(texts, results):
        enc = tokenizer(text, return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=8)
        assert result.sequences == ref.tolist()
        assert result.text == tokenizer.decode(ref[0], skip_special_tokens=True)


# ---- the pool is returned: exhausted, closed early, exceptions ----------------------------------------
def test_pool_idle_after_close_and_errors():
    model = patched(num_blocks=64, grow=False)
    pool_of = lambda: model._hf_paged_t5.pool  # noqa: E731
    inputs = make_inputs()
    gen = hp.BatchGenerator(model, max_new_tokens=8, max_batch_rows=4)
    stream = gen.generate([hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, MAX_NEW)])
    next(stream)
    assert not pool_of().is_idle()  # requests are in flight
    stream.close()
    assert pool_of().is_idle()

    with pytest.raises(RuntimeError, match="consumer failed"):
        for result in gen.as_completed(inputs):
            raise RuntimeError("consumer failed")
    assert pool_of().is_idle()

    bad = inputs[:4] + [[]] + inputs[4:]  # an empty input, met mid-run
    with pytest.raises(ValueError, match="input 4 has no tokens"):
        list(gen.generate(bad))
    assert pool_of().is_idle()

    with pytest.raises(hp.PoolExhaustedError, match="input 0"):
        list(gen.generate([list(range(2, 300))]))  # needs 75+ blocks by itself
    assert pool_of().is_idle()
    assert [r.sequences for r in gen.generate(inputs[:2])] == [alone(model, i, max_new_tokens=8)[0] for i in inputs[:2]]


def test_a_job_refuses_a_hook_it_would_not_run():
    """A forward hook on a decoder block (which the batch engine never calls as a module) stops a
    job before it admits anything, with the reason; a hook on a projection runs; once the block's
    hook is gone, the same generator runs."""
    model = patched()
    inputs = make_inputs()[:3]
    gen = hp.BatchGenerator(model, max_new_tokens=5)
    handle = model.decoder.block[1].register_forward_hook(lambda *_: None)
    with pytest.raises(ValueError, match=r"a hook on decoder\.block\.1 \(a module the paged path does not call\) "
                                         r"would not run; remove it, or use model\.generate\(\)"):
        list(gen.generate(inputs))
    assert model._hf_paged_t5.pool is None or model._hf_paged_t5.pool.is_idle()
    handle.remove()
    runs = []
    handle = model.decoder.block[1].layer[0].SelfAttention.q.register_forward_hook(lambda *_: runs.append(1))
    try:
        results = [r.sequences for r in gen.generate(inputs)]
    finally:
        handle.remove()
    assert runs and results == [alone(model, ids, max_new_tokens=5)[0] for ids in inputs]


def test_generate_between_steps_does_not_deadlock():
    model = patched(seed=8)
    inputs = make_inputs(LENGTHS[:4], seed=7)
    refs = [alone(model, ids, max_new_tokens=6)[0] for ids in inputs]
    for ids, result in zip(inputs, hp.BatchGenerator(model, max_new_tokens=6, max_batch_rows=2).generate(inputs)):
        assert result.sequences == refs[inputs.index(ids)]
        assert model.generate(input_ids=torch.tensor([ids]), max_new_tokens=6).tolist() == result.sequences
    assert model._hf_paged_t5.pool.is_idle()


def test_refusals():
    model = make_model("t5")
    with pytest.raises(TypeError, match="patch_model"):
        hp.BatchGenerator(model)
    hp.patch_model(model, hp.PagedCacheConfig(backend="torch"))
    with pytest.raises(ValueError, match="encoder_repetition_penalty"):
        hp.BatchGenerator(model, encoder_repetition_penalty=1.3)
    with pytest.raises(ValueError, match="cannot serve"):
        hp.BatchGenerator(model, num_beam_groups=2, num_beams=4, diversity_penalty=0.5)
    with pytest.raises(TypeError, match="not generation options"):
        hp.BatchGenerator(model, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="max_batch_rows"):
        hp.BatchGenerator(model, num_beams=4, max_batch_rows=2)
    with pytest.raises(ValueError, match="no tokenizer"):
        list(hp.BatchGenerator(model).generate(["a text"]))
    with pytest.raises(ValueError, match="needs an eos_token_id.*min_new_tokens = max_new_tokens"):
        hp.BatchGenerator(model, eos_token_id=[])
    with pytest.raises(ValueError, match="per-input eos_token_id cannot be combined"):
        gen = hp.BatchGenerator(model, bad_words_ids=[[5]])
        list(gen.generate([hp.BatchRequest([3, 4, 5], eos_token_id=7)]))
    assert model._hf_paged_t5.pool.is_idle()


# ---- GPU: Triton kernels and CUDA graphs under BatchGenerator (python -m pytest -m gpu tests/test_batching.py) --
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_beams, max_graph_batch", [(1, 256), (1, 4), (3, 256)])
def test_cuda_graph_steps_match_generate_alone(num_beams, max_graph_batch):
    """Rows come and go under captured graphs (and, with max_graph_batch=4, switch between graph and
    eager steps as their count crosses it), inputs admitted after the first wave are encoded by
    bucket graphs (padded); each result equals patched generate() alone (fp32)."""
    model = make_model("t5", seed=10, device="cuda")
    hp.patch_model(model, hp.PagedCacheConfig(block_size=16, max_graph_batch=max_graph_batch))
    inputs = make_inputs([5, 40, 3, 17, 90, 30, 2, 64, 8, 33], seed=10)
    requests = [hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, [7, 40, 3, 21, 25, 4, 33, 9, 1, 18])]
    gen = hp.BatchGenerator(model, max_batch_rows=6 * num_beams, num_beams=num_beams)
    for request, result in zip(requests, gen.generate(requests)):
        ids = torch.tensor([request.inputs], device="cuda")
        ref = model.generate(input_ids=ids, max_new_tokens=request.max_new_tokens, num_beams=num_beams)
        assert result.sequences == ref.tolist()
    runtime = model._hf_paged_t5
    assert runtime.runner.graphs.num_steps, "no decode step ran as a CUDA graph"
    assert runtime.bucket_graphs.replays, "no input admitted alone was encoded by a bucket graph"
    assert runtime.pool.is_idle()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_graph_batch, kw", [
    (256, {}), (4, {}), (256, dict(do_sample=True, top_k=4, repetition_penalty=1.3)),
])
def test_decode_steps_never_wait_for_the_gpu(monkeypatch, max_graph_batch, kw):
    """Once the graphs are captured and the pool sized (a first run of the same job), a greedy or
    sampling step, graph or eager — admission, the encoder over the admitted inputs (their mask stays
    on the host) and their cross K/V, the decode step with its token choice, late read-back and
    retirements — makes no synchronizing CUDA call: torch's sync debug mode raises on one. The
    results do not change."""
    model = make_model("t5", seed=10, device="cuda")
    hp.patch_model(model, hp.PagedCacheConfig(block_size=16, max_graph_batch=max_graph_batch))
    inputs = make_inputs([5, 40, 3, 17, 90, 30, 2, 64, 8, 33], seed=10)
    requests = [hp.BatchRequest(ids, max_new_tokens=m) for ids, m in zip(inputs, [7, 40, 3, 21, 25, 4, 33, 9, 1, 18])]
    gen = hp.BatchGenerator(model, max_batch_rows=6, **kw)
    torch.manual_seed(0)
    first = [r.sequences for r in gen.generate(requests)]
    original = BatchRun._step

    def strict(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(BatchRun, "_step", strict)
    torch.manual_seed(0)
    assert [r.sequences for r in gen.generate(requests)] == first
    assert model._hf_paged_t5.pool.is_idle()


def test_per_input_sampling_options_and_seeds_give_solo_draws():
    """Inputs with their own do_sample / temperature / top_p / top_k and a seed, mixed with greedy
    ones in one job: each is generate() on that input alone after torch.manual_seed(seed)."""
    model = patched()
    inputs = make_inputs()[:6]
    options = [dict(do_sample=True, temperature=0.7, top_k=20, seed=11), dict(),
               dict(do_sample=True, top_p=0.9, seed=5), dict(do_sample=True, temperature=1.3, seed=2), dict(seed=4),
               dict(do_sample=True, top_k=5, temperature=0.9, seed=9)]
    requests = [hp.BatchRequest(ids, max_new_tokens=9, min_new_tokens=9, **o) for ids, o in zip(inputs, options)]
    results = list(hp.BatchGenerator(model, max_batch_rows=4).generate(requests))
    draws = set()
    for ids, o, result in zip(inputs, options, results):
        torch.manual_seed(o.get("seed", 0))
        want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=9, min_new_tokens=9,
                              **{k: v for k, v in o.items() if k != "seed"})
        assert result.sequences == want.tolist(), o
        draws.add(tuple(result.sequences[0]))
    assert len(draws) == len(inputs)


def test_per_input_sampling_refusals():
    model = patched()
    ids = make_inputs()[0]
    with pytest.raises(ValueError, match="not beam search"):
        hp.BatchGenerator(model, num_beams=2).make_request(0, hp.BatchRequest(ids, temperature=0.5, do_sample=True))
    gen = hp.BatchGenerator(model)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        gen.make_request(0, hp.BatchRequest(ids, do_sample=True, temperature=0.0))
    with pytest.raises(ValueError, match="top_p must be in"):
        gen.make_request(0, hp.BatchRequest(ids, do_sample=True, top_p=1.5))
    with pytest.raises(ValueError, match="num_return_sequences=1"):
        hp.BatchGenerator(model, do_sample=True, num_return_sequences=2).make_request(0, hp.BatchRequest(ids, seed=3))
    with pytest.raises(ValueError, match="read the generated tokens"):
        hp.BatchGenerator(model, repetition_penalty=1.2).make_request(
            0, hp.BatchRequest(ids, do_sample=True, temperature=0.5))
    with pytest.raises(ValueError, match="read the generated tokens"):
        hp.BatchGenerator(model, do_sample=True, repetition_penalty=1.2).make_request(0, hp.BatchRequest(ids, seed=1))


# ---- random option mixes, float64 ---------------------------------------------------------------
MIX_FAMILIES = ("t5", "t5v1_1", "umt5", "mt5")
CI_MIX_SEEDS = (0, 1, 2, 3)  # each family, both backends
SLOW_MIX_SEEDS = tuple(range(4, 300))


def _mixed_job(rng: random.Random, model, seed: int) -> tuple[dict, list]:
    """A job's generator options (a search mode and a random set of the processors HF applies per
    row) and its requests (inputs of 1-20 tokens, some with their own max / min new tokens)."""
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(2, 300, (rng.randint(1, 20),), generator=g).tolist() for _ in range(rng.randint(1, 9))]
    opts = dict(max_new_tokens=rng.randint(1, 12))
    beams = rng.choice([1, 1, 2, 3])
    if beams > 1:
        opts.update(num_beams=beams, num_return_sequences=rng.randint(1, beams))
        opts.update({k: rng.choice(v) for k, v in (("length_penalty", (0.0, 0.6, 2.0)),
                                                   ("early_stopping", (True, False, "never"))) if rng.random() < 0.5})
    tokens = sorted(set(alone(model, inputs[0], max_new_tokens=10, min_new_tokens=10)[0][0][1:]))
    choices = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "bad_words_ids": [[tokens[0]]],
               "suppress_tokens": tokens[:1], "begin_suppress_tokens": tokens[-1:], "forced_eos_token_id": 1,
               "sequence_bias": {(tokens[0],): -1.0}, "renormalize_logits": True,
               "exponential_decay_length_penalty": (2, 1.5), "min_new_tokens": rng.randint(1, 5),
               "eos_token_id": tokens[:2]}
    opts.update({k: v for k, v in choices.items() if rng.random() < 0.25})
    requests = []
    for ids in inputs:
        limits = {k: rng.randint(1, n) for k, n in (("max_new_tokens", 12), ("min_new_tokens", 4)) if rng.random() < 0.25}
        requests.append(hp.BatchRequest(ids, **limits))
    return opts, requests


@pytest.mark.parametrize("seed", [*CI_MIX_SEEDS, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_MIX_SEEDS)])
def test_random_option_mix_matches_stock_alone_in_float64(seed):
    """A job with random options (search mode, penalties, bans, forced and suppressed tokens, EOS
    ids, per-input limits) on a float64 model, on the case's backend and block size: each input's
    sequences are stock HF's generate() on that input alone, its beam scores too (float64: no
    near ties, so any difference is the engine's)."""
    rng = random.Random(seed)
    model = make_model(MIX_FAMILIES[seed % len(MIX_FAMILIES)], seed=seed).double()
    stock = stock_copy(model)
    opts, requests = _mixed_job(rng, stock, seed)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=rng.choice([1, 4, 16]), backend=("torch", "cpu")[seed % 2]))
    # half the jobs hold 1-3 inputs at a time: inputs join at different steps (beam search: one
    # group of sources at their own lengths, history processors run per length)
    rows = rng.choice([None, opts.get("num_beams", 1) * rng.randint(1, 3)])
    results = dict(hp.BatchGenerator(model, max_batch_rows=rows, **opts).as_completed(requests))
    assert sorted(results) == list(range(len(requests)))
    for index, request in enumerate(requests):
        limits = {k: getattr(request, k) for k in ("max_new_tokens", "min_new_tokens") if getattr(request, k)}
        rows, scores = alone(stock, request.inputs, **{**opts, **limits})
        assert results[index].sequences == rows, (index, opts, limits)
        if scores is not None:
            assert results[index].scores == pytest.approx(scores, rel=1e-12, abs=0), (index, opts, limits)
