"""Greedy token selection of one decode step as one kernel (Triton twin of `reference.greedy_update`).

The device-resident greedy loop (`decode/greedy_graph.py`) extends its sequences by a token after
every decode step: HF's float32 copy of the logits, the min-length rule (EOS at -inf below the
minimum), argmax, the pad id in finished rows, the EOS criterion, and the next step's inputs (its
token, its slot in the row's blocks, its self-attention length). As PyTorch ops that is ~20
launches, ~50 us a step on an H200 at t5-large batch 1 (~7% of the step); here one program per
row does it, and the last program to finish (an atomic ticket) reads every row's flag, records
the column at which none was left unfinished (once), and advances the length counter.

argmax is `torch.argmax`'s: the first index of the largest value, a NaN counting as larger than
everything (the first NaN wins); rows whose every score is -inf get index 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._checks import check_device

# Vocabulary entries one program reads per loop step (fp32 in registers: 16 per thread on 8 warps).
_BLOCK_V = 4096
_ROWS_CHUNK = 1024  # rows the last program reads per step when it gathers the rows' flags


# Which rules a call has (a min-length rule, an EOS criterion) are run-time values, not constexprs:
# one binary serves every call, so a cold process compiles it once, ahead (`hf/generate.py`).
@triton.jit(do_not_specialize=["rows", "vocab", "has_min", "has_pad", "num_eos", "width", "capacity", "stride_logits",
                               "stride_seq", "stride_owned", "stride_step", "block_size"])  # see kernels/__init__.py
def _greedy_update_kernel(
    logits_ptr,  # [rows, >= 1, vocab] (the step's last position read), row stride stride_logits
    eos_until_ptr,  # [vocab] int32: EOS forbidden while cur < eos_until[v] (has_min)
    sequences_ptr,  # [rows, capacity] int64
    cur_len_ptr,  # [] int64: the column this step's token goes to
    unfinished_ptr,  # [rows] bool (as uint8)
    pad_ptr,  # [] int64 (has_pad)
    eos_ptr,  # [num_eos] int64 (none: no EOS criterion)
    done_at_ptr,  # [] int64: -1, then the first column after which every row had finished
    step_ids_ptr,  # [rows, 1] int64, the next step's input (row stride stride_step)
    slot_mapping_ptr,  # [rows] int32
    self_seq_lens_ptr,  # [rows] int32
    owned_ptr,  # [rows, width] int32 the blocks each row writes into
    ticket_ptr,  # [1] int32 zero (left at zero)
    rows,
    vocab,
    has_min,
    has_pad,
    num_eos,
    width,
    capacity,
    stride_logits,
    stride_seq,
    stride_owned,
    stride_step,
    block_size,
    BLOCK_V: tl.constexpr,
    ROWS_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cur = tl.load(cur_len_ptr)
    offs = tl.arange(0, BLOCK_V)
    big = vocab + BLOCK_V  # an index past every entry
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    found_nan = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        index = start + offs
        live = index < vocab
        x = tl.load(logits_ptr + row * stride_logits + index, mask=live, other=float("-inf")).to(tl.float32)
        if has_min != 0:
            until = tl.load(eos_until_ptr + index, mask=live, other=0)
            x = tl.where(cur < until, float("-inf"), x)
        is_nan = x != x
        chunk_nan = tl.max(is_nan.to(tl.int32), axis=0)
        nan_idx = tl.min(tl.where(is_nan, index, big), axis=0).to(tl.int64)
        chunk_max = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
        max_idx = tl.min(tl.where(x == chunk_max, index, big), axis=0).to(tl.int64)
        # strictly larger: an earlier chunk keeps a tie (the first index wins)
        better = (found_nan == 0) & (chunk_nan == 0) & (chunk_max > best_val)
        first_nan = (found_nan == 0) & (chunk_nan != 0)
        best_idx = tl.where(first_nan, nan_idx, tl.where(better, max_idx, best_idx))
        best_val = tl.where(better, chunk_max, best_val)
        found_nan = found_nan | chunk_nan
    token = best_idx
    alive = tl.load(unfinished_ptr + row) != 0
    if has_pad != 0:
        token = tl.where(alive, token, tl.load(pad_ptr))
    tl.store(sequences_ptr + row * stride_seq + tl.minimum(cur, capacity - 1), token)
    if num_eos > 0:
        hit = tl.full([], 0, tl.int32)
        for j in range(0, num_eos):
            hit = hit | (token == tl.load(eos_ptr + j)).to(tl.int32)
        tl.store(unfinished_ptr + row, (alive & (hit == 0)).to(tl.uint8))
    tl.store(step_ids_ptr + row * stride_step, token)
    # the token at column `cur` goes into the cache at position `cur` in the next step (the block
    # index clamped: after the last token no step runs, and its position may lie past the blocks)
    block = tl.load(owned_ptr + row * stride_owned + tl.minimum(cur // block_size, width - 1)).to(tl.int64)
    tl.store(slot_mapping_ptr + row, (block * block_size + cur % block_size).to(tl.int32))
    tl.store(self_seq_lens_ptr + row, (cur + 1).to(tl.int32))
    # Every thread's stores precede the ticket (release); the last program's loads follow it
    # (acquire), so it sees every row's flag.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == rows - 1:
        if num_eos > 0:
            alive_rows = tl.full([], 0, tl.int32)
            for first in range(0, rows, ROWS_CHUNK):
                r = first + tl.arange(0, ROWS_CHUNK)
                flags = tl.load(unfinished_ptr + r, mask=r < rows, other=0, cache_modifier=".cg")
                alive_rows += tl.sum((flags != 0).to(tl.int32), axis=0)
            done = alive_rows == 0
            before = tl.load(done_at_ptr)
            tl.store(done_at_ptr, tl.where(done & (before < 0), cur, before))
        tl.store(cur_len_ptr, cur + 1)
        tl.atomic_xchg(ticket_ptr, 0)


def greedy_update(
    logits: torch.Tensor,
    sequences: torch.Tensor,
    cur_len: torch.Tensor,
    unfinished: torch.Tensor,
    done_at: torch.Tensor,
    step_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    self_seq_lens: torch.Tensor,
    owned: torch.Tensor,
    block_size: int,
    tickets: torch.Tensor,
    eos_until: Optional[torch.Tensor] = None,
    pad: Optional[torch.Tensor] = None,
    eos: Optional[torch.Tensor] = None,
) -> None:
    """One greedy step's token choice and the next step's inputs, in place (no host sync: graph
    capturable). The arguments are `reference.greedy_update`'s; tickets: [>= 1] int32 zeros (left
    at zero)."""
    rows, vocab = logits.shape[0], logits.shape[-1]
    device = logits.device
    for name, t in (("sequences", sequences), ("cur_len", cur_len), ("unfinished", unfinished),
                    ("step_ids", step_ids), ("slot_mapping", slot_mapping), ("self_seq_lens", self_seq_lens),
                    ("owned", owned), ("tickets", tickets)):
        check_device(name, t, device)
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [rows, positions, vocab] with a contiguous vocab, got {tuple(logits.shape)}")
    if sequences.dtype != torch.int64 or cur_len.dtype != torch.int64 or step_ids.dtype != torch.int64:
        raise TypeError("sequences, cur_len and step_ids must be int64")
    if slot_mapping.dtype != torch.int32 or self_seq_lens.dtype != torch.int32 or owned.dtype != torch.int32:
        raise TypeError("slot_mapping, self_seq_lens and owned must be int32")
    if unfinished.dtype != torch.bool or done_at.dtype != torch.int64:
        raise TypeError("unfinished must be bool, done_at int64")
    if (pad is None) != (eos is None):
        raise ValueError("pad and eos go together: HF pads finished rows only with an EOS criterion")
    if eos is not None and eos.numel() == 0:
        raise ValueError("eos must hold at least one id (or be None without an EOS criterion)")
    if eos_until is not None and eos_until.dtype != torch.int32:
        raise TypeError("eos_until must be int32 (decode.min_length.eos_until)")
    if rows == 0:
        return
    last = logits[:, -1]
    # placeholders of the pointers' own types where a rule is absent: one binary for every call
    _greedy_update_kernel[(rows,)](
        last, slot_mapping if eos_until is None else eos_until, sequences, cur_len, unfinished.view(torch.uint8),
        cur_len if pad is None else pad, cur_len if eos is None else eos, done_at,
        step_ids, slot_mapping, self_seq_lens, owned, tickets,
        rows, vocab, int(eos_until is not None), int(pad is not None), 0 if eos is None else eos.numel(),
        owned.shape[1], sequences.shape[1],
        last.stride(0), sequences.stride(0), owned.stride(0), step_ids.stride(0), int(block_size),
        BLOCK_V=_BLOCK_V, ROWS_CHUNK=_ROWS_CHUNK, num_warps=8,
    )  # fmt: skip
