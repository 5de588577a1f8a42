"""`EngineClient`: an `OnlineEngine` in its own process, seen from the HTTP server's process.

    engine = EngineClient.start(EngineOptions(model=path, device="cuda"), tokenizer)   # loads there
    future = engine.submit(BatchRequest(ids, max_new_tokens=32), on_tokens=callback)
    await asyncio.wrap_future(future.accepted)     # the engine's verdict on the request (raises)
    result = await asyncio.wrap_future(future)     # a BatchResult, its texts decoded here
    engine.close(timeout=30)

Why: the event loop (HTTP, JSON, server-sent events, tokenizing) and the engine's decode loop
(CUDA graph launches and per-step host work) in one process share one GIL, and each slows the
other; in two processes they run side by side (as vLLM splits its API server from its engine).

The client offers the part of `OnlineEngine` that `serve.app.create_app` uses: `submit` (a
concurrent future that can be cancelled, with `num_input_tokens` and `accepted`), `stats`,
`kv_blocks`, `error`, `tokenizer`, `eos_token_ids`, `do_sample` and `close`. Text prompts are
tokenized here and results decoded here; the engine process sees token ids only. One reader thread
takes the engine's messages (one per engine step, every request's new tokens in it) and calls the
`on_tokens` callbacks and settles the futures, as the engine's own thread does in process. An
engine process that ends unexpectedly turns into `error` (a server's /health says 503) and fails
every open request; the engine process ends by itself when this process is gone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import threading
from typing import Any, Callable, Optional

from ..batch.requests import BatchRequest, BatchResult
from . import engine_process
from .engine_process import CARRIED, EngineOptions

__all__ = ["EngineClient", "EngineOptions", "EngineStartError"]

CLOSE_MARGIN_S = 60.0  # beyond the drain: what a close waits for the engine process before it kills it


class EngineStartError(RuntimeError):
    """The engine process could not load the model or start its engine (the message says why)."""


def rebuilt(error: tuple[str, str]) -> BaseException:
    """The exception an `engine_process.carried` pair describes."""
    name, message = error
    return CARRIED.get(name, RuntimeError)(message)


@dataclasses.dataclass
class _Open:
    """A request the engine process has not finished."""

    future: concurrent.futures.Future
    on_tokens: Optional[Callable[[list[int]], None]]


class EngineClient:
    """The HTTP process's side of an `OnlineEngine` in the engine process (`start` makes one)."""

    def __init__(self, conn, process, tokenizer: Any, facts: dict) -> None:
        self._conn, self._process, self._tokenizer = conn, process, tokenizer
        self._eos, self._do_sample = tuple(facts["eos_token_ids"]), bool(facts["do_sample"])
        self._lock = threading.Lock()  # the open requests, the next id, the stats
        self._send_lock = threading.Lock()  # one message at a time (the reader never waits for it)
        self._open: dict[int, _Open] = {}
        self._next_id = 1
        self._stats = dict(queued=0, running=0, rows=0, received=0, kv_blocks_used=0, kv_blocks_free=0)
        self._error: Optional[BaseException] = None
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="hf_paged_t5-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, options: EngineOptions, tokenizer: Any = None) -> "EngineClient":
        """Start the engine process (spawned: a fresh interpreter, CUDA untouched here) and wait
        until its model is loaded; EngineStartError with its one-line reason if it cannot be."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=engine_process.main, args=(theirs, options), name="hf_paged_t5-engine")
        process.start()
        theirs.close()  # ours alone now: the engine process's end closing is its exit
        try:
            message = ours.recv()
        except (EOFError, OSError):
            process.join(10)
            raise EngineStartError(f"the engine process exited (status {process.exitcode}) before its model "
                                   "loaded") from None
        if message[0] != "ready":
            process.join(30)
            raise EngineStartError(message[1])
        return cls(ours, process, tokenizer, message[1])

    # ---- what the app uses ------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def do_sample(self) -> bool:
        return self._do_sample

    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the engine (its thread's error, or its process gone), None while it runs."""
        return self._error

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    def submit(self, item, on_tokens: Optional[Callable[[list[int]], None]] = None) -> concurrent.futures.Future:
        """As `OnlineEngine.submit`, but the engine process checks the request: the future's
        `accepted` (a future of None) raises what `OnlineEngine.submit` would have raised. A text
        is tokenized here."""
        limits = item if isinstance(item, BatchRequest) else BatchRequest(item)
        if isinstance(limits.inputs, str):
            if self._tokenizer is None:
                raise ValueError("the input is a text, but the engine client was given no tokenizer")
            limits = dataclasses.replace(limits, inputs=list(self._tokenizer(limits.inputs)["input_ids"]))
        elif not isinstance(limits.inputs, list):  # a tensor or another sequence of ids
            ids = limits.inputs.tolist() if hasattr(limits.inputs, "tolist") else list(limits.inputs)
            limits = dataclasses.replace(limits, inputs=ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.num_input_tokens = len(limits.inputs)
        future.accepted = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            ident = self._next_id
            self._next_id += 1
            self._open[ident] = _Open(future, on_tokens)
        try:
            self._send(("submit", ident, limits, on_tokens is not None))
        except OSError as exc:  # the engine process is gone (the reader is about to say so)
            with self._lock:
                self._open.pop(ident, None)
            raise RuntimeError(f"the engine process is gone: {exc}") from exc
        future.add_done_callback(lambda f: f.cancelled() and self._cancel(ident))
        return future

    def stats(self) -> dict[str, int]:
        """As `OnlineEngine.stats`, from the engine's last step; the open requests sent after it count as queued."""
        with self._lock:
            stats = self._stats
            unseen = sum(1 for ident in self._open if ident > stats["received"])
        return dict(queued=stats["queued"] + unseen, running=stats["running"], rows=stats["rows"])

    def kernel_binaries(self) -> int:
        """As `OnlineEngine.kernel_binaries`, in the engine's process, from its last step."""
        with self._lock:
            return int(self._stats.get("kernel_binaries", 0))

    def kv_blocks(self) -> dict[str, int]:
        """As `OnlineEngine.kv_blocks`, from the engine's last step."""
        with self._lock:
            return dict(used=self._stats["kv_blocks_used"], free=self._stats["kv_blocks_free"])

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """As `OnlineEngine.close`: the engine finishes what runs (or cancels it; after `timeout`
        seconds, what is left), gives its blocks back, and its process exits."""
        with self._lock:
            already, self._closing = self._closing, True
        if not already and self._process.is_alive():
            try:
                self._send(("close", 0.0 if cancel else timeout))
            except OSError:  # it is ending anyway
                pass
        self._reader.join(None if timeout is None or cancel else timeout + CLOSE_MARGIN_S)
        self._process.join(CLOSE_MARGIN_S if self._process.is_alive() else None)
        if self._process.is_alive():  # (it did not finish its close: nothing it holds is worth more waiting)
            self._process.kill()
            self._process.join()
        self._conn.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    # ---- internals: checks, messages out, and the reader thread's handling of messages in -----------
    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error!r}") from self._error
        if self._closing:
            raise RuntimeError("the engine is closed: make a new engine to submit more")

    def _cancel(self, ident: int) -> None:
        with self._lock:
            entry = self._open.pop(ident, None)
            if entry is None:
                return
            gone = self._closing or self._error is not None
        entry.future.accepted.cancel()
        if not gone:
            try:
                self._send(("cancel", ident))
            except OSError:  # the engine process is gone; the reader says so
                pass

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "step":
                    self._step(*message[1:])
                elif message[0] == "acks":
                    self._acks(message[1])
                elif message[0] == "closed":
                    break
        except (EOFError, OSError):
            pass
        self._ended()

    def _step(self, tokens, done, stats: dict, error) -> None:
        with self._lock:
            self._stats = stats
            if error is not None and self._error is None:
                self._error = rebuilt(error)
            opened = [(self._open.get(ident), new) for ident, new in tokens]
            ended = [(self._open.pop(ident, None), outcome) for ident, outcome in done]
        for entry, new in opened:  # (the app's callbacks coalesce: one wake-up of its loop per step)
            if entry is not None and entry.on_tokens is not None:
                entry.on_tokens(new)
        for entry, outcome in ended:
            if entry is None:
                continue
            if isinstance(outcome, BatchResult):
                texts = None if self._tokenizer is None else self._tokenizer.batch_decode(
                    outcome.sequences, skip_special_tokens=True)
                _settle(entry.future, result=dataclasses.replace(outcome, texts=texts))
            else:
                _settle(entry.future, exc=rebuilt(outcome))

    def _acks(self, acks) -> None:
        for ident, failure in acks:
            with self._lock:
                entry = self._open.get(ident) if failure is None else self._open.pop(ident, None)
            if entry is None:
                continue
            if failure is None:
                _settle(entry.future.accepted, result=None)
            else:
                exc = rebuilt(failure)
                _settle(entry.future.accepted, exc=exc)
                _settle(entry.future, exc=exc)

    def _ended(self) -> None:
        """The engine process said closed, or its connection ended: every open request fails."""
        self._process.join(1.0)
        with self._lock:
            if not self._closing and self._error is None:
                code = self._process.exitcode
                self._error = RuntimeError("the engine process exited unexpectedly"
                                           + ("" if code is None else f" (status {code})"))
            error = self._error or RuntimeError("the engine is closed")
            entries, self._open = list(self._open.values()), {}
        for entry in entries:
            _settle(entry.future.accepted, exc=error)
            _settle(entry.future, exc=error)


def _settle(future: concurrent.futures.Future, result=None, exc: Optional[BaseException] = None) -> None:
    """Give `future` its result or error, unless it is done or was cancelled meanwhile."""
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the set
        pass
