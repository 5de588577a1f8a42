"""`fused_linear`: one projection of a decode step with the work around it folded in, for a few rows.

A graphed decode step at small batch is bound by kernel launches, not bytes: a T5 decoder layer
ran ~17 kernels (three norms, seven projections, the K/V store, residual adds, the activation)
at ~3 us each. Here one kernel computes `x @ W.T` for at most `MAX_ROWS` rows, as `gemv.py`
does (each program streams BLOCK_N whole weight rows and dots them with every row of x, in
float32), together with:

- `norm_weight`: T5's RMSNorm of x first (HF's arithmetic: variance in float32, `x * rsqrt(var +
  eps)` rounded to the activations' dtype, times the norm weight, rounded). Every program reads
  whole rows of x anyway; where K fits one tile, x is read once for both, otherwise the norm
  costs one more pass over it, from cache;
- up to three weights of one shape (q, k, v) in one launch;
- an epilogue: `residual + y` (a sub-layer's residual add, each term rounded as HF rounds
  `hidden + out`), ReLU, the gated GELU `gelu_tanh(x @ W0.T) * (x @ W1.T)` (two weights paired
  per output column; `gated_gelu.py`'s formula), or, with three weights, k and v written to
  paged cache slots and q returned.

With `pdl` (Hopper and later; the caller launches a chain of such kernels) each program requests
its first weight tile, which no earlier kernel writes, before it waits for the previous kernel
(`gdc_wait`): the weights stream while the previous kernel finishes, and the launch gap hides.
So does the norm weight where K fits one tile, and with `early_inputs` the residual or the slot
mapping, written further back.

Half precision only (`fused_linear_supports`): float32 keeps cuBLAS so float32 results stay
bit-comparable with stock HF.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import fast_math
from ._checks import check_device, check_float, interpreting, pdl_options
from .gemv import MAX_ROWS, gemv_config

# EPILOGUE values.
_PLAIN, _RESIDUAL, _RELU, _GATED_GELU, _STORE_KV = 0, 1, 2, 3, 4
_ACTIVATIONS = MappingProxyType({None: _PLAIN, "relu": _RELU, "gelu_tanh": _GATED_GELU})
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# Past this many weight elements, a step of 2-4 rows ran slower fused than on cuBLAS's GEMMs with
# the op-by-op kernels (H200, benchmarks/ab_fusion.py: flan-t5-xl's 10.5M-element FF weights at 4
# rows, 2.77 vs 2.28 ms per step replay; t5-large's 4.2M, 1.28 vs 1.43).
MULTI_ROW_ELEMENTS = 1 << 22


@triton.jit
def _round(x, like_ptr):
    """float32 x rounded to the element type of `like_ptr`, back in float32."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["rows"])  # workload sizes: see kernels/__init__.py
def _fused_linear_kernel(
    x_ptr,  # [rows, K]
    norm_weight_ptr,  # [K] (NORM)
    w0_ptr,  # [N, K]
    w1_ptr,  # [N, K], the second weight (k, or the gated FF's linear half); w0_ptr when unused
    w2_ptr,  # [N, K], the third weight (v); w0_ptr when unused
    residual_ptr,  # [rows, N] (EPILOGUE == RESIDUAL)
    out_ptr,  # [rows, N]
    key_cache_ptr,  # [num_blocks, CACHE_BLOCK, num_heads, head_dim] (EPILOGUE == STORE_KV)
    value_cache_ptr,  # like key_cache_ptr
    slot_mapping_ptr,  # [rows] int32 / int64; a negative slot stores nothing (STORE_KV)
    rows,
    N,
    K,
    eps,
    head_dim,
    stride_x_row,
    stride_w_row,
    stride_residual_row,
    stride_out_row,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_K: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    # Programs [0, tiles) read w0, then w1 and w2 (STORE_KV: q, k, v side by side). The gated
    # FF pairs w0 and w1 in every program instead: both halves of one output column meet here.
    tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    segment = pid // tiles
    offs_n = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptr = w0_ptr
    if segment == 1:
        w_ptr = w1_ptr
    if segment == 2:
        w_ptr = w2_ptr
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w_row  # [BLOCK_N, 1]
    w1_rows = w1_ptr + offs_n.to(tl.int64)[:, None] * stride_w_row
    w_mask = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
    w1 = w
    if EPILOGUE == 3:
        w1 = tl.load(w1_rows + offs_k[None, :], mask=w_mask, other=0.0)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < rows
    out_mask = mask_m[:, None] & mask_n[None, :]
    residual_ptrs = residual_ptr + offs_m[:, None] * stride_residual_row + offs_n[None, :]
    if NORM and ONE_K:
        # a parameter: no kernel of the step writes it (in the loop, its load would follow the norm)
        g_one = tl.load(norm_weight_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    if EARLY:
        # The residual and the slots were written before the kernel just before this one began:
        # requested now, they are not a round trip after the products.
        if EPILOGUE == 1:
            res = tl.load(residual_ptrs, mask=out_mask, other=0.0)
        if EPILOGUE == 4:
            slot = tl.load(slot_mapping_ptr + offs_m, mask=mask_m, other=-1)
    if PDL:
        # Everything below reads what earlier kernels wrote, and writes what they may still read.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    x_rows = x_ptr + offs_m[:, None] * stride_x_row  # [BLOCK_M, 1]
    inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
    if ONE_K:
        # K fits one tile: x is read once, for the norm and the products (one round trip to
        # memory after the wait instead of two)
        x_one = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        x_one = x_one.to(tl.float32)
    if NORM:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ONE_K:
            sum_sq += tl.sum(x_one * x_one, axis=1)
        else:
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                xf = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
                sum_sq += tl.sum(xf * xf, axis=1)
        inv_rms = fast_math.rsqrt(sum_sq / K + eps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        if k0 > 0:  # the first tile came before the wait
            w_mask = mask_n[:, None] & mask_k[None, :]
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
            if EPILOGUE == 3:
                w1 = tl.load(w1_rows + k[None, :], mask=w_mask, other=0.0)
        if ONE_K:
            xf = x_one
        else:
            xf = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        if NORM:
            if ONE_K:
                g = g_one
            else:
                g = tl.load(norm_weight_ptr + k, mask=mask_k, other=0.0).to(tl.float32)
            xf = _round(g[None, :] * _round(xf * inv_rms[:, None], x_ptr), x_ptr)
        acc += tl.sum(xf[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if EPILOGUE == 3:
            acc1 += tl.sum(xf[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)

    # HF rounds each Linear's output to the activations' dtype before anything else touches it.
    y = _round(acc, out_ptr)
    if EPILOGUE == 1:
        if not EARLY:
            res = tl.load(residual_ptrs, mask=out_mask, other=0.0)
        y = res.to(tl.float32) + y
    if EPILOGUE == 2:
        y = tl.maximum(y, 0.0)
    if EPILOGUE == 3:
        # gelu_tanh(y) as x / (1 + exp(-2z)): `gated_gelu.py` says why
        inner = SQRT_2_OVER_PI * (y + 0.044715 * y * y * y)
        y = y / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0))) * _round(acc1, out_ptr)
    y = y.to(out_ptr.dtype.element_ty)
    if segment == 0:
        tl.store(out_ptr + offs_m[:, None] * stride_out_row + offs_n[None, :], y, mask=out_mask)
    else:
        cache_ptr = key_cache_ptr
        if segment == 2:
            cache_ptr = value_cache_ptr
        if EARLY and EPILOGUE == 4:
            slot_ids = slot
        else:
            slot_ids = tl.load(slot_mapping_ptr + offs_m, mask=mask_m, other=-1)
        # int64: block_id * stride_cache_block passes 2^31 in pools of a few GB.
        slot_ids = slot_ids.to(tl.int64)
        row_off = (slot_ids // CACHE_BLOCK) * stride_cache_block + (slot_ids % CACHE_BLOCK) * stride_cache_slot
        col_off = (offs_n // head_dim) * stride_cache_head + offs_n % head_dim
        tl.store(cache_ptr + row_off[:, None] + col_off[None, :], y, mask=out_mask & (slot_ids >= 0)[:, None])


# One row's product tile (BLOCK_N x BLOCK_K per weight) may grow to this many elements per thread
# so that K fits one tile: ~125 registers at sm_90 for t5-large's wo (2 x 4096 on 4 warps).
ONE_ROW_TILE_PER_THREAD = 64


def fused_config(rows: int, N: int, K: int, paired: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a `fused_linear` launch: `gemv_config`'s, with fewer weight
    rows per program where the norm's registers would spill, and one row's K in one tile where a
    program's tile fits ONE_ROW_TILE_PER_THREAD products per thread, on 4 warps and fewer weight
    rows if need be (`paired`: the gated FF's two weights per program).

    Each program holds BLOCK_M x BLOCK_N x BLOCK_K products per weight: past 8 x 1024 per two warps
    the norm's extra registers spill (ptxas, sm_90), where the plain GEMV's do not. At one row the
    whole weight tile of a program loads before the PDL wait, so with K in one tile the weights
    stream while the previous kernel finishes. H200, bf16, 512-token inputs, 128 new tokens, ms
    per generate() call at batch 1 (`benchmarks/ab_generate.py`, 2026-12-04,
    benchmarks/results/2026-12-04-h200/fused-one-tile/): t5-large 107.5-107.7 against 118.3-118.6
    with K in 1,024-column tiles (wo: 4,096 columns in one tile); flan-t5-xl 208.4-208.5 against
    228.4-228.5 (q, k, v, o and the gated wi: 2,048 in one tile on 4 warps; wo: 5,120 in one).
    """
    block_n, block_k, num_warps = gemv_config(rows, N, K)
    weights = 2 if paired else 1
    block_n = min(block_n, max(1, 8 // (triton.next_power_of_2(rows) * weights)))
    whole = triton.next_power_of_2(K)
    if rows == 1 and block_k < whole:
        if block_n * whole * weights <= ONE_ROW_TILE_PER_THREAD * 32 * num_warps:
            block_k = whole
        elif whole * weights <= ONE_ROW_TILE_PER_THREAD * 32 * 4:  # fewer weight rows, on 4 warps
            block_n = min(block_n, ONE_ROW_TILE_PER_THREAD * 32 * 4 // (whole * weights))
            block_k, num_warps = whole, 4
    return block_n, block_k, num_warps


def fused_linear_supports(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `fused_linear` serves these operands: at most MAX_ROWS rows of x (more than one
    only for weights of at most MULTI_ROW_ELEMENTS elements), half precision, row-major weights
    of one shape and x's dtype and device. (A decode step picks it for every layer or none:
    `model/fused_layer.py`.)"""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    w0 = weights[0] if weights else None
    return (
        0 < rows <= MAX_ROWS
        and (rows == 1 or w0.numel() <= MULTI_ROW_ELEMENTS)
        and x.dtype in (torch.float16, torch.bfloat16)
        and 1 <= len(weights) <= 3
        and all(
            isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape == w0.shape and w.stride() == w0.stride()
            and w.stride(1) == 1 and w.dtype == x.dtype and w.device == x.device
            for w in weights
        )
        and w0.shape[1] == x.shape[-1]
    )


def _check(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: Optional[str],
    key_cache: Optional[torch.Tensor],
    value_cache: Optional[torch.Tensor],
    slot_mapping: Optional[torch.Tensor],
) -> int:
    """The checks of `fused_linear`'s arguments; returns its EPILOGUE."""
    check_float("x", x, x.dim())
    if not fused_linear_supports(x, weights):
        raise ValueError(
            f"fused_linear serves 1 to {MAX_ROWS} rows of fp16/bf16 x with 1 to 3 row-major weights of one shape, "
            f"x's dtype, device and feature count; got x {tuple(x.shape)} {x.dtype} and weights "
            f"{[(tuple(w.shape), w.dtype, str(w.device)) for w in weights]}"
        )
    if norm_weight is not None:
        check_float("norm_weight", norm_weight, 1)
        check_device("norm_weight", norm_weight, x.device)
        if norm_weight.shape[0] != x.shape[-1] or norm_weight.dtype != x.dtype:
            raise ValueError(f"norm_weight must be [{x.shape[-1]}] in {x.dtype}, got "
                             f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    stores = key_cache is not None or value_cache is not None or slot_mapping is not None
    chosen = [residual is not None, activation is not None, stores]
    if sum(chosen) > 1:
        raise ValueError("give at most one of residual, activation and key_cache / value_cache / slot_mapping")
    expected = 2 if activation == "gelu_tanh" else 3 if stores else 1
    if len(weights) != expected:
        raise ValueError(f"this epilogue takes {expected} weight(s), got {len(weights)}")
    rows, N = x.numel() // x.shape[-1], weights[0].shape[0]
    if residual is not None:
        check_float("residual", residual, residual.dim())
        check_device("residual", residual, x.device)
        if residual.numel() != rows * N or residual.shape[-1] != N or residual.dtype != x.dtype:
            raise ValueError(f"residual must hold [{rows}, {N}] in {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    if stores:
        return _check_store(x, N, rows, key_cache, value_cache, slot_mapping)
    return _RESIDUAL if residual is not None else _ACTIVATIONS[activation]


def _check_store(x, N: int, rows: int, key_cache, value_cache, slot_mapping) -> int:
    if key_cache is None or value_cache is None or slot_mapping is None:
        raise ValueError("storing K/V needs key_cache, value_cache and slot_mapping together")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_float(name, cache, 4)
        check_device(name, cache, x.device)
        if cache.dtype != x.dtype:
            raise TypeError(f"{name} is {cache.dtype} but x is {x.dtype}; build the pool in {x.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    num_heads, head_dim = key_cache.shape[2:]
    if num_heads * head_dim != N or key_cache.stride(3) != 1:
        raise ValueError(f"the cache's heads x head_dim ({num_heads} x {head_dim}) must equal the weights' {N} "
                         "outputs, head_dim contiguous")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError("slot_mapping must be an int32 or int64 tensor")
    check_device("slot_mapping", slot_mapping, x.device)
    if slot_mapping.shape != (rows,):
        raise ValueError(f"slot_mapping must be [rows={rows}], got {tuple(slot_mapping.shape)}")
    return _STORE_KV


def fused_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    key_cache: Optional[torch.Tensor] = None,
    value_cache: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
    pdl: bool = False,
    early_inputs: bool = False,
) -> torch.Tensor:
    """`x @ weights[0].T` for at most MAX_ROWS rows, with the extras of the module docstring.

    x: [..., K] fp16/bf16; weights: 1-3 row-major [N, K] in x's dtype
    norm_weight: [K], or None: x is first T5-layer-normed with `eps`
    residual: [..., N]: returns residual + x @ W.T (one weight)
    activation: "relu" (one weight) or "gelu_tanh" (two: gelu_tanh(x @ W0.T) * x @ W1.T), or None
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim] with num_heads * head_dim
        = N, and slot_mapping [rows] int: three weights (q, k, v); k and v go to the slots
        (negative: none), q is returned
    pdl: launch as a programmatic dependent launch (`pdl_available`); ignored under the interpreter
    early_inputs: the residual and slot_mapping were written before the kernel just before this
        one began (a residual two or more launches back in a dependent chain, a decode step's
        slots): they load before the wait, with the weights. The same result either way.
    returns: [..., N] in x's dtype
    """
    epilogue = _check(x, weights, norm_weight, residual, activation, key_cache, value_cache, slot_mapping)
    N, K = weights[0].shape
    x2 = x.reshape(-1, K)
    rows = x2.shape[0]
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    residual2 = residual.reshape(rows, N) if residual is not None else out
    w0 = weights[0]
    w1 = weights[1] if len(weights) > 1 else w0
    w2 = weights[2] if len(weights) > 2 else w0
    cache = key_cache if key_cache is not None else out.view(1, 1, 1, -1)
    values = value_cache if value_cache is not None else cache
    slots = slot_mapping if slot_mapping is not None else out
    block_n, block_k, num_warps = fused_config(rows, N, K, epilogue == _GATED_GELU)
    block_m = triton.next_power_of_2(rows)
    if interpreting():
        block_n = 16  # the interpreter's cost is per program: fewer, wider ones on the CPU
    segments = 3 if epilogue == _STORE_KV else 1
    pdl, launch = pdl_options(pdl)
    _fused_linear_kernel[(segments * triton.cdiv(N, block_n),)](
        x2, norm_weight if norm_weight is not None else x2, w0, w1, w2, residual2, out, cache, values, slots,
        rows, N, K, float(eps), cache.shape[3],
        x2.stride(0), w0.stride(0), residual2.stride(0), out.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2),
        NORM=norm_weight is not None, EPILOGUE=epilogue, CACHE_BLOCK=cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ONE_K=K <= block_k, PDL=pdl,
        EARLY=bool(early_inputs), num_warps=num_warps, **launch,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], N)
