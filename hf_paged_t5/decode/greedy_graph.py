"""Greedy decoding with every per-step number on the device.

`loop.sample_loop` selects each token with ~15 small PyTorch calls and `DecodeGraphs.run` fills
the step's slot mapping on the host: on a small model that host work takes longer than the
decode step takes on the GPU. Here the host only replays: the decode graph, then `GreedyStep`'s
update, which does what `sample_loop` does — HF's float32 copy of the logits, the min-length
processors, argmax, padding of finished rows, the EOS criterion — and then writes the chosen
tokens into the decode graph's input and the next step's slot mapping and self lengths into its
metadata, all from a step counter that lives on the device. The "all finished" flag is read one
step late, as in `sample_loop`.

Only what this covers takes the path (`supported`): greedy search, logits processors none or
min-length, stopping criteria max length and EOS, no streamer, the whole model on one device.
Anything else runs `loop.sample_loop`. On CPU (and with `cuda_graphs=False`) the same update and
decode step run eagerly on the same static buffers.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria

from .graphs import DecodeGraphs, ResidentLoop, capture_update
from .loop import criteria_supported, eos_ids, lean_processors
from .greedy_state import GreedyState
from .min_length import MinLength, forbid_eos

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
    The sequences are [rows, max_length]; the length counter `cur_len` lives on the device.
    """

    def __init__(self, input_ids, generation_config, logits_processor, stopping_criteria, logits, step_ids,
                 slot_mapping, self_seq_lens, owned, block_size: int) -> None:
        device = input_ids.device
        self.eos = eos_ids(stopping_criteria, device)
        # HF pads finished rows only when an EOS criterion is there
        super().__init__(input_ids, generation_config.max_length,
                         generation_config._pad_token_tensor if self.eos is not None else None)
        self.device, self.max_length = device, generation_config.max_length
        self.logits, self.step_ids, self.slot_mapping, self.self_seq_lens = logits, step_ids, slot_mapping, self_seq_lens
        self.owned, self.block_size = owned, block_size
        vocab = logits.shape[-1]
        self.minimum = [p for p in lean_processors(logits_processor) if isinstance(p, MinLength)]
        self.min_masks = [p.eos_mask(vocab, device) for p in self.minimum]
        self.cur_len = torch.full((), self.prompt_len, dtype=torch.int64, device=device)
        self.all_done = torch.zeros((), dtype=torch.bool, device=device)
        self._graph = None

    @staticmethod
    def signature(input_ids, generation_config, logits_processor, stopping_criteria, owned, vocab: int,
                  block_size: int) -> tuple:
        """What a captured update bakes in besides the tensors `reset` refills: shapes, and the
        min-length processors' Python numbers. Two calls with one signature (and one static step)
        can share the captured update."""
        minimum = tuple((p.minimum, p.skip) for p in lean_processors(logits_processor) if isinstance(p, MinLength))
        eos = [c.eos_token_id.numel() for c in stopping_criteria if type(c) is EosTokenCriteria]
        return (input_ids.shape[0], generation_config.max_length, tuple(owned.shape), vocab, block_size, minimum,
                sum(eos) if eos else None)

    def reset(self, input_ids, generation_config, logits_processor, stopping_criteria, owned) -> None:
        """Refill every tensor the captured update reads with this call's values (device copies, no
        sync): the prompt, the counters, the rows' blocks, the EOS ids, pad id and min-length masks."""
        super().reset(input_ids)
        self.cur_len.fill_(self.prompt_len)
        self.all_done.fill_(False)
        self.owned.copy_(owned)
        minimum = [p for p in lean_processors(logits_processor) if isinstance(p, MinLength)]
        for p, mask in zip(minimum, self.min_masks):
            mask.copy_(p.eos_mask(mask.shape[0], self.device))
        if self.eos is not None:
            self.eos.copy_(eos_ids(stopping_criteria, self.device))
            self.pad.copy_(generation_config._pad_token_tensor.to(self.device))

    def update(self) -> None:
        """`sample_loop`'s token selection for the logits in `self.logits`, then the next decode
        step's inputs (capturable: no host sync, no per-step Python numbers)."""
        cur = self.cur_len
        scores = self.logits[:, -1].to(torch.float32)  # HF: next_token_logits, a float32 copy
        for p, mask in zip(self.minimum, self.min_masks):
            scores = forbid_eos(scores, mask, p.blocked(cur))
        tokens = self.choose(scores, cur)  # argmax, finished rows padded, written at column `cur`
        column = cur.expand(tokens.shape[0], 1)
        if self.eos is not None:
            self.unfinished &= ~(tokens[:, None] == self.eos).any(-1)
            self.all_done.copy_(~self.unfinished.any())
        # the token at position `cur` goes into the cache at position `cur` in the next step
        self.step_ids.copy_(tokens[:, None])
        # (clamped: after the last token no step runs, and its position may lie past the blocks)
        index = torch.div(column, self.block_size, rounding_mode="floor").clamp_(max=self.owned.shape[1] - 1)
        block = torch.gather(self.owned, 1, index)
        self.slot_mapping.copy_(block[:, 0] * self.block_size + cur % self.block_size)
        self.self_seq_lens.copy_(cur + 1)
        cur += 1

    def capture(self, side: torch.cuda.Stream) -> None:
        state = [self.sequences, self.cur_len, self.unfinished, self.all_done, self.step_ids,
                 self.slot_mapping, self.self_seq_lens]
        self._graph = capture_update(self.update, state, side)

    def run(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self.update()


def graph_greedy_loop(graphs: DecodeGraphs, step_fn: Callable, cache,
                      prefill: Callable[[torch.Tensor], torch.Tensor], input_ids, logits_processor,
                      stopping_criteria, generation_config, capture: bool = True) -> torch.LongTensor:
    """Greedy search on device-resident step inputs; same contract as `loop.sample_loop`.

    step_fn(input_ids, meta_for) -> logits: the decode step (`DecodeGraphs`' contract); prefill
    runs the decoder prompt. capture: CUDA graphs for the decode step and the update.
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
                           cache.block_size)
        loop.capture_update(state, "greedy token selection")
        if key is not None and state._graph is not None:
            graphs.keep_update(static, key, state)
    state.run()  # the first new token, from the prefill's logits
    cur_len = state.prompt_len + 1
    while cur_len < state.max_length:
        if loop.next_step(state.all_done, stop_on=True, then=state.run):
            break  # every row had finished: the step just queued is dropped
        cur_len += 1
    out = state.sequences[:, :cur_len]
    return out.clone() if key is not None else out  # a kept update's buffer is the next call's
