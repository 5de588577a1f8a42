"""T5's layer norm (RMS, no mean, no bias) in one kernel, optionally fused with the residual add.

HF's `T5LayerNorm` is ~6 kernels; inside a captured decode step each costs a launch slot,
and a layer has three norms. The arithmetic follows HF step by step so results match it:
variance in float32, `x * rsqrt(var + eps)` in float32, cast to the weight's dtype when that
is half precision, then `weight * x`.

The residual may come as float32 partial sums (`split_k.split_k_linear`'s K-slices of the
sub-layer's last projection): the kernel adds them in slice order and rounds the sum to the
activations' dtype, which is what the projection's own output would have been, then goes on as
with a residual tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fast_math
from ._checks import check_device, check_float, pdl_options


@triton.jit(do_not_specialize=["stride_residual_split"])  # rows x d_model: follows the batch
def _rms_norm_kernel(
    x_ptr, residual_ptr, sum_ptr, weight_ptr, out_ptr,
    stride_x_row, stride_residual_row, stride_residual_split, stride_sum_row, stride_out_row,
    d_model, eps,
    HAS_RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr,
    HALF_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d_model
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a weight: no earlier kernel writes it
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        if SPLITS:  # float32 partials of the sub-layer's output, summed in slice order, rounded once
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(residual_ptr + s * stride_residual_split + row * stride_residual_row + cols,
                               mask=mask, other=0.0)
            r = acc.to(x_ptr.dtype.element_ty)
        else:
            r = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        # Round the sum to the activations' dtype, as `hidden + out` does in HF.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / d_model
    normed = xf * fast_math.rsqrt(var + eps)
    if HALF_WEIGHT:
        normed = normed.to(weight_ptr.dtype.element_ty)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_warps(d_model: int) -> int:
    """Warps per row of `d_model` features."""
    return 4


def rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    pdl: bool = False,
    num_warps: Optional[int] = None,
    partials: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 layer norm of `hidden (+ residual)`.

    hidden: [..., d_model]; residual: same shape and dtype, or None; weight: [d_model]
    partials: instead of `residual`, float32 [S, ..., d_model] whose sum in slice order, rounded to
        hidden's dtype, is the residual (`split_k.split_k_linear`'s output)
    pdl: launch as a programmatic dependent launch (`launch.pdl_available`); ignored under the interpreter
    num_warps: warps per row, or None: `rms_norm_warps`' (tuning)
    returns: (normed [..., d_model] in HF's output dtype, the sum hidden + residual (or hidden))
    """
    check_float("hidden", hidden, hidden.dim())
    check_float("weight", weight, 1)
    check_device("weight", weight, hidden.device)
    d_model = hidden.shape[-1]
    if weight.shape[0] != d_model:
        raise ValueError(f"weight has {weight.shape[0]} entries but hidden's last dim is {d_model}")
    x = hidden.reshape(-1, d_model)
    half_weight = weight.dtype in (torch.float16, torch.bfloat16)
    # HF: `weight * hidden` promotes, so a float32 hidden with a half weight gives float32.
    out_dtype = torch.promote_types(weight.dtype, weight.dtype if half_weight else torch.float32)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    splits = 0
    if partials is not None:
        if residual is not None:
            raise ValueError("give the residual as `residual` or as `partials`, not both")
        check_float("partials", partials, hidden.dim() + 1)
        check_device("partials", partials, hidden.device)
        if partials.dtype != torch.float32 or partials.shape[1:] != hidden.shape or partials.shape[0] < 1:
            raise ValueError(f"partials {tuple(partials.shape)} {partials.dtype} must be float32 [S, "
                             f"*{tuple(hidden.shape)}] (split_k_linear's output for this hidden)")
        splits = partials.shape[0]
        r = partials.reshape(splits, -1, d_model)
        total = torch.empty_like(x)
    elif residual is not None:
        if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match hidden {tuple(hidden.shape)} {hidden.dtype}"
            )
        r = residual.reshape(-1, d_model)
        total = torch.empty_like(x)
    else:
        r, total = x, x
    if x.shape[0] == 0:
        return out.reshape(hidden.shape), total.reshape(hidden.shape)
    pdl, launch = pdl_options(pdl)
    _rms_norm_kernel[(x.shape[0],)](
        x, r, total, weight, out,
        x.stride(0), r.stride(-2), r.stride(0) if splits else 0, total.stride(0), out.stride(0),
        d_model, eps,
        HAS_RESIDUAL=residual is not None or splits > 0,
        SPLITS=splits,
        HALF_WEIGHT=half_weight,
        BLOCK=triton.next_power_of_2(d_model),
        PDL=pdl, num_warps=num_warps or rms_norm_warps(d_model), **launch,
    )
    return out.reshape(hidden.shape), total.reshape(hidden.shape)
