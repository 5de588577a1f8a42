"""`BeamStart`: HF's beam-search tensors at the first step (`GenerationMixin._beam_search`'s setup),
built once for the three beam drivers (`loop.beam_loop`, `beam_graph.BeamStep`, the batch engine's
`BeamGroup`), so their starting state cannot drift apart."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class BeamStart:
    """batch sources x num_beams beams, sequences of at most max_length tokens."""

    beams_to_keep: int  # candidates kept per source and step: max(2, 1 + number of EOS ids) * num_beams
    top_num_beam_mask: torch.Tensor  # [beams_to_keep] bool, the first num_beams True
    running_sequences: torch.Tensor  # [batch, num_beams, max_length] int64: the prompt, then `fill`
    sequences: torch.Tensor  # [batch, num_beams, max_length] int64, a copy of running_sequences
    running_beam_scores: torch.Tensor  # [batch, num_beams] float32: 0 for beam 0, -1e9 for the others
    beam_scores: torch.Tensor  # [batch, num_beams] float32, -1e9
    is_sent_finished: torch.Tensor  # [batch, num_beams] bool, False
    is_early_stop_heuristic_unsatisfied: torch.Tensor  # [batch, 1] bool, True
    running_beam_indices: torch.Tensor  # [batch, num_beams, max_length - prompt_len] int32, -1
    beam_indices: torch.Tensor  # a copy of running_beam_indices

    @classmethod
    def build(cls, prompt: torch.Tensor, max_length: int, fill, num_eos: int) -> "BeamStart":
        """prompt: [batch, num_beams, prompt_len] int64; fill: HF's `fill_value(pad, eos)`."""
        batch, beams, prompt_len = prompt.shape
        device = prompt.device
        beams_to_keep = max(2, 1 + num_eos) * beams
        top_num_beam_mask = torch.zeros(beams_to_keep, dtype=torch.bool, device=device)
        top_num_beam_mask[:beams] = True
        running_sequences = torch.full((batch, beams, max_length), fill_value=fill, dtype=torch.int64, device=device)
        running_sequences[:, :, :prompt_len] = prompt
        running_beam_scores = torch.zeros((batch, beams), dtype=torch.float, device=device)
        running_beam_scores[:, 1:] = -1e9
        running_beam_indices = torch.full((batch, beams, max_length - prompt_len), fill_value=-1, dtype=torch.int32,
                                          device=device)
        return cls(
            beams_to_keep=beams_to_keep,
            top_num_beam_mask=top_num_beam_mask,
            running_sequences=running_sequences,
            sequences=running_sequences.clone(),
            running_beam_scores=running_beam_scores,
            beam_scores=torch.full((batch, beams), fill_value=-1e9, dtype=torch.float, device=device),
            is_sent_finished=torch.zeros((batch, beams), dtype=torch.bool, device=device),
            is_early_stop_heuristic_unsatisfied=torch.ones((batch, 1), dtype=torch.bool, device=device),
            running_beam_indices=running_beam_indices,
            beam_indices=running_beam_indices.clone(),
        )


def fill_value(pad, eos):
    """HF's fill value of unfinished beams' tails, precedence and all: `pad or eos[0]` when there is
    an EOS, else -1 (a pad id of 0 gives eos[0]). pad: int, 0-dim tensor or None; eos: a sequence or
    1-d tensor of ids, or None."""
    return pad or eos[0] if eos is not None else -1
