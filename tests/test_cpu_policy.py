"""The CPU policy of the default backend: calls the paged path cannot make faster on a CPU run on
stock HF, with one logged reason, and give stock's exact result (`hf.policy.cpu_stock_reason`).

From d_model 512 on, an unpadded call without beam search does the same matrix products on both
paths (see docs/performance.md, "CPU"), so `backend="auto"` runs it on stock HF; padded batches
(the encoder skips the padding) and beam search (beams share their source's cross K/V) stay
paged, as does everything at smaller widths, on a GPU, or with `backend="cpu"` asked for.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import make_batch, make_model
from oracle import compare_with_stock
from transformers import T5EncoderModel

import hf_paged_t5 as hp
from hf_paged_t5.hf import forward as forward_mod
from hf_paged_t5.hf.policy import CPU_STOCK_FROM_D_MODEL, cpu_stock_reason

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def wide_model(seed: int = 0):
    """A model at the width the rule starts from: one layer each side, a small vocabulary."""
    return make_model("t5", seed=seed, d_model=CPU_STOCK_FROM_D_MODEL, d_ff=256, d_kv=64, num_heads=8,
                      num_layers=1, num_decoder_layers=1)


def test_the_rule():
    d = CPU_STOCK_FROM_D_MODEL
    assert cpu_stock_reason("auto", {CPU}, d, 1, padded=False) is not None
    assert "backend='cpu'" in cpu_stock_reason("auto", {CPU}, d, 1, padded=False)
    assert cpu_stock_reason("cpu", {CPU}, d, 1, padded=False) is None  # asked for: served
    assert cpu_stock_reason("torch", {CPU}, d, 1, padded=False) is None
    assert cpu_stock_reason("auto", {CPU}, d - 1, 1, padded=False) is None  # overhead-bound: faster paged
    assert cpu_stock_reason("auto", {CPU}, d, 4, padded=False) is None  # beams share cross K/V
    assert cpu_stock_reason("auto", {CPU}, d, 1, padded=True) is None  # the encoder skips padding
    assert cpu_stock_reason("auto", {CPU, CUDA}, d, 1, padded=False) is None  # a device_map split
    assert cpu_stock_reason("auto", {CUDA}, d, 1, padded=False) is None


@pytest.mark.parametrize("mode", ["greedy", "sampling", "dict"])
def test_unpadded_calls_without_beams_run_stock_hf_exactly(mode, caplog):
    model = wide_model(seed=1)
    stock = copy.deepcopy(model)
    hp.patch_model(model)
    ids, mask = make_batch([7, 7], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    if mode == "sampling":
        kw.update(do_sample=True, top_k=20)
    if mode == "dict":
        kw.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        for _ in range(2):
            torch.manual_seed(3)
            want = stock.generate(**kw)
            torch.manual_seed(3)
            got = model.generate(**kw)
            if mode == "dict":
                assert torch.equal(want.sequences, got.sequences)
                for a, b in zip(want.scores + want.logits, got.scores + got.logits):
                    assert torch.equal(a, b)  # stock's own computation, bit for bit
            else:
                assert torch.equal(want, got)
    assert model._hf_paged_t5.pool is None, "the calls ran on stock HF"
    logged = [r for r in caplog.records if "d_model" in r.getMessage()]
    assert len(logged) == 1 and "on stock HF" in logged[0].getMessage()


@pytest.mark.parametrize("case", ["beams", "padded", "backend cpu"])
def test_calls_the_paged_path_gains_on_stay_paged(case):
    model = wide_model(seed=4)
    lengths = [7, 4] if case == "padded" else [7, 7]
    ids, mask = make_batch(lengths, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    if case == "beams":
        kw.update(num_beams=3)
    config = hp.PagedCacheConfig(backend="cpu" if case == "backend cpu" else "auto")
    compare_with_stock(model, config=config, expect_paged=True, **kw)


def test_small_models_stay_paged():
    model = make_model("t5", seed=6)  # d_model 64
    assert model.config.d_model < CPU_STOCK_FROM_D_MODEL
    ids, mask = make_batch([5, 5], seed=7)
    compare_with_stock(model, config=hp.PagedCacheConfig(), expect_paged=True, input_ids=ids, attention_mask=mask,
                       max_new_tokens=5)


def test_encoder_model(monkeypatch):
    """T5EncoderModel at the rule's width: an unpadded batch on stock HF (exactly), a padded one paged."""
    seq2seq = wide_model(seed=8)
    encoder = T5EncoderModel(seq2seq.config).eval()
    encoder.load_state_dict(seq2seq.state_dict(), strict=False)
    stock = copy.deepcopy(encoder)
    hp.patch_model(encoder)
    paged_calls = []
    real = forward_mod.encoder_forward
    monkeypatch.setattr(forward_mod, "encoder_forward", lambda *a, **k: paged_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        ids, mask = make_batch([6, 6], seed=9)
        assert torch.equal(stock(input_ids=ids, attention_mask=mask).last_hidden_state,
                           encoder(input_ids=ids, attention_mask=mask).last_hidden_state)
        assert torch.equal(stock(input_ids=ids).last_hidden_state, encoder(input_ids=ids).last_hidden_state)
        assert not paged_calls
        ids, mask = make_batch([6, 3], seed=10)
        want = stock(input_ids=ids, attention_mask=mask).last_hidden_state
        got = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        assert paged_calls == [1]
        rows = mask.bool()
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-4, atol=1e-5)
