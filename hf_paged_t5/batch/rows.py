"""`DecodeRows`: the greedy / sampling rows of a `BatchRun`, decoded without waiting on the host.

The tokens chosen at step n stay on the device and are step n+1's input ids. They are read back
(non-blocking, into pinned memory) and checked for EOS and max_new_tokens only after step n+1 has
been queued, as `loop.sample_loop` reads its stop flag: the host prepares the next step while the GPU
runs this one. So a row that finished at step n runs step n+1 too, and that step's token is dropped.
Its K/V lands at position max_new at most: inside the 1 + max_new positions promised to every row at
admission, in blocks the row holds until the host frees it.

Per-row limits are uploaded once per order (when rows join or leave), in one transfer; a step then
costs a fixed number of torch and numpy calls, and Python work only for the rows that finish.

Host, per cache row slot (numpy):
    steps:   [max_rows] int64, decode steps queued for the row (its tokens generated, the late ones too)
    length:  [max_rows] int64, tokens of the row read back so far, decoder start token included
    history: [max_rows, width] int64, those tokens
    min_new, max_new: [max_rows] int64, the request's limits
    eos:     [max_rows, num_eos] int64, the request's EOS ids, padded by repeating the first
Device:
    limits:  `RowLimits` of the rows of the order; `generated` is advanced in place every step
    tokens:  [rows] int64, the last step's tokens, in the order of that step
    device_history: [max_rows, width + 1] int64 per slot, column 0 the start token; kept only when
        a logits rule reads the history (its rows then run per group of equal length, as alone)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..kv.tables import upload
from ..decode.greedy_state import pick_tokens
from .decoding import LogitsRules, RowLimits


@dataclasses.dataclass
class _Readback:
    """One queued step, whose tokens are on their way to the host.

    slots: [rows] int64, the step's order; owners: the caller's handle of each row
    discard: [rows] bool, rows that had finished at the step before (their token is dropped)
    """

    slots: np.ndarray
    owners: Sequence[Any]
    discard: Optional[np.ndarray] = None


class DecodeRows:
    """Greedy or sampling rows over the row slots of a `BatchCache`, read back one step late.

    A step is `set_order` (after rows joined or left), `next_input`, the decoder, `choose`, `collect`.
    """

    def __init__(self, max_rows: int, rules: LogitsRules, do_sample: bool, start_id: int,
                 device: torch.device) -> None:
        self.rules, self.do_sample, self.start_id, self.device = rules, do_sample, start_id, device
        self.steps = np.zeros(max_rows, dtype=np.int64)
        self.length = np.zeros(max_rows, dtype=np.int64)
        self.history = np.zeros((max_rows, 2), dtype=np.int64)
        self.min_new = np.zeros(max_rows, dtype=np.int64)
        self.max_new = np.zeros(max_rows, dtype=np.int64)
        self.eos = np.zeros((max_rows, 1), dtype=np.int64)
        self.device_history: Optional[torch.Tensor] = None
        self.slots = np.zeros(0, dtype=np.int64)  # [rows] the order of the next steps
        self.owners: Sequence[Any] = ()
        self.limits: Optional[RowLimits] = None
        self.tokens: Optional[torch.Tensor] = None
        self._order = torch.zeros(0, dtype=torch.long)  # [rows] int64, `slots` on the device
        self._input: Optional[torch.Tensor] = None  # [rows, 1] int64 on the device
        self._groups: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (positions, slots, steps) per length
        self._age = 0  # steps since `set_order`
        self._chosen: Optional[_Readback] = None  # the last step chosen
        self._pending: Optional[_Readback] = None  # the step before it, being read back
        cuda = device.type == "cuda"
        self._host = torch.zeros(max_rows, dtype=torch.long, pin_memory=cuda)  # [max_rows] read-back tokens
        self._copied = torch.cuda.Event() if cuda else None
        # per slot: (LogitsRules, do_sample) of the row's own sampling options (None: the defaults), and
        # its own torch.Generator (a seeded request's); the step's groups of rows by rules (`set_order`)
        self.sampling: list = [None] * max_rows
        self.generators: list = [None] * max_rows
        self._special: set[int] = set()  # slots whose row has its own sampling or seed
        self._sampling_groups: Optional[list] = None

    # ---- rows joining, the order ----------------------------------------------------------------
    def join(self, slot: int, min_new: int, max_new: int, eos: Sequence[int], sampling=None,
             seed: Optional[int] = None) -> None:
        """A new row in `slot` (just taken from the cache), holding only the start token.

        sampling: (LogitsRules, do_sample) of the row's own options, None for the generator's; seed: the
        row draws from its own generator seeded so (a solo generate() after torch.manual_seed(seed)).
        """
        self.sampling[slot] = sampling
        self.generators[slot] = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        if sampling is None and seed is None:
            self._special.discard(slot)
        else:
            self._special.add(slot)
        if 1 + max_new > self.history.shape[1]:
            self.history = _widen_repeating(self.history, 1 + max_new)
        if len(eos) > self.eos.shape[1]:
            self.eos = _widen_repeating(self.eos, len(eos))
        self.steps[slot], self.length[slot], self.history[slot, 0] = 0, 1, self.start_id
        self.min_new[slot], self.max_new[slot] = min_new, max_new
        self.eos[slot, : len(eos)] = eos
        self.eos[slot, len(eos) :] = eos[0]

    def set_order(self, slots: np.ndarray, owners: Sequence[Any]) -> None:
        """The rows of the next steps: slots [rows] int64; `owners[i]` is handed back when row i finishes."""
        steps = self.steps[slots]
        previous = np.zeros(len(self.steps), dtype=np.int64)  # slot -> its position in the last step
        if self._chosen is not None:
            previous[self._chosen.slots] = np.arange(len(self._chosen.slots))
        by_length = np.argsort(steps, kind="stable")
        packed = np.column_stack([
            slots, steps == 0, previous[slots], steps, self.min_new[slots], self.max_new[slots], by_length,
            self.eos[slots],
        ])
        packed = upload(torch.from_numpy(packed), self.device)  # [rows, 7 + num_eos]: one transfer
        self._order = packed[:, 0]
        self.limits = RowLimits(packed[:, 3], packed[:, 4], packed[:, 5], packed[:, 7:].contiguous())
        start = torch.full_like(self._order, self.start_id)
        if self.tokens is not None:  # rows that ran the last step continue from its tokens
            start = torch.where(packed[:, 1].bool(), start, self.tokens[packed[:, 2]])
        self._input = start[:, None]
        self.slots, self.owners, self._age, self._groups = slots, owners, 0, []
        if self.rules.needs_history:
            self._order_history(packed[:, 6], steps[by_length])
        self._sampling_groups = self._group_sampling(slots)

    def _group_sampling(self, slots: np.ndarray) -> Optional[list]:
        """None when every row samples as the generator does from the shared RNG; else, per distinct
        (rules, do_sample): (rules, do_sample, positions on the device, positions, [(position in the
        group, generator)] of its seeded rows)."""
        if not self._special:  # the common case: no host work per order
            return None
        slot_list = slots.tolist()
        if self._special.isdisjoint(slot_list):
            return None
        groups: dict[int, tuple] = {}
        for position, slot in enumerate(slot_list):
            rules, do_sample = self.sampling[slot] or (self.rules, self.do_sample)
            entry = groups.setdefault(id(rules), (rules, do_sample, [], []))
            if self.generators[slot] is not None:
                entry[3].append((len(entry[2]), self.generators[slot]))
            entry[2].append(position)
        return [(rules, do_sample, upload(torch.tensor(positions), self.device), positions, seeded)
                for rules, do_sample, positions, seeded in groups.values()]

    def _order_history(self, by_length: torch.Tensor, sorted_steps: np.ndarray) -> None:
        """The order's groups of rows of equal length, and a device history wide enough for them."""
        width = 2 + int(self.max_new[self.slots].max())  # the late step's token included
        old = self.device_history
        if old is None or width > old.shape[1]:
            width = max(width, 2 * (0 if old is None else old.shape[1]))
            self.device_history = torch.full((len(self.steps), width), self.start_id, dtype=torch.long,
                                             device=self.device)
            if old is not None:
                self.device_history[:, : old.shape[1]] = old
        bounds = (np.flatnonzero(np.diff(sorted_steps)) + 1).tolist()
        for a, b in zip([0, *bounds], [*bounds, len(sorted_steps)]):
            positions = by_length[a:b]
            self._groups.append((positions, self._order[positions], int(sorted_steps[a])))

    # ---- one step --------------------------------------------------------------------------------
    def next_input(self) -> torch.Tensor:
        """[rows, 1] int64 on the device: the next step's input ids."""
        return self._input

    def choose(self, logits: torch.Tensor) -> None:
        """The step's tokens from its logits [rows, vocab] float32, through the logits rules; they stay
        on the device as the next step's input ids. Nothing here waits for the device."""
        rules, limits = self.rules, self.limits
        if self._sampling_groups is not None:  # rows with their own sampling options or seeds
            tokens = self._choose_by_group(logits)
        elif rules.needs_history:  # HF's processors see the rows of one length together
            for positions, slots, steps in self._groups:
                history = self.device_history[slots, : 1 + steps + self._age]  # [group rows, length]
                logits[positions] = rules(history, logits[positions], limits.select(positions))
            tokens = pick_tokens(logits, self.do_sample)
        else:
            tokens = pick_tokens(rules(None, logits, limits), self.do_sample)
        if rules.needs_history:
            self.device_history[self._order, limits.generated + 1] = tokens
        limits.generated.add_(1)
        self.steps[self.slots] += 1
        self._age += 1
        self.tokens, self._input = tokens, tokens[:, None]
        self._chosen = _Readback(self.slots, self.owners)

    def _choose_by_group(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's tokens [rows] when rows sample differently: each group's rules on its rows; a
        seeded row draws alone from its own generator, as HF's `_sample` draws for one input."""
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for rules, do_sample, positions, host_positions, seeded in self._sampling_groups:
            scores = rules(None, logits[positions], self.limits.select(positions))
            chosen = pick_tokens(scores, do_sample) if len(seeded) < len(host_positions) else None
            if do_sample and seeded:
                chosen = chosen if chosen is not None else torch.empty(len(host_positions), dtype=torch.long,
                                                                      device=logits.device)
                for j, generator in seeded:
                    probs = nn.functional.softmax(scores[j : j + 1], dim=-1)
                    chosen[j] = torch.multinomial(probs, num_samples=1, generator=generator)[0, 0]
            elif chosen is None:  # greedy rows with seeds: the seed changes nothing
                chosen = pick_tokens(scores, False)
            tokens[positions] = chosen
        return tokens

    def collect(self) -> list[tuple[Any, list[int]]]:
        """Read back the step before the one just chosen (waiting for that step, not for the one queued
        after it) and queue the read-back of the step just chosen.

        Returns the rows that finished at the step read back: (owner, token ids, start token first).
        """
        pending, chosen = self._pending, self._chosen
        finished, done = [], np.zeros(0, dtype=np.int64)
        if pending is not None:
            if self._copied is not None:
                self._copied.synchronize()
            positions = self._append(pending, self._host[: len(pending.slots)].numpy())
            done = pending.slots[positions]
            finished = [(pending.owners[p], self.history[s, : self.length[s]].tolist())
                        for p, s in zip(positions.tolist(), done.tolist())]
        chosen.discard = np.isin(chosen.slots, done)  # finished a step ago: ran the chosen step late
        self._host[: len(chosen.slots)].copy_(self.tokens, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        self._pending = chosen
        return finished

    def _append(self, step: _Readback, tokens: np.ndarray) -> np.ndarray:
        """Add a read-back step's tokens [rows] to its rows; the positions (in that step) of rows that finished."""
        live = np.flatnonzero(~step.discard)
        slots, tokens = step.slots[live], tokens[live]
        columns = self.length[slots]
        self.history[slots, columns] = tokens
        self.length[slots] = columns + 1
        # HF's EosTokenCriteria and MaxLengthCriteria; `columns` is now each row's count of new tokens
        done = (self.eos[slots] == tokens[:, None]).any(axis=1) | (columns >= self.max_new[slots])
        return live[done]


def _widen_repeating(table: np.ndarray, width: int) -> np.ndarray:
    """`table` with at least `width` columns (doubling), the new ones copies of column 0."""
    new_width = max(width, 2 * table.shape[1])
    return np.concatenate([table, np.repeat(table[:, :1], new_width - table.shape[1], axis=1)], axis=1)
