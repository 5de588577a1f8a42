"""`geglu_linear`: the gated feed-forward's middle, `gelu_tanh(x @ W0.T) * (x @ W1.T)`, as one GEMM.

T5 v1.1 / mT5 / UMT5 run `wi_0` and `wi_1` as one cuBLAS GEMM over their packed weights (a
[tokens, 2 * d_ff] output) and then `gated_gelu` over its two halves: at an XXL encoder's 512
tokens that is a 21 MB intermediate written and read again per layer and a pointwise launch of
~11 µs (H200). Here each program computes a tile of both halves' products for the same output
columns (two float32 accumulators) and applies the gated GELU to the accumulators before the one
store: no intermediate, no second launch. The GELU is `gated_gelu`'s (`x / (1 + exp(-2z))`, the
tanh form without its cancellation), on float32 products that are not rounded to the activations'
dtype first, so the result is at least as close to float32 math as HF's op-by-op bf16 chain.

Half precision only (float32 keeps HF's own ops, so float32 tokens stay HF's bit for bit).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_float, interpreting

Config = tuple  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, "tma"])


def geglu_config(rows: int, n: int, k: int) -> Config:
    """(rows per tile, output columns per tile, K per step, warps, pipeline stages)."""
    if rows <= 64:
        return 64, 64, 64, 4, 4
    return 128, 128, 64, 8, 3


@triton.jit(do_not_specialize=["M"])  # M follows the token count (see kernels/__init__.py)
def _geglu_linear_kernel(
    x_ptr,  # [M, K], unit column stride
    gate_w_ptr,  # [N, K], unit column stride
    linear_w_ptr,  # [N, K], unit column stride
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_gate_n,
    stride_linear_n,
    SQRT_2_OVER_PI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # Grouped order: GROUP_M row tiles walk the column tiles together, so a weight tile is read
    # from L2 by the row tiles beside it.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns load a valid row instead of masking (their results are not stored).
    rows_in = tl.where(rows < M, rows, 0).to(tl.int64)
    cols_in = tl.where(cols < N, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + ks[None, :]
    g_ptrs = gate_w_ptr + cols_in[None, :] * stride_gate_n + ks[:, None]  # [BLOCK_K, BLOCK_N]
    l_ptrs = linear_w_ptr + cols_in[None, :] * stride_linear_n + ks[:, None]
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_linear = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            g = tl.load(g_ptrs)
            lin = tl.load(l_ptrs)
        else:
            left = K - step * BLOCK_K
            a = tl.load(x_ptrs, mask=ks[None, :] < left, other=0.0)
            g = tl.load(g_ptrs, mask=ks[:, None] < left, other=0.0)
            lin = tl.load(l_ptrs, mask=ks[:, None] < left, other=0.0)
        acc_gate = tl.dot(a, g, acc_gate)
        acc_linear = tl.dot(a, lin, acc_linear)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        l_ptrs += BLOCK_K
    inner = SQRT_2_OVER_PI * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
    out = acc_gate / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0))) * acc_linear
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _geglu_linear_tma_kernel(
    x_desc,  # [M, K] blocks [BLOCK_M, BLOCK_K]
    gate_desc,  # [N, K] blocks [BLOCK_N, BLOCK_K]
    linear_desc,  # [N, K] blocks [BLOCK_N, BLOCK_K]
    out_desc,  # [M, N] blocks [BLOCK_M, BLOCK_N]
    M,
    N,
    K,
    SQRT_2_OVER_PI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # The same tiles through tensor-memory-access descriptors (Hopper's bulk copies; out-of-range
    # rows and columns read as zeros and are not stored).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_linear = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([off_m, step * BLOCK_K])
        g = gate_desc.load([off_n, step * BLOCK_K])
        lin = linear_desc.load([off_n, step * BLOCK_K])
        acc_gate = tl.dot(a, g.T, acc_gate)
        acc_linear = tl.dot(a, lin.T, acc_linear)
    inner = SQRT_2_OVER_PI * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
    out = acc_gate / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0))) * acc_linear
    out_desc.store([off_m, off_n], out.to(out_desc.dtype))


def geglu_supports(x: torch.Tensor, gate_weight: torch.Tensor, linear_weight: torch.Tensor) -> bool:
    """Whether `geglu_linear` serves this product: fp16/bf16 x (any leading dims, unit last stride)
    with two 2-D weights of x's dtype and device, one shape, x's feature count (a multiple of 16),
    unit column stride; on CUDA (or CPU under the Triton interpreter)."""
    tensors = (x, gate_weight, linear_weight)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or x.dim() < 1 or gate_weight.dim() != 2:
        return False
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        return False
    return (
        x.dtype in (torch.float16, torch.bfloat16) and all(t.dtype == x.dtype and t.device == x.device for t in tensors)
        and linear_weight.shape == gate_weight.shape and gate_weight.shape[1] == x.shape[-1]
        and x.shape[-1] % 16 == 0 and all(t.stride(-1) == 1 for t in tensors)
    )


def geglu_linear(x: torch.Tensor, gate_weight: torch.Tensor, linear_weight: torch.Tensor,
                 config: Optional[Config] = None) -> torch.Tensor:
    """gelu_tanh(x @ gate_weight.T) * (x @ linear_weight.T), the GELU applied to the float32 products.

    x: [..., K] fp16/bf16; gate_weight, linear_weight: [N, K] in x's dtype (e.g. `wi_0` and `wi_1`,
        rows of one packed tensor or not)
    config: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), or None: `geglu_config`'s (tuning)
    returns: [..., N] in x's dtype
    """
    check_float("x", x, x.dim())
    check_float("gate_weight", gate_weight, 2)
    check_float("linear_weight", linear_weight, 2)
    check_device("gate_weight", gate_weight, x.device)
    check_device("linear_weight", linear_weight, x.device)
    if not geglu_supports(x, gate_weight, linear_weight):
        raise ValueError(
            "geglu_linear takes fp16/bf16 x [..., K] (K a multiple of 16) and two [N, K] weights of x's dtype; "
            f"got x {tuple(x.shape)} {x.dtype}, gate_weight {tuple(gate_weight.shape)} {gate_weight.dtype}, "
            f"linear_weight {tuple(linear_weight.shape)} {linear_weight.dtype}"
        )
    N, K = gate_weight.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        bm, bn, bk, warps, stages = (config if config is not None else geglu_config(M, N, K))[:5]
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        if config is not None and len(config) > 5 and config[5] == "tma":
            from triton.tools.tensor_descriptor import TensorDescriptor

            _geglu_linear_tma_kernel[grid](
                TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(gate_weight, [bn, bk]),
                TensorDescriptor.from_tensor(linear_weight, [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
                M, N, K, SQRT_2_OVER_PI=math.sqrt(2.0 / math.pi), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            return out.reshape(*x.shape[:-1], N)
        _geglu_linear_kernel[grid](
            x2, gate_weight, linear_weight, out, M, N, K, x2.stride(0), gate_weight.stride(0), linear_weight.stride(0),
            SQRT_2_OVER_PI=math.sqrt(2.0 / math.pi), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
            EVEN_K=K % bk == 0, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], N)
