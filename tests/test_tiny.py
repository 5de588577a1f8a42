"""The offline demo assets: tokenizer, random-weight models, saved checkpoints."""

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_paged_t5 import tiny

TEXTS = [
    "The city council voted to build a new bridge.",
    "Heavy rain is expected tonight in the north.",
    "A young fox ran across the field.",
    "Prices of fruit rose after the dry summer.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


def test_tokenizer_special_ids_and_eos(tokenizer):
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("summarize: the weather is nice").input_ids
    assert ids[-1] == 1 and ids.count(1) == 1
    assert tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁")


@pytest.mark.parametrize("text", TEXTS + ["Über den Fluss, café au lait: 42 %!", "  extra   spaces\nand lines "])
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == " ".join(text.split())


def test_tokenizer_is_deterministic(tokenizer):
    again = tiny.build_tokenizer()
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_batch_pads_with_zero(tokenizer):
    batch = tokenizer(TEXTS[:2] + ["Hi."], padding=True, return_tensors="pt")
    assert batch.input_ids[2, -1] == 0 and batch.attention_mask[2, -1] == 0
    assert batch.input_ids.shape == batch.attention_mask.shape


def test_custom_texts_and_vocab_size():
    tok = tiny.build_tokenizer(["one two three four", "three four five six"], vocab_size=150)
    assert len(tok) <= 150
    assert "▁four" in tok.get_vocab()
    assert tok.decode(tok("four five").input_ids, skip_special_tokens=True) == "four five"


def test_shapes_are_real_t5_shapes():
    small = tiny.SHAPES["t5-small"]
    assert (small["d_model"], small["d_ff"], small["d_kv"], small["num_heads"], small["num_layers"]) == (
        512, 2048, 64, 8, 6,
    )
    assert tiny.SHAPES["flan-t5-xl"]["feed_forward_proj"] == "gated-gelu"
    assert not tiny.SHAPES["flan-t5-xl"]["tie_word_embeddings"]
    assert tiny.SHAPES["t5-large"]["num_decoder_layers"] == 24
    with pytest.raises(TypeError):
        tiny.SHAPES["tiny"]["d_model"] = 1


def test_config_of_real_shape_without_building():
    config = tiny.build_config("t5-base", "mt5")
    assert (config.d_model, config.num_heads, config.num_layers) == (768, 12, 12)
    assert config.is_gated_act
    with pytest.raises(ValueError, match="unknown shape"):
        tiny.build_config("t5-huge")
    with pytest.raises(ValueError, match="unknown family"):
        tiny.build_config(family="bart")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_each_family_builds_and_generates_varied_tokens(tokenizer, family):
    model = tiny.build_model(family=family)
    assert type(model).__name__.lower().startswith(family.replace("v1_1", ""))
    assert not model.training
    assert model.config.decoder_start_token_id == 0 and model.config.eos_token_id == 1
    assert model.config.is_gated_act == (family != "t5")
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == len(TEXTS) and (out[:, 0] == 0).all()
    # Random weights are scaled so that different inputs decode to different tokens.
    assert len({tuple(row.tolist()) for row in out}) == len(TEXTS)
    assert len(set(out[:, 1:].flatten().tolist())) > 8


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = tiny.build_model(seed=7)
    assert torch.equal(torch.rand(3), expected)
    second = tiny.build_model(seed=7)
    third = tiny.build_model(seed=8)
    assert torch.equal(first.shared.weight, second.shared.weight)
    assert not torch.equal(first.shared.weight, third.shared.weight)


def test_build_model_dtype_and_overrides():
    model = tiny.build_model(dtype=torch.bfloat16, num_layers=1, num_decoder_layers=3, vocab_size=600)
    assert model.dtype == torch.bfloat16
    assert len(model.encoder.block) == 1 and len(model.decoder.block) == 3
    assert model.config.vocab_size == 600


def test_t5_family_carries_task_prefixes():
    params = tiny.build_model().config.task_specific_params
    assert params["summarization"]["prefix"] == "summarize: "
    assert params["translation_en_to_de"]["prefix"] == "translate English to German: "
    assert tiny.build_model(task_specific_params=None).config.task_specific_params is None


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_save_demo_checkpoint_reloads_offline(tmp_path, monkeypatch, tokenizer, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny.save_demo_checkpoint(tmp_path / "demo", family=family)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    assert type(model) is type(tiny.build_model(family=family))
    assert tok(TEXTS).input_ids == tokenizer(TEXTS).input_ids
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    expected = tiny.build_model(family=family).generate(**batch, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=6, do_sample=False), expected)
