"""Decode-step CUDA graphs: embedding -> every decoder layer -> final norm -> lm_head, replayed.

One graph per (batch bucket, self-table width bucket, cross-table width bucket, rows per
source), captured lazily and reused across `generate()` calls. Rows past the real batch are padding: their
tables point at the pool's scratch block, so they never touch a live sequence. Inputs are
copied into static buffers before each replay; nothing in the replayed step syncs with the host.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Optional

import torch
from torch import nn

from .late_flag import LateFlag
from ..kv.pool import KVPool, StepMetadata
from ..model.attention import run_compiled_ahead
from ..model.encoder_graphs import capture
from ..model.stacks import weight_devices

logger = logging.getLogger(__name__)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def graph_key(cache, rows: int, tables, capture: bool = True) -> tuple[int, int, int, int]:
    """(rows served, self-table width, cross-table width, rows per source) of the static step for
    `rows` rows of `cache` with its `host_tables()`: a graph serves a power-of-two bucket of batch
    sizes, at least the cache's `min_graph_rows`; eager buffers need no padded rows. Rows per
    source: the cache's `cross_group` (`StepMetadata.cross_group`); the padded rows after the
    real ones make groups of their own, over the scratch block."""
    rows_key = bucket(rows, cache.min_graph_rows) if capture else rows
    return rows_key, bucket(tables[0].shape[1], 4), bucket(tables[2].shape[1], 4), cache.cross_group


def predicted_key(cache, rows: int, self_tokens: int, cross_tokens: int,
                  cross_group: Optional[int] = None) -> tuple[int, int, int, int]:
    """`graph_key` of a step of `rows` rows of `cache` before its tables exist: the self table as
    wide as `self_tokens` need, the cross table as wide as the longest source's `cross_tokens`
    real tokens need (a generate() cache: its rows, their owned width, before the cross K/V are
    stored; a batch job: the rows after an admission, its decoder lengths and longest input);
    rows per source the cache's unless `cross_group` is given (another call's step, compiled ahead)."""
    def blocks(tokens: int) -> int:
        return -(-max(tokens, 1) // cache.pool.block_size)

    group = cache.cross_group if cross_group is None else cross_group
    return bucket(rows, cache.min_graph_rows), bucket(blocks(self_tokens), 4), bucket(blocks(cross_tokens), 4), group


@dataclasses.dataclass
class _StaticStep:
    """Static buffers of one captured graph.

    input_ids: [batch, 1] int64 on the device
    packed: [4 * lane + batch * (self_width + cross_width)] int32 on the device (lane: `_lane`);
        `meta`'s tensors are views of it: slot_mapping [batch], self_seq_lens [batch] and
        cross_seq_lens [batch] each at the start of a lane, self_block_table [batch, self_width],
        cross_block_table [batch, cross_width] after the fourth (spare) lane: every view 16-byte aligned
    host: pinned CPU twin of `packed`, filled on the host and copied with one transfer
    copied: event recorded after that transfer; the host waits on it before refilling (None on CPU)
    graph: the captured step, or None for buffers that `DecodeGraphs.replay` runs eagerly
    logits: [batch, 1, vocab]
    """

    input_ids: torch.Tensor
    packed: torch.Tensor
    host: torch.Tensor
    copied: Optional[torch.cuda.Event]
    meta: StepMetadata
    graph: Optional[torch.cuda.CUDAGraph]
    logits: Optional[torch.Tensor]


def _lane(batch: int) -> int:
    """Elements per per-row region of `_StaticStep.packed`: `batch` rounded up to 4 int32, so every
    view starts 16-byte aligned. Triton specializes pointer arguments on 16-byte alignment: a
    1-row step's seq_lens at a 4-byte offset would be another binary than a 16-row step's."""
    return -(-batch // 4) * 4


def _views(packed: torch.Tensor, batch: int, self_width: int, cross_width: int) -> list[torch.Tensor]:
    """slot_mapping, self_seq_lens, cross_seq_lens, self_block_table, cross_block_table of `packed`."""
    lane = _lane(batch)
    slot, self_lens, cross_lens = (packed[i * lane : i * lane + batch] for i in range(3))
    start = 4 * lane
    self_table = packed[start : start + batch * self_width].view(batch, self_width)
    start += batch * self_width
    cross_table = packed[start : start + batch * cross_width].view(batch, cross_width)
    return [slot, self_lens, cross_lens, self_table, cross_table]


# Captured loop updates `DecodeGraphs.keep_update` holds at most (each keeps its graph's memory:
# the float32 scores of its batch, 2 MiB at 16 rows of a 32K vocabulary).
MAX_KEPT_UPDATES = 4


class DecodeGraphs:
    """Captured decode steps of one patched model."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, _StaticStep] = {}
        self._mempool = None
        self._pool_generation: tuple = ()
        # captured loop updates kept across calls (`keep_update`), most recently used last
        self._updates: collections.OrderedDict = collections.OrderedDict()
        self.captures = 0  # graphs captured into this object's keeping, ever (decode steps, kept updates)
        self.streams = Streams()

    @property
    def num_steps(self) -> int:
        """Decode steps captured and kept now (one per graph key)."""
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every captured step, and with them their memory pool: a pool handle whose graphs
        are all gone is released by PyTorch's allocator and must not be captured into again."""
        self._graphs.clear()
        self._updates.clear()
        self._mempool = None

    def cached_update(self, static: _StaticStep, key: Optional[tuple]):
        """The loop update kept for `static` under `key` (`keep_update`), or None."""
        if key is None:
            return None
        entry = self._updates.get((id(static), key))
        if entry is None or entry[0] is not static:
            return None
        self._updates.move_to_end((id(static), key))
        return entry[1]

    def keep_update(self, static: _StaticStep, key: tuple, state) -> None:
        """Keep a captured loop update (its graph reads `static`'s buffers and the state's own
        tensors, which a later call refills) for later calls; at most `MAX_KEPT_UPDATES`, least
        recently used dropped first. They go with the decode graphs (`clear`)."""
        self._updates[(id(static), key)] = (static, state)
        self.captures += 1
        while len(self._updates) > MAX_KEPT_UPDATES:
            self._updates.popitem(last=False)

    def run(
        self,
        step_fn: Callable[[torch.Tensor, Callable[[torch.device], StepMetadata]], torch.Tensor],
        cache,
        input_ids: torch.Tensor,
        device: torch.device,
    ) -> torch.Tensor:
        """One decode step for `input_ids` [rows, 1] through a graph; returns logits [rows, 1, vocab].

        step_fn(input_ids, meta_for) -> logits runs the whole step on given metadata.
        """
        rows = input_ids.shape[0]
        slots = cache.begin_step(1)  # may grow the pool (a cache that allocates per step)
        static = self.prepare(step_fn, cache, rows, device, slots)
        static.input_ids[:rows].copy_(input_ids)
        self.replay(static, step_fn)
        return static.logits[:rows].clone()

    def prepare(self, step_fn, cache, rows: int, device: torch.device, slots,
                capture: bool = True, logits_like=None) -> _StaticStep:
        """The static step serving `rows` rows of `cache`, its buffers filled from the cache's tables.

        slots: [rows] the step's slot mapping (host), or None where the caller writes it on the
        device (`greedy_graph`); then the self lengths are left for the caller too.
        capture: a CUDA graph (captured once per bucket); else buffers of the same layout that
        `replay` runs `step_fn` on eagerly (logits [bucket, 1, vocab] shaped like `logits_like`).
        """
        pool = cache.pool
        if (id(pool), pool.generation) != self._pool_generation:
            self.clear()  # a new or re-allocated pool: captured addresses are stale
            self._pool_generation = (id(pool), pool.generation)
        tables = cache.host_tables()
        key = graph_key(cache, rows, tables, capture)
        if capture:
            static = self._graphs.get(key)
            if static is None:
                static = self._capture(step_fn, pool, key, device)
                if static.graph is not None:  # else a failed capture: eager this call, captured again next time
                    self._graphs[key] = static
                    self.captures += 1
        else:
            static = self._buffers(pool, key, device)
            static.logits = logits_like.new_empty((key[0], 1, logits_like.shape[-1]))
        if slots is None:
            slots = torch.full((rows,), pool.scratch_block * pool.block_size, dtype=torch.int32)
        self._fill(static, pool, key, rows, slots, tables)
        device_table = cache.device_self_table()
        if device_table is not None:  # beams reordered on the device: the host table is stale
            static.meta.self_block_table[:rows, : device_table.shape[1]].copy_(device_table)
        return static

    def run_ahead(self, step_fn, pool: KVPool, key: tuple, device: torch.device,
                  first_blocks: Optional[int] = None) -> None:
        """`step_fn` once on new static buffers of graph key `key` (`predicted_key`), where no
        graph of that key exists: inside a compile-only pass its kernels compile; nothing is kept.
        `first_blocks`: `step_fn(..., blocks=first_blocks)` first, on the same buffers."""
        if key in self._graphs:
            return
        static = self._buffers(pool, key, device)
        meta_for = lambda _device: static.meta  # noqa: E731
        if first_blocks is not None:
            step_fn(static.input_ids, meta_for, blocks=first_blocks)
        step_fn(static.input_ids, meta_for)

    @staticmethod
    def replay(static: _StaticStep, step_fn) -> None:
        """Run the step on the static buffers: the graph, or `step_fn` eagerly (see `prepare`)."""
        if static.graph is not None:
            static.graph.replay()
        else:
            static.logits.copy_(step_fn(static.input_ids, lambda _device: static.meta))

    @staticmethod
    def _fill(static: _StaticStep, pool: KVPool, key: tuple, rows: int, slots, tables) -> None:
        if static.copied is not None:
            static.copied.synchronize()  # the previous transfer out of `host` has finished
        self_table, self_lens, cross_table, cross_lens = (t.numpy() for t in tables)
        # numpy views of the pinned buffer: a few microseconds for what torch ops take ~50 for
        slot, s_lens, c_lens, s_table, c_table = (v.numpy() for v in _views(static.host, *key[:3]))
        # Padded rows (a bucket larger than the batch) write and read only the scratch block.
        slot[rows:] = pool.scratch_block * pool.block_size
        s_lens[rows:] = c_lens[rows:] = 1
        s_table[rows:] = c_table[rows:] = pool.scratch_block
        slot[:rows] = slots.numpy()
        s_lens[:rows] = self_lens
        c_lens[:rows] = cross_lens
        s_table[:rows, : self_table.shape[1]] = self_table
        c_table[:rows, : cross_table.shape[1]] = cross_table
        static.packed.copy_(static.host, non_blocking=True)
        if static.copied is not None:
            static.copied.record()

    @staticmethod
    def _buffers(pool: KVPool, key: tuple, device) -> _StaticStep:
        """A step's static buffers (no graph, no logits yet), every row on the scratch block."""
        batch, self_width, cross_width, cross_group = key
        size = 4 * _lane(batch) + batch * (self_width + cross_width)
        pin = torch.device(device).type == "cuda"
        host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        slot, s_lens, c_lens, s_table, c_table = _views(host, *key[:3])
        slot.fill_(pool.scratch_block * pool.block_size)
        s_lens.fill_(1)
        c_lens.fill_(1)
        s_table.fill_(pool.scratch_block)
        c_table.fill_(pool.scratch_block)
        packed = host.to(device, copy=True)
        slot, s_lens, c_lens, s_table, c_table = _views(packed, *key[:3])
        heads = max(cache.shape[2] for cache in pool.key_caches)
        meta = StepMetadata(
            num_new=1, slot_mapping=slot, self_block_table=s_table, self_seq_lens=s_lens,
            cross_block_table=c_table, cross_seq_lens=c_lens,
            tickets=torch.zeros(batch * heads, dtype=torch.int32, device=device), cross_group=cross_group,
        )
        static_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        copied = torch.cuda.Event() if pin else None
        if copied is not None:
            copied.record()
        return _StaticStep(static_ids, packed, host, copied, meta, None, None)

    def _capture(self, step_fn, pool: KVPool, key: tuple, device) -> _StaticStep:
        logger.info("capturing a decode CUDA graph: batch %d, self width %d, cross width %d, %d rows per source",
                    *key)
        static = self._buffers(pool, key, device)
        static_ids, meta = static.input_ids, static.meta
        meta_for = lambda _device: meta  # noqa: E731  (one device: checked by the caller)
        side = self.streams.generation(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _compile_step_ahead(step_fn, static_ids, meta_for, device)
            # one warm-up outside the capture: Triton's binaries load (and compile, where the pass
            # above could not run), cuBLAS picks its algorithms
            warm = step_fn(static_ids, meta_for)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # captured on the generation stream: each stream cuBLAS runs on keeps a workspace of its
        # own (32 MiB on an H200)
        try:
            logits = capture(graph, lambda: step_fn(static_ids, meta_for), side, self._mempool)
        except RuntimeError as exc:
            # A capture that fails leaves PyTorch's allocator recording into its pool: later
            # captures take a new pool. This step runs eagerly on the same buffers (same values).
            self._mempool = None
            torch.cuda.synchronize(device)
            logger.warning("hf_paged_t5: a decode step could not be captured as a CUDA graph (%s); "
                           "running it eagerly", exc)
            static.logits = torch.empty_like(warm)
            return static
        static.graph, static.logits = graph, logits
        return static


# Decoder layers a capture's compile-only walk goes through (`_compile_step_ahead`): every layer
# launches the same kernels at the same shapes and alignments, except that the op-by-op step's first
# norm adds no residual (the final norm after the walk's last layer does); a second layer is margin.
AHEAD_BLOCKS = 2


def _compile_step_ahead(step_fn, static_ids: torch.Tensor, meta_for, device) -> None:
    """The step through its first `AHEAD_BLOCKS` decoder layers, the final norm and the LM head,
    once, with its kernels compiled at once on a pool and none run (`kernels/ahead.py`): a cold
    process's first capture at a shape compiles them together, not one after another, and a
    capture whose binaries are all loaded spends two layers of host work here, not a stack's.
    Nothing is written (no kernel runs; the static rows point at the scratch block anyway) and the
    output is dropped; a failure is the warm-up's to raise, so it is only logged here. (A binary
    only a later layer reached would compile in the warm-up that follows, the same result.)"""
    # graphs run the Triton backend
    run_compiled_ahead(torch.device(device), "triton", lambda: step_fn(static_ids, meta_for, blocks=AHEAD_BLOCKS),
                       "a decode step")


def capture_update(update: Callable[[], None], state: list[torch.Tensor], side: torch.cuda.Stream,
                   warmup: Optional[Callable[[], None]] = None) -> torch.cuda.CUDAGraph:
    """Record `update` (in-place work on static tensors, no host sync) as a CUDA graph, after one
    warm-up run (`warmup`, default `update`) on the side stream whose effect on `state` (every
    tensor it changes) is undone; the capture itself runs nothing. side: the update stream
    (`Streams.update`) of the tensors' device.

    (`encoder_graphs.capture`: these captures happen once per generate() call.)
    """
    saved = [t.clone() for t in state]
    device = side.device
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        (warmup or update)()
    torch.cuda.current_stream(device).wait_stream(side)
    for t, s in zip(state, saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream(device))
    capture(graph, update, side)
    torch.cuda.current_stream(device).wait_stream(side)
    return graph


class ResidentLoop:
    """What the device-resident decode loops (`greedy_graph`, `beam_graph.resident_beam_loop`)
    share: the prefill, the decode step's static buffers for this call, the capture of the loop's
    update, and queuing a step while reading a device flag one step late.

    logits: the prefill's [rows, prompt_len, vocab]; static: the decode step's buffers
    (`DecodeGraphs.prepare`), its logits buffer holding the prefill's last logits.
    """

    def __init__(self, graphs: DecodeGraphs, step_fn, cache, prefill, input_ids,
                 capture: bool) -> None:
        self.logits = prefill(input_ids)
        rows, self.device = input_ids.shape[0], input_ids.device
        self.cuda = self.device.type == "cuda"
        self.capture = capture and self.cuda
        self.graphs, self.step_fn, self.cache = graphs, step_fn, cache
        self.static = graphs.prepare(step_fn, cache, rows, self.device, slots=None, capture=self.capture,
                                     logits_like=self.logits)
        self.static.logits[:rows].copy_(self.logits[:, -1:])
        # Both loops' flags are copied on the update stream, off the decode steps' stream: the beam
        # loop queues only the decode step after the copy (its bookkeeping, which writes the flag,
        # is queued once the host has read it), and the greedy loop's flag is set once
        side = graphs.streams.update(self.device) if self.cuda else None
        self._late = LateFlag(self.device, side=side)
        self._late_side = LateFlag(self.device, dtype=torch.int64, side=side)

    def capture_update(self, state, what: str) -> None:
        """`state.capture()` when capturing; a failed capture leaves the update eager (slower, same values)."""
        if not self.capture:
            return
        try:
            state.capture(self.graphs.streams.update(self.device))
        except RuntimeError as exc:
            logger.warning("hf_paged_t5: %s could not be captured as a CUDA graph (%s); running it eagerly",
                           what, exc)
            torch.cuda.synchronize(self.device)

    def next_step(self, flag: torch.Tensor, stop_on: bool) -> bool:
        """Queue the next decode step and return whether the loop stops: the device bool `flag`
        held `stop_on` before it. On CUDA it is read after the step is queued, so the GPU never
        waits for the host; a step queued after the last one is dropped by the caller (its K/V
        lands in the call's own blocks, freed by `release`). The copy runs on the update stream:
        nothing the step queues may write `flag` (the beam loop queues its bookkeeping after the
        read). On the CPU nothing is queued once the loop stops (`late_flag.LateFlag`)."""
        return self._late.queue_unless(flag, stop_on, self._queue_step)[0]

    def next_step_read(self, done_at: torch.Tensor, then: Callable[[], None]) -> int:
        """Queue the next decode step and `then` unless `done_at` (a 0-d int64 set once, from -1
        to the column after which every row had finished) is set, and return its value. On CUDA the
        copy runs on the update stream and is read after the step is queued: the value is the
        state before that step or after it, either exact about where the sequences end; a step
        queued past that column is dropped by the caller."""

        def queue():
            self._queue_step()
            then()

        return int(self._late_side.read_late(done_at, lambda v: v >= 0, queue)[0])

    def _queue_step(self) -> None:
        self.cache.advance(1)
        self.graphs.replay(self.static, self.step_fn)


class Streams:
    """The CUDA streams of one patched model's paged calls, one of each kind per device.

    - generation(device): the stream a patched generate() runs on and decode graphs are warmed
      up and captured on: cuBLAS keeps a workspace (32 MiB on an H200) for every stream it has run
      on, so running the eager parts (encoder, prefill) on another stream than the graphs' would
      hold two.
    - update(device): the stream `capture_update` records on, not the decode graphs': these graphs
      die with their generate() call (or, kept by `DecodeGraphs.keep_update`, before the decode
      graphs they read), and PyTorch may drop the cuBLAS workspace of a graph's capture stream
      when the graph is destroyed (pytorch/pytorch#193402) while the decode graphs captured on
      that stream still use it. The updates run no cuBLAS, so this stream has none.
    """

    def __init__(self) -> None:
        self._generation: dict[torch.device, torch.cuda.Stream] = {}
        self._update: dict[torch.device, torch.cuda.Stream] = {}

    def generation(self, device: torch.device) -> torch.cuda.Stream:
        return self._get(self._generation, device)

    def update(self, device: torch.device) -> torch.cuda.Stream:
        return self._get(self._update, device)

    @staticmethod
    def _get(streams: dict, device) -> torch.cuda.Stream:
        device = torch.device(device)
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]


def graphable(decoder: nn.Module) -> bool:
    """The decode step can be captured: every decoder weight on one CUDA device."""
    devices = weight_devices(decoder)
    return len(devices) == 1 and next(iter(devices)).type == "cuda"
