"""HF's `MinLengthLogitsProcessor` / `MinNewTokensLengthLogitsProcessor` rule, once: below the
minimum length, every EOS id scores -inf.

`MinLength` is the rule of one processor (its EOS ids, minimum and the prompt length it skips);
`blocked(cur_len)` says whether the rule holds at a length, as a Python bool on the host or as a
tensor on the device (CUDA graphs, rows at different lengths); `forbid_eos` applies it. The eager
loops, the captured beam update and the batch engine's per-row twin go through `forbid_eos`; the
captured greedy update (`kernels.greedy_update` and its twin) reads the rules folded into one
table, `eos_until`: the same -inf entries, so all give the scores of HF's processors.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch


def forbid_eos(scores: torch.Tensor, eos_mask: torch.Tensor, blocked: Union[bool, torch.Tensor]) -> torch.Tensor:
    """`scores` [rows, vocab] with EOS at -inf where `blocked`.

    eos_mask: [vocab] or [rows, vocab] bool, the EOS ids; blocked: a bool, a 0-d bool tensor or
    [rows, 1] bool (per row).
    """
    if blocked is False:
        return scores
    return scores.masked_fill(eos_mask if blocked is True else eos_mask & blocked, -math.inf)


def row_eos_mask(scores: torch.Tensor, eos: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool: each row's own EOS ids where the row is `blocked`; eos [rows, num_eos]
    int64, blocked [rows, 1] bool. One scatter: a mask for `forbid_eos(scores, mask, True)`."""
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, eos, blocked.expand_as(eos))


class MinLength:
    """One min-length processor, with its EOS mask over the vocabulary built once and nothing
    done once the minimum is reached (HF's scores either way). Callable as HF's processor."""

    def __init__(self, eos_token_id: torch.Tensor, minimum: int, skip: int) -> None:
        self.eos_token_id, self.minimum, self.skip = eos_token_id, minimum, skip
        self.mask: Optional[torch.Tensor] = None  # [vocab] bool

    def blocked(self, cur_len):
        """Whether EOS is forbidden at decoder length `cur_len` (an int, or a tensor on the device)."""
        return cur_len - self.skip < self.minimum

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.blocked(input_ids.shape[-1]):
            return scores
        if self.mask is None:
            self.mask = self.eos_mask(scores.shape[-1], scores.device)
        return forbid_eos(scores, self.mask, True)

    def eos_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab_size] bool: the EOS ids this processor forbids below the minimum."""
        return torch.isin(torch.arange(vocab_size, device=device), self.eos_token_id.to(device))


def eos_until(processors, vocab_size: int, device: torch.device) -> Optional[torch.Tensor]:
    """[vocab_size] int32: for each entry, the decoder length from which the min-length rules of
    `processors` (`MinLength`s) stop forbidding it (0: never forbidden); None without any rule.
    A rule forbids its EOS ids while `cur_len - skip < minimum`, i.e. while cur_len < minimum + skip
    (a bound past int32 is kept at int32's largest: no sequence gets that long)."""
    if not processors:
        return None
    until = torch.zeros(vocab_size, dtype=torch.int32, device=device)
    for p in processors:
        mask = p.eos_mask(vocab_size, device)
        bound = max(0, min(p.minimum + p.skip, torch.iinfo(torch.int32).max))
        until = torch.where(mask, torch.clamp(until, min=bound), until)
    return until
