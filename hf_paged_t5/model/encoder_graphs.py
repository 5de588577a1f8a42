"""Encoder forwards replayed as CUDA graphs: one per input shape that recurs.

A text encoder in a diffusion pipeline (T5 v1.1 XXL in Flux / SD3 / PixArt, UMT5-XXL in Wan) runs
one small batch of one shape per image: a few milliseconds of GPU work behind as many
milliseconds of host-side launches; so does generate()'s own encoder call at small batches
(t5-large, 1 x 512 tokens: ~12 ms of launches for ~2 ms of GPU work, more than a tenth of a
128-token call). The second call of a shape captures the whole encoder forward
(`stacks.encoder_forward`, its bias tables gathered from the weights inside the graph) as a
graph; later calls of that shape copy their input into the graph's static buffer and replay it,
with no host sync. A shape seen once runs eagerly (no capture cost for a shape that never comes
back), and so does every shape while the recent calls hold more shapes than graphs are kept
(`RECENT_CALLS`). A padded batch is keyed by its mask as well (each row's first real position
and length, from the read the mask's checks make anyway): a mask that recurs (a pipeline's empty negative prompt, one prompt
for many images) replays a graph that packs exactly its real positions.

What a graph reads by address must stay where it was: `WeightWatch` notices a replaced weight
(a new Parameter, `.data =`, `model.to(...)`), a module added or swapped (a LoRA injected) and a
hook, cheaply enough to run before every replay; a change drops every graph. Writes in place
need nothing: a replay reads the weights as they are, the bias tables included.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import threading
from typing import Callable, Hashable, Optional

import torch
from torch import nn

from .packing import Registrations

logger = logging.getLogger(__name__)

# Batch x length up to which an encoder forward is replayed as a graph: past it the forward's
# GPU work dwarfs its launches, and a graph's memory grows with it.
MAX_GRAPH_TOKENS = 8192
# Shapes whose graphs are kept at once, least recently used dropped first.
MAX_GRAPHS = 8
# Calls of a shape before it is captured (the first runs eagerly, the second captures).
CAPTURE_AFTER = 2
# Keys counted at most (a padded call's key holds its mask: a stream of new masks must not grow
# the count without bound); past it the count starts again.
MAX_SEEN = 1024
# The last calls whose keys make the working set: a shape is captured only while these calls hold
# at most MAX_GRAPHS distinct keys. A stream of many shapes (one generate() per request of any
# length) would otherwise capture every length seen twice and drop it before its replays paid
# for the capture (~2 eager forwards' host time); it stays eager.
RECENT_CALLS = 32
# How a capture treats CUDA calls: "thread_local" forbids unsafe calls in the capturing thread only,
# so another thread's ordinary work on the GPU (a server's request threads building input tensors,
# a notebook's data loader) neither invalidates a capture nor is refused while one runs; CUDA still
# refuses a device-wide synchronize during any capture (README, Limits).
CAPTURE_MODE = "thread_local"
# The lengths the batch engine pads a lone input to for its encoder graphs (`batch/run.py`): one graph
# per length serves every input up to it. Steps of 64 up to 512, then about 2^(1/4) apart (at most
# ~19% of padding where the forward is GPU-bound), up to 4,096 tokens; longer inputs run eagerly.
BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1216, 1472, 1728, 2048, 2432, 2880,
           3456, 4096)


def capture(graph: torch.cuda.CUDAGraph, work: Callable[[], object], stream: torch.cuda.Stream,
            pool=None) -> object:
    """`work()` recorded into `graph` on `stream` (into the memory pool `pool`, or the graph's
    own); returns what `work` returned. capture_begin / capture_end, not `torch.cuda.graph`,
    whose entry synchronizes the device and empties the allocator's device and pinned-host
    caches: every later allocation would pay cudaMalloc / cudaHostAlloc again (a first call at
    a new batch size captures two or three graphs). Python's cyclic garbage collector is off
    while the capture runs (`_no_collection`). A failed capture raises RuntimeError with the
    caller's stream current again, and CUDA's random generators out of capture mode."""
    with torch.cuda.stream(stream), _no_collection():
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode=CAPTURE_MODE)
        try:
            return work()
        finally:
            try:
                graph.capture_end()
            except RuntimeError:
                _end_generator_capture()
                raise


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector off inside (as it was after). A collection that ran inside
    a capture would free whatever unreachable cycles hold at that moment, on the capturing thread:
    a patched model dropped without `unpatch_model` is such a cycle (its runtime), and it owns CUDA
    graphs, whose destruction (PyTorch's `CUDAGraph` reset: its graph, executable and memory pool)
    CUDA refuses on that thread during a capture ("operation not permitted when stream is
    capturing"): the capture is invalidated, with no error until its end. Outside the capture such
    cycles are collected as usual. Captures in several threads at once: the collector stays off
    until the last one ends."""
    with _Collection.lock:
        if _Collection.inside == 0:
            _Collection.was_enabled = gc.isenabled()
            gc.disable()
        _Collection.inside += 1
    try:
        yield
    finally:
        with _Collection.lock:
            _Collection.inside -= 1
            if _Collection.inside == 0 and _Collection.was_enabled:
                gc.enable()


class _Collection:
    """`_no_collection`'s process-wide state: captures in progress, and whether the collector was on
    before the first of them."""

    lock = threading.Lock()
    inside = 0
    was_enabled = True


def _end_generator_capture() -> None:
    """After a capture whose end failed (invalidated: torch's `capture_end` raises before its
    generator epilogue), the device's default CUDA generator still counts itself in capture mode,
    and the next random op outside a capture raises ("Offset increment outside graph capture"):
    one empty-handed capture on the current stream, which ends cleanly, takes it out again."""
    scratch = torch.empty(1, device=torch.cuda.current_device())
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode=CAPTURE_MODE)
    try:
        scratch.zero_()
    finally:
        graph.capture_end()


def bucket_of(length: int) -> Optional[int]:
    """The shortest of `BUCKETS` that holds `length` tokens, or None past the longest."""
    for bucket in BUCKETS:
        if length <= bucket:
            return bucket
    return None


def _hooked(modules: list[nn.Module]) -> bool:
    """Whether calling any of `modules` runs more than its class's forward (hooks of its own or
    global, accelerate's hook, a replaced forward): that must run on every call, not once at capture."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ or "_hf_hook" in m.__dict__:
            return True
    return False


class WeightWatch:
    """The encoder's modules and weights as they were when looked at: `same(stack)` says whether
    a graph captured then still reads the right tensors."""

    def __init__(self, stack: nn.Module) -> None:
        self.registrations = Registrations.now()
        self.modules = list(stack.modules())
        self.params = list(stack.parameters())
        self.pointers = [p.data_ptr() for p in self.params]
        self.devices = {p.device for p in self.params}

    def current(self, stack: nn.Module) -> "WeightWatch":
        """This watch if nothing was registered since, else a new look at `stack`."""
        return self if self.registrations == Registrations.now() else WeightWatch(stack)

    def same_weights(self, other: "WeightWatch") -> bool:
        return (len(self.params) == len(other.params) and all(a is b for a, b in zip(self.params, other.params))
                and self.pointers == other.pointers)

    def unmoved(self) -> bool:
        return [p.data_ptr() for p in self.params] == self.pointers


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    source: torch.Tensor  # static input (input_ids or inputs_embeds)
    out: torch.Tensor  # static last_hidden_state
    forward: Callable  # the captured function: what it holds (bucket indices) the graph reads


class EncoderGraphs:
    """Captured encoder forwards of one patched model's encoder, keyed by the caller
    (input shape, dtype, device, kind). `max_graphs`: graphs kept at once; `capture_after`: calls
    of a key before it is captured (a caller whose keys are few and recur, as the batch engine's
    `BUCKETS`, captures at the first)."""

    def __init__(self, max_graphs: int = MAX_GRAPHS, capture_after: int = CAPTURE_AFTER) -> None:
        self.max_graphs, self.capture_after = max_graphs, capture_after
        self._graphs: collections.OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self._seen: collections.Counter = collections.Counter()
        self._recent: collections.deque = collections.deque(maxlen=RECENT_CALLS)  # keys of the last calls
        self._failed: set = set()  # keys whose capture failed: eager from then on
        self._watch: Optional[WeightWatch] = None
        self._mempool = None
        self._lock = threading.Lock()
        self.captures = 0  # encoder graphs captured, ever
        self.replays = 0  # encoder forwards served by a replay, ever

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and their memory pool with the last of them) and the look at the
        weights they read (with no graph left it guards nothing, and it holds the model's modules);
        the shapes seen stay counted (a shape that recurred is captured again at its next call)."""
        self._graphs.clear()
        self._failed.clear()
        self._mempool = None
        self._watch = None

    def _usable(self, stack: nn.Module, device: torch.device) -> bool:
        """Whether graphs of `stack` may run now: every graph is dropped first if its weights are
        not where the graphs read them; then all weights on `device` and no hooks."""
        old = self._watch
        watch = old.current(stack) if old is not None else WeightWatch(stack)
        if not watch.unmoved():  # `.data =` or `.to(...)` moved a weight: look again
            watch = WeightWatch(stack)
        if old is not None and watch is not old and not watch.same_weights(old):
            if self._graphs:
                logger.info("encoder weights or modules changed: dropping %d encoder graphs", len(self._graphs))
            self.clear()
        self._watch = watch
        return watch.devices == {device} and not _hooked(watch.modules[1:])  # the stack's own: our forward, inside its hooks

    def usable(self, stack: nn.Module, device: torch.device) -> bool:
        """Whether graphs of `stack` may run on `device` now (all weights there, no hooks; False
        while another thread replays): a caller asks before it builds a forward to capture."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._usable(stack, device)
        finally:
            self._lock.release()

    def replay(self, key: Hashable, stack: nn.Module, source: torch.Tensor) -> Optional[torch.Tensor]:
        """The last_hidden_state of `source` from the graph kept for `key`; None where there is
        none, the weights moved, a hook is set or another thread is replaying."""
        if key not in self._graphs or not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._usable(stack, source.device) or key not in self._graphs:
                return None
            return self._replay(key, source)
        finally:
            self._lock.release()

    def seen(self, key: Hashable) -> None:
        """Count a call of `key`'s shape that no graph served (`would_capture`)."""
        if key not in self._seen and len(self._seen) >= MAX_SEEN:
            self._seen.clear()
        self._seen[key] += 1
        self._recent.append(key)

    def serve(self, key: Hashable, stack: nn.Module, source: torch.Tensor,
              build: Callable[[torch.Tensor], Optional[Callable[[torch.Tensor], torch.Tensor]]]) -> Optional[torch.Tensor]:
        """`key`'s graph replayed on `source`; else, once its capture is due (`would_capture`) and
        graphs of `stack` may run (`usable`, asked before `build` does any work), `build(source)`
        makes the forward to capture (None: `key` is never captured), captured and replayed now;
        else None: the caller runs its eager forward. Every call is counted (`seen`)."""
        hidden = self.replay(key, stack, source)
        if hidden is not None:
            return hidden
        self.seen(key)
        if not (self.would_capture(key) and self.usable(stack, source.device)):
            return None
        forward = build(source)
        if forward is None:
            self._failed.add(key)
            return None
        return self.capture(key, stack, forward, source)

    def would_capture(self, key: Hashable) -> bool:
        """Whether `key`'s graph is due: its shape seen `capture_after` times, not captured yet,
        no failed capture, and the last `RECENT_CALLS` calls' shapes fit in the graphs kept."""
        return (key not in self._graphs and key not in self._failed and self._seen[key] >= self.capture_after
                and len(set(self._recent)) <= self.max_graphs)

    def capture(self, key: Hashable, stack: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                source: torch.Tensor) -> Optional[torch.Tensor]:
        """forward(source) captured as `key`'s graph and replayed; None where the caller runs its
        eager forward (a hook, weights on another device, another thread replaying, a capture
        that failed)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._usable(stack, source.device):
                return None
            captured = self._capture(forward, source)
            if captured is None:
                self._failed.add(key)
                return None
            self._graphs[key] = captured
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return self._replay(key, source)
        finally:
            self._lock.release()

    def _replay(self, key: Hashable, source: torch.Tensor) -> torch.Tensor:
        captured = self._graphs[key]
        self._graphs.move_to_end(key)
        self._recent.append(key)
        captured.source.copy_(source)
        captured.graph.replay()
        self.replays += 1
        return captured.out.clone()

    def _capture(self, forward, source: torch.Tensor) -> Optional[_Captured]:
        device = source.device
        with torch.inference_mode(False), torch.no_grad():  # a buffer later calls copy into outside inference mode
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
            out = capture(graph, lambda: forward(static), side, self._mempool)
        except RuntimeError as exc:
            self._mempool = None  # a failed capture leaves PyTorch's allocator recording into its pool
            torch.cuda.synchronize(device)
            logger.warning("hf_paged_t5: an encoder forward could not be captured as a CUDA graph (%s); "
                           "running it eagerly", exc)
            return None
        self.captures += 1
        logger.info("captured an encoder CUDA graph for input %s", tuple(source.shape))
        return _Captured(graph, static, out, forward)
