"""A generate() call's rows of one source (beams, returned sequences), and a `BatchGenerator` beam
job's beams of one input, share its cross-attention keys:
the Triton backend reads them once per source (`kernels.grouped_decode`, `StepMetadata.cross_group`),
in the op-by-op step and in the fused layer. Triton kernels interpreted on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, make_model  # (conftest sets TRITON_INTERPRET=1 on a machine without CUDA)

import hf_paged_t5 as hp
from oracle import assert_within_stock_error, fp64_twin, teacher_forced_logits
from hf_paged_t5 import kernels, reference
from hf_paged_t5.model import fused_layer

# CPU models through the interpreter; on a CUDA machine tests/test_gpu_e2e.py checks the same launches
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests on CPU tensors")

# The kernel tests' tolerances (tests/test_kernels.py): relative error against the fp32 reference.
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def spy(monkeypatch):
    """Record every grouped launch: (group, rows, relative error of its output against the
    reference attention of each row over its own table and length, not its group's first row's)
    and every fused step."""
    launches, fused_steps = [], []
    real, real_layers = kernels.grouped_decode, fused_layer.decoder_layers

    def grouped(**kw):
        out = real(**kw)
        up = {name: kw[name].float() for name in ("query", "key_cache", "value_cache")}
        ref = reference.paged_decode(**up, block_table=kw["block_table"], seq_lens=kw["seq_lens"], scale=kw["scale"])
        launches.append((kw["group"], out.shape[0], float((out.float() - ref).norm() / ref.norm())))
        return out

    monkeypatch.setattr(kernels, "grouped_decode", grouped)
    monkeypatch.setattr(fused_layer, "decoder_layers", lambda *a, **k: fused_steps.append(1) or real_layers(*a, **k))
    return launches, fused_steps


@pytest.mark.parametrize("dtype,lengths,opts,fused", [
    (torch.float16, [9, 5, 12], dict(num_beams=3), False),  # op-by-op step, 9 rows
    (torch.bfloat16, [7, 5], dict(num_beams=2), True),  # the fused layer (4 rows)
    (torch.float16, [6, 11], dict(do_sample=True, num_return_sequences=2), False),  # returned sequences
])
def test_rows_of_a_source_read_its_cross_keys_once(monkeypatch, dtype, lengths, opts, fused):
    """Every decode step's cross-attention is one grouped launch per layer, its groups the call's
    rows per source; each row gets its own attention within the kernel tests' tolerance (so the
    rows of a group do share their first row's table and length); a beam search's tokens are the
    torch backend's."""
    launches, fused_steps = spy(monkeypatch)
    model = make_model("t5", dtype=dtype)
    ids, mask = make_batch(lengths)
    steps, rows_per_source = 5, max(opts.get("num_beams", 1), opts.get("num_return_sequences", 1))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, **opts)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", cuda_graphs=False))
    torch.manual_seed(3)
    out = model.generate(**kw)
    rows = len(lengths) * rows_per_source
    assert len(launches) == steps * model.config.num_decoder_layers
    assert {(group, n) for group, n, _ in launches} == {(rows_per_source, rows)}
    assert max(err for _, _, err in launches) < TOLERANCE[dtype]
    assert len(fused_steps) == (steps if fused else 0)
    if "num_beams" in opts and dtype == torch.float16:  # (the interpreter's bf16 is not the GPU's)
        hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="torch"))
        assert torch.equal(model.generate(**kw), out)


@pytest.mark.parametrize("dtype,lengths,opts", [
    (torch.float32, [8, 5], dict(num_beams=3)),
    (torch.float16, [8, 5], {}),
    (torch.float16, [8], dict(num_beams=4)),
])
def test_float32_one_row_per_source_and_one_source_keep_the_row_kernel(monkeypatch, dtype, lengths, opts):
    """float32 keeps `paged_decode` (its tokens are HF's bit for bit on the GPU's cuBLAS path, and
    it stays the kernel they were measured with); a call with one row per source has nothing to
    share; a call of one source keeps it too (its rows' repeated reads of the same keys hit L2:
    `PagedEncoderDecoderCache.cross_group`)."""
    launches, _ = spy(monkeypatch)
    model = make_model("t5", dtype=dtype)
    ids, mask = make_batch(lengths)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", cuda_graphs=False))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **opts)
    assert launches == []


# In CI: T5 sampling (1), T5 beams (3), UMT5 with 5 beams (6), T5 v1.1 beams, early_stopping="never" (7)
MIX_CI_SEEDS = (1, 3, 6, 7)
MIX_SLOW_SEEDS = [s for s in range(60) if s not in MIX_CI_SEEDS]


@pytest.mark.parametrize("seed", [*MIX_CI_SEEDS, *(pytest.param(s, marks=pytest.mark.slow) for s in MIX_SLOW_SEEDS)])
def test_random_grouped_calls_match_the_row_kernel(monkeypatch, seed):
    """Random fp16 calls of 2-3 sources (T5, T5 v1.1, UMT5 layouts; block sizes 1, 4, 16): beam
    searches of 2-5 beams with returned sequences, early stopping and length penalties, or sampling
    with 2-4 returned sequences. Every decode step is one grouped launch per layer, each row within
    the kernel tests' tolerance of the reference, and each source's sequences are those of the same
    backend with one `paged_decode` program per row (in some order: seed 45 swaps two returned
    sequences whose fp16 scores tie). Where a beam search's sequences differ (seed 9: an fp16 near
    tie taken the other way, as the torch backend's fp16 tokens differ from both in some of these
    calls: another rounding, not the grouping), each run's beam scores must be as close to the fp64
    scores of its own sequences as the row kernel's are to theirs (`assert_within_stock_error`)."""
    import random

    rng = random.Random(seed)
    launches, _ = spy(monkeypatch)
    model = make_model(rng.choice(["t5", "t5v1_1", "umt5"]), dtype=torch.float16)
    ids, mask = make_batch([rng.randint(3, 14) for _ in range(rng.randint(2, 3))])
    steps = rng.randint(1, 6)
    if rng.random() < 0.7:
        beams = rng.randint(2, 5)
        opts, rows_per_source = dict(num_beams=beams, num_return_sequences=rng.randint(1, beams),
                                     early_stopping=rng.choice([True, False, "never"]),
                                     length_penalty=rng.choice([0.5, 1.0, 2.0])), beams
    else:
        opts = dict(do_sample=True, num_return_sequences=rng.randint(2, 4), top_k=rng.choice([0, 5]))
        rows_per_source = opts["num_return_sequences"]
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, **opts)
    beam = "num_beams" in opts
    if beam:
        kw.update(return_dict_in_generate=True, output_scores=True)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=rng.choice([1, 4, 16]), backend="triton", cuda_graphs=False))
    torch.manual_seed(seed)
    out = model.generate(**kw)
    assert len(launches) == steps * model.config.num_decoder_layers
    assert {group for group, _, _ in launches} == {rows_per_source}
    assert max(err for _, _, err in launches) < TOLERANCE[torch.float16]
    monkeypatch.setattr(kernels, "grouped_supports", lambda query, group: False)
    launches.clear()
    torch.manual_seed(seed)
    rows = model.generate(**kw)
    assert launches == []
    # the same sequences per source; two of them may trade places where their fp16 scores tie
    returned = kw.get("num_return_sequences", 1)
    grouped_seqs, row_seqs = (r.sequences if beam else r for r in (out, rows))
    per_source = [[sorted(t[i : i + returned].tolist()) for i in range(0, len(t), returned)]
                  for t in (grouped_seqs, row_seqs)]
    if per_source[0] == per_source[1] or not beam:
        assert per_source[0] == per_source[1]
        return
    # a near tie taken the other way: each run's scores against the fp64 scores of its own sequences
    model64 = fp64_twin(model)
    eos = model.generation_config.eos_token_id

    def exact(sequences):  # every step masks EOS (min_new_tokens = max_new_tokens): HF's beam score
        logits = teacher_forced_logits(model64, sequences, input_ids=ids, attention_mask=mask)
        logits[..., eos] = float("-inf")
        picked = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]
        return picked.sum(-1) / steps ** opts["length_penalty"]

    row_exact = exact(row_seqs)
    # (grouped's deviation from its own sequences' fp64 scores, carried onto the row run's reference)
    assert_within_stock_error(out.sequences_scores - exact(grouped_seqs) + row_exact, rows.sequences_scores,
                              row_exact, "beam scores")


def test_a_batch_beam_job_reads_each_inputs_cross_keys_once(monkeypatch):
    """A `BatchGenerator` beam job keeps each input's beams consecutive until the input is done
    (`BatchCache.cross_group`): every decode step's cross-attention is one grouped launch per layer
    while inputs join and leave (9 rows: 3 inputs of 3 beams at most, 5 inputs of different lengths
    and limits), each row within the kernel tests' tolerance of the reference over its own table.
    Each input's sequences are those of the same job with one `paged_decode` program per row, and
    their scores as close to the fp64 scores of those sequences as the row kernel's are
    (`oracle.assert_within_stock_error`, the row kernel in stock's place)."""
    launches, _ = spy(monkeypatch)
    model = make_model("t5", dtype=torch.float16)
    model64 = fp64_twin(model)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", cuda_graphs=False))
    g = torch.Generator().manual_seed(7)
    lengths, limits = [9, 4, 13, 6, 11], [5, 2, 4, 6, 3]
    inputs = [torch.randint(2, 384, (n,), generator=g).tolist() for n in lengths]
    # every step masks EOS (min_new_tokens = max_new_tokens) and no length penalty: a returned
    # sequence's score is the sum of its tokens' log-probabilities over the rest of the vocabulary
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs, limits)]

    def job():
        gen = hp.BatchGenerator(model, max_batch_rows=9, num_beams=3, num_return_sequences=2, length_penalty=0.0)
        return list(gen.generate(requests))

    grouped = job()
    assert launches and len(launches) % model.config.num_decoder_layers == 0
    assert {group for group, _, _ in launches} == {3}
    assert {rows for _, rows, _ in launches} > {9}  # inputs joined and left between steps
    assert max(err for _, _, err in launches) < TOLERANCE[torch.float16]
    monkeypatch.setattr(kernels, "grouped_supports", lambda query, group: False)
    launches.clear()
    rows = job()
    assert launches == []
    assert [r.sequences for r in grouped] == [r.sequences for r in rows]
    exact = []
    for ids, result in zip(inputs, rows):
        sequences = torch.tensor(result.sequences)
        logits = teacher_forced_logits(model64, sequences, input_ids=torch.tensor([ids]))
        logits[..., model.generation_config.eos_token_id] = float("-inf")
        picked = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]
        exact.append(picked.sum(-1))
    assert_within_stock_error([torch.tensor(r.scores) for r in grouped], [torch.tensor(r.scores) for r in rows],
                              exact, "beam job scores")
    assert model._hf_paged_t5.pool.is_idle()


def test_a_cpu_backend_beam_job_reads_each_inputs_cross_keys_once(monkeypatch):
    """The CPU backend's beam job: every decode step's cross-attention is one `cpu_ops.grouped_decode`
    call per layer, its groups the job's beams, while inputs join and leave; on a float64 model each
    input's sequences and scores are those of the same job with the keys gathered per row."""
    from hf_paged_t5 import cpu_ops

    calls, real = [], cpu_ops.grouped_decode

    def grouped(**kw):
        calls.append((kw["group"], kw["query"].shape[0]))
        return real(**kw)

    monkeypatch.setattr(cpu_ops, "grouped_decode", grouped)
    model = make_model("t5", dtype=torch.float64)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="cpu"))
    g = torch.Generator().manual_seed(3)
    lengths, limits = [9, 4, 13, 6, 11], [5, 2, 4, 6, 3]
    requests = [hp.BatchRequest(torch.randint(2, 384, (n,), generator=g).tolist(), max_new_tokens=m, min_new_tokens=m)
                for n, m in zip(lengths, limits)]

    def job():
        gen = hp.BatchGenerator(model, max_batch_rows=9, num_beams=3, num_return_sequences=2)
        return list(gen.generate(requests))

    grouped_results = job()
    assert calls and len(calls) % model.config.num_decoder_layers == 0
    assert {group for group, _ in calls} == {3} and {rows for _, rows in calls} > {9}  # inputs joined and left
    monkeypatch.setattr(cpu_ops, "grouped_supports", lambda query, group: False)
    calls.clear()
    rows = job()
    assert calls == []
    assert [r.sequences for r in grouped_results] == [r.sequences for r in rows]
    for a, b in zip(grouped_results, rows):
        assert torch.allclose(torch.tensor(a.scores), torch.tensor(b.scores), rtol=1e-12, atol=0)
    assert model._hf_paged_t5.pool.is_idle()
