"""`PagedRuntime`: everything `patch_model` attaches to one model (as `model._hf_paged_t5`).

Its config, the KV pool, the bias tables, the decode runner (graphs, streams, the lock and owner
of paged calls), the kernel namespace per device and the originals `unpatch_model` restores.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .. import triton_start
from ..config import PagedCacheConfig
from ..decode.runner import DecodeRunner
from ..kv.pool import KVPool, LayerSpec
from ..model import bias as bias_mod
from ..model.attention import OnDevice, backend_ops, compile_in_workers, run_compiled_ahead
from ..model.encoder_graphs import BUCKETS, EncoderGraphs
from ..model.packing import HookWatch
from ..model.probe import output_scale

logger = logging.getLogger("hf_paged_t5.hf.patch")


class PagedRuntime:
    """Everything `patch_model` attaches to one model: config, pool, bias tables, originals."""

    def __init__(self, model: nn.Module, config: PagedCacheConfig) -> None:
        self.config = config
        self.is_seq2seq = hasattr(model, "decoder")
        self.d_model: Optional[int] = getattr(model.config, "d_model", None)
        self.originals: dict[tuple[int, str], tuple[nn.Module, Any, bool]] = {}
        self.pool: Optional[KVPool] = None
        self.warned: set[str] = set()
        self._device_ops: dict[tuple[str, torch.device], OnDevice] = {}
        sig = inspect.signature(type(model).forward).parameters if self.is_seq2seq else {}
        self.cache_kwarg = "cache" if "cache" in sig else "past_key_values"
        # what the class's forward multiplies the decoder output by before lm_head (probe.py)
        self.output_scale = output_scale(model) if self.is_seq2seq else None
        # decode graphs, streams, the lock and owner of paged calls (a generate() nested in one,
        # from a streamer or logits processor, must not wait on the lock nor take its blocks)
        self.runner = DecodeRunner(config, self.ops_for, self.bias_tables, self.output_scale)
        # standalone encoder calls of a recurring shape, replayed (model/encoder_graphs.py)
        self.encoder_graphs = EncoderGraphs()
        # the batch engine's encoder calls of lone inputs, one graph per padded length (batch/run.py)
        self.bucket_graphs = EncoderGraphs(max_graphs=len(BUCKETS), capture_after=1)
        self.tables = bias_mod.BiasTableCache(on_rebuild=self._drop_graphs)  # captured graphs read them
        self.compiled_ahead: set = set()  # the kinds of call `compile_ahead` ran for, with their device
        # what a generate() call in progress adds to its encoder's pass (`also_ahead`), or None
        self._also_ahead: Optional[Callable[[], None]] = None
        self.packed: list = []  # the projection groups `patch_model` packed (`model/packing.py`)
        # hooks on modules the paged path does not call: generate()'s stacks, and an encoder's own call
        self.hook_watch, self.encoder_hook_watch = HookWatch(), HookWatch()

    def release(self) -> None:
        """What `unpatch_model` does after restoring the model: the pool, every captured graph (decode,
        encoder, bucket; with their memory pools) and every reference to the model's modules and
        weights (originals, bias tables, hook lists) dropped now. The runtime is a reference cycle,
        freed only by a cyclic garbage collection; without this it would hold the model's weights
        and its graphs until then (`del model` after `unpatch_model` would free nothing), and a
        collection inside a later capture would destroy its graphs there (`encoder_graphs.capture`)."""
        self.pool = None
        self._drop_graphs()  # the decode steps go with the pool they read
        self.bucket_graphs.clear()
        self.originals.clear()
        self.packed = []
        self.tables = bias_mod.BiasTableCache(on_rebuild=self._drop_graphs)
        self.hook_watch, self.encoder_hook_watch = HookWatch(), HookWatch()
        self._device_ops.clear()

    def _drop_graphs(self) -> None:
        self.runner.graphs.clear()
        self.encoder_graphs.clear()
        # (the bucket graphs gather their tables from the weights inside the graph and read no
        # cached table: a table built or rebuilt leaves them valid, and the first decoder table
        # of a job is built after its first encoder call)

    def compile_ahead(self, device: torch.device, kind, forward) -> None:
        """The first call of a `kind` on a CUDA device: `forward()` once inside
        `kernels.ahead.compile_ahead` (its kernels compiled at once, none run; its output dropped),
        so the real call that follows finds them compiled. A failure there is the real call's to
        raise: it is logged at debug level and the real call runs as it would have. Inside a
        generate() call, the pass also runs what the call registered (`also_ahead`: its first
        decode step and cross K/V store), so their kernels compile on the same pool, at once.
        The pass's compiles go to the compile workers where one is free (`compile_in_workers`): on
        the pool's threads they run largely one after another under the interpreter's lock."""
        key = (device, kind)
        if key in self.compiled_ahead:
            return
        self.compiled_ahead.add(key)
        extra = self._also_ahead if self.runner.owned_here() else None

        def everything():
            with compile_in_workers(device):
                forward()
                if extra is not None:
                    extra()

        # (after Triton's start-up, begun on a thread at import: its sources hashed once, not twice)
        run_compiled_ahead(device, self.config.resolve_backend(device), everything, str(kind),
                           before=triton_start.wait)

    @contextlib.contextmanager
    def also_ahead(self, work: Callable[[], None]) -> Iterator[None]:
        """Within (a generate() call, which owns the runner): an encoder pass of `compile_ahead`
        also runs `work` (compile-only launches of what the call will run after its encoder)."""
        self._also_ahead = work
        try:
            yield
        finally:
            self._also_ahead = None

    # ---- per-layer resources ------------------------------------------------------------
    def ops_for(self, device: torch.device):
        """The kernel namespace for a layer on `device`; with several GPUs, one that makes `device`
        current around each call (see `attention.OnDevice`)."""
        ops = backend_ops(self.config.resolve_backend(device))
        if device.type == "cuda" and torch.cuda.device_count() > 1:
            key = (ops.__name__, device)
            if key not in self._device_ops:
                self._device_ops[key] = OnDevice(ops, device)
            return self._device_ops[key]
        return ops

    def bias_tables(self, stack: nn.Module, causal: bool) -> list[torch.Tensor]:
        """Each layer's bias table of `stack` (`bias.BiasTableCache`; no host sync)."""
        return self.tables.get(stack, causal)

    def side_tables(self, stack: nn.Module) -> Optional[list[torch.Tensor]]:
        """Each layer's side table of a LongT5 transient-global encoder, else None (`bias.BiasTableCache`)."""
        return self.tables.side_tables(stack)

    def band_memos(self, stack: nn.Module) -> list[dict]:
        """Each encoder layer's memo for the prefill kernel's band tiles (`bias.BiasTableCache.memos`)."""
        return self.tables.memos(stack, causal=False)

    def check_weights(self) -> None:
        """Once per generate() call and batch job: drop bias tables whose weights were written in
        place (one host sync); never per decode step."""
        self.tables.check()

    def layer_specs(self, decoder: nn.Module) -> list[LayerSpec]:
        """One pool spec per decoder layer: its device, the model's dtype, its head shape."""
        specs = []
        for i, block in enumerate(decoder.block):
            attn = block.layer[0].SelfAttention
            weight = attn.k.weight
            if self.config.dtype is not None and self.config.dtype != weight.dtype:
                raise ValueError(
                    f"PagedCacheConfig(dtype={self.config.dtype}) does not match decoder layer {i}'s weights "
                    f"({weight.dtype}); the kernels need K/V in the model's dtype. Use dtype=None, or "
                    f"convert the model with model.to({self.config.dtype})"
                )
            specs.append(LayerSpec(weight.device, weight.dtype, attn.n_heads, attn.key_value_proj_dim))
        return specs

    def get_pool(self, decoder: nn.Module) -> KVPool:
        specs = self.layer_specs(decoder)
        if self.pool is None or self.pool.specs != specs:
            if self.pool is not None:
                logger.info("re-creating the KV pool: the decoder's devices or dtypes changed")
            self.pool = KVPool(self.config, specs)
        return self.pool

    def uncalled_hook(self, model: nn.Module) -> Optional[str]:
        """A hook of the seq2seq `model` that would not run on the paged path, in a few words, or
        None (`packing.hooked_among`): patched generate() runs such a call on stock HF, a batch job
        refuses it."""
        stacks = [(model.get_encoder(), "encoder", False), (model.decoder, "decoder", True)]
        return self.hook_watch.hooked(stacks)

    def warn_once(self, reason: str, what: str = "this generate()") -> None:
        """Log once per model and reason that `what` runs on stock HF, and why (a generate() that
        falls back for a reason its encoder shares logs it once)."""
        if reason not in self.warned:
            self.warned.add(reason)
            logger.warning("hf_paged_t5: running %s on stock HF: %s", what, reason)


def set_attr(runtime: PagedRuntime, module: nn.Module, name: str, value: Any) -> None:
    """Set an instance attribute, remembering what it replaced."""
    had = name in module.__dict__
    runtime.originals[(id(module), name)] = (module, module.__dict__.get(name), had)
    setattr(module, name, value)
