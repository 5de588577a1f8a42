"""summarization / translation / text2text-generation pipelines on transformers 5, with the tiny model."""

import logging

import pytest
import torch
import transformers
from transformers import pipeline

from hf_paged_t5.hf import pipelines
from hf_paged_t5 import tiny

TEXTS = [
    "The city council voted on Tuesday to build a new bridge across the river.",
    "Heavy rain is expected tonight.",
    "A young fox ran across the field and disappeared into the tall grass near the old church.",
]
# Short greedy runs; min_length=0 keeps T5's summarization minimum (30) from conflicting.
SHORT = dict(max_new_tokens=5, num_beams=1, min_length=0)


@pytest.fixture(scope="module", autouse=True)
def registered():
    pipelines.register_pipelines()
    yield
    # Leave the registry as the package import leaves it (registered), whatever a test did.
    pipelines.register_pipelines()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny.build_model()


def spy_on_generate(model, calls, fake=False):
    """Record the kwargs of model.generate calls; replaced on the instance, as patch_model does.

    With `fake`, return 2 tokens per sequence instead of generating (for tests of the kwargs only).
    """
    real_generate = model.generate

    def spy(**kwargs):
        calls.append(kwargs)
        if fake:
            rows = len(kwargs["input_ids"]) * kwargs.get("num_return_sequences", 1)
            return torch.tensor([[0, 1]] * rows)
        return real_generate(**kwargs)

    model.generate = spy


@pytest.fixture
def generate_calls(model):
    """The kwargs of every model.generate call of the test."""
    calls = []
    spy_on_generate(model, calls)
    yield calls
    del model.generate


@pytest.fixture
def fake_generate_calls(model):
    """The kwargs of every model.generate call of the test, which generates nothing."""
    calls = []
    spy_on_generate(model, calls, fake=True)
    yield calls
    del model.generate


def decoded_inputs(calls, tokenizer):
    return [tokenizer.decode(row, skip_special_tokens=True) for call in calls for row in call["input_ids"]]


@pytest.mark.parametrize(
    "task, cls",
    [
        ("summarization", pipelines.SummarizationPipeline),
        ("translation", pipelines.TranslationPipeline),
        ("translation_en_to_de", pipelines.TranslationPipeline),
        ("translation_fr_to_en", pipelines.TranslationPipeline),
        ("text2text-generation", pipelines.Text2TextGenerationPipeline),
    ],
)
def test_task_names_build_their_pipeline(model, tokenizer, task, cls):
    pipe = pipeline(task, model=model, tokenizer=tokenizer)
    assert type(pipe) is cls and pipe.task == task
    out = pipe(TEXTS[0], **SHORT)
    assert isinstance(out, list) and len(out) == 1
    assert set(out[0]) == {f"{cls.return_name}_text"} and isinstance(out[0][f"{cls.return_name}_text"], str)


@pytest.mark.parametrize("task", ["summarization", "text2text-generation", "translation_en_to_de"])
def test_output_nesting_like_transformers_4(model, tokenizer, task):
    pipe = pipeline(task, model=model, tokenizer=tokenizer)
    key = f"{pipe.return_name}_text"
    flat = pipe(TEXTS, **SHORT)
    assert len(flat) == len(TEXTS) and all(set(record) == {key} for record in flat)
    nested = pipe(TEXTS, num_return_sequences=2, max_new_tokens=5, num_beams=2, min_length=0)
    assert len(nested) == len(TEXTS) and all(len(records) == 2 for records in nested)
    assert all(set(record) == {key} for records in nested for record in records)
    single = pipe(TEXTS[0], num_return_sequences=2, max_new_tokens=5, num_beams=2, min_length=0)
    assert len(single) == 2 and all(set(record) == {key} for record in single)


def test_text_is_the_decoded_generate_output(model, tokenizer):
    pipe = pipeline("text2text-generation", model=model, tokenizer=tokenizer)
    # the pipeline's own model and device (on a CUDA machine, pipeline() may move the model)
    expected = pipe.model.generate(**tokenizer(TEXTS[1], return_tensors="pt").to(pipe.device), **SHORT)[0]
    record = pipe(TEXTS[1], return_tensors=True, return_text=True, **SHORT)[0]
    assert torch.equal(record["generated_token_ids"], expected)
    assert record["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert set(pipe(TEXTS[1], return_tensors=True, **SHORT)[0]) == {"generated_token_ids"}


@pytest.mark.parametrize("task", ["summarization", "translation_en_to_de", "text2text-generation"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_batch_size_does_not_change_results(model, tokenizer, task, num_beams):
    pipe = pipeline(task, model=model, tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=6, num_beams=num_beams, min_length=0, return_tensors=True, return_text=True)
    one = pipe(TEXTS, batch_size=1, **kwargs)
    batched = pipe(TEXTS, batch_size=2, **kwargs)
    assert [r[f"{pipe.return_name}_text"] for r in one] == [r[f"{pipe.return_name}_text"] for r in batched]


def test_batch_size_given_to_pipeline(model, tokenizer, generate_calls):
    pipe = pipeline("text2text-generation", model=model, tokenizer=tokenizer, batch_size=2)
    assert len(pipe(TEXTS, **SHORT)) == len(TEXTS)
    assert [len(call["input_ids"]) for call in generate_calls] == [2, 1]


@pytest.mark.parametrize(
    "task, call_kwargs, prefix",
    [
        ("summarization", {}, "summarize: "),
        ("translation_en_to_de", {}, "translate English to German: "),
        ("translation_en_to_fr", {}, "translate English to French: "),
        ("translation", {}, "translate English to German: "),  # the first translation entry, as in v4
        ("translation", dict(src_lang="en", tgt_lang="ro"), "translate English to Romanian: "),
        ("translation_en_to_de", dict(tgt_lang="fr"), "translate English to French: "),
        ("text2text-generation", {}, ""),
    ],
)
def test_task_prefix_is_tokenized_with_the_input(model, tokenizer, generate_calls, task, call_kwargs, prefix):
    pipe = pipeline(task, model=model, tokenizer=tokenizer)
    pipe(TEXTS[:2], **call_kwargs, **SHORT)
    assert decoded_inputs(generate_calls, tokenizer) == [prefix + text for text in TEXTS[:2]]


def test_no_prefix_without_task_params(tokenizer):
    bare, generate_calls = tiny.build_model(task_specific_params=None), []
    spy_on_generate(bare, generate_calls)
    pipe = pipeline("summarization", model=bare, tokenizer=tokenizer)
    pipe(TEXTS[0], **SHORT)
    assert decoded_inputs(generate_calls, tokenizer) == [TEXTS[0]]


def test_model_task_params_are_not_mutated(model, tokenizer):
    before = {task: dict(params) for task, params in model.config.task_specific_params.items()}
    pipeline("summarization", model=model, tokenizer=tokenizer)(TEXTS[0], **SHORT)
    assert model.config.task_specific_params == before


def test_task_generation_defaults_and_overrides(model, tokenizer, fake_generate_calls):
    summarize = pipeline("summarization", model=model, tokenizer=tokenizer)
    summarize(TEXTS[0], max_length=8, min_length=2)
    summarize(TEXTS[0], max_new_tokens=4, num_beams=2, length_penalty=1.0)
    first, second = fake_generate_calls
    expected = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True)
    assert {key: first[key] for key in expected} == expected
    assert (first["max_length"], first["min_length"]) == (8, 2) and "max_new_tokens" not in first
    # The user's max_new_tokens replaces the task's max_length instead of competing with it, and the
    # task's min_length (30), which it could never reach, goes too.
    assert second["max_new_tokens"] == 4 and "max_length" not in second and "min_length" not in second
    assert (second["num_beams"], second["length_penalty"]) == (2, 1.0)


# The tiny model's summarization task sets min_length=30 and max_length=200 (29 and 199 new tokens).
@pytest.mark.parametrize(
    "given, lengths_kept",
    [
        (dict(max_new_tokens=20), {}),  # the minimum is above the user's maximum
        (dict(max_length=15), {}),
        (dict(max_new_tokens=29), dict(min_length=30)),  # 29 new tokens: the minimum is reachable
        # The task's maximum is below the user's minimum; the pipeline's default maximum takes its place.
        (dict(min_new_tokens=250), dict(max_new_tokens=256)),
        (dict(min_length=10), dict(max_length=200)),
        (dict(max_new_tokens=20, min_length=0), {}),
    ],
)
def test_user_lengths_drop_the_task_lengths_they_override_or_contradict(
    model, tokenizer, fake_generate_calls, given, lengths_kept
):
    pipeline("summarization", model=model, tokenizer=tokenizer)(TEXTS[0], **given)
    (call,) = fake_generate_calls
    lengths = {k: call[k] for k in ("min_length", "max_length", "min_new_tokens", "max_new_tokens") if k in call}
    assert lengths == {**lengths_kept, **given}
    assert (call["num_beams"], call["no_repeat_ngram_size"]) == (4, 3)  # other task defaults stay


@pytest.mark.parametrize("in_pipeline_call", [False, True])
def test_user_max_new_tokens_wins_silently(model, tokenizer, caplog, monkeypatch, in_pipeline_call):
    import warnings

    import hf_paged_t5

    # transformers' loggers do not propagate to the root logger caplog listens on
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    patched = hf_paged_t5.patch_model(tiny.build_model())
    try:
        with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if in_pipeline_call:
                out = pipeline("summarization", model=patched, tokenizer=tokenizer, max_new_tokens=20)(TEXTS[0])
            else:
                out = pipeline("summarization", model=patched, tokenizer=tokenizer)(TEXTS[0], max_new_tokens=20)
    finally:
        hf_paged_t5.unpatch_model(patched)
    assert not [m for m in caplog.messages if "length" in m], caplog.messages
    assert not [w for w in caught if "length" in str(w.message)], [str(w.message) for w in caught]
    # Stock HF with the same explicit argument and the task's other defaults.
    task = dict(model.config.task_specific_params["summarization"])
    prefix = task.pop("prefix")
    task = {k: v for k, v in task.items() if k not in ("min_length", "max_length")}
    inputs = tokenizer(prefix + TEXTS[0], return_tensors="pt").to(model.device)  # pipeline() may have moved it
    stock = model.generate(**inputs, max_new_tokens=20, **task)[0]
    assert out == [{"summary_text": tokenizer.decode(stock, skip_special_tokens=True)}]


def test_pipeline_defaults_only_where_the_model_sets_nothing(tokenizer):
    bare, generate_calls = tiny.build_model(task_specific_params=None), []
    spy_on_generate(bare, generate_calls, fake=True)
    pipe = pipeline("text2text-generation", model=bare, tokenizer=tokenizer)
    pipe(TEXTS[1])
    bare.generation_config.num_beams = 2
    bare.generation_config.max_length = 7
    pipe(TEXTS[1])
    assert (generate_calls[0]["max_new_tokens"], generate_calls[0]["num_beams"]) == (256, 4)
    assert "num_beams" not in generate_calls[1] and "max_new_tokens" not in generate_calls[1]


def test_generate_kwargs_pass_through(model, tokenizer, generate_calls):
    pipe = pipeline("text2text-generation", model=model, tokenizer=tokenizer, max_new_tokens=3, num_beams=1)
    (short,) = pipe([TEXTS[0]], return_tensors=True)
    (longer,) = pipe([TEXTS[0]], max_new_tokens=7, return_tensors=True, repetition_penalty=1.3)
    assert len(short["generated_token_ids"]) == 1 + 3 and len(longer["generated_token_ids"]) <= 1 + 7
    assert generate_calls[0]["max_new_tokens"] == 3 and generate_calls[1]["max_new_tokens"] == 7
    assert generate_calls[1]["repetition_penalty"] == 1.3 and "repetition_penalty" not in generate_calls[0]


def test_user_generation_config_is_taken_as_complete(model, tokenizer, generate_calls):
    config = transformers.GenerationConfig(max_new_tokens=4, num_beams=1, decoder_start_token_id=0, eos_token_id=1)
    pipeline("summarization", model=model, tokenizer=tokenizer)(TEXTS[0], generation_config=config)
    assert set(generate_calls[0]) == {"input_ids", "attention_mask", "generation_config"}


def test_stop_sequence_and_return_dict_in_generate(model, tokenizer, generate_calls):
    pipe = pipeline("text2text-generation", model=model, tokenizer=tokenizer)
    out = pipe(TEXTS[0], stop_sequence="▁the", return_dict_in_generate=True, output_scores=True, **SHORT)
    assert generate_calls[0]["eos_token_id"] == tokenizer.convert_tokens_to_ids("▁the")
    assert isinstance(out[0]["generated_text"], str)


def test_clean_up_tokenization_spaces_reaches_decode(model, tokenizer, monkeypatch):
    seen = []
    real_decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **kw: seen.append(kw) or real_decode(*a, **kw))
    pipe = pipeline("text2text-generation", model=model, tokenizer=tokenizer)
    pipe(TEXTS[0], **SHORT)
    pipe(TEXTS[0], clean_up_tokenization_spaces=True, **SHORT)
    assert [kw["clean_up_tokenization_spaces"] for kw in seen] == [False, True]
    assert all(kw["skip_special_tokens"] for kw in seen)


def test_truncation(model, generate_calls):
    tok = tiny.build_tokenizer()
    tok.model_max_length = 12
    pipe = pipeline("summarization", model=model, tokenizer=tok)
    pipe(TEXTS[2], **SHORT)
    pipe(TEXTS[2], truncation=True, **SHORT)
    assert generate_calls[0]["input_ids"].shape[1] > 12 and generate_calls[1]["input_ids"].shape[1] == 12


def test_summarization_length_warnings(model, tokenizer, fake_generate_calls, caplog):
    pipe = pipeline("summarization", model=model, tokenizer=tokenizer)
    input_length = len(tokenizer("summarize: " + TEXTS[1]).input_ids)
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5.hf.pipelines"):
        pipe(TEXTS[1], max_length=40, min_length=2, num_beams=1)
    assert caplog.messages == [
        f"Your max_length is set to 40, but your input_length is only {input_length}. Since this is a"
        " summarization task, where outputs shorter than the input are typically wanted, you might consider"
        f" decreasing max_length manually, e.g. summarizer('...', max_length={input_length // 2})"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5.hf.pipelines"):
        pipe(TEXTS[1], max_length=4, min_length=3, num_beams=1)
        pipe(TEXTS[1], max_new_tokens=3, min_length=5, num_beams=1)
    assert caplog.messages == ["Your min_length=5 must be inferior than your max_new_tokens=3."]


def test_translation_length_warning(model, tokenizer, caplog):
    pipe = pipeline("translation_en_to_de", model=model, tokenizer=tokenizer)
    input_length = len(tokenizer("translate English to German: " + TEXTS[0]).input_ids)
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5.hf.pipelines"):
        pipe(TEXTS[0], max_length=10, num_beams=1)
        pipe(TEXTS[0], max_length=input_length * 2, num_beams=1)
    assert caplog.messages == [
        f"Your input_length: {input_length} is bigger than 0.9 * max_length: 10. You might consider increasing"
        " your max_length manually, e.g. translator('...', max_length=400)"
    ]


def test_generator_input_streams(model, tokenizer):
    pipe = pipeline("summarization", model=model, tokenizer=tokenizer)
    out = pipe((text for text in TEXTS), **SHORT)
    assert not isinstance(out, list)
    assert [len(records) for records in out] == [1] * len(TEXTS)


def test_non_text_input_is_rejected(model, tokenizer):
    with pytest.raises(TypeError, match="takes a str"):
        pipeline("summarization", model=model, tokenizer=tokenizer)(42)


def test_pipeline_loads_a_checkpoint_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny.save_demo_checkpoint(tmp_path / "demo")
    pipe = pipeline("translation_en_to_fr", model=path)
    assert isinstance(pipe.model, transformers.T5ForConditionalGeneration)
    assert isinstance(pipe(TEXTS[0], **SHORT)[0]["translation_text"], str)


def test_saved_pipeline_needs_no_remote_code(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipeline("summarization", model=model, tokenizer=tokenizer).save_pretrained(tmp_path)
    assert not getattr(transformers.AutoConfig.from_pretrained(tmp_path), "custom_pipelines", None)
    assert type(pipeline("summarization", model=str(tmp_path))) is pipelines.SummarizationPipeline


def test_register_is_idempotent_and_reversible(model, tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        pipelines.register_pipelines()
    assert not [m for m in caplog.messages if "already registered" in m]
    pipelines.unregister_pipelines()
    pipelines.unregister_pipelines()
    for task in ("summarization", "translation_en_to_de", "text2text-generation"):
        with pytest.raises(KeyError):
            pipeline(task, model=model, tokenizer=tokenizer)
    assert "check_task" not in vars(transformers.pipelines.PIPELINE_REGISTRY)
    pipelines.register_pipelines()
    assert type(pipeline("translation_en_to_de", model=model, tokenizer=tokenizer)) is pipelines.TranslationPipeline


@pytest.mark.parametrize("task", ["summarization", "translation_en_to_de", "text2text-generation"])
def test_patched_model_gives_the_same_records(model, tokenizer, task):
    import hf_paged_t5

    kwargs = dict(max_new_tokens=8, min_length=0, batch_size=2)  # beam search: task / pipeline default 4
    expected = pipeline(task, model=model, tokenizer=tokenizer)(TEXTS, **kwargs)
    patched = hf_paged_t5.patch_model(tiny.build_model())
    try:
        assert pipeline(task, model=patched, tokenizer=tokenizer)(TEXTS, **kwargs) == expected
        assert patched._hf_paged_t5.pool is not None, "the paged path did not run"
    finally:
        hf_paged_t5.unpatch_model(patched)
