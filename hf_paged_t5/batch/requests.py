"""The batch engine's records: `BatchRequest` (one input with its own limits), `BatchResult`
(what `generate()` returns for one input alone) and `Request` (one input in flight)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import torch


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """One input with its own limits (None: the generator's).

    inputs: a text or token ids [seq_len]
    """

    inputs: Union[str, Sequence[int], torch.Tensor]
    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = None
    # sampling of this input (greedy / sampling generators only; None: the generator's): with a
    # `seed`, its draws are those of generate() on this input alone after torch.manual_seed(seed)
    do_sample: Optional[bool] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What `generate()` returns for one input alone.

    index: the input's position in the stream
    sequences: num_return_sequences rows of token ids, decoder start token first, padded to one
        length as `generate()` pads them
    texts: the rows decoded with `skip_special_tokens=True` (None without a tokenizer)
    scores: beam search's `sequences_scores` (None otherwise)
    num_input_tokens: encoder tokens of the input
    """

    index: int
    sequences: list[list[int]]
    texts: Optional[list[str]]
    scores: Optional[list[float]]
    num_input_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.sequences[0]

    @property
    def text(self) -> Optional[str]:
        return None if self.texts is None else self.texts[0]

    @property
    def num_new_tokens(self) -> int:
        """Tokens generated for the first sequence (after the decoder start token)."""
        return len(self.sequences[0]) - 1


@dataclasses.dataclass(eq=False)  # identity: the engine finds requests in its lists by identity
class Request:
    """One input in flight (internal): its tokens, limits, cost and place in the cache."""

    index: int
    ids: list[int]
    max_new: int
    min_new: int
    eos: tuple[int, ...]
    expand: int  # decoder rows: num_beams, or num_return_sequences when sampling
    blocks: int = 0  # pool blocks promised at admission (worst case)
    tokens: int = 0  # KV tokens promised at admission (worst case)
    source: int = -1  # cache source slot
    rows: list[int] = dataclasses.field(default_factory=list)  # cache row slots, one per decoder row
    histories: list[list[int]] = dataclasses.field(default_factory=list)  # greedy/sampling: finished rows
    live: list[int] = dataclasses.field(default_factory=list)  # greedy/sampling: positions of unfinished rows
    cancelled: bool = False  # stopped by `BatchRun.cancel`: its blocks go back, it gives no result
    # called with each batch of new token ids of the first sequence as they are read back (greedy and
    # sampling: every step, one step late; beam search: once, at the end); `emitted` counts them
    on_tokens: Optional[Callable[[list[int]], None]] = None
    emitted: int = 0
    sampling: Any = None  # (LogitsRules, do_sample) of its own sampling options, None: the generator's
    seed: Optional[int] = None
