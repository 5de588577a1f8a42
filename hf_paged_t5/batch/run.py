"""`BatchRun`: one `BatchGenerator` job, one step at a time: admit, encode, decode, retire.

Each `step()` holds the model's runtime lock (so a patched `generate()` from another thread waits
for the step, never for the whole job) and:
1. admits waiting requests, first come first served, while rows, the KV token budget and the pool
   allow (the pool grows if its config lets it). Admission waits until an eighth of the rows and of
   the token budget are free, so the encoder runs on batches rather than one input at a time;
2. runs the encoder over the admitted inputs, packed (varlen), in chunks sorted by length, and
   stores each source's cross-attention K/V once in freshly allocated blocks. A chunk of a few
   inputs (what a server admits between two steps) replays one CUDA graph per input instead, its
   ids padded to the next of `encoder_graphs.BUCKETS` (an eager forward of t5-large is ~12 ms of
   host launches, and the decode steps of every running request wait behind it);
3. runs one decode step (`DecodeRunner.decode`, a CUDA graph on the GPU) for every live row, each at its
   own position;
4. picks the next tokens and retires finished rows and requests, whose blocks go back to the pool.
   Greedy and sampling (`DecodeRows`) keep the tokens on the device as the next step's input and read
   them back one step late, so the host never waits for the step it has just queued: a finished row
   is found, and its blocks freed, after it has run one more step, whose token is dropped. Beam
   search (one `BeamGroup` per EOS ids: HF's beam step for every source at its own length) reads
   each step's beam choices back before the next step, since they decide which blocks the next
   step's rows hold; the partial blocks those reorders share are copied at once.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Optional

import numpy as np
import torch

from .cache import BatchCache, blocks_for
from .decoding import BeamGroup
from .rows import DecodeRows
from ..kv.block_manager import PoolExhaustedError
from ..hf import forward as hf_forward
from ..kv.pool import KVPool
from ..decode.graphs import predicted_key
from ..kv.tables import upload
from ..model import attention as attention_ops
from ..model.attention import prefill_lengths
from ..model.bias import is_local, self_attention
from ..model.encoder_graphs import bucket_of
from ..model.stacks import encoder_forward, store_cross_ahead, store_cross_packed

from .requests import BatchResult, Request

logger = logging.getLogger(__name__)

# A chunk of at most this many inputs is encoded input by input as bucket graphs (`_encode_graphed`);
# a larger one (a job's first admission) runs one eager packed forward, whose launches it shares.
GRAPH_CHUNK_INPUTS = 4


class BatchRun:
    """The state of one job: waiting and running requests, the cache, beam groups."""

    def __init__(self, generator, inputs: Iterable) -> None:  # generator: the job's BatchGenerator
        self.gen = generator
        self.inputs = enumerate(inputs)
        self.exhausted = False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.groups: list[BeamGroup] = []
        self.group_of: dict[int, list[Request]] = {}  # id(group) -> its requests, in the group's order
        self.cache: Optional[BatchCache] = None
        self.live_rows = 0
        self.promised_blocks = 0
        self.promised_tokens = 0
        self.rows: Optional[DecodeRows] = None  # greedy/sampling
        self.streaming: list[Request] = []  # running greedy / sampling requests with `on_tokens`
        self.order_dirty = True
        self.graph_fits: Optional[bool] = None

    # ---- the job's life -------------------------------------------------------------------------
    def step(self) -> Optional[list[BatchResult]]:
        """Admit, encode, decode one token per live row; the results that finished (None: job done)."""
        with self.gen.runtime.runner.owning(), torch.no_grad():
            return self._step()

    def close(self) -> None:
        """Return every block this job holds to the pool (idempotent)."""
        if self.cache is not None:
            with self.gen.runtime.runner.lock:
                self.cache.release()
        self.running.clear()
        self.groups.clear()
        self.live_rows = self.promised_blocks = self.promised_tokens = 0

    def _step(self) -> Optional[list[BatchResult]]:
        pool = self.gen.runtime.get_pool(self.gen.model.decoder)
        if self.cache is None:
            gen = self.gen
            if gen.reserve_tokens is not None:
                _reserve_budget(pool, gen.reserve_tokens, gen.max_batch_rows)
            self.cache = BatchCache(pool, gen.max_batch_rows)
            if gen.num_beams > 1:  # each input's beams consecutive in `order`: one cross-attention read
                self.cache.cross_group = gen.num_beams
            else:
                self.rows = DecodeRows(gen.max_batch_rows, gen.rules, gen.config.do_sample, gen.start_id, gen.device)
        elif self.cache.pool is not pool:
            raise RuntimeError("the model's KV pool was re-created during the batch job (device or dtype changed)")
        admitted = self._admit(pool)
        if admitted:
            self._encode(admitted, pool)
        if not self.running:
            # nothing left: the job is done; nothing yet (a source that can run dry for now): idle
            return None if self.exhausted else []
        return self._decode_step()

    def cancel(self, request: Request) -> None:
        """Stop `request` (between steps): its blocks go back to the pool within the next step and it
        gives no result. A waiting request just leaves the queue."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running and self.rows is not None:
            # greedy / sampling: the row finishes at its next read-back, by the usual retirement
            for j in request.live:
                self.rows.max_new[request.rows[j]] = 0
        # beam search: `_advance_beams` drops it at the next step

    def _next_item(self):
        """The next (index, input) of the job, or None when there is none for now; StopIteration at
        the end. A job's inputs never run dry for now; `batch.online` overrides this."""
        return next(self.inputs)

    # ---- 1. admission ---------------------------------------------------------------------------
    def _peek(self) -> Optional[Request]:
        if not self.waiting and not self.exhausted:
            try:
                entry = self._next_item()
            except StopIteration:
                self.exhausted = True
                return None
            if entry is None:
                return None
            index, item = entry
            request = item if isinstance(item, Request) else self.gen.make_request(index, item)
            bs = self.cache.block_size
            # per row: the K/V of the start token and of max_new - 1 tokens, and one more position for
            # the step a greedy/sampling row runs before the host reads that it finished (DecodeRows);
            # beam search: one block more, for a copy-on-write of a shared last block
            rows_blocks = blocks_for(1 + request.max_new, bs) + (1 if request.expand > 1 else 0)
            request.blocks = blocks_for(len(request.ids), bs) + request.expand * rows_blocks
            request.tokens = len(request.ids) + request.expand * (1 + request.max_new)
            self.waiting.append(request)
        return self.waiting[0] if self.waiting else None

    def _admit(self, pool: KVPool) -> list[Request]:
        gen = self.gen
        free_rows = gen.max_batch_rows - self.live_rows
        free_tokens = gen.max_batch_tokens - self.promised_tokens
        if self.running and (free_rows < max(1, gen.max_batch_rows // 8) or free_tokens < gen.max_batch_tokens // 8):
            return []
        admitted: list[Request] = []
        while (request := self._peek()) is not None:
            alone = not self.running
            if self.live_rows + request.expand > gen.max_batch_rows:
                break
            if not alone and self.promised_tokens + request.tokens > gen.max_batch_tokens:
                break
            # the pool must hold what every running request may still take, plus this one
            if not pool.can_reserve(self.promised_blocks - self.cache.num_held + request.blocks):
                if not alone:
                    break
                self._refuse(request, pool)  # returns only if the pool found room after all
            self.waiting.popleft()
            self.running.append(request)
            if request.on_tokens is not None and self.rows is not None:
                self.streaming.append(request)
            self.live_rows += request.expand
            self.promised_blocks += request.blocks
            self.promised_tokens += request.tokens
            admitted.append(request)
        if admitted:  # grow once for the whole round (growth re-allocates the pool)
            pool.reserve(self.promised_blocks - self.cache.num_held)
            logger.debug("admitted %d inputs: %d running, %d rows, %d KV tokens promised", len(admitted),
                         len(self.running), self.live_rows, self.promised_tokens)
        return admitted

    def _refuse(self, request: Request, pool: KVPool) -> None:
        """Raise for an input the pool cannot hold even alone, with the pool's own advice."""
        try:
            pool.reserve(request.blocks)
        except PoolExhaustedError as exc:
            raise PoolExhaustedError(
                f"input {request.index} ({len(request.ids)} tokens, up to {request.max_new} new, "
                f"{request.expand} rows) needs {request.blocks} KV blocks by itself: {exc}"
            ) from exc

    # ---- 2. encoder and cross K/V ---------------------------------------------------------------
    def _encode(self, admitted: list[Request], pool: KVPool) -> None:
        self._compile_ahead(admitted, pool)
        budget = max(self.gen.encoder_chunk_tokens, len(max(admitted, key=lambda r: len(r.ids)).ids))
        chunk: list[Request] = []
        for request in sorted(admitted, key=lambda r: -len(r.ids)):
            if chunk and (len(chunk) + 1) * len(chunk[0].ids) > budget:  # padded size of the chunk
                self._encode_chunk(chunk, pool)
                chunk = []
            chunk.append(request)
        self._encode_chunk(chunk, pool)
        gen, cache = self.gen, self.cache
        for request in admitted:
            # a row holds the start token's K/V, max_new - 1 more and the late step's (see _peek)
            request.rows = [cache.add_row(request.source, 1 + request.max_new) for _ in range(request.expand)]
            request.histories = [[] for _ in range(request.expand)]
            request.live = list(range(request.expand))
            if self.rows is not None:
                for slot in request.rows:
                    self.rows.join(slot, request.min_new, request.max_new, request.eos, request.sampling,
                                   request.seed)
        if gen.num_beams > 1:
            self._form_groups(admitted)
        self.order_dirty = True

    def _encode_chunk(self, chunk: list[Request], pool: KVPool) -> None:
        """Encoder over `chunk` (longest first), then each source's cross K/V into new blocks."""
        model, runtime = self.gen.model, self.gen.runtime
        packed = self._encode_graphed(chunk) if len(chunk) <= GRAPH_CHUNK_INPUTS else None
        if packed is None:
            packed = self._encode_eager(chunk)  # [total_tokens, d_model]
        slots = []
        for request in chunk:
            request.source, source_slots = self.cache.add_source(len(request.ids))
            slots.append(source_slots)
        slot_mapping = torch.cat(slots)  # [total_tokens] int64, source by source as packed
        store_cross_packed(model.decoder, runtime.ops_for, pool, packed, slot_mapping)

    def _encode_eager(self, chunk: list[Request]) -> torch.Tensor:
        """The packed encoder forward over `chunk`: [total_tokens, d_model], source by source."""
        model, runtime, device = self.gen.model, self.gen.runtime, self.gen.device
        encoder = model.get_encoder()
        lengths = np.array([len(r.ids) for r in chunk])
        real = np.arange(lengths[0]) < lengths[:, None]  # [n, L] bool, the real tokens, row-major as packed
        ids = np.full(real.shape, self.gen.pad_id, dtype=np.int64)
        ids[real] = np.concatenate([r.ids for r in chunk])
        ids = upload(torch.from_numpy(ids), device)
        tables = runtime.bias_tables(encoder, causal=False)
        # the mask stays on the host: the encoder then packs the tokens without reading anything back
        # from the device, so the host queues the encoder behind the decode steps instead of waiting
        # for them to finish
        return encoder_forward(encoder, runtime.ops_for, tables, None, torch.from_numpy(real), input_ids=ids,
                               packed=True, band_memos=runtime.band_memos(encoder),
                               side_tables=runtime.side_tables(encoder))

    def _compile_ahead(self, admitted: list[Request], pool: KVPool) -> None:
        """A cold process: before an admission's first chunk, the kernels of its encoder chunks,
        cross K/V stores and next decode step compile at once, none run
        (`PagedRuntime.compile_ahead`): in the compile worker processes where they are free, else on
        the pass's pool, whose compiles alone the pass waits for (the first launch of a worker's
        binary waits for that one). The encoder runs once per prefill configuration of inputs up
        to the longest admitted (`attention.prefill_lengths`; a chunk of shorter inputs launches
        another binary than the longest's), the step on static buffers of the graph key the rows
        admitted give it; what each of them compiles is requested first (one encoder layer per
        configuration, then one decoder layer of the step), so the compiles start together. Once
        per number of configurations, so a later admission of longer inputs compiles what they
        add; the pass's cuBLAS work runs for real."""
        gen, cache = self.gen, self.cache
        model, runtime, device = gen.model, gen.runtime, gen.device
        if attention_ops.compile_ahead_for(device, runtime.config.resolve_backend(device)) is None:
            return  # no pass here (the CPU, an older Triton): nothing to size, no Triton import
        encoder = model.get_encoder()
        longest = max(len(r.ids) for r in admitted)
        lengths = prefill_lengths(self_attention(encoder.block[0].layer[0]), encoder.embed_tokens.weight.dtype, longest)

        def ahead() -> None:
            rows = self.live_rows  # the rows of the next step: the running ones and these
            # (a table never narrows: the widths the cache has reached count too)
            self_tokens = max(cache.self_width * cache.block_size, max(1 + r.max_new for r in admitted))
            cross_tokens = max(cache.cross_width * cache.block_size, longest)
            key = predicted_key(cache, rows, self_tokens, cross_tokens)
            tables, side = runtime.bias_tables(encoder, causal=False), runtime.side_tables(encoder)

            def encode(length: int, blocks: Optional[int] = None) -> torch.Tensor:
                ids = torch.full((1, length), gen.pad_id, dtype=torch.long, device=device)
                return encoder_forward(encoder, runtime.ops_for, tables, None, torch.ones(1, length, dtype=torch.bool),
                                       input_ids=ids, packed=True, side_tables=side, blocks=blocks)

            # Every compile is requested before the host walks a whole stack: each configuration's
            # through one encoder layer, then the decode step's through one decoder layer (its final
            # norm and LM head after it), then the full step and forwards (the kernels only the
            # later layers reach). A full walk first would request the next binaries, the decode
            # attention's (the pass's last to finish once the prefill binary shortened), only a
            # whole stack of host work later. (`PagedRuntime.compile_ahead` runs this inside
            # `compile_in_workers`: the compiles go to the compile workers where one is free.)
            for length in lengths:
                encode(length, blocks=1)
            runtime.runner.step_ahead(model, cache, device, rows, key, first_blocks=1)
            for length in lengths:
                packed = encode(length)
            store_cross_ahead(model.decoder, runtime.ops_for, pool, packed)
            # Where the process has compile workers: the step of the fewest rows a graph serves,
            # which a job reaches as its last rows finish and whose decode launches may differ
            # (`kernels.launch.decode_config`: 64 rows over long sources), compiled there while the
            # job runs instead of stalling it then.
            with attention_ops.compile_elsewhere(device) as sending:
                ending = predicted_key(cache, cache.min_graph_rows, self_tokens, cross_tokens) if sending else None
                if ending is not None and ending[0] < key[0]:
                    runtime.runner.step_ahead(model, cache, device, rows, ending)

        runtime.compile_ahead(device, ("batch job", len(lengths)), ahead)

    def _encode_graphed(self, chunk: list[Request]) -> Optional[torch.Tensor]:
        """The packed encoder output of `chunk` from the runtime's bucket graphs, one replay per
        input (`hf.forward.bucket_forward`: its ids padded to `bucket_of` its length; a bucket's
        first call captures its graph), or None where they do not serve it: graphs off, not a CUDA
        device, an input past the longest bucket, LongT5's local attention, a module in training
        mode, or a graph refused (a hook, weights on several devices, a failed capture)."""
        gen, runtime, device = self.gen, self.gen.runtime, self.gen.device
        encoder = gen.model.get_encoder()
        buckets = [bucket_of(len(r.ids)) for r in chunk]
        if (device.type not in hf_forward.GRAPH_DEVICE_TYPES or not runtime.config.cuda_graphs or None in buckets
                or encoder.training or is_local(self_attention(encoder.block[0].layer[0]))):
            return None
        graphs, outputs = runtime.bucket_graphs, []
        for request, length in zip(chunk, buckets):
            n = len(request.ids)
            src = np.full(length + 3, gen.pad_id, dtype=np.int64)  # the ids, padded; cu_seqlens [0, n, length]
            src[:n] = request.ids
            src[length:] = (0, n, length)
            src = upload(torch.from_numpy(src), device)
            hidden = graphs.serve((length, device), encoder, src, functools.partial(self._bucket_forward, length))
            if hidden is None:
                return None
            outputs.append(hidden[:n])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _bucket_forward(self, length: int, src: torch.Tensor):
        """The capture of bucket `length` (`hf.forward.bucket_forward`; None where the bias tables
        differ from HF's), its kernels compiled at once first in a cold process."""
        runtime, device = self.gen.runtime, self.gen.device
        forward = hf_forward.bucket_forward(runtime, self.gen.model.get_encoder(), length)
        if forward is not None:
            runtime.compile_ahead(device, ("batch encoder graph", length), lambda: forward(src))
        return forward

    def _form_groups(self, admitted: list[Request]) -> None:
        """Beam search: the requests admitted join the job's `BeamGroup` of their EOS ids (a new one
        for ids no running request has). A group's step is a few dozen small launches whatever its
        size and its sources' lengths, so a job steps one group per EOS ids."""
        gen = self.gen
        by_eos: dict[tuple, list[Request]] = defaultdict(list)
        for request in admitted:
            by_eos[tuple(request.eos)].append(request)
        for eos, requests in by_eos.items():
            group = BeamGroup(gen.config, [r.min_new for r in requests], [1 + r.max_new for r in requests],
                              eos, gen.start_id, gen.pad_id, gen.device)
            joined = next((g for g in self.groups if g.eos_ids == group.eos_ids), None)
            if joined is None:
                self.groups.append(group)
                self.group_of[id(group)] = requests
            else:
                joined.extend(group)
                self.group_of[id(joined)].extend(requests)

    # ---- 3. one decode step ---------------------------------------------------------------------
    def _rebuild_order(self) -> None:
        if self.gen.num_beams > 1:
            self.cache.set_order([slot for g in self.groups for r in self.group_of[id(g)] for slot in r.rows])
        else:
            # Longest source first: the decode kernels launch rows in order, so the programs of the
            # rows with the most cross-attention keys start first and the short rows fill in behind
            # them (longest-processing-time-first) instead of a few long rows finishing last. The
            # order changes no row's result (rows are independent; a seeded row has its own RNG).
            refs = sorted(((r, j) for r in self.running for j in r.live), key=lambda ref: -len(ref[0].ids))
            self.cache.set_order([r.rows[j] for r, j in refs])
            self.rows.set_order(self.cache.order, refs)
        self.order_dirty = False

    def _decode_step(self) -> list[BatchResult]:
        gen = self.gen
        if self.order_dirty:
            self._rebuild_order()
        if gen.num_beams > 1:
            ids = torch.cat([g.next_ids() for g in self.groups]).view(-1, 1)  # [rows, 1]
        else:
            ids = self.rows.next_input()  # [rows, 1], the last step's tokens, still on the device
        fits = ids.shape[0] <= gen.runtime.config.max_graph_batch
        if fits != self.graph_fits:  # the runner decides graph use once per plan, from the row count
            gen.runtime.runner.forget(self.cache)
            self.graph_fits = fits
        self.cache.prepare_step()
        logits = gen.runtime.runner.decode(gen.model, self.cache, ids)  # [rows, 1, vocab]
        logits = logits[:, -1, :].to(copy=True, dtype=torch.float32, device=gen.device)  # as HF: a float32 copy
        if gen.num_beams > 1:
            return self._advance_beams(logits)
        return self._advance_rows(logits)

    # ---- 4. next tokens, retirement -------------------------------------------------------------
    def _advance_rows(self, logits: torch.Tensor) -> list[BatchResult]:
        """Greedy or sampling over rows at any lengths; logits [rows, vocab] float32. Retires the rows
        that finished at the step before (this step is queued by now: reading that one back waits for
        the device only until it has finished the step before)."""
        self.rows.choose(logits)
        finished = []
        for (request, j), history in self.rows.collect():
            request.histories[j] = history
            self.cache.free_row(request.rows[j])
            request.live.remove(j)
            self.live_rows -= 1
            self.order_dirty = True
            if not request.live:
                result = self._retire(request, _pad_rows(request.histories, self.gen.pad_id), None)
                if result is not None:
                    finished.append(result)
        for request in self.streaming:  # the first row's tokens read back at this step
            if request.live and request.live[0] == 0:
                slot = request.rows[0]
                self._emit(request, self.rows.history[slot, 1 + request.emitted : self.rows.length[slot]].tolist())
        return finished

    def _emit(self, request: Request, tokens: list[int]) -> None:
        if not tokens or request.cancelled:
            return
        request.emitted += len(tokens)
        try:
            request.on_tokens(tokens)
        except Exception:  # a caller's callback must not stop the job
            logger.exception("hf_paged_t5: the on_tokens callback of input %d raised", request.index)

    def _advance_beams(self, logits: torch.Tensor) -> list[BatchResult]:
        """One HF beam-search step per group; logits [rows, vocab] float32 in group order."""
        gen, offset, steps = self.gen, 0, []
        for group in self.groups:
            n = group.batch * group.num_beams
            steps.append(group.step(logits[offset : offset + n], gen.rules))
            offset += n
        # One host sync for every group's reorder indices and unfinished flags: the next step cannot be
        # queued before them, since they decide which blocks its rows read and write.
        flat = torch.cat([torch.cat([b.long(), u.long()]) for b, u in steps]).tolist() if steps else []
        finished, moves, start = [], [], 0
        for group in list(self.groups):  # the order of `steps`
            requests, k = self.group_of[id(group)], group.num_beams
            n = group.batch * k
            sources, unfinished = flat[start : start + n], flat[start + n : start + n + group.batch]
            start += n + group.batch
            keep = []
            for b, request in enumerate(requests):
                if request.cancelled:
                    for slot in request.rows:
                        self.cache.free_row(slot)
                    self.live_rows -= k
                    self._drop(request)
                elif unfinished[b]:
                    beams = [s - b * k for s in sources[b * k : (b + 1) * k]]
                    if beams != list(range(k)):  # every beam continuing itself: nothing to move
                        moves.append((request.rows, beams))
                    keep.append(b)
                else:
                    sequences, scores = group.output(b)
                    for slot in request.rows:
                        self.cache.free_row(slot)
                    self.live_rows -= k
                    finished.append(self._retire(request, sequences, scores))
            if len(keep) < len(requests):
                self.order_dirty = True
                if keep:
                    group.keep(keep)
                    self.group_of[id(group)] = [requests[b] for b in keep]
                else:
                    self.groups.remove(group)
                    del self.group_of[id(group)]
        self.cache.reorder(moves)  # (after the frees above: they leave a move's blocks alone)
        return finished

    def _retire(self, request: Request, sequences: list[list[int]], scores) -> Optional[BatchResult]:
        """The request's remaining blocks (its source) back to the pool; its result (None: cancelled)."""
        self._drop(request)
        if request.cancelled:
            return None
        if request.on_tokens is not None:  # the first sequence's tokens not sent yet (beams: all of them)
            first = request.histories[0] if self.rows is not None else _strip_padding(sequences[0], self.gen.pad_id)
            self._emit(request, first[1 + request.emitted :])
        return self.gen.result(request, sequences, scores)

    def _drop(self, request: Request) -> None:
        """A request whose rows are freed leaves the job: its source's blocks and its promises go."""
        self.cache.free_source(request.source)
        self.running.remove(request)
        if request.on_tokens is not None and request in self.streaming:
            self.streaming.remove(request)
        self.promised_blocks -= request.blocks
        self.promised_tokens -= request.tokens


def _strip_padding(tokens: list[int], pad_id: int) -> list[int]:
    """A padded output row without its trailing pad tokens (the decoder start token kept)."""
    end = len(tokens)
    while end > 1 and tokens[end - 1] == pad_id:
        end -= 1
    return tokens[:end]


def _pad_rows(histories: list[list[int]], pad_id: int) -> list[list[int]]:
    """Rows padded to one length with the pad token, as generate() pads finished rows."""
    width = max(len(h) for h in histories)
    return [h + [pad_id] * (width - len(h)) for h in histories]


def _reserve_budget(pool: KVPool, tokens: int, rows: int) -> None:
    """Grow an idle `pool` at once to hold a job's KV budget of `tokens` (plus a partly filled block
    per row and table); nothing when the pool is in use, already that large, or capped lower."""
    blocks = blocks_for(tokens, pool.block_size) + 2 * rows
    before = pool.num_blocks
    if pool.is_idle() and pool.can_reserve(blocks):
        pool.reserve(blocks)  # (nothing when that many blocks are free already)
    if pool.num_blocks == before:
        return
    logger.info("hf_paged_t5: KV pool reserved for the batch budget of %d tokens: %d blocks (%.1f GiB)",
                tokens, pool.num_blocks, pool.num_blocks * pool.bytes_per_block() / 2**30)

