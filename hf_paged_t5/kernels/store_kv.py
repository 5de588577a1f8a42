"""Store tokens' K/V into paged pool slots (Triton twin of `reference.store_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_float

# Keeps one program's register tile (heads x head_dim) bounded for very wide models.
_MAX_TILE = 8192


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [(layers,) num_tokens, num_heads, head_dim]
    value_ptr,  # [(layers,) num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [(layers,) num_blocks, block_size, num_heads, head_dim]
    value_cache_ptr,  # [(layers,) num_blocks, block_size, num_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32 / int64
    num_heads,
    head_dim,
    stride_key_layer,
    stride_key_token,
    stride_key_head,
    stride_value_layer,
    stride_value_token,
    stride_value_head,
    stride_cache_layer,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_start = tl.program_id(1) * BLOCK_H
    layer = tl.program_id(2).to(tl.int64)  # 0 where one layer is stored
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token: nothing to store.
    if slot >= 0:
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = head_start + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
        # int64: block_id * stride_cache_block passes 2^31 in pools of a few GB.
        cache_off = layer * stride_cache_layer + block_id * stride_cache_block + offset * stride_cache_slot
        cache_off += heads[:, None] * stride_cache_head + dims[None, :]
        key_off = layer * stride_key_layer + token * stride_key_token + heads[:, None] * stride_key_head
        value_off = layer * stride_value_layer + token * stride_value_token + heads[:, None] * stride_value_head
        key = tl.load(key_ptr + key_off + dims[None, :], mask=mask)
        value = tl.load(value_ptr + value_off + dims[None, :], mask=mask)
        tl.store(key_cache_ptr + cache_off, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + cache_off, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write tokens' K/V into pool slots, in place.

    key, value: [num_tokens, num_heads, head_dim] (cast to the cache dtype on store), or
        [layers, num_tokens, num_heads, head_dim]: several layers' K/V of the same tokens at once
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim], same shape, strides and
        dtype; [layers, num_blocks, block_size, num_heads, head_dim] for layered K/V
    slot_mapping: [num_tokens] int32 or int64, each in [0, num_blocks * block_size);
        a negative slot skips that token (padding).
    """
    layered = isinstance(key, torch.Tensor) and key.dim() == 4
    check_float("key", key, 4 if layered else 3)
    check_float("value", value, 4 if layered else 3)
    check_float("key_cache", key_cache, 5 if layered else 4)
    check_float("value_cache", value_cache, 5 if layered else 4)
    device = key.device
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_device(name, tensor, device)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError("slot_mapping must be an int32 or int64 tensor")
    check_device("slot_mapping", slot_mapping, device)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"key_cache is {key_cache.dtype} but value_cache is {value_cache.dtype}; build both alike")
    # one layer: a layer dimension of one, stride 0 (shapes and strides only: no tensor views made)
    lead = () if layered else (1,)
    zero = () if layered else (0,)
    key_shape, cache_shape = lead + tuple(key.shape), lead + tuple(key_cache.shape)
    key_strides, value_strides = zero + key.stride(), zero + value.stride()
    cache_strides = zero + key_cache.stride()
    layers, num_tokens, num_heads, head_dim = key_shape
    if cache_shape[0] != layers:
        raise ValueError(f"key holds {layers} layers but key_cache {cache_shape[0]}")
    if cache_shape[3:] != (num_heads, head_dim):
        raise ValueError(
            f"key has [num_heads, head_dim] = {[num_heads, head_dim]} but the cache has {list(cache_shape[3:])}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}")
    if key_strides[3] != 1 or value_strides[3] != 1 or cache_strides[4] != 1:
        raise ValueError("key, value and the caches need head_dim contiguous (stride 1); pass .contiguous() copies")
    if num_tokens == 0 or layers == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h), layers)
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_heads,
        head_dim,
        *key_strides[:3],
        *value_strides[:3],
        *cache_strides[:4],
        BLOCK_SIZE=cache_shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
