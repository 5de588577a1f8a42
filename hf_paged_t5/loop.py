"""The greedy / sampling decode loop of a paged `generate()`, handed to HF as `custom_generate`.

It is HF's `_sample` loop with HF's own logits processors and stopping criteria, minus the
per-step work the paged path does not need (`prepare_inputs_for_generation`, model-kwargs
updates, attention-mask growth), and with the stop decision read one step late: the host
queues step n+1 before it waits for step n's "all finished" flag, so host work overlaps the
GPU instead of alternating with it. When the flag says stop, the queued step's logits are
dropped (its K/V lands in blocks that `release()` frees), so the returned tokens are HF's.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional

import torch
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


class _MinLength:
    """HF's MinLength / MinNewTokensLength processors with the EOS mask over the vocabulary built
    once, not every step, and nothing done once the minimum is reached (same scores either way)."""

    def __init__(self, eos_token_id: torch.Tensor, minimum: int, skip: int) -> None:
        self.eos_token_id, self.minimum, self.skip = eos_token_id, minimum, skip
        self.mask: Optional[torch.Tensor] = None  # [vocab] bool

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.skip >= self.minimum:
            return scores
        if self.mask is None:
            vocab = torch.arange(scores.shape[-1], device=scores.device)
            self.mask = torch.isin(vocab, self.eos_token_id.to(scores.device))
        return torch.where(self.mask, -math.inf, scores)


def lean_processors(processors: LogitsProcessorList) -> list[Callable]:
    """The same processors, in order; the two min-length ones replaced by `_MinLength`.

    `LogitsProcessorList.__call__` inspects every processor's signature every step; here that
    is done once (a processor that wants more arguments keeps HF's call, and HF's error).
    """
    lean: list[Callable] = []
    for p in processors:
        if type(p) is MinNewTokensLengthLogitsProcessor:
            lean.append(_MinLength(p.eos_token_id, p.min_new_tokens, p.prompt_length_to_skip))
        elif type(p) is MinLengthLogitsProcessor:
            lean.append(_MinLength(p.eos_token_id, p.min_length, 0))
        elif len(inspect.signature(p.__call__).parameters) > 2:
            lean.append(LogitsProcessorList([p]))
        else:
            lean.append(p)
    return lean


def lean_criteria(criteria) -> list[Callable]:
    """Stopping criteria as functions of input_ids -> [rows] bool. `MaxLengthCriteria` is left
    out: the loop stops at `max_length` on the host. EOS is a comparison instead of `isin`."""
    lean: list[Callable] = []
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            continue
        if type(c) is EosTokenCriteria:
            eos = c.eos_token_id
            lean.append(lambda ids, eos=eos: (ids[:, -1:, None] == eos.to(ids.device)).any(-1).any(-1))
        else:
            lean.append(lambda ids, c=c: c(ids, None))
    return lean


def sample_loop(
    step: Callable[[torch.Tensor], torch.Tensor],
    prefill: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    streamer=None,
) -> torch.LongTensor:
    """Greedy or multinomial decoding; returns the sequences [rows, length] as HF's `_sample` does.

    prefill(input_ids [rows, L]) -> logits [rows, L, vocab]: the first decoder forward.
    step(tokens [rows, 1]) -> logits [rows, 1, vocab]: one cached decode step.
    """
    pad_token_id = generation_config._pad_token_tensor
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    has_eos_stopping_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_length = stopping_criteria.max_length
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    # Deferring needs an asynchronous device->host copy; a streamer needs every token now anyway.
    defer = input_ids.device.type == "cuda" and streamer is None
    if defer:
        all_done = torch.zeros((), dtype=torch.bool, pin_memory=True)
        copied = torch.cuda.Event()

    processors, criteria = lean_processors(logits_processor), lean_criteria(stopping_criteria)
    logits = prefill(input_ids)
    while True:
        next_token_logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
        scores = next_token_logits
        for processor in processors:
            scores = processor(input_ids, scores)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if has_eos_stopping_criteria:
            # HF's `tokens * unfinished + pad * (1 - unfinished)`, in one op
            next_tokens = torch.where(unfinished, next_tokens, pad_token_id)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        for done in criteria:
            unfinished = unfinished & ~done(input_ids)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if max_length is not None and input_ids.shape[1] >= max_length:
            break  # MaxLengthCriteria has just stopped every row: known on the host, no wait
        if not defer:
            if not unfinished.any():
                break
            logits = step(next_tokens[:, None])
            continue
        all_done.copy_(~unfinished.any(), non_blocking=True)
        copied.record()
        logits = step(next_tokens[:, None])  # queued before we wait: it may be dropped below
        copied.synchronize()
        if bool(all_done):
            break
    if streamer is not None:
        streamer.end()
    return input_ids
