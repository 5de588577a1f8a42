"""Summarize a document with a patched T5, through transformers' `pipeline("summarization")`.

    python examples/summarize.py --model PATH [--file article.txt] [--num-beams 4]
                                 [--max-new-tokens 128] [--compare]

PATH is a local checkpoint directory (e.g. a downloaded google-t5/t5-base or google/flan-t5-large).
transformers 5 dropped the summarization pipeline; importing hf_paged_t5 registers it again, with
the T5 prefix ("summarize: ") and generation defaults from the model's config. `--compare` also
runs the same pipeline on the unpatched model first and says whether the summaries are identical
(they are in float32; in bf16/fp16 a near-tie can go either way).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

import hf_paged_t5

ARTICLE = (
    "The city council voted on Tuesday to build a new bridge across the river, ending a debate that "
    "has lasted for more than ten years. The bridge will carry two lanes of traffic, a bus lane and a "
    "wide path for people on foot and on bicycles. Work is expected to start in the spring and to take "
    "about three years. Until the bridge opens, the old ferry will keep running every twenty minutes "
    "during the day. The council said that the project will cost less than a tunnel, which was the "
    "other plan, and that it will shorten the trip from the northern villages to the city centre by "
    "half an hour. Some residents near the river are worried about noise during the building work, and "
    "the council promised that no work will be done at night or on Sundays."
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="checkpoint directory (model + tokenizer); offline, "
                             "`python -m hf_paged_t5 checkpoint DIR` writes a random-weight one")
    parser.add_argument("--file", help="text file to summarize (default: a short embedded news article)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--num-beams", type=int, default=None,
                        help="default: the model's summarization settings")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--compare", action="store_true", help="also run the unpatched model and compare")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = ARTICLE
    kwargs = {k: v for k, v in (("num_beams", args.num_beams), ("max_new_tokens", args.max_new_tokens)) if v}
    summarizer = pipeline("summarization", model=model, tokenizer=tokenizer)

    def summarize() -> tuple[str, float]:
        start = time.perf_counter()
        summary = summarizer(text, truncation=True, **kwargs)[0]["summary_text"]
        return summary, time.perf_counter() - start

    if args.compare:
        summarize()  # warm-up
        stock, stock_seconds = summarize()
    hf_paged_t5.patch_model(model)  # the pipeline calls model.generate(), now the paged one
    summarize()  # warm-up: allocates the KV pool (and captures CUDA graphs on a GPU)
    summary, seconds = summarize()
    print(f"summary: {summary}")
    print(f"patched: {seconds:.2f} s on {device}, {str(dtype).replace('torch.', '')}")
    if args.compare:
        print(f"stock HF: {stock}")
        print(f"stock HF: {stock_seconds:.2f} s")
        print(f"identical to stock HF: {stock == summary}")


if __name__ == "__main__":
    main()
