"""`python -m hf_paged_t5 summarize|translate|generate` end to end on a saved tiny checkpoint (CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

import hf_paged_t5 as hp
from hf_paged_t5 import batching, tiny
from hf_paged_t5.__main__ import main

TEXTS = [tiny.CORPUS[i] for i in range(9)] + [" ".join(tiny.CORPUS[10:14]), "Short."]
IDS = [f"doc-{i}" for i in range(len(TEXTS) - 1)] + [7]  # string ids and one int id


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: avoid OpenMP spin-waits on a busy machine
    yield
    torch.set_num_threads(threads)


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


def test_generate_fields_and_line_number_ids(checkpoint, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:3]))
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(output),
                 "--text-field", "body", "--id-field", "key", "--no-progress", "--max-new-tokens", "3"]) == 0
    assert sorted(r["key"] for r in read(output)) == [0, 1, 2]


def test_bad_input_is_reported(checkpoint, tmp_path, caplog):
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output",
                 str(tmp_path / "o.jsonl"), "--no-progress"]) == 2
    assert "duplicate id 1" in caplog.text
