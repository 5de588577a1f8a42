"""Decode-step CUDA graphs: embedding -> every decoder layer -> final norm -> lm_head, replayed.

One graph per (batch bucket, self-table width bucket, cross-table width bucket), captured
lazily and reused across `generate()` calls. Rows past the real batch are padding: their
tables point at the pool's scratch block, so they never touch a live sequence. Inputs are
copied into static buffers before each replay; nothing in the replayed step syncs with the host.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from torch import nn

from .cache import KVPool, PagedEncoderDecoderCache, StepMetadata

logger = logging.getLogger(__name__)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class _StaticStep:
    """Static input/output buffers of one captured graph (all on the decoder's device).

    input_ids: [batch, 1] int64; slot_mapping: [batch] int64
    self_block_table: [batch, self_width] int32; self_seq_lens: [batch] int32
    cross_block_table: [batch, cross_width] int32; cross_seq_lens: [batch] int32
    logits: [batch, 1, vocab]
    """

    input_ids: torch.Tensor
    meta: StepMetadata
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class DecodeGraphs:
    """Captured decode steps of one patched model."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, _StaticStep] = {}
        self._mempool = None
        self._pool_generation = -1

    def clear(self) -> None:
        self._graphs.clear()

    def run(
        self,
        step_fn: Callable[[torch.Tensor, Callable[[torch.device], StepMetadata]], torch.Tensor],
        cache: PagedEncoderDecoderCache,
        input_ids: torch.Tensor,
        device: torch.device,
    ) -> torch.Tensor:
        """One decode step for `input_ids` [rows, 1] through a graph; returns logits [rows, 1, vocab].

        step_fn(input_ids, meta_for) -> logits runs the whole step on given metadata.
        """
        pool = cache.pool
        if pool.generation != self._pool_generation:
            self._graphs.clear()  # the pool moved: captured addresses are stale
            self._pool_generation = pool.generation
        rows = input_ids.shape[0]
        slots = cache.begin_step(1)
        tables = cache.host_tables()
        key = (bucket(rows), bucket(tables[0].shape[1], 4), bucket(tables[2].shape[1], 4))
        static = self._graphs.get(key)
        if static is None:
            static = self._capture(step_fn, pool, key, input_ids, device)
            self._graphs[key] = static
        self._fill(static, pool, rows, input_ids, slots, tables)
        static.graph.replay()
        return static.logits[:rows].clone()

    @staticmethod
    def _fill(static: _StaticStep, pool: KVPool, rows: int, input_ids, slots, tables) -> None:
        batch = static.input_ids.shape[0]
        self_table, self_lens, cross_table, cross_lens = tables
        ids = torch.zeros(batch, 1, dtype=torch.long)
        slot = torch.full((batch,), pool.scratch_block * pool.block_size, dtype=torch.long)
        slot[:rows] = slots
        st = torch.full(tuple(static.meta.self_block_table.shape), pool.scratch_block, dtype=torch.int32)
        st[:rows, : self_table.shape[1]] = self_table
        sl = torch.ones(batch, dtype=torch.int32)
        sl[:rows] = self_lens
        ct = torch.full(tuple(static.meta.cross_block_table.shape), pool.scratch_block, dtype=torch.int32)
        ct[:rows, : cross_table.shape[1]] = cross_table
        cl = torch.ones(batch, dtype=torch.int32)
        cl[:rows] = cross_lens
        static.input_ids[:rows].copy_(input_ids, non_blocking=True)
        static.input_ids[rows:].copy_(ids[rows:], non_blocking=True)
        for dst, src in (
            (static.meta.slot_mapping, slot), (static.meta.self_block_table, st), (static.meta.self_seq_lens, sl),
            (static.meta.cross_block_table, ct), (static.meta.cross_seq_lens, cl),
        ):
            dst.copy_(src, non_blocking=True)

    def _capture(self, step_fn, pool: KVPool, key: tuple, input_ids: torch.Tensor, device) -> _StaticStep:
        batch, self_width, cross_width = key
        logger.info("capturing a decode CUDA graph: batch %d, self width %d, cross width %d", *key)
        scratch = pool.scratch_block
        meta = StepMetadata(
            num_new=1,
            slot_mapping=torch.full((batch,), scratch * pool.block_size, dtype=torch.long, device=device),
            self_block_table=torch.full((batch, self_width), scratch, dtype=torch.int32, device=device),
            self_seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
            cross_block_table=torch.full((batch, cross_width), scratch, dtype=torch.int32, device=device),
            cross_seq_lens=torch.ones(batch, dtype=torch.int32, device=device),
        )
        static_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        meta_for = lambda _device: meta  # noqa: E731  (one device: checked by the caller)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms, outside the capture
                step_fn(static_ids, meta_for)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = step_fn(static_ids, meta_for)
        return _StaticStep(static_ids, meta, graph, logits)


def graphable(decoder: nn.Module) -> bool:
    """The decode step can be captured: every decoder weight on one CUDA device."""
    devices = {p.device for p in decoder.parameters()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"
