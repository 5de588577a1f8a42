"""Translate sentences with a patched T5, through transformers' `pipeline("translation_xx_to_yy")`.

    python examples/translate.py --model PATH [--task translation_en_to_de] [--file sentences.txt]
                                 [--batch-size 8] [--compare]

PATH is a local checkpoint directory (e.g. google-t5/t5-base, whose config carries the prefixes
for English to German, French and Romanian). transformers 5 dropped the translation pipelines;
importing hf_paged_t5 registers them again. `--file` holds one sentence per line. `--compare`
also runs the unpatched model first and says whether the translations are identical.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

import hf_paged_t5

SENTENCES = (
    "The weather is nice today and the sky is clear.",
    "The museum will stay open late on Friday so that students can visit after class.",
    "Please send me the report before the meeting starts.",
    "Two cyclists crossed the mountain pass in the fog and reached the town at dusk.",
    "The library lends books, music and maps, and its reading room is free for everyone.",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="checkpoint directory (model + tokenizer); offline, "
                             "`python -m hf_paged_t5 checkpoint DIR` writes a random-weight one")
    parser.add_argument("--task", default="translation_en_to_de", help="translation_<src>_to_<tgt>")
    parser.add_argument("--file", help="one sentence per line (default: a few embedded English sentences)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--num-beams", type=int, default=None,
                        help="default: the model's translation settings")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--compare", action="store_true", help="also run the unpatched model and compare")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            sentences = [line.strip() for line in f if line.strip()]
    else:
        sentences = list(SENTENCES)
    kwargs = {k: v for k, v in (("num_beams", args.num_beams), ("max_new_tokens", args.max_new_tokens)) if v}
    translator = pipeline(args.task, model=model, tokenizer=tokenizer)

    def translate() -> tuple[list[str], float]:
        start = time.perf_counter()
        records = translator(sentences, batch_size=args.batch_size, truncation=True, **kwargs)
        return [r["translation_text"] for r in records], time.perf_counter() - start

    if args.compare:
        translate()  # warm-up
        stock, stock_seconds = translate()
    hf_paged_t5.patch_model(model)  # the pipeline calls model.generate(), now the paged one
    translate()  # warm-up: allocates the KV pool (and captures CUDA graphs on a GPU)
    translations, seconds = translate()
    for source, target in zip(sentences, translations):
        print(f"{source}\n  -> {target}")
    dtype_name = str(dtype).replace("torch.", "")
    print(f"patched: {len(sentences)} sentences in {seconds:.2f} s on {device}, {dtype_name}")
    if args.compare:
        print(f"stock HF: {len(sentences)} sentences in {stock_seconds:.2f} s")
        print(f"identical to stock HF: {stock == translations}")


if __name__ == "__main__":
    main()
