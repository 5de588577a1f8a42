"""Greedy decoding with every per-step number on the device.

`loop.sample_loop` selects each token with ~15 small PyTorch calls and `DecodeGraphs.run` fills
the step's slot mapping on the host: on a small model that host work takes longer than the
decode step takes on the GPU. Here the host only replays: the decode graph, then `GreedyStep`'s
update, which does what `sample_loop` does — HF's float32 copy of the logits, the min-length
processors, argmax, padding of finished rows, the EOS criterion — and then writes the chosen
tokens into the decode graph's input and the next step's slot mapping and self lengths into its
metadata, all from a step counter that lives on the device: one launch of the backend's
`greedy_update` (the Triton kernel, or its PyTorch twin in `reference`). The "finished at
column" flag is read one step late, as in `sample_loop`.

Only what this covers takes the path (`supported`): greedy search, logits processors none or
min-length, stopping criteria max length and EOS, no streamer, the whole model on one device.
Anything else runs `loop.sample_loop`. On CPU (and with `cuda_graphs=False`) the same update and
decode step run eagerly on the same static buffers.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria

from ..model.attention import backend_ops
from .graphs import DecodeGraphs, ResidentLoop, capture_update
from .loop import criteria_supported, eos_ids, lean_processors
from .greedy_state import GreedyState
from .min_length import MinLength, eos_until

# Largest batch whose captured update is kept across generate() calls (`DecodeGraphs.keep_update`).
_CACHED_UPDATE_ROWS = 16


def supported(generation_config, logits_processor, stopping_criteria) -> bool:
    if generation_config.do_sample or (generation_config.num_beams or 1) != 1:
        return False
    if any(type(p) is not MinLength for p in lean_processors(logits_processor)):
        return False
    if not criteria_supported(stopping_criteria, generation_config):
        return False
    # an EOS criterion pads finished rows: without a pad id HF's own loop raises (its error, not ours)
    has_eos = any(type(c) is EosTokenCriteria for c in stopping_criteria)
    return not has_eos or generation_config._pad_token_tensor is not None


class GreedyStep(GreedyState):
    """One greedy search's `GreedyState` and the in-place update that extends it by a token.

    input_ids: [rows, prompt_len] decoder prompt on the model's device.
    logits: [rows, 1, vocab] the buffer the decode step writes (the update reads it).
    step_ids: [rows, 1] int64 the decode step's input; slot_mapping, self_seq_lens: [rows] int32
        of its metadata; owned: [rows, max_self_blocks] int32 the blocks each row writes into.
    ops: the kernel namespace whose `greedy_update` runs the update (default: Triton's on CUDA,
        the PyTorch twin elsewhere).
    The sequences are [rows, max_length]; the length counter `cur_len` lives on the device.
    """

    def __init__(self, input_ids, generation_config, logits_processor, stopping_criteria, logits, step_ids,
                 slot_mapping, self_seq_lens, owned, block_size: int, ops=None) -> None:
        device = input_ids.device
        self.eos = eos_ids(stopping_criteria, device)
        # HF pads finished rows only when an EOS criterion is there
        super().__init__(input_ids, generation_config.max_length,
                         generation_config._pad_token_tensor if self.eos is not None else None)
        self.device, self.max_length = device, generation_config.max_length
        self.logits, self.step_ids, self.slot_mapping, self.self_seq_lens = logits, step_ids, slot_mapping, self_seq_lens
        self.owned, self.block_size = owned, block_size
        self.ops = ops if ops is not None else backend_ops("triton" if device.type == "cuda" else "torch")
        vocab = logits.shape[-1]
        minimum = [p for p in lean_processors(logits_processor) if isinstance(p, MinLength)]
        self.until = eos_until(minimum, vocab, device)  # [vocab] int32, or None without a rule
        self.cur_len = torch.full((), self.prompt_len, dtype=torch.int64, device=device)
        self.done_at = torch.full((), -1, dtype=torch.int64, device=device)
        self.tickets = torch.zeros(1, dtype=torch.int32, device=device)
        self._graph = None

    @staticmethod
    def signature(input_ids, generation_config, logits_processor, stopping_criteria, owned, vocab: int,
                  block_size: int) -> tuple:
        """What a captured update bakes in besides the tensors `reset` refills: shapes, and whether
        a min-length rule and an EOS criterion are there. Two calls with one signature (and one
        static step) can share the captured update."""
        minimum = any(isinstance(p, MinLength) for p in lean_processors(logits_processor))
        eos = [c.eos_token_id.numel() for c in stopping_criteria if type(c) is EosTokenCriteria]
        return (input_ids.shape[0], generation_config.max_length, tuple(owned.shape), vocab, block_size, minimum,
                sum(eos) if eos else None)

    def reset(self, input_ids, generation_config, logits_processor, stopping_criteria, owned) -> None:
        """Refill every tensor the captured update reads with this call's values (device copies, no
        sync): the prompt, the counters, the rows' blocks, the EOS ids, pad id and min-length table."""
        super().reset(input_ids)
        self.cur_len.fill_(self.prompt_len)
        self.done_at.fill_(-1)
        self.owned.copy_(owned)
        if self.until is not None:
            minimum = [p for p in lean_processors(logits_processor) if isinstance(p, MinLength)]
            self.until.copy_(eos_until(minimum, self.until.shape[0], self.device))
        if self.eos is not None:
            self.eos.copy_(eos_ids(stopping_criteria, self.device))
            self.pad.copy_(generation_config._pad_token_tensor.to(self.device))

    def update(self) -> None:
        """`sample_loop`'s token selection for the logits in `self.logits`, then the next decode
        step's inputs (capturable: no host sync, no per-step Python numbers)."""
        self.ops.greedy_update(
            logits=self.logits, sequences=self.sequences, cur_len=self.cur_len, unfinished=self.unfinished,
            done_at=self.done_at, step_ids=self.step_ids, slot_mapping=self.slot_mapping,
            self_seq_lens=self.self_seq_lens, owned=self.owned, block_size=self.block_size, tickets=self.tickets,
            eos_until=self.until, pad=self.pad if self.eos is not None else None, eos=self.eos)

    def capture(self, side: torch.cuda.Stream) -> None:
        state = [self.sequences, self.cur_len, self.unfinished, self.done_at, self.step_ids,
                 self.slot_mapping, self.self_seq_lens]
        self._graph = capture_update(self.update, state, side)

    def run(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self.update()


def update_ahead(ops, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch `ops.greedy_update` once on throwaway buffers of a call's shapes, for a compile-only
    pass (`kernels/ahead.py`): its one binary (every call's, whatever its rules) then compiles with
    the call's other kernels."""
    int32 = dict(dtype=torch.int32, device=device)
    int64 = dict(dtype=torch.int64, device=device)
    ops.greedy_update(
        logits=torch.empty(rows, 1, vocab, dtype=dtype, device=device), sequences=torch.zeros(rows, 2, **int64),
        cur_len=torch.zeros((), **int64), unfinished=torch.ones(rows, dtype=torch.bool, device=device),
        done_at=torch.zeros((), **int64), step_ids=torch.zeros(rows, 1, **int64),
        slot_mapping=torch.zeros(rows, **int32), self_seq_lens=torch.zeros(rows, **int32),
        owned=torch.zeros(rows, 1, **int32), block_size=1, tickets=torch.zeros(1, **int32),
        eos_until=torch.zeros(vocab, **int32), pad=torch.zeros((), **int64), eos=torch.zeros(1, **int64))


def graph_greedy_loop(graphs: DecodeGraphs, step_fn: Callable, cache,
                      prefill: Callable[[torch.Tensor], torch.Tensor], input_ids, logits_processor,
                      stopping_criteria, generation_config, capture: bool = True, ops=None) -> torch.LongTensor:
    """Greedy search on device-resident step inputs; same contract as `loop.sample_loop`.

    step_fn(input_ids, meta_for) -> logits: the decode step (`DecodeGraphs`' contract); prefill
    runs the decoder prompt. capture: CUDA graphs for the decode step and the update. ops: the
    kernel namespace of the update (`GreedyStep`).
    """
    loop = ResidentLoop(graphs, step_fn, cache, prefill, input_ids, capture)
    static, rows = loop.static, input_ids.shape[0]
    owned = cache.owned_table(loop.device)
    args = (input_ids, generation_config, logits_processor, stopping_criteria)
    # A captured update is kept with the decode graphs for small batches (whose calls are short:
    # t5-small at batch 1 spent ~3 ms per call capturing it, ~7% of a 128-token call) and reused
    # by a later call of the same signature on the same static step, its tensors refilled.
    key = None
    if loop.capture and static.graph is not None and rows <= _CACHED_UPDATE_ROWS:
        key = ("greedy", GreedyStep.signature(*args, owned, static.logits.shape[-1], cache.block_size))
    state = graphs.cached_update(static, key)
    if state is not None:
        state.reset(*args, owned)
    else:
        state = GreedyStep(*args, static.logits[:rows], static.input_ids[:rows], static.meta.slot_mapping[:rows],
                           static.meta.self_seq_lens[:rows], owned.clone() if key is not None else owned,
                           cache.block_size, ops)
        loop.capture_update(state, "greedy token selection")
        if key is not None and state._graph is not None:
            graphs.keep_update(static, key, state)
    state.run()  # the first new token, from the prefill's logits
    length = state.prompt_len + 1
    while length < state.max_length:
        done_at = loop.next_step_read(state.done_at, then=state.run)
        if done_at >= 0:
            length = done_at + 1  # every row had finished there: a step queued after it is dropped
            break
        length += 1
    out = state.sequences[:, :length]
    return out.clone() if key is not None else out  # a kept update's buffer is the next call's
