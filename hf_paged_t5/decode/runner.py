"""The decode runner: one per patched model, used by `generate()` and the batch engine alike.

It owns what every decode step shares: the captured decode graphs and their streams
(`graphs.DecodeGraphs`), the lock that serializes paged calls on the model's pool, and the
owner (the thread inside a paged call, whose nested calls must neither wait on the lock nor
take blocks promised to it). `decode(model, cache, ids)` runs one step over a cache, as a
replayed CUDA graph where the call's plan allows it, eagerly otherwise.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from ..model.attention import project
from ..model.stacks import decoder_layers, module_device
from .graphs import DecodeGraphs, graphable


class DecodePlan:
    """How one cache's decode steps run, fixed for the cache's life (or until `forget`).

    step(input_ids, meta_for) -> logits [rows, num_new, vocab]: the decoder stack and lm_head on
    prepared step metadata (`DecodeGraphs`' contract); use_graph: single-token steps replay a
    captured graph.
    """

    def __init__(self, step: Callable, use_graph: bool) -> None:
        self.step, self.use_graph = step, use_graph


class DecodeRunner:
    """Decode steps of one patched model (see the module docstring).

    config: the model's `PagedCacheConfig`; ops_for(device) -> the kernel namespace of a layer;
    bias_tables(stack, causal) -> each layer's bias table; output_scale: what the model's forward
    multiplies the decoder output by before lm_head, or None.
    """

    def __init__(self, config, ops_for: Callable, bias_tables: Callable, output_scale: Optional[float]) -> None:
        self.config, self.ops_for, self.bias_tables, self.output_scale = config, ops_for, bias_tables, output_scale
        self.graphs = DecodeGraphs()
        self.lock = threading.Lock()
        self.owner: Optional[int] = None
        # The devices of the model's weights, read once per paged call (set with `owner`): walking
        # every parameter costs ~1 ms of host time per walk on a large model.
        self.call_devices: Optional[frozenset] = None
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> DecodePlan

    # ---- ownership ---------------------------------------------------------------------
    @contextlib.contextmanager
    def owning(self, devices: Optional[frozenset] = None):
        """Hold the lock for one paged call (a generate() or one batch step) and mark this thread
        its owner; `devices`: the model's weight devices, when the caller read them."""
        with self.lock:
            self.owner, self.call_devices = threading.get_ident(), devices
            try:
                yield
            finally:
                self.owner = self.call_devices = None

    def owned_here(self) -> bool:
        """Whether this thread is inside a paged call of this model."""
        return self.owner == threading.get_ident()

    # ---- steps -------------------------------------------------------------------------
    def plan(self, model: nn.Module, cache, device: torch.device, rows: int) -> DecodePlan:
        """The cache's `DecodePlan`, built at its first step: bias tables, output scale, graph use."""
        plan = self._plans.get(cache)
        if plan is None:
            plan = self._plans[cache] = self._build_plan(model, cache, device, rows)
        return plan

    def step_ahead(self, model: nn.Module, cache, device: torch.device, rows: int, key: tuple,
                   first_blocks: Optional[int] = None) -> None:
        """The first decode step of a call or job about to start (its plan for `rows` rows, a
        static step of graph key `key`, the one its first step will have: `graphs.predicted_key`)
        run once, for a compile-only pass (`kernels/ahead.py`) that also holds its encoder's
        launches: both passes' kernels then compile at once. `first_blocks`: the step walked
        through its first `first_blocks` decoder layers (then the final norm and the LM head)
        before the whole step, on the same buffers: each kernel the step launches is requested
        without the host work of every layer. Where the plan replays no graph, nothing."""
        plan = self.plan(model, cache, device, rows)
        if plan.use_graph:
            self.graphs.run_ahead(plan.step, cache.pool, key, device, first_blocks)

    def forget(self, cache) -> None:
        """Drop the cache's plan: its next step builds one again (e.g. its row count moved past
        what graphs serve)."""
        self._plans.pop(cache, None)

    def decode(self, model: nn.Module, cache, ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, num_new, vocab] of the new decoder tokens ids [rows, num_new]; a captured
        graph serves single tokens where the plan allows it."""
        plan = self.plan(model, cache, ids.device, ids.shape[0])
        if plan.use_graph and ids.shape[1] == 1:
            return self.graphs.run(plan.step, cache, ids, ids.device)
        slots = cache.begin_step(ids.shape[1])
        metas: dict[torch.device, object] = {}

        def meta_for(dev):
            if dev not in metas:
                metas[dev] = cache.metadata(slots, ids.shape[1], dev)
            return metas[dev]

        return plan.step(ids, meta_for)

    def _build_plan(self, model: nn.Module, cache, device: torch.device, rows: int) -> DecodePlan:
        config = self.config
        devices = self.call_devices
        use_graph = (
            config.cuda_graphs
            and rows <= config.max_graph_batch
            and (_one_cuda_device(devices) if devices is not None else graphable(model))
            and config.resolve_backend(device) == "triton"
        )
        scale, ops_for = self.output_scale, self.ops_for
        tables = self.bias_tables(model.decoder, causal=True)
        pool = cache.pool  # not `cache` itself: the plans are keyed by the cache, weakly
        # A cache whose cross K/V are written once (a generate() call) lets the CPU backend read
        # them gathered once (`cpu_ops.DecodeState`); a batch job's cache admits new sources
        # between steps (`cross_written_once` False).
        state = None
        if getattr(cache, "cross_written_once", False) and all(
            config.resolve_backend(module_device(block)) == "cpu" for block in model.decoder.block
        ):
            from ..cpu_ops import DecodeState

            state = DecodeState()

        # Whether the fused layer serves a step, per input shape, decided once for the plan's life
        # (a call, or a batch job): hooks or dropout changed in the middle of a call are not seen.
        fused_served = {} if config.fused_decode else None

        def step(input_ids, meta_for, blocks=None):
            hidden = decoder_layers(model.decoder, ops_for, tables, pool, meta_for, input_ids, state,
                                    fused_served=fused_served, blocks=blocks)
            if scale is not None:
                hidden = hidden * scale
            head_device = module_device(model.lm_head)
            return project(ops_for(head_device), model.lm_head, hidden.to(head_device))

        return DecodePlan(step, use_graph)


def _one_cuda_device(devices: frozenset) -> bool:
    return len(devices) == 1 and next(iter(devices)).type == "cuda"
