"""The fused T5 layer-norm kernel against the reference (HF's T5LayerNorm, step for step)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5LayerNorm

from hf_paged_t5 import kernels, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 50), (2, 5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    r = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE) if with_residual else None
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEVICE)
    out, total = kernels.rms_norm(hidden=x, weight=w, eps=1e-6, residual=r)
    ref_out, ref_total = reference.rms_norm(hidden=x, weight=w, eps=1e-6, residual=r)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)  # the sum is rounded like torch's add
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


def test_reference_is_hf_layer_norm():
    ln = T5LayerNorm(48, eps=1e-6)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 48) * 5
    assert torch.equal(reference.rms_norm(hidden=x, weight=ln.weight, eps=1e-6)[0], ln(x))


def test_rms_norm_rejects_mismatched_weight():
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight has 8 entries"):
        kernels.rms_norm(hidden=x, weight=torch.ones(8, device=DEVICE), eps=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 50), (2, 5, 100)])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_rms_norm_sums_float32_partials_as_the_reference(dtype, shape, splits):
    """`partials` (split_k_linear's float32 K-slices) as the residual: the sum is bit for bit the
    reference's (the partials added in slice order, rounded once, then added to hidden); the norm
    as with a residual tensor."""
    g = torch.Generator().manual_seed(splits)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    parts = (torch.randn((splits,) + shape, generator=g) * 2).to(DEVICE)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEVICE)
    out, total = kernels.rms_norm(hidden=x, weight=w, eps=1e-6, partials=parts)
    ref_out, ref_total = reference.rms_norm(hidden=x, weight=w, eps=1e-6, partials=parts)
    assert total.dtype == dtype and out.shape == ref_out.shape
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    summed = parts[0].clone()
    for part in parts[1:]:
        summed += part
    assert torch.equal(ref_total, x + summed.to(dtype))


def test_rms_norm_rejects_partials_it_cannot_sum():
    x = torch.randn(3, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="not both"):
        kernels.rms_norm(hidden=x, weight=w, eps=1e-6, residual=x,
                         partials=torch.zeros(2, 3, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"must be float32 \[S, \*\(3, 16\)\]"):
        kernels.rms_norm(hidden=x, weight=w, eps=1e-6, partials=torch.zeros(2, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="must be float32"):
        kernels.rms_norm(hidden=x, weight=w, eps=1e-6, partials=torch.zeros(2, 3, 16, device=DEVICE).half())
    with pytest.raises(ValueError, match="must have 3 dims"):
        kernels.rms_norm(hidden=x, weight=w, eps=1e-6, partials=torch.zeros(3, 16, device=DEVICE))
