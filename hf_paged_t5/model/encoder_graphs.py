"""Encoder forwards replayed as CUDA graphs: one per input shape that recurs.

A text encoder in a diffusion pipeline (T5 v1.1 XXL in Flux / SD3 / PixArt, UMT5-XXL in Wan) runs
one small batch of one shape per image: a few milliseconds of GPU work behind tens of
milliseconds of host-side launches. The second call of a shape captures the whole encoder
forward (`stacks.encoder_forward`) as a graph; later calls of that shape copy their input into
the graph's static buffer and replay it. A shape seen once runs eagerly (no capture cost for a
shape that never comes back).

What a graph reads by address must not move: the owner passes a `signature` of the weights
(their storages, dtypes and the hooks on the encoder's modules) with every call, and a changed
signature drops every graph; so does `clear()` (the owner's bias tables were rebuilt).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Callable, Hashable, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Batch x length up to which an encoder forward is replayed as a graph: past it the forward's
# GPU work dwarfs its launches (t5-large 32 x 512 is GPU-bound), and a graph's memory grows with it.
MAX_GRAPH_TOKENS = 8192
# Shapes whose graphs are kept at once, least recently used dropped first.
MAX_GRAPHS = 8
# Calls of a shape before it is captured (the first runs eagerly, the second captures).
CAPTURE_AFTER = 2
CAPTURE_MODE = "thread_local"  # another thread's GPU work does not invalidate a capture (decode/graphs.py)


def weights_signature(stack: nn.Module) -> tuple:
    """What an encoder graph depends on besides its input: (whether any module has hooks (a hook
    runs once at capture, never at replay), each weight's (storage, dtype, device))."""
    hooked = bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in stack.modules())
    return hooked, tuple((p.data_ptr(), p.dtype, p.device) for p in stack.parameters())


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    source: torch.Tensor  # static input (input_ids or inputs_embeds)
    out: torch.Tensor  # static last_hidden_state


class EncoderGraphs:
    """Captured encoder forwards of one patched model, keyed by the caller (shape, dtype, device)."""

    def __init__(self) -> None:
        self._graphs: collections.OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self._seen: collections.Counter = collections.Counter()
        self._failed: set = set()  # keys whose capture failed: eager from then on
        self._signature: Optional[tuple] = None
        self._mempool = None
        self._lock = threading.Lock()
        self.captures = 0  # encoder graphs captured, ever
        self.replays = 0  # encoder forwards served by a replay, ever

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and their memory pool with the last of them)."""
        self._graphs.clear()
        self._seen.clear()
        self._failed.clear()
        self._mempool = None

    def run(self, key: Hashable, signature: tuple, forward: Callable[[torch.Tensor], torch.Tensor],
            source: torch.Tensor) -> Optional[torch.Tensor]:
        """forward(source) replayed from the graph kept for `key`, captured on this call if the
        shape recurs; None where the caller runs `forward` eagerly (a shape seen for the first
        time, hooks on the encoder, another thread replaying, a capture that failed)."""
        if signature[0] or key in self._failed:
            return None  # hooked modules: their hooks must run on every call
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if signature != self._signature:
                self.clear()
                self._signature = signature
            captured = self._graphs.get(key)
            if captured is None:
                self._seen[key] += 1
                if self._seen[key] < CAPTURE_AFTER:
                    return None
                captured = self._capture(forward, source)
                if captured is None:
                    self._failed.add(key)
                    return None
                self._graphs[key] = captured
                while len(self._graphs) > MAX_GRAPHS:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            captured.source.copy_(source)
            captured.graph.replay()
            self.replays += 1
            return captured.out.clone()
        finally:
            self._lock.release()

    def _capture(self, forward, source: torch.Tensor) -> Optional[_Captured]:
        device = source.device
        with torch.inference_mode(False), torch.no_grad():  # a buffer later calls may copy into outside inference mode
            static = source.clone()
        side = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            forward(static)  # warm up on the capture stream: cuBLAS picks algorithms, workspaces exist
        caller.wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool, stream=side, capture_error_mode=CAPTURE_MODE):
                out = forward(static)
        except RuntimeError as exc:
            torch.cuda.set_stream(caller)  # a failed capture leaves its stream current
            self._mempool = None  # ... and PyTorch's allocator recording into its pool
            torch.cuda.synchronize(device)
            logger.warning("hf_paged_t5: an encoder forward could not be captured as a CUDA graph (%s); "
                           "running it eagerly", exc)
            return None
        self.captures += 1
        logger.info("captured an encoder CUDA graph for input %s", tuple(source.shape))
        return _Captured(graph, static, out)
