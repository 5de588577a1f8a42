"""LongT5 (both encoder attention types): the paged encoder (local windows, transient-global side
keys, varlen over the real tokens) and T5's paged decoder.

HF's tokens and, within stock's own fp32 error, its scores (`oracle.compare_with_stock`, which
checks the call ran on the pool) for greedy, beam search and seeded sampling over padded batches
whose lengths are no multiple of the block sizes: a row shorter than a global block (it attends no
side key), one over several global blocks with an orphan tail. Every case also checks that the
paged encoder ran (its attention kernel was called) and that nothing was logged as stock.

HF's LongT5 computes its softmax in float32 even in a float64 model (`scores.float()`), so an
fp64 copy is a reference to ~1e-7, not to ~1e-15: the floats are checked against stock fp32's own
distance from it (`assert_within_stock_error`), not with the fp64 exactness check.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from oracle import CPU_CONFIG, assert_within_stock_error, compare_with_stock, fp64_twin
from transformers import LongT5Config, LongT5EncoderModel, LongT5ForConditionalGeneration

import hf_paged_t5 as hp
from hf_paged_t5 import cpu_ops, reference, tiny
from hf_paged_t5.model import bias as bias_mod
from hf_paged_t5.model.longt5 import LEFT_PADDED, local_plan

ATTENTION = ["local", "transient-global"]
# local_radius 3 (windows of 4), global blocks of 4: 23 = 5 blocks + a tail of 3 (orphans), 9 = 2 + 1,
# 17 = 4 + 1, 3 < one block (no side key)
LENGTHS = (23, 9, 17, 3)

pytestmark = pytest.mark.usefixtures("one_thread_per_module")  # conftest: tiny matmuls, one thread


def config_for(attention: str, **over) -> LongT5Config:
    kw = dict(vocab_size=320, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
              encoder_attention_type=attention, local_radius=3, global_block_size=4, decoder_start_token_id=0,
              pad_token_id=0, eos_token_id=1, initializer_factor=tiny.INIT_FACTOR)
    return LongT5Config(**{**kw, **over})


def longt5(attention: str, seed: int = 0, **over) -> LongT5ForConditionalGeneration:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LongT5ForConditionalGeneration(config_for(attention, **over)).eval()
    with torch.no_grad():
        tiny._calibrate_logits(model, tiny.LOGIT_STD)  # input-dependent tokens, as tiny.build_model's
    return model


def batch(lengths=LENGTHS, seed=1, padding_side="right"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 320, (len(lengths), max(lengths)), generator=g)
    positions = torch.arange(max(lengths))[None, :]
    n = torch.tensor(lengths)[:, None]
    mask = (positions < n) if padding_side == "right" else (positions >= max(lengths) - n)
    return ids * mask, mask.long()


@pytest.fixture
def local_calls(monkeypatch):
    """Counts the paged LongT5 encoder's attention calls, on both CPU backends."""
    calls = []
    for module in (reference, cpu_ops):
        original = module.local_prefill

        def spy(*args, _original=original, **kwargs):
            calls.append(kwargs.get("side_key") is not None)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "local_prefill", spy)
    return calls


def stock_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "on stock HF" in r.getMessage()]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("opts", [dict(return_dict_in_generate=True, output_scores=True, output_logits=True),
                                  dict(num_beams=4, num_return_sequences=2), dict(do_sample=True, top_k=20),
                                  dict(num_beams=3, return_dict_in_generate=True, output_scores=True)],
                         ids=["greedy", "beams", "sample", "beam-scores"])
def test_tokens_and_scores_equal_stock(attention, opts, local_calls, caplog):
    model = longt5(attention)
    ids, mask = batch()
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="torch"))
    assert "forward" in model.encoder.__dict__  # the encoder is on the paged path
    with caplog.at_level(logging.INFO, logger="hf_paged_t5"):
        _, out = compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=12, **opts)
    assert not stock_logs(caplog), stock_logs(caplog)
    # one call per encoder layer, with side keys exactly for transient-global attention
    assert local_calls == [attention == "transient-global"] * model.config.num_layers
    tokens = out if isinstance(out, torch.Tensor) else out.sequences
    assert len(set(tokens[:, 1:].flatten().tolist())) > 3  # not one repeated token: the comparison can fail
    hp.unpatch_model(model)


@pytest.mark.parametrize("attention", ATTENTION)
def test_cpu_backend_tokens_and_scores_equal_stock(attention, local_calls):
    """The CPU backend (what `backend="auto"` runs on a CPU), greedy with scores and beam search;
    a radius past a key tile (interpreter tiles are 16) and several windows per row."""
    model = longt5(attention, seed=3, local_radius=5, global_block_size=2)
    ids, mask = batch(lengths=(29, 1, 14, 6), seed=4)
    for opts in (dict(return_dict_in_generate=True, output_scores=True, output_logits=True), dict(num_beams=3)):
        compare_with_stock(model, config=CPU_CONFIG, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                           **opts)
    assert len(local_calls) == 2 * model.config.num_layers


@pytest.mark.parametrize("attention", ATTENTION)
def test_encoder_model_matches_hf_on_real_tokens(attention, local_calls):
    """LongT5EncoderModel patched: stock's last_hidden_state at the real positions, within stock
    fp32's own error against fp64; 0 at padded positions (documented, as T5's paged encoder)."""
    torch.manual_seed(5)
    model = LongT5EncoderModel(config_for(attention, num_layers=3)).eval()
    ids, mask = batch(lengths=(31, 4, 3, 18), seed=6)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ref64 = fp64_twin(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        for config in (hp.PagedCacheConfig(backend="torch"), CPU_CONFIG):
            hp.patch_model(model, config)
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            hp.unpatch_model(model)
            real = mask.bool()
            assert_within_stock_error(out[real], ref[real], ref64[real], "last_hidden_state")
            assert (out[~real] == 0).all()
    assert len(local_calls) == 2 * 3


def test_local_attention_serves_left_padding(local_calls, caplog):
    """Local attention depends on distances between real tokens only: left padding is served."""
    model = longt5("local", seed=7)
    ids, mask = batch(seed=8, padding_side="left")
    with caplog.at_level(logging.INFO, logger="hf_paged_t5"):
        compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=2)
    assert not stock_logs(caplog) and len(local_calls) == model.config.num_layers


def test_left_padded_transient_global_runs_stock_encoder_with_one_reason(local_calls, caplog):
    """Transient-global blocks are counted from the padded tensor's first position: with left
    padding the encoder is stock HF's (bit for bit), logged once with the reason; the decoder stays paged."""
    model = longt5("transient-global", seed=9)
    ids, mask = batch(seed=10, padding_side="left")
    with caplog.at_level(logging.INFO, logger="hf_paged_t5"):
        hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="torch"))
        compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=10)
        compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=2)
        with torch.no_grad():
            out = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert stock_logs(caplog) == [f"hf_paged_t5: running the encoder on stock HF: {LEFT_PADDED}"]
    assert local_calls == []
    with torch.no_grad():
        hp.unpatch_model(model)
        assert torch.equal(out, model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_global_block_size_not_a_power_of_two_runs_stock_encoder(local_calls, caplog):
    """HF's block ids are a float cumsum of 1 / global_block_size: exact only for a power of two.
    Otherwise the encoder is stock HF's (one logged reason) and BatchGenerator refuses the model."""
    model = longt5("transient-global", seed=11, global_block_size=3)
    ids, mask = batch(seed=12)
    with caplog.at_level(logging.INFO, logger="hf_paged_t5"):
        compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=8)
    logs = stock_logs(caplog)
    assert len(logs) == 1 and "global_block_size 3 is not a power of two" in logs[0]
    assert local_calls == []
    with pytest.raises(TypeError, match="BatchGenerator runs the paged encoder.*power of two.*use model.generate"):
        hp.BatchGenerator(hp.patch_model(model))


@pytest.mark.parametrize("attention", ATTENTION)
def test_batch_generator_matches_generate_alone(attention, local_calls):
    """BatchGenerator packs inputs of several lengths into one encoder pass (right-padded rows, as
    transient-global attention needs): each result is patched generate()'s on that input alone."""
    model = hp.patch_model(longt5(attention, seed=13), hp.PagedCacheConfig(block_size=4, backend="torch"))
    g = torch.Generator().manual_seed(14)
    inputs = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (23, 3, 9, 17, 5)]
    results = list(hp.BatchGenerator(model, max_new_tokens=8).generate(inputs))
    batched = len(local_calls)
    assert batched >= model.config.num_layers
    for ids, result in zip(inputs, results):
        alone = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8)
        assert result.sequences == alone.tolist()
    assert len(local_calls) == batched + len(inputs) * model.config.num_layers


@pytest.mark.parametrize("attention", ATTENTION)
def test_bias_tables_are_hf_bias(attention):
    """The local table at j - i is HF's window bias, the side table at g - block_id HF's side bias
    (`compute_bias`, `compute_side_bias` on a row with an orphan tail)."""
    torch.manual_seed(15)
    model = LongT5EncoderModel(config_for(attention, relative_attention_num_buckets=8,
                                                  relative_attention_max_distance=6)).eval()
    attn = bias_mod.self_attention(model.encoder.block[0].layer[0])
    with torch.no_grad():
        table = bias_mod.local_bias_table(attn)  # [heads, 2 * 6 + 1]
        window = attn.compute_bias(attn.block_len)[0, 0]  # [heads, block_len, 3 * block_len]
        rel = torch.arange(3 * attn.block_len)[None, :] - attn.block_len - torch.arange(attn.block_len)[:, None]
        assert torch.equal(table[:, rel.clamp(-6, 6) + 6], window)
        if attention == "local":
            return
        side = bias_mod.side_bias_table(attn)
        n = 4 * 9 + 2  # blocks farther apart than max_distance, and two orphans
        mask = torch.ones(1, n)
        segments = torch.ones(1, n // 4, dtype=torch.int)
        hf = attn.compute_side_bias(mask, segments)[0]  # [heads, n, globals]
        block_ids = torch.minimum(torch.arange(n) // 4, torch.tensor(n // 4 - 1))
        g_rel = torch.arange(n // 4)[None, :] - block_ids[:, None]
        assert torch.equal(side[:, g_rel.clamp(-6, 6) + 6], hf)


@pytest.mark.parametrize("size", [1, 4, 16])
def test_plan_block_ids_and_sums_are_hf_global_blocks(size):
    """`local_plan`'s block ids and per-block token counts are HF's `_make_global_fixed_block_ids`
    on right-padded rows (orphan tails, a row shorter than a block, one of exact blocks), and each
    row attends exactly its blocks with global_segment_ids 1."""
    from transformers.models.longt5.modeling_longt5 import _make_global_fixed_block_ids

    model = longt5("transient-global", global_block_size=size)
    lens = [3 * size + size // 2 + 1, max(size - 1, 1), 2 * size, 1, 5 * size + size - 1]
    mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()
    ids, segments = _make_global_fixed_block_ids(mask, size)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    plan = local_plan(model.encoder, lens, cu, max(lens))
    assert plan.cu_globals.diff().tolist() == segments.sum(1).tolist()
    for b, n in enumerate(lens):
        row = ids[b, :n]
        if int(segments[b].sum()) == 0:
            assert (row == -1).all()
            continue
        assert torch.equal(plan.block_ids[cu[b]:cu[b + 1]], row)
        g0, g1 = plan.cu_globals[b].item(), plan.cu_globals[b + 1].item()
        assert plan.segment_lengths[g0:g1].tolist() == torch.bincount(row, minlength=g1 - g0).tolist()
    summed = plan.segment_tokens if plan.segment_tokens is not None else torch.arange(int(cu[-1]))
    assert summed.tolist() == [t for b, n in enumerate(lens) for t in range(cu[b], cu[b + 1]) if n >= size]


def test_bias_tables_follow_the_weights():
    """A write to the side bias weights (in place, as a fine-tune step would) rebuilds its tables."""
    model = longt5("transient-global", seed=16)
    ids, mask = batch(seed=17)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="torch"))
    compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=6)
    with torch.no_grad():
        attn = model.encoder.block[0].layer[0].TransientGlobalSelfAttention
        attn.global_relative_attention_bias.weight.mul_(-3.0)
    stock = copy.deepcopy(model)
    hp.unpatch_model(stock)
    compare_with_stock(model, seed=0, stock_model=stock, input_ids=ids, attention_mask=mask, max_new_tokens=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("opts", [dict(), dict(num_beams=4, num_return_sequences=2)], ids=["greedy", "beams"])
def test_on_the_gpu(attention, opts):
    """The encoder's Triton local kernel and the decoder on the Triton kernels and CUDA graphs,
    fp32: stock HF's tokens and scores."""
    model = hp.patch_model(longt5(attention).cuda())
    ids, mask = batch()
    _, out = compare_with_stock(model, seed=0, input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                                **opts)
    assert len(set(out[:, 1:].flatten().tolist())) > 3
