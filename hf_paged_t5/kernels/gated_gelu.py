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


@triton.jit(do_not_specialize=["n"])  # n follows the token count (see kernels/__init__.py)
def _gated_gelu_kernel(gate_ptr, linear_ptr, out_ptr, n, SQRT_2_OVER_PI: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(linear_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    # 0.5 * (1 + tanh(z)) = 1 / (1 + exp(-2z)): no cancellation in the negative tail, where
    # 1 + tanh(z) loses most of its digits; exp's argument capped below float32's overflow
    out = x / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0))) * y
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_gelu(gate: torch.Tensor, linear: torch.Tensor, config: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """gelu_tanh(gate) * linear, elementwise, in gate's dtype (as HF's `hidden_gelu * hidden_linear`).

    gate, linear: the same shape, dtype and device (any layout: made contiguous)
    config: (elements per program, a power of two; warps), or None: `gated_gelu_config`'s (tuning)
    """
    check_float("gate", gate, gate.dim())
    check_float("linear", linear, linear.dim())
    check_device("linear", linear, gate.device)
    if gate.shape != linear.shape or gate.dtype != linear.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and linear {tuple(linear.shape)} {linear.dtype} "
                         "must have one shape and dtype")
    gate, linear = gate.contiguous(), linear.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block, warps = config if config is not None else gated_gelu_config(n)
        _gated_gelu_kernel[(triton.cdiv(n, block),)](gate, linear, out, n, SQRT_2_OVER_PI=math.sqrt(2.0 / math.pi),
                                                     BLOCK=block, num_warps=warps)
    return out
