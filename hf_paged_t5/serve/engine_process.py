"""The engine's own process: `main` loads the model, runs one `OnlineEngine` over it and answers the
`EngineClient` of the HTTP process through one `multiprocessing` connection (started with spawn,
so CUDA is first touched here). The HTTP process tokenizes and detokenizes; this one sees token ids
only (its engine has no tokenizer).

Messages in (tuples, first the kind):
    ("submit", id, BatchRequest with token ids, whether to stream its tokens)
    ("cancel", id)
    ("close", drain seconds or None)    finish what runs (cancel what is left after the drain), exit
Messages out:
    ("ready", facts)  or  ("failed", one line)      once, after the model loaded or did not
    ("acks", [(id, None or carried error), ...])    the verdict of each submit, right away
    ("step", tokens, done, stats, error)            one per engine step: every streamed request's new
                                                    tokens [(id, [ids])], the requests that ended
                                                    [(id, BatchResult or carried error)], the stats,
                                                    the engine's error (carried) or None
    ("closed",)                                     the last message
A carried error is (the exception's type name, its message); `engine_client.rebuilt` makes it
again on the other side. The connection's end (the HTTP process gone) cancels everything and ends
this process.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from types import MappingProxyType
from typing import Any, Optional

from ..kv.block_manager import PoolExhaustedError

logger = logging.getLogger(__name__)

# the exception types that cross the boundary as themselves (an error of another type crosses as
# a RuntimeError naming it); the app answers each with its own status
CARRIED = MappingProxyType({cls.__name__: cls for cls in (ValueError, TypeError, RuntimeError, PoolExhaustedError)})


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the engine process needs to load the model and start its `OnlineEngine`.

    model: checkpoint directory; device: as resolved by the CLI; dtype: the --dtype choice
    ("auto" is resolved here, where CUDA may be touched); generate_kwargs: the task's generation
    defaults; log_level: the HTTP process's root log level; warm_up: run `OnlineEngine.warm_up` before
    answering "ready"."""

    model: str
    device: str
    dtype: str = "auto"
    max_batch_tokens: Optional[int] = None
    max_batch_rows: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    generate_kwargs: dict = dataclasses.field(default_factory=dict)
    log_level: int = logging.WARNING
    warm_up: bool = True


def carried(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of `exc` for the other process: its own type if CARRIED has it, else the
    nearest base that is there, the message then naming the real type."""
    for cls in type(exc).__mro__:
        if cls.__name__ in CARRIED and CARRIED[cls.__name__] is cls:
            return cls.__name__, str(exc) if cls is type(exc) else f"{type(exc).__name__}: {exc}"
    return "RuntimeError", f"{type(exc).__name__}: {exc}"


def main(conn, options: EngineOptions) -> None:
    """The engine process's body (the target of `EngineClient.start`)."""
    logging.basicConfig(level=options.log_level, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the HTTP process leads the drain
    send = _Sender(conn)
    try:
        engine, outbox = _start(options, send)
    except Exception as exc:  # noqa: BLE001 - reported in one line by the HTTP process, which exits 2
        send(("failed", str(exc) or repr(exc)))
        conn.close()
        return
    send(("ready", dict(eos_token_ids=engine.eos_token_ids, do_sample=engine.do_sample)))
    try:
        _serve(conn, engine, outbox, send)
    finally:
        conn.close()


def _start(options: EngineOptions, send) -> tuple[Any, "_Outbox"]:
    from transformers import AutoModelForSeq2SeqLM

    from ..batch import cli as batch_cli
    from ..batch.online import OnlineEngine
    from ..hf.patch import is_patched, patch_model

    model_config = batch_cli.read_model_config(options.model)
    dtype, why = batch_cli.resolve_dtype(options.dtype, options.device, model_config)
    logger.info("model on %s in %s (%s)", options.device, str(dtype).replace("torch.", ""), why)
    model = AutoModelForSeq2SeqLM.from_pretrained(options.model, dtype=dtype).to(options.device).eval()
    if not is_patched(model):
        patch_model(model)
    outbox = _Outbox(send)
    engine = OnlineEngine(model, None, max_batch_tokens=options.max_batch_tokens,
                          max_batch_rows=options.max_batch_rows,
                          gpu_memory_utilization=options.gpu_memory_utilization, on_step=outbox.flush,
                          **options.generate_kwargs)
    if options.warm_up:
        engine.warm_up()  # (the outbox sends nothing of it: its engine is not set yet)
    outbox.engine = engine
    return engine, outbox


def _serve(conn, engine, outbox: "_Outbox", send) -> None:
    """Answer the HTTP process until it says close or is gone."""
    futures: dict[int, Any] = {}  # id -> the engine's future, while it runs
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone: nobody waits for anything
            logger.warning("the HTTP process is gone: the engine process cancels its requests and exits")
            engine.close(cancel=True)
            return
        acks = []
        while True:  # every message already here, then one answer for all their submits
            if message[0] == "submit":
                acks.append(_submit(engine, outbox, futures, *message[1:]))
            elif message[0] == "cancel":
                future = futures.pop(message[1], None)
                if future is not None:
                    future.cancel()
            elif message[0] == "close":
                if acks:
                    send(("acks", acks))
                engine.close(timeout=message[1])
                outbox.flush()
                send(("closed",))
                return
            if not conn.poll():
                break
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # seen again by the outer recv
        if acks:
            send(("acks", acks))


def _submit(engine, outbox: "_Outbox", futures: dict, ident: int, request, stream: bool) -> tuple:
    try:
        future = engine.submit(request, on_tokens=outbox.tokens_of(ident) if stream else None)
    except Exception as exc:  # noqa: BLE001 - the client raises it again, as at an in-process submit
        outbox.received = ident
        return ident, carried(exc)
    futures[ident] = future
    outbox.received = ident
    future.add_done_callback(lambda f: (futures.pop(ident, None), outbox.settled(ident, f)))
    if future.done() and not future.cancelled():  # it ended before the callback was in place:
        outbox.flush()  # its step's message left without it
    return ident, None


class _Sender:
    """`conn.send` for the two threads that send (the engine's and the main one), one at a time."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def __call__(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


class _Outbox:
    """What the engine produced since the last step's message: new tokens and ended requests, sent
    with the stats as one message per step (`flush`, the engine's on_step)."""

    def __init__(self, send: _Sender) -> None:
        self.send = send
        self.engine = None
        self.lock = threading.Lock()
        self.tokens: list[tuple[int, list[int]]] = []
        self.done: list[tuple[int, Any]] = []
        self.received = 0  # the last id submitted, counted in the stats' "received"
        self._last: Optional[tuple] = None  # (stats, error) last sent

    def tokens_of(self, ident: int):
        """The on_tokens callback of request `ident` (the engine's thread)."""
        def on_tokens(tokens: list[int]) -> None:
            with self.lock:
                self.tokens.append((ident, tokens))
        return on_tokens

    def settled(self, ident: int, future) -> None:
        if future.cancelled():  # the client cancelled it: it knows
            return
        exc = future.exception()
        with self.lock:
            self.done.append((ident, future.result() if exc is None else carried(exc)))

    def flush(self) -> None:
        engine = self.engine
        if engine is None:
            return
        received = self.received  # (read before the stats: a request counted twice, never missed)
        stats = dict(engine.stats(), received=received, kernel_binaries=engine.kernel_binaries(),
                     **{f"kv_blocks_{k}": v for k, v in engine.kv_blocks().items()})
        error = None if engine.error is None else carried(engine.error)
        with self.lock:
            tokens, self.tokens = self.tokens, []
            done, self.done = self.done, []
            if not tokens and not done and self._last == (stats, error):
                return
            self._last = (stats, error)
            self.send(("step", tokens, done, stats, error))
