"""The drop-in contract on the GPU: Triton kernels, GEMV projections and CUDA graphs, fp32, vs stock HF.

The CPU contract tests (test_contract_*.py) run the torch backend; here the same oracle
(tests/oracle.py) checks the Triton path: every family and search mode with scores and logits,
the mT5 output scale at an mt5-base layout, a mask with a hole, a hooked projection (which the
GEMV kernel must not bypass), a hook on a block after the graphs were captured, and autocast.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, make_model
from oracle import case_seed, compare_with_stock, stock_copy
from transformers import MT5Config, MT5ForConditionalGeneration

import hf_paged_t5 as hp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = hp.PagedCacheConfig(block_size=16)
MODES = {
    "greedy": {},
    "beam": dict(num_beams=4, num_return_sequences=2, length_penalty=0.8),
    "sample": dict(do_sample=True, top_k=20),
}
OUTPUTS = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)


def _cuda_case(family, *parts, lengths=(19, 7, 33)):
    seed = case_seed("gpu", family, *parts)
    model = make_model(family, seed=seed, device="cuda")
    ids, mask = make_batch(list(lengths), padding_side="left" if seed % 2 else "right", seed=seed, device="cuda")
    return seed, model, dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["t5", "t5v1_1", "mt5", "umt5"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("return_dict", [True, False])
def test_gpu_matches_stock(family, mode, return_dict):
    seed, model, inputs = _cuda_case(family, mode, return_dict)
    kw = dict(**inputs, max_new_tokens=12, **MODES[mode], **(OUTPUTS if return_dict else {}))
    compare_with_stock(model, GPU, seed=seed, **kw)  # with return_dict: scores and logits too


def test_gpu_mt5_base_layout_beam_scores():
    """mt5-base's layout (d_model 768, 12 heads, gated-gelu, 250k vocab cut to 32k): beam search
    scores are stock's (a d_model ** -0.5 scale on the logits changed them)."""
    config = MT5Config(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=2, num_decoder_layers=2,
                       vocab_size=32128, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                       pad_token_id=0, eos_token_id=1)
    with torch.device("cuda"):
        torch.manual_seed(case_seed("mt5-base"))
        model = MT5ForConditionalGeneration(config).eval()
    ids, mask = make_batch([40, 23], seed=3, vocab=32000, device="cuda")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=4, **OUTPUTS)
    compare_with_stock(model, GPU, **kw)


def test_gpu_mask_with_a_hole():
    seed, model, inputs = _cuda_case("t5", "hole")
    inputs["attention_mask"][0, 4:9] = 0
    kw = dict(**inputs, max_new_tokens=10, **OUTPUTS)
    compare_with_stock(model, GPU, seed=seed, **kw)


def test_gpu_hooked_projection_is_not_bypassed():
    seed, model, inputs = _cuda_case("t5v1_1", "hook")
    model.decoder.block[1].layer[0].SelfAttention.q.register_forward_hook(lambda m, a, out: out * 1.25)
    model.lm_head.register_forward_hook(lambda m, a, out: out - 0.5)
    kw = dict(**inputs, max_new_tokens=10, **OUTPUTS)
    compare_with_stock(model, GPU, seed=seed, **kw)


def test_gpu_bias_weight_edited_through_data_after_capture():
    """After a call captured its decode graphs, a `.data` write to a bias weight (no version bump)
    reaches the next call: its tables are rebuilt and its graphs recaptured."""
    seed, model, inputs = _cuda_case("t5", "bias edit")
    kw = dict(**inputs, max_new_tokens=10, **OUTPUTS)
    hp.patch_model(model, GPU).generate(**kw)
    for stack in (model.encoder, model.decoder):
        weight = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        weight.data.copy_(torch.randn_like(weight) * 2)
    compare_with_stock(model, **kw)  # patched: stock HF on an unpatched copy of the edited weights


def test_gpu_hook_on_a_block_after_capture_runs_on_stock():
    """A forward hook on a decoder block (a module the fused layer never calls) added after the
    first call captured its decode graphs: the next call runs on stock HF, the hook runs each
    step, the tokens are stock's; with the hook gone, the call is paged again."""
    seed, model, inputs = _cuda_case("t5", "block hook")
    kw = dict(**inputs, max_new_tokens=10)
    hp.patch_model(model, GPU).generate(**kw)
    runs = []
    handle = model.decoder.block[1].register_forward_hook(lambda *_: runs.append(1))
    try:
        compare_with_stock(model, expect_paged=None, seed=seed, **kw)
    finally:
        handle.remove()
    assert len(runs) >= 2 * 10  # stock's loop and the patched call's, each once a step
    compare_with_stock(model, seed=seed, **kw)


def test_gpu_generate_inside_autocast_runs_on_stock():
    """torch.autocast over a float32 model on the GPU: stock HF's result (the Triton attention would
    get a bfloat16 query against the float32 pool), paged again outside it."""
    seed, model, inputs = _cuda_case("t5", "autocast")
    kw = dict(**inputs, max_new_tokens=10, num_beams=2)
    stock = stock_copy(model)
    hp.patch_model(model, GPU)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(model.generate(**kw), stock.generate(**kw))
    assert model._hf_paged_t5.pool is None
    compare_with_stock(model, stock_model=stock, seed=seed, **kw)  # outside it: paged
