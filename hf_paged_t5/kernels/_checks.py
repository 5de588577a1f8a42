"""Argument checks shared by the public kernel wrappers.

Every check raises `TypeError` (wrong dtype / kind) or `ValueError` (wrong shape, layout or
device) with a message that names the argument and says what to do about it. None of them
reads tensor values, so the wrappers stay free of host-device syncs (CUDA-graph safe).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """`tensor` lives on `device`, which is CUDA (or CPU under the Triton interpreter)."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the query is on {device}; move it with .to({device!s})")
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{name} is on {device}: the Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1); use hf_paged_t5.reference for other devices"
    )


def check_float(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """A float16 / bfloat16 / float32 tensor of `ndim` dims whose last dim is contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {tensor.dtype}; supported: float16, bfloat16, float32")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {tensor.stride(-1)}); call .contiguous()")


def check_int32(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """An int32 index tensor of `ndim` dims."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}; convert it with .to(torch.int32)")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")


def check_same_dtype(name: str, tensor: torch.Tensor, query: torch.Tensor) -> None:
    """Caches and keys must share the query's dtype: the kernels do not cast on the fly."""
    if tensor.dtype != query.dtype:
        raise TypeError(
            f"{name} has dtype {tensor.dtype} but the query has {query.dtype}; cast the query with "
            f".to({tensor.dtype}) or build the KV pool in {query.dtype}"
        )


def check_bias_table(bias_table: Optional[torch.Tensor], num_heads: int, device: torch.device, causal: bool) -> int:
    """Validate a T5 distance table and return its max_distance (0 when there is no table)."""
    if bias_table is None:
        return 0
    if not isinstance(bias_table, torch.Tensor) or not bias_table.is_floating_point():
        raise TypeError("bias_table must be a floating-point tensor (float32 from hf_paged_t5.bias)")
    check_device("bias_table", bias_table, device)
    if bias_table.dim() != 2 or bias_table.shape[0] != num_heads:
        raise ValueError(f"bias_table must be [num_heads={num_heads}, entries], got {tuple(bias_table.shape)}")
    entries = bias_table.shape[1]
    if causal:
        if entries < 1:
            raise ValueError("causal bias_table needs max_distance + 1 >= 1 entries per head")
        return entries - 1
    if entries % 2 != 1:
        raise ValueError(
            f"bidirectional bias_table must have 2 * max_distance + 1 (odd) entries per head, got {entries}; "
            "did you pass the causal table to an encoder (causal=False) call?"
        )
    return (entries - 1) // 2


def broadcast_strides(tensor: torch.Tensor) -> list[int]:
    """Strides with 0 on size-1 dims, so a `[1, ...]` bias broadcasts over batch / heads."""
    return [0 if size == 1 else stride for size, stride in zip(tensor.shape, tensor.stride())]


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two >= 16 (tl.dot and tl.arange need both)."""
    return max(16, 1 << (head_dim - 1).bit_length())
