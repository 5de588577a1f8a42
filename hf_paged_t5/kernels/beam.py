"""One beam-search step's bookkeeping in four kernels (Triton twin of `reference.beam_update`).

The device-resident beam loop (`decode/beam_graph.py`) runs HF's `_beam_search` arithmetic after
every decode step: log-softmax of the float32 logits, the min-length rule, the top `keep`
continuations of each source over its beams x vocab, the stopping criteria on them, the next
running beams, the finished-hypotheses merge, the early-stop heuristic and the "go on" flag; then
the cache reorder and the next step's inputs. As PyTorch ops that is ~80 launches (~0.2 ms a step
on an H200, plus `torch.topk`'s multi-block select over beams x vocab). Here:

- `_beam_candidates_kernel`, one program per (row, vocab chunk): the chunk's max and sum of
  exponentials (the row's log-softmax normalizer, merged later) and its best `keep` entries;
- `_beam_top_kernel`, one program per source: the rows' normalizers, the candidates' scores and
  the best `keep` of them (HF's `_get_top_k_continuations`);
- `_beam_select_kernel`, one program per source: HF's running-beam and finished-hypothesis
  selections, the scores and flags, the next step's inputs, and what each new row is made of;
- `_beam_rows_kernel`, one program per source: the sequences, beam indices and self block table
  rows copied accordingly; the last program to finish (an atomic ticket) sets the "go on" flag and
  advances the step counter.

Four kernels rather than one: each compiles in ~1 s or less (sm_90), and a cold process compiles
them side by side in its compile workers while its first call runs; one kernel of all of it took
~2.5 s, more than a first call lasts.

Selections order equal scores by the lower flat index (beam * vocab + token, or HF's merged
position), as a stable descending sort does; `torch.topk` does not promise an order among equal
values. A chunk's candidates are picked by their logits (a row's scores keep the logits' order up
to rounding, which can only make two of them equal). NaN logits (an fp16 overflow) follow no rule
here (`torch.topk` ranks NaN first); HF's output is meaningless there either way. Sizes are run-time values (one binary per logits dtype for every beam count, vocabulary and
length); what fits (`supports`): at most `MAX_BEAMS` beams, `keep <= MAX_KEEP`, a vocabulary of at
most `MAX_CHUNKS` chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._checks import check_device

_CHUNK = 4096  # vocabulary entries per candidates program
MAX_BEAMS = 8
MAX_KEEP = 24  # HF keeps max(2, 1 + num_eos) * num_beams candidates per source
MAX_CHUNKS = 64  # vocabularies up to 262,144 entries
_KP, _KEEPP, _MP, _CP = 8, 32, 32, 64  # register widths of those (merged: beams + keep <= 32)
_NB = 1024  # candidates per block of the select loop
_BL = 256  # sequence columns per block
_ROWS_CHUNK = 1024
_BIG = tl.constexpr(2**62)  # an index past every candidate


def supports(beams: int, keep: int, vocab: int) -> bool:
    """Whether `beam_update` takes a search of these sizes (else the loop's PyTorch update runs)."""
    return 1 <= beams <= MAX_BEAMS and beams <= keep <= MAX_KEEP and 0 < vocab <= MAX_CHUNKS * _CHUNK


def chunks_of(vocab: int) -> int:
    return triton.cdiv(vocab, _CHUNK)


def workspace(batch: int, beams: int, keep: int, vocab: int, length: int, index_width: int, table_width: int,
              device: torch.device) -> dict:
    """The kernels' scratch (`beam_update(workspace=)`) for `batch` sources x `beams` beams, sequences of
    `length` tokens, beam indices of `index_width` and self block tables of `table_width` columns."""
    rows, chunks = batch * beams, chunks_of(vocab)
    f32, i32, i64 = (dict(dtype=t, device=device) for t in (torch.float32, torch.int32, torch.int64))
    return {
        "cand_val": torch.empty(rows * chunks * keep, **f32),
        "cand_idx": torch.empty(rows * chunks * keep, **i64),
        "stats": torch.empty(rows * chunks * 2, **f32),
        "row_stats": torch.empty(rows * 2, **f32),
        "top_val": torch.empty(batch * keep, **f32),
        "top_idx": torch.empty(batch * keep, **i64),
        "flags": torch.empty(batch * 3, **i32),
        "tickets": torch.zeros(1, **i32),
        "desc": torch.empty(batch * 4 * _KP, **i64),
        "seq_buf": torch.empty(rows * 2 * length, **i64),
        "bi_buf": torch.empty(rows * 2 * max(index_width, 1), **i32),
        "table_buf": torch.empty(rows * max(table_width, 1), **i32),
    }


@triton.jit(do_not_specialize=["stride_logits", "stride_int", "n_steps", "has_min", "vocab", "chunks", "keep"])
def _beam_candidates_kernel(
    logits_ptr,  # [rows, vocab] (the step's last position), row stride stride_logits
    stride_logits,
    step_ptr,  # [] int64: the row of int_table this step reads (clamped to n_steps - 1)
    int_table_ptr,  # [n_steps, >= 3] int64: cur_len, cur_len - prompt_len, at max length
    stride_int,
    n_steps,
    eos_until_ptr,  # [vocab] int32: EOS forbidden while cur_len < eos_until[v] (has_min)
    has_min,
    cand_val_ptr,  # [rows, chunks, keep] float32: the chunk's best logits (masked: -inf)
    cand_idx_ptr,  # [rows, chunks, keep] int64: their vocabulary ids (-1: none left)
    stats_ptr,  # [rows, chunks, 2] float32: the chunk's max and sum of exp(x - max)
    vocab,
    chunks,
    keep,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    index = c * CHUNK + tl.arange(0, CHUNK)
    live = index < vocab
    x = tl.load(logits_ptr + row * stride_logits + index, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    finite = x > float("-inf")
    s = tl.sum(tl.where(finite, tl.exp(tl.where(finite, x - m, 0.0)), 0.0), axis=0)
    at = (row * chunks + c) * 2
    tl.store(stats_ptr + at, m)
    tl.store(stats_ptr + at + 1, s)
    if has_min != 0:  # HF's processors mask the log-probs after the softmax: the sum keeps EOS
        step = tl.minimum(tl.load(step_ptr), n_steps - 1)
        cur = tl.load(int_table_ptr + step * stride_int)
        until = tl.load(eos_until_ptr + index, mask=live, other=0)
        x = tl.where(cur < until, float("-inf"), x)
    taken = index >= vocab
    base = (row * chunks + c) * keep
    for t in range(0, keep):
        best = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        pick = tl.min(tl.where((~taken) & (x == best), index, _BIG), axis=0)
        tl.store(cand_val_ptr + base + t, best)
        tl.store(cand_idx_ptr + base + t, tl.where(pick < vocab, pick, -1))
        taken = taken | (index == pick)


@triton.jit
def _hits(tokens, eos_ptr, num_eos, at_max):
    """HF's stopping criteria on candidates ending in `tokens`: an EOS id, or max length."""
    hit = tokens < 0  # all False
    for e in range(0, num_eos):
        hit = hit | (tokens == tl.load(eos_ptr + e))
    return hit | at_max


@triton.jit
def _finished_score(value, length_factor, full, unsatisfied, just):
    """HF's `_update_finished_beams` score of a candidate: the length penalty, then -1e9 for a full
    source, a satisfied heuristic and a candidate that did not just finish, added one by one."""
    score = value * length_factor
    score = score + tl.where(full, -1.0e9, 0.0)
    score = score + tl.where(unsatisfied, 0.0, -1.0e9)
    return score + tl.where(just, 0.0, -1.0e9)


@triton.jit
def _rank(values, valid, positions):
    """Each entry's place in a descending order of `values`, equal values by position; invalid
    entries rank last (their own rank is meaningless)."""
    beats = (values[None, :] > values[:, None]) | ((values[None, :] == values[:, None])
                                                  & (positions[None, :] < positions[:, None]))
    return tl.sum((beats & valid[None, :]).to(tl.int32), axis=1)


@triton.jit
def _source_of(rank, valid, positions, places):
    """For each place p, the position whose rank is p (0 where none)."""
    hit = (rank[None, :] == places[:, None]) & valid[None, :]
    return tl.sum(tl.where(hit, positions[None, :], 0), axis=1)


@triton.jit
def _copy_row(run_ptr, fin_ptr, buf_ptr, width, row0, p, beam, token, fsrc, fbeam, ftok, from_old, col,
              phase, BL: tl.constexpr):
    """Phase 0: new running row p (old running row `beam`, `token` at `col`) and new finished row p
    (old finished row `fsrc`, or old running row `fbeam` with `ftok` at `col`) into the scratch
    [rows, 2, width]; phase 1: both back into row p."""
    buf = buf_ptr + ((row0 + p) * 2) * width
    for start in range(0, width, BL):
        cols = start + tl.arange(0, BL)
        ok = cols < width
        if phase == 0:
            run = tl.load(run_ptr + (row0 + beam) * width + cols, mask=ok, other=0)
            tl.store(buf + cols, tl.where(cols == col, token.to(run.dtype), run), mask=ok)
            src = tl.where(from_old, fin_ptr + (row0 + fsrc) * width, run_ptr + (row0 + fbeam) * width)
            fin = tl.load(src + cols, mask=ok, other=0)
            tl.store(buf + width + cols, tl.where((cols == col) & ~from_old, ftok.to(fin.dtype), fin), mask=ok)
        else:
            tl.store(run_ptr + (row0 + p) * width + cols, tl.load(buf + cols, mask=ok), mask=ok)
            tl.store(fin_ptr + (row0 + p) * width + cols, tl.load(buf + width + cols, mask=ok), mask=ok)


@triton.jit
def _copy_table(table_ptr, stride_table, owned_ptr, stride_owned, buf_ptr, width, row0, p, beam, current,
                phase, BL: tl.constexpr):
    """Row p of the self block table: row `beam`'s blocks before `current`, its own from there
    (phase 0 into the scratch [rows, width], phase 1 back)."""
    buf = buf_ptr + (row0 + p) * width
    for start in range(0, width, BL):
        cols = start + tl.arange(0, BL)
        ok = cols < width
        if phase == 0:
            moved = tl.load(table_ptr + (row0 + beam) * stride_table + cols, mask=ok, other=0)
            mine = tl.load(owned_ptr + (row0 + p) * stride_owned + cols, mask=ok, other=0)
            tl.store(buf + cols, tl.where(cols >= current, mine, moved), mask=ok)
        else:
            tl.store(table_ptr + (row0 + p) * stride_table + cols, tl.load(buf + cols, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["beams", "keep", "vocab", "chunks"])
def _beam_top_kernel(
    cand_val_ptr, cand_idx_ptr, stats_ptr, row_stats_ptr, rscore_ptr, top_val_ptr, top_idx_ptr,
    beams, keep, vocab, chunks,
    KP: tl.constexpr, CP: tl.constexpr, NB: tl.constexpr,
):
    """One program per source: HF's `_get_top_k_continuations` from the chunks' candidates."""
    b = tl.program_id(0).to(tl.int64)
    row0 = b * beams
    kk = tl.arange(0, KP)
    k_ok = kk < beams

    # 1. each row's log-softmax normalizer from its chunks: max M and log(sum exp(x - M))
    cc = tl.arange(0, CP)
    m2 = k_ok[:, None] & (cc[None, :] < chunks)
    at = ((row0 + kk[:, None]) * chunks + cc[None, :]) * 2
    cm = tl.load(stats_ptr + at, mask=m2, other=float("-inf"))
    cs = tl.load(stats_ptr + at + 1, mask=m2, other=0.0)
    row_max = tl.max(cm, axis=1)
    live = cm > float("-inf")
    total = tl.sum(tl.where(live, cs * tl.exp(tl.where(live, cm - row_max[:, None], 0.0)), 0.0), axis=1)
    tl.store(row_stats_ptr + (row0 + kk) * 2, row_max, mask=k_ok)
    tl.store(row_stats_ptr + (row0 + kk) * 2 + 1, tl.log(tl.where(k_ok, total, 1.0)), mask=k_ok)
    tl.debug_barrier()

    # 2. the candidates' scores, HF's `log_softmax(x) + running score`, and flat ids beam * vocab + token
    per_row = chunks * keep
    n_cand = beams * per_row
    first = row0 * per_row
    for start in range(0, n_cand, NB):
        n = start + tl.arange(0, NB)
        ok = n < n_cand
        k = n // per_row
        x = tl.load(cand_val_ptr + first + n, mask=ok, other=float("-inf"))
        mx = tl.load(row_stats_ptr + (row0 + k) * 2, mask=ok, other=0.0)
        lse = tl.load(row_stats_ptr + (row0 + k) * 2 + 1, mask=ok, other=0.0)
        running = tl.load(rscore_ptr + row0 + k, mask=ok, other=0.0)
        tl.store(cand_val_ptr + first + n, ((x - mx) - lse) + running, mask=ok)
        token = tl.load(cand_idx_ptr + first + n, mask=ok, other=-1)
        tl.store(cand_idx_ptr + first + n, tl.where(token >= 0, k * vocab + token, -1), mask=ok)
    tl.debug_barrier()

    # 3. the best `keep` (score desc, flat id asc), taken one by one
    for t in range(0, keep):
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], _BIG, tl.int64)
        best_n = tl.full([], 0, tl.int64)
        for start in range(0, n_cand, NB):
            n = start + tl.arange(0, NB)
            ok = n < n_cand
            x = tl.load(cand_val_ptr + first + n, mask=ok, other=float("-inf"))
            flat = tl.load(cand_idx_ptr + first + n, mask=ok, other=-1)
            valid = flat >= 0
            v = tl.max(tl.where(valid, x, float("-inf")), axis=0)
            i = tl.min(tl.where(valid & (x == v), flat, _BIG), axis=0)
            pos = tl.min(tl.where(valid & (flat == i), n.to(tl.int64), _BIG), axis=0)
            better = (i < _BIG) & ((v > best_v) | ((v == best_v) & (i < best_i)))
            best_v = tl.where(better, v, best_v)
            best_i = tl.where(better, i, best_i)
            best_n = tl.where(better, pos, best_n)
        tl.store(top_val_ptr + b * keep + t, best_v)
        tl.store(top_idx_ptr + b * keep + t, best_i)
        tl.store(cand_idx_ptr + first + best_n, -1)  # taken
        tl.debug_barrier()



@triton.jit(do_not_specialize=[
    "stride_int", "stride_float", "n_steps", "num_eos", "stride_table", "stride_owned", "width", "stride_input",
    "block_size", "beams", "keep", "vocab", "early_true"])
def _beam_select_kernel(
    step_ptr, int_table_ptr, stride_int, float_table_ptr, stride_float, n_steps,
    top_val_ptr, top_idx_ptr, flags_ptr, desc_ptr, eos_ptr, num_eos,
    rscore_ptr, score_ptr, fin_ptr, heur_ptr, beam_idx_ptr, next_tokens_ptr,
    table_ptr, stride_table, owned_ptr, stride_owned, width, slot_ptr, lens_ptr, input_ids_ptr, stride_input,
    copy_src_ptr, copy_dst_ptr, block_size, beams, keep, vocab, early_true,
    KP: tl.constexpr, KEEPP: tl.constexpr, MP: tl.constexpr,
):
    """One program per source, after `_beam_top_kernel`: HF's selections and the scalar state;
    what each new row is made of goes to `desc` for `_beam_rows_kernel`."""
    b = tl.program_id(0).to(tl.int64)
    step = tl.minimum(tl.load(step_ptr), n_steps - 1)
    cur = tl.load(int_table_ptr + step * stride_int)
    at_max = tl.load(int_table_ptr + step * stride_int + 2) != 0
    length_factor = tl.load(float_table_ptr + step * stride_float)
    heuristic_factor = tl.load(float_table_ptr + step * stride_float + 1)
    row0 = b * beams
    kk = tl.arange(0, KP)
    k_ok = kk < beams
    jj = tl.arange(0, KEEPP)

    # 4. the candidates: beam, token, stopping criteria (HF: EOS as the last token, or max length)
    j_ok = jj < keep
    tv = tl.load(top_val_ptr + b * keep + jj, mask=j_ok, other=float("-inf"))
    ti = tl.load(top_idx_ptr + b * keep + jj, mask=j_ok, other=0)
    hit = _hits(ti % vocab, eos_ptr, num_eos, at_max)
    all_hits = tl.min(tl.where(j_ok, hit.to(tl.int32), 1), axis=0)
    # HF's `_get_running_beams_for_next_iteration`: the best `beams` after -1e9 on those that hit
    running_lp = tv + tl.where(hit, -1.0e9, 0.0)
    r_src = _source_of(_rank(running_lp, j_ok, jj), j_ok, jj, kk)  # [KP] candidate of each new beam
    r_val = tl.load(top_val_ptr + b * keep + r_src, mask=k_ok, other=0.0)
    r_flat = tl.load(top_idx_ptr + b * keep + r_src, mask=k_ok, other=0)
    r_beam = r_flat // vocab
    r_tok = r_flat % vocab
    r_score = r_val + tl.where(_hits(r_tok, eos_ptr, num_eos, at_max), -1.0e9, 0.0)

    # 5. HF's `_update_finished_beams`: old finished hypotheses and the candidates, merged
    old_fin = tl.load(fin_ptr + row0 + kk, mask=k_ok, other=1) != 0
    full = (tl.min(old_fin.to(tl.int32), axis=0) != 0) & (early_true != 0)
    unsatisfied = tl.load(heur_ptr + b) != 0
    mm = tl.arange(0, MP)
    m_ok = mm < beams + keep
    m_old = mm < beams
    mj = tl.where(m_old, 0, mm - beams)
    m_cand = m_ok & ~m_old
    old_score = tl.load(score_ptr + row0 + mm, mask=m_old, other=0.0)
    m_val = tl.load(top_val_ptr + b * keep + mj, mask=m_cand, other=0.0)
    m_tok = tl.load(top_idx_ptr + b * keep + mj, mask=m_cand, other=0) % vocab
    m_just = _hits(m_tok, eos_ptr, num_eos, at_max) & (mj < beams)
    merged = tl.where(m_old, old_score, _finished_score(m_val, length_factor, full, unsatisfied, m_just))
    f_src = _source_of(_rank(merged, m_ok, mm), m_ok, mm, kk)  # [KP] merged position of each new hypothesis
    f_old = f_src < beams
    f_j = tl.where(f_old, 0, f_src - beams)
    f_new_old_score = tl.load(score_ptr + row0 + f_src, mask=k_ok & f_old, other=0.0)
    f_new_old_fin = tl.load(fin_ptr + row0 + f_src, mask=k_ok & f_old, other=0) != 0
    f_val = tl.load(top_val_ptr + b * keep + f_j, mask=k_ok & ~f_old, other=0.0)
    f_flat = tl.load(top_idx_ptr + b * keep + f_j, mask=k_ok & ~f_old, other=0)
    f_beam = f_flat // vocab
    f_tok = f_flat % vocab
    f_just = _hits(f_tok, eos_ptr, num_eos, at_max) & (f_j < beams)
    new_score = tl.where(f_old, f_new_old_score, _finished_score(f_val, length_factor, full, unsatisfied, f_just))
    new_fin = tl.where(f_old, f_new_old_fin, f_just)

    # 6. what each new beam / hypothesis is made of, for the row copies below
    desc = desc_ptr + b * 4 * KP
    tl.store(desc + kk, r_beam, mask=k_ok)
    tl.store(desc + KP + kk, r_tok, mask=k_ok)
    tl.store(desc + 2 * KP + kk, tl.where(f_old, f_src, -1 - f_beam), mask=k_ok)  # old row, or -1 - candidate's beam
    tl.store(desc + 3 * KP + kk, f_tok, mask=k_ok)

    # 7. HF's `_check_early_stop_heuristic` (after its cur_len += 1) on the new state
    best_running = tl.max(tl.where(kk == 0, r_score, float("-inf")), axis=0) * heuristic_factor
    worst = tl.min(tl.where(k_ok, new_score, float("inf")), axis=0)
    worst_each = tl.where(new_fin, worst, -1.0e9)
    improvable = tl.max((k_ok & (best_running > worst_each)).to(tl.int32), axis=0) != 0
    unsatisfied = unsatisfied & improvable
    all_fin = tl.min(tl.where(k_ok, new_fin.to(tl.int32), 1), axis=0)
    tl.store(flags_ptr + b * 3, unsatisfied.to(tl.int32))
    tl.store(flags_ptr + b * 3 + 1, all_fin)
    tl.store(flags_ptr + b * 3 + 2, all_hits)
    rows = row0 + kk
    tl.store(beam_idx_ptr + rows, row0 + r_beam, mask=k_ok)
    tl.store(next_tokens_ptr + rows, r_tok, mask=k_ok)
    current = tl.minimum(cur // block_size, width - 1)
    own = tl.load(owned_ptr + rows * stride_owned + current, mask=k_ok, other=0)
    src_block = tl.load(table_ptr + (row0 + r_beam) * stride_table + current, mask=k_ok, other=0)
    tl.debug_barrier()  # every read of the old scores / flags above precedes the stores below
    tl.store(rscore_ptr + row0 + kk, r_score, mask=k_ok)
    tl.store(score_ptr + row0 + kk, new_score, mask=k_ok)
    tl.store(fin_ptr + row0 + kk, new_fin.to(tl.int8), mask=k_ok)
    tl.store(heur_ptr + b, unsatisfied.to(tl.int8))
    tl.store(copy_src_ptr + rows, src_block.to(tl.int64), mask=k_ok)
    tl.store(copy_dst_ptr + rows, own.to(tl.int64), mask=k_ok)
    tl.store(slot_ptr + rows, (own.to(tl.int64) * block_size + cur % block_size).to(slot_ptr.dtype.element_ty),
             mask=k_ok)
    tl.store(lens_ptr + rows, (cur + 1).to(tl.int32), mask=k_ok)
    tl.store(input_ids_ptr + rows * stride_input, r_tok, mask=k_ok)



@triton.jit(do_not_specialize=["stride_int", "n_steps", "stride_table", "stride_owned", "width", "block_size",
                               "batch", "beams", "length", "index_width", "early_true"])
def _beam_rows_kernel(
    step_ptr, int_table_ptr, stride_int, n_steps, desc_ptr, seq_buf_ptr, bi_buf_ptr, table_buf_ptr, flags_ptr,
    ticket_ptr, rseq_ptr, seq_ptr, rbi_ptr, bi_ptr, unfinished_ptr, table_ptr, stride_table, owned_ptr, stride_owned,
    width, block_size, batch, beams, length, index_width, early_true,
    KP: tl.constexpr, BL: tl.constexpr, ROWS_CHUNK: tl.constexpr,
):
    """One program per source, after `_beam_select_kernel`: the rows it described, and the flag."""
    b = tl.program_id(0).to(tl.int64)
    step = tl.minimum(tl.load(step_ptr), n_steps - 1)
    cur = tl.load(int_table_ptr + step * stride_int)
    col_idx = tl.load(int_table_ptr + step * stride_int + 1)
    row0 = b * beams
    desc = desc_ptr + b * 4 * KP
    current = tl.minimum(cur // block_size, width - 1)
    # 8. the rows: sequences, beam indices and block tables copied out of the old rows into the
    # scratch, then back in place (a row may be another's source); one row at a time
    for phase in range(0, 2):
        for p in range(0, beams):
            beam = tl.load(desc + p)
            token = tl.load(desc + KP + p)
            fsrc = tl.load(desc + 2 * KP + p)
            ftok = tl.load(desc + 3 * KP + p)
            from_old = fsrc >= 0
            fbeam = tl.where(from_old, 0, -1 - fsrc)
            _copy_row(rseq_ptr, seq_ptr, seq_buf_ptr, length, row0, p, beam, token, fsrc, fbeam, ftok, from_old,
                      cur, phase, BL)
            _copy_row(rbi_ptr, bi_ptr, bi_buf_ptr, index_width, row0, p, beam, row0 + beam, fsrc, fbeam,
                      row0 + fbeam, from_old, col_idx, phase, BL)
            _copy_table(table_ptr, stride_table, owned_ptr, stride_owned, table_buf_ptr, width, row0, p, beam,
                        current, phase, BL)
        tl.debug_barrier()

    # 9. HF's `_beam_search_has_unfinished_sequences` over every source, by the last program
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == batch - 1:
        any_open = tl.full([], 0, tl.int32)
        every_fin = tl.full([], 1, tl.int32)
        every_hit = tl.full([], 1, tl.int32)
        for s0 in range(0, batch, ROWS_CHUNK):
            s = s0 + tl.arange(0, ROWS_CHUNK)
            s_ok = s < batch
            any_open = tl.maximum(any_open, tl.max(tl.load(flags_ptr + s * 3, mask=s_ok, other=0,
                                                           cache_modifier=".cg"), axis=0))
            every_fin = tl.minimum(every_fin, tl.min(tl.load(flags_ptr + s * 3 + 1, mask=s_ok, other=1,
                                                             cache_modifier=".cg"), axis=0))
            every_hit = tl.minimum(every_hit, tl.min(tl.load(flags_ptr + s * 3 + 2, mask=s_ok, other=1,
                                                             cache_modifier=".cg"), axis=0))
        open_beam = (every_fin == 0) | (early_true == 0)
        go_on = (any_open != 0) & open_beam & (every_hit == 0)
        tl.store(unfinished_ptr, go_on.to(tl.int8))
        tl.store(step_ptr, tl.load(step_ptr) + 1)
        tl.atomic_xchg(ticket_ptr, 0)


def beam_update(
    logits: torch.Tensor,
    step: torch.Tensor,
    int_table: torch.Tensor,
    float_table: torch.Tensor,
    running_sequences: torch.Tensor,
    sequences: torch.Tensor,
    running_beam_scores: torch.Tensor,
    beam_scores: torch.Tensor,
    running_beam_indices: torch.Tensor,
    beam_indices: torch.Tensor,
    is_sent_finished: torch.Tensor,
    heuristic: torch.Tensor,
    beam_idx: torch.Tensor,
    next_tokens: torch.Tensor,
    unfinished: torch.Tensor,
    table: torch.Tensor,
    owned: torch.Tensor,
    slot_mapping: torch.Tensor,
    self_seq_lens: torch.Tensor,
    input_ids: torch.Tensor,
    copy_src: torch.Tensor,
    copy_dst: torch.Tensor,
    block_size: int,
    keep: int,
    early_stopping_true: bool,
    workspace: Optional[dict] = None,
    eos_until: Optional[torch.Tensor] = None,
    eos: Optional[torch.Tensor] = None,
) -> None:
    """One beam-search step of the device-resident loop, in place (no host sync: graph capturable).
    The arguments are `reference.beam_update`'s; workspace: `kernels.beam.workspace(...)` for these
    sizes (its ticket left at zero)."""
    batch, beams, length = running_sequences.shape
    rows, vocab = logits.shape[0], logits.shape[-1]
    device = logits.device
    if workspace is None:
        raise ValueError("beam_update needs its workspace (kernels.beam.workspace(...) for these sizes)")
    if rows != batch * beams or not supports(beams, keep, vocab):
        raise ValueError(f"beam_update takes {rows} rows of {batch} x {beams} beams with keep {keep} <= {MAX_KEEP}, "
                         f"beams <= {MAX_BEAMS} and vocab <= {MAX_CHUNKS * _CHUNK}; got vocab {vocab}")
    for name, t in (("running_sequences", running_sequences), ("sequences", sequences), ("table", table),
                    ("owned", owned), ("input_ids", input_ids), ("step", step), ("int_table", int_table)):
        check_device(name, t, device)
    for name, t in (("running_sequences", running_sequences), ("sequences", sequences),
                    ("running_beam_indices", running_beam_indices), ("beam_indices", beam_indices),
                    ("running_beam_scores", running_beam_scores), ("beam_scores", beam_scores),
                    ("is_sent_finished", is_sent_finished), ("heuristic", heuristic), ("beam_idx", beam_idx),
                    ("next_tokens", next_tokens), ("int_table", int_table), ("float_table", float_table)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [rows, positions, vocab] with a contiguous vocab, got {tuple(logits.shape)}")
    if table.stride(-1) != 1 or owned.stride(-1) != 1 or table.shape[1] != owned.shape[1]:
        raise ValueError("table and owned must be [rows, width] with contiguous columns and one width")
    if eos_until is not None and eos_until.dtype != torch.int32:
        raise TypeError("eos_until must be int32 (decode.min_length.eos_until)")
    ws = workspace
    last = logits[:, -1]
    chunks = chunks_of(vocab)
    eos_arg = step if eos is None else eos
    _beam_candidates_kernel[(rows, chunks)](
        last, last.stride(0), step, int_table, int_table.stride(0), int_table.shape[0],
        step if eos_until is None else eos_until, int(eos_until is not None),
        ws["cand_val"], ws["cand_idx"], ws["stats"], vocab, chunks, keep,
        CHUNK=_CHUNK, num_warps=8, num_stages=1,
    )
    _beam_top_kernel[(batch,)](
        ws["cand_val"], ws["cand_idx"], ws["stats"], ws["row_stats"], running_beam_scores, ws["top_val"],
        ws["top_idx"], beams, keep, vocab, chunks, KP=_KP, CP=_CP, NB=_NB, num_warps=4, num_stages=1,
    )
    _beam_select_kernel[(batch,)](
        step, int_table, int_table.stride(0), float_table, float_table.stride(0), int_table.shape[0],
        ws["top_val"], ws["top_idx"], ws["flags"], ws["desc"], eos_arg, 0 if eos is None else eos.numel(),
        running_beam_scores, beam_scores, is_sent_finished.view(torch.int8), heuristic.view(torch.int8), beam_idx,
        next_tokens, table, table.stride(0), owned, owned.stride(0), table.shape[1], slot_mapping, self_seq_lens,
        input_ids, input_ids.stride(0), copy_src, copy_dst, int(block_size), beams, keep, vocab,
        int(early_stopping_true is True), KP=_KP, KEEPP=_KEEPP, MP=_MP, num_warps=4, num_stages=1,
    )
    _beam_rows_kernel[(batch,)](
        step, int_table, int_table.stride(0), int_table.shape[0], ws["desc"], ws["seq_buf"], ws["bi_buf"],
        ws["table_buf"], ws["flags"], ws["tickets"], running_sequences, sequences, running_beam_indices,
        beam_indices, unfinished.view(torch.int8), table, table.stride(0), owned, owned.stride(0), table.shape[1],
        int(block_size), batch, beams, length, running_beam_indices.shape[2], int(early_stopping_true is True),
        KP=_KP, BL=_BL, ROWS_CHUNK=_ROWS_CHUNK, num_warps=4, num_stages=1,
    )  # fmt: skip
