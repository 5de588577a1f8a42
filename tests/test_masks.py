"""How the paged path reads an attention_mask (`model/stacks.py`): each row's real tokens, first
position, holes and empty rows, the packed token index, and one read per generate() call."""

from __future__ import annotations

import pytest
import torch

from hf_paged_t5.model import stacks


def _masks():
    g = torch.Generator().manual_seed(0)
    masks = []
    for _ in range(40):
        rows, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        kind = int(torch.randint(0, 4, (1,), generator=g))
        if kind == 3:  # anything: holes, empty rows
            mask = torch.randint(0, 2, (rows, width), generator=g)
        else:
            lens = torch.randint(1, width + 1, (rows,), generator=g)
            mask = torch.zeros(rows, width, dtype=torch.long)
            for r, n in enumerate(lens.tolist()):
                start = 0 if kind == 0 else width - n if kind == 1 else int(torch.randint(0, width - n + 1, (1,), generator=g))
                mask[r, start:start + n] = 1
        masks.append(mask)
    return masks


def _expected(mask):
    lens, firsts, holes = [], [], False
    for row in mask.tolist():
        real = [i for i, v in enumerate(row) if v]
        lens.append(len(real))
        firsts.append(real[0] if real else len(row))
        holes |= bool(real) and real[-1] - real[0] + 1 != len(real)
    empty = 0 in lens
    return lens, firsts, stacks.EMPTY_ROW if empty else stacks.HOLE if holes else None


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.bfloat16])
def test_mask_layout_and_packed_index(dtype):
    for mask in _masks():
        mask = mask.to(dtype)
        lens, firsts, reason = _expected(mask)
        assert stacks.mask_layout(mask) == (lens, firsts, reason)
        if reason == stacks.EMPTY_ROW:
            with pytest.raises(ValueError, match="all padding"):
                stacks.pack_tokens(mask)
            continue
        index, got_lens, cu, longest = stacks.pack_tokens(mask)
        assert torch.equal(index, mask.bool().reshape(-1).nonzero().squeeze(1))
        assert got_lens == lens and longest == max(lens) and cu.tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()


def test_left_padding_is_named_only_where_asked():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert stacks.mask_layout(mask)[2] is None
    assert stacks.mask_layout(mask, right_padded=True)[2] is not None


def test_a_call_reads_its_mask_once(monkeypatch):
    reads = []
    real = stacks._host_real
    monkeypatch.setattr(stacks, "_host_real", lambda m: reads.append(m) or real(m))
    mask, other = torch.tensor([[0, 1, 1], [1, 1, 0]]), torch.tensor([[1, 1, 1]])
    with stacks.known_mask(mask):
        assert stacks.mask_layout(mask) == ([2, 2], [1, 0], None)
        stacks.pack_tokens(mask)
        stacks.mask_layout(other)
        stacks.mask_layout(other)
    stacks.mask_layout(mask)
    assert [m is mask for m in reads] == [True, False, False, True]
