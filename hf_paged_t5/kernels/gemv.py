"""`gemv` for a handful of rows: y = x @ weight.T when x has at most `MAX_ROWS` rows.

A decode step at batch 1 multiplies one activation row by each weight matrix. cuBLAS runs
those products at a fraction of memory bandwidth (~300 GB/s for a 1024x1024 bf16 weight on
an H200), and a T5 layer has six of them. Here every program streams `BLOCK_N` whole weight
rows (no split-K, so no second pass) and dots them with all `x` rows, accumulating in fp32.
Half precision only: fp32 keeps cuBLAS so fp32 results stay bit-comparable with stock HF.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_float, interpreting

MAX_ROWS = 4


@triton.jit(do_not_specialize=["rows"])  # workload sizes: see kernels/__init__.py
def _gemv_kernel(
    x_ptr,  # [rows, K]
    weight_ptr,  # [N, K]
    out_ptr,  # [rows, N]
    rows,
    N,
    K,
    stride_x_row,
    stride_weight_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < rows
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_row
    x_rows = x_ptr + offs_m[:, None] * stride_x_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
        acc += tl.sum(prod, axis=2)
    out = out_ptr + offs_m[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(rows: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [rows, K] x [N, K]^T product.

    From benchmarks/tune_gemv.py on an H200 (bf16, in a CUDA graph): two weight rows per
    program for narrow outputs (more programs in flight), more for wide ones.
    """
    block_k = min(triton.next_power_of_2(K), 1024)
    if N <= 1024:
        return 2, block_k, 4 if rows == 1 and K >= 1024 else 2
    return (8 if N <= 4096 and K <= 2048 else 4), block_k, 2


def gemv_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` serves this product, and beats cuBLAS at it (otherwise use F.linear).

    Measured on an H200: one row up to 8192 outputs (not the vocabulary projection, where
    cuBLAS reaches full bandwidth), up to MAX_ROWS rows for weights of at most 2M elements.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    N, K = weight.shape if weight.dim() == 2 else (0, 0)
    small = N <= 8192 if rows == 1 else N * K <= 1 << 21
    return (
        0 < rows <= MAX_ROWS
        and small
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.device == weight.device
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """x @ weight.T for x [..., K] with at most MAX_ROWS rows, weight [N, K] (row-major), half precision.

    config: (BLOCK_N, BLOCK_K, num_warps) instead of `gemv_config`'s choice (for tuning).
    returns [..., N] in x's dtype
    """
    check_float("x", x, x.dim())
    check_float("weight", weight, 2)
    check_device("weight", weight, x.device)
    if not gemv_supports(x, weight):
        raise ValueError(
            f"gemv serves at most {MAX_ROWS} rows of fp16/bf16 (one row up to 8192 outputs, more rows up to 2M "
            f"weight elements) with a row-major weight of the same dtype; got "
            f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()}"
        )
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but weight expects {K}")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config or gemv_config(rows, N, K)
    if config is None and interpreting():
        block_n = 16  # the interpreter's cost is per program: fewer, wider ones on the CPU
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, weight, out, rows, N, K, x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out.reshape(*x.shape[:-1], N)
