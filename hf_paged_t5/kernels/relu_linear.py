"""`relu_linear`: `relu(x @ W.T)` as one cuBLASLt GEMM with a ReLU epilogue.

T5's feed-forward (t5-small to t5-11b, not the gated v1.1 family) is `wo(relu(wi(x)))`. With
more rows than `gemv` serves, `wi` runs on cuBLAS and the ReLU was a pointwise kernel of its
own: one more launch per decoder layer in a decode step's graph (a dependent stage of ~2 us),
and one more pass over the encoder's [tokens, d_ff] intermediate. cuBLASLt applies the ReLU
to the accumulator before it rounds and stores (`torch._addmm_activation` with a zero bias, the
epilogue PyTorch itself uses for `Linear` + ReLU under `torch.compile`).

The result: ReLU commutes with rounding to the output dtype (it keeps or zeroes each value), so
the epilogue gives `relu(linear(x, W))` of whatever GEMM cuBLASLt picks; the GEMM's own
algorithm may differ from `F.linear`'s (another tile or split order: bf16 roundings of sums).
Half precision on CUDA only: float32 keeps HF's own ops so float32 tokens stay HF's bit for bit,
and one row stays with `gemv` (PyTorch takes the epilogue only for more than one row).
"""

from __future__ import annotations

import functools

import torch

from ._checks import check_device, check_float


@functools.lru_cache(maxsize=None)
def _zero_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero bias per (features, dtype, device): cuBLASLt's ReLU epilogue comes with a bias add.
    (Made at a layer's first call, which runs eagerly before any graph of it is captured.)"""
    return torch.zeros(n, dtype=dtype, device=device)


def relu_linear_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `relu_linear` serves this product: more than one row of fp16/bf16 x on CUDA and a
    2-D weight of x's dtype and device with x's feature count."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() < 2 or weight.dim() != 2:
        return False
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.device == x.device and weight.shape[1] == x.shape[-1] and x.numel() // max(1, x.shape[-1]) > 1)


def relu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """relu(x @ weight.T), the ReLU in the GEMM's epilogue.

    x: [..., K] fp16/bf16 on CUDA, more than one row; weight: [N, K] in x's dtype
    returns: [..., N] in x's dtype
    """
    check_float("x", x, x.dim())
    check_float("weight", weight, 2)
    check_device("weight", weight, x.device)
    if not relu_linear_supports(x, weight):
        raise ValueError(
            "relu_linear serves more than one row of fp16/bf16 x on CUDA with a [N, K] weight of x's dtype and "
            f"K features; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    out = torch._addmm_activation(_zero_bias(N, x.dtype, x.device), x2, weight.t(), use_gelu=False)
    return out.reshape(*x.shape[:-1], N)
