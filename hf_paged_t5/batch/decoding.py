"""Token selection for rows at different lengths: HF's logits processors and HF's beam-search steps.

`LogitsRules` holds the processors `generate()` would build from the generation config (HF's own
objects, from `model._get_logits_processor`). Three of them depend on a request's own length limits
(`MinLengthLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`, `ForcedEOSTokenLogitsProcessor`);
they are replaced, at their place in the list, by row-wise twins that read each row's limits from a
`RowLimits`. Processors that read only the scores run on all rows at once. Any other processor may
read the row's history (`repetition_penalty`, `no_repeat_ngram_size`, ...): it runs once per group
of rows of equal length, with those rows' histories, which is exactly what it sees when the request
runs alone. Processors bound to one batch's encoder inputs or to a second model are refused.

`BeamGroup` is the beam search of a job's requests with the same EOS ids, each at its own length,
kept in HF's layout ([batch, num_beams, ...]) and advanced by HF's beam arithmetic with each
source's own numbers (`decode.beam_graph.advance_candidates`, the twin of `_get_top_k_continuations`,
`_update_finished_beams`, ... that generate()'s captured beam step runs), so length_penalty,
early_stopping and EOS behave as in `generate()`. A request joins the group when admitted and
leaves it when HF's loop would stop for it alone.
"""

from __future__ import annotations

from types import MappingProxyType
import copy
import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList

from ..decode.beam_graph import advance_candidates, length_factors
from ..decode.beam_state import BeamState, fill_value
from ..decode.min_length import forbid_eos, row_eos_mask
from ..kv.tables import upload

# Processors that read the scores only, never `input_ids`: they run on all rows at once.
SCORES_ONLY = frozenset(
    {
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor",
        "LogitNormalization", "SuppressTokensLogitsProcessor",
    }
)
# Processors that captured the config's EOS ids: a request with its own EOS cannot share them.
EOS_BOUND = frozenset({"NoBadWordsLogitsProcessor", "ExponentialDecayLengthPenalty"})
# Generation options whose processors are bound to one batch or model: refused, with the reason.
REFUSED_OPTIONS = MappingProxyType({
    "encoder_repetition_penalty": (1.0, "it is bound to one batch's encoder input_ids"),
    "encoder_no_repeat_ngram_size": (0, "it is bound to one batch's encoder input_ids"),
    "guidance_scale": (1.0, "classifier-free guidance runs a second, unconditional model pass"),
    "watermarking_config": (None, "watermarking is not verified for continuous batching"),
    "stop_strings": (None, "stop strings need the tokenizer inside HF's stopping criteria"),
    "max_time": (None, "a time limit per call has no meaning for a batch job"),
    "output_scores": (False, "per-step scores are not returned"),
    "output_logits": (False, "per-step logits are not returned"),
    "return_dict_in_generate": (False, "results are BatchResult records"),
})


@dataclasses.dataclass
class RowLimits:
    """Per-row length limits of one step, on the logits' device.

    generated: [rows] int64, tokens generated so far (decoder length - 1)
    min_new / max_new: [rows] int64, the row's request limits
    eos: [rows, num_eos] int64, the request's EOS ids (padded by repeating the first)
    """

    generated: torch.Tensor
    min_new: torch.Tensor
    max_new: torch.Tensor
    eos: torch.Tensor

    @staticmethod
    def build(generated: Sequence[int], min_new: Sequence[int], max_new: Sequence[int],
              eos: Sequence[Sequence[int]], device: torch.device) -> "RowLimits":
        width = max(len(e) for e in eos)
        rows = [[g, lo, hi, *e, *[e[0]] * (width - len(e))] for g, lo, hi, e in zip(generated, min_new, max_new, eos)]
        packed = upload(torch.tensor(rows, dtype=torch.long), device)  # [rows, 3 + num_eos], one transfer
        return RowLimits(packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3:])

    def select(self, index: torch.Tensor) -> "RowLimits":
        return RowLimits(self.generated[index], self.min_new[index], self.max_new[index], self.eos[index])


class _RowMinNewTokens:
    """HF's MinLength / MinNewTokens processors with each row's own minimum: EOS is -inf until reached."""

    def apply(self, scores: torch.Tensor, limits: RowLimits) -> torch.Tensor:
        return forbid_eos(scores, row_eos_mask(scores, limits.eos, (limits.generated < limits.min_new)[:, None]), True)


class _RowForcedEos:
    """HF's ForcedEOSTokenLogitsProcessor with each row's own max length."""

    def __init__(self, forced_ids: torch.Tensor) -> None:
        self.forced_ids = forced_ids

    def apply(self, scores: torch.Tensor, limits: RowLimits) -> torch.Tensor:
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.forced_ids] = 0
        last = (limits.generated == limits.max_new - 1)[:, None]
        return torch.where(last, forced, scores)


class LogitsRules:
    """The logits processors of `generate()` for `config`, applicable to rows with their own limits."""

    def __init__(self, model: nn.Module, config: GenerationConfig, device: torch.device) -> None:
        for name, (off, why) in REFUSED_OPTIONS.items():
            value = getattr(config, name, None)
            if value is not None and value != off:
                raise ValueError(f"BatchGenerator does not serve {name}={value!r}: {why}")
        anchored = copy.deepcopy(config)
        # A min_new_tokens of 1 makes HF place its MinNewTokens processor; ours takes its place.
        anchored.min_length, anchored.min_new_tokens = 0, 1
        built = model._get_logits_processor(
            generation_config=anchored, input_ids_seq_length=1, encoder_input_ids=None,
            prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device, model_kwargs={},
        )
        self.steps: list = []
        for processor in built:
            name = type(processor).__name__
            if name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
                if not any(isinstance(s, _RowMinNewTokens) for s in self.steps):
                    self.steps.append(_RowMinNewTokens())
            elif name == "ForcedEOSTokenLogitsProcessor":
                self.steps.append(_RowForcedEos(processor.eos_token_id))
            else:
                self.steps.append(processor)
        names = {type(s).__name__ for s in self.steps}
        self.needs_history = any(
            not isinstance(s, (_RowMinNewTokens, _RowForcedEos)) and type(s).__name__ not in SCORES_ONLY
            for s in self.steps
        )
        self.binds_eos = sorted(names & EOS_BOUND)

    def __call__(self, input_ids: Optional[torch.Tensor], scores: torch.Tensor, limits: RowLimits) -> torch.Tensor:
        """Processed scores [rows, vocab]. `input_ids` [rows, cur_len] (rows of equal length) is needed
        when `needs_history`; otherwise it may be None."""
        for step in self.steps:
            if isinstance(step, (_RowMinNewTokens, _RowForcedEos)):
                scores = step.apply(scores, limits)
            else:
                scores = step(input_ids, scores)
        return scores


class BeamGroup(BeamState):
    """The beam search of `batch` requests with the same EOS ids, each at its own length (the decoder
    start token as prompt): a request joins when admitted (`extend`) and leaves when HF's loop would
    stop for it alone (`keep`), so a job steps one group per EOS ids however its admissions fall.

    The state is HF's ([batch, num_beams, ...], each source's tokens from column 0) and its step is
    HF's beam arithmetic (`decode.beam_graph.advance_candidates`, shared with generate()'s captured
    beam step) with each source's own numbers on the device: its cur_len (`cur`), its max length
    (`limits.max_new`: HF's max-length criterion and forced EOS) and its length-penalty divisors
    (`factors`, HF's Python values per cur_len: `(cur_len + 1 - prompt_len) ** length_penalty`, and
    under early_stopping="never" with a positive penalty the heuristic's `(max_length - prompt_len)
    ** length_penalty`; the prompt is the start token).

    max_lengths: each request's max_length (1 + its max_new_tokens); the buffers take the longest.
    limits: `RowLimits` of the batch * num_beams rows (`generated` is set each step)
    """

    def __init__(self, config: GenerationConfig, min_new: Sequence[int], max_lengths: Sequence[int],
                 eos: Sequence[int], start_id: int, pad_id: Optional[int], device: torch.device) -> None:
        k = config.num_beams
        batch, rows = len(min_new), len(min_new) * k
        if len(max_lengths) != batch:
            raise ValueError(f"{batch} requests but {len(max_lengths)} max lengths")
        prompt = torch.full((batch, k, 1), start_id, dtype=torch.long, device=device)
        self.fill = fill_value(pad_id, list(eos))
        super().__init__(prompt, max(max_lengths), self.fill, len(eos))
        self.config, self.eos_ids = config, tuple(eos)
        self.limits = RowLimits.build([0] * rows, [m for m in min_new for _ in range(k)],
                                      [n - 1 for n in max_lengths for _ in range(k)], [eos] * rows, device)
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)
        self.lengths = np.ones(batch, dtype=np.int64)  # each source's cur_len, on the host
        self.cur = torch.ones(batch, dtype=torch.long, device=device)  # the same on the device
        multiply = device.type == "cuda"  # how HF's division by a Python float runs there (`scale_by`)
        table = np.ones((batch, self.max_length, 2), dtype=np.float32)
        for b, n in enumerate(max_lengths):
            table[b, :n] = _length_factors(n, config.length_penalty, config.early_stopping, multiply)
        self.factors = upload(torch.from_numpy(table), device)  # [batch, max_length, 2] float32

    def next_ids(self) -> torch.Tensor:
        """[batch * num_beams] the last token of every running beam, each source at its own length."""
        column = (self.cur - 1).view(-1, 1, 1).expand(-1, self.num_beams, 1)
        return torch.gather(self.running_sequences, 2, column).reshape(-1)

    def step(self, logits: torch.Tensor, rules: LogitsRules) -> tuple[torch.Tensor, torch.Tensor]:
        """One beam-search step from logits [batch * num_beams, vocab] float32.

        Returns (beam_idx [batch * num_beams]: the group row each row continues from, as HF's
        `reorder_cache` gets it; unfinished [batch] bool: HF's loop would go on for the request alone).
        """
        k = self.num_beams
        self.limits.generated.copy_((self.cur - 1).repeat_interleave(k))
        log_probs = nn.functional.log_softmax(logits, dim=-1)
        log_probs = self._processed(rules, log_probs) if rules.needs_history else rules(None, log_probs, self.limits)
        factors = torch.gather(self.factors, 1, self.cur.view(-1, 1, 1).expand(-1, 1, 2))[:, 0]  # [batch, 2]
        at_max = self.cur >= self.limits.max_new.view(-1, k)[:, 0]  # HF: cur_len + 1 >= max_length
        offset = torch.arange(self.batch, device=self.cur.device).view(-1, 1) * k
        self.next_token_hits = advance_candidates(self, log_probs, self.cur, at_max, self.eos, factors[:, 0],
                                                  factors[:, 1], self.config.early_stopping, offset,
                                                  self.config.do_sample)
        beam_idx = torch.gather(self.running_beam_indices, 2, (self.cur - 1).view(-1, 1, 1).expand(-1, k, 1))
        self.cur += 1
        self.lengths += 1
        return beam_idx.reshape(-1), self.unfinished_each(self.config.early_stopping)

    def _processed(self, rules: LogitsRules, log_probs: torch.Tensor) -> torch.Tensor:
        """`rules` over the sources of each length in turn: a processor that reads the history sees
        the rows of one length, as in HF's loop for each request alone."""
        k, out = self.num_beams, log_probs
        for length in np.unique(self.lengths):
            sources = np.flatnonzero(self.lengths == length)
            history = self.running_sequences[:, :, :length]
            if len(sources) == self.batch:
                return rules(history.reshape(-1, length), log_probs, self.limits)
            index = torch.from_numpy(sources).to(log_probs.device)
            rows = (index[:, None] * k + torch.arange(k, device=index.device)).reshape(-1)
            done = rules(history.index_select(0, index).reshape(-1, length), log_probs.index_select(0, rows),
                         self.limits.select(rows))
            out = out.index_copy(0, rows, done)
        return out

    def output(self, position: int) -> tuple[list[list[int]], list[float]]:
        """The finished request at `position`: its num_return_sequences rows, cropped as generate() crops
        them, and their scores."""
        n = self.config.num_return_sequences
        beam_indices = self.beam_indices[position, :n]  # [n, max_length - 1]
        generated = int((beam_indices + 1).bool().sum(dim=1).max())
        return self.sequences[position, :n, : 1 + generated].tolist(), self.beam_scores[position, :n].tolist()

    def keep(self, positions: Sequence[int]) -> None:
        """Drop every request but those at `positions` (in that order)."""
        super().keep(positions)
        index = torch.tensor(list(positions), dtype=torch.long, device=self.running_sequences.device)
        k = self.num_beams
        self.limits = self.limits.select((index[:, None] * k + torch.arange(k, device=index.device)).reshape(-1))
        self.cur, self.factors = self.cur.index_select(0, index), self.factors.index_select(0, index)
        self.lengths = self.lengths[np.asarray(positions, dtype=np.int64)]

    def extend(self, other: "BeamGroup") -> None:
        """Append `other`'s requests (admitted later: same EOS ids and beams, their own lengths) after
        this group's; the buffers take the longer max length of the two."""
        if other.eos_ids != self.eos_ids or other.num_beams != self.num_beams:
            raise ValueError("only beam groups of the same EOS ids and beam count merge")
        width = max(self.max_length, other.max_length)
        # (name, fill, columns, column axis): a source's tokens, its beam indices (one per generated
        # token), its factors per cur_len
        padding = (("running_sequences", self.fill, width, 2), ("sequences", self.fill, width, 2),
                   ("running_beam_indices", -1, width - 1, 2), ("beam_indices", -1, width - 1, 2),
                   ("factors", 1.0, width, 1))
        for name, fill, columns, axis in padding:
            setattr(self, name, torch.cat([_widen(getattr(g, name), columns, fill, axis) for g in (self, other)]))
        for name in ("running_beam_scores", "beam_scores", "is_sent_finished", "is_early_stop_heuristic_unsatisfied",
                     "next_token_hits", "cur"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.limits = RowLimits(*(torch.cat([getattr(self.limits, f.name), getattr(other.limits, f.name)])
                                  for f in dataclasses.fields(RowLimits)))
        self.lengths = np.concatenate([self.lengths, other.lengths])
        self.max_length = width


def _widen(tensor: torch.Tensor, columns: int, fill, axis: int) -> torch.Tensor:
    """`tensor` padded with `fill` to `columns` along `axis`."""
    missing = columns - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim=axis)


@functools.lru_cache(maxsize=1024)
def _length_factors(max_length: int, length_penalty: float, early_stopping, multiply: bool) -> np.ndarray:
    """[max_length, 2] float32: at each cur_len, the `division_factor`s of HF's length penalty for
    the step's finished candidates and for the early-stop heuristic (prompt: the start token)."""
    table = np.ones((max_length, 2), dtype=np.float32)
    for cur_len in range(1, max_length):
        table[cur_len] = length_factors(cur_len, 1, max_length, length_penalty, early_stopping, multiply)
    return table
