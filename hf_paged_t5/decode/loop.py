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
from typing import Callable, Optional

import torch
from torch import nn

from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .beam_state import BeamState, fill_value
from .greedy_state import GreedyState
from .late_flag import LateFlag
from .min_length import MinLength


def lean_processors(processors: LogitsProcessorList) -> list[Callable]:
    """The same processors, in order; the two min-length ones replaced by `MinLength`.

    `LogitsProcessorList.__call__` inspects every processor's signature every step; here that
    is done once (a processor that wants more arguments keeps HF's call, and HF's error).
    """
    lean: list[Callable] = []
    for p in processors:
        if type(p) is MinNewTokensLengthLogitsProcessor:
            lean.append(MinLength(p.eos_token_id, p.min_new_tokens, p.prompt_length_to_skip))
        elif type(p) is MinLengthLogitsProcessor:
            lean.append(MinLength(p.eos_token_id, p.min_length, 0))
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
    has_eos_stopping_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_length = stopping_criteria.max_length
    state = GreedyState(input_ids, max_length, generation_config._pad_token_tensor if has_eos_stopping_criteria
                        else None)
    # a streamer needs every token now anyway: no late read with one
    late = LateFlag(input_ids.device, defer=streamer is None)

    processors, criteria = lean_processors(logits_processor), lean_criteria(stopping_criteria, input_ids.device)
    logits = prefill(input_ids)
    while True:
        scores = logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
        history = state.history()
        for processor in processors:
            scores = processor(history, scores)
        next_tokens = state.choose(scores, state.length, generation_config.do_sample)
        history = state.history()
        for done in criteria:
            state.unfinished &= ~done(history)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if max_length is not None and state.length >= max_length:
            break  # MaxLengthCriteria has just stopped every row: known on the host, no wait
        stop, logits = late.queue_unless(state.unfinished.any(), False, lambda: step(next_tokens[:, None]))
        if stop:
            break
    if streamer is not None:
        streamer.end()
    return state.history()


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
    """Beam search as HF's `_beam_search` does it, through HF's own beam helpers in HF's order
    (`BeamState.advance`), with the model called directly (no `prepare_inputs_for_generation` /
    model-kwargs updates per step).

    input_ids: [batch * num_beams, prompt_len] decoder prompt; returns the sequences as HF returns
    them without `return_dict_in_generate`. reorder(beam_idx [batch * num_beams]) reorders the cache.
    """
    cfg = generation_config
    pad_token_id, eos_token_id = cfg._pad_token_tensor, cfg._eos_token_tensor
    num_beams = cfg.num_beams
    batch_size, device = input_ids.shape[0] // num_beams, input_ids.device
    state = BeamState(input_ids.reshape(batch_size, num_beams, -1), cfg.max_length,
                      fill_value(pad_token_id, eos_token_id), eos_token_id.shape[0] if eos_token_id is not None else 0)
    processors = lean_processors(logits_processor)

    # the "go on" flag is read one step late on a GPU: the host queues the next step (cache reorder
    # included, done on the device) before it waits for this one's flag
    late = LateFlag(device)
    stop_length = getattr(stopping_criteria, "max_length", None)
    # HF's criteria over the 2 * num_beams candidates, with the max-length check done on the host
    criteria = lean_criteria(stopping_criteria, device)
    no_hit = torch.zeros(batch_size * state.beams_to_keep, dtype=torch.bool, device=device)
    all_hit = torch.ones_like(no_hit)

    def hits_of(candidates: torch.Tensor, cur_len: int) -> torch.Tensor:
        if stop_length is not None and cur_len + 1 >= stop_length:
            hits = all_hit  # MaxLengthCriteria: every candidate, known on the host
        else:
            flat = candidates[:, :, : cur_len + 1].reshape(-1, cur_len + 1)
            hits = no_hit
            for done in criteria:
                hits = hits | done(flat)
        return hits.reshape(batch_size, state.beams_to_keep)

    logits = prefill(input_ids)
    while True:
        log_probs = nn.functional.log_softmax(logits[:, -1, :].to(copy=True, dtype=torch.float32), dim=-1)
        history = state.history()
        for processor in processors:
            log_probs = processor(history, log_probs)
        reorder(state.advance(model, cfg, log_probs, hits_of))
        unfinished = model._beam_search_has_unfinished_sequences(
            state.is_early_stop_heuristic_unsatisfied, state.is_sent_finished, state.next_token_hits,
            cfg.early_stopping,
        )
        if stop_length is not None and state.cur_len >= stop_length:
            break  # MaxLengthCriteria has just hit every candidate: HF stops here too, no wait
        stop, logits = late.queue_unless(unfinished, False, lambda: step(state.next_ids()[:, None]))
        if stop:
            break
    return state.result(cfg.num_return_sequences)
