"""`python -m hf_paged_t5 demo`: stock HF `generate()` and the paged one on the same batch.

Works offline: with no model path it builds a random-weight T5 and a locally trained tokenizer
(`tiny.py`); with a path it loads a checkpoint with `AutoModelForSeq2SeqLM` / `AutoTokenizer`.
The same padded batch runs through stock HF greedy (or beam) search, then through
`patch_model(model)`; the report gives both outputs, their token agreement and the time per
generated token of each. The model is unpatched at the end.

Stock HF then runs once on a float64 copy of the model. How well stock HF at the model's own
dtype agrees with that copy measures how sensitive the model is to rounding: with random weights
at a real T5 shape, float32 rounding alone flips near-tied tokens, and one flipped token changes
the rest of its row. The report prints that figure beside the paged-vs-stock one, and (greedy
search) whether each row where paged and stock differ first differs on such a near-tie.

`python -m hf_paged_t5 checkpoint DIR` writes that random-weight model and tokenizer to DIR, a
checkpoint for the commands and examples that take `--model PATH`.
"""

from __future__ import annotations

from types import MappingProxyType
import argparse
import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Optional

import torch

from . import tiny
from .agreement import Agreement, Float64Check, float64_check, token_agreement
from .config import PagedCacheConfig
from .hf.patch import is_patched, patch_model, unpatch_model
from .hf.policy import CPU_STOCK_FROM_D_MODEL

logger = logging.getLogger(__name__)

# Different lengths on purpose, so the batch is padded; T5 task prefixes, so a real t5 checkpoint
# given with --model produces meaningful text.
DEFAULT_TEXTS = (
    "summarize: The city council voted on Tuesday to build a new bridge across the river. Work starts "
    "in the spring, and the old ferry will keep running until the bridge opens.",
    "translate English to German: The weather is nice today and the sky is clear.",
    "translate English to French: The museum will stay open late on Friday.",
    "summarize: Heavy rain is expected in the north tonight, and the roads may flood near the valley.",
)
DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})


@dataclasses.dataclass(frozen=True)
class GenerateRun:
    """One way of generating (stock HF or paged) over the demo batch.

    sequences: [batch, out_len] int64 on the CPU, column 0 is the decoder start token.
    seconds: median wall time of one timed `generate()` call.
    """

    sequences: torch.Tensor
    texts: tuple[str, ...]
    seconds: float

    @property
    def steps(self) -> int:
        """Decoder steps of one call (tokens generated per row, the longest row)."""
        return max(self.sequences.shape[1] - 1, 1)

    @property
    def ms_per_token(self) -> float:
        """Milliseconds per decoder step of the whole batch."""
        return 1000.0 * self.seconds / self.steps


@dataclasses.dataclass(frozen=True)
class DemoResult:
    model_name: str
    device: str
    dtype: str
    backend: str
    num_beams: int
    texts: tuple[str, ...]
    hf: GenerateRun
    paged: GenerateRun
    agreement: Agreement
    paged_ran: bool  # False when patched generate() fell back to stock HF (logged as a warning)
    float64: Optional[Float64Check] = None  # None when the float64 run was skipped
    d_model: Optional[int] = None  # the model's width (the CPU policy's criterion)

    @property
    def speedup(self) -> float:
        return self.hf.ms_per_token / self.paged.ms_per_token if self.paged.ms_per_token else float("inf")


def load_model(
    model_path: Optional[str] = None,
    shape: str = "tiny",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """(model, tokenizer, name): a checkpoint at `model_path`, or the embedded random-weight T5.

    The embedded model has `tiny.SHAPES[shape]` with the vocabulary of the embedded tokenizer,
    so every generated id decodes to text.
    """
    if model_path is None:
        tokenizer = tiny.build_tokenizer()
        model = tiny.build_model(shape, vocab_size=len(tokenizer), dtype=dtype, device=device)
        return model, tokenizer, f"embedded random-weight T5 ({shape} shape, vocab {len(tokenizer)})"
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    return model, tokenizer, model_path


def _timed_generate(model, batch: dict, repeats: int, **generate_kwargs) -> tuple[torch.Tensor, float]:
    """(sequences [batch, out_len], median seconds): one untimed warm-up call, then `repeats` timed calls.

    The warm-up absorbs one-time costs (first-call allocations, the paged pool, CUDA-graph capture).
    """
    device = next(model.parameters()).device

    def call() -> torch.Tensor:
        out = model.generate(**batch, **generate_kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    out = call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
    return out.cpu(), statistics.median(times)


def _paged_ran(model) -> bool:
    """Whether the patched model's last generate() ran on the paged pool (the pool exists only then)."""
    return is_patched(model) and model._hf_paged_t5.pool is not None


def run_demo(
    model,
    tokenizer,
    texts: Sequence[str] = DEFAULT_TEXTS,
    num_beams: int = 1,
    max_new_tokens: int = 32,
    repeats: int = 3,
    config: Optional[PagedCacheConfig] = None,
    model_name: str = "",
    check_float64: bool = True,
) -> DemoResult:
    """Generate for `texts` with stock HF, then with the model patched; the model ends unpatched.

    Greedy (`num_beams=1`) or beam search, no sampling, so both runs are deterministic.
    `check_float64`: then run stock HF once on a float64 copy of the model (twice its memory in
    float32, four times in 16-bit) and compare both runs with it (`DemoResult.float64`).
    """
    if not texts:
        raise ValueError("the demo needs at least one input text")
    if is_patched(model):
        raise ValueError("pass an unpatched model: the demo runs stock HF first, then patches it")
    device = next(model.parameters()).device
    # on a CPU the default backend runs some calls of wide models on stock HF (the CPU policy,
    # `hf.policy.cpu_stock_reason`); the demo asks for the paged CPU backend so that it shows it
    config = config or PagedCacheConfig(backend="cpu" if device.type == "cpu" else "auto")
    batch = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True).to(device)
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    gen = dict(do_sample=False, num_beams=num_beams, max_new_tokens=max_new_tokens)

    def decoded(sequences: torch.Tensor) -> tuple[str, ...]:
        return tuple(tokenizer.batch_decode(sequences, skip_special_tokens=True))

    ref, hf_seconds = _timed_generate(model, batch, repeats, **gen)
    patch_model(model, config)
    try:
        out, paged_seconds = _timed_generate(model, batch, repeats, **gen)
        paged_ran = _paged_ran(model)
    finally:
        unpatch_model(model)
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else model.config.pad_token_id
    pad = pad if pad is not None else 0
    return DemoResult(
        model_name=model_name or type(model).__name__,
        device=str(device),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        backend=config.resolve_backend(device),
        num_beams=num_beams,
        texts=tuple(texts),
        hf=GenerateRun(ref, decoded(ref), hf_seconds),
        paged=GenerateRun(out, decoded(out), paged_seconds),
        agreement=token_agreement(ref, out, gc.eos_token_id, pad),
        paged_ran=paged_ran,
        float64=float64_check(model, batch, gen, ref, out, gc.eos_token_id, pad) if check_float64 else None,
        d_model=getattr(model.config, "d_model", None),
    )


def _clip(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_report(result: DemoResult) -> str:
    """The demo's report as text: outputs per input, token agreement, timings."""
    search = "greedy" if result.num_beams == 1 else f"beam search ({result.num_beams} beams)"
    lines = [
        f"model:   {result.model_name}",
        f"device:  {result.device}, {result.dtype}, paged backend: {result.backend}, {search}",
        "",
    ]
    for i, (text, hf_text, paged_text) in enumerate(zip(result.texts, result.hf.texts, result.paged.texts)):
        lines.append(f"[{i}] input: {_clip(text)}")
        if hf_text == paged_text:
            lines.append(f"    HF = paged: {hf_text!r}")
        else:
            lines += [f"    HF:    {hf_text!r}", f"    paged: {paged_text!r}"]
    a = result.agreement
    lines += [
        "",
        f"token agreement: {a.matching_tokens}/{a.compared_tokens} generated tokens "
        f"({100.0 * a.fraction:.1f}%), {a.matching_sequences}/{a.num_sequences} sequences identical",
    ]
    if result.float64 is not None:
        lines += _float64_lines(result)
    if not result.paged_ran:
        lines.append("note: the patched generate() fell back to stock HF (see the warning above)")
    batch = len(result.texts)
    lines += [
        f"stock HF: {result.hf.ms_per_token:8.2f} ms/token  ({result.hf.steps} steps, batch {batch})",
        f"paged:    {result.paged.ms_per_token:8.2f} ms/token  ({result.paged.steps} steps, batch {batch})",
        f"speedup:  {result.speedup:8.2f}x",
    ]
    if result.device.startswith("cpu"):
        lines.append(f"note: the package's speedup comes from the GPU path (Triton kernels + CUDA graphs); on CPU "
                     f"the paged path runs the {result.backend} backend, and {result.speedup:.2f}x is its measured "
                     "ratio to stock HF on this machine")
        if result.d_model is not None and result.d_model >= CPU_STOCK_FROM_D_MODEL:
            lines.append(f"note: at d_model {result.d_model}, patch_model's default backend runs unpadded calls "
                         "without beam search on stock HF on a CPU (the same matrix products, no speed to gain); "
                         "the demo asked for backend='cpu' to show the paged path")
    return "\n".join(lines)


def _float64_lines(result: DemoResult) -> list[str]:
    """The float64 check of the report: both runs against stock HF in float64, and what that means."""
    check, dtype = result.float64, result.dtype
    stock, paged = check.stock, check.paged
    lines = [
        f"float64 check: against stock HF on a float64 copy, stock {dtype} agrees on {stock.matching_tokens}/"
        f"{stock.compared_tokens} tokens ({100.0 * stock.fraction:.1f}%), paged {dtype} on "
        f"{paged.matching_tokens}/{paged.compared_tokens} ({100.0 * paged.fraction:.1f}%)",
    ]
    if stock.fraction == 1.0 and result.agreement.fraction == 1.0:
        return lines
    if stock.fraction < 1.0:
        head = (f"note: stock HF's own {dtype} rounding already changes {stock.compared_tokens - stock.matching_tokens}"
                f" of {stock.compared_tokens} tokens: the model is chaotic at this precision (random weights at a "
                "real T5 shape are), so rounding flips near-tied tokens and a flipped token changes the rest of "
                "its row")
    else:
        head = f"note: stock HF {dtype} matches float64 token for token here"
    ties, batch = check.near_ties, len(result.texts)
    gap = f"float64 logits closer than twice stock's own {dtype} logit error there"
    if result.agreement.fraction == 1.0:
        tail = "paged matches stock exactly"
    elif ties is None:
        tail = "with beam search the demo does not check each difference; compare the two agreements with float64"
    elif all(ties):
        tail = (f"paged and stock differ only where stock itself is unstable: in every row where they differ "
                f"({len(ties)} of {batch}), the first two tokens they differ on are a near-tie ({gap})")
    else:
        tail = (f"but where paged and stock differ, {ties.count(False)} of {len(ties)} rows first differ on two "
                f"tokens that are not a near-tie (not {gap}), which rounding does not explain")
    return [*lines, f"{head}; {tail}"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demo` subcommand's options."""
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="checkpoint directory for AutoModelForSeq2SeqLM/AutoTokenizer "
                             "(default: an embedded random-weight T5, no download)")
    parser.add_argument("--shape", choices=sorted(tiny.SHAPES), default="tiny",
                        help="shape of the embedded model (ignored with --model; default: tiny). Random "
                             "weights at larger shapes amplify rounding, so HF and paged may pick different "
                             "near-tied tokens even in float32; the float64 check shows how far stock HF "
                             "itself moves")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu runs a PyTorch backend, cuda the Triton kernels (default: cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="model and KV dtype (default: float32, where greedy tokens match HF exactly)")
    parser.add_argument("--num-beams", type=int, default=1, metavar="K", help="beam width (default: 1, greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, metavar="R",
                        help="timed generate() calls per path after one warm-up; the median is reported "
                             "(default: 3)")
    parser.add_argument("--texts", nargs="+", metavar="TEXT", default=None,
                        help="input texts (default: a few embedded summarize/translate prompts)")
    parser.add_argument("--no-float64-check", dest="check_float64", action="store_false",
                        help="skip the run of stock HF on a float64 copy of the model (which needs that copy's "
                             "memory) that shows how much stock's own rounding changes the tokens")


def cli(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments and print its report; exit status 1 if the paged path did not run."""
    if args.num_beams < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise SystemExit("--num-beams, --max-new-tokens and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here; use --device cpu")
    model, tokenizer, name = load_model(args.model, args.shape, args.device, DTYPES[args.dtype])
    result = run_demo(
        model, tokenizer, texts=args.texts or DEFAULT_TEXTS, num_beams=args.num_beams,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, model_name=name,
        check_float64=args.check_float64,
    )
    print(format_report(result))
    return 0 if result.paged_ran else 1


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The `checkpoint` subcommand's options."""
    parser.add_argument("path", metavar="DIR", help="directory to write (created if missing)")
    parser.add_argument("--shape", choices=sorted(tiny.SHAPES), default="tiny",
                        help="T5 layout of the random-weight model (default: tiny)")


def checkpoint_cli(args: argparse.Namespace) -> int:
    """Write the embedded random-weight model and its tokenizer to `args.path` (`tiny.save_demo_checkpoint`)."""
    path = tiny.save_demo_checkpoint(args.path, shape=args.shape)
    logger.info("wrote a random-weight T5 (%s shape) and its tokenizer to %s; give it as --model %s",
                args.shape, path, path)
    return 0
