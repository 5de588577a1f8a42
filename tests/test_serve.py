"""The OpenAI-style server (`hf_paged_t5.serve`) through Starlette's test client, on CPU: completions
equal patched generate() on each prompt alone, streaming, the 400s that name an option, the model
list, health, metrics, a full queue, and the `serve` command's checks before any model loads."""

from __future__ import annotations

import json
import time

import pytest
import torch

starlette = pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

import hf_paged_t5 as hp  # noqa: E402
from hf_paged_t5 import tiny  # noqa: E402
from hf_paged_t5.__main__ import main  # noqa: E402
from hf_paged_t5.serve.app import create_app  # noqa: E402

PREFIX = "summarize: "


@pytest.fixture(scope="module")
def served():
    """(client, model, tokenizer) of a server over the embedded tiny model; closed after the module."""
    tokenizer = tiny.build_tokenizer()
    model = hp.patch_model(tiny.build_model("tiny", vocab_size=len(tokenizer)), hp.PagedCacheConfig(block_size=4))
    engine = hp.OnlineEngine(model, tokenizer)
    with TestClient(create_app(engine, "t5-test", prefix=PREFIX)) as client:
        yield client, model, tokenizer
    engine.close(cancel=True)


def alone(model, tokenizer, text, max_new):
    ids = tokenizer(PREFIX + text, return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, max_new_tokens=max_new)
    return tokenizer.decode(out[0], skip_special_tokens=True), out[0, 1:].tolist()


TEXTS = ["The morning train was late again.", "A small bakery sells bread and cakes on the corner of the street.",
         "Rain tonight."]


def test_completion_of_one_prompt_and_of_a_list(served):
    client, model, tokenizer = served
    r = client.post("/v1/completions", json={"model": "t5-test", "prompt": TEXTS[0], "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    text, ids = alone(model, tokenizer, TEXTS[0], 7)
    assert body["object"] == "text_completion" and body["model"] == "t5-test" and body["id"].startswith("cmpl-")
    assert [c["text"] for c in body["choices"]] == [text] and body["choices"][0]["token_ids"] == ids
    assert body["choices"][0]["finish_reason"] == ("stop" if ids[-1] == 1 else "length")
    prompt_tokens = len(tokenizer(PREFIX + TEXTS[0]).input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                             "total_tokens": prompt_tokens + len(ids)}

    r = client.post("/v1/completions", json={"prompt": TEXTS, "max_tokens": 9})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [alone(model, tokenizer, t, 9)[0] for t in TEXTS]


def test_token_id_prompts(served):
    client, model, tokenizer = served
    ids = tokenizer(PREFIX + TEXTS[1]).input_ids
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5})
    assert r.status_code == 200, r.text
    want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=5)[0, 1:].tolist()
    assert r.json()["choices"][0]["token_ids"] == want


def test_stream(served):
    client, model, tokenizer = served
    with client.stream("POST", "/v1/completions", json={"prompt": TEXTS[:2], "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        text, ids = alone(model, tokenizer, TEXTS[i], 6)
        assert "".join(c["text"] for c in mine) == text
        assert [t for c in mine for t in c["token_ids"]] == ids
        assert len(mine) >= 3, "the text came in pieces as it was generated"
        assert [c["finish_reason"] for c in mine][-1] in ("stop", "length")
        assert all(c["finish_reason"] is None for c in mine[:-1])


@pytest.mark.parametrize("field, value, status, needle", [
    ("temperature", -1, 400, "temperature"),
    ("top_p", 0.9, 400, "top_p"),
    ("seed", "x", 400, "seed"),
    ("n", 0, 400, "n"),
    ("n", 99, 400, "n"),
    ("stop", [""], 400, "stop"),
    ("stop", ["a", "b", "c", "d", "e"], 400, "stop"),
    ("logprobs", 3, 400, "logprobs"),
    ("echo", True, 400, "echo"),
    ("max_tokens", 0, 400, "max_tokens"),
    ("stream", "yes", 400, "stream"),
    ("prompt", [], 400, "prompt"),
    ("prompt", [[]], 400, "prompt"),
    ("prompt", [5, 10**6], 400, "prompt"),
    ("model", "gpt-4", 404, "model"),
    ("frobnicate", 1, 400, "frobnicate"),
])
def test_options_not_served_get_an_error_naming_them(served, field, value, status, needle):
    client, _, _ = served
    body = {"prompt": "x", "max_tokens": 3, field: value}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == needle and needle in error["message"]


def test_greedy_defaults_are_accepted(served):
    client, _, _ = served
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "n": 1,
                                             "seed": 3, "stop": None, "user": "someone"})
    assert r.status_code == 200, r.text


def test_not_json(served):
    client, _, _ = served
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_models_health_metrics(served):
    client, _, _ = served
    assert client.get("/v1/models").json()["data"][0]["id"] == "t5-test"
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    text = client.get("/metrics").text
    for name in ("hf_paged_t5_queue_depth 0", "hf_paged_t5_running_rows 0", "hf_paged_t5_kv_blocks_free",
                 "hf_paged_t5_generated_tokens_total", 'hf_paged_t5_requests_total{code="200"}',
                 'hf_paged_t5_request_seconds_bucket{le="+Inf"}', "hf_paged_t5_request_seconds_count",
                 "hf_paged_t5_kernel_binaries "):
        assert name in text, text
    generated = int(next(line.split()[-1] for line in text.splitlines()
                         if line.startswith("hf_paged_t5_generated_tokens_total")))
    assert generated > 0


def test_a_full_queue_gets_503():
    tokenizer = tiny.build_tokenizer()
    model = hp.patch_model(tiny.build_model("tiny", vocab_size=len(tokenizer)))
    engine = hp.OnlineEngine(model, tokenizer)
    with TestClient(create_app(engine, "m", max_queue=2)) as client:
        r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        assert client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).status_code == 200
    engine.close()


def test_serve_command_checks_before_loading(tmp_path, caplog):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in caplog.text
    caplog.clear()
    assert main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    assert "--port 70000" in caplog.text
    caplog.clear()
    assert main(["serve", "--model", str(tmp_path), "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization 1.5: must be in (0, 1]" in caplog.text
    path = tiny.save_demo_checkpoint(tmp_path / "ckpt")
    caplog.clear()
    assert main(["serve", "--model", path, "--task", "no-such-task"]) == 2
    assert "--task no-such-task" in caplog.text


def test_min_tokens(served):
    client, model, tokenizer = served
    ids = tokenizer(PREFIX + TEXTS[2]).input_ids
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "min_tokens": 12})
    want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12)[0, 1:].tolist()
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want and len(want) == 12
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "min_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_a_prompt_too_large_for_the_pool_gets_a_400_with_the_numbers():
    tokenizer = tiny.build_tokenizer()
    model = hp.patch_model(tiny.build_model("tiny", vocab_size=len(tokenizer)),
                           hp.PagedCacheConfig(block_size=4, num_blocks=6, grow=False))
    engine = hp.OnlineEngine(model, tokenizer)
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"prompt": list(range(2, 80)), "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "KV blocks by itself" in error["message"]
        r = client.post("/v1/completions", json={"prompt": list(range(2, 80)), "max_tokens": 2, "stream": True})
        assert r.status_code == 400 and "KV blocks by itself" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
    engine.close()


def test_serve_command_names_the_missing_extra(monkeypatch, caplog):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--model", "anything"]) == 2
    assert "pip install 'hf_paged_t5[serve]'" in caplog.text


def test_per_request_sampling_with_a_seed_is_a_solo_runs_draw(served):
    client, model, tokenizer = served
    ids = tokenizer(PREFIX + TEXTS[0]).input_ids
    body = {"prompt": ids, "max_tokens": 10, "min_tokens": 10, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    got = [client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2)]
    torch.manual_seed(7)
    want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=True,
                          temperature=0.8, top_p=0.95)[0, 1:].tolist()
    assert got == [want, want]
    greedy = client.post("/v1/completions", json={**body, "temperature": 0, "top_p": None})
    greedy = greedy.json()["choices"][0]["token_ids"]
    assert greedy == model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10)[0, 1:].tolist()


def test_n_completions_per_prompt(served):
    client, model, tokenizer = served
    prompts = [tokenizer(PREFIX + t).input_ids for t in TEXTS[:2]]
    body = {"prompt": prompts, "max_tokens": 6, "min_tokens": 6, "temperature": 0.9, "seed": 20, "n": 3}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        i, j = divmod(c["index"], 3)
        torch.manual_seed(20 + j)
        want = model.generate(input_ids=torch.tensor([prompts[i]]), max_new_tokens=6, min_new_tokens=6,
                              do_sample=True, temperature=0.9)[0, 1:].tolist()
        assert c["token_ids"] == want, c["index"]


def test_stop_strings_end_the_text_before_them(served):
    client, model, tokenizer = served
    ids = tokenizer(PREFIX + TEXTS[1]).input_ids
    full = tokenizer.decode(model.generate(input_ids=torch.tensor([ids]), max_new_tokens=30, min_new_tokens=30)[0],
                            skip_special_tokens=True)
    stop = full[8:10]
    cut = full.find(stop)
    for stream in (False, True):
        body = {"prompt": ids, "max_tokens": 30, "min_tokens": 30, "stop": ["never-there", stop], "stream": stream}
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            text, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert (text, reason) == (full[:cut], "stop"), (stream, stop, full)
    end = time.monotonic() + 30  # the stopped requests were cancelled: their blocks go back
    while "hf_paged_t5_kv_blocks_used 0" not in client.get("/metrics").text:
        assert time.monotonic() < end, client.get("/metrics").text
        time.sleep(0.01)


def test_streamed_text_is_decoded_a_few_tokens_at_a_time_and_equals_the_whole_decode():
    """`_Detokenizer` decodes each new piece with the tokens before it, not the whole output: at
    every point its text is the whole decode's (special tokens in the middle included, which
    decode to nothing and must not take the next token's leading space)."""
    import random

    from hf_paged_t5.serve.app import _Detokenizer

    tokenizer = tiny.build_tokenizer()
    rng = random.Random(0)
    calls = []
    real = tokenizer.decode

    def counting(ids, **kw):
        calls.append(len(ids))
        return real(ids, **kw)

    tokenizer.decode = counting
    for _ in range(300):
        ids = [rng.randrange(0, tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        detokenizer, k = _Detokenizer(tokenizer), 0
        while k < len(ids):
            k = min(len(ids), k + rng.randint(1, 3))
            text = detokenizer.text(ids[:k])
            if text is not None:
                assert text == real(ids[:k], skip_special_tokens=True)
    assert sum(calls) / len(calls) < 12  # windows of a few tokens, not the whole output (up to 40)


def test_engine_errors_cross_the_process_boundary_as_their_own_type():
    """What the engine process raises reaches the app as the type its status depends on: a prompt the
    pool cannot hold stays a PoolExhaustedError (400 with the numbers), a bad input a ValueError
    (400), another error a RuntimeError naming it (500)."""
    from hf_paged_t5.kv.block_manager import PoolExhaustedError
    from hf_paged_t5.serve.app import _failure
    from hf_paged_t5.serve.engine_client import rebuilt
    from hf_paged_t5.serve.engine_process import carried

    full = rebuilt(carried(PoolExhaustedError("needs 20 KV blocks by itself; the pool has 5")))
    assert type(full) is PoolExhaustedError
    assert _failure(full) == ("the prompt does not fit the server's KV pool: needs 20 KV blocks by itself; the pool "
                              "has 5", "invalid_request_error")
    assert type(rebuilt(carried(ValueError("input 3: token id 999 ...")))) is ValueError
    other = rebuilt(carried(KeyError("x")))
    assert type(other) is RuntimeError and str(other) == "KeyError: 'x'" and _failure(other)[1] == "server_error"
    assert str(rebuilt(carried(type("CudaError", (RuntimeError,), {})("boom")))) == "CudaError: boom"
