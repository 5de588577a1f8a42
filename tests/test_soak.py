"""Many patched generate() calls on one model: no drift, no leak, stock HF's answers.

- CPU, `test_random_mix`: per case (its own seed: family, weights, block size, backend, calls),
  one patched model serves a random mix of calls — batch sizes, source lengths, padding sides,
  greedy / beam search / sampling / beam sampling, `num_return_sequences`, EOS ids, pad ids,
  min lengths, decoder prompts, max_length or max_new_tokens, plain or dict outputs with scores
  and logits. Every call is compared with stock HF on an unpatched copy (tests/oracle.py), the
  calls the device-resident loops serve must run them, and the pool and the memory in use must
  stay flat. A few seeds run in CI; the long sweep is `slow`.
- GPU (`-m gpu`, also `slow`), `test_soak_gpu`: 1,000 calls, t5-small layout, Triton kernels and
  CUDA graphs, `torch.cuda.memory_allocated()`, a sample of 30 compared with stock HF.

Flat means: the pool is idle after every call, its size and free count do not change from the
10th call on, and memory in use does not change from the 10th call on except when the call
captured or kept a new graph (a new batch / table-width bucket; the captured graph keeps its
static buffers; kept loop updates, at most `graphs.MAX_KEPT_UPDATES`, replace one another
throughout). Call 0 is the largest request, so any pool growth happens first; on the GPU a
warm-up pass captures the decode-step buckets the soak's sizes can reach first.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time
import warnings

import pytest
import torch
from conftest import make_batch, make_model, resident_loop
from oracle import case_seed, compare_with_stock, stock_copy

import hf_paged_t5 as hp
from hf_paged_t5 import tiny

CUDA = torch.cuda.is_available()
FLAT_FROM = 10  # growth (pool, first-use allocations) is allowed only before this call


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Limits of the random calls."""

    max_batch: int
    min_src: int
    max_src: int
    max_new: int
    beams: int
    vocab: int


@dataclasses.dataclass(frozen=True)
class Call:
    batch: int
    src_len: int
    new_tokens: int
    num_beams: int
    do_sample: bool
    left_padding: bool
    seed: int

    def inputs(self, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask [batch, src_len]; row 0 full length, the others random lengths."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(2, vocab, (self.batch, self.src_len), generator=g)
        lens = torch.randint(1, self.src_len + 1, (self.batch,), generator=g)
        lens[0] = self.src_len
        pos = torch.arange(self.src_len)[None, :]
        mask = (pos >= self.src_len - lens[:, None]) if self.left_padding else (pos < lens[:, None])
        mask = mask.long()
        return (ids * mask).to(device), mask.to(device)

    def kwargs(self, vocab: int, device) -> dict:
        ids, mask = self.inputs(vocab, device)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=self.new_tokens, num_beams=self.num_beams,
                  do_sample=self.do_sample)
        if self.num_beams > 1:
            kw["num_return_sequences"] = 2 if self.seed % 2 else 1
        if self.do_sample:
            kw["top_k"] = 50
        return kw


def random_calls(n: int, sizes: Sizes, seed: int) -> list[Call]:
    """`n` calls; call 0 is the largest request (so any pool growth happens first), calls 1-3 cover
    beam search and sampling, the rest are random: a quarter beam search, a fifth of the others sampling."""
    rng = random.Random(seed)
    calls = [
        Call(sizes.max_batch, sizes.max_src, sizes.max_new, sizes.beams, False, False, 0),
        Call(3, sizes.min_src, 5, sizes.beams, False, True, 1),
        Call(2, sizes.max_src // 2, 7, 1, True, False, 2),
        Call(1, sizes.min_src, 1, 1, False, False, 3),
    ]
    while len(calls) < n:
        beams = sizes.beams if rng.random() < 0.25 else 1
        calls.append(Call(
            batch=rng.randint(1, sizes.max_batch),
            src_len=rng.randint(sizes.min_src, sizes.max_src),
            new_tokens=rng.randint(1, sizes.max_new),
            num_beams=beams,
            do_sample=beams == 1 and rng.random() < 0.2,
            left_padding=rng.random() < 0.5,
            seed=len(calls),
        ))
    return calls[:n]


def checked_calls(n: int, how_many: int, seed: int) -> set[int]:
    """Which calls are compared with stock HF: the four fixed ones, then a random sample."""
    return set(range(4)) | set(random.Random(seed).sample(range(4, n), how_many - 4))


@dataclasses.dataclass
class Record:
    memory: int
    graphs: int
    pool_blocks: int
    free_blocks: int
    idle: bool


def pool_record(model, memory: int) -> Record:
    pool = model._hf_paged_t5.pool
    assert pool is not None, "the paged path did not run"
    stats = hp.runtime_stats(model)
    # every graph captured so far (decode steps, small batches' kept updates, which replace one
    # another within a bound, and encoder forwards of shapes that recur): memory may change only
    # when this count does
    graphs = stats["graphs_captured"] + stats["encoder_graphs_captured"]
    return Record(memory, graphs, stats["pool_blocks"], stats["pool_blocks_free"], pool.is_idle())


def soak(model, stock_model, calls: list[tuple[int, dict]], checked, measure, loops=None, near_ties=False) -> list[Record]:
    """Run every (seed, generate kwargs) call on the patched `model`, the `checked` ones (indices)
    through `compare_with_stock` against `stock_model` (an unpatched copy); with `loops` (the
    conftest spy), each call must run the resident loop `resident_loop` names, or none."""
    records = []
    calls = iter(calls)
    # no `enumerate`: its reused result tuple would keep the last call's inputs alive through the
    # measurement, and memory would follow the size of each call's inputs
    i = -1
    while (call := next(calls, None)) is not None:
        i += 1
        seed, kw = call
        del call
        if i in checked:
            before = len(loops) if loops is not None else 0
            expected = [name for name in [resident_loop(kw)] if name]

            def ran_expected_loop(_model):
                assert loops is None or loops[before:] == expected, f"call {i} ran {loops[before:]}, not {expected}"

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outputs = compare_with_stock(model, stock_model=stock_model, seed=seed, near_ties=near_ties,
                                             while_patched=ran_expected_loop, **kw)
        else:
            torch.manual_seed(seed)
            outputs = model.generate(**kw)
        del outputs, kw  # measured memory must not include this call's inputs or outputs
        if i in checked:
            gc.collect()  # the stock and fp64 outputs of a checked call may sit in reference cycles
        records.append(pool_record(model, measure()))
    return records


def assert_flat(records: list[Record]) -> None:
    busy = [i for i, r in enumerate(records) if not r.idle]
    assert not busy, f"calls left blocks in use: {busy}"
    tail = records[FLAT_FROM - 1:]
    sizes = [r.pool_blocks for r in tail]
    assert len(set(sizes)) == 1, f"pool grew after call {FLAT_FROM}: {sizes}"
    free = sorted({r.free_blocks for r in tail})
    assert len(free) == 1, f"free blocks drift: {free}"
    drift = [
        (FLAT_FROM - 1 + i, cur.memory - prev.memory)
        for i, (prev, cur) in enumerate(zip(tail, tail[1:]), start=1)
        if cur.graphs == prev.graphs and cur.memory != prev.memory
    ]
    assert not drift, f"memory changed without a new CUDA graph (call, bytes): {drift[:10]}"


# ---- CPU: the random mix ----------------------------------------------------------------------
def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage counted once)."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":  # type(): no __class__ lookups
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


MIX_FAMILIES = ("t5", "t5v1_1", "umt5")
MIX_BLOCK_SIZES = (1, 2, 4, 8, 16, 256)
MIX_BACKENDS = ("torch", "cpu")  # the reference backend and the one "auto" runs on CPU
MIX_CALLS = 24
MAX_ROWS, MAX_SRC, MAX_NEW, MAX_BEAMS, MAX_PROMPT = 4, 14, 20, 4, 9
CI_MIX_SEEDS = (0, 1, 2)  # one per family, both backends
SLOW_MIX_SEEDS = tuple(range(3, 24))


def _largest_call(umt5: bool) -> dict:
    """Call 0: as many blocks as any later call reserves (rows x beams, source, prompt, new tokens):
    the longest prompt and the largest max_length (which counts the prompt) a later call can ask."""
    ids, mask = make_batch([MAX_SRC] * MAX_ROWS, seed=0)
    longest = MAX_NEW + MAX_PROMPT + 1
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=MAX_BEAMS, max_length=longest, min_length=longest)
    if not umt5:
        kw["decoder_input_ids"] = torch.full((MAX_ROWS, MAX_PROMPT), 5)
    return kw


def _mixed_call(rng: random.Random, stock_model, seed: int) -> dict:
    """generate() kwargs of one random call, within the limits `_largest_call` covers."""
    rows = rng.randint(1, MAX_ROWS)
    lens = [rng.randint(1, MAX_SRC) for _ in range(rows)]
    ids, mask = make_batch(lens, padding_side=rng.choice(["left", "right"]), seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask)
    beams = rng.choice([1, 1, 2, 3, MAX_BEAMS])
    if beams > 1:
        kw.update(num_beams=beams, num_return_sequences=rng.randint(1, beams),
                  early_stopping=rng.choice([True, False, "never"]),
                  length_penalty=rng.choice([1.0, 0.0, -0.7, 0.6, 2, 1.3]))
    if rng.random() < 0.25:  # sampling (beam sampling with beams); no temperature: see the oracle
        kw.update(do_sample=True, top_k=rng.choice([0, 20, 50]))
        if beams == 1:
            kw["num_return_sequences"] = rng.randint(1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = stock_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    tokens = probe[:, 1:].flatten().tolist()
    if rng.random() < 0.6:  # tokens the model does produce: rows end at different steps
        kw["eos_token_id"] = rng.sample(tokens, rng.randint(1, 3))
    if rng.random() < 0.3:
        kw["pad_token_id"] = rng.choice([0, 3, 1])
    if rng.random() < 0.3:
        kw["min_new_tokens"] = rng.randint(1, 10)
    if rng.random() < 0.3:
        kw["min_length"] = rng.randint(1, 12)
    if rng.random() < 0.2:  # HF's own loop over the paged forward; floats checked by the oracle
        kw.update(return_dict_in_generate=True, output_scores=True, output_logits=rng.random() < 0.5)
    dec_len = 0
    # (not UMT5: transformers 5.17's UMT5 decoder self-attention lacks is_causal, so stock HF attends
    # to later tokens of a multi-token decoder prompt; the paged path is causal, like HF 5.24. Not
    # with beams' dict outputs: the oracle's fp64 sequences_scores take one start token.)
    umt5 = type(stock_model).__name__ == "UMT5ForConditionalGeneration"
    if rng.random() < 0.35 and not umt5 and not (beams > 1 and kw.get("return_dict_in_generate")):
        dec_len = rng.randint(1, MAX_PROMPT)
        dec = torch.randint(2, 300, (rows, dec_len), generator=torch.Generator().manual_seed(seed))
        if rng.random() < 0.5:
            dec[:, 0] = 0
        kw["decoder_input_ids"] = dec
    if rng.random() < 0.5:
        kw["max_new_tokens"] = rng.randint(1, MAX_NEW)
    else:
        kw["max_length"] = rng.randint(2, MAX_NEW) + dec_len + 1
    return kw


@pytest.mark.parametrize("seed", [*CI_MIX_SEEDS, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_MIX_SEEDS)])
def test_random_mix(seed, loops, one_thread):
    """MIX_CALLS random calls on one patched model of this case's family, block size and backend:
    each one stock HF's (tokens; floats within stock's fp32 error; near ties in float64), on the
    resident loops where they serve it; the pool and memory flat."""
    rng = random.Random(case_seed("random mix", seed))
    family = MIX_FAMILIES[seed % len(MIX_FAMILIES)]
    model = make_model(family, seed=case_seed("random mix", seed))
    stock_model = stock_copy(model)
    config = hp.PagedCacheConfig(block_size=rng.choice(MIX_BLOCK_SIZES), backend=MIX_BACKENDS[seed % 2],
                                 max_tokens=64)
    calls = [(0, _largest_call(family == "umt5"))]
    calls += [(case_seed("random mix", seed, i), _mixed_call(rng, stock_model, case_seed("random mix", seed, i)))
              for i in range(1, MIX_CALLS)]
    hp.patch_model(model, config)
    try:
        records = soak(model, stock_model, calls, range(len(calls)), live_tensor_bytes, loops, near_ties=True)
    finally:
        hp.unpatch_model(model)
    assert records[0].pool_blocks > config.initial_num_blocks, "premise: call 0 grew the pool"
    assert_flat(records)


# ---- GPU ------------------------------------------------------------------------------------
def warm_up_graphs(model, sizes: Sizes, block_size: int, device="cuda") -> None:
    """One short call per CUDA-graph bucket the soak can reach: rows (batch x beams) in powers of
    two, source lengths at each power of two of blocks, and both self-table widths (new tokens
    just under and at the limit)."""
    rows = sorted({1 << k for k in range(8) if (1 << k) <= sizes.max_batch * sizes.beams})
    src_lens = sorted({min(sizes.max_src, block_size * (1 << k)) for k in range(2, 6)} | {sizes.max_src})
    for n in rows:
        beams = 1 if n <= sizes.max_batch else sizes.beams
        for src_len in src_lens:
            for new in (sizes.max_new - 1, sizes.max_new):
                call = Call(n // beams, src_len, new, beams, False, False, seed=n * 1000 + src_len)
                ids, mask = call.inputs(sizes.vocab, device)
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, num_beams=beams,
                               stopping_criteria=_stop_after(2))


def _stop_after(steps: int):
    """Stop every row after `steps` generated tokens (the table width is set by max_new_tokens)."""
    from transformers.generation import StoppingCriteria, StoppingCriteriaList

    class Stop(StoppingCriteria):
        def __init__(self):
            self.start = None

        def __call__(self, input_ids, scores, **kwargs):
            self.start = input_ids.shape[1] if self.start is None else self.start
            done = input_ids.shape[1] - self.start + 1 >= steps
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Stop()])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_soak_gpu():
    sizes = Sizes(max_batch=16, min_src=5, max_src=300, max_new=64, beams=4, vocab=32128)
    # fp32 at the t5-small layout, init factor 1.5: well conditioned (HF fp32 vs fp64 ~6e-6), so
    # stock HF and the kernels pick the same tokens; see tests/test_device_map.py.
    model = tiny.build_model("t5-small", vocab_size=sizes.vocab, initializer_factor=1.5, device="cuda")
    stock_model = stock_copy(model)
    config = hp.PagedCacheConfig()
    hp.patch_model(model, config)
    start = time.perf_counter()
    warm_up_graphs(model, sizes, config.block_size)
    warm = time.perf_counter() - start

    def measure() -> int:
        torch.cuda.synchronize()
        # an allocation makes the caching allocator process the frees it deferred for tensors used on
        # another stream (generate() records its outputs on the generation stream): without it, those
        # blocks count as allocated until some later call's allocation, a drift of a few KiB either way
        torch.empty(1, device="cuda")
        return torch.cuda.memory_allocated()

    calls = ((call.seed, call.kwargs(sizes.vocab, "cuda")) for call in random_calls(1000, sizes, seed=11))
    checked = checked_calls(1000, 30, seed=12)
    records = soak(model, stock_model, calls, checked, measure)
    elapsed = time.perf_counter() - start
    late = [i for i in range(FLAT_FROM, len(records)) if records[i].graphs != records[i - 1].graphs]
    first, last = records[FLAT_FROM - 1], records[-1]
    print(f"\nsoak: warm-up {warm:.1f} s, total {elapsed:.1f} s; memory {first.memory / 2**20:.1f} -> "
          f"{last.memory / 2**20:.1f} MiB; pool {last.pool_blocks} blocks; graphs {last.graphs} "
          f"(captured during the soak after call {FLAT_FROM}: {late})")
    assert_flat(records)
