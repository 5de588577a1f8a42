"""Token selection for rows at different lengths: HF's logits processors and HF's beam-search steps.

`LogitsRules` holds the processors `generate()` would build from the generation config (HF's own
objects, from `model._get_logits_processor`). Three of them depend on a request's own length limits
(`MinLengthLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`, `ForcedEOSTokenLogitsProcessor`);
they are replaced, at their place in the list, by row-wise twins that read each row's limits from a
`RowLimits`. Processors that read only the scores run on all rows at once. Any other processor may
read the row's history (`repetition_penalty`, `no_repeat_ngram_size`, ...): it runs once per group
of rows of equal length, with those rows' histories, which is exactly what it sees when the request
runs alone. Processors bound to one batch's encoder inputs or to a second model are refused.

`BeamGroup` is the beam search of requests admitted in the same step with the same max length and
EOS set, kept in HF's layout ([batch, num_beams, ...]) and advanced by HF's own helpers
(`_get_top_k_continuations`, `_update_finished_beams`, ...), so length_penalty, early_stopping and
EOS behave as in `generate()`. A request leaves its group when HF's loop would stop for it alone.
"""

from __future__ import annotations

from types import MappingProxyType
import copy
import dataclasses
import math
from typing import Optional, Sequence

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList

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


def needs_one_max_length(config: GenerationConfig) -> bool:
    """Whether HF's early-stop heuristic reads max_length (`_check_early_stop_heuristic`: the best
    hypothetical length of a running beam under early_stopping="never" and a positive length
    penalty), so that one beam group must hold requests of one max_length."""
    return config.early_stopping == "never" and config.length_penalty > 0.0


class BeamGroup(BeamState):
    """The `BeamState` of `batch` requests that share cur_len and EOS ids (the decoder start token
    as prompt), stepped by HF's helpers with each request's own length limits.

    max_lengths: each request's max_length (1 + its max_new_tokens). The state's buffers take the
        longest; a request's own, kept in `limits.max_new`, enters HF's max-length criterion
        (`hits_of`) and its forced EOS. HF's early-stop heuristic reads one max_length, and only under
        early_stopping="never" with a positive length penalty: there the caller groups requests
        of one max_length (`needs_one_max_length`).
    limits: `RowLimits` of the batch * num_beams rows, built once (`generated` is set each step)
    """

    def __init__(self, model: nn.Module, config: GenerationConfig, min_new: Sequence[int],
                 max_lengths: Sequence[int], eos: Sequence[int], start_id: int, pad_id: Optional[int],
                 device: torch.device) -> None:
        k = config.num_beams
        batch, rows = len(min_new), len(min_new) * k
        if len(max_lengths) != batch:
            raise ValueError(f"{batch} requests but {len(max_lengths)} max lengths")
        if needs_one_max_length(config) and len(set(max_lengths)) > 1:
            raise ValueError("early_stopping='never' with a positive length_penalty reads one max_length per group")
        prompt = torch.full((batch, k, 1), start_id, dtype=torch.long, device=device)
        super().__init__(prompt, max(max_lengths), fill_value(pad_id, list(eos)), len(eos))
        self.model, self.config = model, config
        self.limits = RowLimits.build([0] * rows, [m for m in min_new for _ in range(k)],
                                      [n - 1 for n in max_lengths for _ in range(k)], [eos] * rows, device)
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)

    def step(self, logits: torch.Tensor, rules: LogitsRules) -> tuple[torch.Tensor, torch.Tensor]:
        """One beam-search step from logits [batch * num_beams, vocab] float32.

        Returns (beam_idx [batch * num_beams]: the group row each row continues from, as HF's
        `reorder_cache` gets it; unfinished [batch] bool: HF's loop would go on for the request alone).
        """
        self.limits.generated.fill_(self.cur_len - 1)
        log_probs = rules(self.history(), nn.functional.log_softmax(logits, dim=-1), self.limits)

        def hits_of(candidates: torch.Tensor, cur_len: int) -> torch.Tensor:  # HF's EOS and max-length criteria
            # cur_len + 1 >= the source's max_length (1 + max_new; its rows share it: the first row's)
            last = cur_len >= self.limits.max_new.view(-1, self.num_beams)[:, :1]  # [batch, 1]
            return torch.isin(candidates[:, :, cur_len], self.eos) | last

        beam_idx = self.advance(self.model, self.config, log_probs, hits_of)
        return beam_idx, self.unfinished_each(self.config.early_stopping)

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
