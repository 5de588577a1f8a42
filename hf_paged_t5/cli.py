"""`python -m hf_paged_t5 summarize|translate|generate`: a JSONL batch job through `BatchGenerator`.

    python -m hf_paged_t5 summarize --model PATH --input in.jsonl --output out.jsonl [--batch-tokens N]

Each input line is a JSON object with a text field (`--text-field`, default "text") and an id field
(`--id-field`, default "id"; a line without one gets its 0-based line number). Each result is
appended to the output as soon as it finishes, in any order, as one flushed JSON line
`{<id-field>: id, "output": text, "num_new_tokens": n}`. A rerun skips the ids already in the
output, so a crashed or interrupted job loses no finished result and resumes where it stopped (a
half-written last line is dropped and redone).

summarize / translate add the T5 task prefix and generation defaults of the model's
`task_specific_params` ("summarization", "translation_xx_to_yy"), as the pipelines do; the
command-line options override the defaults. Progress: a tqdm bar with documents done and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from .batching import BatchGenerator
from .demo import DTYPES, load_model
from .patch import is_patched, patch_model

logger = logging.getLogger(__name__)

# command -> the task_specific_params key it uses by default (None: no task defaults)
TASK_KEYS = {"summarize": "summarization", "translate": "translation", "generate": None}


class CliError(Exception):
    """A problem with the command's files or options, reported without a traceback."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (AutoModelForSeq2SeqLM + tokenizer)")
    parser.add_argument("--input", required=True, help="JSONL file, one object per line")
    parser.add_argument("--output", required=True, help="JSONL results, appended; a rerun skips done ids")
    parser.add_argument("--text-field", default="text", help="input field holding the text (default: text)")
    parser.add_argument("--id-field", default="id", help="input field holding the id (default: id)")
    parser.add_argument("--task", default=None,
                        help="task_specific_params key, e.g. translation_en_to_de (default: from the command)")
    parser.add_argument("--batch-tokens", type=int, default=65536,
                        help="KV tokens the running requests may hold together (default: 65536)")
    parser.add_argument("--batch-rows", type=int, default=None,
                        help="decoder rows per step (default: the pool config's max_graph_batch, 512)")
    parser.add_argument("--num-beams", type=int, default=None, help="beam search with K beams")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--min-new-tokens", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def task_settings(config: Any, command: str, task: Optional[str]) -> tuple[str, dict]:
    """(prefix, generation kwargs) from `config.task_specific_params`, as the pipelines read them."""
    params_by_task = getattr(config, "task_specific_params", None) or {}
    key = task or TASK_KEYS[command]
    if key == "translation":  # no language pair given: the model's first translation entry
        key = next((k for k in params_by_task if k.startswith("translation_")), key)
    params = dict(params_by_task.get(key) or {}) if key else {}
    prefix = params.pop("prefix", None)
    if prefix is None:
        prefix = getattr(config, "prefix", None) or ""
    if key:
        logger.info("task %r: prefix %r, generation defaults %s", key, prefix, params)
    return prefix, params


def generation_kwargs(defaults: dict, args: argparse.Namespace) -> dict:
    """Task defaults overridden by the options given; a length option replaces both forms of that length."""
    kwargs = dict(defaults)
    for option, names in (("max_new_tokens", ("max_new_tokens", "max_length")),
                          ("min_new_tokens", ("min_new_tokens", "min_length"))):
        if getattr(args, option) is not None:
            for name in names:
                kwargs.pop(name, None)
            kwargs[option] = getattr(args, option)
    if args.num_beams is not None:
        kwargs["num_beams"] = args.num_beams
    return kwargs


def read_inputs(path: str, text_field: str, id_field: str) -> list[tuple[Any, str]]:
    """[(id, text)] of a JSONL file; ids must be unique."""
    records, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CliError(f"{path}:{number + 1}: not JSON ({exc})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise CliError(f"{path}:{number + 1}: expected an object with a string field {text_field!r}")
            record_id = obj.get(id_field, number)
            key = json.dumps(record_id)
            if key in seen:
                raise CliError(f"{path}:{number + 1}: duplicate {id_field} {key}; ids must be unique to resume")
            seen.add(key)
            records.append((record_id, obj[text_field]))
    return records


def done_ids(path: str, id_field: str) -> set[str]:
    """JSON-encoded ids already in the output; a half-written last line (a crash) is cut off."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            logger.warning("%s: dropping a half-written last line (%d bytes); it will be redone", path, len(data) - end)
            f.truncate(end)
    done = set()
    for number, line in enumerate(data[:end].decode("utf-8").splitlines()):
        if line.strip():
            try:
                done.add(json.dumps(json.loads(line)[id_field]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CliError(f"{path}:{number + 1}: not a result line with {id_field!r} ({exc})") from exc
    return done


def run_job(command: str, args: argparse.Namespace) -> int:
    """Generate for every input id not yet in the output; returns the exit status."""
    records = read_inputs(args.input, args.text_field, args.id_field)
    done = done_ids(args.output, args.id_field)
    todo = [(record_id, text) for record_id, text in records if json.dumps(record_id) not in done]
    logger.info("%d inputs, %d already done, %d to run", len(records), len(records) - len(todo), len(todo))
    if not todo:
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, _ = load_model(args.model, device=device, dtype=DTYPES[args.dtype])
    if not is_patched(model):
        patch_model(model)
    prefix, defaults = task_settings(model.config, command, args.task)
    generator = BatchGenerator(model, tokenizer, max_batch_tokens=args.batch_tokens,
                               max_batch_rows=args.batch_rows, **generation_kwargs(defaults, args))
    texts = (prefix + text for _, text in todo)
    start, new_tokens = time.perf_counter(), 0
    with open(args.output, "a", encoding="utf-8") as out, tqdm(
        total=len(records), initial=len(records) - len(todo), unit="doc", disable=args.no_progress
    ) as bar:
        for index, result in generator.as_completed(texts):
            record = {args.id_field: todo[index][0], "output": result.text, "num_new_tokens": result.num_new_tokens}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()  # a finished result survives a crash of this process
            new_tokens += result.num_new_tokens
            bar.update(1)
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):.0f} tok/s")
    return 0


def command_runner(command: str):
    """The `run(args) -> exit status` of one subcommand for `__main__._COMMANDS`."""

    def run(args: argparse.Namespace) -> int:
        try:
            return run_job(command, args)
        except (CliError, FileNotFoundError) as exc:
            logger.error("%s", exc)
            return 2

    return run
