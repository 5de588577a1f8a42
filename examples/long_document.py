"""Summarize a long document with a patched T5: the whole text at once, or chunk by chunk.

    python examples/long_document.py --model PATH [--file report.txt] [--mode full|chunked]
                                     [--chunk-tokens 512] [--max-new-tokens 128] [--compare]

--mode full (default) feeds the whole document to the encoder, untruncated. T5's relative position
bias has no maximum position, and the paged encoder keeps attention memory linear in the length
(no L x L score matrix), so 16k tokens fit where stock HF's attention needs gigabytes. How well a
checkpoint summarizes past the lengths it was trained on is another matter (Flan-T5: 2k tokens).
--mode chunked splits the document at sentence ends into chunks of at most --chunk-tokens, summarizes
all chunks in one batched generate(), then summarizes the joined chunk summaries.
Without --file a long synthetic report is built (--target-tokens). --compare (full mode) runs the
unpatched model first; out of memory there is reported, not fatal.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_paged_t5

PARAGRAPHS = (
    "The regional transport office published its yearly report on Monday. Passenger numbers on the "
    "trains rose by eight percent, while bus journeys stayed about the same as the year before.",
    "Most of the growth came from the new line to the airport, which opened in March and now carries "
    "more than twelve thousand people on a normal weekday.",
    "Delays remain the largest complaint. One train in six arrived more than five minutes late, mostly "
    "because of old signals on the northern line and a shortage of drivers in the summer.",
    "The office plans to replace the signals over the next two years and has started training sixty "
    "new drivers. It also wants to add late evening services on Fridays and Saturdays.",
    "Ticket prices will rise by three percent in January. Students and people over sixty-five will keep "
    "their discounts, and a new monthly pass will cover trains, buses and the city ferry.",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def synthetic_report(tokenizer, target_tokens: int) -> str:
    """The embedded paragraphs, numbered and repeated until the text has about `target_tokens` tokens."""
    parts, count, i = [], 0, 0
    while count < target_tokens:
        paragraph = f"Section {i + 1}. {PARAGRAPHS[i % len(PARAGRAPHS)]}"
        parts.append(paragraph)
        count += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"])
        i += 1
    return "\n\n".join(parts)


def chunks(tokenizer, text: str, chunk_tokens: int) -> list[str]:
    """`text` cut at sentence ends into pieces of at most ~`chunk_tokens` tokens."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    pieces, current, size = [], [], 0
    for sentence in sentences:
        n = len(tokenizer(sentence, add_special_tokens=False)["input_ids"])
        if current and size + n > chunk_tokens:
            pieces.append(" ".join(current))
            current, size = [], 0
        current.append(sentence)
        size += n
    return pieces + ([" ".join(current)] if current else [])


@torch.inference_mode()
def summarize(model, tokenizer, texts: list[str], prefix: str, **generate_kwargs) -> list[str]:
    """One batched, untruncated generate() over `texts`."""
    device = model.get_input_embeddings().weight.device
    batch = tokenizer([prefix + t for t in texts], return_tensors="pt", padding=True).to(device)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         **generate_kwargs)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def timed(fn, device, oom_result=None):
    """(result, seconds, peak GiB or None) of fn(); `oom_result` as the result if it ran out of
    memory and `oom_result` is given."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        result = fn()
    except torch.OutOfMemoryError:
        if oom_result is None:
            raise
        result = oom_result
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return result, time.perf_counter() - start, peak


def report(label: str, seconds: float, peak) -> str:
    return f"{label}: {seconds:.2f} s" + (f", peak memory {peak:.2f} GiB" if peak is not None else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="checkpoint directory (model + tokenizer); offline, "
                             "`python -m hf_paged_t5 checkpoint DIR` writes a random-weight one")
    parser.add_argument("--file", help="text file (default: a synthetic report of --target-tokens tokens)")
    parser.add_argument("--target-tokens", type=int, default=4096)
    parser.add_argument("--mode", choices=("full", "chunked"), default="full")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--compare", action="store_true", help="full mode: also run the unpatched model")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.model_max_length = 1 << 30  # no truncation, and no "longer than 512 tokens" warning
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = synthetic_report(tokenizer, args.target_tokens)
    params = (getattr(model.config, "task_specific_params", None) or {}).get("summarization") or {}
    prefix = params.get("prefix", "summarize: ")
    kwargs = dict(max_new_tokens=args.max_new_tokens, num_beams=args.num_beams)
    num_tokens = len(tokenizer(prefix + text)["input_ids"])
    print(f"document: {num_tokens} tokens; mode {args.mode}; {device}, {str(dtype).replace('torch.', '')}")

    if args.mode == "full":
        if args.compare:
            stock, *stock_stats = timed(lambda: summarize(model, tokenizer, [text], prefix, **kwargs)[0],
                                        device, oom_result="(out of memory)")
        hf_paged_t5.patch_model(model)
        summary, *stats = timed(lambda: summarize(model, tokenizer, [text], prefix, **kwargs)[0], device)
        print(f"summary: {summary}")
        print(report("patched", *stats))
        if args.compare:
            print(f"stock HF: {stock}")
            print(report("stock HF", *stock_stats))
            print(f"identical to stock HF: {stock == summary}")
    else:
        hf_paged_t5.patch_model(model)
        pieces = chunks(tokenizer, text, args.chunk_tokens)

        def map_reduce() -> tuple[list[str], str]:
            partial = summarize(model, tokenizer, pieces, prefix, **kwargs)  # all chunks in one batch
            return partial, summarize(model, tokenizer, [" ".join(partial)], prefix, **kwargs)[0]

        (partial, final), *stats = timed(map_reduce, device)
        for i, s in enumerate(partial):
            print(f"chunk {i + 1}/{len(pieces)}: {s}")
        print(f"summary: {final}")
        print(report("patched", *stats))


if __name__ == "__main__":
    main()
