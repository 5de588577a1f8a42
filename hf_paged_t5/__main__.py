"""Command line: `python -m hf_paged_t5 COMMAND [options]` (also installed as `hf-paged-t5`).

Each subcommand is one row of `_COMMANDS`: its name, a one-line help, a function that adds its
options to an argparse parser, and a function that runs it from the parsed arguments and returns
the exit status. Adding a subcommand is adding a row.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Optional

from . import cli, demo

# name -> (help, add_arguments(parser), run(args) -> exit status)
_COMMANDS = {
    "demo": (
        "stock HF generate() vs the paged one on a few texts: outputs, token agreement, ms/token",
        demo.add_arguments,
        demo.cli,
    ),
    "summarize": (
        "summarize a JSONL file with continuous batching (T5 'summarize: ' prefix); resumable output",
        cli.add_arguments,
        cli.command_runner("summarize"),
    ),
    "translate": (
        "translate a JSONL file with continuous batching (T5 translation prefix, --task); resumable output",
        cli.add_arguments,
        cli.command_runner("translate"),
    ),
    "generate": (
        "generate for a JSONL file with continuous batching (no task prefix); resumable output",
        cli.add_arguments,
        cli.command_runner("generate"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_paged_t5",
        description="Paged KV cache and Triton kernels under Hugging Face generate() for T5-family models.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, run) in _COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # The library reports fallbacks to stock HF through logging; show them on the terminal.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
