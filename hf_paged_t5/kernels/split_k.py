"""`split_k_linear`: x @ W.T as float32 partial products over equal slices of K, left for the
next add + RMSNorm kernel to sum (`rms_norm(partials=...)`).

An op-by-op decode step runs the feed-forward's `wo` ([rows, d_ff] @ [d_ff, d_model]) at 16-512
rows as one cuBLAS GEMM; with few rows cuBLAS splits the long K itself and finishes with a
`splitKreduce` kernel of its own, and the next layer norm (which adds the residual) is a third
launch: three dependent stages for one product. Here one batched GEMM
(`torch.bmm(..., out_dtype=torch.float32)` over SPLITS strided K-slices, no copies) writes the
partial products and the norm kernel sums them in slice order, rounds the sum to the
activations' dtype (the GEMM's own output dtype) and adds the residual: two stages, the same
arithmetic as cuBLAS's split-K (float32 partials, one rounding).

Measured with `benchmarks/diag_wo_partials.py` (24 layers in one CUDA graph, H100 80GB, torch
2.11, 2026-12-07): t5-large at 64 rows 9.37 us a layer against cuBLAS + norm's 11.98, flan-t5-xl
13.64 against 15.94 (two slices; four and eight were slower), at the same error against float64.
Served up to MAX_ROWS rows, where cuBLAS splits K itself (its reduce is the launch saved): with
the partials at up to 512 rows a batch job, whose graphed steps run at 64-512 rows, ran 1.5% and
5.2% slower in two rounds (`benchmarks/ab_batch.py --shapes t5-large --beams 1`), though the
isolated layers were faster at 512 rows too; up to 128 rows its median over 8 processes was within
the processes' spread of the job without partials. Attention's `o` (K = d_model) gained nothing
this way: cuBLAS does not split that K (docs/performance.md).
Half precision on CUDA only: float32 keeps HF's own ops so float32 tokens stay HF's bit for bit.
"""

from __future__ import annotations

import torch

from ._checks import check_device, check_float

SPLITS = 2  # K-slices (partials) a product is split into
# the most rows served: on an H100 cuBLAS splits K itself up to 128 rows (t5-large), 64 (flan-t5-xl)
MAX_ROWS = 128


def _mixed_bmm_on_cuda() -> bool:
    """Whether this torch has a CUDA kernel for `bmm` of half-precision operands into float32
    (`aten::bmm.dtype`); read from the dispatcher, nothing runs (safe under graph capture)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::bmm.dtype", "CUDA"))
    except (AttributeError, RuntimeError):
        return False


MIXED_BMM = _mixed_bmm_on_cuda()


def split_k_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `split_k_linear` serves this product: 2 to MAX_ROWS rows of fp16/bf16 x on CUDA, a
    contiguous [N, K] weight of x's dtype and device whose K splits into SPLITS slices of a multiple
    of 8 elements (16-byte aligned slices), and a torch with the mixed-dtype batched GEMM."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return False
    if x.dim() < 2 or weight.dim() != 2:
        return False
    K = weight.shape[1]
    rows = x.numel() // max(1, x.shape[-1])
    return (
        MIXED_BMM and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
        and weight.device == x.device and weight.is_contiguous() and x.shape[-1] == K
        and K % (8 * SPLITS) == 0 and 1 < rows <= MAX_ROWS
    )


def split_k_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The partial products of x @ weight.T over SPLITS equal slices of K, in float32.

    x: [..., K] fp16/bf16 on CUDA, 2 to MAX_ROWS rows; weight: [N, K] contiguous, x's dtype
    returns: [SPLITS, ..., N] float32; their sum in slice order is x @ weight.T before rounding
    """
    check_float("x", x, x.dim())
    check_float("weight", weight, 2)
    check_device("weight", weight, x.device)
    if not split_k_supports(x, weight):
        raise ValueError(
            f"split_k_linear serves 2 to {MAX_ROWS} rows of fp16/bf16 x on CUDA with a contiguous [N, K] "
            f"weight of x's dtype, K a multiple of {8 * SPLITS}, and a torch whose bmm takes out_dtype on "
            f"CUDA; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} "
            f"{weight.dtype} (use F.linear for other products)"
        )
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    rows = x2.shape[0]
    xs = x2.view(rows, SPLITS, K // SPLITS).transpose(0, 1)  # [S, rows, K / S]
    ws = weight.view(N, SPLITS, K // SPLITS).permute(1, 2, 0)  # [S, K / S, N]
    return torch.bmm(xs, ws, out_dtype=torch.float32).view(SPLITS, *x.shape[:-1], N)
