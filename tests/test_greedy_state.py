"""`GreedyState` (decode/greedy_state.py): HF's `_sample` bookkeeping, host and device columns alike."""

from __future__ import annotations

import torch

from hf_paged_t5.decode.greedy_state import GreedyState, pick_tokens


def scores_for(tokens: list[int], vocab: int = 11) -> torch.Tensor:
    scores = torch.zeros(len(tokens), vocab)
    scores[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return scores


def test_host_columns_grow_without_a_capacity_and_pad_finished_rows():
    state = GreedyState(torch.tensor([[0, 4], [0, 7]]), capacity=None, pad=torch.tensor(3))
    assert state.sequences.shape[1] == 3  # the prompt and one column
    for step, tokens in enumerate([[1, 2], [5, 6], [8, 9], [2, 2]]):
        if step == 2:
            state.unfinished &= torch.tensor([False, True])  # row 0 finished at the step before
        assert state.choose(scores_for(tokens), state.length).tolist() == ([3, 9] if step == 2 else
                                                                           [3, 2] if step == 3 else tokens)
    assert state.history().tolist() == [[0, 4, 1, 5, 3, 3], [0, 7, 2, 6, 9, 2]]
    assert state.sequences.shape[1] >= 6


def test_device_column_matches_host_column():
    prompt = torch.tensor([[0, 4, 4], [0, 7, 1]])
    host = GreedyState(prompt, capacity=6, pad=None)
    dev = GreedyState(prompt, capacity=6, pad=None)
    cur = torch.full((), 3, dtype=torch.int64)
    for tokens in ([1, 2], [5, 6], [8, 9]):
        host.choose(scores_for(tokens), host.length)
        dev.choose(scores_for(tokens), cur)
        cur += 1
    assert torch.equal(host.history(), dev.sequences[:, :6])
    dev.reset(prompt[:, :2])
    assert dev.prompt_len == 2 and dev.sequences[:, 2:].eq(0).all() and dev.unfinished.all()


def test_pick_tokens_greedy_and_seeded_sampling():
    scores = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pick_tokens(scores, False), scores.argmax(-1))
    torch.manual_seed(1)
    drawn = pick_tokens(scores, True)
    torch.manual_seed(1)
    assert torch.equal(drawn, torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1))
