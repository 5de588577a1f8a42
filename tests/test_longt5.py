"""LongT5 (both encoder attention types): its encoder stays stock HF, its decoder (T5's) is paged.

HF's tokens and, within stock's own fp32 error, its scores (`oracle.compare_with_stock`, which
checks the call ran on the pool) for greedy, beam search and seeded sampling over padded batches.
"""

from __future__ import annotations

import logging

import pytest
import torch
from oracle import compare_with_stock
from transformers import LongT5Config, LongT5EncoderModel, LongT5ForConditionalGeneration

import hf_paged_t5 as hp
from hf_paged_t5 import tiny

ATTENTION = ["local", "transient-global"]


def longt5(attention: str, seed: int = 0) -> LongT5ForConditionalGeneration:
    config = LongT5Config(vocab_size=320, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                          num_heads=4, encoder_attention_type=attention, local_radius=3, global_block_size=4,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                          initializer_factor=tiny.INIT_FACTOR)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LongT5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        tiny._calibrate_logits(model, tiny.LOGIT_STD)  # input-dependent tokens, as tiny.build_model's
    return model


def batch(lengths=(23, 9, 17), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 320, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("opts", [dict(), dict(num_beams=4, num_return_sequences=2), dict(do_sample=True, top_k=20),
                                  dict(num_beams=3, return_dict_in_generate=True, output_scores=True)],
                         ids=["greedy", "beams", "sample", "beam-scores"])
def test_tokens_and_scores_equal_stock(attention, opts, caplog):
    model = longt5(attention)
    ids, mask = batch()
    with caplog.at_level(logging.INFO, logger="hf_paged_t5.hf.patch"):
        hp.patch_model(model, hp.PagedCacheConfig(block_size=4))
    assert any("LongT5's encoder" in m for m in caplog.messages)
    assert "forward" not in model.encoder.__dict__  # the encoder is stock HF's
    _, out = compare_with_stock(model, seed=0, input_ids=ids, attention_mask=mask, max_new_tokens=12, **opts)
    tokens = out if isinstance(out, torch.Tensor) else out.sequences
    assert len(set(tokens[:, 1:].flatten().tolist())) > 3  # not one repeated token: the comparison can fail
    hp.unpatch_model(model)


def test_batch_generator_and_encoder_model_refused():
    model = hp.patch_model(longt5("local"))
    with pytest.raises(TypeError, match="BatchGenerator runs the paged encoder.*use model.generate"):
        hp.BatchGenerator(model)
    encoder = LongT5EncoderModel(model.config)
    with pytest.raises(TypeError, match="hf_paged_t5 supports"):
        hp.patch_model(encoder)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("opts", [dict(), dict(num_beams=4, num_return_sequences=2)], ids=["greedy", "beams"])
def test_on_the_gpu(attention, opts):
    """The decoder on the Triton kernels and CUDA graphs, fp32: stock HF's tokens and scores."""
    model = hp.patch_model(longt5(attention).cuda())
    ids, mask = batch()
    _, out = compare_with_stock(model, seed=0, input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                                **opts)
    assert len(set(out[:, 1:].flatten().tolist())) > 3
