"""`PagedCacheConfig`: every knob of the paged backend, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

_BACKENDS = ("auto", "triton", "cpu", "torch")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class PagedCacheConfig:
    """Configuration of the paged KV cache attached by `patch_model`.

    Args:
        block_size: tokens per KV block. A power of two between 1 and 256.
        num_blocks: blocks in each decoder layer's pool at creation. `None` sizes the pool
            from `max_tokens`.
        max_tokens: pool capacity in tokens at creation (rounded up to whole blocks); used
            when `num_blocks` is `None`. Self-attention and cross-attention tokens share it.
            `None` (the default) starts empty and sizes the pool to the first request.
        grow: when a `generate()` call needs more blocks than the pool has, grow the pool
            (up to `max_num_blocks`) instead of refusing the call. An idle pool is re-made at
            exactly the size needed; a pool in use by another call is enlarged by copying.
        max_num_blocks: upper bound for growth; `None` means no bound other than memory.
        dtype: KV dtype; `None` uses the dtype of each layer's `k` projection weight.
        backend: "triton" (GPU kernels), "cpu" (batched PyTorch, written for speed on CPU;
            `cpu_ops.py`), "torch" (the plain PyTorch reference, written for reading: the tests'
            oracle) or "auto" (triton on CUDA devices, cpu elsewhere). "cpu" and "torch" run on
            any device.
        cuda_graphs: capture the decode step as a CUDA graph per batch-size bucket, and the
            greedy / beam-search update (token choice, cache reorder, next step's inputs) as one
            graph per `generate()` call (a greedy call of at most 16 rows keeps its update for
            later calls of the same shape); a model on one GPU then runs each `generate()` on the
            stream the graphs are captured on. False runs the same steps eagerly on the caller's
            stream.
        max_graph_batch: largest batch size served by a captured graph; larger batches
            run the same step eagerly. Also `BatchGenerator`'s default rows per decode step
            (512: on an H200, t5-large's batch job ran 1.45x the tokens/s of 256 rows).
        fused_decode: run a bfloat16 decode step of at most 4 rows as a few fused kernels per
            decoder layer (`model/fused_layer.py`: the norm, projections, K/V store, residual
            adds and activation folded together) where every layer is HF's own modules as
            they are. False runs one kernel per op (the same arithmetic, more launches).
        pack_projections: on a GPU in float16 / bfloat16, lay each attention's q/k/v weights,
            each cross-attention's k/v and each gated feed-forward's wi_0/wi_1 out as slices of
            one tensor (`model/packing.py`), so each group runs as one GEMM. The parameters stay
            the same objects with the same values and memory does not grow; `state_dict()` (and
            so every saver) gives each weight a tensor of its own, and `unpatch_model` gives each
            weight its own tensor again. Packing happens in `patch_model`: patch a model after
            moving it to its GPU. Float32 and CPU models are never packed (their GEMMs stay HF's,
            bit for bit).
    """

    block_size: int = 16
    num_blocks: Optional[int] = None
    max_tokens: Optional[int] = None
    grow: bool = True
    max_num_blocks: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    backend: str = "auto"
    cuda_graphs: bool = True
    max_graph_batch: int = 512
    fused_decode: bool = True
    pack_projections: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {bs!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int or None, got {self.num_blocks!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.max_num_blocks is not None:
            if not isinstance(self.max_num_blocks, int) or self.max_num_blocks < self.initial_num_blocks:
                raise ValueError(
                    f"max_num_blocks ({self.max_num_blocks!r}) must be an int >= the initial pool size "
                    f"({self.initial_num_blocks} blocks)"
                )
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES} or None, got {self.dtype!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if not isinstance(self.max_graph_batch, int) or self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be a positive int, got {self.max_graph_batch!r}")

    @property
    def initial_num_blocks(self) -> int:
        """Blocks per layer pool at creation (one, the reserved scratch block, when sized lazily)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.max_tokens is None:
            return 1
        return -(-self.max_tokens // self.block_size)

    def resolve_backend(self, device: torch.device) -> str:
        """The backend that runs on `device`: "triton", "cpu" or "torch"."""
        if self.backend == "auto":
            return "triton" if device.type == "cuda" else "cpu"
        # Triton's interpreter runs the real kernels on CPU tensors (used by the tests).
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if self.backend == "triton" and device.type != "cuda" and not interpreted:
            raise ValueError(
                f"backend='triton' needs CUDA tensors, but a layer lives on {device}; "
                "use PagedCacheConfig(backend='auto') to run such layers on the torch backend"
            )
        return self.backend
