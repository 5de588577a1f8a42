"""`python -m hf_paged_t5 summarize|translate|generate` end to end on a saved tiny checkpoint (CPU)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

import hf_paged_t5 as hp
from hf_paged_t5.batch import generator as batching, cli
from hf_paged_t5 import tiny
from hf_paged_t5.__main__ import build_parser, main

REPO = Path(__file__).resolve().parent.parent

TEXTS = [tiny.CORPUS[i] for i in range(9)] + [" ".join(tiny.CORPUS[10:14]), "Short."]
IDS = [f"doc-{i}" for i in range(len(TEXTS) - 1)] + [7]  # string ids and one int id


pytestmark = pytest.mark.usefixtures("one_thread_per_module")  # conftest: tiny matmuls, one thread


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.save_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def input_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(IDS, TEXTS)))
    return path


def run(command, checkpoint, input_file, output, *extra):
    return main([command, "--model", checkpoint, "--input", str(input_file), "--output", str(output),
                 "--no-progress", "--batch-rows", "6", "--max-new-tokens", "6", "--min-new-tokens", "2", *extra])


def read(output):
    return [json.loads(line) for line in output.read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(checkpoint, input_file, tmp_path_factory):
    output = tmp_path_factory.mktemp("full") / "out.jsonl"
    assert run("summarize", checkpoint, input_file, output) == 0
    return read(output)


def test_summarize_matches_the_pipeline(checkpoint, full_run):
    assert sorted(map(json.dumps, (r["id"] for r in full_run))) == sorted(map(json.dumps, IDS))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = hp.patch_model(AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval())
    summarize = pipeline("summarization", model=model, tokenizer=tokenizer)
    by_id = {json.dumps(r["id"]): r for r in full_run}
    for record_id, text in zip(IDS, TEXTS):
        # the pipeline adds "summarize: " and the task's defaults (4 beams, no_repeat_ngram_size=3, ...)
        expected = summarize(text, max_new_tokens=6, min_new_tokens=2)[0]["summary_text"]
        assert by_id[json.dumps(record_id)]["output"] == expected
    assert all(2 <= r["num_new_tokens"] <= 6 for r in full_run)


def test_resume_after_crash_and_half_written_line(checkpoint, input_file, full_run, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    original = batching.BatchGenerator.as_completed

    def crash_after_three(self, inputs):
        for count, item in enumerate(original(self, inputs)):
            if count == 3:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(batching.BatchGenerator, "as_completed", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        run("summarize", checkpoint, input_file, output)
    assert len(read(output)) == 3  # every finished result was written before the crash
    with open(output, "a") as f:
        f.write('{"id": "doc-9", "outp')  # a crash in the middle of a write
    monkeypatch.setattr(batching.BatchGenerator, "as_completed", original)
    assert run("summarize", checkpoint, input_file, output) == 0
    resumed = read(output)
    assert sorted(json.dumps(r["id"]) for r in resumed) == sorted(json.dumps(i) for i in IDS)
    key = lambda r: json.dumps(r["id"])  # noqa: E731
    assert sorted(resumed, key=key) == sorted(full_run, key=key)
    before = output.read_text()
    assert run("summarize", checkpoint, input_file, output) == 0  # all done: nothing to add
    assert output.read_text() == before


def test_translate_uses_task_prefix(checkpoint, input_file, tmp_path):
    output = tmp_path / "fr.jsonl"
    assert run("translate", checkpoint, input_file, output, "--task", "translation_en_to_fr", "--num-beams", "1") == 0
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = hp.patch_model(AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval())
    by_id = {json.dumps(r["id"]): r["output"] for r in read(output)}
    for record_id, text in list(zip(IDS, TEXTS))[:4]:
        enc = tokenizer("translate English to French: " + text, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=6, min_new_tokens=2, num_beams=1, early_stopping=True)
        assert by_id[json.dumps(record_id)] == tokenizer.decode(out[0], skip_special_tokens=True)


def test_generate_fields_line_number_ids_and_summary_line(checkpoint, tmp_path, caplog):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:3]))
    output = tmp_path / "out.jsonl"
    with caplog.at_level(logging.INFO, logger="hf_paged_t5.batch.cli"):
        assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(output),
                     "--text-field", "body", "--id-field", "key", "--no-progress", "--max-new-tokens", "3"]) == 0
    records = read(output)
    assert sorted(r["key"] for r in records) == [0, 1, 2]
    tokens = sum(r["num_new_tokens"] for r in records)
    summary = rf"3 documents, {tokens} new tokens in [0-9.]+ s \([0-9]+ tokens/s\); output: "
    summary += re.escape(str(output))
    assert [m for m in caplog.messages if re.fullmatch(summary, m)] == [caplog.messages[-1]], caplog.messages
    # the dtype chosen, said before the weights load: the demo checkpoint names float32
    assert "model on cpu in float32 (auto: the checkpoint's dtype)" in caplog.messages


@pytest.mark.parametrize("choice, device, config, bf16, expected", [
    ("float16", "cpu", {"dtype": "bfloat16"}, False, torch.float16),  # given: as given
    ("auto", "cpu", {"dtype": "bfloat16"}, False, torch.bfloat16),  # the checkpoint's
    ("auto", "cpu", {"torch_dtype": "float16"}, False, torch.float16),  # older transformers' key
    ("auto", "cpu", {"dtype": "torch.float32"}, False, torch.float32),
    ("auto", "cpu", {}, False, torch.float32),  # none named
    ("auto", "cuda", {"dtype": "float32"}, True, torch.bfloat16),  # a GPU with bfloat16
    ("auto", "cuda:0", {"dtype": "float16"}, False, torch.float16),  # a GPU without: the checkpoint's
], ids=["given", "checkpoint", "torch_dtype", "prefixed", "unnamed", "gpu-bf16", "gpu-no-bf16"])
def test_dtype_auto(monkeypatch, choice, device, config, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    dtype, why = cli.resolve_dtype(choice, device, config)
    assert dtype == expected and why


def test_rerun_over_a_finished_output_says_so_in_one_line(files):
    model, source, output = files  # `model` holds a config.json and no weights: a load would fail
    output.write_text("".join(json.dumps({"id": i, "output": "x", "num_new_tokens": 1}) + "\n" for i in (1, 2)))
    before = output.read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "hf_paged_t5", "summarize", "--model", str(model), "--input",
                           str(source), "--output", str(output)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr
    # Log records only: a Python warning some installed package prints on import is not ours.
    logged = [line for line in proc.stderr.splitlines() if re.match(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ", line)]
    assert logged == [f"INFO hf_paged_t5.batch.cli: 2 inputs, 2 already done, nothing to run; output: {output}"], proc.stderr
    assert proc.stdout == "" and output.read_text() == before


@pytest.mark.parametrize("where", ["before", "after", "none"])
def test_verbose_before_or_after_the_command(where):
    command = ["summarize", "--model", "m", "--input", "i", "--output", "o"]
    argv = {"before": ["-v", *command], "after": [*command[:1], "-v", *command[1:]], "none": command}[where]
    assert build_parser().parse_args(argv).verbose is (where != "none")


def test_command_help_lists_verbose_and_no_progress(capsys):
    with pytest.raises(SystemExit):
        main(["translate", "--help"])
    out = capsys.readouterr().out
    assert "-v, --verbose" in out and "--no-progress" in out


# ---- bad input: one error line, exit status 2, before the model loads, the output untouched ----


class ModelLoaded(Exception):
    """Raised by the stand-in load_model: validation let the job through to the weights."""


@pytest.fixture
def no_load(monkeypatch):
    """Replaces cli.load_model by one that records its call and raises ModelLoaded."""
    calls = []

    def load_model(*args, **kwargs):
        calls.append((args, kwargs))
        raise ModelLoaded

    monkeypatch.setattr(cli, "load_model", load_model)
    return calls


@pytest.fixture
def files(tmp_path):
    """(checkpoint stand-in: config.json with T5's task_specific_params, input file, output path)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "t5", "task_specific_params": dict(tiny.T5_TASK_SPECIFIC_PARAMS)}))
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n')
    return model, source, tmp_path / "out.jsonl"


def job(command, model, source, output, *extra):
    return main([command, "--model", str(model), "--input", str(source), "--output", str(output),
                 "--no-progress", *extra])


def assert_refused(status, caplog, no_load, message):
    """Exit status 2, exactly one error record (one line) containing `message`, and no model load."""
    assert status == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert message in errors[0], errors[0]
    assert not no_load


def test_valid_job_reaches_the_model_load(files, no_load):
    model, source, output = files
    with pytest.raises(ModelLoaded):
        job("translate", model, source, output, "--task", "translation", "--max-new-tokens", "3",
            "--min-new-tokens", "0", "--batch-rows", "1", "--batch-tokens", "1", "--num-beams", "1")
    assert len(no_load) == 1 and not output.exists()


def test_duplicate_id(files, caplog, no_load):
    model, source, output = files
    source.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    assert_refused(job("generate", model, source, output), caplog, no_load, "in.jsonl:2: duplicate id 1")
    assert not output.exists()


def test_memory_fraction_out_of_range_refused(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("generate", model, source, output, "--gpu-memory-utilization", "1.5"), caplog, no_load,
                   "--gpu-memory-utilization 1.5: must be in (0, 1]")
    assert not output.exists()


def test_missing_input(files, caplog, no_load):
    model, source, output = files
    status = job("generate", model, source.with_name("none.jsonl"), output)
    assert_refused(status, caplog, no_load, "none.jsonl: no such file; give an existing, readable JSONL file")
    assert not output.exists()


def test_input_is_a_directory(files, caplog, no_load, tmp_path):
    model, _, output = files
    assert_refused(job("generate", model, tmp_path, output), caplog, no_load,
                   f"--input {tmp_path}: is a directory; give an existing")
    assert not output.exists()


def test_input_line_not_json(files, caplog, no_load):
    model, source, output = files
    source.write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": \n')
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "in.jsonl:2: not JSON")
    assert "fix or remove the line" in caplog.text and not output.exists()


def test_input_line_without_text_field(files, caplog, no_load):
    model, source, output = files
    source.write_text('{"id": 1, "text": "a"}\n{"id": 2, "body": "b"}\n')
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "in.jsonl:2: expected an object with a string field 'text'; "
                   "fix the line or name the field with --text-field")
    assert not output.exists()


def test_input_not_utf8(files, caplog, no_load):
    model, source, output = files
    source.write_bytes(b'{"id": 1, "text": "a"}\n{"id": 2, "text": "\xff"}\n')
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "in.jsonl:2: not UTF-8 text")
    assert not output.exists()


def test_output_directory_missing(files, caplog, no_load):
    model, source, output = files
    output = output.parent / "missing" / "out.jsonl"
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "does not exist; create it or give another path")
    assert not output.parent.exists()


def test_output_is_a_directory(files, caplog, no_load, tmp_path):
    model, source, _ = files
    assert_refused(job("summarize", model, source, tmp_path), caplog, no_load,
                   f"--output {tmp_path}: is a directory; give a file path")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "model"]


def test_output_is_the_input(files, caplog, no_load):
    model, source, _ = files
    before = source.read_text()
    assert_refused(job("summarize", model, source, source), caplog, no_load,
                   "is the --input file; give another path")
    assert source.read_text() == before


def test_output_not_writable(files, caplog, no_load, monkeypatch):
    model, source, output = files
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a chmod would not stop root
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   f"--output {output}: cannot create a file in {output.parent}; fix its permissions")
    caplog.clear()
    output.write_text("")
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "not readable and writable; fix its permissions or give another path")
    assert output.read_text() == ""


def test_output_with_a_bad_line_is_left_as_it_was(files, caplog, no_load):
    model, source, output = files
    text = '{"id": 1, "output": "x", "num_new_tokens": 1}\nnot a result\n{"id": 2, "outp'
    output.write_text(text)
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "out.jsonl:2: not a result line with 'id'")
    assert "fix or remove the line, or give another --output" in caplog.text
    assert output.read_text() == text  # the half-written last line is not cut off either


def test_half_written_line_survives_a_refused_job(files, caplog, no_load):
    model, source, output = files
    text = '{"id": 1, "output": "x", "num_new_tokens": 1}\n{"id": 2, "outp'
    output.write_text(text)
    assert_refused(job("summarize", model.with_name("nope"), source, output), caplog, no_load,
                   "no such directory")
    assert output.read_text() == text


def test_model_directory_missing(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("summarize", model.with_name("nope"), source, output), caplog, no_load,
                   f"--model {model.with_name('nope')}: no such directory; give a local checkpoint directory")
    assert "Repo id" not in caplog.text and not output.exists()


def test_model_is_a_file(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("summarize", model / "config.json", source, output), caplog, no_load,
                   "config.json: no such directory")
    assert not output.exists()


def test_model_without_config(files, caplog, no_load):
    model, source, output = files
    (model / "config.json").unlink()
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   f"--model {model}: has no config.json; give a directory written by save_pretrained()")
    assert not output.exists()


def test_model_config_not_json(files, caplog, no_load):
    model, source, output = files
    (model / "config.json").write_text("{")
    assert_refused(job("summarize", model, source, output), caplog, no_load,
                   "config.json: cannot be read as JSON")
    assert not output.exists()


def test_unknown_task_names_the_models_tasks(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("translate", model, source, output, "--task", "translation_en_to_xx"), caplog, no_load,
                   "--task translation_en_to_xx: not a task of this model (its task_specific_params have: "
                   "summarization, translation_en_to_de, translation_en_to_fr, translation_en_to_ro); "
                   "give one of those or leave --task out")
    assert not output.exists()


def test_task_for_a_model_without_tasks(files, caplog, no_load):
    model, source, output = files
    (model / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert_refused(job("summarize", model, source, output, "--task", "summarization"), caplog, no_load,
                   "--task summarization: the model's config has no task_specific_params; leave --task out")
    assert not output.exists()


@pytest.mark.parametrize("option, value, lowest", [
    ("--batch-tokens", "0", 1), ("--batch-rows", "0", 1), ("--num-beams", "0", 1),
    ("--max-new-tokens", "0", 1), ("--min-new-tokens", "-1", 0),
])
def test_numeric_option_out_of_range(files, caplog, no_load, option, value, lowest):
    model, source, output = files
    assert_refused(job("summarize", model, source, output, option, value), caplog, no_load,
                   f"{option} {value}: must be >= {lowest}; give a larger value")
    assert not output.exists()


def test_min_new_tokens_above_max(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("summarize", model, source, output, "--min-new-tokens", "5", "--max-new-tokens", "4"),
                   caplog, no_load, "--min-new-tokens 5 is larger than --max-new-tokens 4; lower the first")
    assert not output.exists()


def test_translate_without_task_names_the_pair_it_picked(files, caplog, no_load):
    model, source, output = files
    with caplog.at_level(logging.INFO, logger="hf_paged_t5.batch.cli"), pytest.raises(ModelLoaded):
        job("translate", model, source, output)
    picked = "task 'translation_en_to_de' (the model's first translation task; --task picks another): prefix"
    assert [m for m in caplog.messages if m.startswith(picked)], caplog.messages


def test_task_minimum_above_max_new_tokens_warns(files, caplog, no_load):
    model, source, output = files  # summarization's defaults: min_length 30
    with pytest.raises(ModelLoaded):
        job("summarize", model, source, output, "--max-new-tokens", "5")
    assert "minimum length (29 new tokens) is larger than the maximum (5)" in caplog.text


def test_bad_device(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("summarize", model, source, output, "--device", "gpu"), caplog, no_load,
                   "--device gpu: not a device name; use cpu, cuda or cuda:N")
    assert not output.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_cuda_device_without_cuda(files, caplog, no_load):
    model, source, output = files
    assert_refused(job("summarize", model, source, output, "--device", "cuda"), caplog, no_load,
                   "--device cuda: CUDA is not available on this machine; use --device cpu")
    assert not output.exists()
