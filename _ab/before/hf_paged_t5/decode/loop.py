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

from .beam_start import BeamStart, fill_value
from .late_flag import LateFlag


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
            self.mask = self.eos_mask(scores.shape[-1], scores.device)
        return torch.where(self.mask, -math.inf, scores)

    def eos_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab_size] bool: the EOS ids this processor forbids below the minimum."""
        return torch.isin(torch.arange(vocab_size, device=device), self.eos_token_id.to(device))


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


def lean_criteria(criteria, device: torch.device) -> list[Callable]:
    """Stopping criteria as functions of input_ids (on `device`) -> [rows] bool. `MaxLengthCriteria`
    is left out: the loop stops at `max_length` on the host. EOS is a comparison instead of `isin`."""
    lean: list[Callable] = []
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            continue
        if type(c) is EosTokenCriteria:
            eos = c.eos_token_id.to(device)  # once, not every step
            lean.append(lambda ids, eos=eos: (ids[:, -1:, None] == eos).any(-1).any(-1))
        else:
            lean.append(lambda ids, c=c: c(ids, None))
    return lean


def eos_ids(criteria, device: torch.device) -> Optional[torch.Tensor]:
    """[n] the EOS ids of every `EosTokenCriteria` in `criteria` (a row ends on any of them, as
    HF's criteria list ends it when any criterion does), or None without one."""
    ids = [c.eos_token_id.to(device).reshape(-1) for c in criteria if type(c) is EosTokenCriteria]
    return torch.cat(ids) if ids else None


def criteria_supported(criteria, generation_config) -> bool:
    """The stopping criteria the device-resident loops serve: EOS, and max length at
    `generation_config.max_length` (a user's `MaxLengthCriteria` with another limit replaces HF's
    default one; those calls run `sample_loop` / `beam_loop`, which read the criteria's own limit)."""
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            if c.max_length != generation_config.max_length:
                return False
        elif type(c) is not EosTokenCriteria:
            return False
    return True


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
    # a streamer needs every token now anyway: no late read with one
    late = LateFlag(input_ids.device, defer=streamer is None)

    processors, criteria = lean_processors(logits_processor), lean_criteria(stopping_criteria, input_ids.device)
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
        stop, logits = late.queue_unless(unfinished.any(), False, lambda: step(next_tokens[:, None]))
        if stop:
            break
    if streamer is not None:
        streamer.end()
    return input_ids


def _unflatten(t: torch.Tensor, batch: int, beams: int) -> torch.Tensor:
    """[batch * beams, ...] -> [batch, beams, ...]"""
    return t.reshape(batch, beams, *t.shape[1:])


def _flatten(t: torch.Tensor) -> torch.Tensor:
    """[batch, beams, ...] -> [batch * beams, ...]"""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def beam_loop(
    model,
    step: Callable[[torch.Tensor], torch.Tensor],
    prefill: Callable[[torch.Tensor], torch.Tensor],
    reorder: Callable[[torch.Tensor], None],
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
) -> torch.LongTensor:
    """Beam search as HF's `_beam_search` does it, through HF's own beam helpers in HF's order, with
    the model called directly (no `prepare_inputs_for_generation` / model-kwargs updates per step).

    input_ids: [batch * num_beams, prompt_len] decoder prompt; returns the sequences as HF returns
    them without `return_dict_in_generate`. reorder(beam_idx [batch * num_beams]) reorders the cache.
    """
    cfg = generation_config
    pad_token_id, eos_token_id = cfg._pad_token_tensor, cfg._eos_token_tensor
    num_beams, max_length = cfg.num_beams, cfg.max_length
    flat_rows, cur_len = input_ids.shape[:2]
    batch_size, decoder_prompt_len, device = flat_rows // num_beams, cur_len, input_ids.device
    start = BeamStart.build(_unflatten(input_ids, batch_size, num_beams), max_length,
                            fill_value(pad_token_id, eos_token_id), eos_token_id.shape[0] if eos_token_id is not None else 0)
    beams_to_keep, top_num_beam_mask = start.beams_to_keep, start.top_num_beam_mask
    running_sequences, sequences = start.running_sequences, start.sequences
    running_beam_scores, beam_scores = start.running_beam_scores, start.beam_scores
    is_sent_finished = start.is_sent_finished
    is_early_stop_heuristic_unsatisfied = start.is_early_stop_heuristic_unsatisfied
    running_beam_indices, beam_indices = start.running_beam_indices, start.beam_indices
    top_k_args = inspect.signature(model._get_top_k_continuations).parameters
    processors = lean_processors(logits_processor)

    # the "go on" flag is read one step late on a GPU: the host queues the next step (cache reorder
    # included, done on the device) before it waits for this one's flag
    late = LateFlag(device)
    stop_length = getattr(stopping_criteria, "max_length", None)
    # HF's criteria over the 2 * num_beams candidates, with the max-length check done on the host
    criteria = lean_criteria(stopping_criteria, device)
    no_hit = torch.zeros(batch_size * beams_to_keep, dtype=torch.bool, device=device)
    all_hit = torch.ones_like(no_hit)

    flat_running_sequences = input_ids
    logits = prefill(input_ids)
    while True:
        log_probs = nn.functional.log_softmax(logits[:, -1, :].to(copy=True, dtype=torch.float32), dim=-1)
        for processor in processors:
            log_probs = processor(flat_running_sequences, log_probs)
        vocab_size = log_probs.shape[-1]
        log_probs = _unflatten(log_probs, batch_size, num_beams) + running_beam_scores[:, :, None]
        log_probs = log_probs.reshape(batch_size, num_beams * vocab_size)
        extra = {"vocab_size": vocab_size} if "vocab_size" in top_k_args else {}
        topk_log_probs, topk_running_sequences, topk_running_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len,
            do_sample=cfg.do_sample, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size,
            **extra,
        )
        if stop_length is not None and cur_len + 1 >= stop_length:
            hits = all_hit  # MaxLengthCriteria: every candidate, known on the host
        else:
            candidates = _flatten(topk_running_sequences[:, :, : cur_len + 1])
            hits = no_hit
            for done in criteria:
                hits = hits | done(candidates)
        hits = _unflatten(hits, batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices, next_token_hits_stopping_criteria=hits,
            num_beams=num_beams,
        )
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences, topk_running_sequences=topk_running_sequences, beam_scores=beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished, next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=top_num_beam_mask, num_beams=num_beams, cur_len=cur_len,
            decoder_prompt_len=decoder_prompt_len, length_penalty=cfg.length_penalty,
            early_stopping=cfg.early_stopping,
        )
        reorder(_flatten(running_beam_indices[..., cur_len - decoder_prompt_len]))
        cur_len += 1
        is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
            cur_len=cur_len, max_length=max_length, decoder_prompt_len=decoder_prompt_len,
            early_stopping=cfg.early_stopping, length_penalty=cfg.length_penalty,
        )
        unfinished = model._beam_search_has_unfinished_sequences(
            is_early_stop_heuristic_unsatisfied, is_sent_finished, hits, cfg.early_stopping,
        )
        if stop_length is not None and cur_len >= stop_length:
            break  # MaxLengthCriteria has just hit every candidate: HF stops here too, no wait
        flat_running_sequences = _flatten(running_sequences[:, :, :cur_len])
        stop, logits = late.queue_unless(unfinished, False, lambda: step(flat_running_sequences[:, -1:]))
        if stop:
            break
    sequences = _flatten(sequences[:, : cfg.num_return_sequences, :])
    beam_indices = _flatten(beam_indices[:, : cfg.num_return_sequences, :])
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    return sequences[:, : decoder_prompt_len + max_generated_length]
