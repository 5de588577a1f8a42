"""How two `generate()` outputs agree token by token, and the float64 check of the demo.

`token_agreement` compares the paged run with stock HF position by position; `float64_check`
compares each with stock HF on a float64 copy of the model (how sensitive the model itself is to
rounding) and, for greedy search, whether each row where they differ first differs on a near-tie.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How many generated tokens of the paged run equal stock HF's, position by position.

    A row is compared up to the longer of its two sequences (each ends at its first EOS).
    """

    matching_tokens: int
    compared_tokens: int
    matching_sequences: int
    num_sequences: int

    @property
    def fraction(self) -> float:
        return self.matching_tokens / self.compared_tokens if self.compared_tokens else 1.0


@dataclasses.dataclass(frozen=True)
class Float64Check:
    """Stock HF and paged, each against stock HF on a float64 copy of the model.

    near_ties: one entry per row where paged and stock differ (greedy search only; None with beam
    search): whether the first two tokens they differ on are a near-tie, i.e. their float64 logits
    are closer than twice the largest error of stock's own logits at that step (stock at the
    model's dtype against float64, on the prefix both share). Rounding explains a near-tie flip;
    it does not explain a wider gap.
    """

    stock: Agreement
    paged: Agreement
    near_ties: Optional[tuple[bool, ...]]


def _eos_ids(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(i) for i in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}


def _padded_pair(ref: torch.Tensor, out: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ref, out [batch, len] (lengths may differ), right-padded to one length."""
    width = max(ref.shape[1], out.shape[1])
    ref = torch.nn.functional.pad(ref, (0, width - ref.shape[1]), value=pad_token_id)
    out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=pad_token_id)
    return ref, out


def _row_length(row: torch.Tensor, eos_ids: set[int]) -> int:
    """Length of one generated row [out_len] up to and including its first EOS (column 0 excluded)."""
    for j in range(1, row.shape[0]):
        if int(row[j]) in eos_ids:
            return j + 1
    return row.shape[0]


def token_agreement(ref: torch.Tensor, out: torch.Tensor, eos_token_id, pad_token_id: int) -> Agreement:
    """Position-by-position agreement of generated tokens; ref, out: [batch, len] (lengths may differ)."""
    ref, out = _padded_pair(ref, out, pad_token_id)
    eos_ids = _eos_ids(eos_token_id)
    matching = compared = same_rows = 0
    for r, o in zip(ref, out):
        n = max(_row_length(r, eos_ids), _row_length(o, eos_ids))
        equal = int((r[1:n] == o[1:n]).sum())
        matching += equal
        compared += n - 1
        same_rows += equal == n - 1
    return Agreement(matching, compared, same_rows, ref.shape[0])


def first_departures(ref: torch.Tensor, out: torch.Tensor, eos_token_id, pad_token_id: int) -> list[Optional[int]]:
    """Per row, the index (1 = first generated token) where `out` first differs from `ref`, or None.

    ref, out: [batch, len] (lengths may differ); rows compared as in `token_agreement`.
    """
    ref, out = _padded_pair(ref, out, pad_token_id)
    eos_ids = _eos_ids(eos_token_id)
    departures = []
    for r, o in zip(ref, out):
        n = max(_row_length(r, eos_ids), _row_length(o, eos_ids))
        differ = (r[1:n] != o[1:n]).nonzero()
        departures.append(int(differ[0, 0]) + 1 if differ.numel() else None)
    return departures


@torch.no_grad()
def _next_token_logits(model, batch: dict, row: int, prefix: torch.Tensor) -> torch.Tensor:
    """float64 logits [vocab] of `model` for the token after decoder `prefix` [len] of `batch` row `row`."""
    device = next(model.parameters()).device
    inputs = {k: v[row : row + 1] for k, v in batch.items()}
    return model(**inputs, decoder_input_ids=prefix[None].to(device)).logits[0, -1].double()


def _near_tie(model, exact_model, batch: dict, row: int, prefix: torch.Tensor, a: int, b: int) -> bool:
    """Whether tokens `a` and `b` after `prefix` are closer in float64 than twice stock's own logit error."""
    logits = _next_token_logits(model, batch, row, prefix)
    exact = _next_token_logits(exact_model, batch, row, prefix)
    return bool((exact[a] - exact[b]).abs() <= 2 * (logits - exact).abs().max())


def near_ties(model, exact_model, batch: dict, ref: torch.Tensor, out: torch.Tensor, eos_token_id,
               pad_token_id: int) -> tuple[bool, ...]:
    """Greedy search: one entry per row where `out` differs from `ref` ([batch, len] each), whether
    the first two tokens they differ on are a near-tie (`Float64Check.near_ties`). `model` is the
    unpatched model at its own dtype, `exact_model` its float64 copy."""
    ref_, out_ = _padded_pair(ref, out, pad_token_id)
    return tuple(
        _near_tie(model, exact_model, batch, row, ref_[row, :p], int(ref_[row, p]), int(out_[row, p]))
        for row, p in enumerate(first_departures(ref, out, eos_token_id, pad_token_id)) if p is not None
    )


def float64_check(model, batch: dict, generate_kwargs: dict, ref: torch.Tensor, out: torch.Tensor,
                  eos_token_id, pad_token_id: int) -> Float64Check:
    """Run stock HF on a float64 copy of the unpatched `model` (freed after) and compare stock's
    sequences `ref` and paged's `out` ([batch, len] each) with it."""
    exact_model = copy.deepcopy(model).to(torch.float64)
    try:
        exact = exact_model.generate(**batch, **generate_kwargs).cpu()
        ties = None
        if generate_kwargs.get("num_beams", 1) == 1:
            ties = near_ties(model, exact_model, batch, ref, out, eos_token_id, pad_token_id)
    finally:
        del exact_model
    return Float64Check(
        stock=token_agreement(exact, ref, eos_token_id, pad_token_id),
        paged=token_agreement(exact, out, eos_token_id, pad_token_id),
        near_ties=ties,
    )
