"""`GreedyState`: the sequences of one greedy or sampling search, as HF's `_sample` keeps them, and
the token choice that extends them.

HF's `_sample` keeps `input_ids` (grown by one column per step) and `unfinished_sequences`; a
chosen token is the argmax (or a multinomial draw) of the processed scores, replaced by the pad
id in rows that had finished when an EOS criterion is there. Two loops share this state:
- `loop.sample_loop` (generate()'s host-driven greedy / sampling loop, any logits processors and
  stopping criteria) calls `choose` with a host column;
- `greedy_graph.GreedyStep` (a subclass: the device-resident greedy loop) calls it with the column
  as a device tensor, inside an update that a CUDA graph records.
The batch engine's rows (`batch/rows.py`, rows at different lengths) pick their tokens with the
same `pick_tokens`.

    sequences: [rows, capacity] int64, the first `length` columns valid (HF's input_ids)
    unfinished: [rows] bool, HF's unfinished_sequences (updated in place)
    pad: 0-d int64 on the device, or None without an EOS criterion (HF pads only with one)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


def pick_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """HF's `_sample` choice from processed scores [rows, vocab]: [rows] int64."""
    if do_sample:
        return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


class GreedyState:
    """input_ids: [rows, prompt_len] decoder prompt, on the device the loop runs on; capacity: the
    most columns the sequences reach (None: grown as needed); pad: see the module docstring."""

    def __init__(self, input_ids: torch.Tensor, capacity: Optional[int], pad: Optional[torch.Tensor]) -> None:
        rows, self.prompt_len = input_ids.shape
        device = input_ids.device
        self.length = self.prompt_len
        self.sequences = torch.zeros(rows, max(capacity or 0, self.prompt_len + 1), dtype=torch.int64, device=device)
        self.sequences[:, : self.prompt_len] = input_ids
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        self.pad = None if pad is None else pad.to(device)

    def reset(self, input_ids: torch.Tensor) -> None:
        """Start again from `input_ids` [rows, prompt_len] on the same tensors (in place)."""
        self.prompt_len = self.length = input_ids.shape[1]
        self.sequences.zero_()  # as a fresh state's (columns past the length are never returned)
        self.sequences[:, : self.prompt_len].copy_(input_ids)
        self.unfinished.fill_(True)

    def history(self) -> torch.Tensor:
        """[rows, length] the sequences so far (HF's input_ids), a view."""
        return self.sequences[:, : self.length]

    def choose(self, scores: torch.Tensor, column: Union[int, torch.Tensor], do_sample: bool = False) -> torch.Tensor:
        """Pick the tokens from processed scores [rows, vocab] float32, pad the finished rows and
        write the tokens at `column` (a host int: the next column, counted in `length`; or a device
        tensor, the caller counts). Returns the tokens [rows] int64."""
        tokens = pick_tokens(scores, do_sample)
        if self.pad is not None:
            # HF's `tokens * unfinished + pad * (1 - unfinished)`, in one op
            tokens = torch.where(self.unfinished, tokens, self.pad)
        if isinstance(column, torch.Tensor):
            self.sequences.scatter_(1, column.expand(tokens.shape[0], 1), tokens[:, None])
            return tokens
        if column >= self.sequences.shape[1]:  # no capacity given: double
            wider = self.sequences.new_zeros(self.sequences.shape[0], 2 * self.sequences.shape[1])
            wider[:, : self.sequences.shape[1]] = self.sequences
            self.sequences = wider
        self.sequences[:, column] = tokens
        self.length = column + 1
        return tokens
