"""`OnlineEngine`: the batch engine fed by requests that arrive at any time, from any thread.

    engine = OnlineEngine(model, tokenizer, max_new_tokens=128)
    future = engine.submit("summarize: ...")         # a concurrent.futures.Future
    print(future.result().text)                      # asyncio: await asyncio.wrap_future(future)
    future.cancel()                                  # also while it runs: its blocks go back
    engine.close()

One background thread runs one `BatchRun` for the engine's life: a submitted request joins the
running decode loop at its next step (admitted as `BatchGenerator` admits: while rows, the KV
token budget and the pool allow), and each result is what patched `generate()` returns for that
input alone. The thread sleeps while nothing is queued or running. A request is checked in the
caller's thread (`BatchGenerator.make_request`: clear errors before it is queued). A cancelled
future's request leaves the queue, or, running, gives its blocks back within the next step.

Options are the generator's (`BatchGenerator`'s arguments: one generation config for the engine);
per request: `BatchRequest`'s max / min new tokens and EOS ids. Weights edited in place after the
engine starts are not seen by its bias tables (they are checked once, at start). `on_step`, if
given, is called from the engine's thread after each step, once that step's tokens were handed to
the `on_tokens` callbacks and its futures settled (a server in another process sends one message
per step from it).

The engine's thread gives up the GIL in every torch call; an event loop in the same process that
is busy (many streams) holds each of those calls up to Python's switch interval, 5 ms by default.
`python -m hf_paged_t5 serve` sets 0.2 ms (`sys.setswitchinterval`); an app of your own that
serves the engine may want the same.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Optional

from ..kv.block_manager import PoolExhaustedError
from ..hf import forward as hf_forward
from ..model import encoder_graphs
from ..model.attention import kernel_binaries
from .generator import BatchGenerator, InputItem
from .requests import BatchRequest, Request
from .run import BatchRun

logger = logging.getLogger(__name__)

# `OnlineEngine.warm_up`'s waves: (requests at once, their input lengths in turn). One row, two and
# four (the fused decode layer's row counts), a large batch (the op-by-op layer, the batch-64 decode
# attention), each with short inputs and inputs past 1,024 tokens (prefill's and decode attention's
# next launch configurations: `kernels/launch.py`); "many" is min(64, max_batch_rows) rows.
WARM_UP_WAVES = ((1, (32,)), (1, (1100,)), (2, (32,)), (4, (32, 1100)), ("many", (32, 1100)))
WARM_UP_NEW_TOKENS = 3


class _OnlineRun(BatchRun):
    """A `BatchRun` whose inputs come from the engine's queue and may run dry for now."""

    def __init__(self, generator: BatchGenerator, engine: "OnlineEngine") -> None:
        super().__init__(generator, ())
        self.engine = engine

    def _next_item(self):
        return self.engine._pop()


class OnlineEngine:
    """Continuous batching over requests submitted at any time. Arguments: as `BatchGenerator`'s."""

    def __init__(self, model, tokenizer: Any = None, generation_config=None, max_batch_tokens: Optional[int] = None,
                 max_batch_rows: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 on_step: Optional[Callable[[], None]] = None, **generate_kwargs: Any) -> None:
        self.generator = BatchGenerator(model, tokenizer, generation_config, max_batch_tokens, max_batch_rows,
                                        gpu_memory_utilization, **generate_kwargs)
        self._cond = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._requests: dict[int, Request] = {}
        self._cancelled: list[Request] = []
        self._next_index = 0
        self._closing = False
        self._error: Optional[BaseException] = None
        self._on_step = on_step
        self._run = _OnlineRun(self.generator, self)
        self._thread = threading.Thread(target=self._loop, name="hf_paged_t5-online", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------
    def submit(self, item: InputItem, on_tokens: Optional[Callable[[list[int]], None]] = None
               ) -> concurrent.futures.Future:
        """Queue one input (a text, token ids or a `BatchRequest`); a Future of its `BatchResult`.
        Bad input raises here, in the caller's thread; nothing is queued then.

        on_tokens: called from the engine's thread with each batch of new token ids of the first
        sequence, before the Future resolves: every step for greedy and sampling (read back one step
        late), once at the end for beam search. It must be quick and must not raise.
        """
        with self._cond:
            self._check_open()
            index = self._next_index
            self._next_index += 1
        request = self.generator.make_request(index, item)
        request.on_tokens = on_tokens
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.num_input_tokens = len(request.ids)  # the encoder tokens of the input, for a caller's count
        with self._cond:
            self._check_open()
            self._futures[index] = future
            self._requests[index] = request
            self._queue.append(request)
            self._cond.notify()
        future.add_done_callback(lambda f, request=request: f.cancelled() and self._on_cancel(request))
        return future

    def warm_up(self, force: bool = False) -> float:
        """Run `WARM_UP_WAVES` of synthetic requests (token ids, 3 new tokens forced) through the
        engine, then (where the engine's encoder graphs run) one lone input per `encoder_graphs.BUCKETS`
        length, and wait for them, so the Triton kernels and CUDA graphs of the row counts and input
        lengths a server meets are built before its first request, not while requests wait behind a
        compile (~1 s each on an H200, a dozen of them). Only on a CUDA device (the CPU backend
        compiles nothing) unless `force`; returns the seconds it took (0.0 when skipped)."""
        if self.generator.device.type != "cuda" and not force:
            return 0.0
        start = time.perf_counter()
        gen = self.generator
        specials = {gen.pad_id, *gen.eos}
        tokens = [t for t in range(min(int(gen.model.config.vocab_size), 1024)) if t not in specials]
        many = max(1, min(64, gen.max_batch_rows) // gen.expand)
        skipped: set[int] = set()
        # then one lone input per encoder bucket, one at a time: the batch engine's encoder graphs
        # (one per bucket, `BatchRun._encode_graphed`) are captured now, not under load
        graphed = gen.runtime.config.cuda_graphs and gen.device.type in hf_forward.GRAPH_DEVICE_TYPES
        buckets = tuple((1, (length,)) for length in encoder_graphs.BUCKETS) if graphed else ()
        for count, lengths in (*WARM_UP_WAVES, *buckets):
            count = many if count == "many" else count
            futures = []
            for i in range(count):
                length = lengths[i % len(lengths)]
                if length in skipped:
                    continue
                ids = [tokens[(7 * j + i) % len(tokens)] for j in range(length)]
                request = BatchRequest(ids, max_new_tokens=WARM_UP_NEW_TOKENS, min_new_tokens=WARM_UP_NEW_TOKENS)
                try:
                    futures.append((length, self.submit(request)))
                except ValueError:  # more than the engine's token budget takes: not a shape it will meet
                    skipped.add(length)
            for length, future in futures:
                try:
                    future.result()
                except PoolExhaustedError:  # nor one its pool can hold
                    skipped.add(length)
        if skipped:
            logger.info("warm-up: inputs of %s tokens skipped (too large for this engine's budget or pool)",
                        sorted(skipped))
        seconds = time.perf_counter() - start
        logger.info("warm-up: %d waves of synthetic requests and %d encoder buckets in %.1f s", len(WARM_UP_WAVES),
                    len(buckets), seconds)
        return seconds

    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the engine's thread, or None while it runs (or after a clean close)."""
        return self._error

    def stats(self) -> dict[str, int]:
        """queued: submitted, not yet admitted; running: admitted, not finished; rows: decoder rows now."""
        with self._cond:
            return dict(queued=len(self._queue) + len(self._run.waiting), running=len(self._run.running),
                        rows=self._run.live_rows)

    def kernel_binaries(self) -> int:
        """Triton binaries of this package's kernels loaded in this process so far (0 where no
        Triton kernel ran, e.g. the CPU backend): a rise while serving is a launch that met a new
        configuration, and waited for its compile unless Triton's cache held it."""
        return kernel_binaries()

    def kv_blocks(self) -> dict[str, int]:
        """used: KV pool blocks held by requests now; free: blocks free (both 0 before the first step)."""
        pool = self.generator.runtime.pool
        if pool is None:
            return dict(used=0, free=0)
        free = pool.manager.num_free
        return dict(used=pool.num_blocks - free - 1, free=free)  # the pool's one scratch block is not a request's

    # what a server reads of the generator it serves
    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.generator.eos)

    @property
    def do_sample(self) -> bool:
        """Whether the engine samples by default (else greedy or beam search)."""
        return bool(self.generator.config.do_sample)

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stop taking requests; finish the queued and running ones (or, `cancel=True`, cancel them;
        with a `timeout`, cancel what is left after that many seconds); then stop the thread and
        return every block to the pool."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if not cancel:
            self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                pending = list(self._futures.values())
            for future in pending:
                future.cancel()
            self._thread.join()

    def __enter__(self) -> "OnlineEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error!r}") from self._error
        if self._closing:
            raise RuntimeError("the engine is closed: make a new OnlineEngine to submit more")

    def _on_cancel(self, request: Request) -> None:
        with self._cond:
            if request.index in self._futures:
                self._cancelled.append(request)
                self._cond.notify()

    # ---- the engine's thread --------------------------------------------------------------------
    def _pop(self):
        """The next queued request as (index, request), None if none now, StopIteration once closed."""
        with self._cond:
            while self._queue:
                request = self._queue.popleft()
                if not request.cancelled and not self._futures[request.index].cancelled():
                    return request.index, request
                self._forget(request)
            if self._closing:
                raise StopIteration
            return None

    def _forget(self, request: Request) -> None:
        self._futures.pop(request.index, None)
        self._requests.pop(request.index, None)

    def _loop(self) -> None:
        run = self._run
        dropping: list[Request] = []  # cancelled while running: retired within the next step
        try:
            with self.generator.runtime.runner.lock:
                self.generator.runtime.check_weights()
            while True:
                with self._cond:
                    # (run.waiting: a request taken from the queue that waits for room; it runs once
                    # the others finish, with nothing new submitted)
                    while not (self._queue or run.waiting or run.running or self._cancelled or self._closing):
                        self._cond.wait()
                    cancelled, self._cancelled = self._cancelled, []
                for request in cancelled:
                    running = request in run.running
                    run.cancel(request)
                    if running:
                        dropping.append(request)
                    else:
                        with self._cond:
                            self._forget(request)
                try:
                    finished = run.step()
                except PoolExhaustedError as exc:  # one input too large for the pool even alone: its error
                    request = run.waiting.popleft()
                    with self._cond:
                        future = self._futures.get(request.index)
                        self._forget(request)
                    _settle(future, exc=exc)
                    self._stepped()
                    continue
                if finished is None:
                    break
                for result in finished:
                    with self._cond:
                        future = self._futures.get(result.index)
                        self._forget(self._requests[result.index])
                    _settle(future, result=result)
                if dropping:
                    gone = [r for r in dropping if r not in run.running]
                    dropping = [r for r in dropping if r in run.running]
                    with self._cond:
                        for request in gone:
                            self._forget(request)
                self._stepped()
        except BaseException as exc:  # every waiting caller gets the error; the engine stops
            logger.error("hf_paged_t5: the online engine stopped: %r", exc)
            with self._cond:
                self._error = exc
                futures = list(self._futures.values())
                self._futures.clear()
                self._requests.clear()
                self._queue.clear()
            for future in futures:
                _settle(future, exc=exc)
            with contextlib.suppress(Exception):  # (a hook that fails now has nothing left to report)
                self._stepped()
        finally:
            run.close()

    def _stepped(self) -> None:
        if self._on_step is not None:
            self._on_step()


def _settle(future: Optional[concurrent.futures.Future], result=None, exc: Optional[BaseException] = None) -> None:
    """Give `future` its result or error, unless it is gone or was cancelled meanwhile."""
    if future is None or future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the set
        pass
