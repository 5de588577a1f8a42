"""The drop-in contract of generate(): stock HF's answer, in fp32, for every supported family.

Tokens equal, scores and logits within stock's own fp32 error against fp64 (tests/oracle.py), for
greedy, beam, sampling, beam sampling and num_return_sequences, with and without
return_dict_in_generate, padding on either side, masks with holes and rows without a real token.
Every case has its own seed (weights, inputs and sampling), so no tie hides a wrong scale.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import FAMILIES, make_batch, make_model
from oracle import BACKENDS, case_seed, compare_with_stock

from hf_paged_t5.model.probe import output_scale

MODES = {
    "greedy": {},
    "beam": dict(num_beams=3, num_return_sequences=2, length_penalty=0.8),
    "sample": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=0),
    "sample_nrs": dict(do_sample=True, num_return_sequences=3, top_p=0.9),
}
CONTRACT_FAMILIES = ["t5", "t5v1_1", "mt5", "umt5"]
OUTPUTS = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)


def _case(family, *parts, lengths=(9, 4, 13)):
    seed = case_seed(family, *parts)
    model = make_model(family, seed=seed)
    side = "left" if seed % 2 else "right"
    ids, mask = make_batch(list(lengths), padding_side=side, seed=seed)
    return seed, model, dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", CONTRACT_FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_scores_and_logits_match_stock(family, mode, backend):
    seed, model, inputs = _case(family, mode, "dict")
    kw = dict(**inputs, max_new_tokens=7, **MODES[mode], **OUTPUTS)
    compare_with_stock(model, BACKENDS[backend], seed=seed, float64=True, **kw)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("family", CONTRACT_FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_tokens_match_stock(family, mode, backend):
    """The device-resident and lean loops (no return_dict_in_generate)."""
    seed, model, inputs = _case(family, mode, "tokens")
    compare_with_stock(model, BACKENDS[backend], seed=seed, float64=True, **inputs, max_new_tokens=9, **MODES[mode])


@pytest.mark.parametrize("family", CONTRACT_FAMILIES)
@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_mask_with_a_hole(family, mode, caplog):
    """Zeros between a row's ones: HF keeps the later tokens at their original distances."""
    seed, model, inputs = _case(family, mode, "hole", lengths=(12, 12, 8))
    mask = inputs["attention_mask"].clone()
    real = mask[0].nonzero().squeeze(1)
    mask[0, real[3:6]] = 0
    kw = dict(input_ids=inputs["input_ids"], attention_mask=mask, max_new_tokens=7, **MODES[mode], **OUTPUTS)
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        compare_with_stock(model, seed=seed, float64=True, **kw)
    assert [r.getMessage() for r in caplog.records if "hole" in r.getMessage()], "the fallback is logged"


@pytest.mark.parametrize("family", CONTRACT_FAMILIES)
def test_row_without_real_tokens(family, caplog):
    """An all-zero mask row: stock HF's finite result, the other rows unaffected, one logged reason."""
    seed, model, inputs = _case(family, "empty row")
    inputs["attention_mask"][1] = 0
    kw = dict(**inputs, max_new_tokens=6, **OUTPUTS)
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        _, paged = compare_with_stock(model, seed=seed, expect_paged=False, **kw)  # floats bit for bit
    assert all(torch.isfinite(b).all() for b in paged.logits)
    reasons = [r.getMessage() for r in caplog.records if r.name.startswith("hf_paged_t5")]
    assert len(reasons) == 1 and "no real token" in reasons[0], reasons


def test_every_family_is_covered():
    """The contract runs on every family the tests can build (a new one must be added above)."""
    assert set(CONTRACT_FAMILIES) <= set(FAMILIES)
    assert {"mt5", "umt5", "t5", "t5v1_1"} == set(CONTRACT_FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", CONTRACT_FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sweep", range(8))
def test_scores_and_logits_seed_sweep(family, mode, sweep):
    """More seeds. In float32 a random-weight model can put two tokens within rounding of each
    other, where stock fp32 itself picks another token than fp64: such a call is compared in
    float64 only (float32 tokens are compared where stock fp32 agrees with fp64)."""
    seed, model, inputs = _case(family, mode, "sweep", sweep)
    compare_with_stock(model, seed=seed, float64=True, near_ties=True, **inputs, max_new_tokens=7, **MODES[mode],
                       **OUTPUTS)


def test_beam_tie_oracle_tells_equal_hypotheses_from_worse_ones():
    """`oracle.beam_hypotheses_tie` takes a row whose hypothesis scores what stock's does (in fp64,
    within stock's own fp32 error), and not one that scores worse."""
    from oracle import beam_hypotheses_tie

    seed, model, inputs = _case("umt5", "beam", "sweep", 1)
    _without_output_scale(model)
    kw = dict(**inputs, max_new_tokens=7, **MODES["beam"], **OUTPUTS)
    stock = model.generate(**kw)
    # two hypotheses of that source at -13.8375 in fp64, which fp32 rounds to one score: which one
    # stock keeps follows the CPU's rounding (seen both ways), the other is the tie
    ties = ([0, 0, 0, 0, 0, 0, 0, 106], [0, 0, 0, 0, 106, 358, 0, 72])
    row = stock.sequences[5].tolist()
    assert row in ties

    def with_row(tokens):
        other = copy.copy(stock)
        other.sequences = stock.sequences.clone()
        other.sequences[5] = torch.tensor(tokens)
        return other

    assert beam_hypotheses_tie(model, stock, with_row(ties[1 - ties.index(row)]), kw)
    assert not beam_hypotheses_tie(model, stock, with_row([0, 0, 0, 0, 106, 358, 0, 73]), kw)
    assert not beam_hypotheses_tie(model, stock, with_row([0, 5, 0, 0, 0, 0, 0, 106]), kw)


@torch.no_grad()
def _without_output_scale(model) -> None:
    """Undo the d_model**-0.5 rescaling before the lm_head where this transformers version's class
    applies it (UMT5 built with tie_word_embeddings=False: transformers before 5.24 rescales, 5.24
    on does not), by scaling the decoder's final norm (logits are linear in it; at d_model 64 the factor is
    8, a power of two, so the logits are the unscaled class's bits): the saturated softmax, and with
    it the tie below, on every version."""
    scale = output_scale(model)  # None or d_model ** -0.5
    if scale is not None:
        model.decoder.final_layer_norm.weight.div_(scale)


def test_the_oracle_holds_masks_to_stocks():
    """`oracle.assert_within_stock_error` wants paged's masked (infinite) scores where stock's are;
    an entry the fp64 reference masks otherwise (its own top-k at a near tie) is left out."""
    from oracle import assert_within_stock_error

    ninf = float("-inf")
    stock = torch.tensor([[0.5, -1.0, ninf, -2.0]])
    ref = torch.tensor([[0.5, -1.0, ninf, ninf]], dtype=torch.float64)
    assert_within_stock_error(stock.clone(), stock, ref, "scores")
    with pytest.raises(AssertionError, match="masked"):
        assert_within_stock_error(torch.tensor([[0.5, ninf, ninf, -2.0]]), stock, ref, "scores")
    with pytest.raises(AssertionError, match="deviation"):
        assert_within_stock_error(torch.tensor([[0.5, -1.5, ninf, -2.0]]), stock, ref, "scores")
