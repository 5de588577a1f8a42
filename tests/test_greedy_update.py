"""The greedy step kernel (`kernels.greedy_update`) against its plain-PyTorch twin
(`reference.greedy_update`) and HF's own token choice: argmax ties, NaN, the min-length rule,
padding of finished rows, the EOS criterion, the next step's slot and length, and the last
program's counters, at awkward vocabulary sizes and row counts."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

from hf_paged_t5 import kernels, reference
from hf_paged_t5.decode.loop import lean_processors
from hf_paged_t5.decode.min_length import eos_until

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state(rows, vocab, capacity=12, width=3, block_size=4, cur=5, seed=0, dtype=torch.bfloat16, eos=(1,)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 2, vocab, generator=g).to(dtype)
    owned = torch.randint(0, 50, (rows, width), generator=g, dtype=torch.int32)
    t = dict(
        logits=logits,
        sequences=torch.randint(0, vocab, (rows, capacity), generator=g),
        cur_len=torch.tensor(cur, dtype=torch.int64),
        unfinished=torch.rand(rows, generator=g) < 0.7,
        done_at=torch.tensor(-1, dtype=torch.int64),
        step_ids=torch.zeros(rows, 1, dtype=torch.int64),
        slot_mapping=torch.zeros(rows, dtype=torch.int32),
        self_seq_lens=torch.zeros(rows, dtype=torch.int32),
        owned=owned,
        block_size=block_size,
        tickets=torch.zeros(1, dtype=torch.int32),
        pad=torch.tensor(0, dtype=torch.int64) if eos is not None else None,
        eos=torch.tensor(eos, dtype=torch.int64) if eos is not None else None,
    )
    return t


def run_both(t, **extra):
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    reference.greedy_update(**ref, **{k: v for k, v in extra.items()})
    kernels.greedy_update(**dev, **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in extra.items()})
    return ref, dev


def assert_same(ref, dev):
    for name, value in ref.items():
        if isinstance(value, torch.Tensor) and name != "logits":  # read only (and NaN != NaN)
            assert torch.equal(dev[name].cpu(), value), name


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 4097), (5, 32128), (2, 8191)])
@pytest.mark.parametrize("eos", [(1,), (1, 7), None])
def test_kernel_matches_reference(rows, vocab, eos):
    t = state(rows, vocab, eos=eos, seed=rows * vocab)
    ref, dev = run_both(t)
    assert_same(ref, dev)
    assert int(dev["tickets"][0]) == 0  # left at zero for the next launch
    assert int(ref["cur_len"]) == 6


def test_argmax_ties_nan_and_all_masked():
    """torch.argmax's rules: the first of equal maxima (also across the kernel's 4,096-entry
    chunks), the first NaN over everything, index 0 where every score is -inf."""
    vocab = 9000
    t = state(4, vocab, eos=None, dtype=torch.float32)
    x = torch.full((4, 2, vocab), -1.0)
    x[0, -1, [10, 5000, 8999]] = 3.0  # a tie across chunks: 10 wins
    x[1, -1, 7000] = float("nan")
    x[1, -1, 8000] = float("nan")
    x[1, -1, 3] = float("inf")  # NaN beats +inf
    x[2, -1] = float("-inf")
    x[3, -1, 4096] = 2.0  # the first entry of the second chunk
    t["logits"] = x
    ref, dev = run_both(t)
    assert ref["step_ids"][:, 0].tolist() == [10, 7000, 0, 4096]
    assert_same(ref, dev)
    hf = torch.argmax(x[:, -1], dim=-1)
    assert torch.equal(ref["step_ids"][:, 0], hf)


@pytest.mark.parametrize("cur", [3, 6, 9])
def test_min_length_rule_is_hf_processors(cur):
    """eos_until folds several min-length processors into one table: the kernel forbids EOS
    exactly where HF's processors set it to -inf."""
    vocab, eos_ids = 300, [1, 2]
    procs = LogitsProcessorList([
        MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=1, min_new_tokens=5, eos_token_id=[1], device="cpu"),
        MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=6, eos_token_id=[2], device="cpu"),
    ])
    until = eos_until(lean_processors(procs), vocab, torch.device("cpu"))
    t = state(3, vocab, cur=cur, eos=tuple(eos_ids), dtype=torch.float32, capacity=12)
    t["logits"][:, -1, eos_ids] = 50.0  # EOS would win where allowed
    ref, dev = run_both(t, eos_until=until)
    assert_same(ref, dev)
    scores = procs(torch.zeros(3, cur, dtype=torch.int64), t["logits"][:, -1].clone())
    expect = torch.where(t["unfinished"], torch.argmax(scores, -1), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(ref["step_ids"][:, 0], expect)


def test_min_length_table_keeps_huge_minimums_in_int32():
    """A min-length past int32 (a user's min_length=2**40) still forbids EOS at every length."""
    from hf_paged_t5.decode.min_length import MinLength

    until = eos_until([MinLength(torch.tensor([2]), 2**40, 3)], 5, torch.device("cpu"))
    assert until.dtype == torch.int32 and until.tolist() == [0, 0, 2**31 - 1, 0, 0]


def test_finishing_rows_set_done_once():
    """Rows that pick EOS finish; once none is left, done_at is set and keeps the first
    column it held at, however many steps follow."""
    t = state(2, 64, eos=(3,), dtype=torch.float32, cur=4)
    t["unfinished"][:] = True
    t["logits"][:, -1, 3] = 100.0
    ref, dev = run_both(t)
    assert_same(ref, dev)
    assert int(dev["done_at"]) >= 0 and int(dev["done_at"]) == 4 and int(dev["cur_len"]) == 5
    # another step: finished rows get the pad id, done_at stays
    ref2, dev2 = run_both({**ref, "tickets": torch.zeros(1, dtype=torch.int32)})
    assert_same(ref2, dev2)
    assert int(dev2["done_at"]) == 4 and dev2["step_ids"][:, 0].tolist() == [0, 0]


def test_slot_and_length_follow_the_blocks():
    t = state(3, 16, block_size=4, width=3, cur=9, eos=None, dtype=torch.float32)
    ref, dev = run_both(t)
    assert_same(ref, dev)
    assert ref["slot_mapping"].tolist() == (t["owned"][:, 2] * 4 + 1).tolist()
    assert ref["self_seq_lens"].tolist() == [10, 10, 10]
    # past the last block (a step queued after the last one): clamped to the row's last block
    t = state(1, 16, block_size=4, width=2, cur=11, capacity=11, eos=None, dtype=torch.float32)
    ref, dev = run_both(t)
    assert_same(ref, dev)


def test_bad_arguments():
    t = state(2, 16, eos=(1,))
    with pytest.raises(ValueError, match="pad and eos"):
        kernels.greedy_update(**{**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in t.items()},
                                 "pad": None})
    with pytest.raises(TypeError, match="int32"):
        kernels.greedy_update(**{**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in t.items()},
                                 "slot_mapping": torch.zeros(2, dtype=torch.int64, device=DEVICE)})
