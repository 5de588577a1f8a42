"""Soak: many patched generate() calls of random sizes on one model; no drift, no leak, HF's tokens.

Each call draws a batch size, a source length (rows padded left or right to random lengths), a
number of new tokens, greedy / beam search / seeded sampling. After every call the test records
the pool (idle? size? free blocks?) and the memory in use, and a sample of calls is repeated on
an unpatched copy of the model in fp32, which must give the same tokens.

Flat means: the pool is idle after every call, its size and free count do not change from the
10th call on, and memory in use does not change from the 10th call on except when the call
captured a new CUDA graph (a new batch / table-width bucket; the captured graph keeps its static
buffers). A warm-up pass captures every bucket the soak's sizes can reach first, so normally no
capture happens during the soak at all.

- GPU (`-m gpu`, also `slow`): 1,000 calls, t5-small layout, Triton kernels and CUDA graphs,
  `torch.cuda.memory_allocated()`.
- CPU: 60 calls on a small model, torch backend, bytes of live tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import random
import time

import pytest
import torch
from conftest import make_model

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

    def kwargs(self) -> dict:
        kw = dict(max_new_tokens=self.new_tokens, num_beams=self.num_beams, do_sample=self.do_sample)
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


def run(model, call: Call, vocab: int, device) -> torch.Tensor:
    ids, mask = call.inputs(vocab, device)
    torch.manual_seed(call.seed)  # sampling: the same draws for HF and for the paged run
    return model.generate(input_ids=ids, attention_mask=mask, **call.kwargs()).cpu()


@dataclasses.dataclass
class Record:
    memory: int
    graphs: int
    pool_blocks: int
    free_blocks: int
    idle: bool


def pool_record(model, memory: int) -> Record:
    runtime = model._hf_paged_t5
    pool = runtime.pool
    assert pool is not None, "the paged path did not run"
    # every graph captured and kept so far (decode steps, and small batches' kept updates, which
    # replace one another within a bound): memory may change only when this count does
    graphs = getattr(getattr(runtime, "graphs", None), "captures", 0)
    return Record(memory, graphs, pool.num_blocks, pool.manager.num_free, pool.is_idle())


def soak(model, ref_model, calls: list[Call], checked: set[int], vocab: int, device, measure) -> list[Record]:
    """Run every call on the patched `model`; compare the `checked` ones with `ref_model` (stock HF)."""
    records, mismatches = [], []
    for i, call in enumerate(calls):
        out = run(model, call, vocab, device)
        if i in checked and not torch.equal(run(ref_model, call, vocab, device), out):
            mismatches.append((i, call))
        del out  # measured memory must not include this call's output
        records.append(pool_record(model, measure()))
    assert not mismatches, f"patched tokens differ from stock HF in calls {mismatches}"
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


# ---- CPU ------------------------------------------------------------------------------------
def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage counted once)."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":  # type(): no __class__ lookups
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_soak_cpu():
    sizes = Sizes(max_batch=6, min_src=3, max_src=40, max_new=16, beams=3, vocab=384)
    model = make_model("t5", seed=31)
    ref_model = copy.deepcopy(model)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, backend="torch", max_tokens=64))
    calls = random_calls(60, sizes, seed=7)
    checked = checked_calls(60, 12, seed=8)
    records = soak(model, ref_model, calls, checked, sizes.vocab, "cpu", live_tensor_bytes)
    assert records[0].pool_blocks > 8, "premise: call 0 grew the 8-block pool"
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
    ref_model = copy.deepcopy(model)
    config = hp.PagedCacheConfig()
    hp.patch_model(model, config)
    start = time.perf_counter()
    warm_up_graphs(model, sizes, config.block_size)
    warm = time.perf_counter() - start

    def measure() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    calls = random_calls(1000, sizes, seed=11)
    checked = checked_calls(1000, 30, seed=12)
    records = soak(model, ref_model, calls, checked, sizes.vocab, "cuda", measure)
    elapsed = time.perf_counter() - start
    late = [i for i in range(FLAT_FROM, len(records)) if records[i].graphs != records[i - 1].graphs]
    first, last = records[FLAT_FROM - 1], records[-1]
    print(f"\nsoak: warm-up {warm:.1f} s, total {elapsed:.1f} s; memory {first.memory / 2**20:.1f} -> "
          f"{last.memory / 2**20:.1f} MiB; pool {last.pool_blocks} blocks; graphs {last.graphs} "
          f"(captured during the soak after call {FLAT_FROM}: {late})")
    assert_flat(records)
