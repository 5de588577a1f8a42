"""`python -m hf_paged_t5 serve --model PATH`: the OpenAI-style server (`serve.app`) on uvicorn.

Everything that can be checked without the weights is checked first (the extra installed, the
checkpoint's config, the task, the options), each problem in one line; then the model loads, is
patched, and the server binds --host (127.0.0.1 unless told otherwise) and --port.

By default the engine (the model and its `OnlineEngine`) runs in a process of its own
(`engine_process`, spawned), the HTTP server in this one with the tokenizer (`EngineClient`): the
event loop and the decode loop then do not share a GIL. `--no-engine-process` runs both here, the
engine in a thread. A model that does not load is one line and exit status 2 either way, before
the server binds its port.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import signal
import sys

from ..batch import cli as batch_cli
from ..batch.cli import CliError

# With --no-engine-process the engine's thread and the event loop share the GIL, and the engine gives
# it up in every torch call: with Python's default 5 ms switch interval, a loop busy with many
# streams would hold each of those calls up to 5 ms, stretching a decode step many times over.
# 0.2 ms bounds that wait.
SWITCH_INTERVAL_S = 0.0002

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch_cli.add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--task", default=None,
                        help="task_specific_params key whose prefix and generation defaults apply to every prompt, "
                             "e.g. summarization or translation_en_to_de (default: none)")
    parser.add_argument("--max-queue", type=int, default=None, metavar="N",
                        help="inputs waiting for admission beyond which a request gets a 503 (default: no limit)")
    parser.add_argument("--drain", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM / Ctrl-C, seconds the running requests get to finish (default: 30)")
    parser.add_argument("--model-name", default=None,
                        help="the name clients give as `model` (default: the checkpoint directory's name)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the model and its engine in a process of their own, the HTTP server and the "
                             "tokenizer in this one, so that the two do not share one GIL (default); "
                             "--no-engine-process: one process, the engine in a thread")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU, run a few waves of synthetic requests (1-64 rows, short and 1,100-token "
                             "inputs, then one input per encoder length bucket) before serving, so that kernel "
                             "compiles and graph captures happen before the first request, not while requests "
                             "wait (default); --no-warm-up: serve at once")


def check_options(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise CliError("serve needs Starlette and uvicorn: pip install 'hf_paged_t5[serve]'")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: must be 0-65535")
    for option in ("max_queue", "batch_tokens", "batch_rows"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise CliError(f"--{option.replace('_', '-')} {value}: must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise CliError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1], "
                       "the fraction of the GPU's memory the server may fill; e.g. 0.9")


def run(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except (CliError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2


def _serve(args: argparse.Namespace) -> int:
    import os

    check_options(args)
    device = batch_cli.resolve_device(args.device)
    model_config = batch_cli.read_model_config(args.model)
    key, prefix, defaults = batch_cli.task_settings(model_config, "generate", args.task)
    batch_cli.log_task(key, prefix, defaults, args.task)
    name = args.model_name or os.path.basename(os.path.normpath(args.model))
    # max_tokens comes with each request; the task's other defaults (beams, penalties) are the engine's
    kwargs = {k: v for k, v in defaults.items() if k not in ("max_length", "max_new_tokens", "min_length")}

    import uvicorn

    from .app import create_app

    engine = _engine_process(args, device, kwargs) if args.engine_process else _engine_here(args, device,
                                                                                           model_config, kwargs)
    _Server = _server_class()
    app = create_app(engine, name, prefix=prefix, max_queue=args.max_queue)
    logger.info("serving %r on http://%s:%d (POST /v1/completions, GET /v1/models /health /metrics)%s",
                name, args.host, args.port, f", engine in process {engine.pid}" if args.engine_process else "")
    # (uvicorn's loop and http "auto": uvloop and httptools where they are installed, asyncio and h11 otherwise)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.drain))
    try:  # SIGTERM / SIGINT: no new connections, open requests answered, then the engine closes
        _Server(config).run()
    finally:
        engine.close(timeout=args.drain)  # what runs still gets `--drain` seconds, then is cancelled
    return 0


def _engine_process(args: argparse.Namespace, device: str, kwargs: dict):
    """The `EngineClient` of an engine process that loaded the model (the tokenizer loads here)."""
    from transformers import AutoTokenizer

    from .engine_client import EngineClient, EngineOptions, EngineStartError

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise CliError(f"--model {args.model}: the tokenizer does not load: {exc}") from exc
    options = EngineOptions(model=args.model, device=device, dtype=args.dtype, max_batch_tokens=args.batch_tokens,
                            max_batch_rows=args.batch_rows, gpu_memory_utilization=args.gpu_memory_utilization,
                            generate_kwargs=kwargs, log_level=logging.getLogger().level, warm_up=args.warm_up)
    try:
        return EngineClient.start(options, tokenizer)
    except EngineStartError as exc:
        raise CliError(str(exc)) from exc


def _engine_here(args: argparse.Namespace, device: str, model_config: dict, kwargs: dict):
    """An `OnlineEngine` in this process, its thread beside the event loop."""
    from ..batch.online import OnlineEngine
    from ..hf.patch import is_patched, patch_model

    dtype, why = batch_cli.resolve_dtype(args.dtype, device, model_config)
    logger.info("model on %s in %s (%s)", device, str(dtype).replace("torch.", ""), why)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    model, tokenizer, _ = batch_cli.load_model(args.model, device=device, dtype=dtype)
    try:
        if not is_patched(model):
            patch_model(model)  # (a model of another type: its one-line TypeError)
        engine = OnlineEngine(model, tokenizer, max_batch_tokens=args.batch_tokens, max_batch_rows=args.batch_rows,
                              gpu_memory_utilization=args.gpu_memory_utilization, **kwargs)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.warm_up:
        engine.warm_up()
    return engine


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGTERM / SIGINT start its graceful shutdown and are not raised
        again after it (uvicorn re-raises them, which would end the process before the engine
        closes, with status -15)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
