"""HF's beam-search bookkeeping as one CUDA graph per `generate()` call.

`loop.beam_loop` calls HF's beam helpers every step: ~80 small kernels, each launched from
Python, which costs more host time than a small model's whole decode step takes on the GPU.
`BeamStep` runs the same arithmetic — `_get_top_k_continuations`, the stopping criteria,
`_get_running_beams_for_next_iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`
and `_beam_search_has_unfinished_sequences`, in HF's order and with HF's operations — on static
tensors, with every number that changes per step (the current length, the length penalty,
whether min-length still applies, whether max length is reached) read from device tensors.
One capture then replays it for every step.

The one operation that cannot be copied literally is HF's division by a Python float (the
length penalty): on a CUDA tensor PyTorch computes it as `x * (1 / float32(p))`, on a CPU
tensor as `x / float32(p)`. `BeamStep` does the same from a device scalar, so it gives HF's
values bit for bit on either device.

Only what this covers takes the path (`supported`): beam search without sampling, logits
processors none or min-length, stopping criteria max length and EOS. Anything else runs
`loop.beam_loop` (HF's helpers, called directly).

Resident (`make_resident`) with a backend namespace that has `beam_update` (the Triton kernels on
a GPU) and sizes it takes, the update is that instead (`kernels/beam.py`): the same arithmetic in
four launches, equal scores taken by the lower index where `torch.topk` leaves the order open,
and the length penalty always as HF's CUDA multiplication.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
from torch import nn

from .beam_state import BeamState, fill_value
from .late_flag import LateFlag
from .loop import criteria_supported, eos_ids, lean_processors
from .min_length import MinLength, eos_until, forbid_eos

logger = logging.getLogger(__name__)


def supported(generation_config, logits_processor, stopping_criteria) -> bool:
    if generation_config.do_sample:
        return False
    if any(type(p) is not MinLength for p in lean_processors(logits_processor)):
        return False
    return criteria_supported(stopping_criteria, generation_config)


def _fused(ops, beams: int, keep: int, vocab: int) -> bool:
    """Whether the backend namespace `ops` has the kernels' update (`beam_update` with its size
    rule; `reference`'s twin alone is a test oracle) and it takes these sizes."""
    return hasattr(ops, "beam_update_supports") and ops.beam_update_supports(beams, keep, vocab)


def update_ahead(ops, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch `ops.beam_update` once on throwaway buffers (1 source x 2 beams), for a compile-only
    pass (`kernels/ahead.py`): its four binaries serve every beam call of this logits dtype."""
    if not _fused(ops, 2, 4, vocab):
        return
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    state = BeamState(torch.zeros(1, 2, 1, **i64), 3, 0, 1)
    ops.beam_update(
        logits=torch.zeros(2, 1, vocab, dtype=dtype, device=device), step=torch.zeros((), **i64),
        int_table=torch.zeros(2, 3, **i64), float_table=torch.ones(2, 2, dtype=torch.float32, device=device),
        running_sequences=state.running_sequences, sequences=state.sequences,
        running_beam_scores=state.running_beam_scores, beam_scores=state.beam_scores,
        running_beam_indices=state.running_beam_indices, beam_indices=state.beam_indices,
        is_sent_finished=state.is_sent_finished, heuristic=state.is_early_stop_heuristic_unsatisfied,
        beam_idx=torch.zeros(2, **i64), next_tokens=torch.zeros(2, 1, **i64),
        unfinished=torch.ones((), dtype=torch.bool, device=device), table=torch.zeros(2, 1, **i32),
        owned=torch.zeros(2, 1, **i32), slot_mapping=torch.zeros(2, **i32), self_seq_lens=torch.zeros(2, **i32),
        input_ids=torch.zeros(2, 1, **i64), copy_src=torch.zeros(2, **i64), copy_dst=torch.zeros(2, **i64),
        block_size=1, keep=4, early_stopping_true=False,
        workspace=ops.beam_workspace(1, 2, 4, vocab, 3, 2, 1, device),
        eos_until=torch.zeros(vocab, **i32), eos=torch.zeros(1, **i64))


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """HF's `_gather_beams`: beams `index` [batch, k] of `tensor` [batch, beams, ...]."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def division_factor(denominator: float, multiply: bool) -> float:
    """The float32 number that stands for HF's `x / denominator` (a Python float): its reciprocal
    where `scale_by` multiplies (a CUDA tensor: `x * (1 / float32(p))`), else the denominator."""
    if multiply:
        return float(np.float32(1.0) / np.float32(denominator))
    return float(np.float32(denominator))


def length_factors(cur_len: int, prompt_len: int, max_length: int, length_penalty: float, early_stopping,
                   multiply: bool) -> tuple[float, float]:
    """The `division_factor`s of HF's two length-penalty divisions at `cur_len` (before HF's
    increment): `_update_finished_beams`' `(cur_len + 1 - prompt_len) ** length_penalty` and
    `_check_early_stop_heuristic`'s best hypothetical length (max_length - prompt_len under
    early_stopping="never" with a positive penalty, else the length after the increment)."""
    if early_stopping == "never" and length_penalty > 0.0:
        best = max_length - prompt_len
    else:
        best = cur_len + 1 - prompt_len
    return (division_factor((cur_len + 1 - prompt_len) ** length_penalty, multiply),
            division_factor(best**length_penalty, multiply))


def scale_by(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """HF's division of `x` by a Python float, from `division_factor`'s number on the device."""
    return x * factor if x.device.type == "cuda" else x / factor


def advance_candidates(state: BeamState, log_probs: torch.Tensor, col: torch.Tensor, at_max: torch.Tensor,
                       eos: Optional[torch.Tensor], length_factor: torch.Tensor, heuristic_factor: torch.Tensor,
                       early_stopping, batch_offset: torch.Tensor, do_sample: bool = False) -> torch.Tensor:
    """HF's beam step after the logits processors, on `state`'s tensors in place: the continuations
    (`_get_top_k_continuations`), the stopping criteria on them, `_get_running_beams_for_next_iteration`,
    `_update_finished_beams` and `_check_early_stop_heuristic`, with HF's operations in HF's order.

    Every number HF takes from its loop is a device tensor here, one for all sources (0-dim) or one
    per source ([batch]: sources at their own lengths, the batch engine's beam group):
    log_probs: [batch * num_beams, vocab] processed log-probs; col: the column the new token takes
    (HF's cur_len; the beam-index column is col - prompt_len); at_max: the max-length criterion;
    eos: [num_eos] or [batch, num_eos] ids, or None; length_factor / heuristic_factor: the length
    penalty's `division_factor`s for the finished candidates and for the heuristic's best running
    score; batch_offset: [batch, 1] source * num_beams. Returns the candidates that hit a stopping
    criterion, [batch, beams_to_keep] bool."""
    batch, beams, keep = state.batch, state.num_beams, state.beams_to_keep
    vocab = log_probs.shape[-1]
    col = col.reshape(-1, 1, 1).expand(batch, keep, 1)
    log_probs = log_probs.reshape(batch, beams, vocab) + state.running_beam_scores[:, :, None]
    log_probs = log_probs.reshape(batch, beams * vocab)
    # _get_top_k_continuations
    if do_sample:
        topk_indices = torch.multinomial(nn.functional.softmax(log_probs, dim=-1), num_samples=keep)
        topk_log_probs = torch.gather(input=log_probs, dim=1, index=topk_indices)
        topk_log_probs, order = topk_log_probs.sort(dim=-1, descending=True)
        topk_indices = topk_indices.gather(dim=-1, index=order)
    else:
        topk_log_probs, topk_indices = torch.topk(log_probs, k=keep)
    topk_current_beam_indices = topk_indices // vocab
    topk_running_beam_indices = _gather(state.running_beam_indices, topk_current_beam_indices)
    topk_running_sequences = _gather(state.running_sequences, topk_current_beam_indices)
    topk_ids = topk_indices % vocab
    topk_running_sequences.scatter_(2, col, topk_ids[:, :, None])
    batch_modified_indices = topk_current_beam_indices + batch_offset
    topk_running_beam_indices.scatter_(2, col - state.prompt_len, batch_modified_indices[:, :, None].to(torch.int32))
    # stopping criteria on the candidates: EOS as the last token, max length
    hits = at_max.reshape(-1, 1).expand(batch, keep)
    if eos is not None:  # HF: isin(last token, eos)
        hits = hits | (topk_ids[:, :, None] == eos.reshape(-1, 1, eos.shape[-1])).any(-1)
    # _get_running_beams_for_next_iteration
    topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * -1.0e9
    next_topk_indices = torch.topk(topk_running_log_probs, k=beams)[1]
    state.running_sequences.copy_(_gather(topk_running_sequences, next_topk_indices))
    state.running_beam_scores.copy_(_gather(topk_running_log_probs, next_topk_indices))
    state.running_beam_indices.copy_(_gather(topk_running_beam_indices, next_topk_indices))
    # _update_finished_beams
    heuristic = state.is_early_stop_heuristic_unsatisfied
    did_top_num_beams_just_finished = hits & state.top_num_beam_mask[None, :]
    topk_log_probs = scale_by(topk_log_probs, _per_source(length_factor))
    beams_in_batch_are_full = torch.all(state.is_sent_finished, dim=-1, keepdim=True) & (early_stopping is True)
    topk_log_probs += beams_in_batch_are_full.to(torch.float32) * -1.0e9
    topk_log_probs += (~heuristic).to(torch.float32) * -1.0e9
    topk_log_probs += (~did_top_num_beams_just_finished) * -1.0e9
    merged_sequences = torch.cat((state.sequences, topk_running_sequences), dim=1)
    merged_scores = torch.cat((state.beam_scores, topk_log_probs), dim=1)
    merged_beam_indices = torch.cat((state.beam_indices, topk_running_beam_indices), dim=1)
    merged_is_sent_finished = torch.cat((state.is_sent_finished, did_top_num_beams_just_finished), dim=1)
    topk_merged_indices = torch.topk(merged_scores, k=beams)[1]
    state.sequences.copy_(_gather(merged_sequences, topk_merged_indices))
    state.beam_scores.copy_(_gather(merged_scores, topk_merged_indices))
    state.beam_indices.copy_(_gather(merged_beam_indices, topk_merged_indices))
    state.is_sent_finished.copy_(_gather(merged_is_sent_finished, topk_merged_indices))
    # _check_early_stop_heuristic (after HF's cur_len += 1)
    best_possible_running_score = scale_by(state.running_beam_scores[:, :1], _per_source(heuristic_factor))
    worst_finished_score = torch.where(
        state.is_sent_finished, torch.min(state.beam_scores, dim=1, keepdim=True)[0], -1.0e9
    )
    heuristic.copy_(heuristic & torch.any(best_possible_running_score > worst_finished_score, dim=-1, keepdim=True))
    return hits


def _per_source(factor: torch.Tensor) -> torch.Tensor:
    """A 0-dim factor as it is, a [batch] one as [batch, 1] (it scales each source's row)."""
    return factor if factor.dim() == 0 else factor.reshape(-1, 1)


class BeamStep(BeamState):
    """One beam search's `BeamState` and its capturable per-step update (see the module docstring).

    input_ids: [batch * num_beams, prompt_len] decoder prompt, on the model's device.
    """

    def __init__(self, input_ids, generation_config, logits_processor, stopping_criteria, vocab_size: int,
                 ops=None) -> None:
        cfg = generation_config
        device = input_ids.device
        beams = cfg.num_beams
        batch = input_ids.shape[0] // beams
        eos = cfg._eos_token_tensor
        super().__init__(input_ids.reshape(batch, beams, -1), cfg.max_length, fill_value(cfg._pad_token_tensor, eos),
                         eos.shape[0] if eos is not None else 0)
        self.device, self.vocab = device, vocab_size
        self.length_penalty, self.early_stopping = cfg.length_penalty, cfg.early_stopping
        self.num_return_sequences = cfg.num_return_sequences
        self.eos = eos_ids(stopping_criteria, device)
        minimum = [p for p in lean_processors(logits_processor) if isinstance(p, MinLength)]
        self.min_length = minimum  # applied in order, each with its own on/off flag
        self.min_masks = [p.eos_mask(vocab_size, device) for p in minimum]
        self.heuristic = self.is_early_stop_heuristic_unsatisfied  # updated in place (copy_) from here on
        # (the step counter is the caller's, or `make_resident`'s on the device: `cur_len`, `history`
        # and `next_ids` of the base class stay at the prompt)
        self.batch_offset = torch.arange(batch, device=device).view(-1, 1) * beams
        # per-step inputs: [cur_len, cur_len - prompt_len, at max length, min-length flags...] and
        # [length-penalty factor, heuristic factor] (see `_factor`)
        self.ints = torch.zeros(3 + len(minimum), dtype=torch.int64, device=device)
        self.floats = torch.zeros(2, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self._ints_host = torch.zeros(self.ints.shape, dtype=torch.int64, pin_memory=pin)
        self._floats_host = torch.zeros(self.floats.shape, dtype=torch.float32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        # outputs of `update`
        self.logits = None  # [batch * beams, vocab] float32, set by `load_logits`
        self.beam_idx = torch.zeros(batch * beams, dtype=torch.int64, device=device)
        self.next_tokens = torch.zeros(batch * beams, 1, dtype=torch.int64, device=device)
        self.unfinished = torch.ones((), dtype=torch.bool, device=device)
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits_in: Optional[torch.Tensor] = None  # set by `make_resident`
        # resident: the whole update as `ops.beam_update` (four kernels on a GPU) where it fits
        self.fused = ops if _fused(ops, beams, self.beams_to_keep, vocab_size) else None

    # ---- per step -------------------------------------------------------------------------
    def _numbers(self, cur_len: int) -> tuple[list[int], list[float]]:
        """This step's numbers (HF's Python values for `cur_len`): [cur_len, cur_len - prompt_len,
        at max length, min-length flags...] and [length-penalty factor, heuristic factor]."""
        ints = [cur_len, cur_len - self.prompt_len, int(cur_len + 1 >= self.max_length)]
        ints += [int(p.blocked(cur_len)) for p in self.min_length]
        multiply = self.device.type == "cuda" or self.fused is not None
        floats = list(length_factors(cur_len, self.prompt_len, self.max_length, self.length_penalty,
                                     self.early_stopping, multiply))
        return ints, floats

    def set_step(self, cur_len: int) -> None:
        """Write this step's numbers into the device inputs (not resident: see `make_resident`)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's transfer out of the pinned buffers is done
        ints, floats = self._numbers(cur_len)
        self._ints_host.numpy()[:] = ints
        self._floats_host.numpy()[:] = floats
        self.ints.copy_(self._ints_host, non_blocking=True)
        self.floats.copy_(self._floats_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def make_resident(self, static, owned: torch.Tensor, pool, block_size: int) -> None:
        """Take every per-step input from the device from now on: the numbers of all steps as one
        table indexed by a device step counter, the logits from the decode step's static output,
        and write the decode step's inputs at the end of `update` — the cache reorder into its
        self block table, the new tokens, their slots and the self lengths (`graphs._StaticStep`).
        owned: [rows, max_self_blocks] int32, the blocks each row writes into."""
        rows, width = owned.shape
        steps = [self._numbers(c) for c in range(self.prompt_len, self.max_length)]
        self.int_table = torch.tensor([i for i, _ in steps], dtype=torch.int64, device=self.device)
        self.float_table = torch.tensor([f for _, f in steps], dtype=torch.float32, device=self.device)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.logits_in = static.logits[:rows]
        self.static, self.owned, self.pool, self.block_size = static, owned, pool, block_size
        self.table = static.meta.self_block_table[:rows, :width]
        self.columns = torch.arange(width, device=self.device)
        if self.fused is not None:
            self.workspace = self.fused.beam_workspace(self.batch, self.num_beams, self.beams_to_keep, self.vocab,
                                                       self.max_length, self.running_beam_indices.shape[2], width,
                                                       self.device)
            self.copy_src = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.copy_dst = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.eos_until = eos_until(self.min_length, self.vocab, self.device)

    def _reorder_and_feed(self, col: torch.Tensor, copy_blocks: bool) -> None:
        """Row r continues from row beam_idx[r] (`PagedEncoderDecoderCache.reorder_cache` on the
        static table: rows gathered, the block being filled copied into the row's own), then the
        next decode step's inputs for position `col` (= the cache length)."""
        rows, bs = self.owned.shape[0], self.block_size
        current = torch.div(col, bs, rounding_mode="floor").clamp(max=self.owned.shape[1] - 1).expand(rows, 1)
        table = self.table.index_select(0, self.beam_idx)
        own = torch.gather(self.owned, 1, current)[:, 0]
        if copy_blocks:  # also at a block boundary, where it copies a block nobody has written yet
            self.pool.copy_blocks(torch.gather(table, 1, current)[:, 0], own)
        self.table.copy_(torch.where(self.columns >= current, self.owned, table))
        meta = self.static.meta
        meta.slot_mapping[:rows].copy_(own * bs + col % bs)
        meta.self_seq_lens[:rows].copy_(col + 1)
        self.static.input_ids[:rows].copy_(self.next_tokens)
        self.step += 1

    def load_logits(self, logits: torch.Tensor) -> None:
        """logits [batch * beams, 1, vocab] of the step; copied into the static float32 input."""
        if self.logits is None:
            self.logits = logits[:, -1, :].to(copy=True, dtype=torch.float32)
        else:
            self.logits.copy_(logits[:, -1, :])

    def update(self, copy_blocks: bool = True) -> None:
        """One step of HF's `_beam_search` after the forward, in place (capturable); resident
        (`make_resident`), also the cache reorder and the next decode step's inputs."""
        if self.fused is not None and self.logits_in is not None:
            return self._fused_update(copy_blocks)
        batch, beams = self.batch, self.num_beams
        if self.logits_in is None:
            ints, floats, logits = self.ints, self.floats, self.logits
        else:
            index = self.step.clamp(max=self.int_table.shape[0] - 1).view(1)
            ints, floats = self.int_table.index_select(0, index)[0], self.float_table.index_select(0, index)[0]
            logits = self.logits_in[:, -1].to(torch.float32)  # HF: a float32 copy of the last logits
        col, col_idx, at_max = ints[0], ints[1], ints[2].bool()
        log_probs = nn.functional.log_softmax(logits, dim=-1)
        for i, mask in enumerate(self.min_masks):
            log_probs = forbid_eos(log_probs, mask, ints[3 + i].bool())
        hits = advance_candidates(self, log_probs, col, at_max, self.eos, floats[0], floats[1], self.early_stopping,
                                  self.batch_offset)
        # the cache reorder and the next input tokens
        picked = torch.gather(self.running_beam_indices, 2, col_idx.expand(batch, beams, 1))
        self.beam_idx.copy_(picked.reshape(-1))
        self.next_tokens.copy_(torch.gather(self.running_sequences, 2, col.expand(batch, beams, 1)).reshape(-1, 1))
        # _beam_search_has_unfinished_sequences
        improvement_possible = torch.any(self.heuristic)
        exists_open_beam = ~(torch.all(self.is_sent_finished) & (self.early_stopping is True))
        valid_continuations = ~torch.all(hits)
        self.unfinished.copy_(improvement_possible & exists_open_beam & valid_continuations)
        if self.logits_in is not None:
            self._reorder_and_feed(col, copy_blocks)

    def _fused_update(self, copy_blocks: bool) -> None:
        """`update` as `ops.beam_update` (the same arithmetic, equal scores taken by the lower
        index), then the block copies it asks for."""
        rows, meta = self.owned.shape[0], self.static.meta
        self.fused.beam_update(
            logits=self.logits_in, step=self.step, int_table=self.int_table, float_table=self.float_table,
            running_sequences=self.running_sequences, sequences=self.sequences,
            running_beam_scores=self.running_beam_scores, beam_scores=self.beam_scores,
            running_beam_indices=self.running_beam_indices, beam_indices=self.beam_indices,
            is_sent_finished=self.is_sent_finished, heuristic=self.heuristic, beam_idx=self.beam_idx,
            next_tokens=self.next_tokens, unfinished=self.unfinished, table=self.table, owned=self.owned,
            slot_mapping=meta.slot_mapping[:rows], self_seq_lens=meta.self_seq_lens[:rows],
            input_ids=self.static.input_ids[:rows], copy_src=self.copy_src, copy_dst=self.copy_dst,
            block_size=self.block_size, keep=self.beams_to_keep, early_stopping_true=self.early_stopping is True,
            workspace=self.workspace, eos_until=self.eos_until, eos=self.eos)
        if copy_blocks:  # also at a block boundary, where it copies a block nobody has written yet
            self.pool.copy_blocks(self.copy_src, self.copy_dst)

    def capture(self, side: torch.cuda.Stream) -> None:
        """Record `update` as a CUDA graph on `side` (see `graphs.capture_update`)."""
        from .graphs import capture_update

        # the warm-up run must leave the pool alone (its block copies cannot be undone cheaply)
        self._graph = capture_update(self.update, self._state(), side,
                                     warmup=lambda: self.update(copy_blocks=False))

    def _state(self) -> list[torch.Tensor]:
        state = [self.running_sequences, self.sequences, self.running_beam_scores, self.beam_scores,
                 self.is_sent_finished, self.heuristic, self.running_beam_indices, self.beam_indices]
        if self.logits_in is not None:
            meta = self.static.meta
            state += [self.step, self.table, meta.slot_mapping, meta.self_seq_lens, self.static.input_ids]
        return state

    def run(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self.update()

def graph_beam_loop(step, prefill, reorder, input_ids, logits_processor, stopping_criteria, generation_config,
                    capture: bool = True, streams=None):
    """Beam search with `BeamStep` (captured as a graph on CUDA when `capture`, i.e. unless the
    patch's config turns CUDA graphs off, on `streams.update`: `graphs.Streams`); same contract
    as `loop.beam_loop`."""
    logits = prefill(input_ids)
    state = BeamStep(input_ids, generation_config, logits_processor, stopping_criteria, logits.shape[-1])
    cuda = state.device.type == "cuda"
    late = LateFlag(state.device)
    cur_len = state.prompt_len
    state.load_logits(logits)
    state.set_step(cur_len)
    if cuda and capture:
        try:
            state.capture(streams.update(state.device))
        except RuntimeError as exc:  # the same update then runs eagerly: slower, same values
            logger.warning("hf_paged_t5: beam-search bookkeeping could not be captured as a CUDA graph (%s); "
                           "running it eagerly", exc)
            torch.cuda.synchronize(state.device)
    while True:
        state.run()
        reorder(state.beam_idx)
        cur_len += 1
        if cur_len >= state.max_length:
            break  # every candidate hit max length: HF stops here too, known on the host
        def queue():
            state.load_logits(step(state.next_tokens))
            state.set_step(cur_len)

        stop, _ = late.queue_unless(state.unfinished, False, queue)
        if stop:
            break
    return state.result(state.num_return_sequences)


def resident_beam_loop(graphs, step_fn, cache, prefill, input_ids, logits_processor, stopping_criteria,
                       generation_config, capture: bool = True, ops=None):
    """`graph_beam_loop` with every per-step input on the device (`BeamStep.make_resident`): per step
    the host replays the decode step and the bookkeeping (captured on CUDA when `capture`, eager on
    the same static buffers otherwise) and reads the "go on" flag one step late. The whole model
    on one device (the decode step's one static table)."""
    from .graphs import ResidentLoop

    loop = ResidentLoop(graphs, step_fn, cache, prefill, input_ids, capture)
    state = BeamStep(input_ids, generation_config, logits_processor, stopping_criteria, loop.logits.shape[-1], ops)
    state.make_resident(loop.static, cache.owned_table(loop.device), cache.pool, cache.block_size)
    loop.capture_update(state, "beam-search bookkeeping")
    cur_len = state.prompt_len
    while True:
        state.run()  # the step's beams, the cache reorder, the next step's inputs
        cur_len += 1
        if cur_len >= state.max_length:
            break  # every candidate hit max length: HF stops here too, known on the host
        if loop.next_step(state.unfinished, stop_on=False):
            break  # the step just queued is dropped
    return state.result(state.num_return_sequences)
