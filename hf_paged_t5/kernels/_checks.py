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


def pdl_options(pdl: bool) -> tuple[bool, dict]:
    """(the kernel's PDL constexpr, Triton launch options) for a wrapper asked for a programmatic
    dependent launch: off under the interpreter, which runs no inline PTX."""
    pdl = pdl and not interpreting()
    return pdl, ({"launch_pdl": True} if pdl else {})


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
        raise TypeError("bias_table must be a floating-point tensor (float32 from hf_paged_t5.model.bias)")
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


def check_decode_args(query, key_cache, value_cache, block_table, seq_lens, bias_table, dense_bias) -> int:
    """Validate `paged_decode` arguments; returns the bias table's max_distance (0 if none)."""
    check_float("query", query, 3)
    check_float("key_cache", key_cache, 4)
    check_float("value_cache", value_cache, 4)
    check_int32("block_table", block_table, 2)
    check_int32("seq_lens", seq_lens, 1)
    device = query.device
    for name, tensor in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
    ):
        check_device(name, tensor, device)
    check_same_dtype("key_cache", key_cache, query)
    check_same_dtype("value_cache", value_cache, query)
    batch, num_heads, head_dim = query.shape
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    if tuple(key_cache.shape[2:]) != (num_heads, head_dim):
        raise ValueError(
            f"query has [num_heads, head_dim] = {[num_heads, head_dim]} but the cache has {list(key_cache.shape[2:])}"
        )
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            f"batch = {batch} rows like the query"
        )
    if bias_table is not None and dense_bias is not None:
        raise ValueError("pass at most one of bias_table / dense_bias")
    max_distance = check_bias_table(bias_table, num_heads, device, causal=True)
    if dense_bias is not None:
        if not isinstance(dense_bias, torch.Tensor) or not dense_bias.is_floating_point():
            raise TypeError("dense_bias must be a floating-point tensor")
        check_device("dense_bias", dense_bias, device)
        if dense_bias.dim() != 3 or dense_bias.shape[0] not in (1, batch) or dense_bias.shape[1] not in (1, num_heads):
            raise ValueError(
                f"dense_bias must be [batch|1, num_heads|1, max_keys] = [{batch}|1, {num_heads}|1, L], "
                f"got {tuple(dense_bias.shape)}"
            )
    return max_distance


def check_prefill_args(query, key, value, cu_seqlens, max_seqlen, causal, bias_table, dense_bias) -> int:
    """Validate `prefill` arguments; returns the bias table's max_distance (0 if none)."""
    check_float("query", query, 3)
    check_float("key", key, 3)
    check_float("value", value, 3)
    check_int32("cu_seqlens", cu_seqlens, 1)
    device = query.device
    for name, tensor in (("query", query), ("key", key), ("value", value), ("cu_seqlens", cu_seqlens)):
        check_device(name, tensor, device)
    check_same_dtype("key", key, query)
    check_same_dtype("value", value, query)
    if key.shape != query.shape or value.shape != query.shape:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            "must all be [total_tokens, num_heads, head_dim]"
        )
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must be [batch + 1] with batch >= 0")
    if isinstance(max_seqlen, torch.Tensor) or not hasattr(max_seqlen, "__index__") or max_seqlen < 0:
        raise TypeError(f"max_seqlen must be a non-negative host int, got {max_seqlen!r}")
    if bias_table is not None and dense_bias is not None:
        raise ValueError("pass at most one of bias_table / dense_bias")
    batch, num_heads = cu_seqlens.shape[0] - 1, query.shape[1]
    max_distance = check_bias_table(bias_table, num_heads, device, causal=bool(causal))
    if dense_bias is not None:
        if not isinstance(dense_bias, torch.Tensor) or not dense_bias.is_floating_point():
            raise TypeError("dense_bias must be a floating-point tensor")
        check_device("dense_bias", dense_bias, device)
        if (
            dense_bias.dim() != 4
            or dense_bias.shape[0] not in (1, batch)
            or dense_bias.shape[1] not in (1, num_heads)
            or min(dense_bias.shape[2:]) < max_seqlen
        ):
            raise ValueError(
                f"dense_bias must be [batch|1, num_heads|1, >=max_seqlen, >=max_seqlen] = "
                f"[{batch}|1, {num_heads}|1, >={max_seqlen}, >={max_seqlen}], got {tuple(dense_bias.shape)}"
            )
    return max_distance


def _check_table(name: str, table: Optional[torch.Tensor], num_heads: int, device: torch.device) -> int:
    """A bidirectional distance table [num_heads, 2D + 1], contiguous per head; returns D (0 without one)."""
    distance = check_bias_table(table, num_heads, device, causal=False)
    if table is not None and table.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {table.stride(1)}); call .contiguous()")
    return distance


def check_local_args(query, key, value, cu_seqlens, max_seqlen, local_radius, bias_table, side_key, side_value,
                     cu_globals, block_ids, side_bias_table) -> tuple[int, int]:
    """Validate `local_prefill` arguments; returns the max_distance of the local and the side table."""
    check_prefill_args(query, key, value, cu_seqlens, max_seqlen, False, None, None)
    if isinstance(local_radius, (bool, torch.Tensor)) or not hasattr(local_radius, "__index__") or local_radius < 0:
        raise TypeError(f"local_radius must be a non-negative host int, got {local_radius!r}")
    device, num_heads = query.device, query.shape[1]
    max_distance = _check_table("bias_table", bias_table, num_heads, device)
    side = (side_key, side_value, cu_globals, block_ids)
    if all(t is None for t in side):
        if side_bias_table is not None:
            raise ValueError("side_bias_table needs side_key, side_value, cu_globals and block_ids")
        return max_distance, 0
    if any(t is None for t in side):
        raise ValueError("side keys need all of side_key, side_value, cu_globals and block_ids (or none of them)")
    check_float("side_key", side_key, 3)
    check_float("side_value", side_value, 3)
    check_int32("cu_globals", cu_globals, 1)
    check_int32("block_ids", block_ids, 1)
    for name, tensor in (("side_key", side_key), ("side_value", side_value), ("cu_globals", cu_globals),
                         ("block_ids", block_ids)):
        check_device(name, tensor, device)
    check_same_dtype("side_key", side_key, query)
    check_same_dtype("side_value", side_value, query)
    if side_key.shape != side_value.shape or tuple(side_key.shape[1:]) != tuple(query.shape[1:]):
        raise ValueError(
            f"side_key {tuple(side_key.shape)} and side_value {tuple(side_value.shape)} must both be "
            f"[total_globals, num_heads, head_dim] with the query's {list(query.shape[1:])}"
        )
    if cu_globals.shape != cu_seqlens.shape:
        raise ValueError(f"cu_globals must be [batch + 1] like cu_seqlens {tuple(cu_seqlens.shape)}, "
                         f"got {tuple(cu_globals.shape)}")
    if block_ids.shape[0] != query.shape[0]:
        raise ValueError(f"block_ids must be [total_tokens = {query.shape[0]}], got {tuple(block_ids.shape)}")
    return max_distance, _check_table("side_bias_table", side_bias_table, num_heads, device)
