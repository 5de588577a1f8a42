"""The gated feed-forward's middle, `gelu_tanh(gate) * linear`, in one kernel.

T5 v1.1 / mT5 / UMT5 (`T5DenseGatedActDense` with `gelu_new`) compute it as ~9 elementwise
kernels over a [tokens, d_ff] tensor (pow, mul, add, mul, tanh, add, mul, mul, mul), each
rounding to the activations' dtype; one T5 v1.1 XXL encoder forward of 512 tokens spends ~1.4 ms
of an H200 on them (bench_encoder.py --profile). Here each element is read once, computed in
float32 and rounded once: HF's `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))` as
`x / (1 + exp(-2 * sqrt(2 / pi) * (x + 0.044715 * x^3)))`, the same function without the
cancellation of `1 + tanh` for negative x.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_float


def gated_gelu_config(n: int) -> tuple[int, int]:
    """(elements per program, warps) for n elements: two to four per thread. H200
    (`benchmarks/tune_pointwise.py`, 2026-12-03, T5 v1.1 XXL's d_ff 10240, bf16, in a CUDA graph):
    512 tokens 11.5 µs (2,048 elements on 8 warps: 17.9), 77 tokens 3.1 µs (4.1)."""
    return 512, (8 if n >= 1 << 21 else 4)


@triton.jit(do_not_specialize=["rows"])  # rows follows the token count (see kernels/__init__.py)
def _gated_gelu_kernel(
    gate_ptr,  # [rows, cols], unit column stride
    linear_ptr,  # [rows, cols], unit column stride
    out_ptr,  # [rows, cols] contiguous
    rows,
    cols,
    stride_gate_row,
    stride_linear_row,
    SQRT_2_OVER_PI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per BLOCK columns of a row: a packed projection's output (gate and linear as
    # the two halves of each row) is read in place, with no index division per element.
    row = tl.program_id(0).to(tl.int64)
    cols_here = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols_here < cols
    x = tl.load(gate_ptr + row * stride_gate_row + cols_here, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(linear_ptr + row * stride_linear_row + cols_here, mask=mask, other=0.0).to(tl.float32)
    inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    # 0.5 * (1 + tanh(z)) = 1 / (1 + exp(-2z)): no cancellation in the negative tail, where
    # 1 + tanh(z) loses most of its digits; exp's argument capped below float32's overflow
    out = x / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0))) * y
    tl.store(out_ptr + row * cols + cols_here, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (last dim contiguous) as [rows, last dim]: a view where its leading dims are one
    stride apart (a column slice of a wider output), else a copy."""
    if tensor.dim() == 2:
        return tensor
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return tensor.reshape(-1, tensor.shape[-1])


def gated_gelu(gate: torch.Tensor, linear: torch.Tensor, config: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """gelu_tanh(gate) * linear, elementwise, in gate's dtype (as HF's `hidden_gelu * hidden_linear`).

    gate, linear: the same shape, dtype and device, last dim contiguous (rows of any stride, e.g.
        the two halves of a packed [tokens, 2 * d_ff] projection, are read in place)
    config: (elements per program, a power of two; warps), or None: `gated_gelu_config`'s (tuning)
    returns: a contiguous tensor of gate's shape
    """
    check_float("gate", gate, gate.dim())
    check_float("linear", linear, linear.dim())
    check_device("linear", linear, gate.device)
    if gate.shape != linear.shape or gate.dtype != linear.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and linear {tuple(linear.shape)} {linear.dtype} "
                         "must have one shape and dtype")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        gate_rows, linear_rows = _as_rows(gate), _as_rows(linear)
        rows, cols = gate_rows.shape
        block, warps = config if config is not None else gated_gelu_config(n)
        block = min(block, triton.next_power_of_2(cols))
        _gated_gelu_kernel[(rows, triton.cdiv(cols, block))](
            gate_rows, linear_rows, out, rows, cols, gate_rows.stride(0), linear_rows.stride(0),
            SQRT_2_OVER_PI=math.sqrt(2.0 / math.pi), BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return out
