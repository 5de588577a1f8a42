"""`BatchGenerator`: continuous batching of a patched T5 over a stream of inputs of any length mix.

    gen = BatchGenerator(model, tokenizer, max_new_tokens=128)  # KV budget: 0.9 of the GPU's memory
    for result in gen.generate(texts):          # results in input order
        print(result.text)

Requests are admitted while the decode rows (`max_batch_rows`), the KV token budget
(`max_batch_tokens`) and the pool allow; newly admitted requests run through the encoder as one
packed (varlen) batch and their cross-attention K/V are stored once per source; every decode step
then runs all live rows, each at its own position; a finished request returns its blocks to the
pool at once and its place goes to the next waiting request. Each result is what patched
`generate()` returns for that input alone (greedy and beam search; fp32 token-exact). The job's
steps live in `run.py`; the per-row logits rules and beam search in `decoding.py`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from transformers import GenerationConfig

from .decoding import LogitsRules
from .requests import BatchRequest, BatchResult, Request
from .run import BatchRun
from ..hf.patch import STOCK_ENCODER, _paged_encoder
from ..hf.policy import autocast_reason, fallback_reason
from ..model import longt5

# BatchRequest fields that override the generator's sampling for one input, in GenerationConfig's names.
SAMPLING_OPTIONS = ("do_sample", "temperature", "top_p", "top_k")

logger = logging.getLogger(__name__)

# KV tokens of the default budget off CUDA (a CPU's memory is not the limit a GPU's is)
DEFAULT_BATCH_TOKENS = 65536
# The most padded input tokens one encoder pass takes: its activations are not in the KV budget, so
# a budget sized from a GPU's memory does not size them (t5-large, bf16: 0.5 GiB per hidden state)
ENCODER_CHUNK_TOKENS = 262144
# A budget sized from memory holds at most this many tokens per decoder row: a small model on a large
# GPU would otherwise reserve (and track) hundreds of millions of tokens it cannot fill
MEMORY_BUDGET_TOKENS_PER_ROW = 4096

# What one input may be: a text (needs a tokenizer), token ids, or a request with its own limits.
InputItem = Union[str, Sequence[int], torch.Tensor, "BatchRequest"]


class BatchGenerator:
    """Continuous batching over a model patched by `hf_paged_t5.patch_model`.

    Args:
        model: a patched T5-family seq2seq model in eval mode.
        tokenizer: needed for text inputs and for `BatchResult.texts`.
        generation_config: as for `generate()`; `generate_kwargs` override it, as in `generate()`.
            Greedy, sampling and beam search; max/min new tokens and EOS can be set per input with
            `BatchRequest`. Options HF binds to one batch (encoder_repetition_penalty, guidance, ...)
            are refused with the reason.
        max_batch_tokens: KV tokens the running requests may hold together, counted at admission as
            each request's worst case (input tokens + rows x (max_new_tokens + 1)). An input larger
            than this alone still runs, by itself. Default (None): on CUDA, what fits in
            `gpu_memory_utilization` of each decoder device's memory after what is in use there now
            (weights included; the model's own KV pool counts as room), as vLLM sizes its cache, at
            most `MEMORY_BUDGET_TOKENS_PER_ROW` (4,096) per decoder row,
            and reserved in the model's KV pool when a job starts on an idle pool (the memory stays
            the pool's, for later jobs and generate() calls); elsewhere `DEFAULT_BATCH_TOKENS`.
        gpu_memory_utilization: the fraction of each GPU's memory the process may fill, KV included,
            in (0, 1]; used only to size the default `max_batch_tokens`.
        max_batch_rows: decoder rows (sequences x beams) per decode step; default: the pool config's
            `max_graph_batch`, the largest batch a captured CUDA graph serves.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        generation_config: Optional[GenerationConfig] = None,
        max_batch_tokens: Optional[int] = None,
        max_batch_rows: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        **generate_kwargs: Any,
    ) -> None:
        runtime = getattr(model, "_hf_paged_t5", None)
        if runtime is None or not runtime.is_seq2seq:
            raise TypeError(
                "BatchGenerator needs a seq2seq model patched by hf_paged_t5: call hf_paged_t5.patch_model(model) first"
            )
        if not _paged_encoder(model.get_encoder()):
            raise TypeError(f"BatchGenerator runs the paged encoder, and {STOCK_ENCODER.split(':')[0]}: "
                            "use model.generate() for this model")
        reason = longt5.unserved_reason(model.get_encoder(), None)
        if reason is not None:
            raise TypeError(f"BatchGenerator runs the paged encoder, which does not give stock HF's result here "
                            f"({reason}): use model.generate() for this model")
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be a fraction in (0, 1] of each GPU's memory, got "
                f"{gpu_memory_utilization!r}; e.g. 0.9"
            )
        self.model, self.tokenizer, self.runtime = model, tokenizer, runtime
        self.device = model.get_input_embeddings().weight.device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.config, self.default_max_new, self.default_min_new = _resolve_config(
            model, generation_config, generate_kwargs, self.device
        )
        cfg = self.config
        self.num_beams = cfg.num_beams
        self.expand = max(cfg.num_beams, cfg.num_return_sequences)
        self.eos = tuple(cfg._eos_token_tensor.tolist())
        self.start_id = int(cfg._decoder_start_token_tensor)
        self.pad_id = int(cfg._pad_token_tensor)
        self.rules = LogitsRules(model, cfg, self.device)
        self._rules_by_key: dict[tuple, LogitsRules] = {}  # per-input sampling options -> their rules
        self.max_batch_rows = runtime.config.max_graph_batch if max_batch_rows is None else max_batch_rows
        if not isinstance(self.max_batch_rows, int) or self.max_batch_rows < self.expand:
            raise ValueError(
                f"max_batch_rows must be an int >= the rows of one input ({self.expand}), got {self.max_batch_rows!r}"
            )
        # a budget sized from the GPU's memory is reserved in the pool when a job starts on an idle
        # pool (re-made at that size): growing a pool that is in use copies it, and a copy near the
        # memory's end would need room for both
        self.reserve_tokens: Optional[int] = None
        if max_batch_tokens is None:
            max_batch_tokens, from_memory = _default_batch_tokens(runtime, model.decoder, gpu_memory_utilization,
                                                                  self.max_batch_rows * MEMORY_BUDGET_TOKENS_PER_ROW)
            self.reserve_tokens = max_batch_tokens if from_memory else None
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        self.encoder_chunk_tokens = min(max_batch_tokens, ENCODER_CHUNK_TOKENS)

    # ---- public iteration ---------------------------------------------------------------------
    def generate(self, inputs: Iterable[InputItem]) -> Iterator[BatchResult]:
        """Results in input order (each waits for those before it). `inputs` is read lazily."""
        stream = self.as_completed(inputs)
        done: dict[int, BatchResult] = {}
        next_index = 0
        try:
            for index, result in stream:
                done[index] = result
                while next_index in done:
                    yield done.pop(next_index)
                    next_index += 1
        finally:
            stream.close()

    def as_completed(self, inputs: Iterable[InputItem]) -> Iterator[tuple[int, BatchResult]]:
        """(input index, result) as each input finishes. Closing the iterator early, or an
        exception, returns every block the job holds to the pool."""
        if autocast_reason([self.device]) is not None:
            raise ValueError("BatchGenerator cannot run inside torch.autocast: it runs the model in its "
                             "weights' own dtype; cast the model instead (e.g. model.to(torch.bfloat16))")
        hooked = self.runtime.uncalled_hook(self.model)
        if hooked is not None:
            raise ValueError(f"BatchGenerator cannot run this job: {hooked} would not run; remove it, or use "
                             "model.generate(), which runs such calls on stock HF")
        run = BatchRun(self, inputs)
        with self.runtime.runner.lock:
            self.runtime.check_weights()  # once per job (a decode step must not sync)
        try:
            while (finished := run.step()) is not None:
                for result in finished:
                    yield result.index, result
        finally:
            run.close()

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, index: int, item: InputItem) -> Request:
        """A `Request` for input `index`; clear errors for inputs that cannot run."""
        limits = item if isinstance(item, BatchRequest) else BatchRequest(item)
        ids = self._token_ids(index, limits.inputs)
        max_new = self.default_max_new if limits.max_new_tokens is None else limits.max_new_tokens
        min_new = self.default_min_new if limits.min_new_tokens is None else limits.min_new_tokens
        if max_new < 1:
            raise ValueError(f"input {index}: max_new_tokens must be >= 1, got {max_new}")
        eos = self.eos
        if limits.eos_token_id is not None:
            eos = tuple(torch.tensor(limits.eos_token_id).reshape(-1).tolist())
            if not eos:
                raise ValueError(f"input {index}: eos_token_id is empty")
            if eos != self.eos and self.rules.binds_eos:
                raise ValueError(
                    f"input {index}: a per-input eos_token_id cannot be combined with {self.rules.binds_eos}, "
                    "which HF builds with the generation config's EOS"
                )
        request = Request(index=index, ids=ids, max_new=max_new, min_new=min_new, eos=eos, expand=self.expand)
        request.sampling, request.seed = self._sampling(index, limits)
        return request

    def _sampling(self, index: int, limits: BatchRequest):
        """((LogitsRules, do_sample) of the input's own sampling options or None, its seed)."""
        given = {name: getattr(limits, name) for name in SAMPLING_OPTIONS if getattr(limits, name) is not None}
        if not given and limits.seed is None:
            return None, None
        if self.num_beams > 1:
            raise ValueError(f"input {index}: per-input sampling options ({', '.join(sorted(given)) or 'seed'}) "
                             f"need a greedy or sampling generator, not beam search (num_beams={self.num_beams})")
        cfg = self.config
        key = tuple(given.get(name, getattr(cfg, name)) for name in SAMPLING_OPTIONS)
        do_sample, temperature, top_p, top_k = key
        if do_sample:
            if temperature is None or not temperature > 0:
                raise ValueError(f"input {index}: temperature must be > 0 when sampling, got {temperature!r}")
            if top_p is not None and not 0 < top_p <= 1:
                raise ValueError(f"input {index}: top_p must be in (0, 1], got {top_p!r}")
            if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
                raise ValueError(f"input {index}: top_k must be an int >= 0, got {top_k!r}")
        if limits.seed is not None and (not isinstance(limits.seed, int) or isinstance(limits.seed, bool)):
            raise ValueError(f"input {index}: seed must be an int, got {limits.seed!r}")
        if limits.seed is not None and self.expand > 1:
            raise ValueError(f"input {index}: a seed needs num_return_sequences=1 (HF draws the sequences of one "
                             "input together)")
        if self.rules.needs_history:  # the rows' own draws and rules go by row, not by length group
            raise ValueError(f"input {index}: per-input sampling options or a seed cannot be combined with "
                             "processors that read the generated tokens (repetition penalties, "
                             "no_repeat_ngram_size, ...)")
        if key == tuple(getattr(cfg, name) for name in SAMPLING_OPTIONS):
            return None, limits.seed
        rules = self._rules_by_key.get(key)
        if rules is None:  # (the options' own warpers read only the scores: no history needed here either)
            own = copy.deepcopy(cfg)
            own.do_sample, own.temperature, own.top_p, own.top_k = key
            rules = self._rules_by_key[key] = LogitsRules(self.model, own, self.device)
        return (rules, bool(do_sample)), limits.seed

    def _token_ids(self, index: int, inputs: Any) -> list[int]:
        if isinstance(inputs, str):
            if self.tokenizer is None:
                raise ValueError(f"input {index} is a text, but BatchGenerator was given no tokenizer")
            ids = list(self.tokenizer(inputs)["input_ids"])
        elif isinstance(inputs, torch.Tensor):
            if inputs.dim() != 1:
                raise ValueError(f"input {index}: token ids must be 1-D, got shape {tuple(inputs.shape)}")
            ids = inputs.tolist()
        elif isinstance(inputs, Sequence) and all(isinstance(t, int) for t in inputs):
            ids = list(inputs)
        else:
            raise TypeError(
                f"input {index}: expected a str, a sequence of token ids or a BatchRequest, got {type(inputs).__name__}"
            )
        if not ids:
            raise ValueError(f"input {index} has no tokens; each input needs at least one")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:  # (an id past the embedding is a device-side fault on a GPU)
            bad = low if low < 0 else high
            raise ValueError(f"input {index}: token id {bad} is outside the model's vocabulary "
                             f"(0 to {self.vocab_size - 1})")
        return ids

    def result(self, request: Request, sequences: list[list[int]], scores: Optional[list[float]]) -> BatchResult:
        texts = None
        if self.tokenizer is not None:
            texts = self.tokenizer.batch_decode(sequences, skip_special_tokens=True)
        return BatchResult(request.index, sequences, texts, scores, len(request.ids))


def kv_token_budget(specs: Sequence, utilization: float, mem_get_info: Callable, pool=None) -> int:
    """KV tokens that fit in `utilization` of every decoder device's memory: per device, its free
    memory plus what the model's pool already holds there, less the (1 - utilization) share of its
    total that stays unused, divided by the bytes one token's K/V takes on it; the fewest over the
    devices, at least 0.

    specs: the decoder layers' `LayerSpec`s; mem_get_info(device) -> (free, total) bytes
    (`torch.cuda.mem_get_info`); pool: the model's `KVPool` or None.
    """
    per_token: dict = {}
    for spec in specs:
        per_token[spec.device] = per_token.get(spec.device, 0) + 2 * spec.num_heads * spec.head_dim * (
            torch.finfo(spec.dtype).bits // 8)
    pooled = pool is not None and list(pool.specs) == list(specs)
    budget = None
    for device, nbytes in per_token.items():
        free, total = mem_get_info(device)
        held = pool.num_blocks * pool.block_size * nbytes if pooled else 0
        tokens = max(0, int((free + held - (1 - utilization) * total) // nbytes))
        budget = tokens if budget is None else min(budget, tokens)
    return budget or 0


def _default_batch_tokens(runtime, decoder: nn.Module, utilization: float, cap: Optional[int] = None
                          ) -> tuple[int, bool]:
    """(`max_batch_tokens` when the caller gives none (see `BatchGenerator`), whether it was sized
    from the GPUs' memory); a budget sized from memory is at most `cap` tokens."""
    specs = runtime.layer_specs(decoder)
    if not all(spec.device.type == "cuda" for spec in specs):
        return DEFAULT_BATCH_TOKENS, False
    budget = kv_token_budget(specs, utilization, torch.cuda.mem_get_info, runtime.pool)
    free = {str(s.device): torch.cuda.mem_get_info(s.device) for s in specs}
    if budget < 1:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for KV on "
            + ", ".join(f"{d} ({f / 2**30:.1f} of {t / 2**30:.1f} GiB free)" for d, (f, t) in free.items())
            + "; raise gpu_memory_utilization, free GPU memory, or give max_batch_tokens"
        )
    if cap is not None and budget > cap:
        logger.info("BatchGenerator: a KV budget of %d tokens (%d per decoder row; %s of %s's memory would "
                    "hold %d)", cap, MEMORY_BUDGET_TOKENS_PER_ROW, utilization, ", ".join(free), budget)
        return cap, True
    logger.info("BatchGenerator: a KV budget of %d tokens (%s of %s's memory, after what is in use)",
                budget, utilization, ", ".join(free))
    return budget, True


def _resolve_config(
    model: nn.Module, generation_config: Optional[GenerationConfig], kwargs: dict, device: torch.device
) -> tuple[GenerationConfig, int, int]:
    """(merged config with HF's special-token tensors, default max new tokens, default min new tokens).

    Merged and defaulted by HF's own `_prepare_generation_config`; the lengths follow HF's rule for an
    encoder-decoder (one decoder start token): max_new_tokens, else max_length - 1 when max_length was
    set anywhere, else 20 new tokens; min_new_tokens, else min_length - 1.
    """
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    # What patched generate() would send to stock HF, judged as it judges it: before HF's defaults.
    asked = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    reason = fallback_reason(asked, asked.update(**kwargs), model.training)
    if reason is not None:
        raise ValueError(f"BatchGenerator cannot serve this configuration: {reason}")
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if model_kwargs:
        raise TypeError(f"BatchGenerator got arguments that are not generation options: {sorted(model_kwargs)}")
    if config.num_beams > 1 and config.num_return_sequences > config.num_beams:
        raise ValueError(
            f"num_return_sequences ({config.num_return_sequences}) must be <= num_beams ({config.num_beams})"
        )
    if config.num_beams == 1 and not config.do_sample and config.num_return_sequences > 1:
        raise ValueError("greedy search returns one sequence per input: num_return_sequences must be 1")
    model._prepare_special_tokens(config, False, device=device)
    if config._eos_token_tensor is None or config._eos_token_tensor.numel() == 0:
        raise ValueError("BatchGenerator needs an eos_token_id (in the generation config or model config); "
                         "to force every output's length, give min_new_tokens = max_new_tokens")
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = config.max_length if has_default_max_length else config.max_length - 1
    min_new = config.min_new_tokens if config.min_new_tokens is not None else max((config.min_length or 0) - 1, 0)
    return config, max_new, min_new
