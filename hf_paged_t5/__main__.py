"""Command line: `python -m hf_paged_t5 COMMAND [options]` (also installed as `hf-paged-t5`).

Each subcommand is one row of `_COMMANDS`: its name, a one-line help, a function that adds its
options to an argparse parser, and a function that runs it from the parsed arguments and returns
the exit status. Adding a subcommand is adding a row.
"""

from __future__ import annotations

from types import MappingProxyType
import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Optional

from .batch import cli, ray_data
from . import demo
from .serve import cli as serve_cli

# name -> (help, add_arguments(parser), run(args) -> exit status)
def _job(command: str):
    """A batch command's runner: the local job, or with --ray the Ray Data job."""
    local, on_ray = cli.command_runner(command), cli.command_runner(command, ray_data.run_ray_job)
    return lambda args: (on_ray if args.ray else local)(args)


_COMMANDS = MappingProxyType({
    "demo": (
        "stock HF generate() vs the paged one on a few texts: outputs, token agreement, ms/token",
        demo.add_arguments,
        demo.cli,
    ),
    "checkpoint": (
        "write a random-weight T5 and a local tokenizer to DIR, offline, for --model (output is gibberish)",
        demo.add_checkpoint_arguments,
        demo.checkpoint_cli,
    ),
    "summarize": (
        "summarize a JSONL file with continuous batching (T5 'summarize: ' prefix); resumable output",
        cli.add_arguments,
        _job("summarize"),
    ),
    "translate": (
        "translate a JSONL file with continuous batching (T5 translation prefix, --task); resumable output",
        cli.add_arguments,
        _job("translate"),
    ),
    "generate": (
        "generate for a JSONL file with continuous batching (no task prefix); resumable output",
        cli.add_arguments,
        _job("generate"),
    ),
    "serve": (
        "an OpenAI-style HTTP server (POST /v1/completions) with continuous batching; needs the serve extra",
        serve_cli.add_arguments,
        serve_cli.run,
    ),
})


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="also log the library's INFO messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_paged_t5",
        description="Paged KV cache and Triton kernels under Hugging Face generate() for T5-family models.",
    )
    _add_verbose(parser, default=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, run) in _COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        # SUPPRESS: an absent -v after the command leaves the value of one given before it
        _add_verbose(sub, default=argparse.SUPPRESS)
        sub.set_defaults(run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # The library reports fallbacks to stock HF through logging; show them on the terminal.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # The commands' own reports (what a job does, where its output is) show at the default level too.
    for name in (cli.__name__, demo.__name__, serve_cli.__name__):
        logging.getLogger(name).setLevel(logging.INFO)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
