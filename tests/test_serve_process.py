"""`python -m hf_paged_t5 serve` as a real process on loopback, real HTTP (CPU, the embedded tiny
checkpoint), its engine in a process of its own (the default): 32 concurrent clients with mixed
lengths and options get patched generate()'s answer on each prompt alone, streamed or not; 50
streams cancelled mid-way leave no block in use once the server is idle; a full queue gets 503s,
bad inputs 4xx; the official `openai` client round-trips; SIGTERM lets the running streams finish,
then both processes exit 0; the engine process killed turns /health to 503 and fails the open
requests (no hang); the HTTP process killed takes the engine process with it; one process
(`--no-engine-process`) answers too. Every wait is bounded in time."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hf_paged_t5 import tiny  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict, timeout: float = 60.0):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def metric(base: str, name: str) -> float:
    line = next(line for line in get(base + "/metrics").splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def wait_until(condition, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


MAX_QUEUE = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny.save_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "t5-tiny")


def launch(path: str, *options: str) -> tuple[subprocess.Popen, str]:
    """(process, base url) of `serve` over `path`, not waited for."""
    port = free_port()
    # one torch thread (the tiny model gains nothing from more): on a loaded CI machine, intra-op
    # threads waiting for each other at every op made each decode step take a scheduler quantum or more
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged_t5", "serve", "--model", path, "--port", str(port),
                             "--device", "cpu", "--drain", "5", *options], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen, base: str) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            return json.loads(get(base + "/health", timeout=1)) == {"status": "ok"}
        except OSError:
            return False

    wait_until(up, 120, "the server to start")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the engine process, multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def engine_pid(pid: int) -> int:
    for child in children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return child
    raise AssertionError(f"no engine process under {pid}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(checkpoint):
    """(base url, reference model, tokenizer, process): a server process over a saved tiny checkpoint."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    proc, base = launch(checkpoint, "--max-queue", str(MAX_QUEUE), "--drain", "30")  # (the last --drain counts)
    try:
        wait_up(proc, base)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval()
        yield base, model, tokenizer, proc
    finally:
        stop(proc)


def expected(model, tokenizer, text: str, max_tokens: int, min_tokens: int) -> list[int]:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=max_tokens, min_new_tokens=min_tokens or None)
    return out[0, 1:].tolist()


def read_stream(response) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of one choice's server-sent events."""
    text, ids, reason = "", [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: "):])["choices"][0]
        text += choice["text"]
        ids += choice["token_ids"]
        reason = choice["finish_reason"] or reason
    return text, ids, reason


def test_concurrent_clients_get_generate_alone_answers(server):
    base, model, tokenizer, _ = server
    rng = random.Random(0)
    words = " ".join(tiny.CORPUS).split()
    cases = []
    for i in range(64):  # 32 clients, two requests each
        text = "summarize: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        max_tokens = rng.randint(1, 24)
        cases.append((text, max_tokens, rng.choice([0, 0, rng.randint(0, max_tokens)]), rng.random() < 0.5))
    answers: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            for i in (2 * k, 2 * k + 1):
                text, max_tokens, min_tokens, stream = cases[i]
                body = {"prompt": text, "max_tokens": max_tokens, "min_tokens": min_tokens, "stream": stream}
                with post(base + "/v1/completions", body) as r:
                    if stream:
                        answers[i] = read_stream(r)[:2]
                    else:
                        choice = json.loads(r.read())["choices"][0]
                        answers[i] = (choice["text"], choice["token_ids"])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert len(answers) == len(cases)
    for i, (text, max_tokens, min_tokens, _) in enumerate(cases):
        ids = expected(model, tokenizer, text, max_tokens, min_tokens)
        assert answers[i][1] == ids, (i, cases[i])
        assert answers[i][0] == tokenizer.decode(ids, skip_special_tokens=True)


def test_cancelled_streams_give_their_blocks_back(server):
    base, _, _, _ = server
    rng = random.Random(1)
    for i in range(50):
        body = {"prompt": f"translate English to German: request {i}", "max_tokens": 400, "min_tokens": 400,
                "stream": True}
        r = post(base + "/v1/completions", body)
        for _ in range(rng.randint(1, 3)):  # a few events, then the client goes away
            r.readline()
        r.close()
    wait_until(lambda: metric(base, "hf_paged_t5_running_requests") == 0
               and metric(base, "hf_paged_t5_queue_depth") == 0, 60, "the cancelled requests to stop")
    assert metric(base, "hf_paged_t5_kv_blocks_used") == 0
    cancelled = get(base + "/metrics")
    assert 'hf_paged_t5_requests_total{code="499"}' in cancelled


def test_bad_inputs_get_4xx(server):
    base, _, _, _ = server
    for body, status in (({"prompt": "x", "n": 0}, 400), ({"prompt": 5}, 400),
                         ({"prompt": "x", "model": "other"}, 404), ({"prompt": "x", "max_tokens": -1}, 400)):
        with pytest.raises(urllib.error.HTTPError) as info:
            post(base + "/v1/completions", body)
        assert info.value.code == status
        assert "error" in json.loads(info.value.read())


def test_a_full_queue_gets_503(server):
    base, _, _, _ = server
    prompts = [[5, 6, 7 + i] for i in range(MAX_QUEUE // 16 + 1)]  # 16 completions of each: past the queue's room
    with pytest.raises(urllib.error.HTTPError) as info:
        post(base + "/v1/completions", {"prompt": prompts, "n": 16, "max_tokens": 2})
    assert info.value.code == 503 and info.value.headers["retry-after"]
    assert json.loads(info.value.read())["error"]["code"] == "queue_full"
    with post(base + "/v1/completions", {"prompt": prompts[:2], "n": 16, "max_tokens": 2}) as r:
        assert len(json.loads(r.read())["choices"]) == 32


def test_openai_client_round_trips(server):
    openai = pytest.importorskip("openai")
    base, model, tokenizer, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["t5-tiny"]
    text = "summarize: The morning train to the coast was late again."
    want = tokenizer.decode(expected(model, tokenizer, text, 10, 0), skip_special_tokens=True)
    done = client.completions.create(model="t5-tiny", prompt=text, max_tokens=10)
    assert done.choices[0].text == want
    pieces = client.completions.create(model="t5-tiny", prompt=text, max_tokens=10, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces) == want
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="t5-tiny", prompt=text, max_tokens=10, temperature=-1)
    if len(want) > 3:
        stopped = client.completions.create(model="t5-tiny", prompt=text, max_tokens=10, stop=[want[2:4]])
        assert stopped.choices[0].text == want[: want.find(want[2:4])]
        assert stopped.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model="t5-tiny", prompt=text, max_tokens=10, temperature=0.9, seed=3)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_sigterm_lets_running_streams_finish_then_both_processes_exit(server):
    base, _, _, proc = server
    engine = engine_pid(proc.pid)
    pids = children(proc.pid)
    got: dict[int, tuple] = {}
    started = threading.Barrier(4)

    def client(k: int) -> None:
        body = {"prompt": f"summarize: a long answer {k}", "max_tokens": 200, "min_tokens": 200, "stream": True}
        with post(base + "/v1/completions", body) as r:
            first = r.readline()
            started.wait(30)
            got[k] = read_stream([first, *r])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    started.wait(30)  # every stream runs: now the server is told to stop
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    proc.wait(60)
    assert proc.returncode == 0, proc.stdout.read()
    assert sorted(got) == [0, 1, 2] and all(len(ids) == 200 and reason == "length" for _, ids, reason in got.values()), \
        [(len(ids), reason) for _, ids, reason in got.values()]
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, "the engine process and the resource tracker to exit")
    assert engine in pids


def test_the_engine_process_killed_turns_health_503_and_fails_open_requests(checkpoint):
    proc, base = launch(checkpoint)
    try:
        wait_up(proc, base)
        answers: dict[str, object] = {}
        streaming = threading.Event()

        def client(stream: bool) -> None:
            body = {"prompt": "summarize: never finished", "max_tokens": 20000, "min_tokens": 20000,
                    "stream": stream}
            try:
                with post(base + "/v1/completions", body, timeout=60) as r:
                    first = r.readline()  # (a stream's first event: its status is 200 now)
                    streaming.set()
                    answers[f"stream={stream}"] = [line for line in (first + r.read()).decode().splitlines() if line]
            except urllib.error.HTTPError as exc:
                answers[f"stream={stream}"] = exc.code

        threads = [threading.Thread(target=client, args=(stream,)) for stream in (False, True)]
        for t in threads:
            t.start()
        assert streaming.wait(60), "the stream did not start"
        wait_until(lambda: metric(base, "hf_paged_t5_running_requests") == 2, 30, "both requests to run")
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert answers["stream=False"] == 500
        streamed = answers["stream=True"]
        assert '"error"' in streamed[-2] and streamed[-1] == "data: [DONE]", streamed[-3:]
        with pytest.raises(urllib.error.HTTPError) as info:
            get(base + "/health")
        assert info.value.code == 503 and "engine process exited" in info.value.read().decode()
        with pytest.raises(urllib.error.HTTPError) as info:  # a new request: the engine is gone
            post(base + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert info.value.code == 503
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.returncode == 0, proc.stdout.read()
    finally:
        stop(proc)


def test_the_http_process_killed_takes_the_engine_process_with_it(checkpoint):
    proc, base = launch(checkpoint)
    try:
        wait_up(proc, base)
        pids = children(proc.pid)
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not any(alive(pid) for pid in pids), 30, "the engine process to exit")
    finally:
        stop(proc)


def test_one_process_with_no_engine_process(checkpoint):
    proc, base = launch(checkpoint, "--no-engine-process")
    try:
        wait_up(proc, base)
        assert children(proc.pid) == []
        with post(base + "/v1/completions", {"prompt": "summarize: one process", "max_tokens": 5}) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) >= 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.returncode == 0, proc.stdout.read()
    finally:
        stop(proc)
