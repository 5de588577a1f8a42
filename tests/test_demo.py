"""The offline demo: `python -m hf_paged_t5 demo` on the embedded model and on a saved checkpoint (CPU)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hf_paged_t5 import agreement as agreements
from hf_paged_t5 import demo, tiny
from hf_paged_t5.__main__ import build_parser, main
from hf_paged_t5.config import PagedCacheConfig

FEW_TOKENS = ["--max-new-tokens", "6", "--repeats", "1"]


def _report_lines(out: str) -> dict[str, str]:
    return {line.split(":", 1)[0].strip(): line for line in out.splitlines() if ":" in line}


def _assert_full_agreement(out: str, num_texts: int) -> None:
    lines = _report_lines(out)
    assert "(100.0%)" in lines["token agreement"], out
    assert f"{num_texts}/{num_texts} sequences identical" in lines["token agreement"], out
    assert sum(line.lstrip().startswith("HF = paged:") for line in out.splitlines()) == num_texts, out
    assert "speedup" in lines and "fell back" not in out, out
    # the tiny shape is not chaotic: stock float32 and paged both match stock on a float64 copy
    float64 = lines["float64 check"]
    assert "stock float32 agrees on" in float64 and float64.count("(100.0%)") == 2, out
    assert "rounding" not in out, out
    assert "the package's speedup comes from the GPU path (Triton kernels + CUDA graphs)" in out, out
    assert "is its measured ratio to stock HF on this machine" in out, out


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
    assert result.paged_ran and result.backend == PagedCacheConfig().resolve_backend(torch.device("cpu"))
    assert result.agreement.fraction == 1.0 and result.agreement.compared_tokens > 0
    assert result.float64.stock.fraction == result.float64.paged.fraction == 1.0
    assert result.float64.near_ties == ()
    assert result.hf.texts == result.paged.texts and len(result.hf.texts) == len(demo.DEFAULT_TEXTS)
    assert result.hf.ms_per_token > 0 and result.paged.ms_per_token > 0
    assert not hasattr(model, "_hf_paged_t5")


def test_token_agreement_counts_up_to_eos():
    ref = torch.tensor([[0, 5, 6, 1, 0], [0, 7, 8, 9, 1]])
    out = torch.tensor([[0, 5, 6, 1], [0, 7, 4, 9]])  # row 1: one token differs, no EOS within the length
    agreement = agreements.token_agreement(ref, out, eos_token_id=1, pad_token_id=0)
    # row 0: 3 tokens, all equal; row 1: 4 positions (ref ends with EOS at 4), 2 equal
    assert (agreement.matching_tokens, agreement.compared_tokens) == (5, 7)
    assert (agreement.matching_sequences, agreement.num_sequences) == (1, 2)


def test_demo_without_float64_check_and_exit_status_on_fallback(capsys, monkeypatch):
    monkeypatch.setattr(demo, "_paged_ran", lambda model: False)  # as after a fallback to stock HF
    assert main(["demo", *FEW_TOKENS, "--no-float64-check"]) == 1
    out = capsys.readouterr().out
    assert "note: the patched generate() fell back to stock HF" in out
    assert "float64 check" not in out


def test_first_departures_per_row():
    ref = torch.tensor([[0, 5, 6, 1, 0], [0, 7, 8, 9, 1], [0, 3, 3, 3, 3]])
    out = torch.tensor([[0, 5, 6, 1], [0, 7, 4, 9], [0, 4, 3, 3]])
    assert agreements.first_departures(ref, out, eos_token_id=1, pad_token_id=0) == [None, 2, 1]


def test_float64_check_tells_a_wrong_token_from_a_near_tie():
    model, tokenizer, _ = demo.load_model()
    batch = dict(tokenizer(["A short one.", "A longer input, so the batch is padded."], return_tensors="pt",
                           padding=True))
    gen = dict(do_sample=False, num_beams=1, max_new_tokens=6)
    ref = model.generate(**batch, **gen)
    out = ref.clone()
    out[1, 3:] = (ref[1, 3:] + 7) % model.config.vocab_size  # row 1 takes a wrong turn at its third token
    check = agreements.float64_check(model, batch, gen, ref, out, eos_token_id=1, pad_token_id=0)
    assert check.stock.fraction == 1.0  # the tiny shape is not chaotic
    assert check.paged.matching_tokens == check.stock.matching_tokens - (ref.shape[1] - 3)
    assert check.near_ties == (False,)  # a token chosen at random is far from the top one
    assert agreements.float64_check(model, batch, gen, ref, ref, 1, 0).near_ties == ()
    assert agreements.float64_check(model, batch, {**gen, "num_beams": 2}, ref, out, 1, 0).near_ties is None
    assert next(model.parameters()).dtype == torch.float32  # the float64 run used a copy


def _agreement(matching: int, compared: int, rows: int = 2) -> agreements.Agreement:
    return agreements.Agreement(matching, compared, rows if matching == compared else 0, rows)


def _result(agreement: agreements.Agreement, stock: agreements.Agreement, paged: agreements.Agreement, near_ties=None,
            device: str = "cpu") -> demo.DemoResult:
    """A DemoResult for format_report: two texts, token agreements as given."""
    texts, seqs = ("text 0", "text 1"), torch.zeros(2, 5, dtype=torch.long)
    return demo.DemoResult(
        model_name="m", device=device, dtype="float32", backend="cpu", num_beams=1, texts=texts,
        hf=demo.GenerateRun(seqs, texts, 1.0), paged=demo.GenerateRun(seqs, texts, 0.5),
        agreement=agreement, paged_ran=True, float64=agreements.Float64Check(stock, paged, near_ties),
    )


def test_report_explains_agreement_below_stocks_own():
    chaotic, same = _agreement(6, 8), _agreement(8, 8)
    report = demo.format_report(_result(same, chaotic, chaotic, near_ties=()))
    assert "float64 check: against stock HF on a float64 copy, stock float32 agrees on 6/8 tokens (75.0%), " \
           "paged float32 on 6/8 (75.0%)" in report, report
    assert "note: stock HF's own float32 rounding already changes 2 of 8 tokens: the model is chaotic at this " \
           "precision (random weights at a real T5 shape are)" in report, report
    assert "; paged matches stock exactly" in report, report

    report = demo.format_report(_result(_agreement(5, 8), chaotic, _agreement(7, 8), near_ties=(True,)))
    assert "; paged and stock differ only where stock itself is unstable: in every row where they differ " \
           "(1 of 2), the first two tokens they differ on are a near-tie" in report, report

    report = demo.format_report(_result(_agreement(5, 8), chaotic, chaotic, near_ties=(True, False)))
    assert "; but where paged and stock differ, 1 of 2 rows first differ on two tokens that are not a near-tie" \
           in report, report

    report = demo.format_report(_result(_agreement(5, 8), same, _agreement(5, 8), near_ties=(False,)))
    assert "note: stock HF float32 matches float64 token for token here; but where" in report, report

    report = demo.format_report(_result(_agreement(5, 8), chaotic, chaotic, near_ties=None))
    assert "with beam search the demo does not check each difference" in report, report

    report = demo.format_report(_result(same, same, same, near_ties=()))
    assert "(100.0%), paged float32 on 8/8 (100.0%)" in report and "rounding" not in report, report


def test_report_names_the_gpu_path_only_on_cpu():
    same = _agreement(8, 8)
    assert "comes from the GPU path" in demo.format_report(_result(same, same, same, ()))
    assert "comes from the GPU path" not in demo.format_report(_result(same, same, same, (), device="cuda:0"))


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


def test_report_on_cpu_says_what_the_default_backend_does_at_wide_models():
    same = _agreement(8, 8)
    narrow = dataclasses.replace(_result(same, same, same), d_model=64)
    wide = dataclasses.replace(_result(same, same, same), d_model=512)
    on_gpu = dataclasses.replace(_result(same, same, same, device="cuda:0"), d_model=512)
    policy = "patch_model's default backend runs unpadded calls without beam search on stock HF on a CPU"
    assert policy not in demo.format_report(narrow)
    assert f"note: at d_model 512, {policy}" in demo.format_report(wide)
    assert policy not in demo.format_report(on_gpu)


def test_demo_runs_the_paged_cpu_backend_on_cpu():
    """Even where the default backend would run the call on stock HF (one unpadded input, greedy, d_model 512)."""
    model, tokenizer, _ = demo.load_model(shape="t5-small")
    result = demo.run_demo(model, tokenizer, texts=["one input, so nothing is padded"], max_new_tokens=3, repeats=1,
                           check_float64=False)
    assert result.paged_ran and result.backend == "cpu" and result.d_model == model.config.d_model
