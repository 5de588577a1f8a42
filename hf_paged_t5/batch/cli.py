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

At the default log level a job reports the task entry it uses (with translate and no --task: the
language pair it picked), how many inputs are done and to run, and ends with one line: documents,
new tokens, seconds, tokens/s and the output path. A rerun over a finished output says so in one
line and exits 0 without loading the model.

Options, the input, the output and the checkpoint's config.json (task names) are checked before the
weights load; a problem is one line on stderr, exit status 2, and the output is left as it was.
"""

from __future__ import annotations

from types import MappingProxyType
import argparse
import json
import logging
import os
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from .generator import BatchGenerator
from ..demo import DTYPES, load_model
from ..hf.patch import is_patched, patch_model

logger = logging.getLogger(__name__)

# command -> the task_specific_params key it uses by default (None: no task defaults)
TASK_KEYS = MappingProxyType({"summarize": "summarization", "translate": "translation", "generate": None})


class CliError(Exception):
    """A problem with the command's files or options, reported without a traceback."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the model and its batch engine, shared by the batch commands and `serve`."""
    parser.add_argument("--model", required=True,
                        help="local checkpoint directory (config.json, weights, tokenizer)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="weights' dtype (default auto: bfloat16 on a GPU that supports it, else the "
                             "checkpoint's own dtype, float32 when it names none)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="KV tokens the running requests may hold together (default: what fits in "
                             "--gpu-memory-utilization of the GPU's memory; 65536 on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU's memory the job may fill, KV included, in (0, 1] "
                             "(default 0.9; sizes the default --batch-tokens)")
    parser.add_argument("--batch-rows", type=int, default=None,
                        help="decoder rows per step (default: the pool config's max_graph_batch, 512)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--input", required=True, help="JSONL file, one object per line")
    parser.add_argument("--output", required=True, help="JSONL results, appended; a rerun skips done ids")
    parser.add_argument("--text-field", default="text", help="input field holding the text (default: text)")
    parser.add_argument("--id-field", default="id",
                        help="input field holding the id (default: id); a line without one gets its line "
                             "number, from 0")
    parser.add_argument("--task", default=None,
                        help="task_specific_params key, e.g. translation_en_to_de (default: from the command)")
    parser.add_argument("--num-beams", type=int, default=None, help="beam search with K beams")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--min-new-tokens", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--ray", action="store_true",
                        help="run on Ray Data (pip install 'hf_paged_t5[ray]'): JSONL or Parquet input, the output "
                             "a folder of shard files (Parquet when it ends in .parquet), one model replica per GPU")
    parser.add_argument("--ray-address", default=None, help="the Ray cluster to join (default: RAY_ADDRESS, or a "
                                                            "local one)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="model replicas with --ray (default: the cluster's GPUs, 1 without)")


def check_options(args: argparse.Namespace) -> None:
    """CliError unless the numeric options are in range and --min-new-tokens <= --max-new-tokens."""
    for option, lowest in (("batch_tokens", 1), ("batch_rows", 1), ("num_beams", 1),
                           ("max_new_tokens", 1), ("min_new_tokens", 0)):
        value = getattr(args, option)
        if value is not None and value < lowest:
            raise CliError(f"--{option.replace('_', '-')} {value}: must be >= {lowest}; give a larger value")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise CliError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1], "
                       "the fraction of the GPU's memory the job may fill; e.g. 0.9")
    if args.min_new_tokens is not None and args.max_new_tokens is not None \
            and args.min_new_tokens > args.max_new_tokens:
        raise CliError(f"--min-new-tokens {args.min_new_tokens} is larger than --max-new-tokens "
                       f"{args.max_new_tokens}; lower the first or raise the second")


def resolve_device(device: Optional[str]) -> str:
    """The device to load the model on: `device`, else cuda when available; CliError for an unusable one."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise CliError(f"--device {device}: not a device name; use cpu, cuda or cuda:N") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                           f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def resolve_dtype(choice: str, device: str, model_config: dict) -> tuple[torch.dtype, str]:
    """(dtype to load the weights in, why): `--dtype` as given, or for "auto" bfloat16 on a CUDA
    device that supports it (T5 was trained in bfloat16; float16 overflows its activations), else
    the dtype the checkpoint's config.json names (`dtype`, or `torch_dtype` of older
    transformers), else float32."""
    if choice != "auto":
        return DTYPES[choice], "--dtype"
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16, "auto: a GPU with bfloat16"
    named = model_config.get("dtype") or model_config.get("torch_dtype")
    if isinstance(named, str) and named.replace("torch.", "") in DTYPES:
        return DTYPES[named.replace("torch.", "")], "auto: the checkpoint's dtype"
    return torch.float32, "auto: the checkpoint names no dtype"


def read_model_config(path: str) -> dict:
    """The checkpoint's config.json as a dict, read without loading weights; CliError if `path` holds none.

    `--model` is a local directory: checking it here turns HF's "Repo id must be in the form ..."
    error, raised after a hub lookup, into a one-line message.
    """
    if not os.path.isdir(path):
        raise CliError(f"--model {path}: no such directory; "
                       f"give a local checkpoint directory (save_pretrained output)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CliError(f"--model {path}: has no config.json; give a directory written by save_pretrained()")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"{config_path}: cannot be read as JSON ({exc}); "
                       f"fix or re-save the checkpoint") from exc
    if not isinstance(config, dict):
        raise CliError(f"{config_path}: not a JSON object; fix or re-save the checkpoint")
    return config


def task_key(params_by_task: dict, command: str, task: Optional[str]) -> Optional[str]:
    """The task_specific_params key to use: `task`, else the command's; CliError for a `task` the model lacks.

    "translation" means the model's first translation_xx_to_yy entry, as in the pipelines.
    """
    key = task or TASK_KEYS[command]
    if key == "translation":
        key = next((k for k in params_by_task if k.startswith("translation_")), key)
    if task is not None and key not in params_by_task:
        if not params_by_task:
            raise CliError(f"--task {task}: the model's config has no task_specific_params; leave --task out")
        raise CliError(f"--task {task}: not a task of this model (its task_specific_params have: "
                       f"{', '.join(sorted(params_by_task))}); give one of those or leave --task out")
    return key


def task_settings(config: dict, command: str, task: Optional[str]) -> tuple[Optional[str], str, dict]:
    """(task key, prefix, generation kwargs) from config.json's `task_specific_params`, as the pipelines read them.

    The key is None for a command without task defaults (generate, no --task).
    """
    params_by_task = config.get("task_specific_params") or {}
    key = task_key(params_by_task, command, task)
    params = dict(params_by_task.get(key) or {}) if key else {}
    prefix = params.pop("prefix", None)
    if prefix is None:
        prefix = config.get("prefix") or ""
    return key, prefix, params


def log_task(key: Optional[str], prefix: str, defaults: dict, task: Optional[str]) -> None:
    """One line naming the task entry in use, its prefix and its generation defaults."""
    if not key:
        return
    picked = ""
    if task in (None, "translation") and key.startswith("translation_"):
        # translate without a language pair took the model's first one: say which
        picked = " (the model's first translation task; --task picks another)"
    logger.info("task %r%s: prefix %r, generation defaults %s", key, picked, prefix, defaults)


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


def warn_length_conflict(kwargs: dict) -> None:
    """Warns when a task default's minimum length exceeds --max-new-tokens (or the reverse).

    Both given on the command line is an error (`check_options`); a task default the user did not
    choose is only reported, since generate() still runs (the outputs stop at the maximum, unended).
    """
    # encoder-decoder min_length / max_length count the decoder start token
    min_new = kwargs.get("min_new_tokens", (kwargs.get("min_length") or 1) - 1)
    max_new = kwargs.get("max_new_tokens", (kwargs.get("max_length") or min_new + 1) - 1)
    if min_new > max_new:
        logger.warning("the minimum length (%d new tokens) is larger than the maximum (%d), one of them "
                       "from the task's defaults; outputs will stop at %d tokens without an end. Give both "
                       "--min-new-tokens and --max-new-tokens to choose", min_new, max_new, max_new)


def read_inputs(path: str, text_field: str, id_field: str) -> list[tuple[Any, str]]:
    """[(id, text)] of a JSONL file; ids must be unique. CliError names the first bad line."""
    records, seen = [], set()
    try:
        f = open(path, "rb")  # bytes, decoded line by line, so a bad byte is reported with its line number
    except OSError as exc:
        raise CliError(f"--input {path}: {_os_problem(exc)}; give an existing, readable JSONL file") from exc
    with f:
        for number, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if number == 0 else "utf-8")  # a leading BOM is not JSON
            except UnicodeDecodeError as exc:
                raise CliError(f"{path}:{number + 1}: not UTF-8 text ({exc}); "
                               f"save the file as UTF-8") from exc
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CliError(f"{path}:{number + 1}: not JSON ({exc}); fix or remove the line") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise CliError(f"{path}:{number + 1}: expected an object with a string field {text_field!r}; "
                               f"fix the line or name the field with --text-field")
            record_id = obj.get(id_field, number)
            key = json.dumps(record_id)
            if key in seen:
                raise CliError(f"{path}:{number + 1}: duplicate {id_field} {key}; ids must be unique to resume")
            seen.add(key)
            records.append((record_id, obj[text_field]))
    return records


def _os_problem(exc: OSError) -> str:
    """A short description of why a file could not be opened."""
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, IsADirectoryError):
        return "is a directory"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return f"cannot be opened ({exc.strerror or exc})"


def check_output(path: str, input_path: str) -> None:
    """CliError unless results can be appended to `path` (nothing is created or changed here)."""
    if os.path.isdir(path):
        raise CliError(f"--output {path}: is a directory; "
                       f"give a file path, e.g. {os.path.join(path, 'out.jsonl')}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"--output {path}: directory {directory} does not exist; "
                       f"create it or give another path")
    if os.path.exists(path):
        if os.path.exists(input_path) and os.path.samefile(path, input_path):
            raise CliError(f"--output {path}: is the --input file; give another path for the results")
        if not os.access(path, os.R_OK | os.W_OK):  # read for the done ids, write to append
            raise CliError(f"--output {path}: not readable and writable; "
                           f"fix its permissions or give another path")
    elif not os.access(directory, os.W_OK | os.X_OK):
        raise CliError(f"--output {path}: cannot create a file in {directory}; "
                       f"fix its permissions or give another path")


def done_ids(path: str, id_field: str) -> tuple[set[str], int]:
    """(JSON-encoded ids already in the output, bytes of its complete lines); reads only.

    A half-written last line (a crash) is not counted; `drop_half_written_line` cuts it off once
    the job is sure to run.
    """
    if not os.path.exists(path):
        return set(), 0
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    done = set()
    for number, line in enumerate(data[:end].split(b"\n")):
        if line.strip():
            try:
                done.add(json.dumps(json.loads(line.decode("utf-8"))[id_field]))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CliError(f"{path}:{number + 1}: not a result line with {id_field!r} ({exc}); "
                               f"fix or remove the line, or give another --output") from exc
    return done, end


def drop_half_written_line(path: str, complete_bytes: int) -> None:
    """Cuts the output back to its complete lines, so the next result starts on a line of its own."""
    if os.path.exists(path) and os.path.getsize(path) > complete_bytes:
        logger.warning("%s: dropping a half-written last line (%d bytes); it will be redone",
                       path, os.path.getsize(path) - complete_bytes)
        os.truncate(path, complete_bytes)


def run_job(command: str, args: argparse.Namespace) -> int:
    """Generate for every input id not yet in the output; returns the exit status.

    Everything that can be checked without the weights is checked first, so a bad option or file
    is reported at once instead of after a model load, and leaves the output as it was.
    """
    check_options(args)
    device = resolve_device(args.device)
    records = read_inputs(args.input, args.text_field, args.id_field)
    check_output(args.output, args.input)
    done, complete_bytes = done_ids(args.output, args.id_field)
    model_config = read_model_config(args.model)
    key, prefix, defaults = task_settings(model_config, command, args.task)
    dtype, why = resolve_dtype(args.dtype, device, model_config)
    kwargs = generation_kwargs(defaults, args)
    todo = [(record_id, text) for record_id, text in records if json.dumps(record_id) not in done]
    if not records:
        logger.warning("%s: no input lines; nothing to do", args.input)
        return 0
    if not todo:
        logger.info("%d inputs, %d already done, nothing to run; output: %s",
                    len(records), len(records), args.output)
        return 0
    log_task(key, prefix, defaults, args.task)
    warn_length_conflict(kwargs)
    logger.info("%d inputs, %d already done, %d to run", len(records), len(records) - len(todo), len(todo))
    logger.info("model on %s in %s (%s)", device, str(dtype).replace("torch.", ""), why)
    model, tokenizer, _ = load_model(args.model, device=device, dtype=dtype)
    if not is_patched(model):
        patch_model(model)
    try:
        generator = BatchGenerator(model, tokenizer, max_batch_tokens=args.batch_tokens,
                                   max_batch_rows=args.batch_rows,
                                   gpu_memory_utilization=args.gpu_memory_utilization, **kwargs)
    except (TypeError, ValueError) as exc:  # a model or generation option the batch engine does not serve
        raise CliError(str(exc)) from exc
    drop_half_written_line(args.output, complete_bytes)
    start = time.perf_counter()
    new_tokens = write_results(generator, todo, prefix, args, len(records))
    seconds = time.perf_counter() - start
    logger.info("%d documents, %d new tokens in %.1f s (%.0f tokens/s); output: %s",
                len(todo), new_tokens, seconds, new_tokens / seconds if seconds else 0.0, args.output)
    return 0


def write_results(generator: BatchGenerator, todo: list[tuple[Any, str]], prefix: str,
                  args: argparse.Namespace, total: int) -> int:
    """Generate for `todo` ([(id, text)]), appending each result to the output as it finishes; returns new tokens.

    `total` (all inputs, done ones included) sizes the progress bar.
    """
    texts = (prefix + text for _, text in todo)
    start, new_tokens = time.perf_counter(), 0
    with open(args.output, "a", encoding="utf-8") as out, tqdm(
        total=total, initial=total - len(todo), unit="doc", disable=args.no_progress
    ) as bar:
        for index, result in generator.as_completed(texts):
            record = {args.id_field: todo[index][0], "output": result.text, "num_new_tokens": result.num_new_tokens}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()  # a finished result survives a crash of this process
            new_tokens += result.num_new_tokens
            bar.update(1)
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):.0f} tok/s")
    return new_tokens


def command_runner(command: str, job=None):
    """The `run(args) -> exit status` of one subcommand for `__main__._COMMANDS`; `job(command,
    args)` runs it (default `run_job`; `ray_data.run_ray_job` for --ray)."""
    job = run_job if job is None else job

    def run(args: argparse.Namespace) -> int:
        try:
            return job(command, args)
        except (CliError, FileNotFoundError) as exc:  # FileNotFoundError: a checkpoint file missing at load
            logger.error("%s", exc)
            return 2

    return run
