"""`BeamState`: one beam search in HF's layout, from `GenerationMixin._beam_search`'s setup on, and
its step through HF's own beam helpers (`advance`).

The three beam drivers share it, so their state cannot drift apart:
- `loop.beam_loop` (generate()'s host-driven beam search) steps it with `advance`, which calls HF's
  helpers (`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
  `_update_finished_beams`, `_check_early_stop_heuristic`) in HF's order;
- `beam_graph.BeamStep` (a subclass, generate()'s captured beam step) and the batch engine's
  `BeamGroup` (a subclass: requests of a job, each at its own length) update the same tensors in
  place with `beam_graph.advance_candidates`, a twin of those helpers whose per-step numbers are
  device tensors (no host sync; one per source for `BeamGroup`).

Tensors, batch sources x num_beams beams, sequences of at most max_length tokens:
    running_sequences / sequences: [batch, num_beams, max_length] int64, the prompt then `fill`
    running_beam_scores / beam_scores: [batch, num_beams] float32 (0 for beam 0, -1e9 elsewhere / -1e9)
    running_beam_indices / beam_indices: [batch, num_beams, max_length - prompt_len] int32, -1
    is_sent_finished: [batch, num_beams] bool; is_early_stop_heuristic_unsatisfied: [batch, 1] bool
    next_token_hits: [batch, beams_to_keep] bool, the last step's candidates that hit a stopping criterion
    top_num_beam_mask: [beams_to_keep] bool, the first num_beams True
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch


def fill_value(pad, eos):
    """HF's fill value of unfinished beams' tails, precedence and all: `pad or eos[0]` when there is
    an EOS, else -1 (a pad id of 0 gives eos[0]). pad: int, 0-dim tensor or None; eos: a sequence or
    1-d tensor of ids, or None."""
    return pad or eos[0] if eos is not None else -1


class BeamState:
    """prompt: [batch, num_beams, prompt_len] int64; fill: `fill_value(pad, eos)`; num_eos: EOS ids
    (HF keeps max(2, 1 + num_eos) * num_beams candidates per source and step)."""

    def __init__(self, prompt: torch.Tensor, max_length: int, fill, num_eos: int) -> None:
        batch, beams, prompt_len = prompt.shape
        device = prompt.device
        self.num_beams, self.max_length, self.prompt_len, self.cur_len = beams, max_length, prompt_len, prompt_len
        self.beams_to_keep = max(2, 1 + num_eos) * beams
        self.top_num_beam_mask = torch.zeros(self.beams_to_keep, dtype=torch.bool, device=device)
        self.top_num_beam_mask[:beams] = True
        self.running_sequences = torch.full((batch, beams, max_length), fill_value=fill, dtype=torch.int64,
                                            device=device)
        self.running_sequences[:, :, :prompt_len] = prompt
        self.sequences = self.running_sequences.clone()
        self.running_beam_scores = torch.zeros((batch, beams), dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((batch, beams), fill_value=-1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((batch, beams), dtype=torch.bool, device=device)
        self.is_early_stop_heuristic_unsatisfied = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.next_token_hits = torch.zeros((batch, self.beams_to_keep), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full((batch, beams, max_length - prompt_len), fill_value=-1,
                                               dtype=torch.int32, device=device)
        self.beam_indices = self.running_beam_indices.clone()
        self._top_k_takes_vocab: Optional[bool] = None

    @property
    def batch(self) -> int:
        return self.running_sequences.shape[0]

    def history(self) -> torch.Tensor:
        """[batch * num_beams, cur_len] the running beams, as HF's processors see them."""
        return self.running_sequences[:, :, : self.cur_len].reshape(self.batch * self.num_beams, -1)

    def next_ids(self) -> torch.Tensor:
        """[batch * num_beams] the last token of every running beam (the next step's input)."""
        return self.running_sequences[:, :, self.cur_len - 1].reshape(-1)

    def advance(self, model, config, log_probs: torch.Tensor,
                hits_of: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """One step of HF's `_beam_search` through HF's helpers, from processed log-probs
        [batch * num_beams, vocab] float32. hits_of(topk_running_sequences [batch, beams_to_keep,
        max_length], cur_len) -> [batch, beams_to_keep] bool: the candidates that hit a stopping
        criterion with the token at cur_len. Returns beam_idx [batch * num_beams]: the row each
        row continues from (HF's `reorder_cache` argument)."""
        b, k, cur_len, prompt_len = self.batch, self.num_beams, self.cur_len, self.prompt_len
        vocab = log_probs.shape[-1]
        log_probs = (log_probs.reshape(b, k, vocab) + self.running_beam_scores[:, :, None]).reshape(b, k * vocab)
        if self._top_k_takes_vocab is None:  # transformers versions differ; read once, not every step
            self._top_k_takes_vocab = "vocab_size" in inspect.signature(model._get_top_k_continuations).parameters
        extra = {"vocab_size": vocab} if self._top_k_takes_vocab else {}
        topk_log_probs, topk_sequences, topk_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=self.running_sequences,
            running_beam_indices=self.running_beam_indices, cur_len=cur_len, decoder_prompt_len=prompt_len,
            do_sample=config.do_sample, beams_to_keep=self.beams_to_keep, num_beams=k, batch_size=b, **extra,
        )
        hits = self.next_token_hits = hits_of(topk_sequences, cur_len)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            model._get_running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs, topk_running_sequences=topk_sequences,
                topk_running_beam_indices=topk_beam_indices, next_token_hits_stopping_criteria=hits, num_beams=k,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = model._update_finished_beams(
            sequences=self.sequences, topk_running_sequences=topk_sequences, beam_scores=self.beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=self.beam_indices, topk_running_beam_indices=topk_beam_indices,
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            is_sent_finished=self.is_sent_finished, next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=self.top_num_beam_mask, num_beams=k, cur_len=cur_len, decoder_prompt_len=prompt_len,
            length_penalty=config.length_penalty, early_stopping=config.early_stopping,
        )
        beam_idx = self.running_beam_indices[:, :, cur_len - prompt_len].reshape(-1)
        self.cur_len = cur_len = cur_len + 1
        self.is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            running_beam_scores=self.running_beam_scores, beam_scores=self.beam_scores,
            is_sent_finished=self.is_sent_finished, cur_len=cur_len, max_length=self.max_length,
            decoder_prompt_len=prompt_len, early_stopping=config.early_stopping, length_penalty=config.length_penalty,
        )
        return beam_idx

    def unfinished_each(self, early_stopping) -> torch.Tensor:
        """[batch] bool: HF's `_beam_search_has_unfinished_sequences` for each source alone."""
        return (
            self.is_early_stop_heuristic_unsatisfied[:, 0]
            & ~(self.is_sent_finished.all(dim=-1) & (early_stopping is True))
            & ~self.next_token_hits.all(dim=-1)
        )

    def result(self, num_return_sequences: int) -> torch.Tensor:
        """The sequences HF's `_beam_search` returns without `return_dict_in_generate`:
        [batch * num_return_sequences, prompt_len + longest generated]."""
        n = num_return_sequences
        sequences = self.sequences[:, :n].reshape(self.batch * n, -1)
        beam_indices = self.beam_indices[:, :n].reshape(self.batch * n, -1)
        max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
        return sequences[:, : self.prompt_len + max_generated_length]

    def keep(self, positions: Sequence[int]) -> None:
        """Drop every source but those at `positions` (in that order)."""
        index = torch.tensor(list(positions), dtype=torch.long, device=self.running_sequences.device)
        for name in ("running_sequences", "sequences", "running_beam_scores", "beam_scores", "is_sent_finished",
                     "is_early_stop_heuristic_unsatisfied", "next_token_hits", "running_beam_indices",
                     "beam_indices"):
            setattr(self, name, getattr(self, name).index_select(0, index))
