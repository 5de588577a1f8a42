"""The offline demo: `python -m hf_paged_t5 demo` on the embedded model and on a saved checkpoint (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_paged_t5 import demo, tiny
from hf_paged_t5.__main__ import build_parser, main

FEW_TOKENS = ["--max-new-tokens", "6", "--repeats", "1"]


def _report_lines(out: str) -> dict[str, str]:
    return {line.split(":", 1)[0].strip(): line for line in out.splitlines() if ":" in line}


def _assert_full_agreement(out: str, num_texts: int) -> None:
    lines = _report_lines(out)
    assert "(100.0%)" in lines["token agreement"], out
    assert f"{num_texts}/{num_texts} sequences identical" in lines["token agreement"], out
    assert sum(line.lstrip().startswith("HF = paged:") for line in out.splitlines()) == num_texts, out
    assert "speedup" in lines and "fell back" not in out, out


def test_demo_embedded_default_matches_hf(capsys):
    assert main(["demo", *FEW_TOKENS]) == 0
    out = capsys.readouterr().out
    assert "embedded random-weight T5" in out
    _assert_full_agreement(out, len(demo.DEFAULT_TEXTS))
    for i, text in enumerate(demo.DEFAULT_TEXTS):
        assert f"[{i}] input: {text[:40]}" in out


def test_demo_beam_search_and_own_texts(capsys):
    texts = ["A short one.", "A somewhat longer input text, so that the batch is padded."]
    assert main(["demo", *FEW_TOKENS, "--num-beams", "3", "--texts", *texts]) == 0
    out = capsys.readouterr().out
    assert "beam search (3 beams)" in out
    _assert_full_agreement(out, len(texts))


def test_demo_loads_a_checkpoint_directory(tmp_path, capsys):
    path = tiny.save_demo_checkpoint(tmp_path / "ckpt")
    assert main(["demo", "--model", path, *FEW_TOKENS]) == 0
    out = capsys.readouterr().out
    assert f"model:   {path}" in out
    _assert_full_agreement(out, len(demo.DEFAULT_TEXTS))


def test_run_demo_result_and_model_left_unpatched():
    model, tokenizer, _ = demo.load_model()
    result = demo.run_demo(model, tokenizer, max_new_tokens=5, repeats=1)
    assert result.paged_ran and result.backend == "torch"
    assert result.agreement.fraction == 1.0 and result.agreement.compared_tokens > 0
    assert result.hf.texts == result.paged.texts and len(result.hf.texts) == len(demo.DEFAULT_TEXTS)
    assert result.hf.ms_per_token > 0 and result.paged.ms_per_token > 0
    assert not hasattr(model, "_hf_paged_t5")


def test_token_agreement_counts_up_to_eos():
    ref = torch.tensor([[0, 5, 6, 1, 0], [0, 7, 8, 9, 1]])
    out = torch.tensor([[0, 5, 6, 1], [0, 7, 4, 9]])  # row 1: one token differs, no EOS within the length
    agreement = demo.token_agreement(ref, out, eos_token_id=1, pad_token_id=0)
    # row 0: 3 tokens, all equal; row 1: 4 positions (ref ends with EOS at 4), 2 equal
    assert (agreement.matching_tokens, agreement.compared_tokens) == (5, 7)
    assert (agreement.matching_sequences, agreement.num_sequences) == (1, 2)


def test_parser_rejects_unknown_commands_and_bad_options():
    parser = build_parser()
    assert parser.parse_args(["demo"]).command == "demo"
    with pytest.raises(SystemExit):
        parser.parse_args(["nope"])
    with pytest.raises(SystemExit, match="must be >= 1"):
        main(["demo", "--num-beams", "0"])


def test_demo_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the median is reported (default: 3)" in help_text, help_text
    assert "-v, --verbose" in help_text


def test_checkpoint_command_writes_a_loadable_checkpoint(tmp_path, caplog):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    path = tmp_path / "ckpt"
    with caplog.at_level(logging.INFO, logger="hf_paged_t5.demo"):
        assert main(["checkpoint", str(path)]) == 0
    assert [m for m in caplog.messages if "wrote a random-weight T5" in m and str(path) in m], caplog.messages
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path)
    assert model.config.task_specific_params["summarization"]["prefix"] == "summarize: "
    assert len(tokenizer) <= model.config.vocab_size
