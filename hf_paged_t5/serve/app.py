"""The HTTP server: an OpenAI-style completions API over one `OnlineEngine` (Starlette).

    POST /v1/completions   OpenAI's fields: model, prompt (a string, a list of strings, token ids
                           or lists of them), max_tokens (16), min_tokens, stream (server-sent
                           events), temperature / top_p / seed per request, n (each completion one
                           engine request; with a seed, completion j draws with seed + j), stop
                           (up to 4 strings: the text ends before the first, its request stops)
    GET  /v1/models        the one model served
    GET  /health           200 while the engine runs, 503 after it stopped on an error
    GET  /metrics          Prometheus text: queue depth, running requests and rows, KV blocks used
                           and free, generated tokens, requests by status, request latency

For T5 the prompt is the encoder's input; the task prefix given at start (e.g. "summarize: ") is
put before each prompt. Every prompt of a request is one engine request; a client that disconnects
cancels them (their blocks go back to the pool at the next step). An option the engine does not
serve gets a 400 that names it. With `stream`, server-sent events carry each choice's text as it is
generated (greedy and sampling: step by step; beam search: at its end), the last with the finish
reason, then `data: [DONE]`. Each choice also carries its generated `token_ids` (the only output
of a server started without a tokenizer).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
import uuid
from types import MappingProxyType
from typing import Any, Optional, Union

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..batch.online import OnlineEngine
from ..batch.requests import BatchRequest
from ..kv.block_manager import PoolExhaustedError
from .engine_client import EngineClient

Engine = Union[OnlineEngine, EngineClient]  # what `create_app` serves: the engine here, or in its own process

MAX_N = 16  # completions per prompt a request may ask for
DISCONNECT_CHECK_S = 0.25  # how often a streaming request looks for its client gone
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# fields of OpenAI's completions request that are accepted only at the value that means "off"
OFF_VALUES = MappingProxyType({
    "logprobs": (None,), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, MappingProxyType({})),
})
KNOWN_FIELDS = frozenset({"model", "prompt", "max_tokens", "min_tokens", "temperature", "top_p", "n", "stop",
                          "stream", "seed", "user", "stream_options", *OFF_VALUES})


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


class Metrics:
    """The server's counters (thread-safe), written as Prometheus text."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.requests: dict[int, int] = {}
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def record(self, status: int, seconds: float, prompt_tokens: int = 0, generated: int = 0) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated
            bucket = next((i for i, edge in enumerate(LATENCY_BUCKETS) if seconds <= edge), len(LATENCY_BUCKETS))
            self.latency_counts[bucket] += 1
            self.latency_sum += seconds

    def text(self, engine: "Engine") -> str:
        stats, blocks = engine.stats(), engine.kv_blocks()
        used, free = blocks["used"], blocks["free"]
        lines = [
            "# HELP hf_paged_t5_queue_depth Requests submitted and not yet admitted.",
            "# TYPE hf_paged_t5_queue_depth gauge", f"hf_paged_t5_queue_depth {stats['queued']}",
            "# HELP hf_paged_t5_running_requests Requests admitted and not finished.",
            "# TYPE hf_paged_t5_running_requests gauge", f"hf_paged_t5_running_requests {stats['running']}",
            "# HELP hf_paged_t5_running_rows Decoder rows in the running decode loop.",
            "# TYPE hf_paged_t5_running_rows gauge", f"hf_paged_t5_running_rows {stats['rows']}",
            "# HELP hf_paged_t5_kv_blocks_used KV pool blocks held by requests.",
            "# TYPE hf_paged_t5_kv_blocks_used gauge", f"hf_paged_t5_kv_blocks_used {used}",
            "# HELP hf_paged_t5_kv_blocks_free KV pool blocks free.",
            "# TYPE hf_paged_t5_kv_blocks_free gauge", f"hf_paged_t5_kv_blocks_free {free}",
            "# HELP hf_paged_t5_kernel_binaries Triton kernel binaries loaded by the engine; a rise while "
            "serving is a new launch configuration (a compile stall on a cold cache).",
            "# TYPE hf_paged_t5_kernel_binaries gauge", f"hf_paged_t5_kernel_binaries {engine.kernel_binaries()}",
        ]
        with self.lock:
            lines += ["# HELP hf_paged_t5_generated_tokens_total Tokens generated for finished requests.",
                      "# TYPE hf_paged_t5_generated_tokens_total counter",
                      f"hf_paged_t5_generated_tokens_total {self.generated_tokens}",
                      "# HELP hf_paged_t5_prompt_tokens_total Encoder tokens of finished requests.",
                      "# TYPE hf_paged_t5_prompt_tokens_total counter",
                      f"hf_paged_t5_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP hf_paged_t5_requests_total HTTP completion requests by status code.",
                      "# TYPE hf_paged_t5_requests_total counter"]
            lines += [f'hf_paged_t5_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())]
            lines += ["# HELP hf_paged_t5_request_seconds Completion request latency.",
                      "# TYPE hf_paged_t5_request_seconds histogram"]
            cumulative = 0
            for edge, n in zip((*LATENCY_BUCKETS, "+Inf"), self.latency_counts):
                cumulative += n
                lines.append(f'hf_paged_t5_request_seconds_bucket{{le="{edge}"}} {cumulative}')
            lines += [f"hf_paged_t5_request_seconds_sum {self.latency_sum:.6f}",
                      f"hf_paged_t5_request_seconds_count {cumulative}"]
        return "\n".join(lines) + "\n"


def parse_completion(body: Any, model_name: str, greedy: bool, tokenizer) -> tuple:
    """(prompts: texts or token-id lists, max_tokens, min_tokens, stream, sampling: `BatchRequest`
    fields, n, stop strings) of a completions request; BadRequest otherwise. `temperature` 0 is greedy, > 0 samples
    at that temperature; absent, the server's own decoding (greedy unless started otherwise)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]}", param=unknown[0])
    if body.get("model") not in (None, model_name):
        raise BadRequest(f"the model {body['model']!r} does not exist; this server serves {model_name!r}",
                         param="model", status=404, code="model_not_found")
    for name, off in OFF_VALUES.items():
        if body.get(name) not in off:
            raise BadRequest(f"{name}={body[name]!r} is not served by this server", param=name)
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
    stops = body.get("stop")
    stops = [] if stops in (None, "", []) else [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    if stops and tokenizer is None:
        raise BadRequest("stop strings need the server's tokenizer (it was started without one)", param="stop")
    sampling = {}
    temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise BadRequest(f"temperature must be a number >= 0, got {temperature!r}", param="temperature")
        sampling = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=float(temperature))
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be a number in (0, 1], got {top_p!r}", param="top_p")
        if top_p < 1:
            if not sampling.get("do_sample") and not (sampling == {} and not greedy):
                raise BadRequest("top_p < 1 needs sampling: give a temperature > 0 (this server decodes greedily "
                                 "by default)", param="top_p")
            sampling["top_p"] = float(top_p)
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest(f"seed must be an integer, got {seed!r}", param="seed")
        sampling["seed"] = seed
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    min_tokens = body.get("min_tokens") or 0
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
        raise BadRequest(f"min_tokens must be an integer from 0 to max_tokens ({max_tokens}), got {min_tokens!r}",
                         param="min_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", param="stream")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_token(t) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest("prompt must be a non-empty string, a list of strings, a list of token ids, or a list of "
                         "lists of token ids", param="prompt")
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise BadRequest("this server has no tokenizer: give prompts as token ids", param="prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise BadRequest("a prompt is empty", param="prompt")
    return prompts, max_tokens, min_tokens, stream, sampling, n, stops


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def create_app(engine: Engine, model_name: str, prefix: str = "", max_queue: Optional[int] = None) -> Starlette:
    """The Starlette app serving `engine` (an `OnlineEngine` in this process, or the `EngineClient`
    of one in its own) as `model_name`; `prefix` goes before every text prompt; with `max_queue`, a
    request that finds that many inputs queued gets a 503. It uses of the engine: submit (a future
    that can be cancelled; the client's also says when the engine took the request), stats,
    kv_blocks, error, tokenizer, eos_token_ids and do_sample."""
    metrics = Metrics()
    tokenizer = engine.tokenizer
    greedy = not engine.do_sample
    created = int(time.time())
    eos = set(engine.eos_token_ids)

    def finish_reason(result, max_tokens: int) -> str:
        """"stop" at an EOS token, "length" at max_tokens (OpenAI's two reasons)."""
        tokens = result.token_ids
        if len(tokens) > 1 and tokens[-1] in eos:
            return "stop"
        return "length" if result.num_new_tokens >= max_tokens else "stop"

    def choice(index: int, result, max_tokens: int) -> dict:
        text = result.text if result.texts is not None else ""
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason(result, max_tokens),
                "token_ids": result.token_ids[1:]}

    handoffs: dict[int, _Handoff] = {}  # per event loop (one, unless the app is served by several)

    def handoff_for(loop: asyncio.AbstractEventLoop) -> _Handoff:
        if id(loop) not in handoffs or handoffs[id(loop)].loop is not loop:
            handoffs[id(loop)] = _Handoff(loop)
        return handoffs[id(loop)]

    async def completions(request: HttpRequest):
        start = time.perf_counter()
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(f"the request body is not JSON: {exc}") from exc
            prompts, max_tokens, min_tokens, stream, sampling, n, stops = parse_completion(
                body, model_name, greedy, tokenizer)
            if max_queue is not None and engine.stats()["queued"] + n * len(prompts) > max_queue:
                raise BadRequest(f"the server's queue is full ({max_queue} inputs); retry later", status=503,
                                 code="queue_full")
            futures = []
            watch = stream or bool(stops)  # the output is read as it is generated
            arrivals = _Arrivals(handoff_for(asyncio.get_running_loop())) if watch else None
            try:
                for p in prompts:  # choice i * n + j: the j-th completion of prompt i, as OpenAI numbers them
                    item = prefix + p if isinstance(p, str) else p
                    for j in range(n):
                        own = dict(sampling, seed=sampling["seed"] + j) if "seed" in sampling else sampling
                        futures.append(engine.submit(BatchRequest(item, max_new_tokens=max_tokens,
                                                                  min_new_tokens=min_tokens or None, **own),
                                                     on_tokens=arrivals.callback(len(futures)) if watch else None))
                for f in futures:  # an engine in another process checks a request there: its verdict
                    if getattr(f, "accepted", None) is not None:
                        await asyncio.wrap_future(f.accepted)
            except (ValueError, TypeError) as exc:
                for f in futures:
                    f.cancel()
                sampled = "sampling" in str(exc) or "seed" in str(exc) or "temperature" in str(exc)
                param = next((k for k in ("temperature", "top_p", "seed") if k in body), "prompt") if sampled \
                    else "prompt"
                raise BadRequest(f"{param}: {exc}", param=param) from exc
            except RuntimeError as exc:  # the engine is closed or stopped
                for f in futures:
                    f.cancel()
                raise BadRequest(str(exc), status=503) from exc
            except asyncio.CancelledError:  # the client went away while the engine took the request
                for f in futures:
                    f.cancel()
                raise
        except BadRequest as exc:
            metrics.record(exc.status, time.perf_counter() - start)
            return exc.response()
        ident = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model_name}
        if stream:
            # the first piece decides the status: a prompt the pool cannot hold gets its 400, not a 200
            pieces = _pieces(request, futures, arrivals, max_tokens, stops)
            try:
                first = await pieces.__anext__()
            except asyncio.CancelledError:
                metrics.record(499, time.perf_counter() - start)
                return PlainTextResponse("", status_code=499)
            if first[0] == "error" and len(futures) == 1:
                await pieces.aclose()
                return failed(first[2], start)
            return StreamingResponse(_events(first, pieces, head, start), media_type="text/event-stream")
        if stops:
            return await _collected(request, futures, arrivals, head, max_tokens, stops, start)
        waiting = [asyncio.wrap_future(f) for f in futures]
        while not all(w.done() for w in waiting):
            await asyncio.wait(waiting, timeout=0.05)
            if not all(w.done() for w in waiting) and await request.is_disconnected():
                for f in futures:
                    f.cancel()
                metrics.record(499, time.perf_counter() - start)
                return PlainTextResponse("", status_code=499)
        try:
            results = [w.result() for w in waiting]
        except Exception as exc:  # a prompt the pool cannot hold even alone (400), or the engine stopped
            return failed(exc, start)
        usage = _usage(results)
        metrics.record(200, time.perf_counter() - start, usage["prompt_tokens"], usage["completion_tokens"])
        return JSONResponse({**head, "choices": [choice(i, r, max_tokens) for i, r in enumerate(results)],
                             "usage": usage})

    def chunk(head: dict, index: int, text: str, tokens: list[int], reason: Optional[str]) -> str:
        body = {**head, "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": reason,
                                     "token_ids": tokens}]}
        return f"data: {json.dumps(body)}\n\n"

    async def _pieces(request, futures, arrivals, max_tokens, stops):
        """Each choice's output as it is generated: ("piece", index, text, token ids, finish reason or
        None) - the decoded tokens so far less what was given (a piece that would end inside a
        character waits; with stop strings, the last characters that could start one wait too) -;
        ("error", index, exception) for a choice that failed; then ("usage", usage). A choice whose
        text reaches a stop string ends there (the string left out, OpenAI's "stop") and its
        request is cancelled, its blocks back to the pool. A client gone cancels everything. The
        tokens that arrived while the client was being written to go out as one piece per choice."""
        loop = asyncio.get_running_loop()
        waiting = {asyncio.wrap_future(f): i for i, f in enumerate(futures)}
        for w in waiting:
            w.add_done_callback(arrivals.set)
        by_index = {i: w for w, i in waiting.items()}
        tokens: list[list[int]] = [[] for _ in futures]
        sent_text, sent_tokens = [""] * len(futures), [0] * len(futures)
        hold = max((len(x) for x in stops), default=1) - 1
        prompt_tokens = completion_tokens = 0
        next_check = loop.time() + DISCONNECT_CHECK_S

        detokenizers = [_Detokenizer(tokenizer) for _ in futures]

        def piece(i: int, final: Optional[str] = None) -> Optional[tuple[str, list[int], bool]]:
            text = final if final is not None else detokenizers[i].text(tokens[i])
            if text is None:  # a character split across tokens: wait
                return None
            cuts = [k for k in (text.find(x) for x in stops) if k >= 0]
            if cuts:
                text = text[: min(cuts)]
            elif final is None and hold:
                text = text[: max(len(sent_text[i]), len(text) - hold)]
            delta = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else ""
            new_tokens = tokens[i][sent_tokens[i]:]
            sent_text[i] += delta
            sent_tokens[i] = len(tokens[i])
            return delta, new_tokens, bool(cuts)

        pending = set(waiting)
        try:
            while pending:
                arrivals.wake.clear()
                grown = {}
                for i, new in arrivals.take():
                    if by_index[i] in pending:
                        tokens[i] += new
                        grown[i] = None
                for i in grown:  # (a choice stopped already drops the engine's last tokens before the cancel)
                    out = piece(i)
                    if out is None or not (out[0] or out[1] or out[2]):
                        continue
                    if out[2]:  # a stop string: this choice is done
                        futures[i].cancel()
                        pending.discard(by_index[i])
                        prompt_tokens += getattr(futures[i], "num_input_tokens", 0)
                        completion_tokens += len(tokens[i])
                    yield ("piece", i, out[0], out[1], "stop" if out[2] else None)
                for w in [w for w in pending if w.done()]:  # its tokens arrived before it resolved
                    pending.discard(w)
                    i = waiting[w]
                    try:
                        result = w.result()
                    except Exception as exc:  # noqa: BLE001 - reported per choice
                        yield ("error", i, exc)
                        continue
                    tokens[i] = result.token_ids[1:]
                    delta, new_tokens, stopped = piece(i, final=result.text if result.texts is not None else "")
                    prompt_tokens += result.num_input_tokens
                    completion_tokens += len(tokens[i])
                    yield ("piece", i, delta, new_tokens, "stop" if stopped else finish_reason(result, max_tokens))
                if not pending:
                    break
                if loop.time() >= next_check:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                    next_check = loop.time() + DISCONNECT_CHECK_S
                timer = loop.call_later(DISCONNECT_CHECK_S, arrivals.set)
                try:
                    await arrivals.wake.wait()
                finally:
                    timer.cancel()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        yield ("usage", {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens})

    async def _events(first, pieces, head, start):
        """Server-sent events of `_pieces` (its `first` event already taken), then [DONE]."""

        async def events():
            yield first
            async for event in pieces:
                yield event

        try:
            async for event in events():
                if event[0] == "piece":
                    yield chunk(head, *event[1:])
                elif event[0] == "error":
                    message, kind = _failure(event[2])
                    yield f"data: {json.dumps({'error': {'message': message, 'type': kind, 'index': event[1]}})}\n\n"
                else:
                    usage = event[1]
            yield "data: [DONE]\n\n"
            metrics.record(200, time.perf_counter() - start, usage["prompt_tokens"], usage["completion_tokens"])
        except (asyncio.CancelledError, GeneratorExit):
            metrics.record(499, time.perf_counter() - start)
            raise
        except Exception as exc:
            metrics.record(500, time.perf_counter() - start)
            yield f"data: {json.dumps({'error': {'message': f'generation failed: {exc}', 'type': 'server_error'}})}\n\n"

    def failed(exc: BaseException, start: float) -> JSONResponse:
        message, kind = _failure(exc)
        status = 400 if kind == "invalid_request_error" else 500
        metrics.record(status, time.perf_counter() - start)
        return BadRequest(message, param="prompt" if status == 400 else None, status=status).response()

    async def _collected(request, futures, arrivals, head, max_tokens, stops, start):
        """The JSON answer of a request whose output is watched for stop strings."""
        texts, ids, reasons = [""] * len(futures), [[] for _ in futures], [None] * len(futures)
        try:
            async for event in _pieces(request, futures, arrivals, max_tokens, stops):
                if event[0] == "piece":
                    _, i, delta, new_tokens, reason = event
                    texts[i] += delta
                    ids[i] += new_tokens
                    reasons[i] = reason or reasons[i]
                elif event[0] == "error":
                    for f in futures:
                        f.cancel()
                    return failed(event[2], start)
                else:
                    usage = event[1]
        except asyncio.CancelledError:
            metrics.record(499, time.perf_counter() - start)
            return PlainTextResponse("", status_code=499)
        metrics.record(200, time.perf_counter() - start, usage["prompt_tokens"], usage["completion_tokens"])
        choices = [{"text": t, "index": i, "logprobs": None, "finish_reason": r, "token_ids": k}
                   for i, (t, k, r) in enumerate(zip(texts, ids, reasons))]
        return JSONResponse({**head, "choices": choices, "usage": usage})

    async def models(request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "hf_paged_t5"}]})

    async def health(request: HttpRequest):
        error = engine.error
        if error is not None:
            return JSONResponse({"status": "error", "error": repr(error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(request: HttpRequest):
        return PlainTextResponse(metrics.text(engine), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ])


def _failure(exc: BaseException) -> tuple[str, str]:
    """(message, OpenAI error type) of a choice that failed in the engine."""
    if isinstance(exc, PoolExhaustedError):
        return f"the prompt does not fit the server's KV pool: {exc}", "invalid_request_error"
    return f"generation failed: {exc!r}", "server_error"


class _Detokenizer:
    """The text of one choice's tokens so far, decoded a few tokens at a time (as vLLM streams):
    each call decodes the tokens since the last piece together with the ones before it, and keeps
    what they add to the text of those before - not the whole output again per token, which makes a
    long streamed answer quadratic in its length. None while the last tokens end inside a character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = ""
        self.prefix = self.read = 0  # tokens[prefix:read]: the context of the next decode

    def text(self, tokens: list[int]) -> Optional[str]:
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        before = decode(tokens[self.prefix : self.read], skip_special_tokens=True)
        while not before and self.prefix:  # a context of special tokens alone decodes to nothing,
            self.prefix = max(0, self.prefix - 4)  # and the next token would lose its leading space
            before = decode(tokens[self.prefix : self.read], skip_special_tokens=True)
        now = decode(tokens[self.prefix :], skip_special_tokens=True)
        if now.endswith("\ufffd"):
            return None
        if now.startswith(before):
            self.decoded += now[len(before):]
        else:  # the context decodes differently with what follows it: decode everything once
            self.decoded = decode(tokens, skip_special_tokens=True)
        self.prefix, self.read = self.read, len(tokens)
        return self.decoded


class _Handoff:
    """New tokens from the engine's thread to the event loop, for every open request of one app:
    the engine appends to one queue and wakes the loop at most once until the loop has run (not
    once per request and step: under load the loop would spend its time, and the GIL the engine
    needs, on wake-ups)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: collections.deque = collections.deque()
        self._scheduled = False

    def send(self, arrivals: "_Arrivals", index: int, tokens: list[int]) -> None:
        """From the engine's thread."""
        self.queue.append((arrivals, index, tokens))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False  # before the queue is read: a later send schedules another delivery
        while self.queue:
            arrivals, index, tokens = self.queue.popleft()
            arrivals.queue.append((index, tokens))
            arrivals.wake.set()


class _Arrivals:
    """The new tokens of one HTTP request's choices, on the event loop."""

    def __init__(self, handoff: _Handoff) -> None:
        self.handoff = handoff
        self.queue: collections.deque = collections.deque()
        self.wake = asyncio.Event()

    def callback(self, index: int):
        """The engine's `on_tokens` for choice `index`."""
        return lambda tokens: self.handoff.send(self, index, tokens)

    def set(self, *_: Any) -> None:
        """Wake the reader (a choice resolved, or the disconnect check is due)."""
        self.wake.set()

    def take(self) -> list[tuple[int, list[int]]]:
        """Every (choice, new tokens) that arrived, in order."""
        out = []
        while self.queue:
            out.append(self.queue.popleft())
        return out


def _usage(results) -> dict:
    prompt = sum(r.num_input_tokens for r in results)
    completion = sum(r.num_new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
