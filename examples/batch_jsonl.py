"""Batch job over a JSONL file with the patched `model.generate()`, in fixed-size batches.

    python examples/batch_jsonl.py --model PATH --input in.jsonl --output out.jsonl \
        [--task summarization | --prefix "summarize: "] [--batch-size 16] [--max-new-tokens 128]

Each input line is a JSON object with a text field (`--text-field`, default "text"). The output
has one line per input, in input order: the input object plus `"output": <generated text>`.
Inputs are sorted by length before they are cut into batches, so a batch holds texts of similar
length and little padding. `--task` takes the T5 prefix and generation defaults of the model's
`task_specific_params` (e.g. "summarization", "translation_en_to_de").

This is the plain way: one `generate()` per batch, every batch waits for its longest output.
`python -m hf_paged_t5 summarize|translate|generate` does the same job with continuous batching
(a finished sequence's slot is refilled at once) and resumes an interrupted run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_paged_t5

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="checkpoint directory (model + tokenizer); offline, "
                             "`python -m hf_paged_t5 checkpoint DIR` writes a random-weight one")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU "
                             "(fp16 overflows in t5-large and up)")


def load(path: str, device: str | None = None, dtype: str | None = None):
    """(model, tokenizer), the model patched, in eval mode on `device`."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    return hf_paged_t5.patch_model(model), tokenizer


def task_settings(model, task: str | None, prefix: str | None) -> tuple[str, dict]:
    """(prefix, generation defaults) from `model.config.task_specific_params[task]`; `prefix` wins."""
    by_task = getattr(model.config, "task_specific_params", None) or {}
    params = dict((by_task.get(task) or {}) if task else {})
    task_prefix = params.pop("prefix", "")
    return (task_prefix if prefix is None else prefix), params


def make_batches(tokenizer, texts: list[str], batch_size: int) -> list[list[int]]:
    """Indices of `texts` in batches of `batch_size`, shortest texts first."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.inference_mode()
def generate_batch(model, tokenizer, texts: list[str], **generate_kwargs) -> list[str]:
    """One padded `generate()` over `texts`; the decoded outputs in the same order."""
    device = model.get_input_embeddings().weight.device
    inputs = tokenizer(texts, return_tensors="pt", padding=True, truncation=True).to(device)
    out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         **generate_kwargs)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def generate_all(model, tokenizer, texts, batches, **generate_kwargs) -> dict[int, str]:
    """{index: output} for the texts of `batches` (lists of indices into `texts`)."""
    results = {}
    for batch in batches:
        outputs = generate_batch(model, tokenizer, [texts[i] for i in batch], **generate_kwargs)
        results.update(zip(batch, outputs))
    return results


def read_jsonl(path: str, text_field: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    for number, record in enumerate(records):
        if not isinstance(record.get(text_field), str):
            raise SystemExit(f"{path}: record {number} has no string field {text_field!r}")
    return records


def write_jsonl(path: str, records: list[dict], outputs: dict[int, str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, record in enumerate(records):
            f.write(json.dumps({**record, "output": outputs[i]}, ensure_ascii=False) + "\n")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL file, one object per line")
    parser.add_argument("--output", required=True, help="JSONL results, one line per input, in input order")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--task", default=None,
                        help="task_specific_params key: prefix and generation defaults")
    parser.add_argument("--prefix", default=None, help="text put before every input (overrides the task's)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--num-beams", type=int, default=None)


def job_kwargs(model, args) -> tuple[str, dict]:
    prefix, kwargs = task_settings(model, args.task, args.prefix)
    if args.max_new_tokens is not None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("max_length", "min_length")}
        kwargs["max_new_tokens"] = args.max_new_tokens
    if args.num_beams is not None:
        kwargs["num_beams"] = args.num_beams
    return prefix, kwargs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    add_job_arguments(parser)
    args = parser.parse_args()
    model, tokenizer = load(args.model, args.device, args.dtype)
    prefix, kwargs = job_kwargs(model, args)
    records = read_jsonl(args.input, args.text_field)
    texts = [prefix + r[args.text_field] for r in records]
    start = time.perf_counter()
    outputs = generate_all(model, tokenizer, texts, make_batches(tokenizer, texts, args.batch_size), **kwargs)
    seconds = time.perf_counter() - start
    write_jsonl(args.output, records, outputs)
    print(f"{len(records)} inputs in {seconds:.1f} s ({len(records) / seconds:.1f}/s) -> {args.output}")


if __name__ == "__main__":
    main()
